"""A transformers `TrainerCallback` that tracks per-head statistics while `Trainer` trains (docs/training.md).

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[AttnkitCallback(every=50, path="heads.csv", qk_clip_tau=100.0)])

From the start of training to its end the model is under `attnkit.track`. Every `every` optimiser steps the means
since the last log (the max logit: the maximum) go to the StatsLogger and to `history`. With `qk_clip_tau`, QK-Clip
runs after every optimiser step on the max logits of that step's forwards.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import TrainerCallback

from ..errors import AttnkitError
from .qk_clip import qk_clip
from .stats_log import StatsLogger
from .track import DEFAULT_FEATURES, MAX_LOGIT, track


class AttnkitCallback(TrainerCallback):
    def __init__(self, features=DEFAULT_FEATURES, every: int = 50, path=None, tensorboard=None,
                 qk_clip_tau: float | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise AttnkitError(f"every must be an integer >= 1, got {every!r}")
        features = tuple(features)
        if qk_clip_tau is not None and MAX_LOGIT not in features:
            features += (MAX_LOGIT,)
        self.features, self.every, self.tau = features, every, qk_clip_tau
        self.logger = StatsLogger(path, tensorboard) if path is not None or tensorboard is not None else None
        self.history: list[tuple[int, dict[str, torch.Tensor]]] = []  # (step, statistics on the host)
        self._stack: contextlib.ExitStack | None = None
        self.tracker = None
        self._max = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._stack = contextlib.ExitStack()
        self.tracker = self._stack.enter_context(track(model, self.features))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.tau is not None:  # the max logits of this step's forwards, then the clip (no host sync)
            m = self.tracker.read(MAX_LOGIT)[MAX_LOGIT]
            qk_clip(model, m, self.tau)
            self._max = m if self._max is None else torch.fmax(self._max, m)
        if state.global_step % self.every == 0:
            self._log(state.global_step)

    def _log(self, step: int) -> None:
        means = [f for f in self.features if f != MAX_LOGIT]
        stats = self.tracker.read(means) if means else {}
        if MAX_LOGIT in self.features:
            stats[MAX_LOGIT] = self._max if self.tau is not None else self.tracker.read(MAX_LOGIT)[MAX_LOGIT]
            self._max = None
        stats = {f: stats[f] for f in self.features if stats.get(f) is not None}
        self.history.append((step, {k: v.detach().cpu() for k, v in stats.items()}))
        if self.logger is not None:
            self.logger.log(step, stats)

    def on_train_end(self, args, state, control, **kwargs):
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        if self.logger is not None:
            self.logger.close()
