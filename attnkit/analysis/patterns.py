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
key it can see, so a single-sentence example is the only way to get inter = 0).

The thresholds are a `Rules` (the defaults: the constants below; `attnkit patterns --structured-min ...` sets
them). Values are compared in float32, the precision per_sample.npy stores (files of attnkit 0.1 hold float16,
whose rounding flipped examples within ~3e-5 of a threshold; they are converted to float32 and classified as
stored). `run_patterns` writes the label of every (example, head) to RUN/pattern_labels.npy, and `examples_of`
lists the examples that put one head in one class, with their texts (RUN/per_sample_rows.csv).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import INT_RANGES, AttnkitError, arg, check_int
from ..features import weighting_of
from ..run.files import (
    FIGURES_DIR,
    META_FILE,
    PATTERN_LABELS,
    PATTERNS_FILE,
    PER_SAMPLE_FILE,
    PER_SAMPLE_ROWS,
    REPORT_FILE,
)
from ..run.model_dir import DECODER_TYPES
from ..run.opened import open_run
from ..run.outputs import check_write_target, write_json
from ..run.overwrite import claim_outputs
from ..run.per_sample import check_matches_run, load_per_sample, per_sample_path, read_rows

CLASSES = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")
VERTICAL, DIAGONAL, MIXED, BLOCK, HETEROGENEOUS = range(5)
NO_ATTENTION = -1  # the label of a head a pruning removed (NaN features, docs/pruning.md): no class, not counted
VERTICAL_FEATURES = ("cls", "sep")
DIAGONAL_FEATURES = ("prev", "next", "self")
STRUCTURED_MIN = 0.5   # v + d at least this: the map is dominated by stripes and/or the diagonal band
MIX_PART_MIN = 0.2     # each of v and d at least this: vertical+diagonal
BLOCK_INTRA_MIN = 0.8  # share of a row's mass inside its own sentence for block (pairs only)

PATTERN_COLORS = {"vertical": "#d62728", "diagonal": "#1f77b4", "vertical+diagonal": "#ff7f0e",
                  "block": "#9467bd", "heterogeneous": "#2ca02c"}


@dataclass(frozen=True)
class Rules:
    """The thresholds of the rules (see the module docstring); each a share between 0 and 1."""

    structured_min: float = STRUCTURED_MIN
    mix_part_min: float = MIX_PART_MIN
    block_intra_min: float = BLOCK_INTRA_MIN

    def check(self) -> Rules:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise AttnkitError(f"{arg(name)} must be a share between 0 and 1, got {value!r}")
        return self

    def as_dict(self) -> dict:
        return {"vertical_mass": "+".join(VERTICAL_FEATURES), "diagonal_mass": "+".join(DIAGONAL_FEATURES),
                **asdict(self)}


def rules(r: Rules | None = None) -> dict:
    """The rules as patterns.json records them (`rules`)."""
    return (r or Rules()).as_dict()


def _index(names, wanted) -> list[int]:
    names = list(names)
    missing = [n for n in wanted if n not in names]
    if missing:
        raise AttnkitError(f"the per-sample features lack {', '.join(missing)} (needed for the pattern rules)")
    return [names.index(n) for n in wanted]


def masses(features, names) -> dict:
    """The masses the rules read, per (example, …, head): `v` (cls + sep), `d` (prev + next + self), `intra`
    and `inter`, in float32."""
    x = np.asarray(features, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] != len(list(names)):
        raise AttnkitError(f"features of shape {x.shape} do not end in the {len(list(names))} named features")
    return {"v": x[..., _index(names, VERTICAL_FEATURES)].sum(-1, dtype=np.float32),
            "d": x[..., _index(names, DIAGONAL_FEATURES)].sum(-1, dtype=np.float32),
            "intra": x[..., _index(names, ("intra",))[0]], "inter": x[..., _index(names, ("inter",))[0]]}


def classify(features, names, pairs=None, rules: Rules | None = None) -> np.ndarray:
    """Class ids (see CLASSES) of every (example, …, head) for features `... × F` (e.g. N × layers × heads × F);
    NO_ATTENTION (-1) for a head removed by pruning (its features are NaN).

    `pairs`: None (infer from `inter` > 0 per example and head), a bool, or a bool array broadcastable to
    the leading dims (e.g. shape (N, 1, 1) for one flag per example). `rules`: the thresholds (default:
    `Rules()`).
    """
    r = (rules or Rules()).check()
    m = masses(features, names)
    v, d, intra = m["v"], m["d"], m["intra"]
    if pairs is None:
        pairs = m["inter"] > 0
    pairs = np.broadcast_to(np.asarray(pairs, dtype=bool), v.shape)
    out = np.full(v.shape, HETEROGENEOUS, dtype=np.int8)
    block = pairs & (intra >= np.float32(r.block_intra_min))
    out[block] = BLOCK
    structured = (v + d) >= np.float32(r.structured_min)
    out[structured & (v >= d)] = VERTICAL
    out[structured & (d > v)] = DIAGONAL
    mix = np.float32(r.mix_part_min)
    out[structured & (v >= mix) & (d >= mix)] = MIXED
    out[np.isnan(v)] = NO_ATTENTION  # a removed head has no attention to classify
    return out


def _pairs_for(pairs, i: int, chunk: int):
    if pairs is not None and np.ndim(pairs) == 1:
        return np.asarray(pairs[i:i + chunk], dtype=bool)[:, None, None]
    return pairs


def class_counts(per_sample, names, *, pairs=None, chunk: int = 4096, rules: Rules | None = None,
                 labels: np.ndarray | None = None) -> np.ndarray:
    """layers × heads × 5 counts of examples per class, streaming over `per_sample` (N × layers × heads × F,
    e.g. the memory-mapped per_sample.npy) `chunk` examples at a time. `pairs`: None, a bool, or one bool
    per example. `labels`: an N × layers × heads int8 array (e.g. a memory map) that receives every class id."""
    if per_sample.ndim != 4:
        raise AttnkitError(f"per-sample features must be N × layers × heads × F, got shape {per_sample.shape}")
    N, L, H, _ = per_sample.shape
    counts = np.zeros((L, H, len(CLASSES)), dtype=np.int64)
    if pairs is not None and np.ndim(pairs) == 1 and len(pairs) != N:
        raise AttnkitError(f"{len(pairs)} pair flags for {N} examples")
    for i in range(0, N, chunk):
        cls = classify(per_sample[i:i + chunk], names, _pairs_for(pairs, i, chunk), rules)
        if labels is not None:
            labels[i:i + chunk] = cls
        for c in range(len(CLASSES)):
            counts[..., c] += (cls == c).sum(0)
    return counts


def proportions(counts: np.ndarray, removed: np.ndarray | None = None) -> dict:
    """Shares per class: per layer (over the layer's heads × examples), per head, and over the corpus; the heads
    `removed` (layers × heads booleans: removed by pruning, never classified) are left out: null per head, and
    null per layer for a layer with no head left."""
    total = counts.sum(-1, keepdims=True)
    removed = np.zeros(counts.shape[:2], dtype=bool) if removed is None else np.asarray(removed, dtype=bool)
    if not np.all(total[~removed] > 0) or removed.all():
        raise AttnkitError("no examples to count")
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = counts.sum(1) / counts.sum((1, 2))[:, None]
        per_head = counts / total
    overall = counts.sum((0, 1)) / counts.sum()

    def share(x):
        return None if not np.isfinite(x) else float(x)

    return {"overall": {c: float(overall[j]) for j, c in enumerate(CLASSES)},
            "per_layer": {c: [share(x) for x in per_layer[:, j]] for j, c in enumerate(CLASSES)},
            "per_head": {c: [[None if removed[l, h] else round(float(per_head[l, h, j]), 6)
                              for h in range(counts.shape[1])] for l in range(counts.shape[0])]
                         for j, c in enumerate(CLASSES)}}


def patterns_dict(counts: np.ndarray, *, pairs_rule: str, rules: Rules | None = None,
                  removed: np.ndarray | None = None, weighting: str = "attention") -> dict:
    """patterns.json's content (docs/patterns.md): `removed_heads` lists the heads left out (removed by pruning),
    `weighting` the weighting of the features classified (Kovaleva et al.'s classes describe attention weights:
    "norm" classifies norm-weighted attention instead)."""
    L, H, _ = counts.shape
    removed = np.zeros((L, H), dtype=bool) if removed is None else np.asarray(removed, dtype=bool)
    return {"version": 1, "classes": list(CLASSES), "rules": (rules or Rules()).as_dict(), "pairs": pairs_rule,
            "weighting": weighting, "n_examples": int(counts.sum(-1).max()), "n_layers": int(L), "n_heads": int(H),
            "removed_heads": [[int(l), int(h)] for l, h in np.argwhere(removed)],
            "labels": PATTERN_LABELS, **proportions(counts, removed)}


def proportions_figure(data: dict):
    """Stacked bars of the class shares per layer and over the corpus (Kovaleva et al. Fig. 2/3 analogue)."""
    from ..plotting import plt

    per_layer = data["per_layer"]
    L = len(next(iter(per_layer.values())))
    labels = [f"L{i}" for i in range(L)] + ["all"]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * (L + 1) + 2.5), 3.6))
    bottom = np.zeros(L + 1)
    for c in CLASSES:
        vals = np.array([np.nan if v is None else v for v in per_layer[c]] + [data["overall"][c]])
        ax.bar(labels, vals, bottom=bottom, color=PATTERN_COLORS[c], label=c, edgecolor="white", linewidth=0.5)
        bottom += vals
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of (example, head)")
    ax.set_title(f"Attention pattern types per layer ({data['n_examples']} examples)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def _pairs_rule(pairs) -> str:
    return ("inter > 0 per example and head" if pairs is None
            else f"given: {bool(pairs) if np.ndim(pairs) == 0 else 'per example'}")


def run_patterns(run_dir, *, pairs=None, svg: bool = True, rules: Rules | None = None,
                 overwrite: bool = False) -> tuple[list[Path], dict, str | None]:
    """Classify RUN/per_sample.npy and write RUN/patterns.json, RUN/pattern_labels.npy (the class id of every
    (example, head), int8 N × layers × heads) and RUN/figures/pattern_types.png (+ .svg). Earlier results are
    replaced only with `overwrite` (the report drawn from them goes with them). Returns (the paths written,
    patterns.json's content, the message naming what `overwrite` removed or None). The run is read once
    (attnkit.run.opened.open_run): its meta.json says whether it is a decoder's, and the per_sample.npy it
    attached is the one classified."""
    run_dir = Path(run_dir)
    rules = (rules or Rules()).check()
    try:
        feats = open_run(run_dir if run_dir.is_dir() else run_dir.parent).features
    except AttnkitError:
        per_sample_path(run_dir)  # a directory without one is first told how to make it
        raise
    refuse_decoder_run(run_dir, feats.meta)
    per_sample_path(run_dir)
    if feats.per_sample is not None and (run_dir.is_dir() or run_dir.name == PER_SAMPLE_FILE):
        arr, names = feats.per_sample, feats.names
    else:  # none attached (missing, damaged or not fitting the run): read it here for its own error
        arr, names = load_per_sample(run_dir)
    check_matches_run(run_dir, arr, names, feats)
    figure = run_dir / FIGURES_DIR / "pattern_types"
    outputs = [run_dir / PATTERNS_FILE, run_dir / PATTERN_LABELS, figure.with_suffix(".png")]
    claim = claim_outputs(outputs + ([figure.with_suffix(".svg")] if svg else []), overwrite,
                          stale=[run_dir / REPORT_FILE])
    labels_path = run_dir / PATTERN_LABELS
    for directory in (run_dir, run_dir / FIGURES_DIR):  # before anything is written: no link leads out of RUN
        check_write_target(directory)
    tmp = labels_path.with_name(f".{labels_path.name}.partial")
    labels = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int8, shape=arr.shape[:3])
    try:
        counts = class_counts(arr, names, pairs=pairs, rules=rules, labels=labels)
        labels.flush()
        del labels
        os.replace(tmp, labels_path)
    finally:
        tmp.unlink(missing_ok=True)
    data = patterns_dict(counts, pairs_rule=_pairs_rule(pairs), rules=rules, removed=feats.removed,
                         weighting=weighting_of(feats.meta))
    write_json(run_dir / PATTERNS_FILE, data)
    from ..plotting import save_figure  # matplotlib: only once the checks have passed

    saved = save_figure(proportions_figure(data), run_dir / FIGURES_DIR, "pattern_types", svg=svg)
    claim.remove_stale()
    written = [run_dir / PATTERNS_FILE, labels_path, Path(saved["png"])] + ([Path(saved["svg"])] if saved.get("svg")
                                                                            else [])
    return written, data, claim.removed_message()


STRENGTH = {"vertical": lambda m: m["v"], "diagonal": lambda m: m["d"],
            "vertical+diagonal": lambda m: np.minimum(m["v"], m["d"]), "block": lambda m: m["intra"],
            "heterogeneous": lambda m: -(m["v"] + m["d"])}


def refuse_decoder_run(run_dir, meta: dict | None = None) -> None:
    """Kovaleva et al.'s pattern classes are defined for encoders (vertical = [CLS]/[SEP], diagonal = previous and
    next token, block = a text pair's segments): a run of a decoder is refused, with that reason. `meta`: the run's
    meta.json as already read (None: read here)."""
    import json

    run_dir = Path(run_dir)
    if meta is None:
        try:  # a missing or broken meta.json is for the run's own checks to name
            meta = json.loads((run_dir if run_dir.is_dir() else run_dir.parent).joinpath(META_FILE)
                              .read_text("utf-8"))
        except (OSError, ValueError):
            return
    mtype = meta.get("model_type") if isinstance(meta, dict) else None
    if mtype in DECODER_TYPES:
        raise AttnkitError(f"{run_dir} is a run of a decoder ({mtype}): Kovaleva et al.'s pattern classes are defined "
                           "for bidirectional encoders (vertical is attention to [CLS]/[SEP], diagonal to the previous "
                           "and next token, block to a text pair's segments), and a causal row has no next token or "
                           "second segment; attnkit detect-heads finds a decoder's previous-token and induction heads")


def examples_of(run_dir, layer: int, head: int, pattern: str, *, n: int = 10, pairs=None,
                rules: Rules | None = None):
    """The examples that put head (`layer`, `head`) of a run in class `pattern`, most clearly first (vertical:
    highest v; diagonal: highest d; vertical+diagonal: highest min(v, d); block: highest intra; heterogeneous:
    lowest v + d), at most `n`: a DataFrame indexed by row of per_sample.npy with v, d, intra and the texts
    (when the run has per_sample_rows.csv), and the number of examples in the class."""
    import pandas as pd

    if pattern not in CLASSES:
        raise AttnkitError(f"unknown pattern class {pattern!r}; use one of {', '.join(CLASSES)}")
    check_int(n, "n", maximum=INT_RANGES["list_max"][1])
    refuse_decoder_run(run_dir)
    arr, names = load_per_sample(run_dir)
    N, L, H, _ = arr.shape
    if not (0 <= layer < L and 0 <= head < H):
        raise AttnkitError(f"head L{layer}H{head} is outside the run's {L} layers × {H} heads")
    x = np.asarray(arr[:, layer, head], dtype=np.float32)
    cls = classify(x, names, pairs, rules)
    m = masses(x, names)
    rows = np.flatnonzero(cls == CLASSES.index(pattern))
    order = rows[np.argsort(-STRENGTH[pattern](m)[rows], kind="stable")][:max(int(n), 0)]
    df = pd.DataFrame({"v": m["v"][order], "d": m["d"][order], "intra": m["intra"][order]},
                      index=pd.Index(order, name="row"))
    if (Path(run_dir) / PER_SAMPLE_ROWS).is_file():
        df = df.join(read_rows(run_dir, order.tolist())[["input", "position", "text", "text_pair"]])
    return df, int(len(rows))


__all__ = ["CLASSES", "Rules", "classify", "class_counts", "examples_of", "masses", "proportions", "patterns_dict",
           "proportions_figure", "run_patterns", "rules", "STRUCTURED_MIN", "MIX_PART_MIN", "BLOCK_INTRA_MIN",
           "PATTERNS_FILE"]
