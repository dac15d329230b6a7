"""head_means.npz: the mean output of every head over a corpus, finished or in progress (docs/files.md,
"head_means.npz"; computed by attnkit/jobs/head_means.py, used for mean ablation: docs/interventions.md).

One file serves as result and as checkpoint: the sums of every head's outputs over the valid tokens measured so
far, their number, how many segments of the plan are done, whether the corpus is finished, and the settings that
decide the numbers (a resume continues only under the same settings).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from .outputs import atomic_write
from .schemas import ArraySpec, load_npz

HEAD_MEANS_ARRAYS = {"sums": ArraySpec("float", 3, finite=True), "n_tokens": ArraySpec("int", 0),
                     "next_index": ArraySpec("int", 0), "complete": ArraySpec("int", 0),
                     "settings": ArraySpec("str", 0)}


class HeadMeans:
    """Sums of every head's per-token outputs (n_layers × n_heads × head size, float64) over `n_tokens` valid
    tokens; `mean` divides them. `next_index`: segments of the plan measured; `complete`: the corpus is done."""

    def __init__(self, sums: np.ndarray, n_tokens: int = 0, next_index: int = 0, complete: bool = False,
                 settings: dict | None = None):
        self.sums = np.asarray(sums, dtype=np.float64)
        if self.sums.ndim != 3:
            raise AttnkitError(f"head sums must be layers × heads × head size, got shape {self.sums.shape}")
        self.n_tokens, self.next_index, self.complete = int(n_tokens), int(next_index), bool(complete)
        self.settings = dict(settings or {})

    def __repr__(self) -> str:
        L, H, D = self.sums.shape
        state = "complete" if self.complete else f"in progress, {self.next_index} segments measured"
        return f"HeadMeans({L} layers × {H} heads × {D} dims, mean over {self.n_tokens:,} tokens, {state})"

    @property
    def mean(self) -> np.ndarray:
        """n_layers × n_heads × head size: each head's mean output over every valid token."""
        if self.n_tokens == 0:
            raise AttnkitError("no tokens measured yet: the head means are undefined")
        return self.sums / self.n_tokens

    def add(self, sums: np.ndarray, n_tokens: int, next_index: int) -> None:
        self.sums += sums
        self.n_tokens += int(n_tokens)
        self.next_index = int(next_index)

    def save(self, path) -> Path:
        path = Path(path)
        atomic_write(path, lambda f: np.savez(
            f, sums=self.sums, n_tokens=np.int64(self.n_tokens), next_index=np.int64(self.next_index),
            complete=np.int64(self.complete), settings=np.array(json.dumps(self.settings, sort_keys=True))))
        return path

    @classmethod
    def load(cls, path) -> HeadMeans:
        arrays = load_npz(path, HEAD_MEANS_ARRAYS, what="head means")
        try:
            settings = json.loads(str(arrays["settings"]))
        except ValueError:
            raise AttnkitError(f"{path}: array 'settings' is not JSON") from None
        n = int(arrays["n_tokens"])
        if n < 0 or int(arrays["next_index"]) < 0:
            raise AttnkitError(f"{path}: negative counts")
        return cls(arrays["sums"], n, int(arrays["next_index"]), bool(arrays["complete"]), settings)


__all__ = ["HEAD_MEANS_ARRAYS", "HeadMeans"]
