"""Norm-weighted features (Kobayashi et al. 2020; docs/features.md, "Norm-weighted features").

`attnkit.extract(..., weighting="norm")` against an eager computation written here: a plain transformers model
with eager attention returns the weights α, hooks catch the value vectors, and per head the vectors
α_{s,t}·f_h(x_t) = α_{s,t}·(x_t W_V^h + b_V^h) W_O^h are built in full (B × H × L × L × hidden) and their norms
normalised per row; the features are then computed here from those rows. Tiny BERT, RoBERTa and DistilBERT, with
padding and text pairs; the per-key norms alone, the op's CPU kernel with a key scale against the reference, and
the hand-computed example of docs/features.md.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertModel,
    DistilBertConfig,
    DistilBertModel,
    DistilBertTokenizerFast,
    RobertaConfig,
    RobertaModel,
)

import attnkit
from attnkit import ops
from attnkit.arch.norms import key_norms
from attnkit.errors import AttnkitError
from attnkit.features import CLS, OTHER, SEP
from attnkit.models import default_model_path
from attnkit.reference import reference_attention

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TEXTS = ["The cat sat on the mat, and the dog slept.", "Short one.",
         ("Where did the cat sit?", "The cat sat on the mat. It was warm!"),
         ("Who slept?", "The dog, tired, slept.")]


def sharpen(layers_qk):
    with torch.no_grad():
        for q in layers_qk:
            q.weight.mul_(6.0)


def tiny(kind, roberta_tokenizer=None):
    """(model, tokenizer, per layer: (value Linear, output projection Linear)) — written out per architecture
    here, independently of attnkit's own mapping."""
    torch.manual_seed(0)
    if kind == "bert":
        tok = AutoTokenizer.from_pretrained(default_model_path())
        model = BertModel(BertConfig(vocab_size=tok.vocab_size, max_position_embeddings=64, **TINY)).eval()
        parts = [(lay.attention.self.value, lay.attention.output.dense) for lay in model.encoder.layer]
        sharpen(lay.attention.self.query for lay in model.encoder.layer)
    elif kind == "roberta":
        tok = roberta_tokenizer
        model = RobertaModel(RobertaConfig(vocab_size=len(tok), max_position_embeddings=66, type_vocab_size=1,
                                           pad_token_id=1, bos_token_id=0, eos_token_id=2, **TINY)).eval()
        parts = [(lay.attention.self.value, lay.attention.output.dense) for lay in model.encoder.layer]
        sharpen(lay.attention.self.query for lay in model.encoder.layer)
    else:
        tok = DistilBertTokenizerFast.from_pretrained(default_model_path())
        model = DistilBertModel(DistilBertConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4,
                                                 hidden_dim=64, max_position_embeddings=64)).eval()
        parts = [(lay.attention.v_lin, lay.attention.out_lin) for lay in model.transformer.layer]
        sharpen(lay.attention.q_lin for lay in model.transformer.layer)
    return model, tok, parts


def token_classes(tok, ids):
    cls_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    sep_ids = {tok.sep_token_id, tok.eos_token_id} - {None}
    out = []
    for t, s in zip(ids, tok.convert_ids_to_tokens(ids)):
        out.append("cls" if t == cls_id else "sep" if t in sep_ids else "comma" if s == "," else
                   "period" if s == "." else "other")
    return out


def eager_norm_features(model, tok, parts, texts):
    """Per text: {feature: value} from norm-weighted rows, computed from eager attention and hooks."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    e_parts = [(dict(eager.named_modules())[_name(model, v)], dict(eager.named_modules())[_name(model, o)])
               for v, o in parts]
    H = model.config.num_attention_heads
    rows = []
    for group in ([t for t in texts if isinstance(t, str)], [t for t in texts if not isinstance(t, str)]):
        if not group:
            continue
        enc = (tok(group, padding=True, return_tensors="pt") if isinstance(group[0], str)
               else tok([a for a, _ in group], [b for _, b in group], padding=True, return_tensors="pt"))
        assert (enc["attention_mask"] == 0).any()  # the group has padding
        enc = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        values = {}
        hooks = [v.register_forward_hook(lambda m, i, o, l=l, values=values: values.__setitem__(l, o.detach()))
                 for l, (v, _) in enumerate(e_parts)]
        with torch.no_grad():
            out = eager(**enc, output_attentions=True)
        for h in hooks:
            h.remove()
        for b in range(enc["input_ids"].shape[0]):
            n = int(enc["attention_mask"][b].sum())
            classes = token_classes(tok, enc["input_ids"][b, :n].tolist())
            sample = np.zeros((len(e_parts), H, 8))
            for l, (_, o) in enumerate(e_parts):
                alpha = out.attentions[l][b, :, :n, :n].double()  # H × n × n
                D = values[l].shape[-1] // H
                v = values[l][b, :n].double().view(n, H, D)
                W = o.weight.detach().double()  # hidden × H·D
                fx = torch.stack([v[:, h] @ W[:, h * D:(h + 1) * D].T for h in range(H)])  # H × n × hidden
                vec = alpha[..., None] * fx[:, None, :, :]  # H × n(query) × n(key) × hidden: α_{s,t} f(x_t)
                norm = vec.norm(dim=-1)
                a = norm / norm.sum(-1, keepdim=True)
                for h in range(H):
                    sample[l, h] = row_features(a[h].numpy(), classes)
            rows.append(sample)
    return np.mean(rows, axis=0)


NAMES = ["cls", "sep", "comma", "period", "prev", "next", "entropy", "max"]


def row_features(a, classes):
    """The features of docs/features.md that read classes and neighbours, averaged over the n rows of `a`."""
    n = a.shape[0]
    f = np.zeros(8)
    for s in range(n):
        row = a[s]
        for j, c in enumerate(("cls", "sep", "comma", "period")):
            f[j] += sum(row[t] for t in range(n) if classes[t] == c)
        f[4] += row[s - 1] if s > 0 else 0.0
        f[5] += row[s + 1] if s + 1 < n else 0.0
        nz = row[row > 0]
        f[6] += -(nz * np.log(nz)).sum()
        f[7] += row.max()
    return f / n


def _name(model, module):
    return next(k for k, m in model.named_modules() if m is module)


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_norm_weighted_extraction_equals_eager_hooks(kind, backend, roberta_tokenizer):
    if backend == "fused" and not ops.has_kernel("cpu"):
        pytest.skip("extension not built")
    model, tok, parts = tiny(kind, roberta_tokenizer)
    expect = eager_norm_features(model, tok, parts, TEXTS)
    feats = attnkit.extract(TEXTS, (copy.deepcopy(model), tok), weighting="norm", backend=backend, batch_size=3,
                            max_length=40)
    got = np.stack([feats.feature(n) for n in NAMES], axis=-1)
    np.testing.assert_allclose(got, expect, atol=2e-5, rtol=0)
    assert feats.meta["weighting"] == "norm"
    plain = attnkit.extract(TEXTS, (copy.deepcopy(model), tok), backend=backend, batch_size=3, max_length=40)
    assert plain.meta["weighting"] == "attention"
    assert np.abs(plain.mean - feats.mean).max() > 1e-3  # the weighting changed the features


def test_key_norms_equal_the_direct_product():
    g = torch.Generator().manual_seed(0)
    B, H, L, D, hidden = 2, 3, 5, 4, 7
    v = torch.randn(B, H, L, D, generator=g)
    W = torch.randn(hidden, H * D, generator=g)
    direct = torch.stack([(v[:, h].double() @ W[:, h * D:(h + 1) * D].double().T).norm(dim=-1) for h in range(H)], 1)
    torch.testing.assert_close(key_norms(v, W).double(), direct, atol=1e-5, rtol=1e-5)
    assert key_norms(v.half(), W.half()).dtype == torch.float32
    with pytest.raises(AttnkitError, match=r"must have 3 heads × 4 = 12 columns, got shape \(7, 11\)"):
        key_norms(v, W[:, :11])


def test_worked_example_of_the_docs():
    """docs/features.md, "Norm-weighted features": one head, three tokens [CLS] word [SEP] with uniform attention
    1/3 and ‖f(x)‖ = 1, 4, 1: α' = 1/6, 4/6, 1/6 on every row, so cls = 1/6, sep = 1/6 (1/3 each by weight)."""
    q = torch.zeros(1, 1, 3, 2)  # q = 0: uniform weights
    k = torch.zeros(1, 1, 3, 2)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 4.0], [1.0, 0.0]]]])
    W_O = torch.eye(2)  # f(x) = v, so ‖f‖ = 1, 4, 1
    g = key_norms(v, W_O)
    torch.testing.assert_close(g, torch.tensor([[[1.0, 4.0, 1.0]]]))
    tc = torch.tensor([[CLS, OTHER, SEP]], dtype=torch.int32)
    _, f = reference_attention(q, k, v, torch.tensor([3]), tc, want_features=True, key_scale=g, num_windows=1)
    names = attnkit.feature_names(1)
    f = dict(zip(names, f[0, 0].tolist()))
    assert f["cls"] == pytest.approx(1 / 6) and f["sep"] == pytest.approx(1 / 6)
    assert f["self"] == pytest.approx(4 / 6 / 3)  # the word's own row: its self weight 4/6, over 3 rows
    assert f["max"] == pytest.approx(4 / 6)


def test_unknown_architecture_is_refused_for_norm_weighting():
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    model = AlbertModel(AlbertConfig(vocab_size=99, embedding_size=8, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)).eval()
    tok = AutoTokenizer.from_pretrained(default_model_path())
    try:
        attnkit.instrument(model)
    except AttnkitError:
        pytest.skip("ALBERT does not route attention through the interface in this transformers version")
    with pytest.raises(AttnkitError, match="norm weighting needs to know where a 'albert' model keeps its attention "
                                           "projections; supported model types: bart, bert, camembert, clip_vision_model"):
        attnkit.extract(["a b"], (model, tok), weighting="norm", max_length=16)
    with pytest.raises(AttnkitError, match="unknown weighting 'l2': use 'attention' or 'norm'"):
        attnkit.extract(["a b"], (model, tok), weighting="l2", max_length=16)


# --- the fused CPU kernel with a key scale, against the reference ----------------------------------------
needs_kernel = pytest.mark.skipif(not ops.has_kernel("cpu"), reason="extension not built")


def _inputs(B, H, L, D=16, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L, H, D, generator=g).transpose(1, 2) for _ in range(3))
    lengths = torch.tensor(lengths if lengths is not None else [L] * B)
    tc = torch.randint(0, 5, (B, L), generator=g, dtype=torch.int32)
    tc[:, 0] = CLS
    sid = torch.randint(0, 2, (B, L), generator=g, dtype=torch.int32)
    scale = torch.rand(B, H, L, generator=g) * 3
    return q, k, v, lengths, tc, sid, scale


def _both(q, k, v, lengths, tc, sid, scale, **kw):
    out_f, f_f = ops.attention(q, k, v, lengths, tc, sid, want_features=True, key_scale=scale, backend="fused", **kw)
    out_r, f_r = reference_attention(q, k, v, lengths, tc, sid, want_features=True, key_scale=scale, **kw)
    torch.testing.assert_close(out_f, out_r, atol=2e-6, rtol=0)
    np.testing.assert_allclose(f_f.numpy(), f_r.numpy(), atol=1e-5, rtol=0)
    return f_f


@needs_kernel
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_key_scale_with_every_mode_and_region(renormalize):
    q, k, v, lengths, tc, sid, scale = _inputs(3, 9, 37, lengths=[37, 20, 1])
    mode = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=torch.int32)
    region = torch.tensor([0, 1, 2] * 3, dtype=torch.int32)
    feats = _both(q, k, v, lengths, tc, sid, scale, mode=mode, region=region, renormalize=renormalize)
    assert (feats[:, 3:6] == 0).all()  # zeroed heads: every feature 0, whatever the scale


@needs_kernel
def test_fused_key_scale_zeros_padding_and_one_token():
    q, k, v, lengths, tc, sid, scale = _inputs(3, 2, 24, lengths=[24, 9, 1], seed=3)
    scale[0, 0, 5:15] = 0.0  # keys that count nothing
    scale[1, 1] = 0.0  # a whole row of zeros stays 0
    scale[1, :, 9:] = float("nan")  # padding: never read
    scale[2, :, 1:] = float("nan")
    feats = _both(q, k, v, lengths, tc, sid, scale)
    assert (feats[1, 1] == 0).all()
    n1 = feats[2]  # one token: all weight on it (it is [CLS]) whatever its scale
    names = attnkit.feature_names()
    assert n1[:, names.index("cls")].tolist() == pytest.approx([1.0, 1.0])


@needs_kernel
def test_fused_uniform_scale_is_plain_attention():
    q, k, v, lengths, tc, sid, _ = _inputs(2, 3, 50, lengths=[50, 17], seed=5)
    scaled = _both(q, k, v, lengths, tc, sid, torch.full((2, 3, 50), 2.5))
    plain = ops.attention(q, k, v, lengths, tc, sid, want_features=True, backend="fused")[1]
    np.testing.assert_allclose(scaled.numpy(), plain.numpy(), atol=1e-5, rtol=0)



# --- the command line: meta.json, resume, compare, report ---------------------------------------------------------
def _run(*args):
    from click.testing import CliRunner

    from attnkit.cli.main import main

    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """One corpus extracted with the embedded MiniLM under both weightings."""
    d = tmp_path_factory.mktemp("weightings")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(f"The river {i} was wide, and the bridge was long. [It] held." for i in range(12)))
    for w in ("attention", "norm"):
        code, text = _run("extract", corpus, "-o", d / w, "--weighting", w, "--max-length", 24, "-q",
                          "--batch-size", 4)
        assert code == 0, text
    return d, corpus


def test_runs_record_their_weighting_and_resume_refuses_another(two_runs, tmp_path):
    import json

    from attnkit.features import weighting_of
    from attnkit.run.head_features import FeatureAccumulator
    from attnkit.run.rundir import RunDir

    d, corpus = two_runs
    meta = {w: json.loads((d / w / "meta.json").read_text()) for w in ("attention", "norm")}
    assert meta["norm"]["weighting"] == "norm" and meta["norm"]["settings"]["weighting"] == "norm"
    assert meta["attention"]["weighting"] == "attention" and "weighting" not in meta["attention"]["settings"]
    assert weighting_of({}) == "attention"  # runs from before norm weighting
    for saved, now in (("attention", "norm"), ("norm", "attention")):
        ck = tmp_path / f"ck-{saved}"
        acc = FeatureAccumulator(6, 12, meta[saved]["feature_names"])
        acc.update(np.full((4, 6, 12, 28), 0.5), 40)
        RunDir(ck).save_checkpoint(acc, 4, 0, meta[saved]["settings"])
        code, text = _run("extract", corpus, "-o", ck, "--weighting", now, "--max-length", 24, "-q", "--batch-size",
                          4, "--resume")
        assert code == 1 and "other settings" in text and "weighting" in text, text
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("features.npz", "meta.json"):
        (bad / f).write_bytes((d / "norm" / f).read_bytes())
    (bad / "meta.json").write_text(json.dumps({**meta["norm"], "weighting": "l1"}))
    with pytest.raises(AttnkitError, match=r'meta.json: field weighting: must be one of "attention", "norm", got "l1"'):
        attnkit.HeadFeatures.load(bad)


def test_compare_shows_how_much_special_mass_survives(two_runs, tmp_path):
    import json

    d, _ = two_runs
    code, text = _run("compare", d / "attention", d / "norm", "--json", tmp_path / "w.json")
    assert code == 0, text
    assert "special-token mass" in text and "head types not compared" in text
    res = json.loads((tmp_path / "w.json").read_text())["weighting"]
    att, norm = (attnkit.HeadFeatures.load(d / w) for w in ("attention", "norm"))
    special = ["cls", "sep", "comma", "period"]
    a = sum(att.feature(n) for n in special)
    n = sum(norm.feature(x) for x in special)
    np.testing.assert_allclose(np.array(res["groups"]["all special"]["survival"], dtype=float), n / a, rtol=1e-9)
    assert res["attention_run"].endswith("attention") and res["norm_run"].endswith("norm")
    # either order names the same runs
    code, text2 = _run("compare", d / "norm", d / "attention")
    assert code == 0 and text2.splitlines()[0] == text.splitlines()[0]
    # a run of another corpus is not the same corpus under another weighting
    other = tmp_path / "other.txt"
    other.write_text("A different text.\nAnd another one.\n")
    assert _run("extract", other, "-o", tmp_path / "o", "--max-length", 24, "-q")[0] == 0
    code, text = _run("compare", tmp_path / "o", d / "norm")
    assert code == 1 and "not one corpus under two weightings" in text and "corpus_sha256" in text


def test_report_and_cluster_label_a_norm_weighted_run(two_runs):
    d, _ = two_runs
    code, text = _run("cluster", d / "norm", "-k", 2, "--stability", 2, "--seeds", 1, "-q")
    assert code == 0 and "(norm-weighted)" in text
    code, text = _run("report", d / "norm", "-q", "--no-svg")
    assert code == 0, text
    page = (d / "norm" / "report.html").read_text()
    assert "(norm-weighted)</h1>" in page and "Norm-weighted run" in page
    import json

    assert json.loads((d / "norm" / "clusters.json").read_text())["run"]["weighting"] == "norm"


def test_norm_weighting_outside_measuring_is_refused_in_one_line():
    """A runtime switched to norm weighting by hand, without the output projections that `measuring` finds."""
    from attnkit.engine import forward_features, measuring
    from attnkit.tokens import Encoder

    model, tok, _ = tiny("bert")
    attnkit.instrument(model, tok)
    batch = Encoder(tok)(["a b c"])
    with measuring(model, backend="reference") as rt:
        rt.weighting = "norm"  # out_proj left empty
        with pytest.raises(AttnkitError, match=r"norm weighting needs each layer's output projection: measure inside "
                                               r"attnkit\.engine\.forward\.measuring\(model, weighting='norm'\)"):
            forward_features(model, batch, rt)
