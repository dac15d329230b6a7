"""Library and command line agree on every input, and inputs that are not what they seem are named (issue 25, §3,
§4, §5 and its minor findings): pairs are refused and truncated by the one Encoder, blank texts are refused, a huge
pair is cut before it is tokenised, --data that is a device, FIFO or directory is named as such, a closed standard
input is named, and prune checks its heads before it loads the model and fails on a full disk in one line."""
import json
import os

import pytest
from click.testing import CliRunner

import attnkit
from attnkit import AttnkitError
from attnkit.cli.main import main
from attnkit.tokens import CHARS_PER_TOKEN, Encoder

from .synthetic import tiny_bert


@pytest.fixture(scope="module")
def tiny():
    return tiny_bert(2, 2)


def cli(*args, input=None):
    res = CliRunner().invoke(main, [str(a) for a in args], input=input)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.output


# --- §4: attention_maps, extract and head_means read texts alike ------------------------------------------------
def test_a_pair_too_long_for_max_length_is_refused_by_maps_as_by_extract(tiny):
    pair = ("A question?", "A context.")
    with pytest.raises(AttnkitError) as by_extract:
        attnkit.extract([pair], tiny, max_length=2)
    with pytest.raises(AttnkitError) as by_maps:
        attnkit.attention_maps(pair, tiny, max_length=2)
    assert str(by_maps.value) == str(by_extract.value)
    assert "too short for text pairs" in str(by_maps.value)


def test_maps_truncate_a_pair_as_extract_does(tiny):
    model, tok = tiny
    pair = ("the cat sat on the mat", "a big red house is here")
    maps = attnkit.attention_maps(pair, tiny, max_length=7)
    ids = Encoder(tok, max_length=7)([pair]).inputs["input_ids"][0].tolist()
    assert maps.tokens == tok.convert_ids_to_tokens(ids) and len(maps.tokens) == 7
    assert maps.weights.shape == (2, 2, 7, 7)


@pytest.mark.parametrize("call", ["extract", "head_means", "attention_maps"])
def test_blank_texts_are_refused_everywhere(tiny, call):
    with pytest.raises(AttnkitError, match=r"is empty \(blank\)"):
        if call == "attention_maps":
            attnkit.attention_maps("  ", tiny)
        else:
            getattr(attnkit, call)(["", "  "], tiny)


def test_a_huge_pair_is_cut_before_it_is_tokenised(tiny, monkeypatch):
    """`attention_maps(("q " * 40000, "c " * 40000))` was killed at 22 GB: the tokenizer now never sees more than
    max_length × CHARS_PER_TOKEN characters of a text, and the tokens kept are those of the whole pair."""
    model, tok = tiny
    seen = []
    real = type(tok).__call__

    def spy(self, text=None, text_pair=None, *a, **k):
        items = text if isinstance(text, list) else [text, text_pair]
        for t in items:
            for x in (t if isinstance(t, list) else [t]):
                seen.append(len(x) if isinstance(x, str) else 0)
        return real(self, text, text_pair, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", spy)
    huge = attnkit.attention_maps(("the " * 40000, "cat " * 40000), tiny, max_length=32)
    assert max(seen) <= 32 * CHARS_PER_TOKEN
    monkeypatch.undo()
    small = attnkit.attention_maps(("the " * 40, "cat " * 40), tiny, max_length=32)
    assert huge.tokens == small.tokens and len(huge.tokens) == 32
    assert (huge.weights == small.weights).all()


def test_a_long_text_of_long_words_is_not_cut_short(tiny):
    """A cut that would leave fewer than max_length tokens is not made: the text is tokenised whole."""
    _, tok = tiny
    enc = Encoder(tok, max_length=8)
    text = " ".join(["x" * 300] * 20)  # each word one [UNK]: 20 tokens in 6000 characters
    assert enc.bounded(text) == text
    assert enc.bounded("the " * 1000).count("the") < 1000


# --- §5 and the minor findings: inputs named for what they are --------------------------------------------------
@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_data_that_is_no_file_is_named_for_what_it_is(tmp_path, kind):
    if kind == "device":
        data, says = "/dev/null", "is a character device, not a file"
    elif kind == "fifo":
        data, says = tmp_path / "pipe", "is a FIFO (named pipe), not a file"
        os.mkfifo(data)
    else:
        data, says = tmp_path, "is a directory, not a file"
    for args in (["--task", "stsb", "--experiment", "heads"], ["--task", "stsb", "--experiment", "patching"]):
        code, text = cli("ablate", "default", *args, "--data", data, "-o", tmp_path / "out")
        assert code == 1 and says in text and "not found" not in text, text
        assert not (tmp_path / "out").exists()


def test_a_closed_standard_input_is_named(monkeypatch):
    import sys

    from attnkit.corpus import open_corpus

    monkeypatch.setattr(sys, "stdin", None)  # what Python makes of `attnkit extract - <&-`
    with pytest.raises(AttnkitError, match="standard input is closed"):
        open_corpus(["-"])


def test_a_duplicate_jsonl_key_is_named_with_its_line(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b", "text": "c"}\n')
    code, text = cli("extract", data, "-o", tmp_path / "run", "-q")
    assert code == 1 and f"{data}:2: an object names the field 'text' twice" in text


# --- §3 and the minor findings: prune -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("m") / "model"
    tiny[0].save_pretrained(d)
    tiny[1].save_pretrained(d)
    return d


def test_prune_checks_its_heads_before_loading_the_model(model_dir, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("attnkit.ablation.prune.load_model", no_load)
    code, text = cli("prune", model_dir, "--heads", "L0H5", "-o", tmp_path / "p")
    assert code == 1 and "head L0H5 is outside this model's 2 layers × 2 heads" in text
    code, text = cli("prune", model_dir, "--importance", model_dir / "config.json", "--fraction", "2",
                     "-o", tmp_path / "p")
    assert code == 2 and "--fraction" in text
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("existing", [False, True])
def test_prune_on_a_full_disk_fails_in_one_line_and_leaves_nothing_partial(model_dir, tmp_path, monkeypatch,
                                                                          existing):
    from safetensors import SafetensorError

    out = tmp_path / "p"
    if existing:
        assert cli("prune", model_dir, "--heads", "L1H1", "-o", out, "-q")[0] == 0
    before = sorted(os.listdir(out)) if existing else None

    def full(self, directory, *a, **k):
        os.makedirs(directory, exist_ok=True)
        (directory / "model.safetensors").write_bytes(b"partial")
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr("transformers.PreTrainedModel.save_pretrained", full)
    code, text = cli("prune", model_dir, "--heads", "L0H0", "-o", out, "--overwrite", "-q")
    assert code == 1 and text.strip().splitlines() == [
        f"Error: could not write the pruned model to {out}: Error while serializing: IoError(No space left on device "
        "(os error 28))"]
    assert sorted(os.listdir(tmp_path)) == (["p"] if existing else [])  # no temporary folder beside it
    if existing:  # the old model as it was (and the lock file, which stays: docs/files.md)
        assert [n for n in sorted(os.listdir(out)) if not n.startswith(".attnkit.lock")] == before
        assert json.loads((out / "config.json").read_text())["attnkit_head_counts"] == [2, 1]
