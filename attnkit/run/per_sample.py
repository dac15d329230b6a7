"""RUN/per_sample.npy: every sample's features (float16, N × layers × heads × F) in input order.

`attnkit extract --per-sample` keeps what the corpus means sum away (Kovaleva et al. Sec. 4 classify each
(example, head)). The corpus is streamed, so N is unknown until the end and the batches arrive in plan order
(length-sorted inside windows). `PerSampleWriter` therefore writes each row straight to its place in a
growing file, `per_sample.npy.partial`: row `p` (the sample at 0-based input position `p`) lives at byte
`HEADER_BYTES + p · row_bytes`. The file starts with a reserved, fixed-size .npy header; `close()` rewrites
that header with the final shape and renames the file to `per_sample.npy`, so no row is ever copied or held
in memory beyond one batch, and the result opens with `np.load(path, mmap_mode="r")`. Feature names and
counts go to `per_sample.json`.

Resume rule: an extraction that resumes after the first K segments of its plan reopens the partial file with
`PerSampleWriter(..., resume_after=K)`. The rows of those K segments are taken as written — the extractor
must call `flush()` before every checkpoint it saves, so a checkpoint never counts rows that are not on disk.
Rows written after the last checkpoint are simply written again (same place, same values). `close()` checks
that K + the rows added since equals the number of rows in the file, and that no position came twice.
"""
from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import AttnkitError, arg
from ..features import feature_names, windows_of
from .files import PER_SAMPLE_FILE, PER_SAMPLE_META
from .outputs import write_json
from .schemas import PER_SAMPLE_SCHEMA, load_json

PARTIAL_SUFFIX = ".partial"
HEADER_BYTES = 4096  # reserved .npy header (a multiple of 64, as the format recommends)
DTYPE = np.dtype("<f2")


def npy_header(shape: tuple[int, ...], size: int = HEADER_BYTES) -> bytes:
    """A version 1.0 .npy header for a C-order float16 array of `shape`, padded to exactly `size` bytes
    (numpy writes the dict; only the padding spaces differ from `np.lib.format`'s own)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(DTYPE), "fortran_order": False, "shape": tuple(shape)})
    raw = buf.getvalue()
    text = raw[10:].rstrip(b" \n")
    pad = size - 10 - len(text) - 1
    if pad < 0:
        raise AttnkitError(f"array shape {shape} does not fit a {size}-byte header")
    return raw[:8] + struct.pack("<H", size - 10) + text + b" " * pad + b"\n"


def _npy_path(path) -> Path:
    path = Path(path)
    return path / PER_SAMPLE_FILE if path.is_dir() or not path.suffix else path


class PerSampleWriter:
    """Write per-sample features (see the module docstring for the file layout and the resume rule).

    `path`: the .npy file to leave behind, or a run directory (→ RUN/per_sample.npy).
    `names`: the F feature names. `resume_after`: None for a new file (an old partial file is replaced);
    K to continue a partial file whose rows for the first K planned segments are on disk.
    """

    def __init__(self, path, n_layers: int, n_heads: int, names, *, resume_after: int | None = None):
        self.path = _npy_path(path)
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.names = list(names)
        self.row_shape = (int(n_layers), int(n_heads), len(self.names))
        if min(self.row_shape) < 1:
            raise AttnkitError(f"per-sample rows need layers, heads and features, got {self.row_shape}")
        self.row_bytes = int(np.prod(self.row_shape)) * DTYPE.itemsize
        self.done = 0 if resume_after is None else int(resume_after)
        if self.done < 0:
            raise AttnkitError(f"{arg('resume_after')} must be >= 0, got {resume_after}")
        self.added = 0
        self._seen = bytearray()  # positions written in this session (duplicate check)
        try:
            if resume_after is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                os.pwrite(self._fd, npy_header((0, *self.row_shape)), 0)
            else:
                if not self.partial.is_file():
                    raise AttnkitError(f"cannot resume the per-sample features: {self.partial} is missing")
                self._check_partial()
                self._fd = os.open(self.partial, os.O_RDWR)
        except OSError as exc:
            raise AttnkitError(f"cannot write {self.partial}: {exc.strerror or exc}") from None

    def _check_partial(self) -> None:
        try:
            with open(self.partial, "rb") as f:
                if np.lib.format.read_magic(f) != (1, 0):
                    raise ValueError("not a version 1.0 .npy header")
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                offset = f.tell()
        except (ValueError, OSError) as exc:
            raise AttnkitError(f"{self.partial} is not a per-sample file: {exc}") from None
        if offset != HEADER_BYTES or dtype != DTYPE or fortran or tuple(shape[1:]) != self.row_shape:
            raise AttnkitError(f"{self.partial} holds rows of shape {tuple(shape[1:])} ({dtype}), not "
                               f"{self.row_shape}: it belongs to another model or feature set")
        size = self.partial.stat().st_size - HEADER_BYTES
        if self.done * self.row_bytes > size:
            raise AttnkitError(f"{self.partial} holds fewer than the {self.done} rows the checkpoint counts")

    def add(self, positions, features) -> None:
        """Write one batch: `features` B × layers × heads × F, `positions` the B samples' input positions."""
        if self._fd is None:
            raise AttnkitError("this PerSampleWriter is closed")
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        feats = np.asarray(features)
        if feats.shape != (len(positions), *self.row_shape):
            raise AttnkitError(f"per-sample features have shape {feats.shape}, expected "
                               f"({len(positions)}, {', '.join(map(str, self.row_shape))})")
        if len(positions) and positions.min() < 0:
            raise AttnkitError(f"negative sample position {int(positions.min())}")
        rows = np.ascontiguousarray(feats, dtype=DTYPE)
        for pos, row in zip(positions.tolist(), rows):
            if pos >= len(self._seen):
                self._seen.extend(bytes(max(pos + 1 - len(self._seen), len(self._seen))))
            if self._seen[pos]:
                raise AttnkitError(f"sample position {pos} was written twice")
            self._seen[pos] = 1
            os.pwrite(self._fd, row.tobytes(), HEADER_BYTES + pos * self.row_bytes)
        self.added += len(positions)

    def flush(self) -> None:
        """Make every row added so far durable (call before saving an extraction checkpoint)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> Path:
        """Finish the file: final header, rename to per_sample.npy, write per_sample.json. Returns the path."""
        if self._fd is None:
            return self.path
        size = os.fstat(self._fd).st_size - HEADER_BYTES
        n, rest = divmod(size, self.row_bytes)
        if rest or self.done + self.added != n:
            raise AttnkitError(f"{self.partial}: {self.done} rows from before the resume and {self.added} added "
                               f"do not fill its {size / self.row_bytes:g} rows (positions missing)")
        os.pwrite(self._fd, npy_header((n, *self.row_shape)), 0)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.partial, self.path)
        meta = {"file": self.path.name, "n_samples": int(n), "n_layers": self.row_shape[0],
                "n_heads": self.row_shape[1], "names": self.names, "dtype": "float16", "order": "input"}
        write_json(self.path.with_name(PER_SAMPLE_META), meta)
        return self.path

    def abandon(self) -> None:
        """Stop without finishing (an interrupted run): rows so far stay in the partial file for a resume."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def load_per_sample(run_dir) -> tuple[np.ndarray, list[str]]:
    """(memory-mapped N × layers × heads × F float16 array, feature names) of a run."""
    path = _npy_path(run_dir)
    meta_path = path.with_name(PER_SAMPLE_META)
    if not path.is_file():
        raise AttnkitError(f"{path} is missing: run `attnkit extract --per-sample` first")
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as exc:
        raise AttnkitError(f"{path} is unreadable: {exc}") from None
    names = load_json(meta_path, PER_SAMPLE_SCHEMA)["names"] if meta_path.is_file() else None
    if arr.ndim != 4:
        raise AttnkitError(f"{path} has shape {arr.shape}, expected samples × layers × heads × features")
    if names is None:
        names = feature_names(windows_of(arr.shape[3]))
    if len(names) != arr.shape[3]:
        raise AttnkitError(f"{meta_path} names {len(names)} features but {path} holds {arr.shape[3]}")
    return arr, list(names)


def check_matches_run(run_dir, arr: np.ndarray, names: list[str]) -> None:
    """Refuse per-sample rows that are not those of the run in `run_dir`: as many rows as the run measured
    samples (meta.json n_samples), of its layers × heads, with its feature names (features.npz). A file from
    another run, or cut short, would be classified as if it were this run's."""
    from .head_features import HeadFeatures

    path = _npy_path(run_dir)
    run = HeadFeatures.load(Path(run_dir) if Path(run_dir).is_dir() else path.parent)
    want = (run.n_samples, run.n_layers, run.n_heads, len(run.names))
    if tuple(arr.shape) != want or list(names) != list(run.names):
        what = (f"names other features ({', '.join(names[:3])}, ...)" if tuple(arr.shape) == want
                else f"holds {arr.shape[0]} samples × {arr.shape[1]} layers × {arr.shape[2]} heads × {arr.shape[3]} "
                     f"features")
        raise AttnkitError(f"{path} {what}, but its run measured {want[0]} samples × {want[1]} layers × "
                           f"{want[2]} heads × {want[3]} features: it is not this run's per-sample file; run "
                           "`attnkit extract --per-sample` again")


__all__ = ["PerSampleWriter", "check_matches_run", "load_per_sample", "npy_header", "PER_SAMPLE_FILE",
           "PER_SAMPLE_META", "HEADER_BYTES"]
