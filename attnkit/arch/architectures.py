"""Where each supported architecture keeps the projections of its attention layers: the one mapping that norm
weighting (the output projection W_O) and physical pruning (W_Q, W_K, W_V and W_O) read.

A layer's self-attention module is the module that calls transformers' attention interface. In BERT, RoBERTa,
ELECTRA, XLM-R and CamemBERT it holds `query`, `key` and `value`, and its sibling `output.dense` is the output
projection (the output bias, dropout and LayerNorm that follow belong to the residual path). In DistilBERT it
holds `q_lin`, `k_lin`, `v_lin` and the output projection `out_lin` itself. Head h owns the rows h·D … (h+1)·D − 1
of W_Q, W_K, W_V (and of their biases) and the same columns of W_O (D: the head size).

Decoder language models (docs/decoders.md) keep their output projection in the attention module itself:
- Llama (SmolLM2, Llama 3), Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 and gpt-oss: `q_proj`, `k_proj`, `v_proj` and
  `o_proj`, with grouped-query attention (`k_proj` and `v_proj` have the rows of the Hkv ≤ H KV heads; query head h
  reads KV head h // (H / Hkv)); the head size is `head_dim`.
- GPT-2: one fused `c_attn` (a transformers `Conv1D`, whose weight is input × output, the transpose of an
  `nn.Linear`'s) computes [q | k | v], each hidden wide; the output projection `c_proj` is a `Conv1D` too.
- GPT-NeoX (Pythia): one fused `query_key_value` whose rows are grouped per head, [q_h | k_h | v_h] for each head
  in turn; the output projection is `dense`; the head size is `head_size`.
- Phi-3: one fused `qkv_proj` computing [q (H heads) | k (Hkv heads) | v (Hkv heads)]; the output projection is
  `o_proj`.
- OLMo 2: the Llama family's projections, but its `q_norm` and `k_norm` normalise q and k over all heads together
  (RMSNorm over H·D), so removing a head would change the others' q and k: not prunable.
Encoder–decoders (docs/seq2seq.md) hold separate projections in each attention module, encoder, decoder and cross
alike: BART and Marian `q_proj`, `k_proj`, `v_proj` and `out_proj` (head size `head_dim`), T5 `q`, `k`, `v` and `o`
(head size `key_value_proj_dim`; its `n_heads` stays the unpruned count: T5 builds each stack's position bias for
all heads from it). Their layers are listed in attnkit's order, the encoder's, then the decoder's self-attention,
then its cross-attention layers (`seq2seq_order`).
Vision transformers (docs/features.md, "Image heads"): ViT, DeiT and DINOv2 hold the Llama family's `q_proj`, `k_proj`,
`v_proj` and `o_proj`, CLIP's and SigLIP's vision towers BART's `q_proj`, `k_proj`, `v_proj` and `out_proj`.
ModernBERT (an encoder) holds one fused `Wqkv` computing [q | k | v], each H·D wide, and its output projection `Wo`
in the attention module; the head size is `head_dim`.
Head h's slice of the output projection is, in every one of them, the columns h·D … (h+1)·D − 1 of W_O as an
`nn.Linear` holds it (hidden × H·D): `output_matrix` gives that matrix for a `Conv1D` too. Physical pruning
(attnkit/arch/pruning.py) knows the separate projections of the encoders and of the Llama family, grouped-query
attention included (`prunable`); it refuses the fused ones (GPT-2, GPT-NeoX, Phi-3, ModernBERT) and OLMo 2 by name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AttnkitError


@dataclass(frozen=True)
class Layout:
    """How one architecture names the parts of a self-attention layer."""

    query: str | None  # None where one fused projection computes q, k and v (`fused`)
    key: str | None
    value: str | None
    output: str  # the output projection: a child of the attention module, or of its parent (`output_beside`)
    output_beside: bool
    heads_attr: str | None  # the attention module's attribute that counts its heads, where it has one
    size_attr: str | None  # its attribute holding heads × head size, where it has one
    head_size_attr: str = "attention_head_size"  # its attribute holding the head size
    fused: str | None = None  # the one projection that computes q, k and v (GPT-2, GPT-NeoX, Phi-3)
    prunable: bool = True  # whether attnkit.arch.pruning can remove heads of this layout

    @property
    def projections(self) -> tuple[str, ...]:
        """The attribute names of the projections that compute q, k and v."""
        return (self.fused,) if self.fused else (self.query, self.key, self.value)


BERT_LIKE = Layout("query", "key", "value", "output.dense", True, "num_attention_heads", "all_head_size")
DISTILBERT = Layout("q_lin", "k_lin", "v_lin", "out_lin", False, "n_heads", None)
LLAMA_LIKE = Layout("q_proj", "k_proj", "v_proj", "o_proj", False, None, None, "head_dim")
GPT2 = Layout(None, None, None, "c_proj", False, "num_heads", "embed_dim", "head_dim", fused="c_attn", prunable=False)
GPT_NEOX = Layout(None, None, None, "dense", False, None, None, "head_size", fused="query_key_value", prunable=False)
PHI3 = Layout(None, None, None, "o_proj", False, None, None, "head_dim", fused="qkv_proj", prunable=False)
OLMO2 = Layout("q_proj", "k_proj", "v_proj", "o_proj", False, None, None, "head_dim", prunable=False)
MODERNBERT = Layout(None, None, None, "Wo", False, None, None, "head_dim", fused="Wqkv", prunable=False)
BART_LIKE = Layout("q_proj", "k_proj", "v_proj", "out_proj", False, "num_heads", None, "head_dim")
T5 = Layout("q", "k", "v", "o", False, None, None, "key_value_proj_dim")

LAYOUTS = {"bert": BERT_LIKE, "roberta": BERT_LIKE, "electra": BERT_LIKE, "xlm-roberta": BERT_LIKE,
           "camembert": BERT_LIKE, "distilbert": DISTILBERT,
           "llama": LLAMA_LIKE, "qwen2": LLAMA_LIKE, "qwen3": LLAMA_LIKE, "mistral": LLAMA_LIKE, "gemma2": LLAMA_LIKE,
           "gemma3_text": LLAMA_LIKE, "gpt_oss": LLAMA_LIKE, "gpt2": GPT2, "gpt_neox": GPT_NEOX, "phi3": PHI3,
           "olmo2": OLMO2, "modernbert": MODERNBERT, "bart": BART_LIKE, "marian": BART_LIKE, "t5": T5,
           "vit": LLAMA_LIKE, "deit": LLAMA_LIKE, "dinov2": LLAMA_LIKE, "dinov2_with_registers": LLAMA_LIKE,
           "clip_vision_model": BART_LIKE, "siglip_vision_model": BART_LIKE}


def projection_types() -> tuple:
    """The classes of a projection: nn.Linear, and transformers' Conv1D (GPT-2). Imported when first needed:
    importing transformers here while attnkit.hf_attention loads would import this module again."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def output_matrix(proj: nn.Module) -> torch.Tensor:
    """The weight of an output projection as `nn.Linear` holds it: hidden × (heads · head size), head h's slice its
    columns h·D … (h+1)·D − 1 (a `Conv1D` holds the transpose)."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(proj, Conv1D):
        return proj.weight.t()
    if isinstance(proj, nn.Linear):
        return proj.weight
    raise AttnkitError(f"an output projection must be an nn.Linear or a Conv1D, got {type(proj).__name__}")


def layout_of(model, purpose: str = "this") -> Layout:
    """The layout of `model`'s architecture (by `config.model_type`); an AttnkitError names the supported ones."""
    mtype = getattr(getattr(model, "config", None), "model_type", None)
    if mtype not in LAYOUTS:
        raise AttnkitError(f"{purpose} needs to know where a {mtype or type(model).__name__!r} model keeps its "
                           f"attention projections; supported model types: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[mtype]


@dataclass
class AttentionLayer:
    """One layer's self-attention: the module that calls the attention interface, the module that holds the
    output projection (`owner`, with attribute name `output_name`), and the head size."""

    module: nn.Module
    owner: nn.Module
    output_name: str
    layout: Layout
    head_size: int

    def linear(self, name: str) -> nn.Linear:
        attr = getattr(self.layout, name)
        if attr is None:
            raise AttnkitError(f"this {type(self.module).__name__} computes q, k and v in one fused projection "
                               f"({self.layout.fused!r}): it has no separate {name} projection")
        return getattr(self.module, attr)

    @property
    def query(self) -> nn.Linear:
        return self.linear("query")

    @property
    def key(self) -> nn.Linear:
        return self.linear("key")

    @property
    def value(self) -> nn.Linear:
        return self.linear("value")

    @property
    def output(self) -> nn.Module:
        """The output projection: an nn.Linear, or GPT-2's Conv1D (`output_matrix` reads either)."""
        return getattr(self.owner, self.output_name)

    def replace(self, name: str, linear: nn.Linear) -> None:
        """Put `linear` in place of the projection `name` ("query", "key", "value" or "output")."""
        if name == "output":
            setattr(self.owner, self.output_name, linear)
        else:
            setattr(self.module, getattr(self.layout, name), linear)


def _child(module: nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def attention_layers(model, purpose: str = "this") -> list[AttentionLayer]:
    """The self-attention layers of `model` in layer order (the order of `model.named_modules()`), found by the
    layout of its architecture; an AttnkitError when the architecture is unknown or its modules are not where the
    layout says."""
    layout = layout_of(model, purpose)
    types = projection_types()
    modules = dict(model.named_modules())
    out = []
    for name, mod in modules.items():
        parts = [getattr(mod, p, None) for p in layout.projections]
        if not all(isinstance(p, types) for p in parts):
            continue
        if getattr(mod, "is_cross_attention", False):
            continue
        if layout.output_beside:
            parent_name = name.rsplit(".", 1)[0] if "." in name else ""
            holder_path, _, attr = layout.output.rpartition(".")
            owner = _child(modules[parent_name], holder_path) if holder_path else modules[parent_name]
        else:
            attr, owner = layout.output, mod
        if owner is None or not isinstance(getattr(owner, attr, None), types):
            where = "beside" if layout.output_beside else "in"
            raise AttnkitError(f"{purpose}: the attention module {name!r} of this {model.config.model_type} model "
                               f"has no output projection {layout.output!r} {where} it")
        head_size = getattr(mod, layout.head_size_attr, None)
        if not isinstance(head_size, int) or head_size < 1:
            raise AttnkitError(f"{purpose}: the attention module {name!r} names no head size ({layout.head_size_attr})")
        out.append(AttentionLayer(mod, owner, attr, layout, head_size))
    if not out:
        raise AttnkitError(f"{purpose}: found no self-attention layer in this {model.config.model_type} model")
    return seq2seq_order(model, out) if getattr(model.config, "is_encoder_decoder", False) else out


def seq2seq_order(model, layers: list[AttentionLayer]) -> list[AttentionLayer]:
    """An encoder–decoder's attention layers in attnkit's order (docs/seq2seq.md §2): the encoder's, the decoder's
    self-attention (causal), then its cross-attention layers, each kind in the model's order. Told apart by where a
    module sits (the encoder's stack, `model.get_encoder()`) and whether it is causal, so that a model never
    instrumented (attnkit.arch.load_pruned_model builds one) numbers its layers as attnkit.instrument does."""
    from ..attention.kinds import CROSS, DECODER, ENCODER, KINDS

    encoder = {id(m) for m in model.get_encoder().modules()}

    def kind(layer: AttentionLayer) -> str:
        if id(layer.module) in encoder:
            return ENCODER
        return DECODER if getattr(layer.module, "is_causal", False) else CROSS

    return [layer for k in KINDS for layer in layers if kind(layer) == k]


@dataclass
class QueryKeyUnits:
    """Where the q and k of each head come from in one layer: the projection computing q and the index (H × D) of
    its output units that make head h's q, and likewise for k (Hkv × D; one projection for both where q, k and v are
    fused). Scaling those units (rows of an nn.Linear's weight and bias, columns of a Conv1D's weight) scales q or k
    of that head exactly: the rotary embeddings that follow are linear."""

    query: nn.Module
    query_units: torch.Tensor
    key: nn.Module
    key_units: torch.Tensor


def query_key_units(layer: AttentionLayer, n_heads: int, n_kv_heads: int) -> QueryKeyUnits:
    """The output units of each head's q and k in `layer` (docs/training.md, "QK-Clip"), from the layout: separate
    projections (head h: units h·D … (h+1)·D − 1 of W_Q, KV head g: those of W_K), GPT-2's `c_attn` ([q | k | v],
    each H·D wide), GPT-NeoX's `query_key_value` (per head [q_h | k_h | v_h]) and Phi-3's `qkv_proj` ([q (H heads) |
    k (Hkv heads) | v]). A model that normalises q or k per head after the projection (Qwen3's and Gemma 3's
    `q_norm`/`k_norm`) is refused: the norm would undo the scale."""
    D = layer.head_size
    mod = layer.module
    for name in ("q_norm", "k_norm", "query_layernorm", "key_layernorm"):
        if getattr(mod, name, None) is not None:
            raise AttnkitError(f"this {type(mod).__name__} normalises q and k after their projections ({name}): "
                               "scaling rows of W_Q and W_K would be undone by the norm, so QK-Clip does not apply")
    heads = torch.arange(n_heads)[:, None] * D + torch.arange(D)[None, :]
    kv = torch.arange(n_kv_heads)[:, None] * D + torch.arange(D)[None, :]
    fused = layer.layout.fused
    if fused is None:
        return QueryKeyUnits(layer.query, heads, layer.key, kv)
    proj = getattr(mod, fused)
    if fused == "c_attn":  # GPT-2: [q | k | v], each n_heads · D wide
        return QueryKeyUnits(proj, heads, proj, heads + n_heads * D)
    if fused == "query_key_value":  # GPT-NeoX: per head [q_h | k_h | v_h]
        base = torch.arange(n_heads)[:, None] * 3 * D + torch.arange(D)[None, :]
        return QueryKeyUnits(proj, base, proj, base + D)
    if fused == "qkv_proj":  # Phi-3: [q (H heads) | k (Hkv heads) | v (Hkv heads)]
        return QueryKeyUnits(proj, heads, proj, kv + n_heads * D)
    raise AttnkitError(f"attnkit does not know where the fused projection {fused!r} keeps each head's q and k")


def scale_output_units(proj: nn.Module, units: torch.Tensor, factors: torch.Tensor) -> None:
    """Multiply the output units `units` (n × D) of a projection by `factors` (n, one per row of `units`), in
    place: rows of an nn.Linear's weight and bias, columns of a Conv1D's weight (input × output) and its bias."""
    from transformers.pytorch_utils import Conv1D

    idx = units.reshape(-1).to(proj.weight.device)
    f = factors.to(proj.weight.device, proj.weight.dtype).repeat_interleave(units.shape[1])
    with torch.no_grad():
        if isinstance(proj, Conv1D):
            proj.weight[:, idx] *= f[None, :]
        elif isinstance(proj, nn.Linear):
            proj.weight[idx] *= f[:, None]
        else:
            raise AttnkitError(f"a projection must be an nn.Linear or a Conv1D, got {type(proj).__name__}")
        if proj.bias is not None:
            proj.bias[idx] *= f


__all__ = ["AttentionLayer", "BART_LIKE", "BERT_LIKE", "DISTILBERT", "GPT2", "GPT_NEOX", "LAYOUTS", "LLAMA_LIKE",
           "Layout", "MODERNBERT", "OLMO2", "PHI3",
           "QueryKeyUnits", "T5", "attention_layers", "layout_of", "output_matrix", "query_key_units",
           "scale_output_units", "seq2seq_order"]
