"""A decoder's cached steps on an encoder–decoder (docs/seq2seq.md §4, "Generation"), as a user runs them without
`generate`: a forward of the first target tokens, then one more token with the KV cache, with and without the
source's attention_mask, against eager attention's logits. T5's step carries its relative-position bias for the
new row over every cached key: on the compiled CPU kernel, and on the reference (a build whose kernel takes no bias;
a step there used to skip the bias), both equal eager's."""
from __future__ import annotations

import copy

import pytest
import torch

import attnkit
from attnkit import ops

from .synthetic import tiny_seq2seq

VOCAB = 50


def step_logits(model, source, mask: bool) -> torch.Tensor:
    """The logits of the third target token, computed with the cache of the first two."""
    kw = dict(attention_mask=torch.ones_like(source)) if mask else {}
    target = torch.tensor([[0, 5, 9]] * source.shape[0])
    with torch.no_grad():
        first = model(input_ids=source, decoder_input_ids=target[:, :2], use_cache=True, **kw)
        return model(input_ids=source, decoder_input_ids=target[:, 2:], past_key_values=first.past_key_values,
                     use_cache=True, **kw).logits


@pytest.mark.parametrize("kind", ["bart", "marian", "t5"])
@pytest.mark.parametrize("kernel_takes_bias", [True, False])
def test_a_cached_step_equals_eager_with_and_without_the_sources_mask(kind, kernel_takes_bias, monkeypatch):
    if not kernel_takes_bias:
        monkeypatch.setattr(ops, "fused_bias", lambda device_type: False)
    torch.manual_seed(0)
    eager = tiny_seq2seq(kind, vocab=VOCAB).eval()
    ours = attnkit.instrument(copy.deepcopy(eager))
    source = torch.randint(3, VOCAB, (2, 7))
    for mask in (True, False):
        want = step_logits(eager, source, mask)
        torch.testing.assert_close(step_logits(ours, source, mask), want, atol=1e-5, rtol=1e-5)
