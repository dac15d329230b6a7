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


def check_int(value, name: str, minimum: int = 1):
    """`value` when it is an integer (not a bool) of at least `minimum`; else an AttnkitError naming `name`.
    The one check of counts and sizes (batch size, window, limit, max_length, workers, ...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise AttnkitError(f"{arg(name)} must be {what}, got {value!r}")
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


__all__ = ["AttnkitError", "arg", "check_int", "one_line", "print_message", "spell"]
