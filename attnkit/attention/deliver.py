"""Delivering the results of one call of the op: back in the batch's own positions (rows of left padding 0), the
intervention's replaced head outputs (patch, mean: attnkit.reference.replace_head_outputs), the features clamped at
0, the maps when the forward asked for them (attnkit/attention/maps.py), then each consumer of the plan, in the
order attached (`after`)."""
from __future__ import annotations

from ..reference import replace_head_outputs
from .call import AttentionCall
from .consumers.base import Result
from .maps import maps
from .plan import Plan


def deliver(call: AttentionCall, plan: Plan, out, feats, max_logit) -> Result:
    out = call.own_frame(out, (1,), 1)
    for p in plan.parts:
        out = replace_head_outputs(out, p.outputs, slice(p.start, p.stop))
    if plan.want_features:
        # every feature is a mass or an entropy, never negative: a backend's rounding (win_15 = -1.96e-11) is
        # clamped here, where the features of every backend and engine reach the consumers (docs/features.md §3)
        feats = feats.clamp(min=0.0)
    result = Result(out, feats, max_logit, maps(call, plan) if call.want_maps else None)
    for consumer in plan.consumers:
        consumer.after(call, result)
    return result
