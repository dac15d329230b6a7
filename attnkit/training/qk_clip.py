"""QK-Clip (the Kimi K2 report's MuonClip; docs/training.md, "QK-Clip"): after an optimiser step, every head whose
max logit passed τ gets its W_q and W_k rows scaled so that its max logit comes back to τ.

For head h with max logit m_h > τ, q_h's units are multiplied by sqrt(τ / m_h). A KV head is shared by its query
heads (grouped-query attention), so it is scaled once, by sqrt(τ / M_g), M_g the largest max logit of its query heads
(when M_g > τ): afterwards each layer's max logits computed from the inputs that layer had when measured are at most
τ, the largest of each group exactly τ. That holds on the same batch for the lowest layer scaled; the layers above it
then see other inputs (the clip changed the layers below), so nothing bounds their max logit on that batch. Without
GQA each head has its own k, and both factors are sqrt(τ / m_h). Where q and k come from is attnkit/arch's knowledge
of each architecture (separate projections, GPT-2's c_attn, GPT-NeoX's query_key_value, Phi-3's qkv_proj): nothing
is guessed, and an unknown architecture is refused by name.
"""
from __future__ import annotations

import torch

from ..arch.architectures import attention_layers, query_key_units, scale_output_units
from ..arch.pruning import KV_HEAD_ATTR, kept_heads
from ..errors import AttnkitError
from .checks import model_to_track, positive_real, real_tensor


def clip_plan(model) -> tuple[list, int, int]:
    """(per attention layer its QK-Clip units, query heads, KV heads) of `model`, or an AttnkitError naming why QK-Clip
    cannot scale it (an unknown architecture, a pruned layer, per-head norms of q and k): what `qk_clip` needs, and
    what `AttnkitCallback` checks before the first step."""
    model_to_track(model, "QK-Clip")
    layers = attention_layers(model, "QK-Clip")
    cfg = model.config
    H = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0))
    Hkv = int(getattr(cfg, "num_key_value_heads", None) or H)
    plan = []
    for i, layer in enumerate(layers):
        if kept_heads(layer.module) is not None:
            raise AttnkitError(f"layer {i} was pruned: QK-Clip of a pruned model is not supported")
        plan.append((layer, query_key_units(layer, H, Hkv)))
    return plan, H, Hkv


def qk_clip(model, max_logit: torch.Tensor, tau: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Scale the W_q and W_k units of the heads whose `max_logit` (layers × heads, e.g. `tracker.read()["max_logit"]`)
    exceeds `tau` (a real number > 0: Python, numpy or a 0-d tensor), in place, without a host sync. Returns
    (layers × heads factors applied to q, per layer the factors applied to its KV heads). A non-finite max logit
    changes nothing: NaN (a layer no forward reached), and ±inf (an overflow, which no finite factor brings to
    `tau`: sqrt(tau / inf) would erase the head's q and its KV group's k); a KV group is scaled by its finite heads."""
    tau = positive_real(tau, "tau")
    plan, H, Hkv = clip_plan(model)
    if not real_tensor(max_logit) or max_logit.dim() != 2 or max_logit.shape[0] != len(plan):
        raise AttnkitError(f"max_logit must be a layers × heads tensor of real numbers with {len(plan)} layers, got "
                           f"{type(max_logit).__name__} {tuple(getattr(max_logit, 'shape', ()))}")
    if max_logit.shape[1] != H:
        raise AttnkitError(f"max_logit has {max_logit.shape[1]} heads per layer, the model {H}")
    q_factors, k_factors = [], []
    for i, (layer, units) in enumerate(plan):
        m = max_logit[i].float()
        over = torch.isfinite(m) & (m > tau)
        fq = torch.where(over, torch.sqrt(tau / m.clamp(min=tau)), 1.0)
        named = getattr(layer.module, KV_HEAD_ATTR, None)
        kv = named.long().to(m.device) if named is not None else torch.arange(H, device=m.device) // (H // Hkv)
        group_max = torch.full((Hkv,), float("-inf"), device=m.device).scatter_reduce(
            0, kv, torch.where(over, m, float("-inf")), "amax")
        fk = torch.where(group_max > tau, torch.sqrt(tau / group_max.clamp(min=tau)), 1.0)
        scale_output_units(units.query, units.query_units, fq)
        scale_output_units(units.key, units.key_units, fk)
        q_factors.append(fq)
        k_factors.append(fk)
    return torch.stack(q_factors), k_factors
