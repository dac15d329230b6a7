"""Per-head statistics of training computed without an L×L map (docs/training.md, "Statistics while training").

`max_logits` is attnkit.reference.max_logits by blocks of query rows: each block's scores (block × L) exist at
once, never the whole map. It costs one more q·kᵀ product (about a third of an attention forward's work), which is
why it runs only where a max logit is asked for.
"""
from __future__ import annotations

import torch

from ..reference import query_positions, resolve_kv_head

TILE_ELEMENTS = 1 << 20  # scores per block


def max_logits(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scaling: float, *, kv_head=None,
               causal: bool = False, sliding_window: int | None = None,
               key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """B×H fp32, equal to attnkit.reference.max_logits, by blocks of query rows (no grad). q may have fewer rows
    than k has keys (a KV-cache step: the last positions); a sample with no valid row gets −inf. Cross-attention
    (`key_lengths`): rows i < lengths, keys t < key_lengths."""
    B, H, Lq, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    with torch.no_grad():
        kf = k.float()
        if kv_head is not None or Hkv != H:
            kf = kf.index_select(1, resolve_kv_head(H, Hkv, kv_head, q.device))
        lengths = lengths.to(q.device).long()
        keys = torch.arange(L, device=q.device)
        n_keys = lengths if key_lengths is None else key_lengths.to(q.device).long()
        key_ok = (keys[None, :] < n_keys[:, None])[:, None, None, :]  # B×1×1×L
        # the true position of each query row (cross-attention: its own index)
        rows = query_positions(Lq, L if key_lengths is None else Lq, q.device)
        best = torch.full((B, H), float("-inf"), device=q.device)
        blk = max(1, min(Lq, TILE_ELEMENTS // max(1, B * H * L)))
        for i0 in range(0, Lq, blk):
            i1 = min(Lq, i0 + blk)
            s = torch.matmul(q[:, :, i0:i1].float(), kf.transpose(-1, -2)) * scaling  # B×H×b×L
            offset = rows[i0:i1, None] - keys[None, :]  # s − t
            seen = key_ok & (rows[i0:i1][None, :] < lengths[:, None])[:, None, :, None]  # valid rows only
            if causal:
                seen = seen & (offset >= 0)
            if sliding_window is not None:
                seen = seen & (offset < sliding_window)
            best = torch.maximum(best, s.masked_fill(~seen, float("-inf")).amax((-1, -2)))
            # torch.maximum propagates NaN, as the reference's amax does
    return best
