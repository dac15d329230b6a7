"""The transformer layers of an instrumented model, what they output during a forward, and forwards that start at
a layer (docs/interventions.md, "Sweeps").

An intervention that changes layer l and after leaves layers 0 … l − 1 computing what they compute without it.
`capturing_layer_outputs` keeps what chosen layers return during a forward; inside `starting_at(model, l, h)`,
layers 0 … l − 1 return `h` (what layer l − 1 returned for the same batch) without computing anything, so layer l
and those after it run on exactly the hidden states of a full forward. The embeddings still run (cheap); the model's
own code and heads run unchanged, so this works for any model whose layers form one `nn.ModuleList`.
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import AttnkitError
from ..models import attention_modules


def encoder_layers(model) -> list[torch.nn.Module]:
    """The layers of an instrumented model, in order: the entries of the `nn.ModuleList` whose i-th entry holds the
    i-th attention module."""
    found = getattr(model, "_attnkit_layers", None)
    if found is not None:
        return found
    attn = attention_modules(model)
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == len(attn) and all(
                any(m is a for m in layer.modules()) for layer, a in zip(mod, attn)):
            model._attnkit_layers = list(mod)
            return model._attnkit_layers
    raise AttnkitError(f"cannot find the layers of this {type(model).__name__}: no module list holds its attention "
                       "modules one per entry")


@contextlib.contextmanager
def capturing_layer_outputs(model, layers):
    """Inside the block, every forward puts what each layer in `layers` returns into the yielded dict (layer →
    output, as the layer returned it)."""
    mods = encoder_layers(model)
    seen: dict = {}
    handles = []
    try:
        for i in sorted(set(layers)):
            handles.append(mods[i].register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out)))
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def starting_at(model, layer: int, hidden):
    """Inside the block, forwards skip layers 0 … `layer` − 1: each returns `hidden` (the output of layer `layer` − 1
    for this batch, as `capturing_layer_outputs` kept it) instead of computing. `layer` 0 changes nothing."""
    mods = encoder_layers(model)
    if not 0 <= layer <= len(mods):
        raise AttnkitError(f"cannot start at layer {layer}: the model has {len(mods)} layers")
    skipped = mods[:layer]

    def skip(*args, **kwargs):
        return hidden

    for m in skipped:
        m.forward = skip  # the instance attribute wins over the class's forward
    try:
        yield
    finally:
        for m in skipped:
            m.__dict__.pop("forward", None)


__all__ = ["capturing_layer_outputs", "encoder_layers", "starting_at"]
