"""Where each supported architecture keeps the projections of its attention layers: the one mapping that norm
weighting (the output projection W_O) and physical pruning (W_Q, W_K, W_V and W_O) read.

A layer's self-attention module is the module that calls transformers' attention interface. In BERT, RoBERTa,
ELECTRA, XLM-R and CamemBERT it holds `query`, `key` and `value`, and its sibling `output.dense` is the output
projection (the output bias, dropout and LayerNorm that follow belong to the residual path). In DistilBERT it
holds `q_lin`, `k_lin`, `v_lin` and the output projection `out_lin` itself. Head h owns the rows h·D … (h+1)·D − 1
of W_Q, W_K, W_V (and of their biases) and the same columns of W_O (D: the head size).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import AttnkitError


@dataclass(frozen=True)
class Layout:
    """How one architecture names the parts of a self-attention layer."""

    query: str
    key: str
    value: str
    output: str  # the output projection: a child of the attention module, or of its parent (`output_beside`)
    output_beside: bool
    heads_attr: str  # the attention module's attribute that counts its heads
    size_attr: str | None  # its attribute holding heads × head size, where it has one


BERT_LIKE = Layout("query", "key", "value", "output.dense", True, "num_attention_heads", "all_head_size")
DISTILBERT = Layout("q_lin", "k_lin", "v_lin", "out_lin", False, "n_heads", None)

LAYOUTS = {"bert": BERT_LIKE, "roberta": BERT_LIKE, "electra": BERT_LIKE, "xlm-roberta": BERT_LIKE,
           "camembert": BERT_LIKE, "distilbert": DISTILBERT}


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
        return getattr(self.module, getattr(self.layout, name))

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
    def output(self) -> nn.Linear:
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
    modules = dict(model.named_modules())
    out = []
    for name, mod in modules.items():
        parts = [getattr(mod, getattr(layout, p), None) for p in ("query", "key", "value")]
        if not all(isinstance(p, nn.Linear) for p in parts):
            continue
        if getattr(mod, "is_cross_attention", False):
            continue
        if layout.output_beside:
            parent_name = name.rsplit(".", 1)[0] if "." in name else ""
            holder_path, _, attr = layout.output.rpartition(".")
            owner = _child(modules[parent_name], holder_path) if holder_path else modules[parent_name]
        else:
            attr, owner = layout.output, mod
        if owner is None or not isinstance(getattr(owner, attr, None), nn.Linear):
            where = "beside" if layout.output_beside else "in"
            raise AttnkitError(f"{purpose}: the attention module {name!r} of this {model.config.model_type} model "
                               f"has no output projection {layout.output!r} {where} it")
        head_size = getattr(mod, "attention_head_size", None)
        if not isinstance(head_size, int) or head_size < 1:
            raise AttnkitError(f"{purpose}: the attention module {name!r} names no head size (attention_head_size)")
        out.append(AttentionLayer(mod, owner, attr, layout, head_size))
    if not out:
        raise AttnkitError(f"{purpose}: found no self-attention layer in this {model.config.model_type} model")
    return out


__all__ = ["AttentionLayer", "BERT_LIKE", "DISTILBERT", "LAYOUTS", "Layout", "attention_layers", "layout_of"]
