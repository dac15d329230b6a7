"""The three kinds of attention layers of an encoder–decoder (docs/seq2seq.md): encoder self-attention, decoder
self-attention (causal) and cross-attention (the decoder's queries over the encoder's keys and values).

`attnkit.models.instrument` marks each attention module of an encoder–decoder with its kind (`KIND_ATTR`) and its
number among attnkit's layers (`LAYER_ATTR`): the encoder's layers first, then the decoder's self-attention layers,
then its cross-attention layers, each kind in the model's order. transformers' own `layer_idx` is left alone (the
decoder's KV caches are indexed by it, and an encoder and a decoder layer share it). A model of one stack carries
neither attribute: its layer is its `layer_idx`."""
from __future__ import annotations

from ..errors import AttnkitError

# the kinds and their count from a config alone are the run directory's to know (meta.json's layer_kinds, the model
# identity); this module marks the modules with them
from ..run.model_dir import CROSS, DECODER, ENCODER, KINDS, seq2seq_layer_kinds  # noqa: F401  (re-exported)

KIND_ATTR = "attnkit_kind"
LAYER_ATTR = "attnkit_layer"


def kind_of(module) -> str | None:
    """The kind of an encoder–decoder's attention module (None: a model of one stack, or not instrumented)."""
    return getattr(module, KIND_ATTR, None)


def layer_of(module) -> int | None:
    """attnkit's number of the layer of an attention module (None before attnkit.models.instrument numbers
    DistilBERT's)."""
    layer = getattr(module, LAYER_ATTR, None)
    return getattr(module, "layer_idx", None) if layer is None else layer


def side_of(batch, module):
    """The part of attnkit's batch (attnkit.attention.runtime.BatchInfo) whose tokens are the queries of `module`:
    an encoder–decoder's decoder and cross-attention layers read the target (`batch.target`), every other layer the
    batch itself. None: no attnkit batch."""
    if batch is None or kind_of(module) not in (DECODER, CROSS):
        return batch
    if batch.target is None:
        raise AttnkitError("an encoder–decoder measures (source, target) pairs: attnkit's batch has no target (the "
                           "decoder's lengths and token classes, attnkit.tokens.Batch.target)")
    return batch.target
