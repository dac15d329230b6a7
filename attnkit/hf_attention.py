"""attnkit as a transformers 5 attention implementation (`attn_implementation="attnkit"`).

transformers calls `attnkit_attention(module, q, k, v, mask, scaling=..., dropout=...)` from every
self-attention layer. With nothing active it is plain attention (equal to eager). The call goes through four
steps, each in its own module of attnkit/attention/:
1. read the call (`call.read_call` → a frozen `AttentionCall`): layout and padding, decoder arguments, kept heads;
2. plan it (`plan.plan_call` → `Plan`): the intervention's parts, sentence ids, what the consumers want of the op;
3. run the op (here: `run_op`, and the maps `op_weights`; in training with dropout `run_training`);
4. deliver (`deliver.deliver`): the replaced head outputs, then each consumer's `after`.
What is done with the op's results is a consumer (attnkit/attention/consumers/: extraction's features and the early
stop, observers of q and k and of the max logit, head caches, the training tracker), attached to the model's
`Runtime` for a block; what the Runtime holds (settings, attnkit's own batch, the intervention, the inputs of the
forward under way) is in attnkit/attention/runtime.py. `attnkit.models.instrument` attaches a Runtime to each
attention module; context managers in `attnkit.engine.forward`, `attnkit.models.observing`, `attnkit.interventions`,
`attnkit.cache_heads` and `attnkit.track` attach what they need and always take it off again.

Asked for maps (`model(**inputs, output_attentions=True)`, which transformers passes on to the attention
function), it also returns each layer's B×H×L×L weights, equal to eager attention's, and under an intervention
the weights the layer really used (after mode, region and renormalisation: `attnkit.reference.attention_weights`;
gates scale the head's output, not its weights). They are computed only then: a forward without
`output_attentions` materialises no map.

An intervention says per layer what the op does (`layer_plan` → `LayerPart`s): one call of the op for the batch,
or one per block of samples for stacked interventions; after the op, the outputs of patched and mean-ablated heads
are replaced (attnkit.reference.replace_head_outputs), and the per-head outputs go to the caches of `cache_heads`.

The mask function registered beside it hands over the 2-D padding mask (or None when a batch has no
padding) instead of an L×L bias, to encoders and causal models alike: the op takes per-sample lengths, never an
L×L tensor.

Decoder language models (docs/decoders.md): what transformers passes decides the op's decoder arguments
(`decoder_arguments`: the module's `is_causal`, K/V with fewer heads than Q, the `sliding_window`, `softcap` and
`s_aux` arguments); an argument attnkit does not know is refused by name. A left-padded batch is taken by moving
each sample's tokens to the front (`padding_of`, `rolled`), calling the op, and moving the results back; rows of
left padding get zeros.

Generation with a KV cache (docs/decoders.md, "Generation"): a step has fewer queries than keys, the queries being
the last positions of the keys (the op's definition: attnkit/reference.py, "Fewer queries than keys"). Without
padding the op gets them as they are. A left-padded batch (as `generate` pads) has its keys moved to the front and
its queries left where they are (each sample's last tokens); the samples of one length are one call of the op, with
that many keys. Interventions apply (their modes, gates, mean and patch values of the step's length); regions, which
need the sentence of every key, and observers of q and k are refused by name, as are attnkit's own batches.

Norm weighting (docs/features.md, "Norm-weighted features"): when extraction's consumer weights by "norm", each
layer's features describe its weights scaled per key by ‖f_h(x_t)‖ (attnkit/arch/norms.py), computed from the
values this function receives and the layer's output projection (attnkit.attention.plan); the output does not
change.

A pruned layer (attnkit/arch/pruning.py) has fewer heads than the config names: its intervention codes and gates
are those of the heads it kept, and what attnkit measures is spread over the unpruned heads, so a removed head's
features are 0 (those of a zeroed head) and observers see it with q = k = 0. A layer with no head left calls this
function with empty q, k, v and gets an empty output.

Sentence ids (docs/features.md, "Token classes" and "Sentence ids") matter only to region interventions
(`no_intra`/`no_inter`). For each forward they come from, in this order:
1. attnkit's own batches (`extract`, `ablate`: `Runtime.batch_of`), computed by `attnkit.tokens.Encoder`;
2. ids the user gave (`attnkit.sentences(model, ids)` or `intervene(model, iv, sentences=ids)`), B×L;
3. the inputs of a plain forward, which hooks from `attnkit.models.instrument` record for its duration
   (`Runtime.inputs`), per sample: `token_type_ids` when they take more than one value over the sample's
   tokens (segments A and B of BERT, ELECTRA); else separator tokens in `input_ids`: a run of
   separators before the end closes a segment (RoBERTa's `</s></s>`, BERT's middle `[SEP]`), and with
   no such run the sample is a single text, one sentence; else (no separator token known for the
   model) `token_type_ids` that take one value: a single text again, as the tokenizer marks pairs.
Segments become sentences by `attnkit.tokens.sentence_ids` ([CLS] in the first, a [SEP] in the one it
closes). Where none of this applies — the forward's inputs were not seen, or a sample has neither
separating `token_type_ids` nor `input_ids` with a known separator token (e.g. `inputs_embeds`) — a
region intervention raises AttnkitError saying how to give the ids; it never runs as a silent no-op.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .arch.pruning import to_unpruned
from .attention.call import (  # noqa: F401 (re-exported: where other modules and tests import them)
    HARMLESS_KWARGS,
    READ_KWARGS,
    AttentionCall,
    decoder_arguments,
    kv_index,
    observed,
    per_query_head,
    read_call,
)
from .attention.consumers import FeaturesComplete, LayerFeatures, Result  # noqa: F401 (re-exported)
from .attention.deliver import deliver
from .attention.layout import (  # noqa: F401 (re-exported)
    first_token_classes,
    lengths_from_mask,
    padding_of,
    rolled,
    unshift,
)
from .attention.plan import Plan, plan_call
from .attention.runtime import (  # noqa: F401 (re-exported)
    RUNTIME_ATTR,
    BatchInfo,
    Callers,
    LayerPart,
    ModelInputs,
    Runtime,
    kept_part,
    recording_callers,
)
from .attention.sentences import (  # noqa: F401 (re-exported)
    check_sentences_shape,
    forward_sentence_ids,
    sentence_ids_from_inputs,
)
from .errors import AttnkitError
from .features import num_features
from .ops import attention
from .reference import attention_weights

NAME = "attnkit"


def attnkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    call = read_call(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if dropout and module.training:
        return run_training(call)
    plan = plan_call(call)
    result = deliver(call, plan, *run_op(call, plan))
    return result.out, op_weights(call, plan) if call.want_maps else None


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
        width = num_features(plan.num_windows, "sink" in call.dec, grid=plan.grid is not None)
        return q.new_zeros(n, L, 0, call.D), q.new_zeros((n, 0, width), dtype=torch.float32)
    if call.grouped_by_length:  # no features (attnkit's own batches are refused by the reader)
        out = q.new_zeros(q[rows].shape[0], L, H, call.D)
        for where, idx, n, r in call.length_groups(rows):
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
        want_max_logit=plan.want_max_logit, grid=None if plan.grid is None else plan.grid[rows], **call.dec,
    )


def op_weights(call: AttentionCall, plan: Plan) -> torch.Tensor:
    """The maps: the weights this forward used, interventions included (their definition: attnkit.reference), in
    the batch's own positions; a pruned layer's maps cover the unpruned heads, a removed head's map all zeros (as
    its features)."""
    if call.H == 0:
        weights = call.query.new_zeros(call.B, 0, call.L, call.Lk, dtype=torch.float32)
    else:
        weights = torch.cat([part_weights(call, plan, p) for p in plan.parts])
    weights = call.own_frame(weights, (2, 3), 2)
    if call.kept is not None:
        weights = to_unpruned(weights, call.kept)
    return weights.to(call.query.dtype)


def part_weights(call: AttentionCall, plan: Plan, p: LayerPart) -> torch.Tensor:
    rows = slice(p.start, p.stop)
    q, k, L = call.query, call.key, call.L
    if not call.grouped_by_length:
        return attention_weights(q[rows], k[rows], call.lengths[rows], call.scale,
                                 None if plan.sentence_id is None else plan.sentence_id[rows], p.mode, p.region,
                                 p.renormalize, **call.dec)
    w = q.new_zeros(q[rows].shape[0], call.H, L, call.Lk, dtype=torch.float32)
    for where, idx, n, r in call.length_groups(rows):  # as `run_part` computes them
        w[where, :, L - r:, :n] = attention_weights(q[idx, :, L - r:], k[idx, :, :n], call.lengths[idx], call.scale,
                                                    None, p.mode, p.region, p.renormalize, **call.dec)
    return w


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
                                      grid=call.tokens.grid(B, L, call.device),
                                      backend=rt.backend, want_max_logit=any(w.max_logit for _, w in taking),
                                      **call.dec)
        for c, _ in taking:
            c.after(call, Result(None, feats, ml[0] if ml else None))
    if rt is not None and rt.active:
        raise AttnkitError("attnkit cannot measure or intervene while attention dropout is on: call model.eval()")
    if call.want_maps or call.dec or call.offsets is not None:
        q = call.query
        weights = torch.nn.functional.dropout(
            attention_weights(q, call.key, call.lengths, call.scale, **call.dec).to(q.dtype),
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


def padding_mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """transformers' mask function for attnkit: the 2-D padding mask (None when the batch has no
    padding). While compiling or capturing a CUDA graph, the mask is handed over even without padding:
    deciding "no padding" needs its values on the host (a graph break, or a sync that a capture
    forbids), and lengths_from_mask handles a full mask just as well.

    A static cache has `kv_length` slots, of which only the first hold tokens: the mask then covers those
    (flash_attention_mask hands over a given mask shorter than the slots; without one, a mask of ones over the
    tokens seen, `q_offset` + `q_length`), and the attention function takes the keys it covers (attention.call.filled).
    """
    compiling = torch.compiler.is_compiling()
    if attention_mask is not None and (
        compiling or (attention_mask.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return attention_mask[:, -kv_length:]
    if attention_mask is None and not compiling and kwargs.get("q_offset") is not None:
        seen = int(kwargs["q_offset"]) + q_length  # a static layer's offset is a tensor (one host read)
        if seen < kv_length:
            return torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device"))
    return flash_attention_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make "attnkit" a valid `attn_implementation` (idempotent): `import attnkit` calls it, and so does
    `attnkit.models.instrument` before it switches a model to it."""
    AttentionInterface.register(NAME, attnkit_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


register()  # importing this module makes attn_implementation="attnkit" valid (attnkit/__init__.py imports it
#             as soon as transformers is imported)
