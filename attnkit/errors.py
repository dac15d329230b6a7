"""User-facing errors: a message that names the problem, shown by the command line as one line.

The library speaks Python and the command line speaks options. A message that names an argument of the
call it refuses writes it with `arg()`: `str(error)` names the Python argument (`max_length must be an
integer of at least 2, got 1`), and `error.message(names)` names it as the caller says it; the command line
passes its option names (`--max-length must be ...`, see attnkit/cli/options.py). Progress messages of the
jobs behind the command line name arguments the same way (`spell`).

The checks that more than one module needs are written once, here (`check_int`).
"""
from __future__ import annotations

import json
import numbers
import re
from collections.abc import Mapping

_TOKEN = re.compile("\x00([A-Za-z_][A-Za-z0-9_]*)(?:\x01([^\x00]*))?\x00")


def arg(name: str, value=None) -> str:
    """Argument `name` of the call, as a message names it. With `value`, the message advises that setting:
    Python reads `name=value` (`resume=True`), the command line its option (`--resume`, `--engine ray`)."""
    if value is None:
        return f"\x00{name}\x00"
    return f"\x00{name}\x01{json.dumps(value)}\x00"


def spell(text: str, names: Mapping[str, str] | None = None) -> str:
    """`text` with each argument it names (`arg`) spelled as `names` maps it (argument → how the caller writes
    it, e.g. "--max-length"), the others as Python names them."""
    names = names or {}

    def name(m: re.Match) -> str:
        key, value = m.group(1), None if m.group(2) is None else json.loads(m.group(2))
        if key in names:
            return names[key] if value is None or value is True else f"{names[key]} {value}"
        return key if value is None else f"{key}={value!r}"

    return _TOKEN.sub(name, text)


class AttnkitError(Exception):
    """Bad input or a failed step that the user can fix; the CLI prints it without a traceback.

    `template` keeps the arguments the message names (see `arg`); `str()` names them as Python does."""

    def __init__(self, message: object = ""):
        self.template = message.template if isinstance(message, AttnkitError) else str(message)
        super().__init__(self.message())

    @property
    def arguments(self) -> list[str]:
        """The arguments the message names, in order."""
        return [m.group(1) for m in _TOKEN.finditer(self.template)]

    def message(self, names: Mapping[str, str] | None = None) -> str:
        """The message with each argument spelled as `names` maps it, the others as Python names them."""
        return spell(self.template, names)

    def __reduce__(self):  # pickled across processes (workers, Ray actors) with the arguments it names
        return type(self), (self.template,)


INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1  # what scikit-learn and numpy accept as a seed
MAX_NUM_WINDOWS = 1024  # the CUDA kernels' limit (csrc/cuda/fused_attention_params.h), for every backend

# The range (minimum, maximum) of every integer argument of the library, by its Python name. The command
# line's options take these limits (attnkit/cli/options.py, `int_range`), so a bad value is refused the same
# way from Python and from a shell, before anything is read, allocated or started. Maxima bound what a value
# sizes up front (num_windows: feature arrays; seeds and stability fits: lists and fits, one per value);
# INT32_MAX bounds the rest (a window or batch larger than that could not be held anyway). `workers` is
# bounded by the cores at run time (attnkit.engine.local.max_workers).
INT_RANGES = {
    "batch_size": (1, INT32_MAX),
    "window": (1, INT32_MAX),
    "limit": (1, 2**63 - 1),
    "max_length": (2, INT32_MAX),
    "num_windows": (1, MAX_NUM_WINDOWS),
    "checkpoint_every": (1, INT32_MAX),
    "workers": (0, None),
    "threads": (1, 1024),
    "k": (2, INT32_MAX),
    "n_stability": (0, 1000),
    "n_seeds": (1, 1000),
    "seed": (0, SEED_MAX),
    "rows_per_sample": (1, INT32_MAX),
    "examples": (0, 1000),
    "sample": (1, INT32_MAX),
    "min_count": (1, INT32_MAX),
    "list_max": (1, INT32_MAX),
    "resamples": (0, 1_000_000),
    "stack": (1, INT32_MAX),
    "length": (2, INT32_MAX),
    "n_sequences": (1, INT32_MAX),
    "top": (1, INT32_MAX),
    "max_new_tokens": (1, INT32_MAX),
}


def check_int(value, name: str, minimum: int | None = None, maximum: int | None = None):
    """`value` when it is an integer (not a bool) within [`minimum`, `maximum`]; else an AttnkitError naming
    `name`. Limits not given come from INT_RANGES[name] (else: at least 1, no maximum). The one check of
    counts and sizes (batch size, window, limit, max_length, workers, ...)."""
    lo, hi = INT_RANGES.get(name, (1, None))
    minimum = lo if minimum is None else minimum
    maximum = hi if maximum is None else maximum
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise AttnkitError(f"{arg(name)} must be {what}, got {value!r}")
    if maximum is not None and value > maximum:
        raise AttnkitError(f"{arg(name)} must be at most {maximum}, got {value!r}")
    return value


def one_line(exc: BaseException, limit: int = 300) -> str:
    """The message of `exc` on one line (white space folded), cut to `limit` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_message(text: str, err: bool = False) -> None:
    """Print `text` (arguments spelled as Python names them) on stdout, or stderr with `err`: how the jobs
    behind the command line report when Python calls them without an `echo` of its own."""
    import sys

    print(spell(text), file=sys.stderr if err else sys.stdout)


__all__ = ["INT32_MAX", "INT_RANGES", "MAX_NUM_WINDOWS", "SEED_MAX", "AttnkitError", "arg", "check_int", "one_line",
           "print_message", "spell"]
