"""Names and codes shared by the reference, the fused ops and everything downstream (docs/features.md).

Token classes, intervention modes and regions are small integers so the C++/CUDA kernels can read them.
"""
from __future__ import annotations

from .errors import check_int

# Token classes (docs/features.md, "Token classes" and "Sentence ids").
OTHER, CLS, SEP, COMMA, PERIOD = 0, 1, 2, 3, 4
TOKEN_CLASS_NAMES = ("other", "cls", "sep", "comma", "period")

# Intervention modes and regions (docs/interventions.md).
MODES = ("keep", "zero", "uniform")
REGIONS = ("all", "no_intra", "no_inter")
KEEP, ZERO, UNIFORM = 0, 1, 2
ALL, NO_INTRA, NO_INTER = 0, 1, 2

DEFAULT_NUM_WINDOWS = 16
DEFAULT_MAX_LENGTH = 128  # tokens per sample, special tokens included, when none is given
DEFAULT_WINDOW = 4096  # segments read ahead and sorted by length together (docs/pipeline.md)
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
