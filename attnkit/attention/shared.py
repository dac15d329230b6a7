"""Layers that share one attention module (ALBERT runs one shared layer N times) are refused: attnkit numbers
features, maps and interventions by attention module, so those layers would merge into one, silently.

`attnkit.models.instrument` refuses such a model after its probe forward (`shared_layers_error`). A model loaded
with `attn_implementation="attnkit"` directly (`from_pretrained`/`from_config`, not through attnkit) runs without
instrument until attnkit is asked for something, so its first forward counts the calls of each attention module
(`check_not_shared`, from the attention function while a module has no Runtime): a second call of one module in the
forward of the model that runs it is refused the same way. After one whole forward without a repeat the modules it
called are not counted again. The model is the innermost transformers model being called (its `__call__` on the
stack, so that a hook ends the count with its forward); where none is (a module called by hand), nothing is
counted."""
from __future__ import annotations

import sys

import torch

from ..errors import AttnkitError

CHECKED_ATTR = "_attnkit_layers_checked"  # on an attention module: one forward ran it once
CENSUS_ATTR = "_attnkit_census"  # on a model: the count of its forward under way


def shared_layers_error(model, module, count: int | None = None) -> AttnkitError:
    """The refusal of `model`, which runs attention `module` for `count` layers (None: more than one)."""
    mtype = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    layers = "more than one layer" if count is None else f"{count} layers"
    return AttnkitError(f"model type {mtype!r} runs one attention module ({type(module).__name__}) for {layers} "
                        "(shared layers): attnkit measures and changes each layer's own attention module, so it "
                        "cannot tell these layers apart")


class Census:
    """The calls of each attention module in one forward of `model`. Made during a forward (the first call of a
    module not counted yet), it keeps hooks on the model until one whole forward has been counted: each forward
    starts a new count (a pre-hook), and a forward that ends with an output marks the modules it called as checked
    and takes the hooks off (a forward that began without hooks on the model ends without them running)."""

    def __init__(self, model):
        self.calls: dict = {}
        setattr(model, CENSUS_ATTR, self)
        self.handles = (model.register_forward_pre_hook(self.start),
                        model.register_forward_hook(self.end, always_call=True))

    def count(self, model, module) -> None:
        self.calls[module] = self.calls.get(module, 0) + 1
        if self.calls[module] > 1:
            raise shared_layers_error(model, module)

    def start(self, model, args) -> None:
        self.calls = {}

    def end(self, model, args, output) -> None:
        if output is None:  # an exception in the forward (the hook gets no output): count the next one again
            return
        for handle in self.handles:
            handle.remove()
        delattr(model, CENSUS_ATTR)
        for module in self.calls:
            setattr(module, CHECKED_ATTR, True)


def check_not_shared(module) -> None:
    """Count this call of `module`, which has no Runtime, in the forward of the model running it (docstring)."""
    if getattr(module, CHECKED_ATTR, False) or torch.compiler.is_compiling():
        return
    model = calling_model()
    if model is None:
        setattr(module, CHECKED_ATTR, True)  # called by hand: there is no forward to count in
        return
    census = getattr(model, CENSUS_ATTR, None) or Census(model)
    census.count(model, module)


def calling_model():
    """The innermost transformers model whose `__call__` is on the stack (None when there is none)."""
    from transformers import PreTrainedModel

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and isinstance(frame.f_locals.get("self"), PreTrainedModel):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None
