"""A model whose layers share one attention module (ALBERT) is refused by name also when it was loaded with
`attn_implementation="attnkit"` directly, not through attnkit.instrument (attnkit.attention.shared): its first
forward counts each module's calls. A model whose modules each run once is not refused, and is not counted again
after its first forward."""
from __future__ import annotations

import copy

import pytest
import torch

import attnkit  # noqa: F401 (registers attn_implementation="attnkit")
from attnkit.attention.shared import CENSUS_ATTR, CHECKED_ATTR
from attnkit.errors import AttnkitError


def _albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    cfg = AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                       intermediate_size=64)
    return AlbertForMaskedLM._from_config(cfg, attn_implementation="attnkit").eval()


def test_albert_loaded_with_attnkit_attention_is_refused_at_its_first_forward():
    model = _albert()
    ids = torch.randint(3, 50, (2, 5))
    for _ in range(2):  # a refused forward is no checked one: the next one is refused again
        with pytest.raises(AttnkitError, match="'albert' runs one attention module .*AlbertAttention.* for more "
                                               "than one layer"):
            with torch.no_grad():
                model(input_ids=ids)


def test_a_model_with_a_module_per_layer_runs_and_is_counted_once():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64)
    model = BertModel._from_config(cfg, attn_implementation="attnkit").eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids = torch.randint(3, 50, (2, 5))
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(input_ids=ids).last_hidden_state, eager(input_ids=ids).last_hidden_state,
                                       rtol=1e-5, atol=1e-5)
    mods = [m for m in model.modules() if type(m).__name__ == "BertSelfAttention"]
    assert len(mods) == 2 and all(getattr(m, CHECKED_ATTR, False) for m in mods)
    assert not hasattr(model, CENSUS_ATTR) and not model._forward_hooks and not model._forward_pre_hooks
