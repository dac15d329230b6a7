"""Drawing and saving figures: matplotlib on its non-interactive Agg backend, figures written atomically.

Every module that draws imports pyplot from here (`from attnkit.plotting import plt`), so the Agg backend is
chosen before pyplot loads, whoever imports first. The figures themselves live with what they show:
attnkit/analysis/figures.py (head types, maps), attnkit/ablation/figures.py (ablation tables),
attnkit/probe/run.py (probe accuracies), attnkit/jobs/compare.py (two models).
"""
from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..run.outputs import atomic_write, os_errors  # noqa: E402


def figure_bytes(fig, fmt: str = "png", dpi: int = 110, **kwargs) -> bytes:
    """`fig` rendered as `fmt` (png, svg) in memory."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi, **kwargs)
    return buf.getvalue()


def save_figure(fig, directory, stem: str, *, close: bool = True, svg: bool = True) -> dict:
    """Write `directory/stem.png` and (with `svg`) `.svg`, each atomically; returns {"png": path, "svg": path or
    None, "png_bytes": bytes} (the report embeds the bytes)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    png_bytes = figure_bytes(fig, "png", bbox_inches="tight")
    png = directory / f"{stem}.png"
    atomic_write(png, lambda f: f.write(png_bytes))
    svg_path = None
    if svg:
        svg_bytes = figure_bytes(fig, "svg", bbox_inches="tight")
        svg_path = directory / f"{stem}.svg"
        atomic_write(svg_path, lambda f: f.write(svg_bytes))
    if close:
        plt.close(fig)
    return {"png": png, "svg": svg_path, "png_bytes": png_bytes}


def save_figure_file(fig, path, *, dpi: int = 130) -> Path:
    """Write `fig` to the one file `path` (its format from the suffix), atomically, and close it: a failed
    write (full disk, ...) leaves neither a partial figure nor a temporary file, only a one-line error."""
    path = Path(path)
    try:
        with os_errors("write the figure"):
            data = figure_bytes(fig, path.suffix.lstrip(".") or "png", dpi=dpi)
        atomic_write(path, lambda f: f.write(data))
    finally:
        plt.close(fig)
    return path


def fitted_scale(grid, min_span: float = 1e-3) -> tuple[float, float, int]:
    """(vmin, vmax, digits) of a colour scale fitted to the finite values of `grid` (at least `min_span` wide), and
    the decimals a cell label needs for neighbouring values on it to read differently (2 to 4)."""
    finite = np.asarray(grid, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return 0.0, 1.0, 2
    lo, hi = float(finite.min()), float(finite.max())
    if hi - lo < min_span:
        mid = (hi + lo) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    digits = int(min(4, max(2, np.ceil(-np.log10(hi - lo)) + 1)))
    return lo, hi, digits


def head_grid(ax, grid, *, labels=None, cmap: str = "viridis", vmin=None, vmax=None, fontsize: float = 6,
              dark_below: float | None = None, colorbar: dict | None = None):
    """Draw a layers × heads `grid` on `ax` (layers down, heads across, ticks on every one), with `labels`
    (a grid of strings, or a format such as "{:.2f}" for the finite cells) written in the cells: white on
    cells below `dark_below`, black elsewhere; `colorbar`: the arguments of a colour bar beside it. Returns
    the image. The layer × head heatmaps of attnkit (ablation, probes, two models) are drawn with it."""
    grid = np.asarray(grid, dtype=np.float64)
    im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    n_layers, n_heads = grid.shape
    if labels is not None:
        for (l, h), v in np.ndenumerate(grid):
            text = labels.format(v) if isinstance(labels, str) else labels[l][h]
            if text == "" or (isinstance(labels, str) and not np.isfinite(v)):
                continue
            dark = dark_below is not None and v < dark_below
            ax.text(h, l, text, ha="center", va="center", fontsize=fontsize, color="white" if dark else "black")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    if colorbar is not None:
        ax.figure.colorbar(im, ax=ax, **colorbar)
    return im


__all__ = ["figure_bytes", "fitted_scale", "head_grid", "plt", "save_figure", "save_figure_file"]
