"""The report in a real browser (headless Chromium driven by Selenium): click a head in the grid and read its
panel; sort a table; colour the grid by a feature. Skipped where Chromium, chromedriver or selenium is missing
(`apt-get install -y chromium chromium-driver`, `pip install -e ".[test]"`)."""
import csv
import json
import os
import shutil
import tempfile
import weakref

import numpy as np
import pytest

from attnkit.analysis.report import build_report

from .synthetic import rich_run

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
pytestmark = pytest.mark.skipif(BROWSER is None or DRIVER is None,
                                reason="no chromium/chromedriver (apt-get install -y chromium chromium-driver)")


def chromium():
    """A headless Chromium driven by Selenium (quit it when done). Its temporary files go to a directory of its
    own, removed with the driver: Chromium leaves one in TMPDIR after every session, and they piled up in /tmp. (A
    short path: Chromium's socket there must fit a Unix socket's 108 bytes, which pytest's tmp_path may not.)"""
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,2000"):
        opts.add_argument(flag)
    opts.binary_location = BROWSER
    scratch = tempfile.mkdtemp(prefix="attnkit-chromium-")
    try:
        driver = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER,
                                                                env={**os.environ, "TMPDIR": scratch}))
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    weakref.finalize(driver, shutil.rmtree, scratch, True)
    return driver


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run = tmp_path_factory.mktemp("browser") / "run"
    f, per, texts, dist = rich_run(run)
    rows = [{"setting": "baseline", "layer": None, "spearman": 80.0}] + [
        {"setting": f"L{l} zero", "layer": l, "spearman": 80 - l, "delta_spearman": -1.0 - l,
         "delta_spearman_lo": -1.5 - l, "delta_spearman_hi": -0.5 - l} for l in range(f.n_layers)]
    (run / "layers.json").write_text(json.dumps({"experiment": "layers", "main_metric": "spearman", "rows": rows}))
    (run / "layers.meta.json").write_text(json.dumps({"experiment": "layers", "model": "synthetic", "task": "stsb"}))
    return build_report(run, svg=False), f, per, texts


def _panel_rows(driver, css):
    return [[td.text for td in tr.find_elements("css selector", "td")]
            for tr in driver.find_elements("css selector", f"#panel table.{css} tbody tr")]


def test_clicking_a_head_shows_its_panel(browser, report):
    page, f, per, texts = report
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(page.as_uri())
    WebDriverWait(browser, 20).until(lambda d: d.find_element("id", "panel").get_attribute("data-head") == "L0H0")
    browser.find_element("css selector", '#grid td[data-head="L2H3"]').click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element("id", "panel").get_attribute("data-head") == "L2H3")
    assert browser.find_element("id", "panel-title").text.startswith("L2H3 · layer 2, head 3")
    assert browser.execute_script("return location.hash") == "#L2H3"
    assert "selected" in browser.find_element("css selector", '#grid td[data-head="L2H3"]').get_attribute("class")
    # its features with their spread
    feats = {r[0]: r[1:3] for r in _panel_rows(browser, "panel-table") if len(r) == 4}
    for n in ("cls", "sep", "entropy", "win_3"):
        j = f.names.index(n)
        assert feats[n] == [f"{f.mean[2, 3, j]:.3f}", f"{f.std[2, 3, j]:.3f}"]
    # its type, as clusters.json says
    run = page.parent
    head = next(h for h in json.loads((run / "clusters.json").read_text())["heads"] if (h["layer"], h["head"]) == (2, 3))
    assert f"type {head['type']}" in browser.find_element("css selector", "#panel p.type").text
    # its top examples for a chosen feature, with their texts
    Select(browser.find_element("id", "example-feature")).select_by_value("entropy")
    top = _panel_rows(browser, "examples-top")
    col = per[:, 2, 3, f.names.index("entropy")]
    want = np.argsort(-col, kind="stable")[:3]
    assert [int(r[0]) for r in top] == list(want)
    assert [r[2] for r in top] == [texts[i] for i in want]
    # probe accuracy per relation over the baseline, best first
    best = {}
    for r in csv.DictReader(open(run / "probe.csv")):
        if (int(r["layer"]), int(r["head"])) == (2, 3):
            gain = float(r["accuracy"]) - float(r["baseline_accuracy"])
            best[r["relation"]] = max(best.get(r["relation"], -9), gain)
    probe = _panel_rows(browser, "probe")
    assert probe[0][0] == max(best, key=best.get) and probe[0][3] == f"{max(best.values()):+.3f}"
    # pattern shares and the ablation effect
    shares = json.loads((run / "patterns.json").read_text())["per_head"]
    assert [r[1] for r in _panel_rows(browser, "patterns")] == [f"{100 * shares[c][2][3]:.1f}%" for c in shares]
    delta = next(r for r in json.loads((run / "heads.json").read_text())["rows"][1:] if (r["layer"], r["head"]) == (2, 3))
    assert f"{delta['delta_spearman']:+.2f}" in _panel_rows(browser, "ablation")[0][1]
    # a nearest head is a link that selects it
    browser.find_element("css selector", "#panel a.head").click()
    assert browser.find_element("id", "panel").get_attribute("data-head") != "L2H3"


def test_tables_sort_and_the_grid_colours_by_a_feature(browser, report):
    page, f, *_ = report
    from selenium.webdriver.support.ui import Select

    browser.get("about:blank")
    browser.get(page.as_uri() + "#L1H1")
    assert browser.find_element("id", "panel").get_attribute("data-head") == "L1H1"  # the address keeps the head
    browser.execute_script("document.querySelectorAll('#tables details').forEach(d => d.open = true)")
    table = browser.find_element("css selector", "#tables table.sortable")
    header = [th.text.rstrip(" ⇅▲▼?") for th in table.find_elements("css selector", "thead th")]
    col = header.index("sep")
    th = table.find_elements("css selector", "thead th")[col]
    th.click()
    values = [float(tr.find_elements("css selector", "td")[col].text)
              for tr in table.find_elements("css selector", "tbody tr")]
    assert values == sorted(values) and len(values) == f.n_layers * f.n_heads
    th.click()
    values = [float(tr.find_elements("css selector", "td")[col].text)
              for tr in table.find_elements("css selector", "tbody tr")]
    assert values == sorted(values, reverse=True)
    Select(browser.find_element("id", "grid-colour")).select_by_value("sep")
    cell = browser.find_element("css selector", '#grid td[data-head="L2H1"]')
    assert cell.text == f"{f.mean[2, 1, f.names.index('sep')]:.2f}"


# --- issue 30 §3: the panel in the page's flow, labels, legend, bars, layer ablations, the head view -------------
def _open(browser, page, head="L0H0"):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get("about:blank")
    browser.get(page.as_uri() + f"#{head}")
    WebDriverWait(browser, 20).until(lambda d: d.find_element("id", "panel").get_attribute("data-head") == head)


def test_the_panel_is_in_the_pages_flow_and_the_legend_follows_the_colouring(browser, report):
    page, f, *_ = report
    from selenium.webdriver.support.ui import Select

    _open(browser, page)
    style = browser.execute_script("var s = getComputedStyle(document.getElementById('panel'));"
                                   "return [s.overflowY, s.maxHeight];")
    assert style == ["visible", "none"]  # no scroll box of its own: its parts follow in the page
    grid_bottom = browser.execute_script("return document.getElementById('grid').getBoundingClientRect().bottom")
    panel_top = browser.execute_script("return document.getElementById('panel').getBoundingClientRect().top")
    assert panel_top >= grid_bottom
    legend = browser.find_element("id", "type-legend")
    assert legend.is_displayed()
    Select(browser.find_element("id", "grid-colour")).select_by_value("entropy")
    assert not legend.is_displayed() and "entropy: white" in browser.find_element("id", "grid-legend").text
    Select(browser.find_element("id", "grid-colour")).select_by_value("type")
    assert legend.is_displayed()


def test_bars_scale_each_feature_by_its_meaning(browser, report):
    page, f, *_ = report
    import math

    _open(browser, page, "L1H2")
    widths = browser.execute_script(
        "var out = {}; document.querySelectorAll('#panel table.panel-table tbody tr').forEach(function (tr) {"
        " var b = tr.querySelector('span.bar'); if (b) out[tr.cells[0].textContent] = parseFloat(b.style.width); });"
        " return out;")
    ln_n = math.log(f.n_tokens / f.n_samples)
    assert widths["entropy"] == pytest.approx(60 * min(1.0, f.mean[1, 2, f.names.index("entropy")] / ln_n), abs=0.05)
    assert widths["sep"] == pytest.approx(60 * f.mean[1, 2, f.names.index("sep")], abs=0.05)


def test_a_heads_panel_shows_its_layers_ablation(browser, report):
    page, f, *_ = report
    _open(browser, page, "L2H1")
    rows = _panel_rows(browser, "ablation")
    layers = json.loads((page.parent / "layers.json").read_text())["rows"]
    d = next(r for r in layers if r.get("layer") == 2)["delta_spearman"]
    assert rows[1][0] == "layers (layers.json)" and f"when its layer 2 is disabled: {d:+.2f}" in rows[1][1]


@pytest.fixture(scope="module")
def examples_report(tmp_path_factory):
    from .synthetic import WORDS, tiny_bert

    run = tmp_path_factory.mktemp("examples") / "run"
    rich_run(run, n_samples=8)
    model, tok = tiny_bert(n_layers=3, n_heads=4)
    texts = [" ".join(WORDS[i:i + 3 + i % 7]) + " ." for i in range(12)]
    page = build_report(run, svg=False, do_sweep=False, examples=3, texts=texts, model=(model, tok))
    return page, texts, (model, tok)


def test_clicking_a_token_shows_where_the_head_attends(browser, examples_report):
    from selenium.webdriver.support.ui import Select

    from attnkit.jobs.maps import attention_maps

    page, texts, model = examples_report
    _open(browser, page)
    shortest = sorted(range(len(texts)), key=lambda i: (len(model[1](texts[i])["input_ids"]), i))[:3]
    options = [o.text for o in Select(browser.find_element("id", "hv-text")).options]
    assert len(options) == 3
    Select(browser.find_element("id", "hv-layer")).select_by_value("1")
    Select(browser.find_element("id", "hv-head")).select_by_value("2")
    maps = attention_maps(texts[shortest[0]], model, max_length=64)
    w = maps.head(1, 2)
    tol = w.max() / 255 + 1e-4  # 8-bit maps scaled to the head's largest weight

    def drawn():
        return [(int(e.get_attribute("data-q")), int(e.get_attribute("data-k")), float(e.get_attribute("data-w")))
                for e in browser.find_elements("css selector", "#hv-draw line")]

    def check(lines, rows, cut):  # exactly the links of `rows` of at least `cut`, with their weights
        assert all(q in rows and abs(v - w[q, k]) <= tol and w[q, k] >= cut - tol for q, k, v in lines)
        assert {(q, k) for q in rows for k in range(len(w)) if w[q, k] >= cut + tol} <= {x[:2] for x in lines}

    before = drawn()
    check(before, range(len(w)), 0.1)
    assert len({q for q, _, _ in before}) > 1
    token = browser.find_element("css selector", '#hv-draw text.tok-q[data-i="2"]')
    assert token.text == maps.tokens[2]
    token.click()
    after = drawn()
    assert after != before and {q for q, _, _ in after} == {2}
    assert browser.find_element("css selector", "#hv-draw svg").get_attribute("data-from") == "2"
    check(after, [2], 0.01)
    # all heads of the layer: one colour per head, each head's links from the token
    Select(browser.find_element("id", "hv-head")).select_by_value("all")
    heads = {int(e.get_attribute("data-h")) for e in browser.find_elements("css selector", "#hv-draw line")}
    assert heads == {h for h in range(4) if maps.head(1, h)[2].max() >= 0.01}


def test_map_labels_are_not_clipped(browser, examples_report):
    page, *_ = examples_report
    _open(browser, page, "L0H1")
    canvases = browser.find_elements("css selector", "#panel canvas.map")
    assert len(canvases) == 3
    for c in canvases:
        fits = browser.execute_script(
            "var c = arguments[0], g = c.getContext('2d'), pad = +c.getAttribute('data-pad'), n = +c.getAttribute('data-n');"
            "var cell = Math.max(4, Math.min(14, Math.floor(420 / n)));"
            "g.font = Math.min(10, cell) + 'px sans-serif';"
            "return [pad, Math.max.apply(null, ['[CLS]', '[SEP]'].map(function (t) { return g.measureText(t).width; }))];",
            c)
        assert fits[0] - 3 >= fits[1]  # the longest label fits in the margin


@pytest.fixture(scope="module")
def pruned_report(tmp_path_factory):
    from .synthetic import pruned_run

    run = tmp_path_factory.mktemp("pruned") / "run"
    pruned_run(run, n_samples=8)
    return build_report(run, svg=False, do_sweep=False)


def test_removed_heads_are_greyed_out_in_the_grid(browser, pruned_report):
    from selenium.webdriver.support.ui import Select

    _open(browser, pruned_report)
    cell = browser.find_element("css selector", '#grid td[data-head="L1H2"]')
    assert "removed" in cell.get_attribute("class") and cell.text == "×"
    Select(browser.find_element("id", "grid-colour")).select_by_value("sep")
    assert cell.text == "×" and "removed" in cell.get_attribute("class")
    cell.click()
    assert browser.find_element("id", "panel").get_attribute("data-head") == "L1H2"
    assert "removed from the model" in browser.find_element("css selector", "#panel p.removed-note").text
    assert not browser.find_elements("css selector", "#panel table")


def test_no_script_from_a_file_runs(browser, tmp_path):
    """Payloads in every field that reaches the page, and in the example tokens: no alert fires, nothing they carry
    runs while the reader clicks through the grid, the panels, the tables and the head view."""
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.support.ui import Select

    from .test_report_safety import FIELDS, PAYLOADS, P

    run = tmp_path / "run"
    rich_run(run, n_samples=8)
    for field, inject in FIELDS.items():
        if field != "clusters.json sweep type_names":
            inject(run, P)
    import attnkit.jobs.maps as maps_module

    def fake_maps(text, model, max_length=64):
        toks = ["[CLS]", PAYLOADS[1], PAYLOADS[0], PAYLOADS[2], "[SEP]"]
        return maps_module.AttentionMaps(text, toks, np.full((3, 4, 5, 5), 0.2, dtype=np.float32))

    real = maps_module.attention_maps
    maps_module.attention_maps = fake_maps
    try:
        tok = lambda *parts, **kw: {"input_ids": [0, 1, 2, 3, 4]}
        page = build_report(run, svg=False, do_sweep=False, examples=2, texts=["x", "y"], model=(object(), tok))
    finally:
        maps_module.attention_maps = real
    _open(browser, page)
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    for head in ("L0H1", "L2H3"):
        browser.find_element("css selector", f'#grid td[data-head="{head}"]').click()
    Select(browser.find_element("id", "grid-colour")).select_by_index(len(Select(
        browser.find_element("id", "grid-colour")).options) - 1)  # the payload feature
    for e in browser.find_elements("css selector", "#hv-draw text.tok-q")[:3]:
        e.click()
    for th in browser.find_elements("css selector", "table.sortable thead th")[:5]:
        th.click()
    with pytest.raises(NoAlertPresentException):
        _ = browser.switch_to.alert.text
    assert browser.execute_script("return window.pwned === undefined")
    shown = browser.find_element("css selector", '#hv-draw text.tok-q[data-i="1"]').text
    assert shown == PAYLOADS[1]  # shown as text
