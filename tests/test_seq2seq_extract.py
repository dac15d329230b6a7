"""`attnkit extract` and `attnkit.extract` over (source, target) pairs of an encoder–decoder (docs/seq2seq.md,
"Extracting over pairs"), on tiny random BART and T5 saved with a word-level tokenizer into tmp_path: features of
encoder, decoder and cross heads against those counted from eager's `output_attentions` maps of each pair alone
(teacher-forced: the target shifted right), TSV and JSONL inputs, the Python API, per-sample output, resume after an
interruption, workers, and every refusal by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import attnkit
from attnkit.cli.main import main
from attnkit.errors import AttnkitError
from attnkit.features import CLS, COMMA, OTHER, PERIOD, SEP
from attnkit.run.head_features import HeadFeatures

from .synthetic import alignment_from_maps, cross_features_from_maps, features_from_maps, tiny_seq2seq

NW = 4
WORDS = ("the cat sat on mat a dog ran far le chat est assis sur tapis un chien court loin and it was very big "
         "small red blue").split()
PAIRS = [("the cat sat on the mat .", "le chat est assis sur le tapis ."),
         ("a dog ran .", "un chien court loin , très loin ."),
         ("the dog , the cat and the mat were very big red and blue .", "le chien ."),
         ("it was small", "un chat"),
         ("a cat ran far and it was very small .", "le chat court loin ."),
         ("red", "le tapis est grand , rouge et bleu .")]
SPECIALS = {"bart": ["<pad>", "<s>", "</s>", "<unk>"], "t5": ["<pad>", "</s>", "<unk>"]}


def word_tokenizer(kind: str):
    """A word-level fast tokenizer with BART's (<s> A </s>) or T5's (A </s>) template; ids match tiny_seq2seq's
    config (padding 0; BART: BOS 1, EOS 2; T5: EOS 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS[kind] + [",", "."] + sorted(set(WORDS) | {w for p in PAIRS for s in p for w in s.split()}
                                                 - {",", "."})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ids = {w: i for i, w in enumerate(words)}
    if kind == "bart":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                           special_tokens=[("<s>", 1), ("</s>", 2)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                       cls_token="<s>", unk_token="<unk>", pad_token="<pad>"), len(ids)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>"), len(ids)


@pytest.fixture(scope="module", params=["bart", "t5"])
def model_dir(request, tmp_path_factory):
    """(kind, a directory holding a tiny random encoder–decoder of `kind` and its tokenizer)"""
    kind = request.param
    return kind, save_seq2seq(kind, tmp_path_factory.mktemp(kind))


def write_tsv(path, pairs, header=("source", "target")):
    path.write_text("\t".join(header) + "\n" + "".join(f"{s}\t{t}\n" for s, t in pairs))
    return path


def write_jsonl(path, pairs, fields=("source", "target")):
    path.write_text("".join(json.dumps(dict(zip(fields, p))) + "\n" for p in pairs))
    return path


def classes(ids: list[int], tok, first_cls: bool) -> np.ndarray:
    """Token classes written out: CLS on <s> (and on the first position where `first_cls`), SEP on </s>, COMMA and
    PERIOD on "," and "."."""
    vocab = tok.get_vocab()
    named = {vocab.get("<s>"): CLS, vocab["</s>"]: SEP, vocab[","]: COMMA, vocab["."]: PERIOD}
    out = np.array([named.get(i, OTHER) for i in ids], dtype=np.int32)
    if first_cls:
        out[0] = CLS
    return out


def eager_features(path, kind: str, pairs) -> np.ndarray:
    """Each pair alone through the eager model, teacher-forced: the source as tokenised, the decoder's input the
    target shifted right (decoder_start first, its last token dropped); features counted from its maps (encoder,
    decoder, cross: samples × 6 layers × heads × F)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    start = model.config.decoder_start_token_id
    rows = []
    for src, tgt in pairs:
        s = tok(src)["input_ids"]
        t = [start] + tok(text_target=tgt)["input_ids"][:-1]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([s]), decoder_input_ids=torch.tensor([t]), output_attentions=True)
        sc = classes(s, tok, first_cls=kind == "t5")[None]
        tc = classes(t, tok, first_cls=True)[None]
        enc = features_from_maps([a.numpy() for a in out.encoder_attentions], [len(s)], sc, np.zeros_like(sc), NW)
        dec = features_from_maps([a.numpy() for a in out.decoder_attentions], [len(t)], tc, np.zeros_like(tc), NW)
        cross = np.stack([cross_features_from_maps(a.numpy(), [len(t)], [len(s)], tc, sc, NW)
                          for a in out.cross_attentions], 1)
        # every kind's features end with the alignment features (docs/features.md, "Alignment features")
        align = np.stack([alignment_from_maps(a.numpy(), [len(s)]) for a in out.encoder_attentions]
                         + [alignment_from_maps(a.numpy(), [len(t)]) for a in out.decoder_attentions]
                         + [alignment_from_maps(a.numpy(), [len(t)], [len(s)]) for a in out.cross_attentions], 1)
        rows.append(np.concatenate([np.concatenate([enc, dec, cross], 1), align], -1)[0])
    return np.stack(rows)


def cli(*args):
    """(exit code, output) of `attnkit ARGS` run here."""
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def test_extract_over_tsv_and_jsonl_equals_eager_and_the_api(model_dir, tmp_path):
    kind, path = model_dir
    want = eager_features(path, kind, PAIRS)
    tsv = write_tsv(tmp_path / "pairs.tsv", PAIRS)
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", PAIRS, ("src", "tgt"))
    for corpus in (tsv, jsonl):
        out = tmp_path / f"run-{corpus.suffix[1:]}"
        code, text = cli("extract", corpus, "--model", path, "-o", out, "--num-windows", NW, "--batch-size", 4,
                         "--device", "cpu", "--per-sample", "-q", "--workers", 0, "--threads", 1, "--max-length", 32)
        assert code == 0, text
        run = HeadFeatures.load(out)
        np.testing.assert_allclose(run.per_sample, want, atol=1e-5)
        np.testing.assert_allclose(run.mean, want.mean(0), atol=1e-5)
        meta = json.loads((out / "meta.json").read_text())
        assert meta["n_segments"] == len(PAIRS)
    api = attnkit.extract(PAIRS, model=str(path), num_windows=NW, batch_size=3, device="cpu", per_sample=True,
                          max_length=32)
    np.testing.assert_allclose(api.per_sample, want, atol=1e-5)


def extract_args(corpus, path, out, *more):
    return ("extract", corpus, "--model", path, "-o", out, "--num-windows", NW, "--device", "cpu", "-q",
            "--threads", 1, "--max-length", 32, *more)


def test_resume_and_workers_give_the_numbers_of_an_uninterrupted_run(model_dir, tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt from the second forward) after the first unit of a run over pairs: --resume ends
    with the features and per-sample rows of a run never interrupted, and so does a run with a tokenisation
    worker."""
    from attnkit.engine import extract as engine

    kind, path = model_dir
    tsv = write_tsv(tmp_path / "pairs.tsv", PAIRS)
    plan = ("--batch-size", 2, "--window", 2, "--per-sample")
    whole, out = tmp_path / "whole", tmp_path / "resumed"
    assert cli(*extract_args(tsv, path, whole, *plan, "--workers", 0))[0] == 0
    real, calls = engine.device_forward, []

    def interrupted(model, batch):
        calls.append(len(batch.lengths))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(model, batch)

    monkeypatch.setattr(engine, "device_forward", interrupted)
    code, text = cli(*extract_args(tsv, path, out, *plan, "--workers", 0))
    assert code == 130 and "interrupted after 2 segments" in text, text
    monkeypatch.setattr(engine, "device_forward", real)
    code, text = cli(*extract_args(tsv, path, out, *plan, "--workers", 0, "--resume"))
    assert code == 0, text
    a, b = HeadFeatures.load(whole), HeadFeatures.load(out)
    np.testing.assert_array_equal(b.per_sample, a.per_sample)
    np.testing.assert_allclose(b.mean, a.mean, rtol=1e-12, atol=1e-12)
    assert b.n_samples == a.n_samples == len(PAIRS) and b.n_tokens == a.n_tokens
    worker = tmp_path / "worker"
    assert cli(*extract_args(tsv, path, worker, *plan, "--workers", 1))[0] == 0
    np.testing.assert_array_equal(HeadFeatures.load(worker).per_sample, a.per_sample)


def test_meta_records_layer_kinds_and_truncation_of_either_side(model_dir, tmp_path):
    """A source or target longer than --max-length is cut to it, as single texts are, and counted as truncated
    once per pair; meta.json records the kind of every layer."""
    kind, path = model_dir
    long = " ".join(["the cat sat"] * 4)
    pairs = [(long, "le chat ."), ("le chat", long), (long, long), ("a dog", "un chien")]
    tsv = write_tsv(tmp_path / "pairs.tsv", pairs)
    out = tmp_path / "run"
    code, text = cli("extract", tsv, "--model", path, "-o", out, "--num-windows", NW, "--device", "cpu", "-q",
                     "--max-length", 8, "--workers", 0)
    assert code == 0, text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_truncated"] == 3
    kinds = [["encoder", 0], ["encoder", 1], ["decoder", 0], ["decoder", 1], ["cross", 0], ["cross", 1]]
    assert meta["layer_kinds"] == kinds
    model, _ = attnkit.load_model(str(path), device="cpu")
    assert [list(k) for k in attnkit.models.layer_kinds(model)] == kinds  # what the instrumented model finds
    # export and cluster name each head's kind and layer within its kind beside attnkit's layer number
    table = HeadFeatures.load(out).to_pandas()
    assert list(table.columns[:4]) == ["layer", "head", "kind", "kind_layer"]
    assert table.groupby("layer")[["kind", "kind_layer"]].first().values.tolist() == kinds
    code, text = cli("cluster", out, "-k", 2, "--stability", 2)
    assert code == 0, text
    heads = json.loads((out / "clusters.json").read_text())["heads"]
    assert [[h["kind"], h["kind_layer"]] for h in heads] == [k for k in kinds for _ in range(4)]


def save_seq2seq(kind: str, path):
    """A tiny random encoder–decoder of `kind` and its word-level tokenizer saved into `path`; returns `path`."""
    tok, vocab = word_tokenizer(kind)
    tiny_seq2seq(kind, vocab=vocab).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory):
    return save_seq2seq("bart", tmp_path_factory.mktemp("bart"))


@pytest.fixture()
def no_model_loads(monkeypatch):
    """Fail a test that loads a model: every refusal below comes before."""
    import attnkit.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(attnkit.models, "load_model", refuse)


REFUSALS = [
    ("pairs.txt", "le chat\nun chien\n", (), "plain text holds single texts, but an encoder–decoder measures (source, "
                                             "target) pairs"),
    ("pairs.tsv", "source\ttarget\n\tthe cat\n", (), "pairs.tsv:2: the pair column 'source' is empty"),
    ("pairs.tsv", "a\tb\tc\nx\ty\tz\n", (), "no columns are named source and target"),
    ("pairs.tsv", "source\ttarget\nx\ty\n", ("--columns", "source"), "name two columns with --columns SOURCE,TARGET"),
    ("pairs.tsv", "source\ttarget\nx\ty\n", ("--columns", "source,tgt"), "no column 'tgt'"),
    ("pairs.jsonl", '{"text": "x"}\n', (), "no fields are named source and target"),
]


@pytest.mark.parametrize("name,content,more,message", REFUSALS)
def test_refusals_name_the_problem_before_the_model_loads(bart_dir, tmp_path, no_model_loads, name, content, more,
                                                         message):
    corpus = tmp_path / name
    corpus.write_text(content)
    code, text = cli("extract", corpus, "--model", bart_dir, "-o", tmp_path / "run", "-q", "--max-length", 32, *more)
    assert code != 0 and message in text, text
    assert not (tmp_path / "run").exists()


# rows past the first are read as the run streams the corpus: named by file and line when reached, nothing saved
ROW_REFUSALS = [
    ("pairs.tsv", "source\ttarget\nle chat\tthe cat\nun chien\t\n", "pairs.tsv:3: the pair column 'target' is empty"),
    ("pairs.jsonl", '{"source": "x", "target": "y"}\n{"source": "z"}\n', 'pairs.jsonl:2: "target" must be a string'),
]


@pytest.mark.parametrize("name,content,message", ROW_REFUSALS)
def test_rows_with_a_side_missing_are_refused_by_line(bart_dir, tmp_path, name, content, message):
    corpus = tmp_path / name
    corpus.write_text(content)
    code, text = cli("extract", corpus, "--model", bart_dir, "-o", tmp_path / "run", "-q", "--max-length", 32,
                     "--workers", 0)
    assert code != 0 and message in text, text
    assert not (tmp_path / "run" / "features.npz").exists()


def test_positions_and_model_kinds_are_refused_by_name(bart_dir, tmp_path, no_model_loads):
    tsv = write_tsv(tmp_path / "pairs.tsv", PAIRS)
    code, text = cli("extract", tsv, "--model", bart_dir, "-o", tmp_path / "run", "-q", "--max-length", 128)
    assert code != 0 and "--max-length 128 exceeds the model's 64 positions (bart)" in text, text
    decoder = tmp_path / "llama"
    decoder.mkdir()
    (decoder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    code, text = cli("extract", tsv, "--model", decoder, "-o", tmp_path / "run", "-q", "--max-length", 32,
                     "--columns", "source,target")
    assert code != 0 and "gives text pairs, but 'llama' is a decoder-only model, which has no pair format" in text
    with pytest.raises(AttnkitError, match=r"texts\[1\] is a single text, but 'bart' is an encoder–decoder"):
        attnkit.extract([("le chat", "the cat"), "un chien"], model=str(bart_dir), max_length=32)
    with pytest.raises(AttnkitError, match=r"texts\[0\] gives text pairs, but 'llama' is a decoder-only"):
        attnkit.extract([("le chat", "the cat")], model=str(decoder), max_length=32)
    whisper = tmp_path / "whisper"
    whisper.mkdir()
    (whisper / "config.json").write_text(json.dumps({"model_type": "whisper", "is_encoder_decoder": True}))
    code, text = cli("extract", tsv, "--model", whisper, "-o", tmp_path / "run", "-q", "--max-length", 32)
    assert code != 0 and "encoder reads audio" in text, text


def test_a_datasets_directory_of_pairs_equals_eager(bart_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    pairs = PAIRS[:4]
    data = tmp_path / "pairs"
    datasets.Dataset.from_dict({"id": [str(i) for i in range(len(pairs))], "src": [s for s, _ in pairs],
                                "tgt": [t for _, t in pairs]}).save_to_disk(str(data))
    out = tmp_path / "run"
    code, text = cli(*extract_args(data, bart_dir, out, "--columns", "src,tgt", "--per-sample", "--workers", 0))
    assert code == 0, text
    np.testing.assert_allclose(HeadFeatures.load(out).per_sample, eager_features(bart_dir, "bart", pairs), atol=1e-5)
    datasets.Dataset.from_dict({"source": ["le chat", "un chien"], "target": ["the cat", None]}).save_to_disk(
        str(tmp_path / "holes"))
    code, text = cli(*extract_args(tmp_path / "holes", bart_dir, tmp_path / "run2", "--workers", 0))
    assert code != 0 and "row 2: the pair column 'target' is null; drop or fill such rows" in text, text
    assert "name one text column" not in text  # one column is no answer for an encoder–decoder
