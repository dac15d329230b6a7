"""The run directory of an extraction, and its checkpoints.

A finished run holds features.npz and meta.json. While a run is under way, only checkpoint.npz is
written (atomically, every few batches and on interruption): it holds the feature sums, the index of
the next segment and the settings. A failed or interrupted run therefore never damages a finished run
in the same directory, and `--resume` continues from the checkpoint to the same numbers an
uninterrupted run gives (the same batches, in the same order, summed in float64).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import AttnkitError, arg
from .files import CHECKPOINT_FILE, DERIVED_OUTPUTS, FEATURES_FILE, META_FILE, PER_SAMPLE_FILE
from .head_features import FeatureAccumulator, HeadFeatures
from .outputs import atomic_write
from .overwrite import Claim, claim_outputs
from .schemas import load_npz
from .settings import setting_differences


class RunDir:
    def __init__(self, path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise AttnkitError(f"output path {str(self.path)!r} exists and is not a directory")

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT_FILE

    def is_finished(self) -> bool:
        return (self.path / FEATURES_FILE).is_file()

    def has_checkpoint(self) -> bool:
        return self.checkpoint_path.is_file()

    def check_new(self, overwrite: bool, per_sample: bool = False) -> Claim:
        """Refuse to start a fresh run over an existing one unless told to (naming what `overwrite` removes: the
        run and everything derived from it); returns what the new run will replace. `per_sample`: the new run
        is asked for per-sample features, which a finished run without them can only get by measuring again."""
        if not overwrite and self.has_checkpoint():
            raise AttnkitError(f"{self.path} holds an interrupted run: continue it with {arg('resume', True)}, or "
                               f"start over with {arg('overwrite', True)}")
        lacks = per_sample and self.is_finished() and not (self.path / PER_SAMPLE_FILE).is_file()
        return self.claim(overwrite, what=f"{self.path} already holds a finished run"
                          + (f" without {PER_SAMPLE_FILE} (only a new measurement of its corpus adds it)"
                             if lacks else ""))

    def claim(self, overwrite: bool, what: str | None = None) -> Claim:
        """The overwrite check of a fresh run here: features.npz and meta.json are replaced, the checkpoint and
        what later steps derived from the old features (DERIVED_OUTPUTS) go with them."""
        return claim_outputs([self.path / FEATURES_FILE, self.path / META_FILE], overwrite,
                             stale=[self.path / CHECKPOINT_FILE] + [self.path / n for n in DERIVED_OUTPUTS],
                             what=what)

    def load_checkpoint(self, settings: dict) -> tuple[FeatureAccumulator, int, int, np.ndarray | None]:
        """(accumulator, next segment index, truncated so far, histogram of full token lengths) after checking
        that the settings match and that the checkpoint's numbers are possible."""
        if not self.has_checkpoint():
            raise AttnkitError(f"nothing to resume in {self.path}: no {CHECKPOINT_FILE}")
        state = load_npz(self.checkpoint_path, what="checkpoint",
                         corrupt=f"start over with {arg('overwrite', True)}")
        try:
            saved = json.loads(str(state["settings"]))
            acc = FeatureAccumulator.from_state(state)
            next_index, n_truncated = int(state["next_index"]), int(state["n_truncated"])
            lengths = np.asarray(state["lengths"], dtype=np.int64) if "lengths" in state else None
        except Exception as exc:
            raise AttnkitError(f"checkpoint {self.checkpoint_path} is corrupt: {type(exc).__name__}: {exc}") from None
        if not isinstance(saved, dict):
            raise AttnkitError(f"checkpoint {self.checkpoint_path} is corrupt: its settings are not a mapping")
        self.check_settings(saved, settings)
        problem = checkpoint_problem(acc, next_index, n_truncated)
        if problem:
            raise AttnkitError(f"checkpoint {self.checkpoint_path} is impossible ({problem}); start over with "
                               f"{arg('overwrite', True)}")
        return acc, next_index, n_truncated, lengths

    @staticmethod
    def check_settings(saved: dict, settings: dict) -> None:
        """Refuse to add to a run made with other settings, naming each that differs."""
        diffs = setting_differences(saved, settings)
        if diffs:
            raise AttnkitError("cannot resume: the run directory was made with other settings ("
                               + "; ".join(diffs) + ")")

    def finished_settings(self) -> dict:
        meta = HeadFeatures.load(self.path).meta
        return meta.get("settings", {})

    def save_checkpoint(self, acc: FeatureAccumulator, next_index: int, n_truncated: int, settings: dict,
                        lengths: np.ndarray | None = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        state = acc.state()
        state.update(next_index=np.int64(next_index), n_truncated=np.int64(n_truncated),
                     settings=np.array(json.dumps(settings, sort_keys=True)))
        if lengths is not None:
            state["lengths"] = np.asarray(lengths, dtype=np.int64)
        atomic_write(self.checkpoint_path, lambda f: np.savez(f, **state))

    def finish(self, features: HeadFeatures, fresh: bool = True) -> str | None:
        """Write the finished run; a `fresh` run (not a resumed one) also removes what later steps derived
        from the features it replaces. Returns the message naming what a replaced run lost (None: nothing)."""
        claim = self.claim(True) if fresh else None
        features.save(self.path)
        self.checkpoint_path.unlink(missing_ok=True)
        if claim is None:
            return None
        claim.stale = [p for p in claim.stale if p != self.checkpoint_path]
        claim.remove_stale()
        return claim.removed_message()


def checkpoint_problem(acc: FeatureAccumulator, next_index: int, n_truncated: int) -> str | None:
    """What makes a checkpoint's numbers impossible, or None. Every segment is one sample with at least one
    token, and sums of squared deviations cannot be negative."""
    if next_index < 1:
        return f"next segment {next_index} < 1"
    if acc.n_samples != next_index:
        return f"{acc.n_samples} samples summed for {next_index} segments"
    if not 0 <= n_truncated <= next_index:
        return f"{n_truncated} truncated of {next_index} segments"
    if acc.n_tokens < acc.n_samples:
        return f"{acc.n_tokens} tokens for {acc.n_samples} samples"
    if not (np.isfinite(acc.sum).all() and np.isfinite(acc.m2).all()):
        return "sums that are not finite"
    if (acc.m2 < -1e-9 * (1.0 + np.square(acc.sum) / acc.n_samples)).any():
        return "negative sums of squared deviations"
    return None
