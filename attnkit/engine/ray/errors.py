"""What went wrong on a Ray cluster, in one line: Ray carries a remote error as a traceback in its message."""
from __future__ import annotations

import re

from ...errors import AttnkitError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ray_failure(exc: BaseException) -> AttnkitError:
    """The AttnkitError inside an exception raised through Ray when there is one (as it was raised, or found in
    the remote traceback's text), else an AttnkitError with the remote exception's own last line."""
    chain, cur = [], exc
    while cur is not None and all(cur is not c for c in chain):
        chain.append(cur)
        cur = getattr(cur, "cause", None) or cur.__cause__ or cur.__context__
    for e in chain:
        if isinstance(e, AttnkitError):
            return e
    for e in chain:
        found = re.findall(r"AttnkitError: (.+)", _ANSI.sub("", str(e)))
        if found:
            return AttnkitError(found[-1].strip())
    for e in chain:  # the remote exception's own last line, e.g. "ValueError: ..." under a traceback
        found = [m for m in re.findall(r"^\s*([\w.]+(?:Error|Exception)): (.+)$", _ANSI.sub("", str(e)), re.M)
                 if not m[0].startswith(("ray.", "Ray", "UserCodeException", "SystemException"))]
        if found:
            return AttnkitError(f"{found[-1][0].rsplit('.', 1)[-1]}: {found[-1][1].strip()}")
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return AttnkitError(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)


__all__ = ["ray_failure"]
