"""The decoder report's newer fields in headless Chromium (issue 34 §8): a payload in every string of
detected_heads.csv/.json, of a language-model loss ablation table, of the runs and results given to --include and of
the reasons why another model's results are not shown runs no script; and the example maps' column labels stay above
the map (issue 35 §6). Skipped where Chromium, chromedriver or selenium is missing, as tests/test_report_browser.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from attnkit.analysis.report import build_report

from .synthetic import rich_run
from .test_report_browser import BROWSER, DRIVER, _open, chromium
from .test_report_safety import PAYLOADS, P, assert_inert

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
pytestmark = pytest.mark.skipif(BROWSER is None or DRIVER is None,
                                reason="no chromium/chromedriver (apt-get install -y chromium chromium-driver)")

# a directory name cannot hold "/": the payloads that need none
DIR = PAYLOADS[0] + PAYLOADS[2]


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


def _write(path, obj) -> None:
    path.write_text(json.dumps(obj))


def _identity(name: str) -> dict:
    return {"name": name, "path": None, "model_type": "llama", "n_layers": 3, "n_heads": 4,
            "config_sha256": "a" * 64}


def _detections(d, model: str, kinds=("previous", "duplicate", "induction", "retrieval")) -> None:
    rng = np.random.default_rng(1)
    rows = ["layer,head," + ",".join(kinds)] + [f"{l},{h}," + ",".join(f"{rng.random():.3f}" for _ in kinds)
                                               for l in range(3) for h in range(4)]
    (d / "detected_heads.csv").write_text("\n".join(rows) + "\n")
    _write(d / "detected_heads.json", {"model": model, "model_type": "llama", "model_identity": _identity(model),
                                       "kinds": list(kinds), "length": 8, "n_sequences": 4, "seed": 0, "bos": 1,
                                       "corpus": "/data/" + P, "n_layers": 3, "n_heads": 4, "seconds": 1.0})


def _loss_ablation(d, model: str, experiment: str = "layers") -> None:
    grid = [(l, None) for l in range(3)] if experiment == "layers" else [(l, h) for l in range(3) for h in range(4)]
    rows = [{"setting": P, "layer": None, "head": None, "loss": 3.0, "note": P}] + [
        {"setting": P + f" {l} {h}", "layer": l, "head": h, "loss": 3.0 + 0.1 * l, "delta_loss": 0.1 * l + 0.05,
         "delta_loss_lo": 0.1 * l, "delta_loss_hi": 0.1 * l + 0.1, P: P} for l, h in grid]
    _write(d / f"{experiment}.json", {"experiment": experiment, "main_metric": "loss", "rows": rows})
    _write(d / f"{experiment}.meta.json", {"experiment": experiment, "model": model, "task": P, "mode": P,
                                           "model_identity": _identity(model), P: P})


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A decoder run whose model is named P, with its detected heads and a loss ablation, a run of the other
    weighting in a directory whose name is a payload, and another model's detections and ablation, included."""
    from attnkit.run import HeadFeatures

    root = tmp_path_factory.mktemp("poison")
    run = root / "run"
    f, *_ = rich_run(run, n_samples=8)
    meta = json.loads((run / "meta.json").read_text())
    meta.update(model=P, model_type="llama", model_identity=_identity(P), corpus=P)
    _write(run / "meta.json", meta)
    # clustered again as the decoder run it now is (its types are named from a decoder's class shares)
    from attnkit.analysis.clustering import cluster
    from attnkit.analysis.results import save_clusters

    decoder_run = HeadFeatures.load(run)
    save_clusters(run, cluster(decoder_run, k=4, n_stability=3), decoder_run)
    clusters = json.loads((run / "clusters.json").read_text())
    clusters["run"]["model"] = P
    _write(run / "clusters.json", clusters)
    for name in ("probe.json", "heads.meta.json"):
        data = json.loads((run / name).read_text())
        _write(run / name, {**data, "model": P, "model_identity": _identity(P)})
    _detections(run, P)
    _loss_ablation(run, P)
    norm = root / DIR
    HeadFeatures(f.mean * 0.5, f.std, f.names, f.n_samples, f.n_tokens, {**meta, "weighting": "norm"}).save(norm)
    other = root / (DIR + " other")
    other.mkdir()
    _detections(other, P + " other")
    _loss_ablation(other, P + " other", "heads")
    page = build_report(run, svg=False, do_sweep=False, include=[norm, other])
    return page, run


def test_no_script_from_the_decoder_fields_or_the_included_runs_runs(browser, poisoned):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.support.ui import Select

    page, run = poisoned
    text = page.read_text()
    data = assert_inert(text)
    for p in PAYLOADS[:3]:
        assert p not in text  # not one payload in the markup as written
    # what the page shows of each poisoned file: the loss ablation, the detections, the other weighting's run and
    # the reasons why another model's results are not shown
    assert data["detected"]["kinds"] == ["previous", "duplicate", "induction", "retrieval"]
    assert [a["source"] for a in data["ablation"]] == ["heads.json", "layers.json"]
    assert data["ablation"][1]["metric"] == "loss (higher is worse)"
    _open(browser, page)
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    shown = PAYLOADS[0] + PAYLOADS[1] + PAYLOADS[2]  # (the browser shows U+2028 and U+2029 as line breaks)
    findings = browser.find_element("id", "findings").text
    assert "disabling layer 2 alone raises loss the most" in findings
    assert f"{DIR} (norm)" in findings or DIR in findings  # the other weighting's run, named as text
    elsewhere = browser.find_element("id", "elsewhere").text
    assert f"{DIR} other/heads.meta.json" in elsewhere and f"made with the model {shown}" in elsewhere
    assert f"{DIR} other/detected_heads.json" in elsewhere
    ablation = browser.find_element("id", "ablation").text
    assert shown in ablation and "From layers.json" in ablation  # the task and the settings, as text
    for head in ("L0H1", "L2H3"):
        browser.find_element("css selector", f'#grid td[data-head="{head}"]').click()
    colour = Select(browser.find_element("id", "grid-colour"))
    for value in ("detected:retrieval", "detected:induction"):
        colour.select_by_value(value)
        browser.find_element("css selector", '#grid td[data-head="L1H2"]').click()
    panel = browser.find_element("id", "panel").text
    assert "layers (layers.json)" in panel and "retrieval" in panel
    for th in browser.find_elements("css selector", "table.sortable thead th")[:5]:
        th.click()
    with pytest.raises(NoAlertPresentException):
        _ = browser.switch_to.alert.text
    assert browser.execute_script("return window.pwned === undefined")


@pytest.fixture(scope="module")
def blank_maps_report(tmp_path_factory):
    """Example maps of no weight at all (every cell white), with tokens of various lengths."""
    import attnkit.jobs.maps as maps_module

    run = tmp_path_factory.mktemp("blank") / "run"
    rich_run(run, n_samples=8)
    tokens = ["[CLS]", "the", "Ġattention", "of", "a", "considerably", ".", "[SEP]"]

    def blank(text, model, max_length=64):
        n = len(tokens)
        return maps_module.AttentionMaps(text, tokens, np.zeros((3, 4, n, n), dtype=np.float32))

    real = maps_module.attention_maps
    maps_module.attention_maps = blank
    try:
        tok = lambda *parts, **kw: {"input_ids": list(range(8))}
        page = build_report(run, svg=False, do_sweep=False, examples=1, texts=["x"], model=(object(), tok))
    finally:
        maps_module.attention_maps = real
    return page, len(tokens)


def test_the_column_labels_of_a_map_stay_above_it(browser, blank_maps_report):
    """Drawn on a map with no weight, every cell of the map stays white: no label covers a row; and every column
    has its label above the map."""
    page, n = blank_maps_report
    _open(browser, page, "L1H2")
    canvas = browser.find_element("css selector", "#panel canvas.map")
    got = browser.execute_script(
        "var c = arguments[0], pad = +c.getAttribute('data-pad'), n = +c.getAttribute('data-n');"
        "var cell = Math.max(4, Math.min(14, Math.floor(420 / n))), g = c.getContext('2d');"
        "var map = g.getImageData(pad, pad, n * cell, n * cell).data, inked = 0;"
        "for (var i = 0; i < map.length; i += 4) if (map[i] < 250 || map[i + 1] < 250 || map[i + 2] < 250) inked++;"
        "var above = [];"
        "for (var j = 0; j < n; j++) { var col = g.getImageData(pad + j * cell, 0, cell, pad).data, k = 0;"
        "  for (var i = 0; i < col.length; i += 4) if (col[i] < 200) k++; above.push(k); }"
        "return [n, inked, above];", canvas)
    assert got[0] == n
    assert got[1] == 0  # no pixel of a label on the map's cells
    assert all(k > 0 for k in got[2])  # each column's label is drawn, above the map
