"""Names and codes shared by the reference, the fused ops and everything downstream (docs/features.md).

Token classes, intervention modes and regions are small integers so the C++/CUDA kernels can read them.
"""
from __future__ import annotations

import numbers
import re

from .errors import AttnkitError, arg, check_int

# Token classes (docs/features.md, "Token classes" and "Sentence ids").
OTHER, CLS, SEP, COMMA, PERIOD = 0, 1, 2, 3, 4
TOKEN_CLASS_NAMES = ("other", "cls", "sep", "comma", "period")
# A vision transformer's tokens in the same scheme (docs/features.md, "Token classes"; attnkit/attention/positions.py):
# [CLS] is CLS, the extra tokens that hold no part of the image (DeiT's distillation token, DINOv2's registers) SEP,
# every patch OTHER
IMAGE_CLS, IMAGE_DISTILLATION, IMAGE_REGISTER, IMAGE_PATCH = CLS, SEP, SEP, OTHER

# Intervention modes and regions (docs/interventions.md).
MODES = ("keep", "zero", "uniform")
REGIONS = ("all", "no_intra", "no_inter")
KEEP, ZERO, UNIFORM = 0, 1, 2
ALL, NO_INTRA, NO_INTER = 0, 1, 2

# What the features describe (docs/features.md, "Norm-weighted features"): the attention weights, or the weights
# scaled per key by the norm of the transformed key vector (Kobayashi et al. 2020). Runs without a weighting
# recorded are "attention" runs.
WEIGHTINGS = ("attention", "norm")
DEFAULT_WEIGHTING = "attention"

DEFAULT_NUM_WINDOWS = 16
DEFAULT_MAX_LENGTH = 128  # tokens per sample, special tokens included, when none is given
DEFAULT_WINDOW = 4096  # segments read ahead and sorted by length together (docs/pipeline.md)
# How a run's forwards are cut from its segments (docs/pipeline.md §2: windows by characters, units by tokens), in
# the settings of every resumable run (meta.json, checkpoints, Ray shard files): a run planned otherwise (by
# characters alone, as attnkit did before units) is not resumed with this plan
PLAN = "units by tokens"
ROW_FEATURES = ("prev", "next", "entropy", "max", "intra", "inter")
# The feature of image heads (docs/features.md, "Image heads"): last, when the op is given the patch grid
MEAN_ATTENTION_DISTANCE = "mean_attention_distance"
# then the masses within 2-D rings of distance on the patch grid (docs/features.md, "Image heads"): ring_R is the
# mass on the patch keys t with R <= ‖grid(s) − grid(t)‖ < the next bound (∞ after the last), in patches
RING_BOUNDS = (0, 1, 2, 4, 8)
RING_FEATURES = tuple(f"ring_{r}" for r in RING_BOUNDS)
IMAGE_FEATURES = (MEAN_ATTENTION_DISTANCE, *RING_FEATURES)
# How diagonal a head's attention is (docs/features.md, "Alignment features"): last, when the op is given
# `alignment` (every layer of an encoder–decoder's run): the mean |t − p| of a row's mass from its aligned key
# position p, and the mass within one token of it
ALIGNMENT_FEATURES = ("align_offset", "align_near")


def bucket_names(num_windows: int = DEFAULT_NUM_WINDOWS) -> list[str]:
    """The exclusive distance-feature buckets (Guan et al. Eq. 2): they sum to 1 per row."""
    return ["cls", "sep", "comma", "period", "self"] + [f"win_{i}" for i in range(num_windows)]


def feature_names(num_windows: int = DEFAULT_NUM_WINDOWS, sink: bool = False, grid: bool = False,
                  alignment: bool = False) -> list[str]:
    """All per-head features, in the order the ops emit them. With `sink` (a model with a learned sink logit
    per head, e.g. gpt-oss), one more comes next: `sink`, the sink's mass (docs/features.md, "Decoder models").
    With `grid` (a vision model: the op is given its patch grid), `mean_attention_distance` and the ring masses
    come next (IMAGE_FEATURES; docs/features.md, "Image heads"); with `alignment` (an encoder–decoder's run),
    ALIGNMENT_FEATURES last (docs/features.md, "Alignment features")."""
    return (bucket_names(num_windows) + list(ROW_FEATURES) + ["cls_entropy"] + (["sink"] if sink else [])
            + (list(IMAGE_FEATURES) if grid else []) + (list(ALIGNMENT_FEATURES) if alignment else []))


def num_features(num_windows: int = DEFAULT_NUM_WINDOWS, sink: bool = False, grid: bool = False,
                 alignment: bool = False) -> int:
    return len(feature_names(num_windows, sink=sink, grid=grid, alignment=alignment))


def windows_of(n_features: int, sink: bool = False, grid: bool = False, alignment: bool = False) -> int:
    """The number of distance windows behind `n_features` features (the inverse of `num_features`)."""
    return n_features - num_features(0, sink=sink, grid=grid, alignment=alignment)


# Features that are 0 for every head of a decoder (a causal model, docs/features.md "Decoder models"): no row sees a
# next token, and the CLS row, row 0, sees only itself. A decoder run's report, glossary and clustering leave them out.
DECODER_CONSTANT = {"next": "no causal row sees a next token",
                    "cls_entropy": "the CLS row is row 0, which sees only itself"}

# One line per feature, for tooltips and the report's glossary (the definitions: docs/features.md).
_DEFINITIONS = {
    "cls": "weight on the [CLS] token (the tokenizer's cls/bos token)",
    "sep": "weight on [SEP] tokens (sep/eos)",
    "comma": "weight on tokens that are exactly ','",
    "period": "weight on tokens that are exactly '.'",
    "self": "weight on the query token itself, when it is none of the four classes above",
    "prev": "weight on the previous token",
    "next": "weight on the next token",
    "entropy": "entropy of the row in nats (0: one key; ln n: uniform over n tokens)",
    "max": "the largest single weight of the row",
    "intra": "weight on keys in the query's own sentence",
    "inter": "weight on keys in other sentences",
    "cls_entropy": "entropy of the [CLS] row alone",
    "sink": "mass on the learned sink logit of the head (no key, no value; with the buckets it sums to 1)",
    MEAN_ATTENTION_DISTANCE: "for each patch query, Σ over patch keys of weight × distance on the patch grid "
                             "(in patches), averaged over the image's patches",
    **{name: f"for each patch query, the weight on the patch keys at grid distance d with {lo} <= d < {hi} patches"
              f"{' (the patch itself)' if lo == 0 else ''}, averaged over the image's patches"
       for name, lo, hi in zip(RING_FEATURES, RING_BOUNDS, RING_BOUNDS[1:] + ("∞",))},
    "align_offset": "Σ over keys of weight × |t − p| (in tokens), p the row's aligned key position: its own for "
                    "self-attention, i·(nk − 1)/(nq − 1) for cross-attention",
    "align_near": "weight on the (at most three) keys within one token of the row's aligned key position",
}
# What differs on a decoder's run (causal rows): `cls` is the sample's first position, `sep` its EOS tokens.
_DECODER_DEFINITIONS = {
    "cls": "weight on the sample's first position, whatever token is there (the attention sink)",
    "sep": "weight on EOS tokens",
}
# The section of docs/features.md that defines each feature: GitHub's anchor of its heading, and where it is as a
# reader finds it (the numbered section, then the heading inside it, as the heading reads without its markup).
_SECTIONS = {"bucket": "the-21-exclusive-distance-buckets-5--n-in-general", "row": "the-row-features",
             "cls_entropy": "3-from-rows-to-a-sample-from-samples-to-the-corpus",
             "sink": "8-decoder-models-causal-rows-grouped-query-attention-windows-soft-capping-sinks",
             "image": "10-image-heads-vision-transformers", "alignment": "11-alignment-features"}
_SECTION_TITLES = {"bucket": "2. Features of one query row › The 21 exclusive distance buckets (5 + N in general)",
                   "row": "2. Features of one query row › The row features",
                   "cls_entropy": "3. From rows to a sample, from samples to the corpus",
                   "sink": "8. Decoder models: causal rows, grouped-query attention, windows, soft-capping, sinks",
                   "image": "10. Image heads: vision transformers", "alignment": "11. Alignment features"}


def describe_feature(name: str, decoder: bool = False) -> str:
    """A one-line definition of feature `name` (docs/features.md has the full ones); `decoder`: as a decoder's run
    measures it."""
    if name.startswith("win_") and name[4:].isdigit():
        w = int(name[4:])
        d = "s − t" if decoder else "|s − t|"
        return (f"weight on the other keys at distance d = {d} in window {w}: floor(d·N/n) = {w} of the N windows "
                "(fractions of the sample's length n)")
    return (decoder and _DECODER_DEFINITIONS.get(name)) or _DEFINITIONS.get(name, name)


def shown_features(names, decoder: bool = False) -> list[str]:
    """The features a report shows of a run: all of `names`, less DECODER_CONSTANT on a decoder's run."""
    return [n for n in names if not (decoder and n in DECODER_CONSTANT)]


def _section_of(name: str) -> str:
    if name in ("cls_entropy", "sink"):
        return name
    if name in IMAGE_FEATURES:
        return "image"
    if name in ALIGNMENT_FEATURES:
        return "alignment"
    return "row" if name in ROW_FEATURES else "bucket"


def feature_section(name: str) -> str:
    """The anchor of the section of docs/features.md that defines feature `name`."""
    return _SECTIONS[_section_of(name)]


def feature_section_title(name: str) -> str:
    """Where docs/features.md defines feature `name`, as its reader finds it: "2. Features of one query row › The
    row features" (the numbered section, then the heading inside it)."""
    return _SECTION_TITLES[_section_of(name)]


def check_num_windows(num_windows: int) -> int:
    return check_int(num_windows, "num_windows")


def check_weighting(weighting) -> str:
    """`weighting` when it is one of WEIGHTINGS; else an AttnkitError naming the argument."""
    if weighting not in WEIGHTINGS:
        raise AttnkitError(f"unknown {arg('weighting')} {weighting!r}: use 'attention' or 'norm'")
    return weighting


def weighting_of(meta: dict) -> str:
    """The weighting a run's meta.json records ("attention" when it records none: runs before norm weighting)."""
    return (meta or {}).get("weighting") or DEFAULT_WEIGHTING


HEAD_RE = re.compile(r"^L(\d+)(?:H(\d+))?$", re.IGNORECASE)  # L2H5, or L4 for a whole layer


def is_index(x) -> bool:
    """An integer >= 0 (a numpy integer too; not a bool, a float or a string): a layer or head number."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


def read_heads(spec) -> list[tuple[int, int | None]]:
    """(layer, head) pairs, as written, from "L2H5,L3H0" (0-based; "L4": head None, the whole layer 4) or an
    iterable of (layer, head); no model needed (attnkit.interventions.parse_heads expands and range-checks them)."""
    items: list = []
    if isinstance(spec, str):
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            m = HEAD_RE.match(part)
            if not m:
                raise AttnkitError(f"cannot read head {part!r}: write heads as L<layer>H<head>, e.g. L2H5, or L<layer>")
            items.append((int(m.group(1)), None if m.group(2) is None else int(m.group(2))))
        return items
    for item in spec:
        try:
            layer, head = item
        except (TypeError, ValueError):
            raise AttnkitError(f"a head must be a (layer, head) pair, got {item!r}") from None
        if not is_index(layer) or not (head is None or is_index(head)):
            raise AttnkitError(f"a head must be a (layer, head) pair of integers >= 0 (head None: the whole "
                               f"layer), got {item!r}")
        items.append((int(layer), None if head is None else int(head)))
    return items


def distance_feature_names(names) -> list[str]:
    """The exclusive distance buckets (cls, sep, comma, period, self, win_*) among `names`, in order."""
    return [n for n in names if n in ("cls", "sep", "comma", "period", "self") or n.startswith("win_")]


def resolve_subset(names, features_subset=None, decoder: bool = False) -> list[str]:
    """Feature names to cluster on: None → the distance buckets; a str → comma-separated names;
    "all" → every feature; a list → those names (each must exist). `decoder` (a decoder's run): "all" leaves out
    DECODER_CONSTANT, the features that are 0 for every head of a causal model, and naming one is refused."""
    names = list(names)
    if features_subset is None or features_subset == "distance":
        chosen = distance_feature_names(names)
        if not chosen:
            raise AttnkitError("the features hold no distance buckets (cls, sep, ..., win_*) to cluster on")
        return chosen
    if features_subset == "all":
        return [n for n in names if not (decoder and n in DECODER_CONSTANT)]
    if isinstance(features_subset, str):
        features_subset = [s.strip() for s in features_subset.split(",") if s.strip()]
    chosen = list(features_subset)
    if not chosen:
        raise AttnkitError("the feature subset is empty")
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise AttnkitError(f"unknown feature(s) {', '.join(map(repr, unknown))}; known: {', '.join(names)}")
    if len(set(chosen)) != len(chosen):
        raise AttnkitError(f"the feature subset names a feature twice: {chosen}")
    constant = [n for n in chosen if decoder and n in DECODER_CONSTANT]
    if constant:
        raise AttnkitError("; ".join(f"{n} is 0 for every head of a decoder's run ({DECODER_CONSTANT[n]})"
                                     for n in constant) + ": it tells no heads apart; leave it out of the features")
    return chosen
