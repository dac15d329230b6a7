"""Figures of the ablation tables: changes of the main metric from the baseline, on axes through 0 (a bar's
length is the change, not the score), with the paired bootstrap intervals as error bars.

* `heads`: a layer × head grid of the change when each head alone is disabled (Kovaleva et al. Fig. 8);
* `best_head`: the same grid of the change when each head alone of its layer is kept (Michel et al. Table 4);
* `patching`: the same grid of the share of the clean − corrupted gap that patching each head restores;
* `types`, `layers`: one bar per setting;
* `importance`: head importance and the pruning curve (Michel et al.); an encoder–decoder's one curve per kind of
  attention pruned alone beside the curve over all heads.
"""
from __future__ import annotations

import os

import numpy as np

from ..plotting import head_grid, plt, save_figure_file
from .experiments import ResultTable
from .translation import TRANSLATION_METRICS


def heads_axes(table: ResultTable, shape, title: str = ""):
    """Kovaleva et al. Fig. 8: Δ of the main metric when each head alone is disabled, as a layer × head grid
    ("*": the bootstrap interval excludes 0 by more than the Monte-Carlo noise of its ends, the row's
    `delta_<metric>_excludes_0`). Returns (figure, axes)."""
    key = f"delta_{table.main_metric}"
    grid = np.full(shape, np.nan)
    for r in table.rows[1:]:
        grid[r["layer"], r["head"]] = r[key]
    lim = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
    lim = lim or 1.0
    sure = np.zeros(shape, dtype=bool)  # the bootstrap interval excludes 0, beyond the Monte-Carlo noise of its ends
    for r in table.rows[1:]:
        sure[r["layer"], r["head"]] = bool(r.get(f"{key}_excludes_0", False))
    labels = [[f"{v:.1f}" + ("*" if sure[l, h] else "") if np.isfinite(v) else "" for h, v in enumerate(row)]
              for l, row in enumerate(grid)]
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * shape[1], 1.0 + 0.5 * shape[0]))
    patching = table.experiment == "patching"
    head_grid(ax, grid, labels=labels, cmap="RdBu", vmin=-lim, vmax=lim, fontsize=7,
              colorbar={"label": "% of the clean − corrupted gap restored" if patching else f"Δ {table.main_metric}"})
    base = table.rows[0][table.main_metric]
    has_ci = any(f"{key}_lo" in r for r in table.rows)
    default = ("share of the clean − corrupted gap that patching one head restores (%)" if patching
               else f"Δ {table.main_metric} when only this head of its layer is kept (baseline {base:.2f})"
               if table.experiment == "best_head"
               else f"Δ {table.main_metric} when one head is disabled (baseline {base:.2f})")
    ax.set_title((title or default) + ("\n* the 95% bootstrap interval excludes 0" if has_ci else ""), fontsize=9)
    fig.tight_layout()
    return fig, ax


def _error_bars(table: ResultTable, rows, metric: str | None = None) -> np.ndarray | None:
    """2 × len(rows) distances from each row's change of `metric` (default: the main metric) to the ends of its
    bootstrap interval (for `xerr`/`yerr`); None when the table has no intervals."""
    key = f"delta_{metric or table.main_metric}"
    if not any(f"{key}_lo" in r for r in rows):
        return None
    lo = [r[key] - r.get(f"{key}_lo", np.nan) for r in rows]
    hi = [r.get(f"{key}_hi", np.nan) - r[key] for r in rows]
    return np.clip(np.array([lo, hi], dtype=np.float64), 0.0, None)


def _with_interval_ends(values, err) -> list:
    """`values` and, with error bars, the ends of their intervals (for axis limits)."""
    values = list(values)
    if err is None:
        return values
    return values + [v - e for v, e in zip(values, err[0])] + [v + e for v, e in zip(values, err[1])]


def _deltas(table: ResultTable, metric: str | None = None) -> tuple[float, np.ndarray]:
    """(baseline value, Δ of `metric` (default: the main metric) from the baseline for every row); NaN where
    unknown."""
    metric = metric or table.main_metric
    base = table.rows[0].get(metric)
    base = float("nan") if base is None else float(base)
    out = []
    for r in table.rows:
        v = r.get(f"delta_{metric}")
        if v is None and r.get(metric) is not None:
            v = float(r[metric]) - base
        out.append(float("nan") if v is None else float(v))
    return base, np.asarray(out, dtype=np.float64)


def _zero_centred_limits(values, min_half_span: float = 1.0) -> tuple[float, float]:
    """Axis limits that contain 0 and every finite value, with a margin; at least ±`min_half_span`
    wide so that noise of a few hundredths of a point does not fill the axis."""
    finite = [float(v) for v in values if np.isfinite(v)]
    lo, hi = min(finite + [0.0]), max(finite + [0.0])
    if hi - lo < 2 * min_half_span:
        mid_pad = (2 * min_half_span - (hi - lo)) / 2
        lo, hi = lo - mid_pad, hi + mid_pad
    pad = 0.1 * (hi - lo)  # room for the value printed beside a short bar
    return min(lo - pad, -pad), max(hi + pad, pad)


def _absolute_axis(ax, base: float, metric: str, which: str) -> None:
    """A second axis (top or right) in absolute values of the metric, when the baseline is known."""
    if not np.isfinite(base):
        return
    fns = (lambda d: d + base, lambda m: m - base)
    sec = ax.secondary_xaxis("top", functions=fns) if which == "x" else ax.secondary_yaxis("right", functions=fns)
    (sec.set_xlabel if which == "x" else sec.set_ylabel)(metric, fontsize=8)
    sec.tick_params(labelsize=7)


LABEL_ROOM = 0.12  # share of the axis added on each side for the printed values


def bars_axes(table: ResultTable, title: str = ""):
    """One bar per setting: Δ of the main metric from the baseline, on an axis through 0 (a bar's
    length is the change, not the score). Returns (figure, axes); the top axis reads absolute scores."""
    base, deltas = _deltas(table)
    rows, d = table.rows[1:], deltas[1:]
    metric = table.main_metric
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.3 * max(len(rows), 1)))
    colors = ["#c44e52" if v < 0 else "#4c72b0" for v in np.nan_to_num(d)]
    ax.barh(range(len(rows)), np.nan_to_num(d), color=colors, height=0.7)
    err = _error_bars(table, rows)
    if err is not None:  # the paired bootstrap 95% interval of each change
        ax.errorbar(d, range(len(rows)), xerr=err, fmt="none", ecolor="#333", capsize=2, lw=0.8)
    ends = _with_interval_ends(d, err)
    lo, hi = _zero_centred_limits(ends)
    span = hi - lo
    lo, hi = lo - LABEL_ROOM * span, hi + LABEL_ROOM * span  # room for the values beyond the intervals
    ax.set_xlim(lo, hi)
    ax.axvline(0.0, color="black", linewidth=1.0)
    span = hi - lo
    for i, v in enumerate(d):
        if not np.isfinite(v):
            ax.text(0.01 * span, i, "nan", va="center", ha="left", fontsize=7)
            continue
        # the value sits beyond the far end of the bar and of its interval, so no error bar crosses it
        sign = 1.0 if v >= 0 else -1.0
        far = v + sign * (0.0 if err is None or not np.isfinite(err[(1 if v >= 0 else 0), i])
                          else err[(1 if v >= 0 else 0), i])
        x = (max(far, 0.0) if v >= 0 else min(far, 0.0)) + sign * 0.01 * span
        ax.text(x, i, f"{v:+.2f}", va="center", ha="left" if v >= 0 else "right", fontsize=7, color="black")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["setting"] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first setting on top
    ax.set_xlabel(f"Δ {metric} from the baseline ({base:.2f})")
    ax.grid(axis="x", alpha=0.3)
    _absolute_axis(ax, base, metric, "x")
    ax.set_title(title or table.experiment, fontsize=10)
    fig.tight_layout()
    return fig, ax


def _pruning_curves(ax, table: ResultTable, metric: str, title: str) -> None:
    """The pruning curves of `metric` on `ax`: Δ from the unpruned model against the share of heads pruned, one
    curve per `kind` of an encoder–decoder's rows (all heads, and each kind pruned alone), with error bars."""
    base, deltas = _deltas(table, metric)
    curves: dict = {}  # kind → row indices
    for i, r in enumerate(table.rows):
        curves.setdefault(r.get("kind"), []).append(i)
    ends = []
    for kind, idx in curves.items():
        rows = [table.rows[i] for i in idx]
        share, d = [100 * r["share"] for r in rows], deltas[idx]
        line, = ax.plot(share, d, marker="o", label=None if kind is None else f"{kind} heads")
        err = _error_bars(table, rows, metric)
        if err is not None:  # the paired bootstrap 95% interval of each change
            ax.errorbar(share, d, yerr=err, fmt="none", ecolor=line.get_color(), capsize=2, lw=0.8)
        ends += _with_interval_ends(d, err)
    if len(curves) > 1:
        ax.legend(fontsize=8, title="pruned among", title_fontsize=8)
    ax.axhline(0.0, color="black", linewidth=1.0)
    ax.set_ylim(*_zero_centred_limits(ends))
    ax.set_xlabel("% heads pruned" if len(curves) == 1 else "% of the curve's heads pruned")
    ax.set_ylabel(f"Δ {metric} from the unpruned model ({base:.2f})")
    _absolute_axis(ax, base, metric, "y")
    ax.set_title(title)
    ax.grid(alpha=0.3)


DECODED = tuple(TRANSLATION_METRICS)  # the further metrics of a seq2seq task with --decode, drawn beside the main one


def importance_axes(table: ResultTable, title: str = ""):
    """Head importance (left) and the pruning curve as Δ of the main metric from the unpruned model on an
    axis through 0 (its right-hand axis reads absolute scores); an encoder–decoder's one curve per kind, and with
    --decode a panel each for BLEU and chrF. Returns (figure, (importance axes, curve axes...))."""
    imp = np.asarray(table.extra["importance"])
    more = [m for m in DECODED if any(f"delta_{m}" in r for r in table.rows)]
    fig, axes = plt.subplots(1, 2 + len(more), figsize=(12 + 5 * len(more), 1.5 + 0.45 * imp.shape[0]))
    a1 = axes[0]
    im = a1.imshow(imp, cmap="viridis", aspect="auto")
    a1.set_xlabel("head")
    a1.set_ylabel("layer")
    a1.set_xticks(range(imp.shape[1]))
    a1.set_yticks(range(imp.shape[0]))
    a1.set_title("head importance |∂L/∂ξ| (layer-normalised)" if table.extra.get("normalize_layers") else
                 "head importance |∂L/∂ξ|")
    fig.colorbar(im, ax=a1)
    for ax, metric in zip(axes[1:], [table.main_metric, *more]):
        _pruning_curves(ax, table, metric, (title or "iterative pruning by importance") if metric ==
                        table.main_metric else f"{metric} of the greedy translations")
    fig.tight_layout()
    return fig, tuple(axes)


def save_figure(table: ResultTable, shape, out_dir: str, title: str = "") -> str:
    """Draw the experiment's figure into `out_dir`/<experiment>.png, atomically (a failed write leaves neither a
    partial figure nor a temporary file, only a one-line error)."""
    if table.experiment in ("heads", "patching", "best_head"):
        fig, _ = heads_axes(table, shape, title)
    elif table.experiment == "importance":
        fig, _ = importance_axes(table, title)
    else:
        fig, _ = bars_axes(table, title)
    return str(save_figure_file(fig, os.path.join(out_dir, f"{table.experiment}.png")))


__all__ = ["bars_axes", "heads_axes", "importance_axes", "save_figure"]
