"""Writing tracked statistics (docs/training.md, "Logging"): one row per (step, feature, layer, head) to CSV or
Parquet, and one TensorBoard scalar per head (`torch.utils.tensorboard`, which needs the `tensorboard` package)."""
from __future__ import annotations

import csv

import torch

from ..errors import AttnkitError
from .checks import directory_to_write, file_to_write, integer, stats_table

COLUMNS = ("step", "feature", "layer", "head", "value")


class StatsLogger:
    """`log(step, stats)` writes `tracker.read()`'s dict: to `path` (".csv": appended row by row; ".parquet": kept and
    written by `close()`; either suffix in any case) and/or to a TensorBoard directory `tensorboard` (tags
    `attnkit/<feature>/L<l>H<h>`). Moving the statistics to the host is the one sync of a `log` call.

    A file that already holds this table is appended to; one that holds another table is refused, never mixed.
    `close()` writes and releases the files; a `log` after it opens them again (CSV and TensorBoard append, the
    Parquet file is written again with every row), so no row is lost."""

    def __init__(self, path=None, tensorboard=None):
        if path is None and tensorboard is None:
            raise AttnkitError("StatsLogger needs a path (.csv or .parquet) or a tensorboard directory")
        self.path = None if path is None else file_to_write(path, "path", (".csv", ".parquet"))
        self.format = None if path is None else self.path.suffix.lower()[1:]
        self.tensorboard = None if tensorboard is None else directory_to_write(tensorboard, "tensorboard")
        self._summary_writer = None
        if self.tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise AttnkitError(f"logging to TensorBoard needs the tensorboard package ({exc}): "
                                   "pip install tensorboard") from None
            self._summary_writer = SummaryWriter
        self._rows: list[tuple] = []  # Parquet: the rows to write (those the file held before, then every logged one)
        if self.format == "csv":
            self._check_csv_header()
        elif self.format == "parquet":
            self._rows = self._parquet_rows()
        self._csv = None
        self._writer = None

    def _check_csv_header(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, newline="", encoding="utf-8", errors="replace") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != COLUMNS:
            raise AttnkitError(f"path {str(self.path)!r} holds another table (its header: {','.join(header)[:120]!r}, "
                               f"this logger's: {','.join(COLUMNS)!r}): log to a new file, or remove that one")

    def _parquet_rows(self) -> list[tuple]:
        if not self.path.exists():
            return []
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(self.path)
        except (pa.ArrowException, OSError) as exc:
            raise AttnkitError(f"path {str(self.path)!r} exists and is not a Parquet file this logger can append to "
                               f"({exc}): log to a new file, or remove that one") from None
        if tuple(table.column_names) != COLUMNS:
            raise AttnkitError(f"path {str(self.path)!r} holds another table (columns {table.column_names}, this "
                               f"logger's {list(COLUMNS)}): log to a new file, or remove that one")
        return list(zip(*(table.column(c).to_pylist() for c in COLUMNS)))

    def _open(self) -> None:
        if self.format == "csv" and self._csv is None:
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._csv = open(self.path, "a", newline="")  # noqa: SIM115 (closed by close())
            self._csv_writer = csv.writer(self._csv)
            if new:
                self._csv_writer.writerow(COLUMNS)
        if self._summary_writer is not None and self._writer is None:
            self._writer = self._summary_writer(str(self.tensorboard))

    def log(self, step: int, stats: dict[str, torch.Tensor]) -> None:
        """Write `stats` ({feature: layers × heads tensor}, as `tracker.read()` returns) as step `step` (an integer
        ≥ 0: a Python or numpy integer, or a 0-d integer tensor)."""
        step = integer(step, "step")
        table = stats_table(stats)
        rows = []
        for name, t in table.items():
            for layer, heads in enumerate(t.tolist()):
                for head, value in enumerate(heads):
                    rows.append((step, name, layer, head, float(value)))
        self._open()
        if self._csv is not None:
            self._csv_writer.writerows(rows)
            self._csv.flush()
        elif self.format == "parquet":
            self._rows.extend(rows)
        if self._writer is not None:
            for step_, name, layer, head, value in rows:
                self._writer.add_scalar(f"attnkit/{name}/L{layer}H{head}", value, step_)

    def close(self) -> None:
        """Write what is kept (Parquet) and release the files; a later `log` opens them again."""
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        if self.format == "parquet" and self._rows:
            import pyarrow as pa
            import pyarrow.parquet as pq

            cols = list(zip(*self._rows))
            pq.write_table(pa.table({c: list(v) for c, v in zip(COLUMNS, cols)}), self.path)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
