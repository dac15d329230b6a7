"""The analyses on decoder runs (issue 27 item 5): extract → distances, cluster, compare, export on a tiny random
Llama, and compare-models of two decoders; the numbers they compute from attention (Jensen-Shannon divergences,
row and map cosines) checked against eager attention maps of the same tokenised inputs (causal rows, grouped-query
KV heads, sliding windows, uneven KV groups of a pruned model)."""
from __future__ import annotations

import copy
import csv
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

import attnkit
from attnkit.cli.main import main
from attnkit.engine.distances import DistanceCollector
from attnkit.errors import AttnkitError
from attnkit.run import HeadFeatures
from attnkit.run.distances import HeadDistances
from attnkit.tokens import Encoder

from .conftest import SENTENCES
from .synthetic import tiny_decoder

MAX_LENGTH = 32


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def save(model, tok, path):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, decoder_tokenizer):
    return save(tiny_decoder("llama", vocab=len(decoder_tokenizer)), decoder_tokenizer,
                tmp_path_factory.mktemp("llama") / "m")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text("\n".join(s.lower() for s in SENTENCES) + "\n")
    return path


def eager_maps(model, tok, texts):
    """Per layer, B × H × L × L numpy maps of eager attention on attnkit's own batch of `texts`; the lengths."""
    batch = Encoder(tok, max_length=MAX_LENGTH)(texts)
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        maps = model(**batch.inputs, output_attentions=True).attentions
    return [m.double().numpy() for m in maps], batch.lengths.tolist()


def js_sums(maps, lengths):
    """Σ over valid rows of JS(A_i[s], A_j[s]) for all pairs of heads (numbered layer · H + head), natural logs."""
    K = maps[0].shape[-1]
    rows = np.stack([np.concatenate([m[b, :, s, :] for m in maps]).reshape(-1, K)
                     for b, n in enumerate(lengths) for s in range(n)])  # R × M × L

    def kl(p, q):
        return np.where(p > 0, p * np.log(np.where(p > 0, p, 1) / np.where(q > 0, q, 1)), 0).sum(-1)
    p, q = rows[:, :, None, :], rows[:, None, :, :]
    m = (p + q) / 2
    return (0.5 * kl(p, m) + 0.5 * kl(q, m)).sum(0)


def test_extract_distances_cluster_compare_export_on_a_decoder_run(llama_dir, corpus, decoder_tokenizer, tmp_path):
    runs = {}
    for name, extra in (("a", ()), ("b", ("--weighting", "norm"))):
        runs[name] = tmp_path / name
        code, out = run("extract", corpus, "--model", llama_dir, "--max-length", MAX_LENGTH, "-o", runs[name], "-q",
                        *extra)
        assert code == 0, out
    # distances: the JS divergences of the causal, grouped-query maps eager attention gives
    code, out = run("distances", runs["a"], "-q")
    assert code == 0, out
    dist = HeadDistances.load(runs["a"])
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    maps, lengths = eager_maps(model, decoder_tokenizer, [s.lower() for s in SENTENCES])
    assert dist.n_rows == sum(lengths)
    np.testing.assert_allclose(dist.total, js_sums(maps, lengths), atol=1e-5)
    # cluster each run, then compare their types; export the features
    for r in runs.values():
        code, out = run("cluster", r, "-k", 2, "--stability", 2, "--features", "distance", "-q")
        assert code == 0, out
    code, out = run("compare", runs["a"], runs["b"], "--json", tmp_path / "cmp.json", "-q")
    assert code == 0, out
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    clusters = [json.loads((r / "clusters.json").read_text()) for r in runs.values()]
    types = [{(h["layer"], h["head"]): h["type"] for h in c["heads"]} for c in clusters]
    assert len(types[0]) == len(types[1]) == 8
    assert cmp["n_heads"] == 8 and sorted((c["layer"], c["head"]) for c in cmp["changed"]) == sorted(
        k for k in types[0] if types[0][k] != types[1][k])
    feats = HeadFeatures.load(runs["a"])
    for c in clusters[0]["clusters"]:  # a centroid is the mean of its heads' features (no standardisation)
        members = [(h["layer"], h["head"]) for h in clusters[0]["heads"] if h["label"] == c["label"]]
        assert c["centroid"]["cls"] == pytest.approx(np.mean([feats.mean[l, h, 0] for l, h in members]), abs=1e-5)
    code, out = run("report", runs["a"], "--examples", 1, "-q")  # its example maps come from the decoder
    assert code == 0, out
    assert (runs["a"] / "report.html").stat().st_size > 0
    code, out = run("export", runs["a"], "-o", tmp_path / "a.csv")
    assert code == 0, out
    with open(tmp_path / "a.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 * 4
    row = next(r for r in table if (r["layer"], r["head"]) == ("1", "2"))
    assert float(row["cls"]) == pytest.approx(feats.mean[1, 2, feats.names.index("cls")], abs=1e-6)
    assert float(row["next"]) == 0.0  # a causal row sees no next token


@pytest.mark.parametrize("kind", ["qwen2", "gemma2"])
def test_distances_follow_windows_and_softcaps(kind, decoder_tokenizer):
    """Qwen2 (a sliding window in its upper layer, grouped-query) and Gemma 2 (windows and a soft cap): the
    collector's sums equal the JS divergences of eager maps, with and without smoothing over the visible keys."""
    tok = decoder_tokenizer
    model = tiny_decoder(kind, vocab=len(tok), window=3)
    texts = [s.lower() for s in SENTENCES]
    maps, lengths = eager_maps(model, tok, texts)
    for smoothing in (0.0, 0.01):
        coll = DistanceCollector(2, smoothing=smoothing)
        attnkit.extract(texts, (attnkit.instrument(copy.deepcopy(model), tok), tok), max_length=MAX_LENGTH,
                        observers=[coll])
        res = coll.result()
        expect = maps
        if smoothing:  # ε spread over the keys each row sees (eager maps are > 0 exactly there)
            expect = [(1 - smoothing) * m + smoothing * (m > 0) / np.maximum((m > 0).sum(-1, keepdims=True), 1)
                      for m in maps]
        np.testing.assert_allclose(res.total, js_sums(expect, lengths), atol=1e-5)


def cosines(maps_a, maps_b, lengths):
    """Per layer × head: the mean row cosine over valid rows, and the mean over samples of the map cosine."""
    L, H = len(maps_a), maps_a[0].shape[1]
    row, flat = np.zeros((L, H)), np.zeros((L, H))
    for l in range(L):
        for b, n in enumerate(lengths):
            a, c = maps_a[l][b, :, :n, :n], maps_b[l][b, :, :n, :n]
            row[l] += ((a * c).sum(-1) / np.sqrt((a * a).sum(-1) * (c * c).sum(-1))).sum(-1)
            flat[l] += (a * c).sum((1, 2)) / np.sqrt((a * a).sum((1, 2)) * (c * c).sum((1, 2)))
    return row / sum(lengths), flat / len(lengths)


def test_compare_models_of_two_decoders_and_a_pruned_one(llama_dir, corpus, decoder_tokenizer, tmp_path):
    """compare-models of a Llama and the same Llama with heads L0H0 and L1H0, L1H1 pruned (layer 0 then has uneven
    KV groups): the kept heads' cosines are those of the two models' eager maps (layer 0's equal, 1), removed heads
    are not compared; against a second random Llama, the cosines are those of the two models' eager maps."""
    from attnkit.arch import load_pruned_model, prune_heads

    tok = decoder_tokenizer
    full = AutoModelForCausalLM.from_pretrained(llama_dir)
    heads = [(0, 0), (1, 0), (1, 1)]
    pruned_dir = save(prune_heads(copy.deepcopy(full), heads), tok, tmp_path / "pruned")
    other_dir = save(tiny_decoder("llama", vocab=len(tok), seed=5), tok, tmp_path / "other")
    texts = [s.lower() for s in SENTENCES]
    maps, lengths = eager_maps(full, tok, texts)
    for other, name in ((pruned_dir, "p"), (other_dir, "o")):
        code, out = run("compare-models", llama_dir, other, corpus, "--max-length", MAX_LENGTH, "-o",
                        tmp_path / name, "-q", "--no-svg")
        assert code == 0, out
    got = json.loads((tmp_path / "p" / "compare_models.json").read_text())
    # the pruned model's eager maps (its GroupedKV projections give eager each query head's KV head) for the heads
    # it kept; a removed head is not compared (null)
    kept_maps, _ = eager_maps(load_pruned_model(pruned_dir, AutoModelForCausalLM), tok, texts)
    maps_b = []
    for l, m in enumerate(kept_maps):
        b = np.full_like(maps[l], np.nan)
        b[:, [h for h in range(4) if (l, h) not in heads]] = m
        maps_b.append(b)
    row, flat = cosines(maps, maps_b, lengths)
    as_array = lambda x: np.array(x, dtype=float)  # noqa: E731 - null → NaN
    np.testing.assert_allclose(as_array(got["row_cosine"]), row, atol=1e-5)
    np.testing.assert_allclose(as_array(got["map_cosine"]), flat, atol=1e-5)
    assert got["row_cosine"][0][0] is None and sorted(map(tuple, got["removed_heads"])) == heads
    assert got["row_cosine"][0][1] == pytest.approx(1.0, abs=1e-6)  # layer 0: the same inputs, the same head
    other_maps, _ = eager_maps(AutoModelForCausalLM.from_pretrained(other_dir), tok, texts)
    row, flat = cosines(maps, other_maps, lengths)
    got = json.loads((tmp_path / "o" / "compare_models.json").read_text())
    np.testing.assert_allclose(got["row_cosine"], row, atol=1e-5)
    np.testing.assert_allclose(got["map_cosine"], flat, atol=1e-5)


def test_compare_models_of_a_decoder_with_sinks(decoder_tokenizer):
    """gpt-oss (sink logits, windows, grouped KV heads): compare-models' cosines are those of eager's maps (whose
    rows sum to 1 − the sink's mass)."""
    from attnkit.jobs.compare import compare_models

    tok = decoder_tokenizer
    a, b = (tiny_decoder("gpt_oss", vocab=len(tok), window=3, seed=s) for s in (0, 1))
    texts = [s.lower() for s in SENTENCES]
    res = compare_models(texts, (copy.deepcopy(a), tok), (copy.deepcopy(b), tok), max_length=MAX_LENGTH)
    maps_a, lengths = eager_maps(a, tok, texts)
    maps_b, _ = eager_maps(b, tok, texts)
    assert maps_a[0][0, 0, 3].sum() < 0.99  # the sink took its share
    row, flat = cosines(maps_a, maps_b, lengths)
    np.testing.assert_allclose(res.row_cosine, row, atol=1e-5)
    np.testing.assert_allclose(res.map_cosine, flat, atol=1e-5)


def test_a_decoder_is_not_compared_with_an_encoder(decoder_tokenizer):
    from attnkit.jobs.compare import PairedCollector

    coll = PairedCollector(1, 2)
    q = torch.randn(1, 2, 3, 4)
    coll.observe_a(0, q, q, torch.tensor([3]), None)
    with pytest.raises(AttnkitError, match="one model's attention is causal and the other's is not"):
        coll.observe_b(0, q, q, torch.tensor([3]), None, causal=True)


def test_the_syntax_probes_refuse_a_decoder(decoder_tokenizer):
    from attnkit.probe.run import word_attention_batch

    tok = decoder_tokenizer
    model = attnkit.instrument(tiny_decoder("llama", vocab=len(tok)), tok)
    enc = dict(tok(["the cat sat."], return_tensors="pt"))
    with pytest.raises(AttnkitError, match=r"an observer of q and k \(word_attention_batch.<locals>.observe\) does "
                                           "not take a decoder's attention arguments"):
        word_attention_batch(model, enc, [], 1, "auto")
