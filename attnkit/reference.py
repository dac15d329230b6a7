"""The executable specification: pure-PyTorch attention with interventions and per-head features.

Every backend (the C++ and CUDA ops) is tested against `reference_attention`. It materialises the
B×H×L×L weights, so it is for correctness and small inputs, not for speed. It is differentiable
(autograd flows to q, k, v and gates), which the fused op's backward relies on.

Semantics (docs/features.md, docs/interventions.md):
  * Padding is per sample: keys `t >= lengths[b]` get weight 0. Padded query rows still attend to the
    valid keys (as eager attention does) but contribute no features.
  * Weights = softmax(q kᵀ · scaling) → mode (keep / zero / uniform 1/n) → region (zero the intra- or
    inter-sentence keys) → optional renormalisation of what is left (a row with nothing left stays 0).
  * Output = weights · v, times the head's gate; returned as B×L×H×D like transformers expects.
  * Features describe the final weights and are means over the n valid query rows of each sample,
    except `cls_entropy`, the mean entropy of the rows whose token class is CLS (0 if there is none).
"""
from __future__ import annotations

import torch

from .features import (
    CLS,
    COMMA,
    KEEP,
    NO_INTER,
    NO_INTRA,
    OTHER,
    PERIOD,
    SEP,
    UNIFORM,
    ZERO,
    num_features,
)


def _key_mask(lengths: torch.Tensor, L: int) -> torch.Tensor:
    """B×L bool, True on valid (non-padding) positions."""
    return torch.arange(L, device=lengths.device)[None, :] < lengths[:, None]


def intervene_weights(
    weights: torch.Tensor,
    lengths: torch.Tensor,
    sentence_id: torch.Tensor | None,
    mode: torch.Tensor | None,
    region: torch.Tensor | None,
    renormalize: bool,
) -> torch.Tensor:
    """Apply per-head mode and region to B×H×L×L softmax weights (padded keys already 0)."""
    B, H, L, _ = weights.shape
    valid_key = _key_mask(lengths, L)[:, None, None, :]  # B×1×1×L
    if mode is not None:
        mode = mode.to(weights.device).view(1, H, 1, 1)
        uniform = valid_key.to(weights.dtype) / lengths.to(weights.dtype).clamp(min=1).view(B, 1, 1, 1)
        weights = torch.where(mode == ZERO, torch.zeros_like(weights), weights)
        weights = torch.where(mode == UNIFORM, uniform.expand_as(weights), weights)
    if region is not None:
        region = region.to(weights.device).view(1, H, 1, 1)
        if sentence_id is None:
            same = torch.ones(B, 1, L, L, dtype=torch.bool, device=weights.device)
        else:
            same = (sentence_id[:, :, None] == sentence_id[:, None, :])[:, None]  # B×1×L×L
        drop = ((region == NO_INTRA) & same) | ((region == NO_INTER) & ~same)
        weights = weights.masked_fill(drop, 0.0)
    if renormalize:
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total > 0, weights / total.clamp(min=torch.finfo(weights.dtype).tiny), weights)
    return weights


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    sentence_id: torch.Tensor | None = None,
    mode: torch.Tensor | None = None,
    region: torch.Tensor | None = None,
    renormalize: bool = False,
) -> torch.Tensor:
    """B×H×L×L fp32 weights after softmax and interventions."""
    L = q.shape[2]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    valid_key = _key_mask(lengths, L)[:, None, None, :]
    scores = scores.masked_fill(~valid_key, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return intervene_weights(weights, lengths, sentence_id, mode, region, renormalize)


def bucket_index(token_class: torch.Tensor, lengths: torch.Tensor, num_windows: int) -> torch.Tensor:
    """B×L×L int64: the distance-feature bucket of key t for query s (docs/features.md).

    0..3: key class cls/sep/comma/period; 4: self (t == s, class OTHER); 5 + w: window w of
    d = |s − t| ≥ 1, w = floor(d · N / n). Padded positions get a bucket too; callers mask them.
    """
    B, L = token_class.shape
    pos = torch.arange(L, device=token_class.device)
    dist = (pos[:, None] - pos[None, :]).abs()  # L×L
    n = lengths.clamp(min=1).view(B, 1, 1)
    window = torch.div(dist[None] * num_windows, n, rounding_mode="floor").clamp(max=num_windows - 1)
    idx = 5 + window
    idx = torch.where(dist[None] == 0, torch.full_like(idx, 4), idx)
    key_cls = token_class[:, None, :].long().expand(B, L, L)
    special = key_cls != OTHER
    # class codes CLS..PERIOD (1..4) map to buckets 0..3
    idx = torch.where(special, key_cls - 1, idx)
    return idx


def row_features(
    weights: torch.Tensor,
    lengths: torch.Tensor,
    token_class: torch.Tensor,
    sentence_id: torch.Tensor | None,
    num_windows: int,
) -> torch.Tensor:
    """Per-(sample, head) feature vectors B×H×F (fp32) from final B×H×L×L weights."""
    B, H, L, _ = weights.shape
    w = weights.float()
    valid = _key_mask(lengths, L)  # B×L
    w = w * valid[:, None, None, :]  # padded keys contribute nothing
    nb = 5 + num_windows
    idx = bucket_index(token_class, lengths, num_windows)[:, None].expand(B, H, L, L)
    buckets = torch.zeros(B, H, L, nb, dtype=torch.float32, device=w.device).scatter_add_(-1, idx, w)

    prev = torch.zeros(B, H, L, device=w.device)
    nxt = torch.zeros(B, H, L, device=w.device)
    if L > 1:
        prev[..., 1:] = torch.diagonal(w, offset=-1, dim1=-2, dim2=-1)
        nxt[..., :-1] = torch.diagonal(w, offset=1, dim1=-2, dim2=-1)
    entropy = -torch.special.xlogy(w, w).sum(-1)
    mx = w.amax(-1)
    if sentence_id is None:
        intra = w.sum(-1)
        inter = torch.zeros_like(intra)
    else:
        same = (sentence_id[:, :, None] == sentence_id[:, None, :])[:, None]
        intra = (w * same).sum(-1)
        inter = (w * ~same).sum(-1)
    rows = torch.cat(
        [buckets, torch.stack([prev, nxt, entropy, mx, intra, inter], dim=-1)], dim=-1
    )  # B×H×L×(F-1)
    row_valid = valid[:, None, :, None].float()
    n = lengths.clamp(min=1).float().view(B, 1, 1)
    means = (rows * row_valid).sum(2) / n

    is_cls_row = (token_class == CLS) & valid  # B×L
    n_cls = is_cls_row.sum(-1).float().view(B, 1)
    cls_ent = (entropy * is_cls_row[:, None, :]).sum(-1) / n_cls.clamp(min=1)
    out = torch.cat([means, cls_ent[..., None]], dim=-1)
    assert out.shape[-1] == num_features(num_windows)
    return out


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    token_class: torch.Tensor | None = None,
    sentence_id: torch.Tensor | None = None,
    *,
    scaling: float | None = None,
    num_windows: int = 16,
    mode: torch.Tensor | None = None,
    region: torch.Tensor | None = None,
    renormalize: bool = False,
    gates: torch.Tensor | None = None,
    want_features: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention + interventions + features, computed in fp32.

    q, k, v: B×H×L×D. lengths: B (int). token_class, sentence_id: B×L ints (None: all OTHER / one
    sentence). mode, region: H ints (codes in `attnkit.features`). gates: H floats.
    Returns (out B×L×H×D in q's dtype, features B×H×F fp32, or B×H×0 when not wanted).
    """
    B, H, L, D = q.shape
    if scaling is None:
        scaling = D**-0.5
    lengths = lengths.to(q.device).long()
    weights = attention_weights(q, k, lengths, scaling, sentence_id, mode, region, renormalize)
    out = torch.matmul(weights, v.float())  # B×H×L×D
    if gates is not None:
        out = out * gates.to(out.device, torch.float32).view(1, H, 1, 1)
    out = out.transpose(1, 2).to(q.dtype)
    if want_features:
        if token_class is None:
            token_class = torch.full((B, L), OTHER, dtype=torch.int32, device=q.device)
        feats = row_features(weights.detach(), lengths, token_class, sentence_id, num_windows)
    else:
        feats = q.new_zeros((B, H, 0), dtype=torch.float32)
    return out, feats


__all__ = [
    "reference_attention",
    "reference_js_distances",
    "attention_weights",
    "intervene_weights",
    "row_features",
    "bucket_index",
    "KEEP",
    "SEP",
    "COMMA",
    "PERIOD",
]


def reference_js_distances(attn: torch.Tensor, lengths: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """M×M fp64 Σ_b Σ_{s<n_b} JS(attn[b,i,s,:], attn[b,j,s,:]) (natural logs, 0·log 0 = 0).

    attn: B×M×L×L attention rows (padded keys 0); lengths: B. Pure PyTorch, chunked over heads i so
    that at most chunk×M×L×L values exist at once (the executable spec of the js_distances op).
    """
    B, M, L, _ = attn.shape
    a = attn.double()
    rows = torch.arange(L, device=attn.device)[None, :] < lengths.to(attn.device).view(B, 1)  # B×L
    out = torch.zeros(M, M, dtype=torch.float64, device=attn.device)
    for b in range(B):
        p_all = a[b][:, rows[b]]  # M×n×L
        for i0 in range(0, M, chunk):
            p = p_all[i0:i0 + chunk, None]  # c×1×n×L
            q = p_all[None]  # 1×M×n×L
            m = (p + q) / 2
            kl_p = torch.special.xlogy(p, p) - torch.special.xlogy(p, m)
            kl_q = torch.special.xlogy(q, q) - torch.special.xlogy(q, m)
            out[i0:i0 + chunk] += (0.5 * (kl_p + kl_q)).sum((-1, -2))
    return out
