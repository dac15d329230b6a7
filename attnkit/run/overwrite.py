"""The one overwrite policy of every command that writes results (docs/files.md, "Replacing results").

A command never replaces earlier results silently. Before it starts working it asks `claim_outputs` about the
files it will write (and the files derived from them that a new result makes stale): when any of them exists
and `overwrite` is false, it is refused with one line naming them and the option that would replace them;
with `overwrite`, the command goes ahead and, once its new results are written, says which old files
`--overwrite` removed (`Claim.removed_message`).

    claim = claim_outputs([run / "distances.npz"], overwrite, stale=[run / "report.html"])
    ... the work, then write distances.npz ...
    claim.remove_stale()
    echo(claim.removed_message())          # "--overwrite removed RUN/distances.npz, RUN/report.html"
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AttnkitError, arg


def _exists(p: Path) -> bool:
    return p.exists() or p.is_symlink()


def _names(paths: list[Path]) -> str:
    """Paths as a message lists them: those under one directory as `DIR/{a, b, sub/c}`, else each in full."""
    if not paths:
        return ""
    if len(paths) == 1:
        return str(paths[0])
    try:
        common = Path(os.path.commonpath([str(p) for p in paths]))
    except ValueError:  # relative and absolute paths mixed
        return ", ".join(str(p) for p in paths)
    if common in paths:
        common = common.parent
    return f"{common}/{{{', '.join(str(p.relative_to(common)) for p in paths)}}}"


@dataclass
class Claim:
    """What a command found in its way: `replaced`, the existing files it writes anew, and `stale`, the
    existing files that describe the old results and go with them. Both are empty for a fresh start."""

    replaced: list[Path] = field(default_factory=list)
    stale: list[Path] = field(default_factory=list)
    outdated: list[Path] = field(default_factory=list)  # stale files kept because nothing was replaced
    _removed: list[Path] = field(default_factory=list)

    @property
    def existing(self) -> list[Path]:
        return self.replaced + self.stale

    def remove_stale(self) -> list[Path]:
        """Remove the stale files (call once the new results are written); returns those removed."""
        for p in self.stale:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            self._removed.append(p)
        return list(self._removed)

    def removed_message(self) -> str | None:
        """`--overwrite removed ...`: the old files the command replaced or removed; or, when nothing was
        replaced, a note naming the files that were made before these results and do not show them (a report
        drawn before a probe was added to its run); None when there is nothing to say."""
        gone = self.replaced + [p for p in self.stale if p in self._removed]
        if gone:
            return f"{arg('overwrite', True)} removed {_names(gone)}"
        if self.outdated:
            one = len(self.outdated) == 1
            redraw = [p for p in self.outdated if p.name == "report.html"]
            return (f"note: {_names(self.outdated)} {'was' if one else 'were'} made before these results and "
                    f"{'does' if one else 'do'} not show them"
                    + (f"; `attnkit report {redraw[0].parent} --overwrite` redraws the report" if redraw else ""))
        return None


def claim_outputs(outputs: Iterable, overwrite: bool, *, stale: Iterable = (), what: str | None = None) -> Claim:
    """The overwrite check of a command about to write `outputs` (paths of files or directories).

    `stale`: files that describe the results being replaced and are removed with them (e.g. a report drawn
    from an old clusters.json). Without `overwrite`, an existing output is refused at once with an AttnkitError
    that names what exists and everything `overwrite` would remove; a stale file alone neither stops a command
    nor is removed (nothing is replaced then). `what` names the results in that message ("RUN already holds a
    finished run"; default: the outputs that exist).
    """
    outputs = [Path(p) for p in outputs]
    replaced = [p for p in outputs if _exists(p)]
    old = [Path(p) for p in stale if _exists(Path(p)) and Path(p) not in outputs]
    if replaced and not overwrite:
        one = what is not None or len(replaced) == 1  # `what` names one thing ("a finished run")
        head = what or f"{_names(replaced)} already exist{'s' if one else ''}"
        raise AttnkitError(f"{head}: give {arg('overwrite', True)} to replace {'it' if one else 'them'} (it removes "
                           f"{_names(replaced + old)}), or write elsewhere")
    return Claim(replaced, old) if replaced else Claim(outdated=old)


__all__ = ["Claim", "claim_outputs"]
