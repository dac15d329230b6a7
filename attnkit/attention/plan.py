"""Planning one call of the op from an AttentionCall: the parts (the intervention's `LayerPart`s, for a pruned layer
those of the heads it kept), the sentence ids region interventions need, the consumers that take part and what they
want of the op (features, with which token classes and key scales; the max logit), the backend and windows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arch.architectures import output_matrix
from ..arch.norms import key_norms
from ..errors import AttnkitError
from ..features import DEFAULT_NUM_WINDOWS
from .call import AttentionCall, kv_index, per_query_head
from .kinds import DECODER, kind_of
from .runtime import LayerPart, kept_part
from .sentences import check_sentences_shape, forward_sentence_ids


@dataclass(frozen=True)
class Plan:
    """What the op is called with, and who gets its results (`consumers`, in the order attached)."""

    parts: list  # LayerPart: one for the whole batch, or one per block of samples (stacked interventions)
    token_class: torch.Tensor | None  # int32 B×L
    sentence_id: torch.Tensor | None  # int32 B×L
    key_scale: torch.Tensor | None  # norm weighting: B×H×L
    want_features: bool
    want_max_logit: bool
    backend: str = "auto"
    num_windows: int = DEFAULT_NUM_WINDOWS
    consumers: tuple = ()
    key_class: torch.Tensor | None = None  # cross-attention: the keys' token classes, int32 B×Lk
    grid: torch.Tensor | None = None  # int32 B×L×2: an image's patch grid (attnkit/attention/positions.py)
    alignment: bool = False  # the alignment features (an encoder–decoder's layers, every kind: Runtime.alignment)


def plan_call(call: AttentionCall) -> Plan:
    """The plan of `call` (module docstring); observers of q and k are called here, before the op."""
    rt = call.rt
    if rt is None:  # not instrumented (the probe forward): plain attention
        return Plan(kept_parts(call, [LayerPart(0, call.B)]), None, None, None, False, False)
    if call.info is None and not call.cross:
        check_sentences_shape(call.forward.sentences, call.B, call.L)
    parts, sentence_id = intervention_parts(call)
    taking = [(c, w) for c in rt.consumers if (w := c.wants(call)) is not None]
    for c, _ in taking:
        c.before(call)
    want_features = any(w.features for _, w in taking)
    want_max_logit = call.H > 0 and any(w.max_logit for _, w in taking)
    if call.info is not None:
        token_class = call.info.token_class
    else:  # features without attnkit's batch (attnkit.track): the classes the reader found (attention/positions.py)
        token_class = call.tokens.token_class(call.B, call.L, call.device) if want_features else None
    grid = call.tokens.grid(call.B, call.L, call.device) if want_features else None
    projection = next((w.out_proj for _, w in taking if w.out_proj is not None), None)
    return Plan(kept_parts(call, parts), token_class, sentence_id, key_scale(call, projection), want_features,
                want_max_logit, rt.backend, rt.num_windows, tuple(c for c, _ in taking),
                call.key_classes(want_features), grid, rt.alignment and want_features)


def intervention_parts(call: AttentionCall) -> tuple[list, torch.Tensor | None]:
    """(the parts of the intervention in force for the forward, or one unchanged part; the sentence ids they
    need)."""
    intervention = call.forward.intervention
    sentence_id = call.info.sentence_id if call.info is not None and not call.cross else None
    if intervention is None:
        return [LayerPart(0, call.B)], sentence_id
    parts = intervention.layer_plan(call.layer, call.B, call.L, call.D, call.device, call.query.dtype)
    if any(p.region is not None for p in parts):
        if call.cross:
            raise AttnkitError(f"region interventions (no_intra, no_inter) are not defined on cross-attention (layer "
                               f"{call.layer}): a target token's sentence is not among the source's; intervene on "
                               "its heads with modes and gates (docs/seq2seq.md)")
        if call.decode:
            raise AttnkitError("region interventions need the sentence of every key, which a step of generation "
                               "with a KV cache does not see (only its new tokens): generate with "
                               "use_cache=False under a region intervention")
        if sentence_id is None and kind_of(call.module) == DECODER:
            raise AttnkitError(f"region interventions on an encoder–decoder's decoder layer ({call.layer}) need the "
                               "target's sentence ids, which attnkit finds only in its own batches "
                               "(attnkit.tokens.Batch.target); a plain forward's are the source's")
        if sentence_id is None:
            sentence_id = forward_sentence_ids(call.rt, call.forward, call.B, call.L, call.lengths, call.device,
                                               call.offsets)
    return parts or [LayerPart(0, call.B)], sentence_id


def kept_parts(call: AttentionCall, parts: list) -> list:
    """A pruned layer: the intervention's settings of the heads it kept (the probe forward of
    attnkit.models.instrument runs before DistilBERT's layers are numbered)."""
    if call.kept is None:
        return parts
    return [kept_part(p, call.kept, call.layer) for p in parts]


def key_scale(call: AttentionCall, projection) -> torch.Tensor | None:
    """Norm weighting: each key's ‖f_h(x_t)‖ (attnkit/arch/norms.py), each query head with its KV head's values
    and its own columns of the output projection."""
    if projection is None:
        return None
    values = per_query_head(call.value, kv_index(call.H, call.Hkv, call.dec, call.device))
    return key_norms(values, output_matrix(projection))
