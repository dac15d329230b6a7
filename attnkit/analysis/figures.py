"""Matplotlib figures that readers of Guan et al. 2020 and Clark et al. 2019 recognise.

Every function returns a `matplotlib.figure.Figure`; `attnkit.plotting.save_figure` writes it as PNG and SVG
(re-exported here, where the report and older code found it).
"""
from __future__ import annotations

import numpy as np

from ..errors import AttnkitError
from ..plotting import plt, save_figure
from .clustering import distance_feature_names, head_matrix

TYPE_COLORS = {"dense": "#2ca02c", "diagonal": "#1f77b4", "dense+vertical": "#ff7f0e", "vertical+dense": "#ff7f0e",
               "vertical": "#d62728", "first-token": "#d62728", "previous-token": "#1f77b4", "local": "#aec7e8",
               "broad": "#2ca02c"}
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


# a decoder run's panels (docs/analysis.md, "The report"): `cls` is the first position, `sep` its EOS tokens, and
# no row sees a next token
DECODER_HEATMAP_FEATURES = (
    ("attention to the first token", ("cls",)),
    ("attention to punctuation (, .)", ("comma", "period")),
    ("entropy (nats)", ("entropy",)),
    ("attention to previous token", ("prev",)),
    ("mass on the learned sink", ("sink",)),
)


def type_colors(type_names) -> dict:
    """A fixed colour for the plain classes (and Guan's dense+vertical), others from a qualitative palette."""
    out, j = {}, 0
    for name in type_names:
        if name in TYPE_COLORS:
            out[name] = TYPE_COLORS[name]
        else:
            out[name] = _EXTRA[j % len(_EXTRA)]
            j += 1
    return out


def feature_heatmaps(features, panels=HEATMAP_FEATURES):
    """Per layer × head heatmaps of features (Clark et al. Figs. 2, 4, 6 as grids)."""
    panels = [(t, ns) for t, ns in panels if all(n in features.names for n in ns)]
    if not panels:
        raise AttnkitError("none of the heatmap features are in this run")
    return grid_heatmaps([(title, sum(features.feature(n) for n in ns)) for title, ns in panels],
                         layer_labels=features.layer_labels())


def grid_heatmaps(panels, *, vmin=None, vmax=None, layer_labels=None):
    """One layer × head heatmap per (title, L × H grid) of `panels`, three to a row; NaN (a removed head) blank;
    `layer_labels`: the rows' names (default: their numbers)."""
    L, H = np.shape(panels[0][1])
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 0.45 * L * rows + 1.4 * rows), squeeze=False)
    for ax, (title, grid) in zip(axes.flat, panels):
        im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="upper", vmin=vmin, vmax=vmax)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L), labels=layer_labels)
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


MAX_HEAD_LABELS = 14
LABEL_FONTSIZE = 8
# offsets (points) tried for a head label, nearest first: right/above, right/below, left/above, ...
_LABEL_OFFSETS = ((5, 4, "left", "bottom"), (5, -4, "left", "top"), (-5, 4, "right", "bottom"),
                  (-5, -4, "right", "top"), (0, 8, "center", "bottom"), (0, -8, "center", "top"))


def label_candidates(xy, labels, max_labels: int = MAX_HEAD_LABELS) -> list[int]:
    """Heads worth naming on a 2-D map, most telling first, at most `max_labels`.

    First, per type, the head nearest the type's mean position (its most typical member); then the
    extremes: each type's heads in decreasing distance from the centre of the whole map, taken from
    the types in turn so that every type gets names. The map's axes are scaled by their spread first,
    so a long, thin map does not favour one direction.
    """
    xy = np.asarray(xy, dtype=np.float64)
    labels = np.asarray(labels)
    if len(xy) == 0 or max_labels <= 0:
        return []
    spread = xy.std(0)
    z = (xy - np.median(xy, 0)) / np.where(spread > 0, spread, 1.0)
    radius = (z**2).sum(1)
    chosen: list[int] = []
    queues = []
    for c in dict.fromkeys(labels.tolist()):
        members = np.flatnonzero(labels == c)
        centre = z[members].mean(0)
        chosen.append(int(members[np.argmin(((z[members] - centre) ** 2).sum(1))]))
        queues.append([int(m) for m in members[np.argsort(-radius[members], kind="stable")]])
    for rank in range(max((len(q) for q in queues), default=0)):
        chosen += [q[rank] for q in queues if rank < len(q) and q[rank] not in chosen]
    return chosen[:max_labels]


def _overlaps(box, boxes, pad: float = 2.0) -> bool:
    return any(box.x0 - pad < b.x1 and b.x0 < box.x1 + pad and box.y0 - pad < b.y1 and b.y0 < box.y1 + pad
               for b in boxes)


def place_head_labels(ax, xy, names, order, *, fontsize: float = LABEL_FONTSIZE) -> list:
    """Annotate the heads `order` (indices into xy/names) without overlaps; returns the annotations.

    Call it once the figure's layout is final (after tight_layout): label positions are checked in
    display coordinates. Each label tries a few offsets around its point and takes the first that
    stays inside the axes, overlaps no label placed before, and covers no other point; failing that,
    the first that only avoids the other labels and the axes' edges (on a white box); failing that,
    the head stays unlabelled.
    """
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    xy = np.asarray(xy, dtype=np.float64)
    frame = ax.get_window_extent(renderer)
    points = ax.transData.transform(xy)
    r = 4.0 * fig.dpi / 72.0  # a marker's half-width in pixels (markers are about 6.5 points wide)
    placed, boxes = [], []
    for m in order:
        accepted = None
        for strict in (True, False):
            for dx, dy, ha, va in _LABEL_OFFSETS:
                ann = ax.annotate(names[m], xy[m], xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                                  fontsize=fontsize, color="#222222", zorder=5,
                                  bbox=None if strict else dict(boxstyle="round,pad=0.1", fc="white", ec="none",
                                                                alpha=0.75))
                box = ann.get_window_extent(renderer)
                inside = (box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1)
                covers = strict and any(box.x0 - r <= px <= box.x1 + r and box.y0 - r <= py <= box.y1 + r
                                        for k, (px, py) in enumerate(points) if k != m)
                if inside and not covers and not _overlaps(box, boxes):
                    accepted = (ann, box)
                    break
                ann.remove()
            if accepted:
                break
        if accepted:
            placed.append(accepted[0])
            boxes.append(accepted[1])
    return placed


def _scatter_types(ax, xy, labels, type_names):
    colors = type_colors(type_names)
    for c, name in enumerate(type_names):
        sel = labels == c
        if np.any(sel):
            ax.scatter(xy[sel, 0], xy[sel, 1], s=40, c=colors[name], marker=MARKERS[c % len(MARKERS)],
                       edgecolors="black", linewidths=0.3, label=f"{name} ({int(sel.sum())})", zorder=3)
    # outside the axes, so that it hides no point and no head label
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, framealpha=0.9)
    ax.set_xticks([])
    ax.set_yticks([])


def _label_heads(ax, xy, labels, heads, max_labels):
    if heads is None or max_labels <= 0:
        return
    ax.figure.canvas.draw()  # fix the layout so label extents are measured where they will be drawn
    place_head_labels(ax, xy, list(heads), label_candidates(xy, labels, max_labels))


def tsne_scatter(xy, labels, type_names, heads=None, title="t-SNE of head features, coloured by type",
                 max_labels: int = MAX_HEAD_LABELS):
    """Guan et al. Fig. 2: t-SNE of the distance features, colours = K-means types. With `heads` (names in
    the order of xy), up to `max_labels` typical and extreme heads are named (see `label_candidates`)."""
    xy, labels = np.asarray(xy), np.asarray(labels)
    fig, ax = plt.subplots(figsize=(8.0, 5.6))
    _scatter_types(ax, xy, labels, list(type_names))
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    _label_heads(ax, xy, labels, heads, max_labels)
    return fig


def mds_maps(xy, labels, type_names, layers, heads=None, max_labels: int = MAX_HEAD_LABELS):
    """Clark et al. Fig. 6: MDS of the JS distances, coloured by type (left) and by layer (right).
    Head names as in `tsne_scatter`, on the left map."""
    xy, layers = np.asarray(xy), np.asarray(layers)
    fig, (a, b) = plt.subplots(1, 2, figsize=(14.5, 5.8), gridspec_kw={"width_ratios": [1.0, 0.9]})
    if labels is not None:
        _scatter_types(a, xy, np.asarray(labels), list(type_names))
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
    _label_heads(a, xy, np.zeros(len(xy), dtype=int) if labels is None else np.asarray(labels), heads, max_labels)
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
    weights (n × n numpy), tokens (n strings). Rows: types; columns: examples of that type. Every map
    has its own colour bar (its scale runs from 0 to its largest weight)."""
    from ..tokens import shown_token  # torch is loaded: a model drew the maps

    if not examples:
        raise AttnkitError("no example attention maps to draw")
    types = list(dict.fromkeys(e["type"] for e in examples))
    per = {t: [e for e in examples if e["type"] == t] for t in types}
    cols = max(len(v) for v in per.values())
    fig, axes = plt.subplots(len(types), cols, figsize=(4.8 * cols, 4.6 * len(types)), squeeze=False)
    for r, t in enumerate(types):
        for c in range(cols):
            ax = axes[r, c]
            if c >= len(per[t]):
                ax.axis("off")
                continue
            e = per[t][c]
            w = np.asarray(e["weights"])[:max_tokens, :max_tokens]
            toks = [shown_token(str(t)) for t in e["tokens"]][:max_tokens]
            im = ax.imshow(w, cmap="Blues", vmin=0, vmax=max(float(w.max()), 1e-6), interpolation="nearest")
            cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
            cb.ax.tick_params(labelsize=7)
            ax.set_title(f"{t}: L{e['layer']} H{e['head']}", fontsize=9)
            ax.set_xlabel("key", fontsize=7)
            ax.set_ylabel("query", fontsize=7)
            size = 6 if len(toks) <= 24 else 5
            ax.set_xticks(range(len(toks)))
            ax.set_xticklabels(toks, rotation=90, fontsize=size)
            ax.set_yticks(range(len(toks)))
            ax.set_yticklabels(toks, fontsize=size)
    fig.tight_layout()
    return fig


def attention_distance_by_layer(distance, patch: int | None = None):
    """Dosovitskiy et al. (ViT) Fig. 7: each head's mean attention distance (L × H, in patches; NaN: a removed head)
    against its layer, one point per head. `patch`: the patch size in pixels, for a second axis in pixels."""
    d = np.asarray(distance, dtype=np.float64)
    L, H = d.shape
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * L + 3), 4.0))
    layers = np.repeat(np.arange(L), H)
    jitter = (np.tile(np.arange(H), L) - (H - 1) / 2) * (0.5 / max(H, 1))  # the heads of a layer side by side
    ax.scatter(layers + jitter, d.ravel(), s=22, color="#1f77b4", alpha=0.8, edgecolors="white", linewidths=0.4)
    ax.set_xticks(range(L))
    ax.set_xlim(-0.6, L - 0.4)
    ax.set_xlabel("layer (network depth)")
    ax.set_ylabel("mean attention distance (patches)")
    top = np.nanmax(d) if np.isfinite(d).any() else 1.0
    ax.set_ylim(0, 1.08 * top if top > 0 else 1.0)
    if patch:
        px = ax.secondary_yaxis("right", functions=(lambda x: x * patch, lambda x: x / patch))
        px.set_ylabel("pixels")
    ax.set_title("mean attention distance of each head by layer", fontsize=11)
    fig.tight_layout()
    return fig


def cls_attention_maps(maps, image=None):
    """DINO's figure (Caron et al. 2021, Fig. 1): for one image, each head's attention from [CLS] to the patches
    (`maps`, layers × heads × rows × columns), a small heatmap per head, layers down and heads across, each scaled
    to its own maximum; `image` (H × W × 3 uint8, as the model saw it) drawn first in the top-left corner."""
    m = np.asarray(maps, dtype=np.float64)
    L, H = m.shape[:2]
    cols = H + (image is not None)
    fig, axes = plt.subplots(L, cols, figsize=(0.9 * cols + 0.6, 0.9 * L + 0.6), squeeze=False)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_frame_on(False)
    for layer in range(L):
        axes[layer, 0].set_ylabel(f"L{layer}", fontsize=7, rotation=0, labelpad=10)
        for h in range(H):
            ax = axes[layer, h + (image is not None)]
            ax.imshow(m[layer, h], cmap="inferno", interpolation="nearest")
            if layer == 0:
                ax.set_title(f"H{h}", fontsize=7)
    if image is not None:
        axes[0, 0].imshow(image)
        axes[0, 0].set_title("image", fontsize=7)
    fig.suptitle("[CLS] attention over the patches, per head", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["DECODER_HEATMAP_FEATURES", "save_figure", "feature_heatmaps", "grid_heatmaps",
           "tsne_scatter", "mds_maps", "type_share_per_layer",
           "distance_boxplots", "stability_sweep", "attention_examples", "type_colors", "label_candidates",
           "place_head_labels", "attention_distance_by_layer", "cls_attention_maps"]
