"""Uncertainty where results are read: stability over seeds, unreliable type changes, bootstrap intervals of
metric changes, Clark-style summaries and departures, smoothed JS divergences."""
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from attnkit.ablation.experiments import Setting, run_settings
from attnkit.ablation.metrics import ExampleScores, bootstrap_delta, percentile_interval, spearman
from attnkit.analysis.clustering import cluster, stability_over_seeds, sweep
from attnkit.engine.distances import js_distances, smooth_attention
from attnkit.analysis.results import clusters_dict, compare, save_clusters
from attnkit.analysis.summaries import layer_summaries, paper_differences, threshold_heads
from attnkit.errors import AttnkitError
from attnkit.run.head_features import HeadFeatures
from attnkit.interventions import Intervention

try:
    from tests.analysis_fixtures import layered_truth, make_features
except ImportError:
    from analysis_fixtures import layered_truth, make_features


# --- clustering stability over seeds ---------------------------------------------------------------------
def test_stability_over_seeds_separates_clear_from_structureless():
    truth = layered_truth(4, 12)
    clear = stability_over_seeds(make_features(truth, noise=0.005), n_seeds=10, k=4, n_stability=4)
    assert clear["n_seeds"] == 10 and clear["seeds"] == list(range(10)) and len(clear["values"]) == 10
    assert clear["min"] <= clear["mean"] <= clear["max"] and clear["mean"] > 0.9
    mush = stability_over_seeds(make_features(truth, noise=0.02, structureless=True), n_seeds=10, k=4, n_stability=4)
    assert mush["mean"] < 0.8 and mush["max"] - mush["min"] >= 0
    with pytest.raises(AttnkitError, match="seeds"):
        stability_over_seeds(make_features(truth), n_seeds=0)


def test_sweep_rows_carry_seed_range():
    rows = sweep(make_features(layered_truth(4, 12)), ks=[2, 4], n_seeds=3, n_stability=3)
    for r in rows:
        assert r["n_seeds"] == 3 and r["stability_min"] <= r["stability_mean"] <= r["stability_max"]


def _clusters(features, n_seeds=10):
    c = cluster(features, k=4, n_stability=4)
    return clusters_dict(c, features, seeds=stability_over_seeds(features, n_seeds=n_seeds, first=c, k=4,
                                                                  n_stability=4))


def test_compare_marks_changes_unreliable_when_a_run_is_unstable():
    truth = layered_truth(4, 12)
    a = _clusters(make_features(truth, noise=0.005))
    b = _clusters(make_features(truth, noise=0.005, seed=3))
    mush = _clusters(make_features(truth, noise=0.02, structureless=True))
    ok = compare(a, b)
    assert ok["reliable"] and ok["stability"]["a"] == a["stability"]["over_seeds"]["mean"]
    bad = compare(a, mush)
    assert not bad["reliable"] and bad["stability"]["b"] < 0.8
    assert bad["changed"] and all(c["reliable"] is False for c in bad["changed"])


def test_cluster_and_compare_commands_warn(tmp_path):
    from attnkit.cli.main import main

    truth = layered_truth(4, 12)
    for name, f in (("good", make_features(truth, noise=0.005)),
                    ("mush", make_features(truth, noise=0.02, structureless=True))):
        f.save(tmp_path / name)
    r = CliRunner().invoke(main, ["cluster", str(tmp_path / "mush"), "--stability", "4", "--seeds", "10", "-q"])
    assert r.exit_code == 0, r.output
    assert "stability over 10 seeds" in r.output and "warning: stability" in r.output
    data = json.loads((tmp_path / "mush" / "clusters.json").read_text())
    assert data["stability"]["over_seeds"]["n_seeds"] == 10
    r = CliRunner().invoke(main, ["cluster", str(tmp_path / "good"), "--stability", "4", "-q"])
    assert r.exit_code == 0 and "warning" not in r.output
    r = CliRunner().invoke(main, ["compare", str(tmp_path / "good"), str(tmp_path / "mush")])
    assert r.exit_code == 0 and "unreliable" in r.output


# --- bootstrap intervals ---------------------------------------------------------------------------------
def _mean_scores(values):
    return ExampleScores({"v": np.asarray(values, dtype=float)}, lambda a: 100.0 * a["v"].mean())


def test_paired_bootstrap_of_a_constant_shift_is_exact():
    rng = np.random.default_rng(0)
    base = rng.random(200)
    lo, hi = bootstrap_delta(_mean_scores(base), _mean_scores(base + 0.05), n_boot=200)
    assert lo == pytest.approx(5.0) and hi == pytest.approx(5.0)  # paired: the noise cancels


def test_bootstrap_interval_covers_the_true_change_and_shrinks_with_n():
    rng = np.random.default_rng(1)
    widths = []
    for n in (50, 800):
        base = rng.integers(0, 2, n)
        flip = rng.random(n) < 0.1
        other = np.where(flip, 1 - base, base)
        true = 100.0 * (other.mean() - base.mean())
        lo, hi = bootstrap_delta(_mean_scores(base), _mean_scores(other), n_boot=500, seed=2)
        assert lo <= true <= hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2


def test_undefined_resamples_give_nan():
    const = ExampleScores({"p": np.ones(5), "g": np.arange(5.0)}, lambda a: spearman(a["p"], a["g"]))
    assert all(math.isnan(x) for x in bootstrap_delta(const, const, n_boot=50))
    assert percentile_interval(np.array([1.0, 2.0, 3.0]), 0.5) == (1.5, 2.5)


class FakeEvaluate:
    """Each setting's name says how many of 100 examples it gets right."""

    def __init__(self, hits):
        self.hits, self.last_examples, self.calls = hits, None, 0

    def __call__(self, iv):
        k = self.hits[self.calls]
        self.calls += 1
        v = (np.arange(100) < k).astype(float)
        self.last_examples = _mean_scores(v)
        return {"accuracy": 100.0 * v.mean()}


def test_run_settings_adds_intervals():
    iv = Intervention(np.zeros((1, 2)))
    table = run_settings("t", [Setting("baseline", iv), Setting("same", iv), Setting("worse", iv)],
                         FakeEvaluate([80, 80, 60]), "accuracy", progress=False, n_boot=300)
    base, same, worse = table.rows
    assert base["delta_accuracy_lo"] == base["delta_accuracy_hi"] == 0.0
    assert same["delta_accuracy_lo"] == same["delta_accuracy_hi"] == 0.0
    assert worse["delta_accuracy_hi"] < 0 < -worse["delta_accuracy_lo"] and worse["delta_accuracy"] == -20.0
    assert worse["delta_accuracy_lo"] < -20 < worse["delta_accuracy_hi"]
    assert "delta_accuracy_lo" in table.to_markdown()


# --- Clark summaries ---------------------------------------------------------------------------------------
def _features(**per_feature):
    from attnkit.features import feature_names

    names = feature_names(16)
    L, H = 6, 4
    mean = np.zeros((L, H, len(names)))
    mean[..., names.index("entropy")] = 2.0
    mean[..., names.index("cls_entropy")] = 2.5
    for k, v in per_feature.items():
        mean[..., names.index(k)] = v
    return HeadFeatures(mean, np.zeros_like(mean), names, n_samples=10, n_tokens=200, meta={})


def test_thresholds_and_baseline():
    f = _features()
    names = f.names
    f.mean[0, 1, names.index("prev")] = 0.7
    f.mean[1, 2, names.index("next")] = 0.55
    f.mean[3, 0, names.index("sep")] = 0.65
    f.mean[0, 3, names.index("entropy")] = 2.9  # 0.8 · ln 20 = 2.40
    s = layer_summaries(f)
    assert s["n_mean_tokens"] == 20 and s["uniform_entropy"] == pytest.approx(math.log(20))
    th = threshold_heads(f)
    assert th["previous token"] == [{"layer": 0, "head": 1, "value": pytest.approx(0.7)}]
    assert [(r["layer"], r["head"]) for r in th["next token"]] == [(1, 2)]
    assert [(r["layer"], r["head"]) for r in th["[SEP]"]] == [(3, 0)]
    assert [(r["layer"], r["head"]) for r in th["broad"]] == [(0, 3)]
    assert th["[CLS]"] == []


def test_paper_differences():
    cls_sink = _features(cls=0.5, sep=0.1)
    notes = paper_differences(cls_sink)
    assert any("sink is [CLS], not [SEP]" in n for n in notes)
    assert any("No head puts more than 50%" in n for n in notes)
    like_paper = _features(cls=0.05, sep=0.5)
    like_paper.mean[0, 0, like_paper.names.index("prev")] = 0.8
    like_paper.mean[..., like_paper.names.index("entropy")] = np.linspace(2.8, 1.0, 6)[:, None]
    assert paper_differences(like_paper) == []


def test_report_shows_summaries_and_stability_warning(tmp_path):
    from attnkit.analysis.report import build_report

    f = make_features(layered_truth(4, 12), noise=0.02, structureless=True)
    f.save(tmp_path)
    c = cluster(f, k=4, n_stability=4)
    save_clusters(tmp_path, c, f, None, stability_over_seeds(f, n_seeds=10, first=c, k=4, n_stability=4))
    page = build_report(tmp_path, svg=False).read_text()
    assert "Over 10 seeds" in page and "Warning:</b> stability" in page
    assert "Per-layer summaries (Clark et al.)" in page and "Differs from the paper" in page
    assert (tmp_path / "figures" / "layer_summaries.png").is_file()


# --- smoothed JS divergences -------------------------------------------------------------------------------
def test_smoothing_matches_clark_formula():
    attn = torch.zeros(1, 2, 3, 3)
    attn[0, 0, :, 0] = 1.0  # head 0: all on token 0; head 1: all on token 1 (rows of a 2-token sample)
    attn[0, 1, :, 1] = 1.0
    lengths = torch.tensor([2])
    sm = smooth_attention(attn, lengths, 0.001)
    assert torch.allclose(sm[0, 0, 0, :2], torch.tensor([0.999 + 0.0005, 0.0005])) and sm[0, 0, 0, 2] == 0
    raw, n = js_distances(attn, lengths, use_op=False)
    smooth, _ = js_distances(attn, lengths, smoothing=0.001)
    assert raw[0, 1] == pytest.approx(2 * math.log(2))
    p, q = np.array([0.9995, 0.0005]), np.array([0.0005, 0.9995])
    m = (p + q) / 2
    js = 0.5 * np.sum(p * np.log(p / m)) + 0.5 * np.sum(q * np.log(q / m))
    assert float(smooth[0, 1]) == pytest.approx(2 * js, rel=1e-5) and float(smooth[0, 1]) < float(raw[0, 1])
    with pytest.raises(AttnkitError, match="smoothing"):
        js_distances(attn, lengths, smoothing=0.001, use_op=True)
    with pytest.raises(AttnkitError, match="smoothing must lie"):
        smooth_attention(attn, lengths, 1.5)


def test_bars_show_the_intervals_as_error_bars():
    import matplotlib.pyplot as plt

    from attnkit.ablation.experiments import ResultTable, bars_axes

    rows = [{"setting": "baseline", "accuracy": 80.0, "delta_accuracy": 0.0, "delta_accuracy_lo": 0.0,
             "delta_accuracy_hi": 0.0},
            {"setting": "L0 uniform", "accuracy": 75.0, "delta_accuracy": -5.0, "delta_accuracy_lo": -8.0,
             "delta_accuracy_hi": -2.5}]
    fig, ax = bars_axes(ResultTable("layers", "accuracy", rows))
    segs = [seg for c in ax.collections for seg in getattr(c, "get_segments", lambda: [])()]
    assert any(np.allclose(np.sort(seg[:, 0]), [-8.0, -2.5]) for seg in segs)
    lo, _ = ax.get_xlim()
    assert lo < -8.0
    plt.close(fig)
