"""RUN/per_sample.npy: every sample's features (float32, N × layers × heads × F) in input order, and
RUN/per_sample_rows.csv, which says where each row came from.

`attnkit extract --per-sample` keeps what the corpus means sum away (Kovaleva et al. Sec. 4 classify each
(example, head)). The corpus is streamed, so N is unknown until the end and the batches arrive in plan order
(length-sorted inside windows). `PerSampleWriter` therefore writes each row straight to its place in a
growing file, `per_sample.npy.partial`: row `p` (the sample at 0-based input position `p`) lives at byte
`HEADER_BYTES + p · row_bytes`. The file starts with a reserved, fixed-size .npy header; `close()` rewrites
that header with the final shape and renames the file to `per_sample.npy`, so no row is ever copied or held
in memory beyond one batch, and the result opens with `np.load(path, mmap_mode="r")`. Feature names and
counts go to `per_sample.json`.

Values are stored as float32, the precision the kernels compute them in: classes decided by thresholds on these
values (attnkit/analysis/patterns.py) must not flip by storage rounding (float16, which attnkit 0.1 wrote and
`load_per_sample` still reads, moved values by up to 3e-5 near 0.5). `per_sample.json` names the dtype.

The rows table: when the writer is given the batches' segments, it keeps them in `per_sample_rows.csv.partial`
as one JSON line per sample in plan order, and `close()` writes `per_sample_rows.csv` in input order: `row`,
`input` (index into meta.json `inputs`), `position` (the segment's 0-based place in that input) and the
segment's `text` and `text_pair`. Plan order differs from input order only inside a window, so a heap of at most
one window's rows puts them in order.

Resume rule: an extraction that resumes after the first K segments of its plan reopens the partial files with
`PerSampleWriter(..., resume_after=K)`. The rows of those K segments are taken as written — the extractor
must call `flush()` before every checkpoint it saves, so a checkpoint never counts rows that are not on disk.
Rows written after the last checkpoint are simply written again (same place, same values); the rows table
keeps its first K lines and drops the rest. `close()` checks that K + the rows added since equals the number
of rows in the file, and that no position came twice.
"""
from __future__ import annotations

import csv
import heapq
import io
import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import AttnkitError, arg
from ..features import feature_names, windows_of
from .files import PER_SAMPLE_FILE, PER_SAMPLE_META, PER_SAMPLE_ROWS
from .outputs import check_write_target, write_json
from .schemas import PER_SAMPLE_SCHEMA, load_json

PARTIAL_SUFFIX = ".partial"
HEADER_BYTES = 4096  # reserved .npy header (a multiple of 64, as the format recommends)
DTYPE = np.dtype("<f4")  # what new files hold
READABLE_DTYPES = (np.dtype("<f4"), np.dtype("<f2"))  # float16: files of attnkit 0.1


def npy_header(shape: tuple[int, ...], size: int = HEADER_BYTES) -> bytes:
    """A version 1.0 .npy header for a C-order float32 array of `shape`, padded to exactly `size` bytes
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
        check_write_target(self.path.parent)
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
        self.rows = _RowsTable(self.path.with_name(PER_SAMPLE_ROWS), resume_after)
        self.rows_written = False  # whether close() wrote the rows table
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
                               f"{self.row_shape} ({DTYPE}): it belongs to another model, feature set or attnkit "
                               f"version; start over with {arg('overwrite', True)}")
        size = self.partial.stat().st_size - HEADER_BYTES
        if self.done * self.row_bytes > size:
            raise AttnkitError(f"{self.partial} holds fewer than the {self.done} rows the checkpoint counts")

    def add(self, positions, features, segments=None) -> None:
        """Write one batch: `features` B × layers × heads × F, `positions` the B samples' input positions,
        `segments` their texts (str or (str, str)) for the rows table (None: no table)."""
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
        if segments is not None:
            self.rows.add(positions.tolist(), segments)

    def flush(self) -> None:
        """Make every row added so far durable (call before saving an extraction checkpoint)."""
        if self._fd is not None:
            os.fsync(self._fd)
        self.rows.flush()

    def close(self, input_counts=None) -> Path:
        """Finish the file: final header, rename to per_sample.npy, write per_sample.json, and the rows table
        when segments were given (`input_counts`: the segments each input gave, in reading order; None: one
        input). Returns the path."""
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
                "n_heads": self.row_shape[1], "names": self.names, "dtype": DTYPE.name, "order": "input"}
        self.rows_written = self.rows.close(int(n), input_counts)
        if self.rows_written:
            meta["rows"] = PER_SAMPLE_ROWS
        write_json(self.path.with_name(PER_SAMPLE_META), meta)
        return self.path

    def abandon(self) -> None:
        """Stop without finishing (an interrupted run): rows so far stay in the partial file for a resume."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        self.rows.abandon()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abandon()


class _RowsTable:
    """per_sample_rows.csv, built from JSON lines in plan order (see the module docstring)."""

    COLUMNS = ("row", "input", "position", "text", "text_pair")

    def __init__(self, path: Path, resume_after: int | None):
        self.path = path
        check_write_target(path.parent)
        self.partial = path.with_name(path.name + PARTIAL_SUFFIX)
        self._f = None
        self.lines = 0
        self.given_up = False  # a resumed run whose partial table is missing or short goes on without one
        if not resume_after:
            self.partial.unlink(missing_ok=True)
            return
        kept = []
        if self.partial.is_file():  # keep the lines of the K segments the checkpoint counts
            with open(self.partial, "rb") as f:
                kept = [line for _, line in zip(range(resume_after), f)]
        if len(kept) != resume_after:
            self.partial.unlink(missing_ok=True)
            self.given_up = True
            return
        with open(self.partial, "wb") as f:
            f.writelines(kept)
        self.lines = resume_after
        self._f = open(self.partial, "a", encoding="utf-8")  # noqa: SIM115 (closed by close/abandon)

    def add(self, positions: list[int], segments) -> None:
        if self.given_up:
            return
        if self._f is None:
            self._f = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115
        for pos, seg in zip(positions, segments):
            if isinstance(seg, str):
                text, pair = seg, None
            elif hasattr(seg, "name"):  # an image (attnkit.corpus.images.ImageItem): its name
                text, pair = seg.name, None
            else:
                text, pair = seg[0], seg[1]
            self._f.write(json.dumps([pos, text, pair], ensure_ascii=False) + "\n")
        self.lines += len(positions)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())

    def abandon(self) -> None:
        if self._f is not None:
            self.flush()
            self._f.close()
            self._f = None

    def close(self, n_rows: int, input_counts) -> bool:
        """Write the table in input order (True), or leave none when segments were not given (False)."""
        if self._f is None:
            self.partial.unlink(missing_ok=True)
            return False
        self._f.close()
        self._f = None
        if self.lines != n_rows:
            self.partial.unlink(missing_ok=True)
            raise AttnkitError(f"{self.partial}: {self.lines} rows described for {n_rows} samples")
        counts = [int(c) for c in (input_counts if input_counts is not None else [n_rows])]
        if sum(counts) != n_rows:
            raise AttnkitError(f"the inputs gave {sum(counts)} segments but {n_rows} samples were written")
        starts = np.cumsum([0] + counts[:-1])
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(self.partial, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8", newline="") as out:
            w = csv.writer(out)
            w.writerow(self.COLUMNS)
            heap: list = []
            expect = 0
            for line in src:
                pos, text, pair = json.loads(line)
                heapq.heappush(heap, (pos, text, pair))
                while heap and heap[0][0] == expect:
                    pos, text, pair = heapq.heappop(heap)
                    i = int(np.searchsorted(starts, pos, side="right")) - 1
                    w.writerow((pos, i, pos - int(starts[i]), text, "" if pair is None else pair))
                    expect += 1
            if heap or expect != n_rows:
                raise AttnkitError(f"{self.partial}: rows missing or repeated (row {expect} never came)")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        self.partial.unlink()
        return True


def read_rows(run_dir, rows=None):
    """The rows table of a run (per_sample_rows.csv) as a DataFrame indexed by `row`; `rows` picks some."""
    import pandas as pd

    path = _npy_path(run_dir).with_name(PER_SAMPLE_ROWS)
    if not path.is_file():
        raise AttnkitError(f"{path} is missing: runs extracted with --per-sample by attnkit 0.1 have no rows table; "
                           f"extract again with --per-sample")
    try:
        df = pd.read_csv(path, keep_default_na=False, dtype={"text": str, "text_pair": str})
    except (ValueError, OSError) as exc:
        raise AttnkitError(f"{path} is unreadable: {exc}") from None
    if list(df.columns) != list(_RowsTable.COLUMNS):
        raise AttnkitError(f"{path} has columns {', '.join(df.columns)}, not {', '.join(_RowsTable.COLUMNS)}")
    df = df.set_index("row")
    return df if rows is None else df.loc[list(rows)]


def rows_table_problem(run_dir, n_rows: int) -> str | None:
    """Why RUN/per_sample_rows.csv cannot say where the `n_rows` rows of per_sample.npy came from: missing although
    per_sample.json lists it (the writer lists it when it writes it), or cut short (fewer complete lines than rows,
    a last line without all its columns). None when it describes every row, or when the run never had one (runs of
    attnkit 0.1: their texts are read again from the corpus). A file that is no rows table at all (other columns,
    a row that is not a number) is left to its reader, which names it (AttnkitError)."""
    path = _npy_path(run_dir).with_name(PER_SAMPLE_ROWS)
    meta_path = path.with_name(PER_SAMPLE_META)
    if not path.is_file():
        try:
            listed = json.loads(meta_path.read_text(encoding="utf-8")).get("rows") == PER_SAMPLE_ROWS
        except (OSError, ValueError, AttributeError):
            listed = False
        return f"{PER_SAMPLE_ROWS} is missing ({PER_SAMPLE_META} lists it)" if listed else None
    complete, expect = 0, len(_RowsTable.COLUMNS)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            if next(reader, None) != list(_RowsTable.COLUMNS):
                return None  # no rows table: its reader names the problem
            for record in reader:
                if len(record) != expect or record[0] != str(complete):
                    break
                complete += 1
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    if complete < n_rows:
        return (f"{PER_SAMPLE_ROWS} is cut short or damaged: it describes {complete} of the {n_rows} rows of "
                f"{PER_SAMPLE_FILE} in order")
    if complete > n_rows:
        return f"{PER_SAMPLE_ROWS} describes {complete} rows, {PER_SAMPLE_FILE} holds {n_rows}: it is another run's"
    return None


def per_sample_path(run_dir) -> Path:
    """The per-sample file of a run directory (or `run_dir` itself, a .npy file), refused when it is missing."""
    path = _npy_path(run_dir)
    if not path.is_file():
        raise AttnkitError(f"{path} is missing: run `attnkit extract --per-sample` first")
    return path


def load_per_sample(run_dir) -> tuple[np.ndarray, list[str]]:
    """(memory-mapped N × layers × heads × F array, feature names) of a run: float32, or float16 in files of
    attnkit 0.1 (read as they are; callers that compare with thresholds convert rows to float32 first)."""
    path = per_sample_path(run_dir)
    meta_path = path.with_name(PER_SAMPLE_META)
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as exc:
        raise AttnkitError(f"{path} is unreadable: {exc}") from None
    names = load_json(meta_path, PER_SAMPLE_SCHEMA)["names"] if meta_path.is_file() else None
    if arr.ndim != 4:
        raise AttnkitError(f"{path} has shape {arr.shape}, expected samples × layers × heads × features")
    if arr.dtype not in READABLE_DTYPES:
        raise AttnkitError(f"{path} holds {arr.dtype} values; per-sample files hold float32 (or float16)")
    if names is None:
        names = feature_names(windows_of(arr.shape[3]))
    if len(names) != arr.shape[3]:
        raise AttnkitError(f"{meta_path} names {len(names)} features but {path} holds {arr.shape[3]}")
    return arr, list(names)


def check_matches_run(run_dir, arr: np.ndarray, names: list[str], run) -> None:
    """Refuse per-sample rows that are not those of `run` (the HeadFeatures of `run_dir`): as many rows as the
    run measured samples (meta.json n_samples), of its layers × heads, with its feature names (features.npz), and
    whose mean over samples is the run's mean of every feature. A file from another run, cut short or left over
    from a replaced run would be classified as if it were this run's."""
    path = _npy_path(run_dir)
    want = (run.n_samples, run.n_layers, run.n_heads, len(run.names))
    if tuple(arr.shape) != want or list(names) != list(run.names):
        what = (f"names other features ({', '.join(names[:3])}, ...)" if tuple(arr.shape) == want
                else f"holds {arr.shape[0]} samples × {arr.shape[1]} layers × {arr.shape[2]} heads × {arr.shape[3]} "
                     f"features")
        raise AttnkitError(f"{path} {what}, but its run measured {want[0]} samples × {want[1]} layers × "
                           f"{want[2]} heads × {want[3]} features: it is not this run's per-sample file; run "
                           "`attnkit extract --per-sample` again")
    # the same shape is not enough: the run's means are the means of its samples (docs/features.md)
    total = np.zeros(want[1:], dtype=np.float64)
    for i in range(0, want[0], 4096):
        total += np.asarray(arr[i:i + 4096], dtype=np.float64).sum(0)
    mean, theirs = total / max(want[0], 1), np.asarray(run.mean, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        off = ~np.isclose(mean, theirs, rtol=1e-4, atol=1e-5, equal_nan=True)
    if off.any():
        l, h, f = (int(x) for x in np.argwhere(off)[0])
        raise AttnkitError(f"{path} does not hold the samples of its run: their mean of {run.names[f]} for L{l}H{h} "
                           f"is {mean[l, h, f]:.6g}, features.npz says {theirs[l, h, f]:.6g} ({int(off.sum())} "
                           "values differ); run `attnkit extract --per-sample` again")


__all__ = ["PerSampleWriter", "check_matches_run", "load_per_sample", "npy_header", "read_rows", "rows_table_problem",
           "PER_SAMPLE_FILE", "PER_SAMPLE_META", "PER_SAMPLE_ROWS", "HEADER_BYTES"]
