"""The report of a decoder run (issue 27 item 5; docs/analysis.md, "The report"): the sink heads by first-token mass
and how much of it survives norm weighting (a run of the other weighting given to --include), the heads of
`attnkit detect-heads` (findings, a grid per kind, the explorer and the panel), thresholds that apply to causal rows,
and language-model loss ablations read with a rise as the harm. Every number the page states is recomputed here
from the files the commands wrote."""
from __future__ import annotations

import csv
import html
import json
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis.attached import find_attached, read_detected
from attnkit.cli.main import main
from attnkit.errors import AttnkitError
from attnkit.run import HeadFeatures

from .conftest import SENTENCES
from .synthetic import tiny_decoder


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def text_of(page: str, section: str) -> str:
    """The visible text of one section of report.html, whitespace collapsed."""
    start = page.index(f'<section id="{section}"')
    body = re.sub(r"</?(code|b|a|span)\b[^>]*>", "", page[start:page.index("</section>", start)])  # inline: no gap
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", body)))


def page_data(page: str) -> dict:
    start = page.index('id="attnkit-data"')
    return json.loads(page[page.index(">", start) + 1:page.index("</script>", start)])


@pytest.fixture(scope="module")
def decoder_runs(tmp_path_factory, decoder_tokenizer):
    """A tiny Llama (4 heads on 2 KV heads, 3 layers), its run of the corpus under both weightings, its detected
    heads and a layers ablation on the language-model loss written into the run."""
    root = tmp_path_factory.mktemp("decoder-report")
    model = root / "llama"
    tiny_decoder("llama", vocab=len(decoder_tokenizer), n_layers=3).save_pretrained(model)
    decoder_tokenizer.save_pretrained(model)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(s.lower() for s in SENTENCES) + "\n")
    for name, weighting in (("run", "attention"), ("norm", "norm")):
        run("extract", corpus, "--model", model, "--max-length", 32, "--weighting", weighting, "-o", root / name, "-q")
    run("detect-heads", model, "-o", root / "run", "--length", 8, "--sequences", 4)
    run("ablate", model, "--task", "lm", "--data", corpus, "--experiment", "layers", "--mode", "zero",
        "--resamples", 200, "-o", root / "run", "-q")
    run("cluster", root / "run", "-k", 2, "--stability", 2, "-q")
    return root


@pytest.fixture(scope="module")
def report(decoder_runs):
    run("report", decoder_runs / "run", "--include", decoder_runs / "norm", "--examples", 0, "-q")
    return (decoder_runs / "run" / "report.html").read_text()


def test_the_findings_name_the_sink_heads_and_what_survives_norm_weighting(decoder_runs, report):
    text = text_of(report, "findings")
    first = HeadFeatures.load(decoder_runs / "run").feature("cls")
    norm = HeadFeatures.load(decoder_runs / "norm").feature("cls")
    assert "Sink heads: mass on the first token" in text
    assert f"On average over the 12 heads, {first.mean():.2f} of each row's weight goes to the sample's first" in text
    best = np.unravel_index(np.argmax(first), first.shape)
    assert f"The strongest: L{best[0]}H{best[1]} ({first.max():.3f})" in text
    assert f"{int((first >= 0.9).sum())} head(s) put at least 0.9 there" in text
    survives = f"{100 * norm.mean() / first.mean():.0f}%"
    assert (f"first-token mass {first.mean():.3f} by attention, {norm.mean():.3f} by norm on average over the heads, "
            f"so {survives} of it survives") in text
    assert f"L{best[0]}H{best[1]} {first.max():.2f} → {norm[best]:.2f}" in text
    # Clark et al.'s encoder comparisons are not made; the thresholds that mean something for causal rows are
    assert "not made for a decoder run" in text and "What differs from the papers" not in text
    assert "first token cls > 0.6" in text and "next token next >" not in text and "[SEP] sep" not in text


def test_the_findings_show_the_detected_heads_with_their_settings(decoder_runs, report):
    text = text_of(report, "findings")
    with open(decoder_runs / "run" / "detected_heads.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert "From run/detected_heads.csv: 4 sequences of 8 random tokens, each repeated once (seed 0; the model's " \
           "BOS, id 1, before each)" in text
    for kind in ("previous", "duplicate", "induction"):
        top = sorted(rows, key=lambda r: -float(r[kind]))[:5]
        above = sum(float(r[kind]) >= 0.5 for r in rows)
        named = ", ".join(f"L{r['layer']}H{r['head']} ({float(r[kind]):.2f})" for r in top)
        assert f"{kind} {above} {named}" in text
    detected = text_of(report, "detected")
    top10 = sorted(rows, key=lambda r: -float(r["induction"]))[:10]
    assert "induction " + ", ".join(f"L{r['layer']}H{r['head']} ({float(r['induction']):.3f})" for r in top10) in detected
    assert (decoder_runs / "run" / "figures" / "detected_heads.png").stat().st_size > 1000
    data = page_data(report)["detected"]  # the panel and the grid's colouring read these
    assert data["kinds"] == ["previous", "duplicate", "induction"]
    np.testing.assert_allclose(data["scores"], [[float(r[k]) for k in data["kinds"]] for r in rows], atol=1e-4)
    assert 'value="detected:induction"' in report


def test_a_loss_ablation_names_the_layer_that_raises_the_loss_most(decoder_runs, report):
    table = json.loads((decoder_runs / "run" / "layers.json").read_text())
    assert table["main_metric"] == "loss"
    rows = table["rows"][1:]
    worst = max(rows, key=lambda r: r["delta_loss"])
    text = text_of(report, "findings")
    said = (f"disabling layer {worst['layer']} alone raises loss the most:" if worst["delta_loss"] > 0 else
            f"disabling no single layer raises loss; the closest, layer {worst['layer']}:")
    assert (f"{said} Δ {worst['delta_loss']:+.2f} "
            f"[{worst['delta_loss_lo']:+.2f}, {worst['delta_loss_hi']:+.2f}] from {table['rows'][0]['loss']:.2f} "
            "(higher is worse)") in text
    ablation = page_data(report)["ablation"]
    assert ablation[0]["metric"] == "loss (higher is worse)" and ablation[0]["per"] == "layer"


def test_a_run_of_learned_sinks_says_how_much_the_sink_logit_takes(tmp_path, decoder_tokenizer):
    model = tmp_path / "gpt-oss"
    tiny_decoder("gpt_oss", vocab=len(decoder_tokenizer)).save_pretrained(model)
    decoder_tokenizer.save_pretrained(model)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(s.lower() for s in SENTENCES[:6]) + "\n")
    run("extract", corpus, "--model", model, "--max-length", 32, "-o", tmp_path / "run", "-q")
    run("cluster", tmp_path / "run", "-k", 2, "--stability", 2, "-q")
    run("report", tmp_path / "run", "--examples", 0, "-q")
    text = text_of((tmp_path / "run" / "report.html").read_text(), "findings")
    sink = HeadFeatures.load(tmp_path / "run").feature("sink")
    assert f"The model's learned sink logit takes {sink.mean():.3f} of the weight on average" in text
    assert "Not measured for this run: attnkit detect-heads MODEL -o RUN" in text
    assert "--weighting norm and give that run to attnkit report RUN --include OTHER_RUN" in text


def test_older_detect_heads_files_are_read_and_an_ablation_of_heads_still_is(decoder_runs, tmp_path):
    # detect-heads used to write heads.csv + heads.meta.json, the names of `ablate --experiment heads`'s table
    run_dir = tmp_path / "run"
    shutil.copytree(decoder_runs / "run", run_dir)
    shape = (3, 4)
    new = read_detected(run_dir / "detected_heads.csv", run_dir / "detected_heads.json", shape)
    (run_dir / "detected_heads.csv").rename(run_dir / "heads.csv")
    (run_dir / "detected_heads.json").rename(run_dir / "heads.meta.json")
    found = find_attached(run_dir, shape)
    assert found.detected["path"].name == "heads.csv" and not found.links
    for kind in new["kinds"]:
        np.testing.assert_array_equal(found.detected["scores"][kind], new["scores"][kind])
    assert [a["experiment"] for a in found.ablations] == ["layers"]


@pytest.mark.parametrize("damage, problem", [
    (lambda p: p.write_text(p.read_text().replace("layer,head,previous", "layer,head,prev")), "its columns are"),
    (lambda p: p.write_text("\n".join(p.read_text().splitlines()[:-1]) + "\n"), "lacks 1 of the 12 heads"),
    (lambda p: p.write_text(re.sub(r"^(0,1,)[^,]+", r"\g<1>1.5", p.read_text(), flags=re.M)), "outside 0–1"),
    (lambda p: p.write_text(p.read_text() + "0,0,0.1,0.1,0.1\n"), "repeats a head"),
])
def test_a_damaged_detection_table_is_named(decoder_runs, tmp_path, damage, problem):
    run_dir = tmp_path / "run"
    shutil.copytree(decoder_runs / "run", run_dir)
    damage(run_dir / "detected_heads.csv")
    with pytest.raises(AttnkitError, match=f"detected_heads.csv is unreadable: .*{problem}"):
        find_attached(run_dir, (3, 4))
    result = CliRunner().invoke(main, ["report", str(run_dir), "--examples", "0", "--overwrite", "-q"])
    assert result.exit_code != 0 and "detected_heads.csv is unreadable" in result.output


def test_results_that_do_not_fit_are_named_not_shown(decoder_runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(decoder_runs / "run", run_dir)
    meta = json.loads((run_dir / "detected_heads.json").read_text())
    (run_dir / "detected_heads.json").write_text(json.dumps({**meta, "n_layers": 30}))
    feats = HeadFeatures.load(run_dir)
    found = find_attached(run_dir, (3, 4), [decoder_runs / "run"], feats)  # a run of the same weighting
    assert found.detected is not None  # the included run's own detection (the run's does not fit)
    reasons = {what: why for what, _, why in found.links}
    assert "30 layers × 4 heads, the run has 3 × 4" in reasons["detected heads"]
    assert "same weighting (attention)" in reasons["run"]
    found = find_attached(run_dir, (3, 4), [decoder_runs / "norm"], feats)
    assert found.detected is None and found.weighting["other"] == decoder_runs / "norm"


def test_the_grid_is_coloured_by_a_detected_kind_and_the_panel_lists_the_scores(decoder_runs, report):
    from .test_report_browser import BROWSER, DRIVER

    if BROWSER is None or DRIVER is None:
        pytest.skip("no chromium/chromedriver (apt-get install -y chromium chromium-driver)")
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from .test_report_browser import chromium

    driver = chromium()
    try:
        with open(decoder_runs / "run" / "detected_heads.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        best = max(rows, key=lambda r: float(r["induction"]))
        head = f"L{best['layer']}H{best['head']}"
        driver.get((decoder_runs / "run" / "report.html").as_uri())
        WebDriverWait(driver, 20).until(lambda d: d.find_element("id", "panel").get_attribute("data-head") == "L0H0")
        Select(driver.find_element("id", "grid-colour")).select_by_value("detected:induction")
        cell = driver.find_element("css selector", f'#grid td[data-head="{head}"]')
        assert cell.text == f"{float(best['induction']):.2f}"
        assert "detected:induction" in driver.find_element("id", "grid-legend").text
        cell.click()
        WebDriverWait(driver, 10).until(lambda d: d.find_element("id", "panel").get_attribute("data-head") == head)
        listed = {tr.find_elements("css selector", "td")[0].text: [td.text for td in tr.find_elements("css selector", "td")[1:]]
                  for tr in driver.find_elements("css selector", "#panel table.detected tbody tr")}
        assert listed["induction"] == [f"{float(best['induction']):.3f}", "1 of 12"]
        assert listed["previous"][0] == f"{float(best['previous']):.3f}"
    finally:
        driver.quit()


def test_an_encoder_report_says_how_much_special_token_mass_survives_norm_weighting(tmp_path):
    from attnkit.analysis.report import build_report

    from .synthetic import rich_run

    f, *_ = rich_run(tmp_path / "run")
    special = ("cls", "sep", "comma", "period")
    mean = np.array(f.mean)
    mean[..., [f.names.index(n) for n in special]] *= 0.25  # norm weighting keeps a quarter of every head's mass
    HeadFeatures(mean, f.std, f.names, f.n_samples, f.n_tokens, {**f.meta, "weighting": "norm"}).save(tmp_path / "norm")
    page = build_report(tmp_path / "run", svg=False, include=[tmp_path / "norm"]).read_text()
    text = text_of(page, "findings")
    mass = sum(f.feature(n) for n in special)
    best = np.unravel_index(np.argmax(mass), mass.shape)
    assert (f"[CLS] + [SEP] + punctuation mass {mass.mean():.3f} by attention, {mass.mean() / 4:.3f} by norm on average "
            "over the heads, so 25% of it survives") in text
    assert f"L{best[0]}H{best[1]} {mass.max():.2f} → {mass.max() / 4:.2f}" in text
    assert "Sink heads" not in text  # an encoder's findings stay Clark et al.'s
