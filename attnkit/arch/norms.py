"""The per-key norms of norm-weighted features (Kobayashi et al. 2020; docs/features.md, "Norm-weighted
features").

Head h transforms key token t into f_h(x_t) = (x_t W_V^h + b_V^h) W_O^h: its value vector (what the attention
function receives as `value`) times the head's D columns of the output projection (the output bias is not part of
it). The norm needs no hidden-size product per token: with the head's Gram matrix G_h = W_O^hᵀ W_O^h (D × D),
‖f_h(x_t)‖² = v_t G_h v_tᵀ. Per layer that is one H × D × D product of W_O with itself and one batched product of
the values with G, B × H × L × D in and B × H × L out; nothing L × L and nothing B × L × hidden.
"""
from __future__ import annotations

import torch

from ..errors import AttnkitError


def key_norms(value: torch.Tensor, out_weight: torch.Tensor) -> torch.Tensor:
    """‖f_h(x_t)‖ for every sample b, head h and key t: B × H × L, float32.

    `value`: B × H × L × D, the values the attention function receives (x W_V + b_V, per head).
    `out_weight`: the output projection's weight as `nn.Linear` keeps it, hidden × (H·D); head h's slice is its
    columns h·D … (h+1)·D − 1. Computed in float32 whatever the dtype of the inputs.
    """
    if value.dim() != 4:
        raise AttnkitError(f"value must be B × H × L × D, got shape {tuple(value.shape)}")
    B, H, L, D = value.shape
    if out_weight.dim() != 2 or out_weight.shape[1] != H * D:
        raise AttnkitError(f"the output projection's weight must have {H} heads × {D} = {H * D} columns, got shape "
                           f"{tuple(out_weight.shape)}")
    w = out_weight.detach().float().view(out_weight.shape[0], H, D)
    gram = torch.einsum("ohd,ohe->hde", w, w)  # H × D × D
    v = value.detach().float()
    squared = (torch.matmul(v, gram[None]) * v).sum(-1)
    return squared.clamp_min_(0.0).sqrt_()


__all__ = ["key_norms"]
