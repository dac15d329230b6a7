"""clusters.json, run comparison, the HTML report and the click commands, on synthetic runs."""
import base64
import json
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit import AttnkitError
from attnkit.analysis import HeadDistances, cluster, sweep
from attnkit.analysis.commands import cluster_cmd, compare_cmd, distances_cmd, report_cmd
from attnkit.analysis.report import build_report, example_maps
from attnkit.analysis.results import compare, load_clusters, save_clusters, type_distribution

try:
    from tests.analysis_fixtures import KINDS, layered_truth, make_features, tiny_model_and_tokenizer
except ImportError:
    from analysis_fixtures import KINDS, layered_truth, make_features, tiny_model_and_tokenizer

VOID = {"meta", "img", "br", "hr", "input", "link"}


class TagChecker(HTMLParser):
    """Checks that every non-void tag is closed in order; collects img sources."""

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.imgs, self.tags = [], [], [], set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "img":
            self.imgs.append(dict(attrs).get("src", ""))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> with open {self.stack[-3:]}")
        else:
            self.stack.pop()


def make_run(path, truth, seed=1, distances=True):
    feats = make_features(truth, seed=seed)
    feats.save(path)
    if distances:
        X = feats.mean[:, :, :21].reshape(-1, 21)
        d = np.abs(X[:, None, :] - X[None, :, :]).sum(-1) * 100  # any symmetric dissimilarity, zero diagonal
        L, H = truth.shape
        HeadDistances(d, 1000, L, H).save(path)
    return feats


@pytest.fixture(scope="module")
def truth():
    return layered_truth(seed=4)


def test_clusters_json_and_compare(tmp_path, truth):
    fa = make_run(tmp_path / "a", truth, distances=False)
    changed = truth.copy()
    flips = [(0, 1), (5, 7), (3, 3)]
    for l, h in flips:
        changed[l, h] = (changed[l, h] + 1) % 4
    fb = make_run(tmp_path / "b", changed, seed=2, distances=False)
    for path, f in ((tmp_path / "a", fa), (tmp_path / "b", fb)):
        save_clusters(path, cluster(f, k=4, n_stability=3), f)
    a, b = load_clusters(tmp_path / "a"), load_clusters(tmp_path / "b")
    assert a["settings"]["k"] == 4 and a["run"]["n_layers"] == 6 and len(a["heads"]) == 72
    assert {c["type"] for c in a["clusters"]} == set(KINDS)
    assert sum(c["share"] for c in a["clusters"]) == pytest.approx(1.0)
    assert set(a["clusters"][0]["centroid"]) == set(a["settings"]["features"])
    assert 0 <= a["stability"]["stability"] <= 1
    for h in a["heads"]:
        assert h["type"] == KINDS[truth[h["layer"], h["head"]]]
    res = compare(a, b)
    assert res["n_changed"] == len(flips)
    assert {(c["layer"], c["head"]) for c in res["changed"]} == set(flips)
    for c in res["changed"]:
        assert (c["a"], c["b"]) == (KINDS[truth[c["layer"], c["head"]]], KINDS[changed[c["layer"], c["head"]]])
    dist = type_distribution(a)
    for t, counts in dist.items():
        assert counts == [int(np.sum(truth[l] == KINDS.index(t))) for l in range(6)]
    with pytest.raises(AttnkitError, match="missing"):
        load_clusters(tmp_path / "nothing")


def test_report_is_self_contained_html(tmp_path, truth):
    run = tmp_path / "run"
    feats = make_run(run, truth)
    # clusters.json with a (cheap) sweep: the report draws the sweep figure from it
    save_clusters(run, cluster(feats, k=4, n_stability=3), feats, sweep(feats, n_stability=2))
    out = build_report(run)
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>")
    checker = TagChecker()
    checker.feed(page)
    checker.close()
    assert checker.errors == [] and checker.stack == []
    assert {"html", "head", "body", "table", "img", "h2"} <= checker.tags
    # every image embedded as base64 PNG that decodes to a PNG; nothing fetched from elsewhere
    assert len(checker.imgs) >= 6
    for src in checker.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for stem in ("type_share_per_layer", "distance_boxplots", "tsne_types", "mds_js", "feature_heatmaps",
                 "stability_sweep"):
        assert (run / "figures" / f"{stem}.png").stat().st_size > 1000
        assert (run / "figures" / f"{stem}.svg").read_text().lstrip().startswith("<?xml")
    assert "Stability over k" in page and "L5H11" not in page.split("<figure>")[0]
    data = json.loads((run / "clusters.json").read_text())
    assert [r["k"] for r in data["stability"]["sweep"]] == list(range(2, 9))
    # a second report reuses clusters.json (and tolerates a run without distances)


def test_report_without_clusters_or_distances(tmp_path):
    run = tmp_path / "small"
    make_run(run, layered_truth(L=3, H=6, seed=1), distances=False)
    page = build_report(run, svg=False, do_sweep=False).read_text()
    assert "No distances.npz" in page and "clusters.json was missing" in page
    assert load_clusters(run)["stability"]["sweep"] is None
    assert not list((run / "figures").glob("*.svg"))


def test_example_maps_are_attention_rows(tmp_path):
    import copy

    import torch

    import attnkit

    model, tok = tiny_model_and_tokenizer(tmp_path)
    eager = copy.deepcopy(model)
    attnkit.instrument(model)
    texts = ["the cat sat on the mat.", ("a big red house", "the dog ran")]
    ex = example_maps(model, tok, texts, [("dense", 1, 0, 1), ("vertical", 0, 1, 0), ("dense", 0, 0, 1)])
    assert [(e["type"], e["layer"], e["head"]) for e in ex] == [("dense", 1, 0), ("vertical", 0, 1), ("dense", 0, 0)]
    for e in ex:
        w = e["weights"]
        assert w.shape == (len(e["tokens"]),) * 2
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-5)
    enc = tok(*texts[1], return_tensors="pt")
    with torch.no_grad():
        att = eager(**enc, output_attentions=True).attentions
    np.testing.assert_allclose(ex[0]["weights"], att[1][0, 0].numpy(), atol=1e-5)
    assert ex[0]["tokens"][0] == "[CLS]"


def test_commands(tmp_path):
    run = tmp_path / "run"
    make_run(run, layered_truth(L=3, H=6, seed=2))
    runner = CliRunner()
    r = runner.invoke(cluster_cmd, [str(run), "--k", "3", "--stability", "3", "--sweep"])
    assert r.exit_code == 0, r.output
    assert "stability" in r.output and (run / "clusters.json").is_file()
    assert "k  stability  silhouette" in r.output
    r = runner.invoke(compare_cmd, [str(run), str(run), "--json", str(tmp_path / "cmp.json")])
    assert r.exit_code == 0, r.output
    assert "0 of 18 heads changed type" in r.output
    assert json.loads((tmp_path / "cmp.json").read_text())["n_changed"] == 0
    r = runner.invoke(report_cmd, [str(run), "--no-svg"])
    assert r.exit_code == 0, r.output
    assert (run / "report.html").is_file()
    # errors are one line, not a traceback
    empty = tmp_path / "empty"
    empty.mkdir()
    r = runner.invoke(cluster_cmd, [str(empty)])
    assert r.exit_code == 1 and "features.npz is missing" in r.output
    r = runner.invoke(cluster_cmd, [str(run), "--features", "cls,bogus"])
    assert r.exit_code == 1 and "unknown feature" in r.output
    r = runner.invoke(distances_cmd, [str(run)])  # synthetic run: no corpus recorded
    assert r.exit_code == 1 and "--corpus" in r.output
    for cmd in (cluster_cmd, distances_cmd, report_cmd, compare_cmd):
        assert runner.invoke(cmd, ["--help"]).exit_code == 0
