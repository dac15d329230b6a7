"""Running the op for one planned call (`run_op`): one call of attnkit.ops.attention for the whole batch, or one
per block of samples for stacked interventions; a left-padded KV-cache step one per group of samples of one length.
Its results stay in the op's frame (a left-padded batch's tokens at the front) until `deliver`.

A forward in training with attention dropout on is not planned: `run_training` computes it as eager attention
does, and gives the consumers that take training forwards (the tracker) the statistics before dropout."""
from __future__ import annotations

import torch

from ..arch.pruning import to_unpruned
from ..errors import AttnkitError
from ..features import num_features
from ..ops import attention
from ..reference import attention_weights
from .call import AttentionCall, kv_index, per_query_head
from .consumers.base import Result
from .plan import Plan
from .runtime import LayerPart


def run_op(call: AttentionCall, plan: Plan) -> tuple:
    """(out, feats, max logit) of the op over the batch, in the op's frame: one call for the whole batch, or one per
    block of samples for stacked interventions. With `want_max_logit`, each head's max logit per sample (B×H) from
    the same call (attnkit.ops.attention)."""
    if len(plan.parts) == 1:
        out, feats, *ml = run_part(call, plan, plan.parts[0], slice(None))
        return out, feats, ml[0] if plan.want_max_logit else None
    results = [run_part(call, plan, p, slice(p.start, p.stop)) for p in plan.parts]
    out, feats = torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])
    return out, feats, torch.cat([r[2] for r in results]) if plan.want_max_logit else None


def run_part(call: AttentionCall, plan: Plan, p: LayerPart, rows: slice) -> tuple:
    """The op on samples `rows` with part `p`."""
    q, k, v, L, H = call.query, call.key, call.value, call.L, call.H
    if H == 0:  # a layer whose heads were all pruned: nothing to attend with (no max logit is wanted)
        n = q[rows].shape[0]
        width = num_features(plan.num_windows, "sink" in call.dec, grid=plan.grid is not None,
                             alignment=plan.alignment)
        return q.new_zeros(n, L, 0, call.D), q.new_zeros((n, 0, width), dtype=torch.float32)
    if call.grouped_by_length:  # no features (attnkit's own batches are refused by the reader)
        out = q.new_zeros(q[rows].shape[0], L, H, call.D)
        for where, idx, n, r in call.length_groups(rows):  # (no bias: refused by the reader)
            out[where, L - r:] = attention(
                q[idx, :, L - r:], k[idx, :, :n], v[idx, :, :n], call.lengths[idx], scaling=call.scaling,
                num_windows=plan.num_windows, mode=p.mode, region=p.region, renormalize=p.renormalize, gates=p.gates,
                backend=plan.backend, **call.dec)[0]
        return out, q.new_zeros((out.shape[0], H, 0), dtype=torch.float32)
    return attention(
        q[rows], k[rows], v[rows], call.lengths[rows],
        None if plan.token_class is None else plan.token_class[rows],
        None if plan.sentence_id is None else plan.sentence_id[rows],
        scaling=call.scaling, num_windows=plan.num_windows, mode=p.mode, region=p.region,
        renormalize=p.renormalize, gates=p.gates, want_features=plan.want_features,
        key_scale=None if plan.key_scale is None else plan.key_scale[rows], backend=plan.backend,
        want_max_logit=plan.want_max_logit, grid=None if plan.grid is None else plan.grid[rows],
        alignment=plan.alignment, **call.dec,
        **call.sample_args(rows, plan.key_class),
    )


def measures_or_changes(call: AttentionCall) -> bool:
    """Whether something measures or changes this call's attention (refused while attention dropout is on): the
    forward's intervention, or a consumer attached that does not take training forwards (as the tracker does)."""
    rt = call.rt
    return rt is not None and (call.forward.intervention is not None
                               or any(not getattr(c, "in_training", False) for c in rt.consumers))


def run_training(call: AttentionCall) -> tuple:
    """A forward in training with attention dropout on. Consumers that take training forwards (the tracker) get the
    statistics of the weights before dropout (docs/training.md), from a call without gradients; anything else that
    measures or changes attention is refused. The output: as eager attention computes it (the maps after dropout,
    and the output from them) where attnkit's own handling is needed, else plain attention with dropout, exactly
    what sdpa computes."""
    if call.decode:
        raise AttnkitError("attnkit does not run a KV-cache step with attention dropout on: call model.eval()")
    rt = call.rt
    taking = [(c, w) for c in rt.consumers if c.in_training and (w := c.wants(call)) is not None] if rt else []
    if taking:
        B, L = call.B, call.L
        classes = call.tokens.token_class(B, L, call.device) if call.info is None else call.info.token_class
        with torch.no_grad():
            _, feats, *ml = attention(call.query, call.key, call.value, call.lengths, classes, None,
                                      scaling=call.scaling, num_windows=rt.num_windows, want_features=True,
                                      grid=call.tokens.grid(B, L, call.device), alignment=rt.alignment,
                                      backend=rt.backend,
                                      want_max_logit=any(w.max_logit for _, w in taking),
                                      **call.dec, **call.sample_args(slice(None), call.key_classes(True)))
        for c, _ in taking:
            c.after(call, Result(None, feats, ml[0] if ml else None))
    if measures_or_changes(call):
        raise AttnkitError("attnkit cannot measure or intervene while attention dropout is on: call model.eval()")
    per_sample = call.sample_args(slice(None))  # a bias, cross-attention's key lengths
    if call.want_maps or call.dec or call.offsets is not None or per_sample:
        q = call.query
        weights = torch.nn.functional.dropout(
            attention_weights(q, call.key, call.lengths, call.scale, **call.dec, **per_sample).to(q.dtype),
            p=call.dropout, training=True)
        out = torch.matmul(weights, per_query_head(call.value, kv_index(call.H, call.Hkv, call.dec, call.device)))
        out = call.own_frame(out.transpose(1, 2).contiguous(), (1,), 1)
        if not call.want_maps:
            return out, None
        weights = call.own_frame(weights, (2, 3), 2)
        return out, weights if call.kept is None else to_unpruned(weights, call.kept)  # over the unpruned heads
    mask = call.attention_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        call.query, call.key, call.value, attn_mask=None if mask is None else mask[:, None, None, :].bool(),
        dropout_p=call.dropout, scale=call.scaling)
    return out.transpose(1, 2).contiguous(), None
