"""attnkit as a transformers attention implementation: equal to eager, and features equal to an
independent computation from `output_attentions` maps."""
import numpy as np
import pytest
import torch
from transformers import (
    AutoModel,
    BertConfig,
    BertModel,
)

import attnkit
from attnkit.errors import AttnkitError
from attnkit.models import default_model_path

from .conftest import SENTENCES
from .synthetic import features_from_maps, padded_inputs, tiny_config, tiny_encoder


@pytest.mark.parametrize("kind", ["bert", "roberta", "electra", "distilbert"])
def test_tiny_models_equal_eager(kind):
    model = tiny_encoder(kind)
    inputs = padded_inputs(120, (9, 5, 1))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expect = model(**inputs).last_hidden_state
    attnkit.instrument(model)
    assert len(model._attnkit_modules) == 2
    assert [m.layer_idx for m in model._attnkit_modules] == [0, 1]
    with torch.no_grad():
        got = model(**inputs).last_hidden_state
    valid = inputs["attention_mask"].bool()
    assert (got - expect)[valid].abs().max().item() <= 1e-5


def test_minilm_equals_eager_with_padding(minilm, minilm_eager):
    """≤ 1e-5 on every real token. Padding positions are compared too, against PyTorch's own spread:
    their outputs carry no meaning and amplify fp32 rounding (SDPA itself differs from eager there by
    ~1.4e-5 on this batch, 10x more than on real tokens)."""
    model, tok = minilm
    eager = minilm_eager
    sdpa = AutoModel.from_pretrained(default_model_path(), attn_implementation="sdpa").eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    real = enc["attention_mask"].bool()
    assert (~real).any()
    with torch.no_grad():
        expect = eager(**enc).last_hidden_state
        diff = (model(**enc).last_hidden_state - expect).abs()
        sdpa_diff = (sdpa(**enc).last_hidden_state - expect).abs()
    assert diff[real].max().item() <= 1e-5
    assert diff[~real].max().item() <= max(2 * sdpa_diff[~real].max().item(), 1e-5)


def test_unsupported_model_is_refused_by_name():
    from transformers import DebertaV2Config, DebertaV2Model

    model = DebertaV2Model(DebertaV2Config(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=64)).eval()
    with pytest.raises(AttnkitError, match="deberta-v2"):
        attnkit.instrument(model)


def test_decoder_is_refused():
    model = BertModel(BertConfig(**tiny_config(), is_decoder=True)).eval()
    with pytest.raises(AttnkitError, match="decoder"):
        attnkit.instrument(model)


def test_extract_matches_independent_features_from_output_attentions(minilm, minilm_eager):
    model, tok = minilm
    texts = SENTENCES[:3] + [(SENTENCES[3], SENTENCES[4])]
    nw = 8
    feats = attnkit.extract(texts, (model, tok), num_windows=nw, max_length=32, backend="reference", batch_size=2)
    eager = minilm_eager
    from attnkit.tokens import Encoder

    batch = Encoder(tok, max_length=32)(texts)
    with torch.no_grad():
        attn = [a.numpy() for a in eager(**batch.inputs, output_attentions=True).attentions]
    per = features_from_maps(attn, batch.lengths.tolist(), batch.token_class.numpy(), batch.sentence_id.numpy(), nw)
    assert feats.n_samples == 4 and feats.n_tokens == int(batch.lengths.sum())
    np.testing.assert_allclose(feats.mean, per.mean(0), atol=1e-5)
    np.testing.assert_allclose(feats.std, per.std(0), atol=1e-5)
    assert feats.names == attnkit.feature_names(nw)


def test_model_outputs_do_not_change_while_measuring(minilm):
    model, tok = minilm
    from attnkit.engine import forward_features, measuring
    from attnkit.tokens import Encoder

    batch = Encoder(tok)(SENTENCES)
    with torch.no_grad():
        plain = model(**batch.inputs).last_hidden_state
    with measuring(model, backend="reference") as rt:
        f = forward_features(model, batch, rt)
    assert f.shape == (len(SENTENCES), 6, 12, len(attnkit.feature_names()))
    with torch.no_grad():
        again = model(**batch.inputs).last_hidden_state
    assert torch.equal(plain, again)
