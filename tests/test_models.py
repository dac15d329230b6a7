"""load_model refuses incomplete model directories with what is missing, never a silent tiny vocabulary."""
import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from attnkit import AttnkitError
from attnkit.models import load_model

WORDS = "the cat sat on a mat and dog ran".split()


def _model(path, vocab_size):
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32)).save_pretrained(path)


def _tokenizer(path, words):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(words)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    return len(vocab)


def test_complete_directory_loads(tmp_path):
    n = _tokenizer(tmp_path, WORDS)
    _model(tmp_path, n)
    model, tok = load_model(tmp_path, device="cpu")
    assert len(tok) == model.config.vocab_size == n


def test_directory_without_tokenizer_files_is_refused(tmp_path):
    _model(tmp_path, 100)
    with pytest.raises(AttnkitError) as e:
        load_model(tmp_path, device="cpu")
    msg = str(e.value)
    assert msg.startswith(f"could not load a model from {str(tmp_path)!r}: the directory is incomplete, missing "
                          "the tokenizer files (tokenizer.json or vocab.txt")
    assert "config.json, model.safetensors" in msg and "weights" not in msg and "\n" not in msg


def test_a_crowded_directory_that_is_no_model_is_named_in_a_few_files(tmp_path):
    for i in range(300):
        (tmp_path / f"f{i:03d}.txt").write_text("x")
    with pytest.raises(AttnkitError) as e:
        load_model(tmp_path, device="cpu")
    msg = str(e.value)
    assert "(it holds: f000.txt, f001.txt" in msg and "f009.txt, … and 290 more)" in msg and "f010" not in msg


def test_tokenizer_much_smaller_than_the_embeddings_is_refused(tmp_path):
    _tokenizer(tmp_path, [])  # 5 special tokens only
    _model(tmp_path, 100)
    with pytest.raises(AttnkitError, match="knows 5 tokens but the model embeds 100"):
        load_model(tmp_path, device="cpu")


def test_missing_weights_and_config_are_named(tmp_path):
    _tokenizer(tmp_path, WORDS)
    with pytest.raises(AttnkitError) as e:
        load_model(tmp_path, device="cpu")
    msg = str(e.value)
    assert "incomplete, missing the config (config.json); the weights (model.safetensors or" in msg
    assert not msg.rstrip().endswith(":")


def test_empty_directory_file_and_missing_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(AttnkitError, match=r"incomplete, missing .*\(it is empty\)$"):
        load_model(tmp_path / "empty", device="cpu")
    (tmp_path / "f").write_text("x")
    with pytest.raises(AttnkitError, match="is a file: give the directory"):
        load_model(tmp_path / "f", device="cpu")
    with pytest.raises(AttnkitError, match="not found"):
        load_model(tmp_path / "nope", device="cpu")


def test_unloadable_files_give_a_whole_one_line_message(tmp_path):
    _tokenizer(tmp_path, WORDS)
    _model(tmp_path, 15)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AttnkitError) as e:
        load_model(tmp_path, device="cpu")
    assert str(e.value).startswith(f"could not load a model from {str(tmp_path)!r}: ") and "\n" not in str(e.value)


def test_transformers_bars_are_silenced_while_loading_and_restored(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    n = _tokenizer(tmp_path, WORDS)
    _model(tmp_path, n)
    hf_logging.enable_progress_bar()
    capfd.readouterr()
    load_model(tmp_path, device="cpu")
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "%|" not in err
    assert hf_logging.is_progress_bar_enabled()
