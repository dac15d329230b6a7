"""Reading a call of cross-attention (docs/seq2seq.md): an encoder–decoder's decoder queries over the encoder's keys
and values, a reader of the call beside attnkit/attention/call.py that gives an AttentionCall (a
`CrossAttentionCall`), so the steps after it (plan, op, deliver, consumers) take it as they take self-attention.

Which modules are cross-attention: attnkit.models.instrument marks them (attnkit/attention/kinds.py) from what
transformers hands their forward in the probe: encoder states as `key_value_states` (BART, Marian, Whisper, T5).

The layout of its two sequences:
- the keys: the encoder's 2-D padding mask, which transformers passes to cross-attention (None: every key valid);
  left padding is moved to the front as for self-attention;
- the queries: in attnkit's own batches the target's lengths and token classes (`attnkit.tokens.Batch.target`);
  in a plain forward the `decoder_attention_mask` the forward was given (recorded by attnkit.models' hooks) when it
  covers the queries, else every query row is a token (a step of generation: its new tokens).
The op's definition of cross-attention (attnkit/reference.py, "Cross-attention"): no causal mask, a row's features
over the keys of the other sequence, sentences and regions refused by name."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arch.pruning import kept_heads
from ..errors import AttnkitError
from .call import AttentionCall, decoder_arguments, read_bias
from .context import BatchInfo, Forward
from .kinds import layer_of, side_of
from .layout import first_token_classes, padding_of, rolled, unshift
from .positions import TEXT
from .runtime import RUNTIME_ATTR, Runtime, note_caller


@dataclass(frozen=True)
class CrossAttentionCall(AttentionCall):
    """A call of cross-attention, read (`read_cross_call`): `query` B×H×Lq×D (the target; `lengths`, `offsets` and
    `info` its layout and attnkit's batch of it), `key` and `value` B×Hkv×Lk×D (the source: `key_lengths`,
    `key_offsets`, `key_info`)."""

    key_lengths: torch.Tensor | None = None
    key_offsets: torch.Tensor | None = None
    key_info: BatchInfo | None = None

    @property
    def cross(self) -> bool:
        return True

    @property
    def decode(self) -> bool:
        """Never a KV-cache step of self-attention: the keys are the other sequence's."""
        return False

    @property
    def grouped_by_length(self) -> bool:
        return False

    def own_frame(self, t: torch.Tensor, dims, row_dim: int) -> torch.Tensor:
        """A result computed with each sequence's tokens at the front put back in the batch's own positions: the
        query rows (`row_dim`, rows of left padding 0) by the target's offsets, the other `dims` (keys) by the
        source's."""
        if self.key_offsets is not None:
            for d in dims:
                if d != row_dim:
                    t = rolled(t, self.key_offsets, d, back=True)
        if self.offsets is not None:
            t = unshift(t, self.offsets, [row_dim], row_dim)
        return t

    def sample_args(self, rows: slice, key_class: torch.Tensor | None = None) -> dict:
        out = super().sample_args(rows)
        out["key_lengths"] = self.key_lengths[rows]
        if key_class is not None:
            out["key_class"] = key_class[rows]
        return out

    def key_classes(self, want: bool) -> torch.Tensor | None:
        """The source's token classes: attnkit's batch's, else (features wanted) the first token CLS."""
        if self.key_info is not None:
            return self.key_info.token_class
        return first_token_classes(self.B, self.Lk, self.device) if want else None


def read_cross_call(module, query, key, value, attention_mask, scaling, dropout, kwargs: dict) -> CrossAttentionCall:
    """Read a call of cross-attention (module docstring) into a CrossAttentionCall."""
    B, H, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if torch.is_autocast_enabled(query.device.type):  # as attnkit.attention.call.read_call
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    rt: Runtime | None = getattr(module, RUNTIME_ATTR, None)
    forward = Forward() if rt is None else rt.context()
    want_maps = bool(kwargs.get("output_attentions")) or forward.output_attentions
    kept = kept_heads(module)
    dec = decoder_arguments(module, H, Hkv, kwargs, kept, query.device)
    if dec.get("causal") or "sliding_window" in dec:
        raise AttnkitError(f"{type(module).__name__} (cross-attention, layer {layer_of(module)}) asks for a causal "
                           "mask or a sliding window: attnkit's cross-attention rows see every key of the source")
    note_caller(module, "sink" in dec)
    batch = forward.batch
    if batch is not None:  # attnkit's own batch: right-padded, whole sequences
        info, key_info = side_of(batch, module), batch
        lengths, offsets, key_lengths, key_offsets = info.lengths, None, key_info.lengths, None
        if lengths.shape[0] != B or key_lengths.shape[0] != B:
            raise AttnkitError(f"runtime batch has {key_lengths.shape[0]} samples but the model got {B}")
    else:
        info = key_info = None
        key_lengths, key_offsets = padding_of(attention_mask, B, Lk, query.device)
        lengths, offsets = query_layout(forward, B, Lq, query.device)
    if offsets is not None:
        query = rolled(query, offsets, 2)
    if key_offsets is not None:
        key, value = (rolled(t, key_offsets, 2) for t in (key, value))
    bias = read_bias(kwargs.get("position_bias"), B, offsets, key_offsets)
    # the queries are a text's (a decoder's target: the first token CLS), never an image's: a grid is refused with
    # cross-attention (attnkit/reference.py)
    return CrossAttentionCall(module, rt, forward, query, key, value, attention_mask, scaling, dropout, want_maps, kept,
                              dec, info, lengths, offsets, bias, TEXT, key_lengths, key_offsets, key_info)


def query_layout(forward: Forward, B: int, Lq: int, device) -> tuple:
    """(lengths, offsets or None) of the queries of a plain forward: from the `decoder_attention_mask` it was given
    when that covers the Lq queries, else every row a token (no mask, or a step of generation)."""
    mask = None if forward.inputs is None else forward.inputs.decoder_mask
    if mask is None or tuple(mask.shape) != (B, Lq):
        return torch.full((B,), Lq, dtype=torch.int64, device=device), None
    return padding_of(mask.to(device), B, Lq, device)
