"""Every encoder family attnkit names (tests/synthetic.py: ENCODER_KINDS: BERT, RoBERTa, ELECTRA, DistilBERT, XLM-R,
CamemBERT), tiny and random, through attnkit attention, pruned and not: hidden states and maps on request against
the same model with eager attention; features against features computed here from eager's maps; norm-weighted
features against value vectors and output projections taken from the eager model here. The inputs carry
`token_type_ids` of a text pair, as a BERT tokenizer gives them, for every family: DistilBERT hands them on to its
attention function (issue 34: it was refused there). Then the same through `attnkit.extract` with a WordPiece
tokenizer and through the command line on a saved DistilBERT, and the refusals that stay: an attention argument that
changes attention, and a model that runs one attention module for several layers (ALBERT)."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.features import CLS, COMMA, OTHER, PERIOD, SEP
from attnkit.models import runtime_of
from attnkit.tokens import Batch

from .synthetic import ENCODER_KINDS, CallCounter, features_from_maps, padded_inputs, tiny_bert, tiny_encoder

VOCAB = 120
LENGTHS = (9, 6, 1)
N_LAYERS = 3
N_HEADS = 4
# removed when pruned: layer 1 loses every head, layers 0 and 2 some
PRUNED = [(0, 1), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 2)]
NW = 4


def kept_of(pruned: bool) -> list[list[int]]:
    """Per layer the heads the model has, in the unpruned numbering (written out here, not read from attnkit)."""
    gone = set(PRUNED) if pruned else set()
    return [[h for h in range(N_HEADS) if (layer, h) not in gone] for layer in range(N_LAYERS)]


def inputs() -> dict:
    """A padded batch whose token_type_ids mark a text pair (segment B from position 4)."""
    return padded_inputs(VOCAB, LENGTHS, pair=True)


@pytest.fixture(scope="module", params=[(k, p) for k in ENCODER_KINDS for p in (False, True)],
                ids=lambda kp: f"{kp[0]}-{'pruned' if kp[1] else 'full'}")
def pair(request):
    """(kind, pruned, eager model, the same weights with attnkit attention)"""
    from attnkit.arch import prune_heads

    kind, pruned = request.param
    eager = tiny_encoder(kind, n_layers=N_LAYERS, vocab=VOCAB)
    with torch.no_grad():  # sharper attention than the default init, so heads differ
        for name, p in eager.named_parameters():
            if name.endswith(("query.weight", "q_lin.weight")):
                p.mul_(6.0)
    if pruned:
        prune_heads(eager, PRUNED)
    eager.set_attn_implementation("eager")
    return kind, pruned, eager, attnkit.instrument(copy.deepcopy(eager))


def test_hidden_states_and_maps_equal_eager(pair):
    kind, pruned, eager, ours = pair
    enc = inputs()
    with torch.no_grad(), runtime_of(ours).attached(CallCounter()) as counter:
        e = eager(**enc, output_attentions=True, output_hidden_states=True)
        o = ours(**enc, output_attentions=True, output_hidden_states=True)
    assert counter.calls == N_LAYERS  # every layer went through attnkit
    valid = enc["attention_mask"].bool()
    for a, b in zip(e.hidden_states, o.hidden_states, strict=True):
        torch.testing.assert_close(b[valid], a[valid], atol=1e-5, rtol=1e-5)
    both = valid[:, None, :, None] & valid[:, None, None, :]
    assert len(o.attentions) == N_LAYERS
    want = eager_maps(e.attentions, pruned)
    for layer, (a, b) in enumerate(zip(want, o.attentions)):
        kept = kept_of(pruned)[layer]
        assert b.shape == (len(LENGTHS), N_HEADS, max(LENGTHS), max(LENGTHS))  # maps cover the unpruned heads
        assert a.shape[1] == len(kept)
        got = b[:, kept]
        m = both.expand_as(got)
        torch.testing.assert_close(got[m], a[m], atol=1e-6, rtol=1e-5)
        assert float(b[:, [h for h in range(N_HEADS) if h not in kept]].abs().sum()) == 0.0  # removed: all zero
        assert float(b[~valid[:, None, None, :].expand_as(b)].abs().sum()) == 0.0  # no weight on padding


def eager_maps(attentions, pruned: bool) -> list[torch.Tensor]:
    """Eager's maps per layer: transformers leaves out the map of a layer with no head left (its attention returns
    none); here it is B × 0 × L × L."""
    it = iter(attentions)
    out = []
    for kept in kept_of(pruned):
        out.append(next(it) if kept else torch.zeros(len(LENGTHS), 0, max(LENGTHS), max(LENGTHS)))
    assert next(it, None) is None
    return out


def batch_of(enc: dict) -> Batch:
    """An attnkit Batch of `enc`: CLS first, SEP closing each segment (position 3 and the last token), a comma and
    a period where the ids say so; sentence 1 from position 4 on."""
    ids, mask = enc["input_ids"], enc["attention_mask"]
    lengths = mask.sum(-1)
    cls = torch.full(ids.shape, OTHER, dtype=torch.int32)
    cls[ids % 11 == 0] = COMMA
    cls[ids % 13 == 0] = PERIOD
    cls[:, 3] = SEP
    cls[torch.arange(len(LENGTHS)), lengths - 1] = SEP
    cls[:, 0] = CLS
    sent = (torch.arange(ids.shape[1])[None] >= 4).int().expand_as(ids).contiguous()
    return Batch(dict(enc), lengths, cls, sent, 0)


def spread(per_kept: np.ndarray, pruned: bool) -> np.ndarray:
    """Samples × layers × kept heads × F (a list per layer) as samples × layers × heads × F, NaN for removed heads."""
    out = np.full((len(LENGTHS), N_LAYERS, N_HEADS, per_kept[0].shape[-1]), np.nan)
    for layer, kept in enumerate(kept_of(pruned)):
        out[:, layer, kept] = per_kept[layer]
    return out


def eager_features(maps, batch) -> np.ndarray:
    per_layer = []
    for a in maps:  # a layer with no head left has no features
        if a.shape[1] == 0:
            per_layer.append(np.zeros((len(LENGTHS), 0, 5 + NW + 7)))
            continue
        per_layer.append(features_from_maps([a], batch.lengths.tolist(), batch.token_class.numpy(),
                                            batch.sentence_id.numpy(), NW)[:, 0])
    return per_layer


def test_features_equal_those_of_eager_maps(pair):
    kind, pruned, eager, ours = pair
    from attnkit.engine.forward import forward_features, measuring

    enc = inputs()
    batch = batch_of(enc)
    with measuring(ours, backend="auto", num_windows=NW):
        feats = forward_features(ours, batch).numpy()
    with torch.no_grad():
        maps = [a.numpy() for a in eager_maps(eager(**enc, output_attentions=True).attentions, pruned)]
    want = spread(eager_features(maps, batch), pruned)
    assert feats.shape == want.shape
    np.testing.assert_array_equal(np.isnan(feats), np.isnan(want))  # removed heads: NaN, never 0
    np.testing.assert_allclose(feats, want, atol=2e-5)


def projections(model, kind):
    """Per layer (value projection, output projection) of an encoder of `kind`, named here per family."""
    if kind == "distilbert":
        return [(lay.attention.v_lin, lay.attention.out_lin) for lay in model.transformer.layer]
    return [(lay.attention.self.value, lay.attention.output.dense) for lay in model.encoder.layer]


def test_norm_weighting_equals_value_norms_of_eager(pair):
    kind, pruned, eager, ours = pair
    from attnkit.engine.forward import forward_features, measuring

    enc = inputs()
    batch = batch_of(enc)
    with measuring(ours, num_windows=NW, weighting="norm"):
        feats = forward_features(ours, batch).numpy()
    values = {}
    parts = projections(eager, kind)
    hooks = [v.register_forward_hook(lambda m, i, o, layer=layer: values.__setitem__(layer, o.detach()))
             for layer, (v, _) in enumerate(parts)]
    with torch.no_grad():
        maps = eager_maps(eager(**enc, output_attentions=True).attentions, pruned)
    for h in hooks:
        h.remove()
    D = 32 // N_HEADS
    weighted = []
    for layer, (a, (_, out)) in enumerate(zip(maps, parts)):
        h_kept = a.shape[1]
        if not h_kept:  # a layer with no head left computes no values
            weighted.append(a.numpy())
            continue
        v = values[layer].unflatten(-1, (h_kept, D))  # B × L × kept × D
        W = out.weight.detach()  # hidden × kept·D
        norms = torch.stack([(v[:, :, j] @ W[:, j * D:(j + 1) * D].T).norm(dim=-1) for j in range(h_kept)], 1)
        scaled = a * norms[:, :, None, :]
        weighted.append((scaled / scaled.sum(-1, keepdim=True).clamp_min(1e-30)).numpy())
    want = spread(eager_features(weighted, batch), pruned)
    np.testing.assert_array_equal(np.isnan(feats), np.isnan(want))
    np.testing.assert_allclose(feats, want, atol=2e-5)
    with measuring(ours, num_windows=NW):
        plain = forward_features(ours, batch).numpy()
    assert np.nanmax(np.abs(plain - feats)) > 1e-3  # the weighting changed the features


@pytest.mark.parametrize("weighting", ["attention", "norm"])
@pytest.mark.parametrize("kind", ENCODER_KINDS)
def test_extract_with_a_wordpiece_tokenizer(kind, weighting):
    """`attnkit.extract` as the command line runs it: a BERT tokenizer hands every model `token_type_ids`; the
    features of each family equal those computed here from eager's maps on the same tokens (attention weighting),
    and norm weighting runs and differs from them."""
    from attnkit.tokens import Encoder

    _, tok = tiny_bert()
    eager = tiny_encoder(kind, vocab=VOCAB)
    eager.set_attn_implementation("eager")
    texts = ["the cat sat on the mat, and the dog ran.", ("is it here?", "the red house is here."), "a dog."]
    feats = attnkit.extract(texts, (copy.deepcopy(eager), tok), num_windows=NW, max_length=32, batch_size=2,
                            weighting=weighting)
    batch = Encoder(tok, max_length=32)(texts)
    assert "token_type_ids" in batch.inputs
    with torch.no_grad():
        maps = [a.numpy() for a in eager(**batch.inputs, output_attentions=True).attentions]
    per = features_from_maps(maps, batch.lengths.tolist(), batch.token_class.numpy(), batch.sentence_id.numpy(), NW)
    assert feats.n_samples == 3 and feats.meta["weighting"] == weighting
    if weighting == "attention":
        np.testing.assert_allclose(feats.mean, per.mean(0), atol=1e-5)
    else:
        assert np.isfinite(feats.mean).all() and np.abs(feats.mean - per.mean(0)).max() > 1e-3


def test_command_line_measures_a_distilbert_with_a_bert_tokenizer(tmp_path):
    """issue 34: a DistilBERT directory whose tokenizer gives token_type_ids was refused by `extract`, with
    `--weighting norm`, and once pruned."""
    from click.testing import CliRunner

    from attnkit.cli.main import main

    _, tok = tiny_bert()
    model = tiny_encoder("distilbert", vocab=len(tok))
    model.save_pretrained(tmp_path / "distil")
    tok.save_pretrained(tmp_path / "distil")
    assert json.loads((tmp_path / "distil" / "tokenizer_config.json").read_text())["tokenizer_class"] == "BertTokenizer"
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat.\nthe dog ran, and the cat sat.\n")
    runner = CliRunner()
    r = runner.invoke(main, ["prune", str(tmp_path / "distil"), "--heads", "L0H1,L1", "-o", str(tmp_path / "pruned")])
    assert r.exit_code == 0, r.output
    for name, model_dir in (("plain", "distil"), ("pruned", "pruned")):
        for weighting in ("attention", "norm"):
            out = tmp_path / f"{name}-{weighting}"
            r = runner.invoke(main, ["extract", str(corpus), "--model", str(tmp_path / model_dir), "--max-length",
                                     "32", "--weighting", weighting, "-o", str(out), "--device", "cpu"])
            assert r.exit_code == 0, r.output
            mean = np.load(out / "features.npz")["mean"]
            assert mean.shape[:2] == (2, 4)
            assert np.isnan(mean[1]).all() == (name == "pruned") and np.isfinite(mean[0, 0]).all()


def test_an_argument_that_changes_attention_is_still_refused_by_name():
    from attnkit.hf_attention import attnkit_attention

    model = attnkit.instrument(tiny_encoder("distilbert"))
    mod = model.transformer.layer[0].attention
    q = torch.randn(1, 4, 3, 8)
    out, _ = attnkit_attention(mod, q, q, q, None, scaling=0.3, token_type_ids=torch.zeros(1, 3, dtype=torch.long),
                               num_items_in_batch=torch.tensor(3))
    assert out.shape == (1, 3, 4, 8)
    for name, value in (("cu_seq_lens_q", torch.tensor([0, 3])), ("seq_idx", torch.zeros(1, 3, dtype=torch.int32))):
        with pytest.raises(AttnkitError, match=f"DistilBertSelfAttention passes '{name}' to its attention function, "
                                               "which attnkit does not know"):
            attnkit_attention(mod, q, q, q, None, scaling=0.3, **{name: value})


def test_one_attention_module_for_several_layers_is_refused():
    """ALBERT runs one shared layer N times: attnkit numbers features, maps and interventions by attention module,
    so every layer would land on layer 0 (a model of 1 layer, silently). It is refused by name."""
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    model = AlbertModel(AlbertConfig(vocab_size=VOCAB, embedding_size=8, hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_size=64)).eval()
    with pytest.raises(AttnkitError, match="'albert' runs one attention module .*AlbertAttention.* for 3 layers"):
        attnkit.instrument(model)
