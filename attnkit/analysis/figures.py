"""Matplotlib figures (Agg backend) that readers of Guan et al. 2020 and Clark et al. 2019 recognise.

Every function returns a `matplotlib.figure.Figure`; `save_figure` writes it as PNG and SVG.
"""
from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..errors import AttnkitError  # noqa: E402

TYPE_COLORS = {"dense": "#2ca02c", "diagonal": "#1f77b4", "dense+vertical": "#ff7f0e", "vertical": "#d62728"}
_EXTRA = ["#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"]

# heatmap panels: (title, feature names summed)
HEATMAP_FEATURES = (
    ("attention to [CLS]", ("cls",)),
    ("attention to [SEP]", ("sep",)),
    ("attention to punctuation (, .)", ("comma", "period")),
    ("entropy (nats)", ("entropy",)),
    ("attention to previous token", ("prev",)),
    ("attention to next token", ("next",)),
)


def type_colors(type_names) -> dict:
    """A fixed colour for the four Guan types, others from a qualitative palette."""
    out, j = {}, 0
    for name in type_names:
        if name in TYPE_COLORS:
            out[name] = TYPE_COLORS[name]
        else:
            out[name] = _EXTRA[j % len(_EXTRA)]
            j += 1
    return out


def save_figure(fig, directory, stem: str, *, close: bool = True, svg: bool = True) -> dict:
    """Write `directory/stem.png` and (with `svg`) `.svg`; returns {"png": path, "svg": path or None,
    "png_bytes": bytes}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    png = directory / f"{stem}.png"
    png.write_bytes(buf.getvalue())
    svg_path = None
    if svg:
        svg_path = directory / f"{stem}.svg"
        fig.savefig(svg_path, format="svg", bbox_inches="tight")
    if close:
        plt.close(fig)
    return {"png": png, "svg": svg_path, "png_bytes": buf.getvalue()}


def feature_heatmaps(features, panels=HEATMAP_FEATURES):
    """Per layer × head heatmaps of features (Clark et al. Figs. 2, 4, 6 as grids)."""
    L, H = features.mean.shape[:2]
    panels = [(t, ns) for t, ns in panels if all(n in features.names for n in ns)]
    if not panels:
        raise AttnkitError("none of the heatmap features are in this run")
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 0.45 * L * rows + 1.4 * rows), squeeze=False)
    for ax, (title, ns) in zip(axes.flat, panels):
        grid = sum(features.feature(n) for n in ns)
        im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="upper")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _scatter_types(ax, xy, labels, type_names, heads=None):
    colors = type_colors(type_names)
    for c, name in enumerate(type_names):
        sel = labels == c
        if np.any(sel):
            ax.scatter(xy[sel, 0], xy[sel, 1], s=36, c=colors[name], marker=MARKERS[c % len(MARKERS)],
                       edgecolors="black", linewidths=0.3, label=f"{name} ({int(sel.sum())})")
    if heads is not None:
        for (x, y), lab in zip(xy, heads):
            ax.annotate(lab, (x, y), fontsize=5, alpha=0.6, xytext=(2, 2), textcoords="offset points")
    ax.legend(fontsize=8, loc="best", framealpha=0.8)
    ax.set_xticks([])
    ax.set_yticks([])


def tsne_scatter(xy, labels, type_names, heads=None, title="t-SNE of head features, coloured by type"):
    """Guan et al. Fig. 2: t-SNE of the distance features, colours = K-means types."""
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    _scatter_types(ax, np.asarray(xy), np.asarray(labels), list(type_names), heads)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return fig


def mds_maps(xy, labels, type_names, layers, heads=None):
    """Clark et al. Fig. 6: MDS of the JS distances, coloured by type (left) and by layer (right)."""
    xy, layers = np.asarray(xy), np.asarray(layers)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12.5, 5.4))
    if labels is not None:
        _scatter_types(a, xy, np.asarray(labels), list(type_names), heads)
        a.set_title("MDS of Jensen-Shannon distances: head types", fontsize=11)
    else:
        a.scatter(xy[:, 0], xy[:, 1], s=30, c="gray")
        a.set_title("MDS of Jensen-Shannon distances (no clusters yet)", fontsize=11)
    n_layers = int(layers.max()) + 1
    cmap = plt.get_cmap("viridis", n_layers)
    sc = b.scatter(xy[:, 0], xy[:, 1], s=36, c=layers, cmap=cmap, vmin=-0.5, vmax=n_layers - 0.5,
                   edgecolors="black", linewidths=0.3)
    cb = fig.colorbar(sc, ax=b, ticks=range(n_layers))
    cb.set_label("layer")
    b.set_title("same map, coloured by layer", fontsize=11)
    for ax in (a, b):
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    return fig


def type_share_per_layer(labels_grid, type_names):
    """Guan et al. Fig. 3: how many heads of each type every layer has (stacked bars, shares)."""
    labels_grid = np.asarray(labels_grid)
    L, H = labels_grid.shape
    colors = type_colors(type_names)
    fig, ax = plt.subplots(figsize=(max(5.5, 0.5 * L + 3), 4.2))
    bottom = np.zeros(L)
    for c, name in enumerate(type_names):
        share = (labels_grid == c).sum(1) / H
        ax.bar(range(L), share, bottom=bottom, color=colors[name], label=name, edgecolor="white", linewidth=0.5)
        bottom += share
    ax.set_xticks(range(L))
    ax.set_xlabel("layer")
    ax.set_ylabel("share of heads")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.set_title("head types per layer", fontsize=11)
    fig.tight_layout()
    return fig


def distance_boxplots(features, labels, type_names):
    """Guan et al. Fig. 1 (bottom): box plots of the distance buckets of the heads of each type."""
    from .clustering import distance_feature_names, head_matrix

    buckets = distance_feature_names(features.names)
    X = head_matrix(features, buckets)
    labels = np.asarray(labels)
    k = len(type_names)
    colors = type_colors(type_names)
    fig, axes = plt.subplots(k, 1, figsize=(max(7.0, 0.38 * len(buckets) + 1.5), 2.3 * k), sharex=True,
                             squeeze=False)
    short = [b.replace("win_", "w") for b in buckets]
    for c, (ax, name) in enumerate(zip(axes[:, 0], type_names)):
        sel = X[labels == c]
        if len(sel):
            bp = ax.boxplot(sel, patch_artist=True, widths=0.6, showfliers=True, flierprops={"markersize": 2})
            for patch in bp["boxes"]:
                patch.set_facecolor(colors[name])
                patch.set_alpha(0.7)
        ax.set_ylabel("weight")
        ax.set_title(f"{name}: {len(sel)} heads", fontsize=10, loc="left")
        ax.set_ylim(bottom=0)
    axes[-1, 0].set_xticks(range(1, len(buckets) + 1))
    axes[-1, 0].set_xticklabels(short, rotation=60, fontsize=8)
    fig.tight_layout()
    return fig


def stability_sweep(rows):
    """Stability and silhouette against k (from `attnkit.analysis.sweep`)."""
    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    ax.plot(ks, [r["stability"] for r in rows], "o-", label="stability (share of heads stable in all fits)")
    if all("stability_min" in r for r in rows):
        ax.fill_between(ks, [r["stability_min"] for r in rows], [r["stability_max"] for r in rows], alpha=0.2,
                        label=f"range over {rows[0].get('n_seeds', '')} seeds")
    ax.plot(ks, [r["silhouette"] for r in rows], "s--", label="silhouette")
    ax.set_xlabel("k (number of clusters)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def attention_examples(examples, max_tokens: int = 40):
    """A grid of example attention maps: `examples` is a list of dicts with keys type, layer, head,
    weights (n × n numpy), tokens (n strings). Rows: types; columns: examples of that type."""
    if not examples:
        raise AttnkitError("no example attention maps to draw")
    types = list(dict.fromkeys(e["type"] for e in examples))
    per = {t: [e for e in examples if e["type"] == t] for t in types}
    cols = max(len(v) for v in per.values())
    fig, axes = plt.subplots(len(types), cols, figsize=(3.3 * cols, 3.3 * len(types)), squeeze=False)
    for r, t in enumerate(types):
        for c in range(cols):
            ax = axes[r, c]
            if c >= len(per[t]):
                ax.axis("off")
                continue
            e = per[t][c]
            w = np.asarray(e["weights"])[:max_tokens, :max_tokens]
            toks = list(e["tokens"])[:max_tokens]
            ax.imshow(w, cmap="Blues", vmin=0, vmax=max(float(w.max()), 1e-6), interpolation="nearest")
            ax.set_title(f"{t}: L{e['layer']} H{e['head']}", fontsize=9)
            if len(toks) <= 40:
                ax.set_xticks(range(len(toks)))
                ax.set_xticklabels(toks, rotation=90, fontsize=4)
                ax.set_yticks(range(len(toks)))
                ax.set_yticklabels(toks, fontsize=4)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
    fig.tight_layout()
    return fig


__all__ = ["save_figure", "feature_heatmaps", "tsne_scatter", "mds_maps", "type_share_per_layer",
           "distance_boxplots", "stability_sweep", "attention_examples", "type_colors"]
