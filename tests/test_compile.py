"""torch.compile(fullgraph=True) with inductor over the instrumented embedded MiniLM, on CPU.

The attention function must not break the graph: the backend choice is made outside the traced path
(attnkit.ops caches which kernels exist) and `lengths_from_mask` does no host-side data checks while
compiling. Outputs and features must equal the eager ones.
"""
from __future__ import annotations

import pytest
import torch

from attnkit import ops

pytestmark = pytest.mark.slow

SENTS = ["The cat sat on the mat, and the dog slept.", "Rivers bend. Lakes form!"]


@pytest.fixture(scope="module")
def model_and_batch(minilm):
    from attnkit.tokens import Encoder

    model, tok = minilm  # the session's MiniLM: compiling a function that calls it leaves it as it was
    batch = Encoder(tok, max_length=32)(SENTS)
    return model, batch


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="inductor", dynamic=False)


def test_fullgraph_inductor_plain_forward(model_and_batch):
    model, batch = model_and_batch

    def forward(inputs):
        return model(**inputs).last_hidden_state

    with torch.inference_mode():
        eager = forward(batch.inputs)
        got = _compiled(forward)(batch.inputs)
    valid = batch.inputs["attention_mask"].bool()
    assert valid.sum() < valid.numel()  # the batch has padding: the mask path is traced
    torch.testing.assert_close(got[valid], eager[valid], atol=1e-4, rtol=1e-4)


def test_fullgraph_inductor_forward_with_features(model_and_batch):
    from attnkit.engine import measuring

    model, batch = model_and_batch
    n_layers = len(model._attnkit_modules)

    def forward(inputs, rt):
        out = model(**inputs).last_hidden_state
        return out, torch.stack([rt.features[i] for i in range(n_layers)], dim=1)

    with measuring(model) as rt, rt.batch_of(batch), torch.inference_mode():
        eager_out, eager_feats = forward(batch.inputs, rt)
        rt.features = {}
        got_out, got_feats = _compiled(forward)(batch.inputs, rt)
    assert eager_feats.shape[:2] == (len(SENTS), n_layers)
    assert ops.backend_label("auto", "cpu") in ("fused-cpu", "reference")
    valid = batch.inputs["attention_mask"].bool()
    torch.testing.assert_close(got_out[valid], eager_out[valid], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_feats, eager_feats, atol=1e-5, rtol=1e-4)
