"""A run directory opened once (`Run`): what a command read from it and checked, handed down to whatever the command
does next, so that no file of the run is read twice (one command, one reading: the checks made before the work are
those of the files the work uses)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .files import CLUSTERS_FILE
from .head_features import HeadFeatures


@dataclass
class Run:
    """A run directory as a command read it: `path`, its `features` (features.npz and meta.json, checked by
    `HeadFeatures.load`) and `clusters`, the content of clusters.json checked against the run (None: the run has none,
    or the command does not read it). `open_run` makes one; the report and `attnkit cluster` with
    `attnkit.analysis.preflight.load_run`, which adds their checks."""

    path: Path
    features: HeadFeatures
    clusters: dict | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(n_layers, n_heads)."""
        return self.features.n_layers, self.features.n_heads

    @property
    def clusters_file(self) -> Path:
        return self.path / CLUSTERS_FILE


def open_run(run_dir) -> Run:
    """`run_dir` opened once: features.npz and meta.json read and checked (`HeadFeatures.load`, which also attaches
    per_sample.npy when it fits), clusters.json not read. A command that needs more checks (the report's, the
    clustering's: attnkit.analysis.preflight.load_run) makes its `Run` there."""
    return Run(Path(run_dir), HeadFeatures.load(run_dir))


__all__ = ["Run", "open_run"]
