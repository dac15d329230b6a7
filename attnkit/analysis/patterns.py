"""Kovaleva et al. (2019, Sec. 4) pattern types of each (example, head), from per-sample features.

Kovaleva et al. label attention maps by eye (then with a CNN) as one of five classes. attnkit labels each
(example, head) by written rules on that example's features (RUN/per_sample.npy, `attnkit extract
--per-sample`; every feature is a mean over the example's query rows, see docs/features.md; the rules are
docs/patterns.md's):

    vertical mass  v = cls + sep                    attention to the special tokens (vertical stripes)
    diagonal mass  d = prev + next + self           attention next to the main diagonal (incl. itself)

1. structured, when v + d ≥ STRUCTURED_MIN:
     - both v ≥ MIX_PART_MIN and d ≥ MIX_PART_MIN   → vertical+diagonal
     - otherwise the larger of v and d              → vertical, or diagonal
2. block, when the example has two segments (a text pair) and intra ≥ BLOCK_INTRA_MIN: the head keeps
   inside the query's own sentence ("intra-sentence attention for tasks with two distinct sentences").
   For single texts intra is 1 by construction, so block is never assigned to them.
3. heterogeneous: everything else (Kovaleva's class is also "none of the above").

Whether an example is a pair is given by the caller (`pairs`); by default it is read from the features:
an example has a second sentence when its `inter` mass is above zero (softmax never gives exactly 0 to a
key it can see, so a single-sentence example is the only way to get inter = 0; float16 storage rounds
masses below ~6e-8 to 0, which only matters for heads that are block by any measure).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..run.files import FIGURES_DIR, PATTERNS_FILE
from ..run.outputs import write_json
from ..run.per_sample import check_matches_run, load_per_sample

CLASSES = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")
VERTICAL, DIAGONAL, MIXED, BLOCK, HETEROGENEOUS = range(5)
VERTICAL_FEATURES = ("cls", "sep")
DIAGONAL_FEATURES = ("prev", "next", "self")
STRUCTURED_MIN = 0.5   # v + d at least this: the map is dominated by stripes and/or the diagonal band
MIX_PART_MIN = 0.2     # each of v and d at least this: vertical+diagonal
BLOCK_INTRA_MIN = 0.8  # share of a row's mass inside its own sentence for block (pairs only)

PATTERN_COLORS = {"vertical": "#d62728", "diagonal": "#1f77b4", "vertical+diagonal": "#ff7f0e",
                  "block": "#9467bd", "heterogeneous": "#2ca02c"}


def rules() -> dict:
    return {"vertical_mass": "+".join(VERTICAL_FEATURES), "diagonal_mass": "+".join(DIAGONAL_FEATURES),
            "structured_min": STRUCTURED_MIN, "mix_part_min": MIX_PART_MIN, "block_intra_min": BLOCK_INTRA_MIN}


def _index(names, wanted) -> list[int]:
    names = list(names)
    missing = [n for n in wanted if n not in names]
    if missing:
        raise AttnkitError(f"the per-sample features lack {', '.join(missing)} (needed for the pattern rules)")
    return [names.index(n) for n in wanted]


def classify(features, names, pairs=None) -> np.ndarray:
    """Class ids (see CLASSES) of every (example, …, head) for features `... × F` (e.g. N × layers × heads × F).

    `pairs`: None (infer from `inter` > 0 per example and head), a bool, or a bool array broadcastable to
    the leading dims (e.g. shape (N, 1, 1) for one flag per example).
    """
    x = np.asarray(features, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] != len(list(names)):
        raise AttnkitError(f"features of shape {x.shape} do not end in the {len(list(names))} named features")
    v = x[..., _index(names, VERTICAL_FEATURES)].sum(-1)
    d = x[..., _index(names, DIAGONAL_FEATURES)].sum(-1)
    intra = x[..., _index(names, ("intra",))[0]]
    if pairs is None:
        pairs = x[..., _index(names, ("inter",))[0]] > 0
    pairs = np.broadcast_to(np.asarray(pairs, dtype=bool), v.shape)
    out = np.full(v.shape, HETEROGENEOUS, dtype=np.int8)
    block = pairs & (intra >= BLOCK_INTRA_MIN)
    out[block] = BLOCK
    structured = (v + d) >= STRUCTURED_MIN
    out[structured & (v >= d)] = VERTICAL
    out[structured & (d > v)] = DIAGONAL
    out[structured & (v >= MIX_PART_MIN) & (d >= MIX_PART_MIN)] = MIXED
    return out


def class_counts(per_sample, names, *, pairs=None, chunk: int = 4096) -> np.ndarray:
    """layers × heads × 5 counts of examples per class, streaming over `per_sample` (N × layers × heads × F,
    e.g. the memory-mapped per_sample.npy) `chunk` examples at a time. `pairs`: None, a bool, or one bool
    per example."""
    if per_sample.ndim != 4:
        raise AttnkitError(f"per-sample features must be N × layers × heads × F, got shape {per_sample.shape}")
    N, L, H, _ = per_sample.shape
    counts = np.zeros((L, H, len(CLASSES)), dtype=np.int64)
    if pairs is not None and np.ndim(pairs) == 1 and len(pairs) != N:
        raise AttnkitError(f"{len(pairs)} pair flags for {N} examples")
    for i in range(0, N, chunk):
        p = pairs
        if p is not None and np.ndim(p) == 1:
            p = np.asarray(p[i:i + chunk], dtype=bool)[:, None, None]
        cls = classify(per_sample[i:i + chunk], names, p)
        for c in range(len(CLASSES)):
            counts[..., c] += (cls == c).sum(0)
    return counts


def proportions(counts: np.ndarray) -> dict:
    """Shares per class: per layer (over the layer's heads × examples), per head, and over the corpus."""
    total = counts.sum(-1, keepdims=True)
    if not np.all(total > 0):
        raise AttnkitError("no examples to count")
    per_layer = counts.sum(1) / counts.sum((1, 2))[:, None]
    overall = counts.sum((0, 1)) / counts.sum()
    per_head = counts / total
    return {"overall": {c: float(overall[j]) for j, c in enumerate(CLASSES)},
            "per_layer": {c: [float(x) for x in per_layer[:, j]] for j, c in enumerate(CLASSES)},
            "per_head": {c: np.round(per_head[..., j], 6).tolist() for j, c in enumerate(CLASSES)}}


def patterns_dict(counts: np.ndarray, *, pairs_rule: str) -> dict:
    L, H, _ = counts.shape
    return {"version": 1, "classes": list(CLASSES), "rules": rules(), "pairs": pairs_rule,
            "n_examples": int(counts[0, 0].sum()), "n_layers": int(L), "n_heads": int(H),
            **proportions(counts)}


def proportions_figure(data: dict):
    """Stacked bars of the class shares per layer and over the corpus (Kovaleva et al. Fig. 2/3 analogue)."""
    from ..plotting import plt

    per_layer = data["per_layer"]
    L = len(next(iter(per_layer.values())))
    labels = [f"L{i}" for i in range(L)] + ["all"]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * (L + 1) + 2.5), 3.6))
    bottom = np.zeros(L + 1)
    for c in CLASSES:
        vals = np.array(per_layer[c] + [data["overall"][c]])
        ax.bar(labels, vals, bottom=bottom, color=PATTERN_COLORS[c], label=c, edgecolor="white", linewidth=0.5)
        bottom += vals
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of (example, head)")
    ax.set_title(f"Attention pattern types per layer ({data['n_examples']} examples)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def run_patterns(run_dir, *, pairs=None, svg: bool = True) -> tuple[Path, dict]:
    """Classify RUN/per_sample.npy, write RUN/patterns.json and RUN/figures/pattern_types.png (+ .svg)."""
    from ..plotting import save_figure

    run_dir = Path(run_dir)
    arr, names = load_per_sample(run_dir)
    check_matches_run(run_dir, arr, names)
    counts = class_counts(arr, names, pairs=pairs)
    rule = ("inter > 0 per example and head" if pairs is None
            else f"given: {bool(pairs) if np.ndim(pairs) == 0 else 'per example'}")
    data = patterns_dict(counts, pairs_rule=rule)
    path = run_dir / PATTERNS_FILE
    write_json(path, data)
    save_figure(proportions_figure(data), run_dir / FIGURES_DIR, "pattern_types", svg=svg)
    return path, data


__all__ = ["CLASSES", "classify", "class_counts", "proportions", "patterns_dict", "proportions_figure",
           "run_patterns", "rules", "STRUCTURED_MIN", "MIX_PART_MIN", "BLOCK_INTRA_MIN", "PATTERNS_FILE"]
