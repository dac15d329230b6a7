"""The input checks of the training tools, written once (docs/training.md): each public entry point (`track`,
`StatsLogger`, `AttnkitCallback`, `qk_clip`) calls them at its top, so bad input is refused by an AttnkitError that
names the argument before anything is attached, opened or scaled, and valid input of another type (a numpy or 0-d
tensor scalar, one feature given as a string) is taken as what it means."""
from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from ..errors import AttnkitError, arg, check_int


def _is_bool(value) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.dtype in (torch.bool, np.bool_)
    return isinstance(value, (bool, np.bool_))


def _scalar(value):
    """`value` unless it is a tensor or array of more than zero dimensions (a TypeError, which the callers turn into
    the AttnkitError naming the argument)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim != 0:
        raise TypeError
    return value


def integer(value, name: str, minimum: int = 0) -> int:
    """`value` as an int: a Python or numpy integer, or a 0-d integer tensor or array (a step that `Trainer` or a
    loop counts in a tensor); not a bool, a float (1.7 is no step, and 2.0 says a float was meant), or a value
    below `minimum`."""
    try:
        if _is_bool(value):
            raise TypeError
        number = operator.index(_scalar(value))
    except TypeError:
        raise AttnkitError(f"{arg(name)} must be an integer, got {value!r}") from None
    return check_int(number, name, minimum=minimum)


def positive_real(value, name: str) -> float:
    """`value` as a float when it is a finite real number > 0: a Python, numpy or 0-d tensor scalar; not a bool,
    NaN, ±inf or ≤ 0."""
    try:
        if _is_bool(value):
            raise TypeError
        number = _scalar(value)
        if isinstance(number, (torch.Tensor, np.ndarray)):
            number = number.item()
        if not isinstance(number, numbers.Real) or isinstance(number, bool):
            raise TypeError
        number = float(number)
    except TypeError:
        raise AttnkitError(f"{arg(name)} must be a real number > 0, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise AttnkitError(f"{arg(name)} must be a finite number > 0, got {number!r}")
    return number


def feature_list(features, default: tuple[str, ...], name: str = "features") -> tuple[str, ...]:
    """The feature names `features` as a tuple: None means `default`, a string one feature; otherwise an iterable of
    strings, at least one, none twice. Whether the model has them is the caller's check (it needs the model)."""
    if features is None:
        return tuple(default)
    if isinstance(features, str):
        return (features,)
    if not isinstance(features, Iterable) or isinstance(features, Mapping):
        raise AttnkitError(f"{arg(name)} must be a feature name or a sequence of them, got {features!r}")
    features = tuple(features)
    bad = [f for f in features if not isinstance(f, str)]
    if bad:
        raise AttnkitError(f"{arg(name)} must be feature names (strings), got {bad[0]!r}")
    if not features:
        raise AttnkitError(f"{arg(name)} names no feature: give at least one")
    if len(set(features)) != len(features):
        raise AttnkitError(f"{arg(name)} names a feature twice: {list(features)}")
    return features


def model_to_track(model, purpose: str):
    """`model` when it is a transformers model (a torch module with a config), else an AttnkitError."""
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise AttnkitError(f"{purpose} needs a transformers model (a torch.nn.Module with a config), got "
                           f"{type(model).__name__}")
    return model


def file_to_write(path, name: str, suffixes: tuple[str, ...]) -> Path:
    """Path(`path`) for a file to write: a str or os.PathLike whose suffix is one of `suffixes` (any case), in a
    folder that exists, and not itself a directory. Returns the path and its lower-case suffix."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise AttnkitError(f"{arg(name)} must be a file path, got {path!r}")
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise AttnkitError(f"{arg(name)}: StatsLogger writes {' or '.join(suffixes)} files, got {str(path)!r}")
    if path.is_dir():
        raise AttnkitError(f"{arg(name)} {str(path)!r} is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "is missing"
        raise AttnkitError(f"{arg(name)} {str(path)!r}: its folder {str(parent)!r} {what}")
    return path


def directory_to_write(path, name: str) -> Path:
    """Path(`path`) for a directory to write into (created if needed): a str or os.PathLike that is not a file."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise AttnkitError(f"{arg(name)} must be a directory path, got {path!r}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AttnkitError(f"{arg(name)} {str(path)!r} is a file, not a directory")
    return path


def stats_table(stats, name: str = "stats") -> dict[str, torch.Tensor]:
    """`stats` as `tracker.read()` returns them: a dict {feature name: layers × heads tensor (or numpy array) of real
    numbers}, each as an fp32 tensor on the host."""
    if not isinstance(stats, Mapping):
        raise AttnkitError(f"{arg(name)} must be a dict {{feature: layers × heads tensor}} as tracker.read() returns, "
                           f"got {type(stats).__name__}")
    out = {}
    for feature, t in stats.items():
        if not isinstance(feature, str) or not feature:
            raise AttnkitError(f"{arg(name)}: feature names must be strings, got {feature!r}")
        if isinstance(t, np.ndarray) and t.dtype.kind in "iuf":
            t = torch.from_numpy(np.ascontiguousarray(t))
        if not isinstance(t, torch.Tensor) or t.dtype == torch.bool or t.is_complex():
            raise AttnkitError(f"{arg(name)}[{feature!r}] must be a tensor of real numbers, got "
                               f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}")
        if t.dim() != 2:
            raise AttnkitError(f"{arg(name)}[{feature!r}] must be a layers × heads tensor, got shape {tuple(t.shape)}")
        out[feature] = t.detach().float().cpu()
    return out


def real_tensor(value) -> bool:
    """Whether `value` is a tensor of real numbers (not bool, not complex)."""
    return isinstance(value, torch.Tensor) and value.dtype != torch.bool and not value.is_complex()


__all__ = ["directory_to_write", "feature_list", "file_to_write", "integer", "model_to_track", "positive_real",
           "real_tensor", "stats_table"]
