"""The report as a reader meets it: findings first, the head panel's data (checked against independent
computations), the results of patterns, probe and ablate beside the run's heads, links for what cannot be shown,
feature names linked to their definitions, and one-line errors."""
import csv
import json
import re

import numpy as np
import pytest

from attnkit.analysis.report import SECTIONS, Section, build_report

from .synthetic import rich_run


@pytest.fixture(scope="module")
def rich(tmp_path_factory):
    run = tmp_path_factory.mktemp("rich") / "run"
    f, per, texts, dist = rich_run(run)
    page = build_report(run, svg=False).read_text()
    data = json.loads(re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', page,
                                re.S).group(1))
    return run, f, per, texts, dist, page, data


def test_the_page_opens_with_findings_and_a_contents_list(rich):
    *_, page, _ = rich
    ids = re.findall(r'<section id="([^"]+)">', page)
    assert ids[:2] == ["findings", "explorer"] and ids[-1] == "settings"
    assert {"patterns", "probe", "ablation", "tables", "glossary"} <= set(ids)
    toc = re.search(r'<nav class="toc">(.*?)</nav>', page, re.S).group(1)
    assert re.findall(r'href="#([^"]+)"', toc) == ids  # every section, in page order
    findings = page.split('<section id="findings">')[1].split("</section>")[0]
    for part in ("Head types", "The attention sink", "What differs from the papers", "Heads above the papers'",
                 "Other results of this run"):
        assert part in findings
    assert "stability <b>" in findings


def test_panel_data_is_the_runs_numbers(rich):
    run, f, per, texts, dist, _, data = rich
    L, H, F = f.mean.shape
    assert data["heads"][7] == f"L{7 // H}H{7 % H}"
    np.testing.assert_allclose(np.array(data["features"]["mean"]), f.mean.reshape(L * H, F), atol=1e-5)
    np.testing.assert_allclose(np.array(data["features"]["std"]), f.std.reshape(L * H, F), atol=1e-5)
    clusters = json.loads((run / "clusters.json").read_text())
    assert [data["types"]["names"][x] for x in data["types"]["label"]] == [h["type"] for h in clusters["heads"]]
    # nearest heads by divergence: an independent argsort of the distances, self excluded
    for m in range(L * H):
        d = dist[m].copy()
        d[m] = np.inf
        assert [x[0] for x in data["near"]["js"][m]] == list(np.argsort(d, kind="stable")[:5])
    # top and bottom examples: per head and feature, the rows of the highest and lowest per-sample values
    j = f.names.index("sep")
    for m in range(L * H):
        col = per[:, m // H, m % H, j]
        top = [x[0] for x in data["examples"]["top"]["sep"][m]]
        bottom = [x[0] for x in data["examples"]["bottom"]["sep"][m]]
        assert top == list(np.argsort(-col, kind="stable")[:3]) and bottom == list(np.argsort(col, kind="stable")[:3])
        assert data["examples"]["top"]["sep"][m][0][1] == pytest.approx(float(col.max()), abs=1e-5)
    shown = {int(r) for r in data["examples"]["texts"]}
    assert shown and all(data["examples"]["texts"][str(r)] == texts[r] for r in shown)


def test_attached_results_per_head(rich):
    run, f, *_, data = rich
    L, H = f.n_layers, f.n_heads
    rows = list(csv.DictReader(open(run / "probe.csv")))
    acc = {}
    for r in rows:
        key = (r["relation"], int(r["layer"]), int(r["head"]))
        acc[key] = max(acc.get(key, 0.0), float(r["accuracy"]))
    probe = data["probe"]
    assert probe["relations"][0] == "(all)" and set(probe["relations"]) == {"(all)", "nsubj", "det"}
    for m in range(L * H):
        for i, rel in enumerate(probe["relations"]):
            assert probe["acc"][m][i] == pytest.approx(acc[(rel, m // H, m % H)], abs=1e-5)
    patterns = json.loads((run / "patterns.json").read_text())
    for m in range(L * H):
        assert data["patterns"]["shares"][m] == pytest.approx(
            [patterns["per_head"][c][m // H][m % H] for c in patterns["classes"]], abs=1e-5)
    table = json.loads((run / "heads.json").read_text())["rows"][1:]
    (ab,) = data["ablation"]
    assert ab["experiment"] == "heads" and ab["metric"] == "spearman"
    for r in table:
        m = r["layer"] * H + r["head"]
        assert ab["delta"][m] == pytest.approx(r["delta_spearman"], abs=1e-5)
        assert ab["lo"][m] == pytest.approx(r["delta_spearman_lo"], abs=1e-5)


def test_results_that_do_not_fit_are_named_without_links(tmp_path):
    run = tmp_path / "run"
    rich_run(run, n_samples=8)
    other = tmp_path / "probe-of-another-model"
    other.mkdir()
    (other / "probe.json").write_text(json.dumps({"layers": 12, "heads": 12, "settings": {}}))
    (run / "layers.meta.json").write_text(json.dumps({"experiment": "layers"}))  # its table is missing
    page = build_report(run, svg=False, include=[other]).read_text()
    elsewhere = page.split('<section id="elsewhere">')[1].split("</section>")[0]
    assert "href" not in elsewhere and str(tmp_path) not in page  # the page links nothing of this machine
    assert ">probe-of-another-model/probe.json<" in elsewhere
    assert "the probe ran on a model of 12 layers × 12 heads, the run has 3 × 4" in elsewhere
    assert ">layers.meta.json<" in elsewhere and "layers.json is missing beside layers.meta.json" in elsewhere


def test_feature_names_link_to_the_glossary_inside_the_page(rich):
    _, f, *_, page, data = rich
    hrefs = set(re.findall(r'href="([^"]*)"', page))
    assert hrefs and all(h.startswith("#") for h in hrefs)  # one self-contained file: no link leaves the page
    assert "file://" not in page
    ids = set(re.findall(r' id="([^"]+)"', page))
    assert {h[1:] for h in hrefs} <= ids  # every link lands on an anchor of the page
    for n in f.names:
        assert data["features"]["docs"][n] == f"#glossary-{n}"
        assert f'<tr id="glossary-{n}">' in page
    glossary = page.split('<section id="glossary">')[1].split("</section>")[0]
    assert "<b>prev</b></td><td class=\"l\">weight on the previous token</td>" in glossary
    assert "docs/features.md § 2. Features of one query row › The row features" in glossary
    tables = page.split('<section id="tables">')[1].split("</section>")[0]
    assert 'prev<a class="doc" href="#glossary-prev" title="weight on the previous token">?</a>' in tables


def test_sections_can_be_added_by_other_analyses(tmp_path):
    run = tmp_path / "run"
    rich_run(run, n_samples=5)

    def extra(report):
        return Section("extra", "An added section", f"<p>{report.features.n_layers} layers</p>")

    SECTIONS.insert(1, extra)
    try:
        page = build_report(run, svg=False).read_text()
    finally:
        SECTIONS.remove(extra)
    assert re.findall(r'<section id="([^"]+)">', page)[:3] == ["findings", "extra", "explorer"]
    assert '<section id="extra"><h2>An added section</h2><p>3 layers</p></section>' in page


def test_report_of_a_run_without_per_sample_says_how_to_get_examples(tmp_path):
    from .synthetic import layered_truth, make_features

    run = tmp_path / "run"
    make_features(layered_truth(L=3, H=4, seed=1)).save(run)
    page = build_report(run, svg=False, do_sweep=False).read_text()
    data = json.loads(re.search(r'id="attnkit-data">(.*?)</script>', page, re.S).group(1))
    assert data["examples"] is None and data["probe"] is None and data["ablation"] == []
    assert "attnkit extract --per-sample" in data["notes"]["examples"]
    assert "attnkit distances" in page and "--corpus" not in page.split('id="maps"')[1].split("</section>")[0]
