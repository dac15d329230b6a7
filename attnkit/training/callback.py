"""A transformers `TrainerCallback` that tracks per-head statistics while `Trainer` trains (docs/training.md).

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[AttnkitCallback(every=50, path="heads.csv", qk_clip_tau=100.0)])

Only the forwards of the training steps count: the tracker is attached (`attached`) from `on_step_begin` to
`on_step_end`, so the evaluations that the Trainer runs between steps add nothing, and the forward that gradient
checkpointing re-runs inside the backward takes the path it took (the tracker counts it once). Every `every`
optimiser steps the means since the last log (the max logit: the maximum) go to the StatsLogger and to `history`.
With `qk_clip_tau`, QK-Clip runs after every optimiser step on the max logits of that step's forwards.

The Trainer calls no callback when `train()` raises, so the step guards itself: while it runs, the model's forward is
wrapped. An exception or KeyboardInterrupt raised inside a forward ends the step there (the tracker detached, the
forward put back, the forwards the interrupt left open exited, the logger's rows written). A step that an exception
elsewhere left (the backward, the optimiser, another callback) ends at the first forward of the model made outside
the code that began it (the Trainer's loop is no longer on the stack), or when `track` or the next `on_train_begin`
finds its tracker: it is replaced, not refused.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from types import FrameType

import torch
from transformers import TrainerCallback

from ..errors import AttnkitError, check_int
from ..models import runtime_of
from .checks import feature_list, positive_real
from .qk_clip import clip_plan, qk_clip
from .stats_log import StatsLogger
from .track import DEFAULT_FEATURES, MAX_LOGIT, attached, new_tracker

_HANDLER = "transformers.trainer_callback"  # the module whose CallbackHandler calls a callback's events


def _step_frame() -> FrameType | None:
    """The frame of the code that called the callback event under way (the Trainer's training loop): it runs until
    the step is over, and every forward of the step is made from inside it. That is the frame above transformers'
    callback handler (whatever subclasses of the callback run in between); called by hand, the first frame outside
    this module."""
    frame, outside = sys._getframe(1), None
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if name == _HANDLER:
            while frame is not None and frame.f_globals.get("__name__") == _HANDLER:
                frame = frame.f_back
            return frame
        if outside is None and name != __name__:
            outside = frame
        frame = frame.f_back
    return outside


def _runs_inside(frame: FrameType) -> bool:
    """Whether the calling code runs inside `frame` (it is on this thread's stack)."""
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


class _Step:
    """One training step under way: the tracker attached to the model and its forward wrapped, so that an exception
    inside a forward (KeyboardInterrupt too, after which the Trainer calls no callback) ends the step there, and a
    forward made outside `frame` (the step was left by an exception elsewhere) ends it before it runs. `end()`
    detaches the tracker and puts the forward back."""

    def __init__(self, callback: AttnkitCallback, model):
        self.model, self.frame = model, _step_frame()
        self.depth = runtime_of(model).open_forwards
        self._attachment = contextlib.ExitStack()
        self._attachment.enter_context(attached(model, callback.tracker))
        self.saved = vars(model).get("forward")  # an instance attribute (accelerate's, say), else the class's
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            if not self.live():
                callback.end_step(failed=True, unwind=False)  # this forward is open: it is not exited
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            except BaseException:  # noqa: B036 (KeyboardInterrupt too)
                callback.end_step(failed=True)
                raise

        model.forward = forward

    def live(self) -> bool:
        """Whether the code that began the step is still running around the caller."""
        return self.frame is not None and _runs_inside(self.frame)

    def end(self, unwind: bool = True) -> None:
        if self.saved is None:
            vars(self.model).pop("forward", None)
        else:
            self.model.forward = self.saved
        self._attachment.close()
        if unwind:
            runtime_of(self.model).exit_forwards(self.depth)
        self.frame = None


class AttnkitCallback(TrainerCallback):
    """Track `features` (a name, a sequence of names; None: DEFAULT_FEATURES) over the training steps' forwards;
    every `every` optimiser steps write them to `history` and, with `path` or `tensorboard`, to a StatsLogger; with
    `qk_clip_tau` (a real number > 0), QK-Clip after every optimiser step. Every argument is checked here, the model
    at `on_train_begin`, before the first step."""

    def __init__(self, features=DEFAULT_FEATURES, every: int = 50, path=None, tensorboard=None,
                 qk_clip_tau: float | None = None):
        features = feature_list(features, DEFAULT_FEATURES)
        self.every = check_int(every, "every")
        self.tau = None if qk_clip_tau is None else positive_real(qk_clip_tau, "qk_clip_tau")
        if self.tau is not None and MAX_LOGIT not in features:
            features += (MAX_LOGIT,)
        self.features = features
        self.logger = StatsLogger(path, tensorboard) if path is not None or tensorboard is not None else None
        self.history: list[tuple[int, dict[str, torch.Tensor]]] = []  # (step, statistics on the host)
        self.tracker = None
        self._step: _Step | None = None
        self._max = None

    def end_step(self, failed: bool = False, unwind: bool = True) -> None:
        """End the step under way, if any: the model's forward as it was, nothing of attnkit left on it (`unwind`:
        the forwards an interrupt left open exited too). `failed`: an exception ends the training, so the logger
        writes what it has (a later `log` opens it again)."""
        step, self._step = self._step, None
        if step is not None:
            step.end(unwind)
        if failed and self.logger is not None:
            self.logger.close()

    def _release_if_left(self) -> None:
        if self._step is not None and not self._step.live():  # its training raised outside a forward
            self.end_step(failed=True, unwind=False)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.end_step()  # a step that an exception left
        if getattr(args, "n_gpu", 1) > 1:  # Trainer wraps the model in nn.DataParallel, whose replicas run in threads
            raise AttnkitError("AttnkitCallback does not track a model that Trainer replicates over several GPUs in "
                               "one process (nn.DataParallel): launch one process per GPU (torchrun, accelerate "
                               "launch)")
        tracker = new_tracker(model, self.features, purpose="AttnkitCallback")
        tracker.release_if_left = self._release_if_left
        if self.tau is not None:
            clip_plan(model)  # a model QK-Clip cannot scale is refused now, not after the first optimiser step
        self.tracker, self._max = tracker, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.end_step()
        if self.tracker is None:
            raise AttnkitError("AttnkitCallback.on_step_begin before on_train_begin: the Trainer calls them in order")
        self._step = _Step(self, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.end_step()
        if self.tau is not None:  # the max logits of this step's forwards, then the clip (no host sync)
            m = self.tracker.read(MAX_LOGIT)[MAX_LOGIT]
            qk_clip(model, m, self.tau)
            self._max = m if self._max is None else torch.fmax(self._max, m)
        if state.global_step % self.every == 0:
            self._log(state.global_step)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.end_step()  # a step that a callback stopped before its optimiser step (the evaluation follows)

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
        self.end_step()
        if self.logger is not None:
            self.logger.close()
