"""The run directory of an extraction, and its checkpoints.

A finished run holds features.npz and meta.json. While a run is under way, only checkpoint.npz is
written (atomically, every few batches and on interruption): it holds the feature sums, the index of
the next segment and the settings. A failed or interrupted run therefore never damages a finished run
in the same directory, and `--resume` continues from the checkpoint to the same numbers an
uninterrupted run gives (the same batches, in the same order, summed in float64).
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from ..errors import AttnkitError, arg
from .files import (
    CHECKPOINT_FILE,
    DERIVED_OUTPUTS,
    DISTANCE_SHARDS_DIR,
    FEATURE_SHARDS_DIR,
    FEATURES_FILE,
    META_FILE,
    PER_SAMPLE_FILE,
)
from .head_features import FeatureAccumulator, HeadFeatures
from .outputs import atomic_write
from .overwrite import Claim, claim_outputs
from .schemas import META_SCHEMA, load_npz, validate
from .settings import changed_inputs, setting_differences

RUN_COUNTS = ("n_samples", "n_tokens", "n_layers", "n_heads")  # what every meta.json of a run records
CHECKPOINT_ARRAYS = ("next_index", "settings", "sum")  # what every extraction checkpoint holds
SHARD_ARRAYS = ("fingerprint", "settings", "n_segments")  # what every shard file of the Ray engine holds


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

    def check_resumable(self, finished: bool = True) -> None:
        """Refuse a resume where there is no checkpoint (nor, with `finished`, a finished run, which a resume
        leaves as it is)."""
        if not self.has_checkpoint() and not (finished and self.is_finished()):
            raise AttnkitError(f"nothing to resume in {self.path}: no {CHECKPOINT_FILE}")

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

    def claim(self, overwrite: bool, what: str | None = None, *, checkpoint: bool = True) -> Claim:
        """The overwrite check of a fresh run here: features.npz and meta.json are replaced, the checkpoint (unless
        `checkpoint` is false: the run's own) and what later steps derived from the old features
        (DERIVED_OUTPUTS) go with them."""
        stale = ([self.checkpoint_path] if checkpoint else []) + [self.path / n for n in DERIVED_OUTPUTS]
        return claim_outputs([self.path / FEATURES_FILE, self.path / META_FILE], overwrite, stale=stale, what=what)

    def load_checkpoint(self, settings: dict, shape: tuple[int, int, int] | None = None,
                        inputs: list | None = None, removed: list | None = None,
                        ) -> tuple[FeatureAccumulator, int, int, np.ndarray | None]:
        """(accumulator, next segment index, truncated so far, histogram of full token lengths) after checking
        that the settings match, that its arrays have `shape` (the model's layers × heads × features, when
        given) and that the checkpoint's numbers are possible (`checkpoint_problem`; `removed`: the [layer, head]
        pairs the model lost to pruning, the only heads whose sums may be NaN). `inputs` (Corpus.describe()) name
        the input that changed when the corpus differs."""
        self.check_resumable(finished=False)
        state, saved = self._checkpoint()
        try:
            saved_inputs = json.loads(str(state["inputs"])) if "inputs" in state else None
            acc = FeatureAccumulator.from_state(state)
            next_index, n_truncated = int(state["next_index"]), int(state["n_truncated"])
            lengths = np.asarray(state["lengths"], dtype=np.int64) if "lengths" in state else None
        except Exception as exc:
            raise AttnkitError(f"checkpoint {self.checkpoint_path} is corrupt: {type(exc).__name__}: {exc}") from None
        self.check_settings(saved, settings, saved_inputs, inputs)
        arrays = {"sum": acc.sum.shape, "m2": acc.m2.shape}
        wrong = {k: v for k, v in arrays.items() if shape is not None and tuple(v) != tuple(shape)}
        if wrong:
            name, got = next(iter(wrong.items()))
            raise AttnkitError(f"checkpoint {self.checkpoint_path} holds sums of shape {tuple(got)} ({name}), but "
                               f"the model measures {shape[0]} layers × {shape[1]} heads × {shape[2]} features: it "
                               f"belongs to another model or feature set; start over with {arg('overwrite', True)}")
        problem = checkpoint_problem(acc, next_index, n_truncated, removed)
        if problem:
            raise AttnkitError(f"checkpoint {self.checkpoint_path} is impossible ({problem}); start over with "
                               f"{arg('overwrite', True)}")
        return acc, next_index, n_truncated, lengths

    def checkpoint_max_logit(self, shape: tuple[int, int]) -> np.ndarray:
        """The checkpoint's max logits so far (layers × heads, NaN where none was seen) of a --max-logit run (whose
        settings `load_checkpoint` has matched); AttnkitError naming the checkpoint when it lacks them or they do
        not have `shape`."""
        state, _ = self._checkpoint()
        m = state.get("max_logit")
        if m is None or m.dtype.kind != "f" or m.shape != tuple(shape):
            got = "no max_logit" if m is None else f"max_logit of shape {m.shape}"
            raise AttnkitError(f"checkpoint {self.checkpoint_path} holds {got}, but the run measures max logits of "
                               f"{shape[0]} layers × {shape[1]} heads; start over with {arg('overwrite', True)}")
        return m.astype(np.float64)

    def _checkpoint(self) -> tuple[dict, dict]:
        """The checkpoint's arrays and its settings (a mapping), or AttnkitError naming it corrupt."""
        state = load_npz(self.checkpoint_path, what="checkpoint",
                         corrupt=f"start over with {arg('overwrite', True)}")
        try:
            saved = json.loads(str(state["settings"]))
        except Exception as exc:
            raise AttnkitError(f"checkpoint {self.checkpoint_path} is corrupt: {type(exc).__name__}: {exc}") from None
        if not isinstance(saved, dict):
            raise AttnkitError(f"checkpoint {self.checkpoint_path} is corrupt: its settings are not a mapping")
        return state, saved

    def check_resume_settings(self, settings: dict) -> None:
        """Refuse a resume whose `settings` (some of a run's settings: those known before a model loads) differ
        from the run's, its checkpoint's or else its finished meta.json's, naming each that differs; the settings
        that `settings` leaves out are the job's to check."""
        saved = self._checkpoint()[1] if self.has_checkpoint() else self.finished_meta().get("settings", {})
        self.check_settings({k: saved[k] for k in settings if k in saved}, settings)

    @staticmethod
    def check_settings(saved: dict, settings: dict, saved_inputs: list | None = None,
                       inputs: list | None = None) -> None:
        """Refuse to add to a run made with other settings, naming each that differs; a changed corpus is
        named by its input (path, and size or modification time) when both input lists are given."""
        diffs = setting_differences(saved, settings)
        if any(d.startswith("corpus_sha256:") for d in diffs):
            changed = changed_inputs(saved_inputs, inputs)
            if changed:
                diffs = [d for d in diffs if not d.startswith("corpus_sha256:")] + changed
        if diffs:
            raise AttnkitError("cannot resume: the run directory was made with other settings ("
                               + "; ".join(diffs) + ")")

    def finished_meta(self) -> dict:
        return HeadFeatures.load(self.path).meta

    def save_checkpoint(self, acc: FeatureAccumulator, next_index: int, n_truncated: int, settings: dict,
                        lengths: np.ndarray | None = None, inputs: list | None = None,
                        max_logit: np.ndarray | None = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        state = acc.state()
        state.update(next_index=np.int64(next_index), n_truncated=np.int64(n_truncated),
                     settings=np.array(json.dumps(settings, sort_keys=True)))
        if inputs is not None:  # each input's path, sha256, size and mtime (named when a resume finds it changed)
            state["inputs"] = np.array(json.dumps(inputs, sort_keys=True, default=str))
        if lengths is not None:
            state["lengths"] = np.asarray(lengths, dtype=np.int64)
        if max_logit is not None:  # --max-logit: each head's maximum so far (NaN: not seen yet)
            state["max_logit"] = np.asarray(max_logit, dtype=np.float64)
        atomic_write(self.checkpoint_path, lambda f: np.savez(f, **state))

    def finish(self, features: HeadFeatures, fresh: bool = True) -> str | None:
        """Write the finished run; a `fresh` run (not a resumed one) also removes what later steps derived
        from the features it replaces. Returns the message naming what a replaced run lost (None: nothing)."""
        claim = self.claim(True, checkpoint=False) if fresh else None  # the checkpoint now is this run's own
        features.save(self.path)
        self.checkpoint_path.unlink(missing_ok=True)
        if claim is None:
            return None
        claim.remove_stale()
        return claim.removed_message()


def _npz_holds(path: Path, names: tuple[str, ...]) -> bool:
    """Whether `path` is a .npz archive holding arrays `names` (read from its zip directory, not loaded)."""
    try:
        with zipfile.ZipFile(path) as z:
            held = {n[:-4] for n in z.namelist() if n.endswith(".npy")}
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return set(names) <= held


def is_run_dir(path) -> bool:
    """Whether `path` is a directory attnkit wrote as a run, told by its own files rather than by a name (a
    corpus folder may hold a file or folder called `shards` or `features.npz`): a meta.json that follows
    attnkit's schema with the counts every run records, an extraction checkpoint, or a shard file of the Ray
    engine, each holding what attnkit writes into it."""
    p = Path(path)
    meta = p / META_FILE
    if meta.is_file():
        try:
            data = json.loads(meta.read_text(encoding="utf-8"))
            validate(data, META_SCHEMA, str(meta))
        except (OSError, ValueError, AttnkitError):
            data = None
        if isinstance(data, dict) and all(isinstance(data.get(k), int) for k in RUN_COUNTS):
            return True
    if _npz_holds(p / CHECKPOINT_FILE, CHECKPOINT_ARRAYS):
        return True
    for folder in (p / FEATURE_SHARDS_DIR, p / DISTANCE_SHARDS_DIR):
        if folder.is_dir() and any(_npz_holds(f, SHARD_ARRAYS) for f in sorted(folder.glob("shard-*.npz"))[:1]):
            return True
    return False


def checkpoint_problem(acc: FeatureAccumulator, next_index: int, n_truncated: int,
                       removed: list | None = None) -> str | None:
    """What makes a checkpoint's numbers impossible, or None. Every segment is one sample with at least one
    token, sums of squared deviations cannot be negative, and the sums of every head the model has are finite:
    only a head removed by pruning has NaN features, so NaN sums. `removed`: those heads ([layer, head] pairs);
    None: every head whose sums are all NaN is taken for one (a caller that does not know the model). A NaN
    feature of a measured head (a non-finite attention score: docs/features.md) would make the run's means
    NaN: refused by array and heads rather than resumed into NaN features."""
    if next_index < 1:
        return f"next segment {next_index} < 1"
    if acc.n_samples != next_index:
        return f"{acc.n_samples} samples summed for {next_index} segments"
    if not 0 <= n_truncated <= next_index:
        return f"{n_truncated} truncated of {next_index} segments"
    if acc.n_tokens < acc.n_samples:
        return f"{acc.n_tokens} tokens for {acc.n_samples} samples"
    if removed is None:
        measured = ~np.isnan(acc.sum).all(axis=-1)
    else:
        measured = np.ones(acc.sum.shape[:2], dtype=bool)
        for layer, head in removed:
            if 0 <= layer < measured.shape[0] and 0 <= head < measured.shape[1]:
                measured[layer, head] = False
    for name, array in (("sum", acc.sum), ("m2", acc.m2)):
        bad = measured & ~np.isfinite(array).all(axis=-1)
        if bad.any():
            heads = [f"L{l}H{h}" for l, h in np.argwhere(bad)]
            return (f"array {name!r} holds NaN or infinite values for {len(heads)} of the model's "
                    f"{int(measured.sum())} heads ({', '.join(heads[:5])}{' ...' if len(heads) > 5 else ''})")
    if (acc.m2 < -1e-9 * (1.0 + np.square(acc.sum) / acc.n_samples)).any():
        return "negative sums of squared deviations"
    return None
