"""The context of a forward (attnkit/attention/context.py, issue 47): what a forward needs is read once, when it
begins, into its own `Forward`, which every call of the attention function in it reads (`AttentionCall.forward`).
The Runtime keeps its settings, the consumers, what the blocks give the next forwards and the stack of forwards
under way, and no field of one forward. A forward run inside another (a hook that calls the model again) has its own
context, and the outer one has its own back afterwards, also when the inner one was interrupted inside a block; a
block entered during a forward applies from the next forward on. The outputs are checked against the same forwards
run alone on a copy of the model."""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch

import attnkit
from attnkit.attention.consumers import BaseConsumer
from attnkit.attention.context import NOTHING_GIVEN, Forward
from attnkit.attention.runtime import Runtime
from attnkit.caching import encoder_layers
from attnkit.interventions import Intervention, merged
from attnkit.models import runtime_of

from .synthetic import padded_inputs, tiny_encoder

# What a Runtime may hold: settings, the consumers attached, what the blocks give the next forwards (`given`) and the
# forwards under way. The data of one forward (its inputs, attnkit's batch, sentence ids, ...) belongs in `Forward`.
# `image`: a vision transformer's ImageLayout, a setting of the model read from its config at attnkit.instrument (as
# `sink`); the size of one forward's image is per-forward data (ModelInputs.image_size). `alignment`: whether every
# layer measures the alignment features (an encoder–decoder's, set at attnkit.instrument: docs/features.md §11).
RUNTIME_FIELDS = {"backend", "num_windows", "separator_ids", "sink", "segment_types", "image", "alignment", "consumers",
                  "given", "forwards"}

OUTER = padded_inputs(120, (9, 5), pair=True)  # segment B from position 4
INNER = padded_inputs(120, (7, 7, 3))  # other samples and length, segment B from position 2
INNER["token_type_ids"] = (torch.arange(7)[None] >= 2).long() * INNER["attention_mask"]


class Seen(BaseConsumer):
    """Keeps (layer, the call's Forward) for each call of the attention function, in call order."""

    def __init__(self):
        self.calls = []

    def wants(self, call):
        self.calls.append((call.layer, call.forward))
        return None


def test_the_runtime_holds_no_field_of_one_forward():
    assert {f.name for f in dataclasses.fields(Runtime)} == RUNTIME_FIELDS
    with pytest.raises(dataclasses.FrozenInstanceError):
        Forward().inputs = None  # set once, when the forward begins
    model = attnkit.instrument(tiny_encoder("bert"))
    rt = runtime_of(model)
    a = Intervention.from_heads(model, [(1, 0)], mode="zero")
    with attnkit.intervene(model, a):  # outside a forward: what is given now, no inputs seen
        assert rt.context().inputs is None and rt.context().intervention is a
    assert rt.context().intervention is None and rt.forwards == []


def _alone(model, inputs, *interventions):
    """The last hidden state of one forward of `inputs` under the `interventions` (nested blocks)."""
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for iv in interventions:
            stack.enter_context(attnkit.intervene(model, iv))
        return model(**inputs).last_hidden_state


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_forward_inside_another_has_its_own_context_and_the_outer_one_gets_its_own_back(interrupted):
    """The outer forward begins under `a`; a hook on its first layer enters `b` and runs the model on other inputs
    (with `interrupted`, Ctrl-C in that inner forward's second layer, caught by the hook). The outer forward's second
    layer still runs under `a` alone with its own inputs and sentence ids; the inner one ran under `a` and `b`."""
    model = attnkit.instrument(tiny_encoder("bert"))
    fresh = copy.deepcopy(model)
    rt = runtime_of(model)
    a = Intervention.from_heads(model, "L1", mode="keep", region="no_inter")  # needs each forward's sentence ids
    b = Intervention.from_heads(model, [(1, 2), (0, 1)], mode="uniform")
    first, second = encoder_layers(model)[:2]
    state = {"calls": 0, "inner": None}

    def run_inner(module, args, output):
        state["calls"] += 1
        if state["calls"] != 1:  # the inner forward runs this hook too
            return
        try:
            with attnkit.intervene(model, b):
                state["inner"] = model(**INNER).last_hidden_state
        except KeyboardInterrupt:
            state["inner"] = "interrupted"

    def ctrl_c(module, args, output):
        if interrupted and rt.open_forwards == 2:
            raise KeyboardInterrupt

    seen = Seen()
    handles = [first.register_forward_hook(run_inner), second.register_forward_hook(ctrl_c)]
    try:
        with torch.no_grad(), rt.attached(seen), attnkit.intervene(model, a):
            outer = model(**OUTER).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    assert rt.forwards == [] and rt.given == NOTHING_GIVEN

    want = _alone(fresh, OUTER, a)
    torch.testing.assert_close(outer, want, rtol=0, atol=0)
    assert not torch.allclose(_alone(fresh, OUTER, a, b), want)  # b, had it reached the outer forward, would show
    # the calls in order: outer layer 0, the inner forward's layers 0 and 1, outer layer 1
    assert [layer for layer, _ in seen.calls] == [0, 0, 1, 1]
    f_outer, f_inner = seen.calls[0][1], seen.calls[1][1]
    assert seen.calls[2][1] is f_inner and seen.calls[3][1] is f_outer and f_inner is not f_outer
    assert f_outer.intervention is a and f_outer.inputs.input_ids is OUTER["input_ids"]
    assert f_inner.inputs.input_ids is INNER["input_ids"] and f_inner.intervention is not a
    # the sentence ids of the region intervention, derived once per forward from its own inputs
    assert f_outer.derived["sentence_id"].shape == OUTER["input_ids"].shape
    assert f_inner.derived["sentence_id"].shape == INNER["input_ids"].shape
    if interrupted:
        assert state["inner"] == "interrupted"
    else:
        torch.testing.assert_close(state["inner"], _alone(fresh, INNER, merged(a, b)), rtol=0, atol=0)


def test_a_block_entered_during_a_forward_applies_from_the_next_forward():
    model = attnkit.instrument(tiny_encoder("bert"))
    fresh = copy.deepcopy(model)
    b = Intervention.from_heads(model, "L1", mode="uniform")
    blocks = []

    def enter(module, args, output):
        if not blocks:
            blocks.append(attnkit.intervene(model, b))
            blocks[0].__enter__()

    handle = encoder_layers(model)[0].register_forward_hook(enter)
    try:
        with torch.no_grad():
            during = model(**OUTER).last_hidden_state
            after = model(**OUTER).last_hidden_state
    finally:
        handle.remove()
        blocks[0].__exit__(None, None, None)
    torch.testing.assert_close(during, _alone(fresh, OUTER), rtol=0, atol=0)
    torch.testing.assert_close(after, _alone(fresh, OUTER, b), rtol=0, atol=0)
    assert not torch.allclose(during, after)
    assert runtime_of(model).given == NOTHING_GIVEN


def test_ctrl_c_in_a_forward_inside_a_block_leaves_no_forward_open():
    model = attnkit.instrument(tiny_encoder("bert"))
    fresh = copy.deepcopy(model)
    rt = runtime_of(model)
    a = Intervention.from_heads(model, [(0, 0)], mode="zero")

    def ctrl_c(module, args, output):
        raise KeyboardInterrupt

    handle = encoder_layers(model)[0].register_forward_hook(ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad(), attnkit.intervene(model, a):
            model(**OUTER)
    finally:
        handle.remove()
    assert rt.forwards == [] and rt.given == NOTHING_GIVEN
    torch.testing.assert_close(_alone(model, OUTER), _alone(fresh, OUTER), rtol=0, atol=0)
