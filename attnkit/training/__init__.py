"""attnkit while a model trains (docs/training.md): per-head statistics every step (`track`), QK-Clip (`qk_clip`),
logging them (`StatsLogger`) and a transformers `TrainerCallback` (`AttnkitCallback`).

The operator's backward (attnkit/kernels/backward.py) is what makes training through attnkit cost what sdpa costs;
this package is what a training loop calls around it. It sits in the model layer (docs/architecture.md)."""
from .qk_clip import qk_clip
from .stats_log import StatsLogger
from .track import DEFAULT_FEATURES, MAX_LOGIT, Tracker, track, trackable_features

__all__ = ["DEFAULT_FEATURES", "MAX_LOGIT", "AttnkitCallback", "StatsLogger", "Tracker", "qk_clip", "track",
           "trackable_features"]


def __getattr__(name):
    if name == "AttnkitCallback":  # imports transformers' Trainer machinery: only when asked for
        from .callback import AttnkitCallback

        return AttnkitCallback
    raise AttributeError(f"module 'attnkit.training' has no attribute {name!r}")
