"""Tracking (attnkit.track): every forward's per-head statistics handed to an attnkit.training.Tracker
(`record(layer, feats, max_logit, kept)`), from the same call of the op that computes the output. In training with
attention dropout on, from a call without gradients on the weights before dropout (docs/training.md). A generation
step is no training forward, and a layer whose heads were all pruned has nothing to track."""
from __future__ import annotations

from ..call import AttentionCall
from .base import BaseConsumer, Result, Wants


class Tracking(BaseConsumer):
    role = "tracker"
    in_training = True

    def __init__(self, tracker):
        self.tracker = tracker

    def wants(self, call: AttentionCall) -> Wants | None:
        if call.decode or call.H == 0:
            return None
        return Wants(features=True, max_logit=self.tracker.want_max)

    def after(self, call: AttentionCall, result: Result) -> None:
        self.tracker.record(call.layer, result.feats, result.max_logit, call.kept)
