"""Reading one call of the attention function: what transformers passed (q, k, v, the mask, scaling, dropout, its
keyword arguments) read once into a frozen `AttentionCall` that every later step takes: the batch's layout (lengths,
left padding moved to the front), the op's decoder arguments, a pruned layer's kept heads, whether maps are asked
for, whether it is a KV-cache step.

What it reads is self-attention over one sequence. What each token is (`tokens`) comes from a reader of its own
(attnkit/attention/positions.py): a text's tokens, or a vision transformer's [CLS], extra tokens and patches with
their 2-D positions on the image's grid, which the plan hands to the op as they are (no branch of the steps after
it). Other inputs (queries and keys from two sequences in cross-attention) are other readers that give an
AttentionCall, not branches of the steps after it: cross-attention's is attnkit/attention/cross.py. Both read T5's
additive `position_bias` (`read_bias`).

Decoder language models (docs/decoders.md): what transformers passes decides the op's decoder arguments
(`decoder_arguments`: the module's `is_causal`, K/V with fewer heads than Q, the `sliding_window`, `softcap` and
`s_aux` arguments); an argument attnkit does not know is refused by name. A `sliding_window` in bidirectional
attention (ModernBERT's local layers) is the op's bidirectional window (`symmetric_window`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..arch.pruning import KV_HEAD_ATTR, kept_heads, to_kept, to_unpruned
from ..errors import AttnkitError
from .context import BatchInfo, Forward
from .kinds import KIND_ATTR, layer_of, side_of
from .layout import padding_of, rolled, unshift
from .positions import TEXT, read_tokens
from .runtime import RUNTIME_ATTR, Runtime, note_caller, recording
from .shared import check_not_shared


@dataclass(frozen=True)
class AttentionCall:
    """One call of the attention function, read (`read_call`). `query`, `key`, `value` are as the op takes them:
    in the autocast dtype, a left-padded batch's tokens moved to the front (`offsets`, None without left padding);
    `lengths` the tokens per sample; `forward` the context of the forward the call belongs to (its inputs, the
    intervention and sentence ids given: attnkit/attention/context.py); `info` the batch of attnkit's own forwards
    (None in a plain forward); `kept` a pruned layer's heads (attnkit/arch/pruning.py); `dec` the op's decoder
    arguments ({} for an encoder); `bias` an additive bias B×H×L×Lk in the op's frame (T5's position_bias; None:
    none); `tokens` what each token is (attnkit/attention/positions.py)."""

    module: object
    rt: Runtime | None
    forward: Forward
    query: torch.Tensor  # B×H×L×D
    key: torch.Tensor  # B×Hkv×Lk×D
    value: torch.Tensor  # B×Hkv×Lk×D
    attention_mask: torch.Tensor | None
    scaling: float | None
    dropout: float
    want_maps: bool
    kept: tuple | None
    dec: dict
    info: BatchInfo | None
    lengths: torch.Tensor
    offsets: torch.Tensor | None
    bias: torch.Tensor | None = None
    # what each token is in a forward without attnkit's batch: classes and, for an image, grid positions
    # (attnkit/attention/positions.py: `token_class(B, L, device)`, `grid(B, L, device)`, None for a text)
    tokens: object = TEXT

    @property
    def layer(self):
        """The module's layer number among attnkit's layers (attnkit/attention/kinds.py; None before
        attnkit.models.instrument numbers DistilBERT's)."""
        return layer_of(self.module)

    @property
    def cross(self) -> bool:
        """Cross-attention (attnkit/attention/cross.py): queries and keys from two sequences."""
        return False

    def sample_args(self, rows: slice, key_class: torch.Tensor | None = None) -> dict:
        """The op's per-sample arguments besides lengths, token classes and sentence ids, for samples `rows`: the
        bias (and cross-attention's key lengths and key classes)."""
        return {} if self.bias is None else {"bias": self.bias[rows]}

    def key_classes(self, want: bool) -> torch.Tensor | None:
        """Cross-attention's key token classes (None: the keys are the queries' own tokens)."""
        return None

    @property
    def B(self) -> int:
        return self.query.shape[0]

    @property
    def H(self) -> int:
        return self.query.shape[1]

    @property
    def L(self) -> int:
        return self.query.shape[2]

    @property
    def D(self) -> int:
        return self.query.shape[3]

    @property
    def Hkv(self) -> int:
        return self.key.shape[1]

    @property
    def Lk(self) -> int:
        return self.key.shape[2]

    @property
    def decode(self) -> bool:
        """A step of generation with a KV cache: the L queries are the last L of the Lk keys
        (attnkit/reference.py, "Fewer queries than keys")."""
        return self.Lk > self.L

    @property
    def scale(self) -> float:
        return self.D**-0.5 if self.scaling is None else self.scaling

    @property
    def device(self):
        return self.query.device

    def own_frame(self, t: torch.Tensor, dims, row_dim: int) -> torch.Tensor:
        """A result computed with the tokens at the front put back in the batch's own positions along `dims`; rows
        of left padding 0. A KV-cache step's rows were not moved: only its keys go back."""
        if self.offsets is None:
            return t
        if self.decode:
            return unshift(t, self.offsets, [d for d in dims if d != row_dim], row_dim, first_row=self.Lk - self.L)
        return unshift(t, self.offsets, dims, row_dim)

    @property
    def grouped_by_length(self) -> bool:
        """A left-padded KV-cache step: its samples go to the op in groups of one length (`length_groups`)."""
        return self.decode and self.offsets is not None

    def length_groups(self, rows: slice) -> list:
        """A left-padded KV-cache step, its keys moved to the front: sample b's queries are the last of its own
        n_b keys, so the samples of one length n go to the op together, with their first n keys and their last
        min(L, n) queries (the rows before are padding). [(positions in `rows`, sample indices, n, rows taken)]."""
        ns = self.lengths[rows].tolist()
        first = range(self.B)[rows].start
        groups = []
        for n in sorted(set(ns)):
            where = [i for i, m in enumerate(ns) if m == n]
            groups.append((where, torch.tensor([first + i for i in where], device=self.device), n, min(self.L, n)))
        return groups

    @functools.cached_property
    def observed(self) -> tuple:
        """(q, k, decoder arguments) as observers of q and k see them (`observed`)."""
        return observed(self.query, self.key, self.kept, self.dec)


def read_call(module, query, key, value, attention_mask, scaling, dropout, kwargs: dict) -> AttentionCall:
    """Read a call of the attention function (module docstring) into an AttentionCall."""
    key, value = filled(attention_mask, query.shape[2], key, value)
    B, H, L, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if Lk < L:
        raise AttnkitError(
            f"attnkit attention computes self-attention over one sequence here, but got {L} queries and {Lk} keys: "
            "attnkit measures cross-attention in the encoder–decoders attnkit.instrument marks (docs/seq2seq.md)")
    if torch.is_autocast_enabled(query.device.type):  # mixed precision: attention in the autocast dtype, as eager's
        # matmuls run under autocast (q and k may arrive in fp32 from the rotary embedding, v in the autocast dtype)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    rt: Runtime | None = getattr(module, RUNTIME_ATTR, None)
    if rt is None and not recording():  # loaded with attn_implementation="attnkit", not instrumented (yet)
        check_not_shared(module)
        check_kind_known(module)
    forward = Forward() if rt is None else rt.context()
    # model(..., output_attentions=True): return the maps (transformers passes the flag on, except GPT-2's module)
    want_maps = bool(kwargs.get("output_attentions")) or forward.output_attentions
    kept = kept_heads(module)  # a pruned layer: its heads in the unpruned numbering (attnkit/arch/pruning.py)
    dec = decoder_arguments(module, H, Hkv, kwargs, kept, query.device)
    note_caller(module, "sink" in dec)
    info, lengths, offsets = read_layout(forward.batch, attention_mask, B, L, Lk, query.device, module)
    if offsets is not None and Lk > L:
        # left padding in generation: the keys' tokens to the front; the queries are already each sample's last
        # tokens, where every sample's tokens must end
        if not bool(((offsets + lengths) == Lk).all()):
            raise AttnkitError("a KV-cache step needs each sample's tokens to end at the last key (left padding, as "
                               "generate pads decoders); this attention mask has padding after a sample's tokens")
        key, value = (rolled(t, offsets, 2) for t in (key, value))
    elif offsets is not None:  # left padding: each sample's tokens to the front, computed there, put back after
        query, key, value = (rolled(t, offsets, 2) for t in (query, key, value))
    if kwargs.get("position_bias") is not None and offsets is not None and Lk > L:
        raise AttnkitError("a left-padded KV-cache step with an additive position bias (T5) is not supported: "
                           "generate without left padding in the decoder")
    bias = read_bias(kwargs.get("position_bias"), B, offsets, offsets, Lk)
    return AttentionCall(module, rt, forward, query, key, value, attention_mask, scaling, dropout, want_maps, kept,
                         dec, info, lengths, offsets, bias, read_tokens(rt, forward))


def check_kind_known(module) -> None:
    """An encoder–decoder's module that attnkit.models.instrument has not marked with its kind: a call of its
    cross-attention cannot be told from a KV-cache step, so the model must be instrumented first."""
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False) and KIND_ATTR not in vars(module):
        raise AttnkitError(f"{type(module).__name__} belongs to an encoder–decoder loaded with "
                           "attn_implementation=\"attnkit\" but not instrumented: call attnkit.instrument(model) "
                           "first, which tells its encoder, decoder and cross-attention layers apart")


def read_bias(bias, B: int, row_offsets, key_offsets, Lk: int | None = None) -> torch.Tensor | None:
    """T5's `position_bias` ((1 or B)×H×L×Lk, added to the scores) as the op takes it: B×H×L×Lk (a view), rows and
    keys moved as the queries and keys were (left padding to the front); None when none is given, or when it is all
    zeros (T5's layers without a relative bias, cross-attention among them, pass zeros: the op runs them as plain
    attention)."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.dim() != 4:
        raise AttnkitError(f"position_bias must be a 4-D floating-point tensor, got "
                           f"{getattr(bias, 'shape', type(bias).__name__)}")
    if not bias.requires_grad and not torch.compiler.is_compiling() and not bool(bias.any()):
        return None
    if Lk is not None:  # a static cache's keys cut to the filled ones (`filled`): the bias's columns too
        bias = bias[..., :Lk]
    bias = bias.expand(B, *bias.shape[1:])
    if row_offsets is not None:
        bias = rolled(bias, row_offsets, 2)
    if key_offsets is not None:
        bias = rolled(bias, key_offsets, 3)
    return bias


def filled(attention_mask, L: int, key, value) -> tuple:
    """The keys and values of the sequence's tokens. A static cache (`generate(..., cache_implementation="static")`)
    hands over all its slots, those after the tokens not filled yet, and transformers' mask function the 2-D mask of
    the filled ones, shorter than the keys (as for flash attention; `padding_mask`): the keys are those it covers."""
    n = attention_mask.shape[-1] if attention_mask is not None and attention_mask.dim() == 2 else None
    if n is None or not L <= n < key.shape[2]:
        return key, value
    return key[:, :, :n], value[:, :, :n]


def read_layout(batch: BatchInfo | None, attention_mask, B: int, L: int, Lk: int, device, module=None) -> tuple:
    """(attnkit's batch or None, lengths, offsets of left padding or None): attnkit's own batches (`batch`, the
    forward's) are right-padded and whole sequences (an encoder–decoder's decoder layers read its target:
    `side_of`); a plain forward's layout comes from its 2-D mask (`padding_of`)."""
    if batch is None:
        return (None, *padding_of(attention_mask, B, Lk, device))
    if Lk > L:
        raise AttnkitError(f"attnkit's own batches run whole sequences, but this forward has {L} queries and "
                           f"{Lk} keys (a KV cache): run them without past_key_values")
    batch = side_of(batch, module)
    lengths = batch.lengths
    if lengths.shape[0] != B:
        raise AttnkitError(f"runtime batch has {lengths.shape[0]} samples but the model got {B}")
    return batch, lengths, None


# The keyword arguments transformers passes to an attention function besides `scaling` and `dropout`: those attnkit
# reads, and those that do not change what attention computes (positions are already in q and k; caches, router
# logits, the loss's token count and return flags are the model's business; DistilBERT hands the model's inputs on
# to its attention function, so `token_type_ids` the tokenizer made arrive there, where no attention implementation
# reads them: segments reach attnkit through the recorded inputs, `Forward.inputs`; ModernBERT passes
# `deterministic`, flash-attn's choice of a deterministic backward for its dropout, which changes no weight and no
# output: transformers' eager and sdpa functions ignore it too). Any other argument that has a value is refused by
# name: it might change attention, and attnkit would silently ignore it.
READ_KWARGS = frozenset({"output_attentions", "is_causal", "sliding_window", "softcap", "s_aux", "position_bias"})
HARMLESS_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_router_logits",
                             "output_hidden_states", "return_dict", "past_key_values", "position_embeddings",
                             "token_type_ids", "num_items_in_batch", "deterministic"})


def decoder_arguments(module, H: int, Hkv: int, kwargs: dict, kept, device) -> dict:
    """The op's decoder arguments (docs/decoders.md, "What attnkit reads from transformers") for one call of the
    attention function: `causal` from the module's `is_causal` (or an `is_causal` argument), `sliding_window`
    and `softcap` from the arguments of the same names (a window in bidirectional attention with
    `symmetric_window`: ModernBERT's local layers, |s − t| < W), `sink` from gpt-oss's `s_aux`, `kv_head` where the
    module names one (KV_HEAD_ATTR). Only what differs from the op's defaults is returned: an encoder gets {}. An
    argument attnkit does not know is refused by name (READ_KWARGS, HARMLESS_KWARGS)."""
    unknown = sorted(k for k, v in kwargs.items() if k not in READ_KWARGS and k not in HARMLESS_KWARGS
                     and v is not None)
    name = type(module).__name__
    if unknown:
        raise AttnkitError(f"{name} passes {unknown[0]!r} to its attention function, which attnkit does not know: it "
                           "may change what attention computes, so attnkit refuses it rather than ignore it")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False)) if causal is None else bool(causal)
    out: dict = {"causal": True} if causal else {}
    window = kwargs.get("sliding_window")
    if window is not None:
        # transformers' flash convention, which ModernBERT follows: W = its mask's inclusive half-width + 1, so the
        # bidirectional mask |q_idx − kv_idx| ≤ W − 1 is the op's |s − t| < W
        out["sliding_window"] = int(window)
        if not causal:
            out["symmetric_window"] = True
    if kwargs.get("softcap") is not None:
        out["softcap"] = float(kwargs["softcap"])
    sink = kwargs.get("s_aux")
    if sink is not None:
        # not detached: a model in training learns its sink logits through the op's backward (attnkit.ops)
        sink = sink.to(device, torch.float32)
        # pruning keeps the sink logits of the heads kept; a layer that names them for the unpruned heads gets those
        out["sink"] = sink if kept is None or sink.shape[0] == H else to_kept(sink, kept)
    kv_head = getattr(module, KV_HEAD_ATTR, None)
    if kv_head is not None:
        out["kv_head"] = kv_head.to(device, torch.int32)
    elif Hkv != H and (Hkv == 0 or H % Hkv):
        raise AttnkitError(f"{name} has {H} query heads and {Hkv} KV heads, which do not form even groups, and "
                           f"names no KV head of each query head ({KV_HEAD_ATTR})")
    return out


def kv_index(H: int, Hkv: int, dec: dict, device) -> torch.Tensor | None:
    """The KV head of each query head (int64 H), or None when there is one KV head per query head."""
    if "kv_head" in dec:
        return dec["kv_head"].long()
    if Hkv == H:
        return None
    return torch.arange(H, device=device) // (H // Hkv)


def observed(query, key, kept, dec: dict) -> tuple:
    """(q, k, decoder arguments) as observers see them: the unpruned heads, a removed head with q = 0 (and, where
    K/V have a head per query head, k = 0). Where the layer's query heads read shared KV heads, k keeps its KV heads
    and `kv_head` maps every unpruned query head (a removed one to KV head 0). An encoder's observers get no
    decoder arguments (dec is {}), so observers written for encoders keep working."""
    if kept is None:
        return query, key, dec
    q = to_unpruned(query, kept)
    H, Hkv = query.shape[1], key.shape[1]
    if Hkv == H and "kv_head" not in dec:
        return q, to_unpruned(key, kept), dec
    index = kv_index(H, Hkv, dec, query.device)
    full = torch.zeros(kept[1], dtype=torch.int32, device=query.device)
    full[list(kept[0])] = (torch.arange(H, device=query.device) if index is None else index).to(torch.int32)
    dec = dict(dec, kv_head=full)
    if "sink" in dec:
        dec["sink"] = to_unpruned(dec["sink"][None], kept)[0]
    return q, key, dec


def per_query_head(value: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """B × Hkv × L × D values as B × H × L × D, each query head with its KV head's (a copy; only for what needs
    them per query head: norm weighting, and the maps path of training)."""
    return value if index is None else value.index_select(1, index)
