"""Ablation figures show changes from the baseline on an axis through zero (not scores on an axis that
starts near the data, which makes small changes look large)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from attnkit.ablation.experiments import ResultTable  # noqa: E402
from attnkit.ablation.figures import bars_axes, importance_axes, save_figure  # noqa: E402


def types_table():
    base = 82.1
    scores = {"prune dense": 81.9, "prune vertical": 81.6, "substitute dense & vertical": 81.75,
              "remove intra of dense": float("nan")}
    rows = [{"setting": "baseline", "spearman": base, "n": 50, "delta_spearman": 0.0}]
    rows += [{"setting": k, "spearman": v, "n": 50, "delta_spearman": v - base} for k, v in scores.items()]
    return ResultTable("types", "spearman", rows)


def test_bars_are_deltas_on_an_axis_through_zero(tmp_path):
    table = types_table()
    fig, ax = bars_axes(table)
    lo, hi = ax.get_xlim()
    assert lo < 0 < hi  # every change here is negative: an axis near the data would not reach 0
    widths = [p.get_width() for p in ax.patches]
    np.testing.assert_allclose(widths, [-0.2, -0.5, -0.35, 0.0], atol=1e-9)  # NaN draws no bar
    assert [t.get_text() for t in ax.get_yticklabels()] == [r["setting"] for r in table.rows[1:]]
    assert any(t.get_text() == "nan" for t in ax.texts)
    assert "Δ spearman" in ax.get_xlabel() and "82.10" in ax.get_xlabel()
    # small changes stay small: the axis spans at least ±1 point around zero, not just the data
    assert hi - lo >= 2.0
    plt.close(fig)
    path = save_figure(table, (2, 2), str(tmp_path))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_pruning_curve_is_deltas_on_an_axis_through_zero(tmp_path):
    base = 70.0
    rows = [{"setting": "baseline" if k == 0 else f"prune {k} heads", "pruned": k, "share": k / 8,
             "accuracy": base - 0.1 * k, "delta_accuracy": -0.1 * k} for k in (0, 2, 4, 6)]
    table = ResultTable("importance", "accuracy", rows, {"importance": np.random.default_rng(0).random((2, 4)),
                                                         "normalize_layers": True})
    fig, (_, curve) = importance_axes(table)
    lo, hi = curve.get_ylim()
    assert lo < 0 < hi
    line = curve.get_lines()[0]
    np.testing.assert_allclose(line.get_ydata(), [0.0, -0.2, -0.4, -0.6])
    np.testing.assert_allclose(line.get_xdata(), [0, 25, 50, 75])
    plt.close(fig)
    assert save_figure(table, (2, 4), str(tmp_path)).endswith("importance.png")


def test_bars_show_the_intervals_as_error_bars():
    import matplotlib.pyplot as plt

    from attnkit.ablation.experiments import ResultTable
    from attnkit.ablation.figures import bars_axes

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


def test_value_labels_do_not_sit_on_the_error_bars():
    """Every printed change lies beyond its bar and interval, inside the axes, and overlaps no error bar."""
    rows = [{"setting": "baseline", "accuracy": 80.0, "delta_accuracy": 0.0}]
    cases = [(-5.0, -8.0, -2.5), (-0.3, -1.2, 0.4), (2.0, 0.5, 3.1), (-12.0, -14.0, -11.0), (0.1, -0.2, 0.3)]
    for i, (d, lo, hi) in enumerate(cases):
        rows.append({"setting": f"L{i} uniform", "accuracy": 80 + d, "delta_accuracy": d, "delta_accuracy_lo": lo,
                     "delta_accuracy_hi": hi})
    fig, ax = bars_axes(ResultTable("layers", "accuracy", rows))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith(("+", "-"))]
    assert [t.get_text() for t in labels] == [f"{d:+.2f}" for d, _, _ in cases]
    frame = ax.get_window_extent(renderer)
    segs = [seg for c in ax.collections for seg in getattr(c, "get_segments", lambda: [])()]
    bar_boxes = [ax.transData.transform(seg) for seg in segs]  # error bars and caps, in pixels
    for t in labels:
        box = t.get_window_extent(renderer)
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1  # inside the axes
        for pts in bar_boxes:
            x0, x1 = sorted(pts[:, 0])
            y0, y1 = sorted(pts[:, 1])
            overlaps = box.x0 < x1 + 1 and x0 - 1 < box.x1 and box.y0 < y1 + 1 and y0 - 1 < box.y1
            assert not overlaps, (t.get_text(), pts)
    plt.close(fig)


def test_csv_layers_and_heads_are_integers(tmp_path):
    rows = [{"setting": "baseline", "layer": None, "head": None, "spearman": 80.0, "n": 50},
            {"setting": "L3H5 zero", "layer": 3, "head": 5, "spearman": 79.5, "n": 50, "delta_spearman": -0.5}]
    paths = ResultTable("heads", "spearman", rows).save(str(tmp_path))
    lines = open(paths["csv"]).read().splitlines()
    assert lines[0] == "setting,layer,head,spearman,n,delta_spearman"
    assert lines[1] == "baseline,,,80.0,50," and lines[2] == "L3H5 zero,3,5,79.5,50,-0.5"


def test_heads_grid_stars_only_intervals_clear_of_zero_beyond_monte_carlo_noise():
    """The star follows the row's delta_<metric>_excludes_0 (decided with the Monte-Carlo noise of the interval's
    ends), not the interval's ends alone: an end at +0.0001 that other resamples could put below 0 gets none."""
    from attnkit.ablation.figures import heads_axes

    rows = [{"setting": "baseline", "layer": None, "head": None, "accuracy": 80.0, "delta_accuracy": 0.0},
            {"setting": "L0H0 zero", "layer": 0, "head": 0, "accuracy": 79.0, "delta_accuracy": 1.0,
             "delta_accuracy_lo": 0.0001, "delta_accuracy_hi": 2.0, "delta_accuracy_excludes_0": False},
            {"setting": "L0H1 zero", "layer": 0, "head": 1, "accuracy": 78.0, "delta_accuracy": -2.0,
             "delta_accuracy_lo": -3.0, "delta_accuracy_hi": -1.0, "delta_accuracy_excludes_0": True}]
    fig, ax = heads_axes(ResultTable("heads", "accuracy", rows), (1, 2))
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == ["-2.0*", "1.0"]
    plt.close(fig)


def test_tables_write_every_settings_per_example_outputs(tmp_path):
    import pandas as pd

    from .synthetic import mean_scores

    ex = [mean_scores([1.0, 0.0, 1.0]), mean_scores([0.0, 0.0, 1.0])]
    rows = [{"setting": "baseline", "accuracy": 66.7}, {"setting": "L0 uniform", "accuracy": 33.3}]
    paths = ResultTable("layers", "accuracy", rows, examples=ex).save(str(tmp_path))
    frame = pd.read_csv(paths["examples"])
    assert list(frame.columns) == ["setting", "example", "v"]
    assert frame["setting"].tolist() == ["baseline"] * 3 + ["L0 uniform"] * 3
    assert frame["v"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0] and frame["example"].tolist() == [0, 1, 2] * 2
