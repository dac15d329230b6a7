"""Shard files of the Ray engine: RUN/shards/shard-000042.npz (RUN/distance-shards/ for distances), one
finished shard's sums with the settings they were measured under (docs/pipeline.md, "Many machines").

A shard's sums are written atomically once all its batches are in; a rerun with the same settings skips the
shards that have a file, and a file written under other settings is refused, naming what differs. Feature
moments merge as counts, sums and sums of squared deviations (`merge_moments`), the rest of the sums add.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from .files import DISTANCE_SHARDS_DIR, FEATURE_SHARDS_DIR
from .head_features import merge_moments
from .outputs import atomic_write
from .schemas import load_npz
from .settings import setting_differences, settings_fingerprint

# What a batch contributes, per kind of run: summed in batch order within a shard, then over shards.
SUM_KEYS = {
    "features": ("sum", "m2", "n_samples", "n_tokens", "n_truncated"),
    "distances": ("js", "n_rows", "n_samples", "n_tokens", "n_truncated"),
}
SHAPE_KEYS = ("n_layers", "n_heads")
_SHARD_DIRS = {"features": FEATURE_SHARDS_DIR, "distances": DISTANCE_SHARDS_DIR}
_ADDED = {"sum", "n_samples", "n_tokens", "n_truncated", "js", "n_rows"}


def shard_dir(run_dir, kind: str = "features") -> Path:
    """Where a run keeps its finished shards (features: RUN/shards, distances: RUN/distance-shards)."""
    return Path(run_dir) / _SHARD_DIRS[kind]


def remove_shards(run_dir, kind: str = "features") -> None:
    """Delete a run's shard files (after the run was saved, or before starting over)."""
    d = shard_dir(run_dir, kind)
    if d.is_dir():
        for p in d.glob("shard-*.npz"):
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()


def add_sums(total: dict | None, part: dict) -> dict:
    """`total` plus one more batch's or shard's sums. Feature moments merge as counts, sums and sums of squared
    deviations (merge_moments); other summable keys add; the rest (shape) are taken as they are."""
    part = {k: np.array(v) for k, v in part.items()}
    if total is None:
        return part
    out = {k: (total[k] + part[k]) if k in _ADDED else part[k] for k in part}
    if "m2" in part:
        n, out["sum"], out["m2"] = merge_moments(int(total["n_samples"]), total["sum"], total["m2"],
                                                 int(part["n_samples"]), part["sum"], part["m2"])
        out["n_samples"] = np.int64(n)
    return out


class ShardStore:
    """RUN/<dir>/shard-000042.npz: one finished shard's sums, with the settings they were measured under."""

    def __init__(self, directory: Path, settings: dict, kind: str):
        self.directory = Path(directory)
        self.settings = settings
        self.fingerprint = settings_fingerprint(settings)
        self.kind = kind

    def path(self, shard: int) -> Path:
        return self.directory / f"shard-{shard:06d}.npz"

    def finished(self) -> set[int]:
        """Shards with a file, after checking that every file was written under these settings."""
        out = set()
        if not self.directory.is_dir():
            return out
        for p in sorted(self.directory.glob("shard-*.npz")):
            try:
                shard = int(p.stem.split("-", 1)[1])
            except ValueError:
                continue
            self._read(p)
            out.add(shard)
        return out

    def _read(self, path: Path) -> dict:
        data = load_npz(path, what="shard file", corrupt="delete it to measure that shard again")
        try:
            fingerprint = str(data["fingerprint"])
            saved = json.loads(str(data["settings"]))
        except Exception as exc:
            raise AttnkitError(f"shard file {path} is unreadable or corrupt ({type(exc).__name__}: {exc}); "
                               "delete it to measure that shard again") from None
        if fingerprint != self.fingerprint:
            diffs = setting_differences(saved, self.settings)
            raise AttnkitError(f"shard file {path} was written under other settings ("
                               + ("; ".join(diffs) or "fingerprint differs")
                               + "): use another run directory, or delete " + str(self.directory))
        return data

    def load(self, shard: int, n_segments: int) -> dict:
        path = self.path(shard)
        data = self._read(path)
        if int(data["n_segments"]) != n_segments:
            raise AttnkitError(f"shard file {path} holds {int(data['n_segments'])} segments but window {shard} of "
                               f"the corpus has {n_segments}: the corpus changed; delete {self.directory}")
        return {k: data[k] for k in SUM_KEYS[self.kind]} | {k: data[k] for k in SHAPE_KEYS if k in data}

    def save(self, shard: int, sums: dict, n_segments: int, n_batches: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        state = {k: np.asarray(v) for k, v in sums.items()}
        state.update(n_segments=np.int64(n_segments), n_batches=np.int64(n_batches), kind=np.array(self.kind),
                     fingerprint=np.array(self.fingerprint),
                     settings=np.array(json.dumps(self.settings, sort_keys=True, default=str)))
        atomic_write(self.path(shard), lambda f: np.savez(f, **state))


__all__ = ["SHAPE_KEYS", "SUM_KEYS", "ShardStore", "add_sums", "remove_shards", "settings_fingerprint", "shard_dir"]
