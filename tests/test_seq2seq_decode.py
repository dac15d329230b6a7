"""`attnkit ablate --task seq2seq --decode`: greedy translations scored by corpus BLEU and chrF.

The statistics-based corpus scores against sacrebleu's own (random sets, empty hypotheses, and resamples as the
corpus with each pair repeated as often as it was drawn); the greedy translations with nothing ablated against an
eager copy's `generate`, pair by pair; a zeroed head's BLEU and chrF against sacrebleu on the translations a plain
`model.generate` gives under `attnkit.intervene` of that head; the refusals. The tiny random BART decodes with
`min_new_tokens` and `no_repeat_ngram_size` in its generation config (its own decoding rules, which `generate`
follows), so that its translations are not empty, and its cross-attention strengthened; its targets are its own greedy translations, so the baseline's
BLEU is 100 and a head that changes a translation lowers it."""
from __future__ import annotations

import csv
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import attnkit
from attnkit.ablation.experiments import Setting, TaskEvaluator, run_settings
from attnkit.ablation.tasks import get_task
from attnkit.ablation.translation import pair_statistics, weighted_bleu, weighted_chrf
from attnkit.cli.ablate import ablate
from attnkit.errors import AttnkitError

from .synthetic import tiny_seq2seq
from .test_seq2seq_extract import PAIRS, word_tokenizer, write_tsv

sacrebleu = pytest.importorskip("sacrebleu")
SOURCES = [s for s, _ in PAIRS]
NEW = 10  # tokens per translation


def eager_decoder():
    tok, vocab = word_tokenizer("bart")
    model = tiny_seq2seq("bart", vocab=vocab)
    with torch.no_grad():  # a stronger cross-attention: the translations depend on their sources
        for name, p in model.named_parameters():
            if name.endswith(("encoder_attn.v_proj.weight", "encoder_attn.out_proj.weight")):
                p.mul_(4.0)
    model.generation_config.min_new_tokens = 3
    model.generation_config.no_repeat_ngram_size = 1
    return model, tok


def greedy(model, tok, sources, iv=None) -> list[str]:
    """Each source translated alone by a plain `model.generate` (under `attnkit.intervene(iv)` where given)."""
    out = []
    for source in sources:
        enc = tok(source, return_tensors="pt")
        with torch.no_grad(), (attnkit.intervene(model, iv) if iv is not None else torch.no_grad()):
            ids = model.generate(**enc, max_new_tokens=NEW, do_sample=False, num_beams=1)
        out.append(tok.decode(ids[0], skip_special_tokens=True))
    return out


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    """The model saved with its tokenizer, and a TSV of the sources with its own greedy translations as targets."""
    model, tok = eager_decoder()
    path = tmp_path_factory.mktemp("bart-decode")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    data = write_tsv(path / "pairs.tsv", list(zip(SOURCES, greedy(model, tok, SOURCES))))
    return path, data


WORDS = "the cat sat on a mat dog ran big red , . !".split()


def random_corpus(rng, n: int) -> tuple[list[str], list[str]]:
    refs = [" ".join(rng.choice(WORDS, rng.integers(1, 10))) for _ in range(n)]
    hyps = [" ".join(rng.choice(WORDS, rng.integers(0, 12))) for _ in range(n)]
    return hyps, refs


@pytest.mark.parametrize("seed", range(6))
def test_statistics_give_sacrebleus_corpus_scores_exactly(seed):
    rng = np.random.default_rng(seed)
    hyps, refs = random_corpus(rng, int(rng.integers(2, 15)))
    hyps[0] = ""  # an empty translation
    if seed == 5:
        hyps = [""] * len(hyps)  # nothing translated: BLEU and chrF 0
    stats = pair_statistics(hyps, refs)
    ones = np.ones(len(hyps))
    assert weighted_bleu(stats, ones)[0] == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert weighted_chrf(stats, ones)[0] == sacrebleu.corpus_chrf(hyps, [refs]).score
    # a resample (counts of each pair) scores as the corpus of its pairs repeated that often
    counts = rng.multinomial(len(hyps), np.ones(len(hyps)) / len(hyps), size=4).astype(np.float64)
    bleu, chrf = weighted_bleu(stats, counts), weighted_chrf(stats, counts)
    for row, b, c in zip(counts, bleu, chrf):
        rh = [h for h, k in zip(hyps, row) for _ in range(int(k))]
        rr = [r for r, k in zip(refs, row) for _ in range(int(k))]
        assert b == pytest.approx(sacrebleu.corpus_bleu(rh, [rr]).score, rel=1e-12, abs=1e-12)
        assert c == pytest.approx(sacrebleu.corpus_chrf(rh, [rr]).score, rel=1e-12, abs=1e-12)
    if seed == 5:
        assert bleu.tolist() == [0.0] * 4 and chrf.tolist() == [0.0] * 4


def test_decoding_with_nothing_ablated_equals_an_eager_copys_greedy_output(decoder_dir, tmp_path):
    path, data = decoder_dir
    eager, _ = eager_decoder()
    model, tok = attnkit.load_model(str(path), device="cpu", task="seq2seq-lm")
    task = get_task("seq2seq", data, decode=True, max_new_tokens=NEW)
    got = task.evaluate(model, tok, batch_size=4)  # sources padded in batches, sorted by length
    want = greedy(eager, tok, SOURCES)
    assert task.last_examples.arrays["hypothesis"].tolist() == want
    assert any(want) and len(set(want)) > 1
    refs = [t for _, t in task.examples]  # these translations (BLEU 100 up to rounding)
    assert got["bleu"] == sacrebleu.corpus_bleu(want, [refs]).score == pytest.approx(100.0)
    assert got["chrf"] == sacrebleu.corpus_chrf(want, [refs]).score == pytest.approx(100.0)
    assert got["loss"] == pytest.approx(get_task("seq2seq", data).evaluate(model, tok, batch_size=4)["loss"])


def test_a_zeroed_head_scores_the_translations_of_generate_under_intervene(decoder_dir):
    path, data = decoder_dir
    model, tok = attnkit.load_model(str(path), device="cpu", task="seq2seq-lm")
    task = get_task("seq2seq", data, decode=True, max_new_tokens=NEW)
    refs = [t for _, t in task.examples]
    heads = ["L4H1", "L5H0", "L1H2", "L3H0"]  # cross, cross, encoder, decoder
    settings = [Setting("baseline", attnkit.Intervention.for_model(model), {})]
    settings += [Setting(h, attnkit.Intervention.from_heads(model, h), {}) for h in heads]
    table = run_settings("heads", settings, TaskEvaluator(task, model, tok, batch_size=4), "loss", progress=False,
                         n_boot=200)
    changed, base = 0, table.rows[0]
    for row in table.rows[1:]:
        hyps = greedy(model, tok, SOURCES, attnkit.Intervention.from_heads(model, row["setting"]))
        bleu, chrf = sacrebleu.corpus_bleu(hyps, [refs]).score, sacrebleu.corpus_chrf(hyps, [refs]).score
        assert row["bleu"] == bleu and row["chrf"] == chrf
        assert row["delta_bleu"] == bleu - base["bleu"] and row["delta_chrf"] == chrf - base["chrf"]
        for key in ("delta_loss", "delta_bleu", "delta_chrf"):
            assert row[f"{key}_lo"] <= row[key] + 1e-9 and row[key] - 1e-9 <= row[f"{key}_hi"]
        changed += bleu < base["bleu"]
    assert changed >= 2  # the cross-attention heads change some translations
    assert table.rows[0]["delta_bleu"] == 0.0 and table.rows[0]["delta_bleu_lo"] == 0.0


@pytest.mark.slow
def test_ablate_decode_writes_bleu_and_chrf_with_intervals(decoder_dir, tmp_path):
    path, data = decoder_dir
    out = tmp_path / "out"
    res = CliRunner().invoke(ablate, [str(path), "--task", "seq2seq", "--data", str(data), "--experiment", "layers",
                                      "--decode", "--max-new-tokens", str(NEW), "--out", str(out), "--resamples",
                                      "100", "--quiet"])
    assert res.exit_code == 0, res.output
    with open(out / "layers.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 7 and float(rows[0]["bleu"]) == pytest.approx(100.0)
    for key in ("delta_bleu", "delta_chrf"):
        assert all(float(r[f"{key}_lo"]) <= float(r[key]) + 1e-9 <= float(r[f"{key}_hi"]) + 2e-9 for r in rows)
    assert min(float(r["bleu"]) for r in rows) < 99.0
    with open(out / "layers.examples.csv") as f:
        examples = list(csv.DictReader(f))
    assert {"hypothesis", "bleu_match_1", "chrf_match_6"} <= set(examples[0])
    assert "max_new_tokens" in (out / "layers.meta.json").read_text()


def test_decode_is_refused_by_name(decoder_dir, tmp_path, monkeypatch):
    path, data = decoder_dir
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat .\na dog ran .\n")

    def refused(args, said):
        res = CliRunner().invoke(ablate, [str(path), "--data", str(data), "--out", str(tmp_path / "o"), *args])
        assert res.exit_code != 0 and said in res.output, res.output
        assert not (tmp_path / "o").exists()

    refused(["--task", "seq2seq", "--experiment", "heads", "--max-new-tokens", "5"], "--max-new-tokens is for --decode")
    refused(["--task", "seq2seq", "--experiment", "heads", "--decode", "--max-new-tokens", "0"], "--max-new-tokens")
    refused(["--task", "lm", "--experiment", "heads", "--decode"], "--decode translates with an encoder–decoder")
    with pytest.raises(AttnkitError, match="decode translates"):
        get_task("lm", texts, decode=True)
    model, tok = attnkit.load_model(str(path), device="cpu", task="seq2seq-lm")  # 64 positions
    with pytest.raises(AttnkitError, match="max_new_tokens 64 runs past the model's 64 positions"):
        get_task("seq2seq", data, decode=True, max_new_tokens=64).evaluate(model, tok)
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # not installed
    refused(["--task", "seq2seq", "--experiment", "heads", "--decode"], "pip install attnkit[seq2seq]")
    with pytest.raises(AttnkitError, match=r"pip install attnkit\[seq2seq\]"):
        get_task("seq2seq", data, decode=True)
