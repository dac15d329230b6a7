"""The one protocol of a consumer: what is done with the results of one call of the op.

A consumer says per call what it wants of the op (`wants`: features, the max logit per head, the output projection
that norm weighting scales the features by; None: it takes no part in this call), may look at q and k before the
op (`before`), and gets the results after it (`after`: the layer's output, its features, its max logits). It is
attached to a model's Runtime for a block (`Runtime.attach` / `detach`, or `Runtime.attached`), so adding one adds
no field to the Runtime and no branch to the attention path (attnkit/hf_attention.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..call import AttentionCall


@dataclass(frozen=True)
class Wants:
    """What a consumer wants of one call of the op."""

    features: bool = False
    max_logit: bool = False
    # norm weighting (docs/features.md): the layer's output projection, by whose columns the features are weighted
    out_proj: object | None = None


@dataclass(frozen=True)
class Result:
    """The results of one call of the op, in the batch's own positions: `out` B×L×H×D after the intervention's
    replaced head outputs (None in training, where only the statistics are computed); `feats` B×H×F (clamped at
    0 outside training) when a consumer wanted them; `max_logit` B×H when one wanted it. These cover the heads the
    layer has (a pruned layer's kept heads: `AttentionCall.kept`). `maps` B×H×L×Lk when the forward asked for
    them (`AttentionCall.want_maps`; outside training), over the unpruned heads (attnkit/attention/maps.py)."""

    out: torch.Tensor | None
    feats: torch.Tensor | None
    max_logit: torch.Tensor | None
    maps: torch.Tensor | None = None


class Consumer(Protocol):
    role: str  # what it is, for the Runtime's views (`Runtime.observers`, `tracker`, `features`)
    in_training: bool  # it takes forwards with attention dropout on (only the statistics; no output is changed)

    def wants(self, call: AttentionCall) -> Wants | None: ...

    def before(self, call: AttentionCall) -> None: ...

    def after(self, call: AttentionCall, result: Result) -> None: ...


class BaseConsumer:
    """Defaults of the protocol: takes part in every call, wants nothing of the op, does nothing before it."""

    role = ""
    in_training = False

    def wants(self, call: AttentionCall) -> Wants | None:
        return Wants()

    def before(self, call: AttentionCall) -> None:
        return None

    def after(self, call: AttentionCall, result: Result) -> None:
        return None
