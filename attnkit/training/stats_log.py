"""Writing tracked statistics (docs/training.md, "Logging"): one row per (step, feature, layer, head) to CSV or
Parquet, and one TensorBoard scalar per head (`torch.utils.tensorboard`, which needs the `tensorboard` package)."""
from __future__ import annotations

import csv
from pathlib import Path

import torch

from ..errors import AttnkitError

COLUMNS = ("step", "feature", "layer", "head", "value")


class StatsLogger:
    """`log(step, stats)` writes `tracker.read()`'s dict: to `path` (".csv": appended row by row; ".parquet": kept and
    written by `close()`) and/or to a TensorBoard directory `tensorboard` (tags `attnkit/<feature>/L<l>H<h>`).
    Moving the statistics to the host is the one sync of a `log` call."""

    def __init__(self, path=None, tensorboard=None):
        if path is None and tensorboard is None:
            raise AttnkitError("StatsLogger needs a path (.csv or .parquet) or a tensorboard directory")
        self.path = None if path is None else Path(path)
        if self.path is not None and self.path.suffix not in (".csv", ".parquet"):
            raise AttnkitError(f"StatsLogger writes .csv or .parquet files, got {str(path)!r}")
        self._rows: list[tuple] = []
        self._csv = None
        self._writer = None
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise AttnkitError(f"logging to TensorBoard needs the tensorboard package ({exc}): "
                                   "pip install tensorboard") from None
            self._writer = SummaryWriter(str(tensorboard))
        if self.path is not None and self.path.suffix == ".csv":
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._csv = open(self.path, "a", newline="")  # noqa: SIM115 (closed by close())
            self._csv_writer = csv.writer(self._csv)
            if new:
                self._csv_writer.writerow(COLUMNS)

    def log(self, step: int, stats: dict[str, torch.Tensor]) -> None:
        rows = []
        for name, t in stats.items():
            values = t.detach().float().cpu().tolist()
            for layer, heads in enumerate(values):
                for head, value in enumerate(heads):
                    rows.append((int(step), name, layer, head, float(value)))
        if self._csv is not None:
            self._csv_writer.writerows(rows)
            self._csv.flush()
        elif self.path is not None:
            self._rows.extend(rows)
        if self._writer is not None:
            for step_, name, layer, head, value in rows:
                self._writer.add_scalar(f"attnkit/{name}/L{layer}H{head}", value, step_)

    def close(self) -> None:
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        if self.path is not None and self.path.suffix == ".parquet" and self._rows:
            import pyarrow as pa
            import pyarrow.parquet as pq

            cols = list(zip(*self._rows))
            pq.write_table(pa.table({c: list(v) for c, v in zip(COLUMNS, cols)}), self.path)
            self._rows = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
