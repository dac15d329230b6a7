"""Maps on request: `output_attentions=True` on an instrumented model returns every layer's maps, equal to eager
attention, and under an intervention the weights the model used; `attnkit.attention_maps` gives one text's."""
import copy

import numpy as np
import pytest
import torch
from transformers import AutoModel

import attnkit
import attnkit.attention.maps as maps_step
from attnkit.errors import AttnkitError
from attnkit.models import default_model_path

from .synthetic import padded_inputs, tiny_encoder


@pytest.mark.parametrize("kind", ["bert", "roberta", "electra", "distilbert"])
def test_output_attentions_equal_eager_with_padding(kind):
    model = tiny_encoder(kind)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    attnkit.instrument(model)
    inputs = padded_inputs(120, (9, 5, 1))
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True).attentions
        got = model(**inputs, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape == (3, 4, 9, 9)
        assert (g - w).abs().max().item() <= 1e-6
    # the tuple form of the output carries them too
    with torch.no_grad():
        as_tuple = model(**inputs, output_attentions=True, return_dict=False)
    in_tuple = [x for x in as_tuple if isinstance(x, tuple) and len(x) == 2]  # the attentions (not cross-attentions)
    assert len(in_tuple) == 1 and torch.equal(in_tuple[0][1], got[1])


def test_no_map_is_computed_unless_asked(monkeypatch):
    model = attnkit.instrument(tiny_encoder("bert"))
    calls = []
    real = maps_step.attention_weights
    monkeypatch.setattr(maps_step, "attention_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        out = model(**padded_inputs(120, (9, 5, 1)))
    assert calls == [] and not out.attentions
    with torch.no_grad():
        model(**padded_inputs(120, (9, 5, 1)), output_attentions=True)
    assert len(calls) == 2  # one per layer, only when asked


def _eager_maps(kind, inputs):
    eager = tiny_encoder(kind)  # the same seed: the same weights as the instrumented copy
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        return eager(**inputs, output_attentions=True).attentions


@pytest.mark.parametrize("renormalize", [False, True])
def test_maps_under_an_intervention_are_the_weights_the_model_used(renormalize):
    """Last layer: head 0 zeroed, head 1 uniform, head 2 loses its inter-sentence weight, head 3 kept. The first
    layer is untouched, so the last layer's scores are eager's and the expected maps follow from eager's maps."""
    model = attnkit.instrument(tiny_encoder("bert"))
    inputs = padded_inputs(120, (9, 6))
    types = torch.zeros_like(inputs["input_ids"])
    types[0, 4:9], types[1, 3:6] = 1, 1  # two segments per sample
    inputs["token_type_ids"] = types
    want = _eager_maps("bert", inputs)
    iv = attnkit.Intervention.for_model(model).set(1, 0, mode="zero").set(1, 1, mode="uniform")
    iv.set(1, 2, region="no_inter")
    iv.renormalize = renormalize
    with attnkit.intervene(model, iv), torch.no_grad():
        got = model(**inputs, output_attentions=True).attentions
    assert (got[0] - want[0]).abs().max().item() <= 1e-6  # layer 0: no intervention
    lengths = inputs["attention_mask"].sum(1)
    valid_key = inputs["attention_mask"].bool()[:, None, :]  # B×1×L
    assert got[1][:, 0].abs().max().item() == 0.0
    uniform = valid_key.float() / lengths[:, None, None]
    assert torch.allclose(got[1][:, 1], uniform.expand_as(got[1][:, 1]), atol=1e-7)
    same = types[:, :, None] == types[:, None, :]
    kept = want[1][:, 2] * same
    if renormalize:
        kept = kept / kept.sum(-1, keepdim=True)
    assert (got[1][:, 2] - kept).abs().max().item() <= 1e-6
    assert (got[1][:, 3] - want[1][:, 3]).abs().max().item() <= 1e-6


def test_attention_maps_of_one_text_equal_eager(minilm, minilm_eager):
    model, tok = minilm
    eager = minilm_eager
    for text in ("The cat sat on the mat.", ("Where is the cat?", "The cat sat on the mat.")):
        maps = attnkit.attention_maps(text, minilm)
        enc = tok(*((text,) if isinstance(text, str) else text), return_tensors="pt")
        with torch.no_grad():
            want = torch.stack(eager(**enc, output_attentions=True).attentions)[:, 0].numpy()
        n = enc["input_ids"].shape[1]
        assert maps.weights.shape == (6, 12, n, n) and maps.weights.dtype == np.float32
        assert np.abs(maps.weights - want).max() <= 1e-5
        assert maps.tokens == tok.convert_ids_to_tokens(enc["input_ids"][0].tolist())
        assert np.allclose(maps.head(2, 5).sum(-1), 1.0, atol=1e-5)
        df = maps.to_pandas(2, 5)
        assert df.shape == (n, n) and df.index[0] == "0:[CLS]"
        assert repr(maps).startswith(f"AttentionMaps(6 layers × 12 heads, {n} tokens: [CLS]")


def test_attention_maps_under_an_intervention_and_bad_input(minilm):
    iv = attnkit.Intervention.for_model(minilm[0]).set(5, 3, mode="uniform")
    maps = attnkit.attention_maps("A short text.", minilm, intervention=iv)
    n = len(maps.tokens)
    assert np.allclose(maps.head(5, 3), 1.0 / n, atol=1e-7)
    assert not np.allclose(maps.head(5, 2), 1.0 / n, atol=1e-3)
    with pytest.raises(AttnkitError, match="^text must be a string or a pair of strings"):
        attnkit.attention_maps(["a", "b", "c"], minilm)
    with pytest.raises(AttnkitError, match="outside this model's 6 layers × 12 heads"):
        maps.head(6, 0)
    assert len(attnkit.attention_maps("word " * 300, minilm, max_length=16).tokens) == 16


def test_a_model_loaded_with_attnkit_attention_can_be_intervened_without_instrument(minilm):
    model = AutoModel.from_pretrained(default_model_path(), attn_implementation="attnkit").eval()
    enc = minilm[1](["The cat sat on the mat."], return_tensors="pt")
    iv = attnkit.Intervention.for_model(model).set(0, None, mode="zero")
    with torch.no_grad():
        plain = model(**enc).last_hidden_state
        with attnkit.intervene(model, iv):
            changed = model(**enc).last_hidden_state
        with attnkit.intervene(minilm[0], iv):
            reference = minilm[0](**enc).last_hidden_state
    assert (changed - plain).abs().max().item() > 1e-2
    assert (changed - reference).abs().max().item() <= 1e-5


def test_a_model_with_other_attention_is_refused_saying_why():
    model = AutoModel.from_pretrained(default_model_path(), attn_implementation="sdpa").eval()
    iv = attnkit.Intervention.for_model(model)
    with pytest.raises(AttnkitError, match="runs 'sdpa' attention, which attnkit cannot measure or change: load it "
                                           "with attn_implementation=\"attnkit\", or call attnkit.instrument"):
        with attnkit.intervene(model, iv):
            pass


@pytest.mark.parametrize("name", ["bert-base-uncased", "google-bert/bert-base-uncased"])
def test_a_hub_id_gets_told_how_to_download(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AttnkitError, match=f"looks like a Hugging Face Hub id.*`hf download {name} --local-dir "
                                           "DIR`.*then pass DIR"):
        attnkit.load_model(name)
    with pytest.raises(AttnkitError, match="not found: give a local directory"):
        attnkit.load_model(str(tmp_path / "no" / "such" / "dir"))
