"""Where attnkit writes: check an output before the work, and turn OS errors into one line.

The one write path of every command (`output_directory`, `output_file` in locking.py; docs/files.md, "Where
commands write") is built from these: `check_output_place` (the output is no input, lies in none and holds none),
`ensure_writable_dir` (a bad `-o` — under a file, on a read-only file system, on a full disk — fails at once
instead of after minutes of work), `writing_into` and `check_write_target` (nothing is written outside the output,
not through a symbolic link either), `atomic_write` (beside, then renamed), and `os_errors` (an OSError while
writing, ENOSPC, EROFS, ..., ends as an `AttnkitError`).
"""
from __future__ import annotations

import contextlib
import contextvars
import io
import json
import math
import os
import tempfile
from pathlib import Path

from ..errors import AttnkitError, arg


def describe_os_error(exc: OSError) -> str:
    """`path: reason` of an OSError, without the Python class name."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = exc.filename if exc.filename is not None else None
    return f"{where}: {reason}" if where else reason


def check_output_path(path, name: str = "out"):
    """`path` unless it is empty: an empty path would silently mean the current directory (Path("") is ".").
    `name` is the argument that gave it."""
    if path is not None and not str(path).strip():
        raise AttnkitError(f"{arg(name)} is empty: name the directory or file to write")
    return path


def real_path(path) -> Path:
    """`path` absolute, with every symbolic link of it resolved (also when its last parts do not exist yet)."""
    return Path(os.path.realpath(path))


def is_within(path: Path, root: Path) -> bool:
    """Whether real path `path` is `root` or lies inside it."""
    return path == root or root in path.parents


def check_output_place(out, inputs=(), *, whole: bool = False, name: str = "out") -> Path:
    """Path(`out`) unless writing there could touch what the command reads (AttnkitError, before any work): `out`
    may not be empty, be an input (a model directory, a corpus file, a run that is read), lie inside one or hold
    one. `inputs`: the paths the command reads, each a path or a (what, path) pair naming it ("the model being
    pruned"), or (what, path, True) for a corpus folder, which may hold the output (the corpus readers skip run
    directories: docs/pipeline.md); None, '-' and paths that do not exist are skipped. `whole`: the command
    replaces `out` as a whole (prune), so it may not be or hold the working directory either. `name`: the argument
    that gave `out`."""
    check_output_path(out, name)
    where = real_path(out)
    for item in inputs:
        what, given, may_hold = (item + (False,))[:3] if isinstance(item, tuple) else ("an input of this command",
                                                                                       item, False)
        if given is None or str(given) in ("", "-") or not os.path.lexists(given):
            continue
        read = real_path(given)
        named = what if where == read else f"{what} ({str(given)!r})"
        relation = "is" if where == read else "lies inside" if is_within(where, read) and not may_hold else \
            "holds" if is_within(read, where) else None
        if relation:
            raise AttnkitError(f"{arg(name)} {str(out)!r} {relation} {named}: write elsewhere")
    if whole:
        cwd = real_path(os.getcwd())
        if is_within(cwd, where):
            raise AttnkitError(f"{arg(name)} {str(out)!r} {'is' if cwd == where else 'holds'} the working directory, "
                               "which this command would replace: write elsewhere")
    return Path(out)


# The directories the running command writes into (set by `writing_into`, which run_lock enters): a file written
# by atomic_write, or a directory prepared by ensure_writable_dir, must lie inside one of them once symbolic links
# are resolved, so a link such as RUN/figures -> /elsewhere is never written through.
_WRITE_ROOTS: contextvars.ContextVar[tuple[tuple[Path, Path], ...]] = contextvars.ContextVar("attnkit_write_roots",
                                                                                            default=())


@contextlib.contextmanager
def writing_into(*roots):
    """While the block runs, attnkit writes only inside `roots` (directories): `check_write_target` refuses
    anything else. They replace the roots of an enclosing block (a command started inside another's block, as
    Python may do, writes where it is told); no roots: no bound."""
    token = _WRITE_ROOTS.set(tuple((Path(r), real_path(r)) for r in roots))
    try:
        yield
    finally:
        _WRITE_ROOTS.reset(token)


def check_write_target(directory) -> None:
    """Refuse (AttnkitError) to write into `directory` when a command is writing (`writing_into`) and
    `directory`, its symbolic links resolved, lies outside every directory the command writes into."""
    roots = _WRITE_ROOTS.get()
    if not roots:
        return
    real = real_path(directory)
    if any(is_within(real, resolved) for _, resolved in roots):
        return
    given = roots[-1][0]
    raise AttnkitError(f"{directory} leads out of {given} (to {real}, through a symbolic link): attnkit writes "
                       f"nothing there; remove the link, or write elsewhere")


def check_no_file_in_the_way(path, what: str = "output directory") -> Path:
    """Path(`path`) unless it, or the nearest of its parents that exists, is not a directory (AttnkitError)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AttnkitError(f"{what} {str(path)!r} exists and is not a directory")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise AttnkitError(f"cannot create {what} {str(path)!r}: {str(parent)!r} is a file, not a directory")
            break
    return path


def ensure_writable_dir(path, what: str = "output directory") -> Path:
    """Create directory `path` if needed and prove that a file can be written in it; return it.

    Refuses with an AttnkitError naming the problem: `path` (or one of its parents) is a file, the
    directory cannot be created, or a probe file cannot be written there (read-only file system, no
    space, no permission — the probe is the only test that also holds for root).
    """
    if not str(path).strip():
        raise AttnkitError(f"the {what} path is empty: name the directory to write")
    path = check_no_file_in_the_way(path, what)
    check_write_target(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AttnkitError(f"cannot create {what} {str(path)!r}: {exc.strerror or exc}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".attnkit-probe-"):
            pass
    except OSError as exc:
        raise AttnkitError(f"cannot write into {what} {str(path)!r}: {exc.strerror or exc}") from None
    return path


@contextlib.contextmanager
def os_errors(doing: str):
    """Turn an OSError raised inside the block into an AttnkitError "could not <doing>: path: reason"."""
    try:
        yield
    except OSError as exc:
        raise AttnkitError(f"could not {doing}: {describe_os_error(exc)}") from None


def atomic_write(path, write) -> None:
    """Write `path` through a temporary file in the same directory and rename it into place, so a
    crash never leaves a half-written `path`. `write(f)` gets the open binary file. On any failure the
    temporary file is removed; an OSError (full disk, read-only file system, a parent that is a file)
    becomes an AttnkitError naming `path`."""
    path = Path(path)
    check_write_target(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise AttnkitError(f"could not write {path}: {exc.strerror or exc}") from None
        raise


def json_float(x) -> float | None:
    """`x` as a JSON number: a float, or None (null) for NaN, which JSON cannot hold."""
    x = float(x)
    return None if math.isnan(x) else x


def write_json(path, obj) -> None:
    """`obj` as indented JSON (one trailing newline), written atomically."""
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()))


TABLE_FORMATS = ("csv", "parquet")


def write_table(df, path, fmt: str) -> None:
    """Write DataFrame `df` to `path` as CSV or Parquet (pyarrow), atomically."""
    if fmt == "csv":
        data = df.to_csv(index=False).encode("utf-8")
    else:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise AttnkitError(f"Parquet needs pyarrow (pip install pyarrow); or use {arg('fmt', 'csv')}") from None
        buf = io.BytesIO()
        df.to_parquet(buf, index=False, engine="pyarrow")
        data = buf.getvalue()
    atomic_write(path, lambda f: f.write(data))


__all__ = ["TABLE_FORMATS", "atomic_write", "check_no_file_in_the_way", "check_output_path", "check_output_place",
           "check_write_target", "describe_os_error", "ensure_writable_dir", "is_within", "json_float", "os_errors",
           "real_path", "write_json", "write_table", "writing_into"]
