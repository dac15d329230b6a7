"""The features of a forward go into one buffer made before the forward (attnkit.hf_attention.LayerFeatures,
attnkit.engine.forward.forward_features): a tensor kept per layer would sit in the holes glibc's heap keeps for
the activations and make it grow (docs/decoders.md §7)."""
from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.hf_attention import LayerFeatures
from attnkit.models import attention_modules, runtime_of
from tests.synthetic import tiny_bert, tiny_decoder


def _batch(model, B=3, L=7, seed=0):
    from attnkit.tokens import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, min(100, model.config.vocab_size), (B, L), generator=g)
    lengths = torch.tensor([L, L - 2, 1][:B])
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    return Batch({"input_ids": ids, "attention_mask": mask}, lengths, torch.zeros(B, L, dtype=torch.long),
                 torch.zeros(B, L, dtype=torch.int32), 0)


@pytest.mark.parametrize("kind", ["bert", "llama", "gpt_oss"])
def test_every_layer_is_written_into_the_buffer_made_before_the_forward(kind):
    from attnkit.engine.forward import forward_features, measuring

    model = attnkit.instrument(tiny_bert()[0] if kind == "bert" else tiny_decoder(kind))
    rt = runtime_of(model)
    seen = []
    hook = attention_modules(model)[0].register_forward_pre_hook(
        lambda *_: seen.append((rt.features.stacked().data_ptr(), tuple(rt.features.stacked().shape))))
    batch = _batch(model)
    with measuring(model, num_windows=4):
        feats = forward_features(model, batch)
        hook.remove()
        # the per-layer features of a forward without the buffer (one layer's tensor each), for the numbers
        rt.features = {}
        with rt.batch_of(batch), torch.inference_mode():
            model(**batch.inputs)
        per_layer = torch.stack([rt.features[i] for i in range(len(attention_modules(model)))], dim=1)
    assert seen == [(feats.data_ptr(), tuple(feats.shape))]  # made before layer 0 ran, never remade
    assert feats.shape[:3] == (3, len(attention_modules(model)), model.config.num_attention_heads)
    torch.testing.assert_close(feats, per_layer, rtol=0, atol=0)


def test_layer_features_refuse_what_does_not_fit():
    lf = LayerFeatures(3, (2, 4, 5))
    assert 0 not in lf and 3 not in lf and -1 not in lf
    with pytest.raises(KeyError):
        lf[0]
    with pytest.raises(AttnkitError, match="layer 3.*3 attention layers"):
        lf[3] = torch.zeros(2, 4, 5)
    lf[1] = torch.ones(2, 4, 5)
    assert 1 in lf and torch.equal(lf[1], torch.ones(2, 4, 5))
    with pytest.raises(AttnkitError, match=r"layer 2 produced features of shape \(2, 3, 5\).*\(2, 4, 5\)"):
        lf[2] = torch.zeros(2, 3, 5)


def test_a_first_layer_of_another_shape_remakes_the_buffer():
    lf = LayerFeatures(2, (2, 4, 5))  # a wrong guess: the first layer's features decide
    lf[0] = torch.full((2, 3, 6), 2.0)
    lf[1] = torch.full((2, 3, 6), 3.0)
    out = lf.stacked()
    assert out.shape == (2, 2, 3, 6)
    assert torch.equal(out[:, 0], torch.full((2, 3, 6), 2.0)) and torch.equal(out[:, 1], torch.full((2, 3, 6), 3.0))


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_the_forward_ends_once_the_last_attention_layer_has_measured(kind):
    """forward_features reads only the features: the last layer's output projection and MLP and the model's final
    norm do not run (attnkit.attention.runtime.Runtime.stop_when_measured); a plain forward afterwards runs whole."""
    from attnkit.caching import encoder_layers
    from attnkit.engine.forward import forward_features, measuring

    model = attnkit.instrument(tiny_bert()[0] if kind == "bert" else tiny_decoder(kind))
    rt = runtime_of(model)
    last = encoder_layers(model)[-1]
    calls = []
    hooks = [last.register_forward_pre_hook(lambda *_: calls.append("enter")),
             last.register_forward_hook(lambda *_: calls.append("leave"))]
    batch = _batch(model)
    with measuring(model, num_windows=4):
        feats = forward_features(model, batch)
    assert calls == ["enter"]
    assert feats.shape[1] == len(attention_modules(model)) and torch.isfinite(feats).all()
    assert not rt.stop_when_measured and rt.open_forwards == 0 and attnkit.process_changes() == []
    with torch.inference_mode():
        model(**batch.inputs)
    assert calls == ["enter", "enter", "leave"]
    for h in hooks:
        h.remove()
