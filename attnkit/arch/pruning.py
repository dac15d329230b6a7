"""Physical head pruning (Michel et al. 2019; docs/pruning.md): heads removed from W_Q, W_K, W_V and W_O.

`prune_heads(model, [(layer, head), ...])` removes the named heads in place: their rows of the query, key and
value projections (weights and biases) and their columns of the output projection. A layer may keep any number
of heads. A layer with none left keeps its residual path only: its attention module returns a zero-width output,
so the output projection adds just its bias (what a layer whose every head is zeroed gives), and it still calls
the attention interface with empty q, k, v, so attnkit sees every layer.

Heads keep the numbering of the unpruned model: each attention module carries the heads it kept (original
indices, `kept_heads`), and the config records them per layer (`attnkit_heads`, with `attnkit_head_counts`);
`config.num_attention_heads` stays the unpruned count. attnkit's measurements of a pruned model therefore use the
unpruned layers × heads grid (attnkit/hf_attention.py).

Grouped-query decoders (Llama, Qwen2/3, Mistral, Gemma 2/3, gpt-oss): query head h reads KV head h // g (g = H /
Hkv of the unpruned config). A query head goes from q_proj (rows) and o_proj (columns); a KV head goes from k_proj
and v_proj (rows) when the last query head that reads it goes. Where the heads left share their KV heads in even
groups, the module's `num_key_value_groups` says so and nothing else changes. Where they do not (uneven groups),
the module names the KV head of each query head it kept (KV_HEAD_ATTR, read by attnkit attention, which never
repeats K/V), and its k_proj and v_proj are `GroupedKV` projections: under any other attention implementation
(eager, sdpa) they hand each query head its KV head's keys and values (`num_key_value_groups` 1), so the module
computes the same in plain transformers. gpt-oss's per-head sink logits (`sinks`) keep the entries of the heads kept.

Encoder–decoders (BART, Marian, T5; docs/seq2seq.md) prune heads of each kind, numbered as attnkit numbers their
layers (encoder, decoder self-attention, cross-attention; `attnkit.arch.architectures.seq2seq_order`), and the config
records the heads of every one of those layers. A headless layer's keys are the source's in cross-attention, and
its decoder self-attention still grows the KV cache (by a head of zeros: later steps of generation count their positions
from it). T5 builds one position bias for all heads of a stack (in its first layer) and hands it on from layer to
layer: a pruned T5 layer passes on the whole bias and attends with its kept heads' part (`_t5_forward_kept`).

transformers cannot load such a model by itself (each layer of its classes has `num_attention_heads` heads):
`load_pruned_model(path)` builds the unpruned structure from the config, removes the heads the config names and
loads the weights; `attnkit.load_model(path)` uses it for a pruned directory.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import re
import types
import warnings
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from ..attention.kinds import seq2seq_layer_kinds
from ..errors import AttnkitError
from .architectures import LAYOUTS, T5, AttentionLayer, attention_layers

log = logging.getLogger("attnkit")

KEPT_ATTR = "_attnkit_kept_heads"  # on an attention module: (kept heads in the unpruned numbering, unpruned count)
OWN_OUTPUT_ATTR = "_attnkit_own_output"  # on a headless attention module that holds its output projection
CONFIG_HEADS = "attnkit_heads"  # config: per layer, the heads kept (unpruned numbering)
CONFIG_COUNTS = "attnkit_head_counts"  # config: per layer, how many
# On an attention module: the KV head (a position in its k_proj/v_proj) of each query head it has (int32), where its
# query heads do not share the KV heads in even groups (a grouped-query layer that lost heads); without it, query
# head h reads KV head h // (H / Hkv). attnkit attention passes it to the op as `kv_head`.
KV_HEAD_ATTR = "_attnkit_kv_head"


def kept_heads(module) -> tuple[tuple[int, ...], int] | None:
    """(heads kept, in the unpruned numbering; the unpruned head count) of an attention module that
    `prune_heads` changed; None for one it did not."""
    return getattr(module, KEPT_ATTR, None)


def to_kept(t: torch.Tensor | None, kept: tuple[tuple[int, ...], int]) -> torch.Tensor | None:
    """The entries of the kept heads of a per-head tensor of the unpruned layer (heads on its first axis: the
    modes, regions and gates of an intervention); None stays None."""
    if t is None:
        return None
    return t[torch.tensor(kept[0], dtype=torch.long, device=t.device)]


def to_unpruned(t: torch.Tensor, kept: tuple[tuple[int, ...], int], fill: float = 0.0) -> torch.Tensor:
    """A B × h × … tensor of the kept heads (features, q, k, outputs) spread over the unpruned heads (B × H × …):
    `fill` in the places of the removed heads (features: NaN, a head that has no attention has no features;
    outputs, q and k: 0)."""
    heads, H = kept
    out = t.new_full((t.shape[0], H, *t.shape[2:]), fill)
    out[:, list(heads)] = t
    return out


def _n_heads(model) -> int:
    return int(model.config.num_attention_heads)


def n_attnkit_layers(config) -> int:
    """How many of attnkit's layers a model of `config` has: an encoder–decoder's encoder, decoder and cross
    layers (docs/seq2seq.md §2; its `num_hidden_layers` counts one stack), any other model's hidden layers."""
    kinds = seq2seq_layer_kinds(config)
    return len(kinds) if kinds is not None else int(config.num_hidden_layers)


def kv_group_size(config) -> int:
    """How many query heads of the unpruned model read each KV head (1 without grouped-query attention)."""
    H = int(config.num_attention_heads)
    Hkv = getattr(config, "num_key_value_heads", None) or H
    return H // int(Hkv)


class GroupedKV(nn.Linear):
    """The key or value projection of a grouped-query layer whose query heads no longer share KV heads in even
    groups (module docstring). Its weight and bias are the rows of the KV heads kept (saved as an nn.Linear's).
    Under attnkit attention it returns them as they are (the op maps each query head to its KV head); under any
    other implementation it returns one KV head per query head (`index`: the KV head of each), as eager and sdpa
    attention with `num_key_value_groups` 1 expect."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.config._attn_implementation == "attnkit":
            return out
        D = self.head_size
        heads = out.unflatten(-1, (-1, D)).index_select(-2, self.index)
        return heads.flatten(-2)


def _grouped_kv(lin: nn.Linear, index: torch.Tensor, head_size: int, config) -> GroupedKV:
    new = GroupedKV.__new__(GroupedKV)
    nn.Module.__init__(new)
    new.in_features, new.out_features = lin.in_features, lin.out_features
    new.weight = lin.weight
    new.register_parameter("bias", lin.bias)
    new.register_buffer("index", index.to(lin.weight.device), persistent=False)
    new.head_size, new.config = head_size, config
    return new


def _skip_init_linear(in_features: int, out_features: int, like: nn.Linear) -> nn.Linear:
    """An nn.Linear of the given size on `like`'s device and dtype, its parameters left uninitialised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Initializing zero-element tensors is a no-op"
        lin = torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=like.bias is not None,
                                       device=like.weight.device, dtype=like.weight.dtype)
    lin.weight.requires_grad_(like.weight.requires_grad)
    return lin


def _rows(lin: nn.Linear, idx: torch.Tensor) -> nn.Linear:
    new = _skip_init_linear(lin.in_features, len(idx), lin)
    with torch.no_grad():
        new.weight.copy_(lin.weight[idx.to(lin.weight.device)])
        if lin.bias is not None:
            new.bias.copy_(lin.bias[idx.to(lin.bias.device)])
    return new


def _columns(lin: nn.Linear, idx: torch.Tensor) -> nn.Linear:
    new = _skip_init_linear(len(idx), lin.out_features, lin)
    with torch.no_grad():
        new.weight.copy_(lin.weight[:, idx.to(lin.weight.device)])
        if lin.bias is not None:
            new.bias.copy_(lin.bias)
    return new


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention of zero heads (what eager attention gives for them): an empty B × L × 0 × D output."""
    B, _, L, D = query.shape
    return query.new_zeros(B, L, 0, D), None


def _forward_without_heads(self, hidden_states, attention_mask=None, *args, **kwargs):
    """The forward of an attention module with no head left: a B × L × 0 output (through the module's own output
    projection where it holds one: its bias). The attention interface is still called, with empty q, k, v."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    B, L = hidden_states.shape[:2]
    D = getattr(self, "attention_head_size", None) or self.head_dim
    empty = hidden_states.new_zeros(B, 0, L, D)
    for name in ("past_key_values", "cache", "position_embeddings"):  # rotary positions: nothing to rotate
        kwargs.pop(name, None)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, _no_attention)
    scaling = getattr(self, "scaling", None) or getattr(self, "scale", None)  # CLIP's and SigLIP's: `scale`
    out, weights = fn(self, empty, empty, empty, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
    out = out.reshape(B, L, 0)
    own = getattr(self, OWN_OUTPUT_ATTR, None)
    if own is not None:
        out = getattr(self, own)(out)
    return out, weights


def _seq2seq_arguments(module, args, kwargs) -> dict:
    """The arguments of a call of an encoder–decoder's attention module by name (BART's and T5's forwards order
    them differently), its other keyword arguments under "kwargs"."""
    a = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
    a.pop("self", None)
    a["kwargs"] = dict(a.get("kwargs", {}))
    return a


def _t5_position_bias(module, hidden_states, key_value_states, position_bias, cache) -> torch.Tensor:
    """The position bias of all the unpruned heads that T5's attention module computes when it is handed none (the
    first layer of a stack; what it then hands on): a relative bias from its `relative_attention_bias` (kept whole),
    else zeros, over the queries' and the keys' lengths (a dynamic KV cache's past tokens before the queries)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    if position_bias is not None:
        return position_bias
    L = hidden_states.shape[1]
    own = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    if key_value_states is None and own is not None and not isinstance(own, DynamicCache):
        raise AttnkitError(f"a pruned T5 generates with a dynamic KV cache (generate's default), not a "
                           f"{type(own).__name__}")
    past = own.get_seq_length(module.layer_idx) if own is not None and key_value_states is None else 0
    Lk = key_value_states.shape[1] if key_value_states is not None else past + L
    if not module.has_relative_attention_bias:
        return hidden_states.new_zeros(1, module.n_heads, L, Lk)
    return module.compute_bias(L, Lk, device=hidden_states.device, past_seen_tokens=past)


def _t5_forward_kept(self, *args, **kwargs):
    """The forward of a pruned T5 attention module that kept heads: T5's own, given its kept heads' part of the
    position bias; it returns the bias of all heads for the layers after it (module docstring)."""
    a = _seq2seq_arguments(self, args, kwargs)
    full = _t5_position_bias(self, a["hidden_states"], a.get("key_value_states"), a.get("position_bias"),
                             a.get("cache"))
    a["position_bias"] = to_kept(full.transpose(0, 1), kept_heads(self)).transpose(0, 1)
    out, _, weights = type(self).forward(self, **a.pop("kwargs"), **a)
    return out, full, weights


def _seq2seq_forward_without_heads(self, *args, **kwargs):
    """The forward of an encoder–decoder's attention module with no head left (BART, Marian, T5): as
    `_forward_without_heads`, the keys of cross-attention the source's, a decoder self-attention's KV cache grown by
    a zero head of the step's keys (a cache's length counts the positions of later steps), and T5's position bias of all
    heads returned for the layers after it."""
    from transformers.cache_utils import EncoderDecoderCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    a = _seq2seq_arguments(self, args, kwargs)
    hidden, source, cache = a["hidden_states"], a.get("key_value_states"), a.get("cache")
    B, L = hidden.shape[:2]
    D = getattr(self, "head_dim", None) or self.key_value_proj_dim
    extra = dict(a["kwargs"])
    t5 = "position_bias" in inspect.signature(type(self).forward).parameters
    if t5:  # before the cache grows: T5 counts the past tokens first
        full = _t5_position_bias(self, hidden, source, a.get("position_bias"), cache)
        extra["position_bias"] = full[:, :0]
    Lk = L if source is None else source.shape[1]
    if source is None and cache is not None:  # one zero head: transformers counts an empty cache layer as no tokens
        own = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        zero = hidden.new_zeros(B, 1, L, D)
        Lk = own.update(zero, zero.clone(), self.layer_idx, kwargs=a["kwargs"])[0].shape[2]
    query, key = hidden.new_zeros(B, 0, L, D), hidden.new_zeros(B, 0, Lk, D)
    mask = a.get("attention_mask", a.get("mask"))
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, _no_attention)
    out, weights = fn(self, query, key, key, mask, dropout=0.0, scaling=self.scaling, **extra)
    out = getattr(self, getattr(self, OWN_OUTPUT_ATTR))(out.reshape(B, L, 0))
    return (out, full, weights) if t5 else (out, weights)


def _head_rows(positions: list[int], D: int) -> torch.Tensor:
    return torch.tensor([p * D + d for p in positions for d in range(D)], dtype=torch.long)


def _keep_heads(layer: AttentionLayer, current: list[int], kept: list[int], group: int, config) -> None:
    """Keep only the query heads `kept` (unpruned numbering) of the layer's `current` heads, and the KV heads they
    read (query head h reads KV head h // `group` of the unpruned model), in the projections of `layer`."""
    D = layer.head_size
    idx = _head_rows([current.index(h) for h in kept], D)
    kv_now = sorted({h // group for h in current})
    kv_kept = sorted({h // group for h in kept})
    kv_idx = _head_rows([kv_now.index(g) for g in kv_kept], D) if group > 1 else idx
    mod = layer.module
    layer.replace("query", _rows(layer.query, idx))
    for name in ("key", "value"):
        layer.replace(name, _rows(layer.linear(name), kv_idx))
    layer.replace("output", _columns(layer.output, idx))
    if layer.layout.heads_attr is not None:
        setattr(mod, layer.layout.heads_attr, len(kept))
    if layer.layout.size_attr is not None:
        setattr(mod, layer.layout.size_attr, len(kept) * D)
    sinks = getattr(mod, "sinks", None)  # gpt-oss: a learned sink logit per query head
    if isinstance(sinks, nn.Parameter):
        with torch.no_grad():
            mod.sinks = nn.Parameter(sinks[[current.index(h) for h in kept]].clone(),
                                     requires_grad=sinks.requires_grad)
    if group == 1:
        return
    if hasattr(mod, KV_HEAD_ATTR):
        delattr(mod, KV_HEAD_ATTR)
    sizes = {sum(1 for h in kept if h // group == g) for g in kv_kept}
    if len(sizes) <= 1:  # even groups (or no head left): query head i reads KV head i // size
        mod.num_key_value_groups = sizes.pop() if sizes else 1
        return
    kv_head = torch.tensor([kv_kept.index(h // group) for h in kept], dtype=torch.int32)
    setattr(mod, KV_HEAD_ATTR, kv_head)
    mod.num_key_value_groups = 1  # eager and sdpa get one KV head per query head from GroupedKV
    for name in ("key", "value"):
        layer.replace(name, _grouped_kv(layer.linear(name), kv_head.long(), D, config))


def current_heads(layers: list[AttentionLayer], n_heads: int) -> list[list[int]]:
    """The heads each layer has now, in the unpruned numbering."""
    out = []
    for layer in layers:
        kept = kept_heads(layer.module)
        out.append(list(kept[0]) if kept is not None else list(range(n_heads)))
    return out


def prune_heads(model, heads: Iterable[tuple[int, int]]):
    """Remove `heads` ((layer, head) pairs in the unpruned numbering) from `model`, in place; returns the model.

    A head outside the model's layers × heads, or one it no longer has, is refused (AttnkitError) before anything
    changes. The config records what each layer kept (module docstring)."""
    layers = attention_layers(model, "pruning heads")
    seq2seq = seq2seq_layer_kinds(model.config) is not None
    if seq2seq:
        _check_one_head_count(model.config)
    if not layers[0].layout.prunable:
        raise AttnkitError(f"pruning heads of a {model.config.model_type!r} model is not supported: attnkit prunes "
                           f"separate query, key and value projections "
                           f"({', '.join(sorted(k for k, v in LAYOUTS.items() if v.prunable))}), not fused ones, nor "
                           f"those normalised over all heads together (OLMo 2's q_norm and k_norm)")
    L, H = len(layers), _n_heads(model)
    group = kv_group_size(model.config)
    current = current_heads(layers, H)
    remove: dict[int, set[int]] = {}
    for item in heads:
        try:
            layer, head = (int(x) for x in item)
        except (TypeError, ValueError):
            raise AttnkitError(f"a head to prune must be a (layer, head) pair, got {item!r}") from None
        if not (0 <= layer < L and 0 <= head < H):
            raise AttnkitError(f"head L{layer}H{head} is outside this model's {L} layers × {H} heads")
        if head not in current[layer]:
            raise AttnkitError(f"head L{layer}H{head} was already pruned from this model")
        remove.setdefault(layer, set()).add(head)
    for layer, gone in sorted(remove.items()):
        kept = [h for h in current[layer] if h not in gone]
        _keep_heads(layers[layer], current[layer], kept, group, model.config)
        mod = layers[layer].module
        setattr(mod, KEPT_ATTR, (tuple(kept), H))
        if not kept:
            if not layers[layer].layout.output_beside:
                setattr(mod, OWN_OUTPUT_ATTR, layers[layer].layout.output)
            headless = _seq2seq_forward_without_heads if seq2seq else _forward_without_heads
            mod.forward = types.MethodType(headless, mod)
        elif layers[layer].layout is T5:
            mod.forward = types.MethodType(_t5_forward_kept, mod)
        current[layer] = kept
    setattr(model.config, CONFIG_HEADS, [list(k) for k in current])
    setattr(model.config, CONFIG_COUNTS, [len(k) for k in current])
    return model


def _check_one_head_count(config) -> None:
    """An encoder–decoder's heads are numbered on one layers × heads grid: both stacks need one head count."""
    counts = {getattr(config, name, None) for name in ("encoder_attention_heads", "decoder_attention_heads")} - {None}
    if len(counts) > 1:
        raise AttnkitError(f"pruning heads of a {config.model_type!r} model with {config.encoder_attention_heads} "
                           f"heads in its encoder and {config.decoder_attention_heads} in its decoder is not "
                           "supported: attnkit numbers an encoder–decoder's heads with one head count in every layer")


def heads_in_config(config, where: str = "the config") -> list[list[int]] | None:
    """The heads each layer kept, from a config that `prune_heads` wrote (None: not a pruned model); an
    AttnkitError names a malformed entry."""
    kept = getattr(config, CONFIG_HEADS, None)
    if kept is None:
        return None
    H = int(config.num_attention_heads)
    L = n_attnkit_layers(config)
    if not isinstance(kept, list) or len(kept) != L:
        raise AttnkitError(f"{where}: {CONFIG_HEADS} must list the heads kept by each of the {L} layers")
    for l, heads in enumerate(kept):
        ok = isinstance(heads, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in heads)
        if not ok or any(not 0 <= h < H for h in heads) or heads != sorted(set(heads)):
            raise AttnkitError(f"{where}: {CONFIG_HEADS}[{l}] must be increasing head numbers in [0, {H}), "
                               f"got {heads!r}")
    counts = getattr(config, CONFIG_COUNTS, None)
    if counts is not None and counts != [len(h) for h in kept]:
        raise AttnkitError(f"{where}: {CONFIG_COUNTS} {counts} does not count the heads of {CONFIG_HEADS}")
    return kept


def pruned_head_grid(model_or_config) -> np.ndarray:
    """n_layers × n_heads booleans, True where the head is kept (all True for a model that was not pruned)."""
    config = getattr(model_or_config, "config", model_or_config)
    L, H = n_attnkit_layers(config), int(config.num_attention_heads)
    grid = np.ones((L, H), dtype=bool)
    kept = heads_in_config(config)
    if kept is not None:
        grid[:] = False
        for l, heads in enumerate(kept):
            grid[l, heads] = True
    return grid


def removed_heads(model_or_config) -> list[list[int]]:
    """[[layer, head], ...] of the heads an earlier pruning removed (in the unpruned numbering; [] for a model
    that was not pruned): what RUN/meta.json records as `removed_heads` (docs/files.md)."""
    return [[int(l), int(h)] for l, h in np.argwhere(~pruned_head_grid(model_or_config))]


def _read_weights(path: str) -> dict:
    from safetensors.torch import load_file

    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for name in files:
            state.update(load_file(os.path.join(path, name)))
        return state
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise AttnkitError(f"{path}: no weights (model.safetensors, its index, or pytorch_model.bin)")


def _renamed_as_loaded(model, state: dict) -> dict:
    """The checkpoint's weights under the names `model` gives them: transformers saves some models (ViT, DeiT,
    DINOv2) with their weights' earlier names and renames them when it loads them (its conversion mapping). Weights
    it converts otherwise (split, merged) stay as they are, and `_load_state` refuses them as unexpected."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    own = model.state_dict().keys()
    if all(k in own for k in state):
        return state
    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
    return {apply_renamings(k, renamings): v for k, v in state.items()} if renamings else state


def _load_state(model, state: dict, path: str) -> None:
    """Load a checkpoint into `model` as transformers would: weights renamed as transformers renames them, the base
    model's prefix added or removed as needed, tied weights tied again; a missing or unexpected weight of the
    encoder is refused."""
    state = _renamed_as_loaded(model, state)
    own = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not own.keys() & state.keys():
        if any(k.startswith(prefix + ".") for k in state):  # a task model's checkpoint into its bare encoder
            state = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
        else:  # a bare encoder's checkpoint into a task model
            state = {f"{prefix}.{k}": v for k, v in state.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        lines = [s.strip() for s in str(exc).splitlines() if "size mismatch" in s]
        raise AttnkitError(f"{path}: the weights do not fit the heads its config keeps"
                           + (f" ({lines[0]})" if lines else "")) from None
    model.tie_weights()
    ignored = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()  # rebuilt by the model (Marian's
    missing = [k for k in missing if not any(re.search(p, k) for p in ignored)]  # sinusoidal positions)
    loaded = {t.data_ptr() for k, t in model.state_dict().items() if k in state}
    base = f"{prefix}." if prefix and model.base_model is not model else ""
    untied = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded]
    lost = [k for k in untied if k.startswith(base) or not base]
    if lost or unexpected:
        what = (f"missing {', '.join(lost[:3])}" if lost else f"unexpected {', '.join(unexpected[:3])}")
        raise AttnkitError(f"{path}: the checkpoint does not match a pruned {model.config.model_type} model ({what})")
    if untied:
        log.warning("attnkit: %s has no weights for %s; they are newly initialised", path, ", ".join(untied[:4]))


def load_pruned_model(path, model_class=None, *, dtype=None):
    """A model that `prune_heads` changed and `save_pretrained` wrote to `path`, loaded with transformers only.

    `model_class`: a transformers class with `from_config` (default `AutoModel`; e.g.
    `AutoModelForSequenceClassification` for the classifier a fine-tuned model was saved with). The config names
    the heads each layer kept; the unpruned structure is built from it, those heads removed, and the weights
    loaded. Returns the model in eval mode on the CPU (in `dtype` when given)."""
    from transformers import AutoConfig, AutoModel

    path = str(path)
    config = AutoConfig.from_pretrained(path)
    kept = heads_in_config(config, os.path.join(path, "config.json"))
    if kept is None:
        raise AttnkitError(f"{path} is not a pruned model: its config.json has no {CONFIG_HEADS}")
    model = (model_class or AutoModel).from_config(config)
    H = int(config.num_attention_heads)
    prune_heads(model, [(l, h) for l, heads in enumerate(kept) for h in range(H) if h not in heads])
    _load_state(model, _read_weights(path), path)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


__all__ = ["CONFIG_COUNTS", "CONFIG_HEADS", "KV_HEAD_ATTR", "GroupedKV", "current_heads", "heads_in_config",
           "kept_heads", "kv_group_size", "load_pruned_model", "n_attnkit_layers", "prune_heads", "pruned_head_grid",
           "removed_heads", "to_kept", "to_unpruned"]
