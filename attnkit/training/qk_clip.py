"""QK-Clip (the Kimi K2 report's MuonClip; docs/training.md, "QK-Clip"): after an optimiser step, every head whose
max logit passed τ gets its W_q and W_k rows scaled so that its max logit comes back to τ.

For head h with max logit m_h > τ, q_h's units are multiplied by sqrt(τ / m_h). A KV head is shared by its query
heads (grouped-query attention), so it is scaled once, by sqrt(τ / M_g), M_g the largest max logit of its query heads
(when M_g > τ): afterwards every head's max logit (on the batches measured) is at most τ, and the largest of each
group exactly τ. Without GQA each head has its own k, and both factors are sqrt(τ / m_h). Where q and k come from is
attnkit/arch's knowledge of each architecture (separate projections, GPT-2's c_attn, GPT-NeoX's query_key_value,
Phi-3's qkv_proj): nothing is guessed, and an unknown architecture is refused by name.
"""
from __future__ import annotations

import math

import torch

from ..arch.architectures import attention_layers, query_key_units, scale_output_units
from ..arch.pruning import KV_HEAD_ATTR, kept_heads
from ..errors import AttnkitError


def qk_clip(model, max_logit: torch.Tensor, tau: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Scale the W_q and W_k units of the heads whose `max_logit` (layers × heads, e.g. `tracker.read()["max_logit"]`)
    exceeds `tau`, in place, without a host sync. Returns (layers × heads factors applied to q, per layer the factors
    applied to its KV heads). NaN max logits (a layer no forward reached) change nothing."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise AttnkitError(f"QK-Clip's threshold tau must be a finite number > 0, got {tau!r}")
    layers = attention_layers(model, "QK-Clip")
    if not isinstance(max_logit, torch.Tensor) or max_logit.dim() != 2 or max_logit.shape[0] != len(layers):
        raise AttnkitError(f"max_logit must be a layers × heads tensor with {len(layers)} layers, got "
                           f"{tuple(getattr(max_logit, 'shape', ()))}")
    cfg = model.config
    q_factors, k_factors = [], []
    for i, layer in enumerate(layers):
        if kept_heads(layer.module) is not None:
            raise AttnkitError(f"layer {i} was pruned: QK-Clip of a pruned model is not supported")
        H = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0))
        Hkv = int(getattr(cfg, "num_key_value_heads", None) or H)
        if max_logit.shape[1] != H:
            raise AttnkitError(f"max_logit has {max_logit.shape[1]} heads per layer, the model {H}")
        m = max_logit[i].float()
        over = m > tau  # NaN: False
        fq = torch.where(over, torch.sqrt(tau / m.clamp(min=tau)), 1.0)
        named = getattr(layer.module, KV_HEAD_ATTR, None)
        kv = named.long().to(m.device) if named is not None else torch.arange(H, device=m.device) // (H // Hkv)
        group_max = torch.full((Hkv,), float("-inf"), device=m.device).scatter_reduce(
            0, kv, torch.where(over, m, float("-inf")), "amax")
        fk = torch.where(group_max > tau, torch.sqrt(tau / group_max.clamp(min=tau)), 1.0)
        units = query_key_units(layer, H, Hkv)
        scale_output_units(units.query, units.query_units, fq)
        scale_output_units(units.key, units.key_units, fk)
        q_factors.append(fq)
        k_factors.append(fk)
    return torch.stack(q_factors), k_factors
