"""attnkit as a transformers 5 attention implementation (`attn_implementation="attnkit"`).

transformers calls `attnkit_attention(module, q, k, v, mask, scaling=..., dropout=...)` from every
self-attention layer. With nothing active it is plain attention (equal to eager). This module holds that function,
its registration and the mask function; the call goes through four steps, each in its own module of
attnkit/attention/:
1. read the call (`call.read_call` → a frozen `AttentionCall`): the context of the forward it belongs to
   (`context.Forward`: the forward's inputs, and attnkit's batch, the sentence ids and the intervention given when
   it began), layout and padding, decoder arguments, kept heads; an encoder–decoder's cross-attention by its own
   reader (`cross.read_cross_call`, docs/seq2seq.md);
2. plan it (`plan.plan_call` → `Plan`): the intervention's parts, sentence ids, what the consumers want of the op;
3. run the op (`run.run_op`; a forward in training with attention dropout is not planned: `run.run_training`);
4. deliver (`deliver.deliver` → `Result`): the replaced head outputs, the maps when asked for (`maps.maps`), then
   each consumer's `after`.
What is done with the op's results is a consumer (attnkit/attention/consumers/: extraction's features and the early
stop, observers of q and k and of the max logit, head caches, the training tracker), attached to the model's
`Runtime` for a block. The Runtime (attnkit/attention/runtime.py) holds settings, the consumers, what the blocks
open on the model give the next forwards (`Runtime.given`) and the stack of forwards under way; a forward's own
data is its `Forward`, made when it begins (attnkit.models' hooks on the base model) and dropped when it ends.
`attnkit.models.instrument` attaches a Runtime to each attention module; context managers in
`attnkit.engine.forward`, `attnkit.models.observing`, `attnkit.interventions`, `attnkit.cache_heads` and
`attnkit.track` attach or give what they need and always take it off again.

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
1. attnkit's own batches (`extract`, `ablate`: `Runtime.batch_of`, read into the forward's `Forward` when it
   begins), computed by `attnkit.tokens.Encoder`;
2. ids the user gave (`attnkit.sentences(model, ids)` or `intervene(model, iv, sentences=ids)`), B×L;
3. the inputs of a plain forward, which hooks from `attnkit.models.instrument` record for its duration
   (`Forward.inputs`; the ids are derived once per forward, when the first layer needs them), per sample:
   `token_type_ids` when they take more than one value over the sample's tokens (segments A and B of BERT,
   ELECTRA); else separator tokens in `input_ids`: a run of separators before the end closes a segment
   (RoBERTa's `</s></s>`, BERT's middle `[SEP]`), and with no such run the sample is a single text, one
   sentence; else (no separator token known for the model) `token_type_ids` that take one value: a single text
   again, as the tokenizer marks pairs.
Segments become sentences by `attnkit.tokens.sentence_ids` ([CLS] in the first, a [SEP] in the one it
closes). Where none of this applies — the forward's inputs were not seen, or a sample has neither
separating `token_type_ids` nor `input_ids` with a known separator token (e.g. `inputs_embeds`) — a
region intervention raises AttnkitError saying how to give the ids; it never runs as a silent no-op.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .attention.call import read_call
from .attention.consumers import LayerFeatures  # noqa: F401 (re-exported: where tests import it)
from .attention.context import BatchInfo  # noqa: F401 (re-exported: where tests import it)
from .attention.cross import read_cross_call
from .attention.deliver import deliver
from .attention.kinds import CROSS, kind_of
from .attention.layout import lengths_from_mask, padding_of, rolled  # noqa: F401 (re-exported: where tests import them)
from .attention.plan import plan_call
from .attention.run import run_op, run_training
from .attention.sentences import sentence_ids_from_inputs  # noqa: F401 (re-exported: where tests import it)

NAME = "attnkit"


def attnkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    reader = read_cross_call if kind_of(module) == CROSS else read_call  # an encoder–decoder's cross-attention
    call = reader(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if dropout and module.training:
        return run_training(call)
    plan = plan_call(call)
    result = deliver(call, plan, *run_op(call, plan))
    return result.out, result.maps


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
        if seen < kv_length and _hides_later_keys(kwargs.get("mask_function"), kv_length):
            return torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device"))
    return flash_attention_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


def _hides_later_keys(mask_function, kv_length: int) -> bool:
    """Whether transformers' `mask_function` hides a later key from the first query (a causal mask, whose keys may be
    a static cache's slots, filled or not), as flash_attention_mask's default does. A bidirectional one (an
    encoder's, or cross-attention's over an encoder's states: more keys than queries, every one a token) does not."""
    if mask_function is None or kv_length < 2:
        return True
    zero = torch.tensor(0)
    return not bool(mask_function(zero, zero, zero, torch.tensor(kv_length - 1)))


def register() -> None:
    """Make "attnkit" a valid `attn_implementation` (idempotent): `import attnkit` calls it, and so does
    `attnkit.models.instrument` before it switches a model to it."""
    AttentionInterface.register(NAME, attnkit_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


register()  # importing this module makes attn_implementation="attnkit" valid (attnkit/__init__.py imports it
#             as soon as transformers is imported)
