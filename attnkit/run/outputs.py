"""Where attnkit writes: check an output directory before the work, and turn OS errors into one line.

Every writer (extract, cluster, distances, report, compare --json, export, ablate -o, probe) calls
`ensure_writable_dir` before it starts computing, so a bad `-o` (under a file, on a read-only file
system, on a full disk) fails at once instead of after minutes of work, and wraps its writing in
`os_errors` so an OSError while writing (ENOSPC, EROFS, ...) ends as an `AttnkitError`.
"""
from __future__ import annotations

import contextlib
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
def output_dir(path, what: str = "output directory"):
    """`ensure_writable_dir(path)` for the block (checked before the work), and removed again if the block fails
    while the directory it created is still empty: a command that failed leaves nothing behind."""
    existed = Path(path).exists() if str(path).strip() else True
    directory = ensure_writable_dir(path, what)
    try:
        yield directory
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                directory.rmdir()  # only while empty
        raise


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


__all__ = ["TABLE_FORMATS", "atomic_write", "check_no_file_in_the_way", "check_output_path", "describe_os_error",
           "ensure_writable_dir", "json_float", "os_errors", "output_dir", "write_json", "write_table"]
