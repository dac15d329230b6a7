"""The input checks of the training tools (attnkit/training/checks.py, docs/training.md) and their cleanup when the
user's code raises (issue 47): bad input to `track`, `StatsLogger`, `AttnkitCallback` and `qk_clip` is refused by
name before anything runs, valid input of other types (numpy and 0-d tensor scalars, a feature as a string, an
upper-case suffix) works, no statistic or row is silently wrong or lost, and a KeyboardInterrupt raised inside a
tracked forward (a plain `track` block, a Trainer step) leaves nothing of attnkit's attached to the model."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.models import runtime_of
from attnkit.training import DEFAULT_FEATURES, StatsLogger, qk_clip, track

from .synthetic import tiny_decoder

STATS = {"entropy": torch.tensor([[0.5, 1.0], [1.5, 2.0]]), "max_logit": torch.tensor([[3.0, 4.0], [5.0, 6.0]])}


def batch(n=3, seed=1, vocab=120):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, 9), generator=g)
    mask = (torch.arange(9)[None] < torch.tensor([9, 6, 3, 8, 5][:n])[:, None]).long()
    return ids, mask


def samples(ids, mask):
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i].masked_fill(mask[i] == 0, -100)}
            for i in range(len(ids))]


def read_csv(path):
    import pandas as pd

    return pd.read_csv(path)


# -- track ------------------------------------------------------------------------------------------------------------

def test_track_takes_none_as_the_default_features_and_refuses_bad_arguments_by_name():
    model = attnkit.instrument(tiny_decoder("llama"))
    ids, mask = batch()
    with track(model, features=None) as t:
        model(input_ids=ids, attention_mask=mask)
        assert t.features == DEFAULT_FEATURES and set(t.read()) == set(DEFAULT_FEATURES)
    for features, message in ((5, "features"), ([1], "features"), ((), "at least one"),
                              (("entropy", "entropy"), "twice")):
        with pytest.raises(AttnkitError, match=message):
            with track(model, features=features):
                pass
    with pytest.raises(AttnkitError, match="num_windows"):
        with track(model, num_windows=0):
            pass
    with pytest.raises(AttnkitError, match="model"):
        with track("llama"):
            pass
    assert runtime_of(model).tracker is None


# -- cleanup when the user's code raises (issue 47) -------------------------------------------------------------------

class InterruptOnCall:
    """A forward hook that raises KeyboardInterrupt on its `at`-th call (1-based), deterministically."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


def assert_nothing_attached(model):
    from attnkit.ops import cpu_allocator_holders

    rt = runtime_of(model)
    assert rt.tracker is None
    assert rt.inputs is None and rt._outer_inputs == []
    assert "forward" not in vars(model)  # no wrapper of the forward left behind
    assert cpu_allocator_holders() == 0


def test_a_keyboard_interrupt_inside_a_tracked_forward_detaches_the_tracker():
    model = attnkit.instrument(tiny_decoder("llama"))
    fresh = copy.deepcopy(model)
    ids, mask = batch()
    hook = model.model.layers[1].mlp.register_forward_hook(InterruptOnCall(1))  # after layer 1's attention
    with pytest.raises(KeyboardInterrupt):
        with track(model, features=("entropy", "max_logit")):
            model(input_ids=ids, attention_mask=mask)
    hook.remove()
    assert_nothing_attached(model)

    def tracked(m):
        with track(m, features=("entropy", "max_logit")) as t, torch.no_grad():
            m(input_ids=ids, attention_mask=mask)
            return t.read()

    got, want = tracked(model), tracked(fresh)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)
