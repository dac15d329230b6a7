"""The maps of one call (`maps`), when the forward asks for them (`model(..., output_attentions=True)`): each layer's
B×H×L×Lk weights, equal to eager attention's, and under an intervention the weights the layer really used (after
mode, region and renormalisation: `attnkit.reference.attention_weights`; gates scale the head's output, not its
weights), in the batch's own positions. A step of delivery (attnkit/attention/deliver.py), computed only then: a
forward without `output_attentions` materialises no map. A pruned layer's maps cover the unpruned heads, a removed
head's map all zeros (as its features)."""
from __future__ import annotations

import torch

from ..arch.pruning import to_unpruned
from ..reference import attention_weights
from .call import AttentionCall
from .plan import Plan
from .runtime import LayerPart


def maps(call: AttentionCall, plan: Plan) -> torch.Tensor:
    """The weights this call used, interventions included, in the batch's own positions (module docstring)."""
    if call.H == 0:
        weights = call.query.new_zeros(call.B, 0, call.L, call.Lk, dtype=torch.float32)
    else:
        weights = torch.cat([part_weights(call, plan, p) for p in plan.parts])
    weights = call.own_frame(weights, (2, 3), 2)
    if call.kept is not None:
        weights = to_unpruned(weights, call.kept)
    return weights.to(call.query.dtype)


def part_weights(call: AttentionCall, plan: Plan, p: LayerPart) -> torch.Tensor:
    """The weights of samples `p.start` … `p.stop` − 1 under part `p`, in the op's frame."""
    rows = slice(p.start, p.stop)
    q, k, L = call.query, call.key, call.L
    if not call.grouped_by_length:
        return attention_weights(q[rows], k[rows], call.lengths[rows], call.scale,
                                 None if plan.sentence_id is None else plan.sentence_id[rows], p.mode, p.region,
                                 p.renormalize, **call.dec, **call.sample_args(rows))
    w = q.new_zeros(q[rows].shape[0], call.H, L, call.Lk, dtype=torch.float32)
    for where, idx, n, r in call.length_groups(rows):  # as attnkit.attention.run.run_part computes them
        w[where, :, L - r:, :n] = attention_weights(q[idx, :, L - r:], k[idx, :, :n], call.lengths[idx], call.scale,
                                                    None, p.mode, p.region, p.renormalize, **call.dec)
    return w
