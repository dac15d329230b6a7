"""The backward of attnkit's attention without an L×L map (docs/training.md, "The backward").

`attention_backward` gives the gradients of the op's output with respect to q, k, v, the gates and the sink logits
when no intervention is active (no mode, region or renormalisation: those keep the reference's backward,
attnkit/ops.py). Two ways, chosen by what a call uses:

* ATen's CPU flash-attention backward (`_scaled_dot_product_flash_attention_for_cpu_backward`) for CPU tensors
  without a sliding window, soft-cap or sink. It needs the output and the per-row log-sum-exp of the scaled scores
  (natural log, fp32, B×H×L: the convention of ATen's forward): the forward's own, saved by
  attnkit::fused_attention_lse (`saved`, attnkit/ops.py `saves_lse`; gated calls run it ungated), or else — old
  builds, the reference — recomputed by `stats` with ATen's own CPU flash forward (O(L) memory). Padding goes in as
  an additive B×1×1×L key mask (none when no sample is padded: `unpadded`), causal rows as `is_causal`; grouped
  K/V are repeated per query head (B×H×L×D, never L×L) and their gradients summed over each KV head's query heads.
* `tiled_backward` everywhere else (sliding windows, soft-capping, sinks, CUDA): the flash derivation in PyTorch,
  one block of query rows at a time. A tile holds its rows' full scores (block × L), so its softmax needs no saved
  log-sum-exp: P = softmax(S), O = P V, D = rowsum(dO ∘ O), dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D), through the
  soft-cap's chain rule (dS ∘ (1 − tanh²)), dQ = dS K·scaling, dK += dSᵀ Q·scaling; a sink logit gets
  Σ −p_sink·D over its head's rows. Memory O(block · L) per tile, the block chosen so a tile holds at most
  TILE_ELEMENTS scores.

Gates (head importance, Michel et al.): out = gate_h · O_h, so the gate's gradient is Σ dO_h ∘ O_h (the ungated
output, which both ways have at hand) and the rest sees dO · gate. Keys past a sample's length are zeroed in k and
v first (the reference drops them: NaN there never reaches a valid row), so they get zero gradients.
"""
from __future__ import annotations

import torch

TILE_ELEMENTS = 1 << 20  # scores per tile of the tiled backward (4 MB in fp32; about eight such tensors live at once)
_ATEN_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def uses_aten(q: torch.Tensor, sliding_window, softcap, sink) -> bool:
    """True when ATen's CPU flash backward computes this call's gradients (docs/training.md)."""
    return q.device.type == "cpu" and q.dtype in _ATEN_DTYPES and sliding_window is None and softcap is None \
        and sink is None


def _kv_index(H: int, Hkv: int, kv_head, device) -> torch.Tensor | None:
    if kv_head is None and Hkv == H:
        return None
    if kv_head is not None:
        return kv_head.to(device=device, dtype=torch.long)
    return torch.arange(H, device=device) // (H // Hkv)


def _per_query_head(t: torch.Tensor, index) -> torch.Tensor:
    return t if index is None else t.index_select(1, index)


def _sum_per_kv_head(g: torch.Tensor, index, Hkv: int) -> torch.Tensor:
    """B×H×L×D gradients of repeated K/V summed into their B×Hkv×L×D KV heads."""
    if index is None:
        return g
    return g.new_zeros(g.shape[0], Hkv, *g.shape[2:]).index_add_(1, index, g)


def _valid_keys(lengths: torch.Tensor, L: int) -> torch.Tensor:
    return torch.arange(L, device=lengths.device)[None, :] < lengths[:, None]  # B×L


def unpadded(lengths: torch.Tensor, L: int) -> bool:
    """Every sample is L long: no key is padding, so the backward needs no key mask (ATen's kernels then take their
    mask-free path, as sdpa's do) and zeroes nothing. Read on the host, only for real lengths on the CPU (no device
    sync), never while compiling or tracing (fake or functional tensors: the general path traces)."""
    return (type(lengths) is torch.Tensor and lengths.device.type == "cpu" and not torch.compiler.is_compiling()
            and bool((lengths == L).all()))


def stats(q, k, v, mask, causal: bool, scaling: float):
    """(O B×H×L×D in q's dtype, lse B×H×L fp32) recomputed by ATen's CPU flash forward: the backward's way to them
    when the forward did not save them (`saved` of `attention_backward`: old builds, a gated output)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scaling)


def _aten_backward(grad_out, q, k, v, lengths, scaling, gates, index, causal, saved=None, full=False):
    B, H, L, D = q.shape
    mask = None  # full: no padded key
    if not full:
        valid = _valid_keys(lengths, L)
        mask = torch.zeros(B, 1, 1, L, dtype=q.dtype, device=q.device).masked_fill(~valid[:, None, None, :],
                                                                                    float("-inf"))
    ke = _per_query_head(k, index).contiguous()
    ve = _per_query_head(v, index).contiguous()
    if saved is not None:  # the forward's own output (B×L×H×D, ungated) and log-sum-exp (attnkit/ops.py)
        o, lse = saved[0].transpose(1, 2), saved[1]
    else:
        o, lse = stats(q.contiguous(), ke, ve, mask, causal, scaling)
    go = grad_out.transpose(1, 2)  # B×H×L×D
    grad_gates = None
    if gates is not None:
        grad_gates = (go.float() * o.float()).sum((0, 2, 3))
        go = go * gates.to(go.dtype).view(1, H, 1, 1)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        go.contiguous(), q.contiguous(), ke, ve, o, lse, 0.0, causal, attn_mask=mask, scale=scaling)
    return dq, dk, dv, grad_gates, None


def _block_rows(B: int, H: int, L: int) -> int:
    return max(1, min(L, TILE_ELEMENTS // max(1, B * H * L)))


def tiled_backward(grad_out, q, k, v, lengths, scaling, gates, index, causal, sliding_window, softcap, sink, *,
                   symmetric_window=False):
    """Gradients (fp32) by query-row tiles of full rows (module docstring); any device."""
    B, H, L, D = q.shape
    dev = q.device
    ke = _per_query_head(k, index).float()
    ve = _per_query_head(v, index).float()
    qf = q.float()
    go_all = grad_out.transpose(1, 2).float()  # B×H×L×D
    gate = None if gates is None else gates.float().view(1, H, 1, 1)
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(ke)
    dv = torch.zeros_like(ve)
    grad_gates = None if gates is None else torch.zeros(H, dtype=torch.float32, device=dev)
    grad_sink = None if sink is None else torch.zeros(H, dtype=torch.float32, device=dev)
    sink_logit = None if sink is None else sink.float().view(1, H, 1)
    pos = torch.arange(L, device=dev)
    key_ok = _valid_keys(lengths, L)[:, None, None, :]  # B×1×1×L
    blk = _block_rows(B, H, L)
    for i0 in range(0, L, blk):
        i1 = min(L, i0 + blk)
        qb = qf[:, :, i0:i1]
        s = torch.matmul(qb, ke.transpose(-1, -2)) * scaling  # B×H×b×L
        t = None
        if softcap is not None:
            t = torch.tanh(s / softcap)
            s = softcap * t
        offset = pos[i0:i1, None] - pos[None, :]  # b×L: s − t
        vis = key_ok
        if causal:
            vis = vis & (offset >= 0)
        if sliding_window is not None:
            vis = vis & (offset < sliding_window)
            if symmetric_window:
                vis = vis & (offset > -sliding_window)
        s = s.masked_fill(~vis, float("-inf"))
        lse = torch.logsumexp(s, -1)  # B×H×b
        if sink_logit is not None:
            lse = torch.logaddexp(lse, sink_logit.expand_as(lse))
        p = torch.where(vis, torch.exp(s - lse[..., None]), 0.0)  # a row that sees nothing: 0, not NaN
        del s
        o = torch.matmul(p, ve)
        go = go_all[:, :, i0:i1]
        if gate is not None:
            grad_gates += (go * o).sum((0, 2, 3))
            go = go * gate
        d = (go * o).sum(-1)  # B×H×b: rowsum(dO ∘ O)
        dv += torch.matmul(p.transpose(-1, -2), go)
        ds = p * (torch.matmul(go, ve.transpose(-1, -2)) - d[..., None])
        del p
        if grad_sink is not None:
            p_sink = torch.exp(sink_logit - lse)  # B×H×b (0 where lse is +inf-free and the row sees keys only)
            grad_sink -= (p_sink * d).sum((0, 2))
        if t is not None:
            ds = ds * (1 - t * t)
        dq[:, :, i0:i1] = torch.matmul(ds, ke) * scaling
        dk += torch.matmul(ds.transpose(-1, -2), qb) * scaling
    return dq, dk, dv, grad_gates, grad_sink


def attention_backward(grad_out, q, k, v, lengths, *, scaling: float, gates=None, kv_head=None, causal=False,
                       sliding_window=None, softcap=None, sink=None, symmetric_window=False, saved=None):
    """(dq, dk, dv, d gates or None, d sink or None) of the op's output (B×L×H×D) without interventions, in the
    dtypes of q, k, v, gates and sink; see the module docstring for which way computes them. `saved`: the
    forward's (out B×L×H×D, lse B×H×L fp32), ungated, which ATen's backward then uses instead of `stats`."""
    B, H, L, D = q.shape
    Hkv = k.shape[1]
    lengths = lengths.to(device=q.device, dtype=torch.long)
    index = _kv_index(H, Hkv, kv_head, q.device)
    full = unpadded(lengths, L)
    valid = _valid_keys(lengths, L)[:, None, :, None]
    if not full:
        k = torch.where(valid, k, 0).to(k.dtype)  # padded keys never reach a valid row (the reference drops them)
        v = torch.where(valid, v, 0).to(v.dtype)
    if uses_aten(q, sliding_window, softcap, sink):
        dq, dke, dve, dg, ds = _aten_backward(grad_out, q, k, v, lengths, scaling, gates, index, causal,
                                              saved=saved if gates is None else None, full=full)
    else:
        dq, dke, dve, dg, ds = tiled_backward(grad_out, q, k, v, lengths, scaling, gates, index, causal,
                                              sliding_window, softcap, sink, symmetric_window=symmetric_window)
    dk = _sum_per_kv_head(dke.float() if index is not None else dke, index, Hkv)
    dv = _sum_per_kv_head(dve.float() if index is not None else dve, index, Hkv)
    if not full:
        dk = torch.where(valid, dk, 0)
        dv = torch.where(valid, dv, 0)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if dg is None else dg.to(gates.dtype),
            None if ds is None else ds.to(sink.dtype))
