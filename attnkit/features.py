"""Names and codes shared by the reference, the fused ops and everything downstream (docs/features.md).

Token classes, intervention modes and regions are small integers so the C++/CUDA kernels can read them.
"""
from __future__ import annotations

from .errors import AttnkitError, arg, check_int

# Token classes (docs/features.md, "Token classes" and "Sentence ids").
OTHER, CLS, SEP, COMMA, PERIOD = 0, 1, 2, 3, 4
TOKEN_CLASS_NAMES = ("other", "cls", "sep", "comma", "period")

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
ROW_FEATURES = ("prev", "next", "entropy", "max", "intra", "inter")


def bucket_names(num_windows: int = DEFAULT_NUM_WINDOWS) -> list[str]:
    """The exclusive distance-feature buckets (Guan et al. Eq. 2): they sum to 1 per row."""
    return ["cls", "sep", "comma", "period", "self"] + [f"win_{i}" for i in range(num_windows)]


def feature_names(num_windows: int = DEFAULT_NUM_WINDOWS) -> list[str]:
    """All per-head features, in the order the ops emit them."""
    return bucket_names(num_windows) + list(ROW_FEATURES) + ["cls_entropy"]


def num_features(num_windows: int = DEFAULT_NUM_WINDOWS) -> int:
    return 5 + num_windows + len(ROW_FEATURES) + 1


def windows_of(n_features: int) -> int:
    """The number of distance windows behind `n_features` features (the inverse of `num_features`)."""
    return n_features - num_features(0)


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
