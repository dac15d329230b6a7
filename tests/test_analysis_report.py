"""clusters.json, run comparison, the HTML report and the click commands, on synthetic runs."""
import base64
import json
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit import AttnkitError
from attnkit.analysis import HeadDistances, cluster, stability_over_seeds, sweep
from attnkit.analysis.report import build_report, example_maps
from attnkit.analysis.results import compare, load_clusters, save_clusters, type_distribution
from attnkit.cli.analysis import cluster_cmd, compare_cmd, distances_cmd, report_cmd

from .synthetic import KINDS, layered_truth, make_features, tiny_bert

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
    assert "http://" not in page and "https://" not in page
    # scripts are inline (the data and report.js), never loaded from a file or a CDN
    assert page.count("<script") == 2 and "<script src" not in page and "@import" not in page
    for stem in ("type_share_per_layer", "distance_boxplots", "tsne_types", "mds_js", "feature_heatmaps",
                 "stability_sweep"):
        assert (run / "figures" / f"{stem}.png").stat().st_size > 1000
        assert (run / "figures" / f"{stem}.svg").read_text().lstrip().startswith("<?xml")
    assert "Stability over k" in page
    # findings first, the settings last and folded away
    h2 = [x.split("</h2>")[0] for x in page.split("<h2>")[1:]]
    assert h2[0] == "Findings" and h2[-1] == "Settings and versions"
    assert page.split('<section id="settings">')[1].split("</h2>", 1)[1].startswith("<details>")
    data = json.loads((run / "clusters.json").read_text())
    assert [r["k"] for r in data["stability"]["sweep"]] == list(range(2, 9))
    # a second report reuses clusters.json (and tolerates a run without distances)


def test_report_without_clusters_or_distances_nests_settings(tmp_path):
    run = tmp_path / "small"
    feats = make_features(layered_truth(L=3, H=6, seed=1))
    feats.meta.update(settings={"max_length": 128, "dtype": "float32", "columns": None},
                      versions={"torch": "2.13.0", "python": "3.11"}, split_sentences=True)
    feats.save(run)
    page = build_report(run, svg=False, do_sweep=False, k=4).read_text()
    assert "No distances.npz" in page and "clusters.json was missing" in page
    assert load_clusters(run)["stability"]["sweep"] is None
    assert not list((run / "figures").glob("*.svg"))
    settings = page.split('<section id="settings">', 1)[1].split("</section>", 1)[0]
    # neither raw nor HTML-escaped Python dict text
    assert "{'" not in settings and "{&#x27;" not in settings and "}" not in settings
    assert settings.count('<table class="nested">') == 3  # settings, versions, clustering
    assert '<td class="l">dtype</td><td class="l">float32</td>' in settings
    assert '<td class="l">torch</td><td class="l">2.13.0</td>' in settings
    assert '<td class="l">split_sentences</td><td class="l">yes</td>' in settings
    # lists of names read as lists, not Python reprs
    assert "vertical, diagonal, dense" in settings and "['" not in settings


def test_head_maps_name_few_heads_without_overlap(truth):
    from attnkit.analysis import figures as figs

    rng = np.random.default_rng(0)
    labels = truth.ravel()
    centres = np.array([[0, 0], [4, 0], [0, 4], [4, 4]], dtype=float)
    xy = centres[labels] + rng.normal(0, 0.8, size=(len(labels), 2))  # four crowded blobs
    xy = (xy - xy.mean(0)) / xy.std(0)  # unit spread on both axes, as label_candidates scales them
    heads = [f"L{m // 12}H{m % 12}" for m in range(len(labels))]
    order = figs.label_candidates(xy, labels, max_labels=10)
    assert len(order) == 10 and len(set(order)) == 10
    typical = set()
    for c in range(4):
        members = np.flatnonzero(labels == c)
        typical.add(int(members[np.argmin(((xy[members] - xy[members].mean(0)) ** 2).sum(1))]))
    assert set(order[:4]) == typical  # first the head nearest each type's mean position, then extremes
    radius = (xy - np.median(xy, 0)) ** 2
    assert max(range(len(xy)), key=lambda m: radius[m].sum()) in order
    import matplotlib.pyplot as plt

    layers = np.repeat(np.arange(truth.shape[0]), truth.shape[1])
    for fig in (figs.tsne_scatter(xy, labels, KINDS, heads, max_labels=10),
                figs.mds_maps(xy, labels, KINDS, layers, heads, max_labels=10)):
        ax = fig.axes[0]
        renderer = fig.canvas.get_renderer()
        texts = [t for t in ax.texts if t.get_text() in heads]
        assert 4 <= len(texts) <= 10
        assert all(t.get_fontsize() >= 7 for t in texts)
        boxes = [t.get_window_extent(renderer) for t in texts]
        frame = ax.get_window_extent(renderer)
        for i, a in enumerate(boxes):
            assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (a, b)
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.x0 >= frame.x1  # the legend hides no point
        plt.close(fig)


def test_example_maps_have_colour_bars():
    from attnkit.analysis import figures as figs

    toks = ["[CLS]", "a", "b", ",", "[SEP]"]
    w = np.full((5, 5), 0.2)
    ex = [{"type": t, "layer": 0, "head": h, "tokens": toks, "weights": w}
          for t in ("dense", "vertical") for h in (0, 1)]
    fig = figs.attention_examples(ex)
    maps = [ax for ax in fig.axes if ax.images]
    bars = [ax for ax in fig.axes if not ax.images]  # colour bars hold no image
    assert len(maps) == 4 and len(bars) == 4
    for ax in maps:
        assert [t.get_text() for t in ax.get_xticklabels()] == toks
        lo, hi = ax.images[0].get_clim()
        assert lo == 0 and hi == pytest.approx(0.2)


def test_example_maps_are_attention_rows(tmp_path):
    import copy

    import torch

    import attnkit

    model, tok = tiny_bert()
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
    r = runner.invoke(cluster_cmd, [str(run), "--k", "3", "--stability", "3", "--sweep", "--seeds", "2"])
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
    # results are not replaced without --overwrite; with it, the command says what went
    r = runner.invoke(cluster_cmd, [str(run), "--k", "2", "--stability", "2"])
    assert r.exit_code == 1 and "clusters.json already exists: give --overwrite" in r.output
    assert json.loads((run / "clusters.json").read_text())["settings"]["k"] == 3
    r = runner.invoke(report_cmd, [str(run), "--no-svg"])
    assert r.exit_code == 1 and "report.html" in r.output and "--overwrite" in r.output
    r = runner.invoke(compare_cmd, [str(run), str(run), "--json", str(tmp_path / "cmp.json")])
    assert r.exit_code == 1 and "cmp.json already exists" in r.output
    r = runner.invoke(cluster_cmd, [str(run), "--k", "2", "--stability", "2", "--overwrite"])
    assert r.exit_code == 0 and json.loads((run / "clusters.json").read_text())["settings"]["k"] == 2
    assert f"--overwrite removed {run}/{{clusters.json, report.html}}" in r.output
    assert not (run / "report.html").exists()  # drawn from the old clusters: gone with them
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


def test_report_shows_summaries_and_stability_warning(tmp_path):
    from attnkit.analysis.report import build_report

    f = make_features(layered_truth(4, 12), noise=0.02, structureless=True)
    f.save(tmp_path)
    c = cluster(f, k=4, n_stability=4)
    save_clusters(tmp_path, c, f, None, stability_over_seeds(f, n_seeds=10, first=c, k=4, n_stability=4))
    page = build_report(tmp_path, svg=False).read_text()
    assert "Over 10 seeds" in page and "Warning:</b> stability" in page
    assert "Per-layer summaries (Clark et al.)" in page and "What differs from the papers" in page
    assert (tmp_path / "figures" / "layer_summaries.png").is_file()


def test_report_bar_starts_with_its_figures(tmp_path, capsys):
    """The report's progress bar appears once it knows how many figures it draws: none for no figures (it printed
    `report: 0 figures [00:00, ? figures/s]` when made before that), and a bar counting to the total otherwise."""
    from attnkit.analysis.report import _FigureSaver

    save = _FigureSaver(tmp_path, svg=False, progress=True)
    save.expect(0)
    save.close()
    assert capsys.readouterr().err == ""
    save = _FigureSaver(tmp_path, svg=False, progress=True)
    save.expect(2)
    save.close()
    err = capsys.readouterr().err
    assert "0/2" in err and "0 figures [" not in err
