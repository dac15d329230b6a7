"""Generation with transformers' static cache (`cache_implementation="static"`) on attnkit models: the cache hands
over all its slots, those after the tokens not filled yet, and the mask of the filled ones (attnkit.attention.call
.filled). Greedy tokens equal eager's with the same static cache, left-padded and not; a forward with a StaticCache
and no attention mask equals eager's (its slots would otherwise be read as tokens)."""
from __future__ import annotations

import copy

import pytest
import torch

import attnkit

from .synthetic import tiny_decoder
from .test_generation import KW, prompts


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])  # mistral: a sliding window of 5 tokens
@pytest.mark.parametrize("padded", [False, True])
def test_greedy_tokens_with_a_static_cache_equal_eagers(kind, padded):
    eager = tiny_decoder(kind)
    ours = attnkit.instrument(copy.deepcopy(eager))
    enc = prompts(padded)
    want = eager.generate(**enc, **KW, cache_implementation="static")
    got = ours.generate(**enc, **KW, cache_implementation="static")
    assert torch.equal(got, want)
    assert torch.equal(want, eager.generate(**enc, **KW))  # the static cache changes nothing in eager either


def test_a_forward_with_a_static_cache_and_no_mask_equals_eagers():
    from transformers import StaticCache

    eager = tiny_decoder("llama")
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids = torch.randint(3, 120, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (eager, ours):
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            prefill = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            step = model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).logits
        logits.append((prefill, step))
    for got, want in zip(logits[1], logits[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
