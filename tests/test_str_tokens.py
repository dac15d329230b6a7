"""Readable tokens (issue 35 item 3): `attnkit.to_str_tokens` decodes each token with the tokenizer's own decoder
(byte-level BPE's 'Ġis' → ' is', 'Ċ' → a newline; SentencePiece's '▁is' → ' is'; WordPiece kept as it is), and
`attention_maps` (its `tokens`, repr and labels) and the report's head view show them so, a newline as ↵."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.tokens import shown_token, to_str_tokens

from .conftest import SENTENCES
from .synthetic import tiny_bert, tiny_decoder

TEXT = "The cat is on the mat.\nRivers bend, caf\u00e9 ok"


@pytest.fixture(scope="module")
def byte_bpe():
    """A GPT-2-style byte-level BPE tokenizer trained in memory (no special tokens added to a text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 3 + [TEXT, ", . ! ?"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style (Metaspace, '▁' for a space) BPE tokenizer, as Llama's and Gemma's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")


def test_byte_level_tokens_read_as_their_text(byte_bpe):
    raw = byte_bpe.convert_ids_to_tokens(byte_bpe(TEXT)["input_ids"])
    assert "Ġis" in raw and "Ċ" in raw  # what the tokenizer's vocabulary calls them
    out = to_str_tokens(byte_bpe, TEXT)
    assert len(out) == len(raw)
    assert " is" in out and "\n" in out
    assert not any("Ġ" in t or "Ċ" in t for t in out)
    assert "".join(out) == TEXT  # each token is the text it stands for
    ids = byte_bpe(TEXT)["input_ids"]
    assert to_str_tokens(byte_bpe, ids) == out == to_str_tokens(byte_bpe, torch.tensor(ids)) \
        == to_str_tokens(byte_bpe, np.array(ids))
    assert [shown_token(t) for t in out].count("↵") == 1


def test_sentencepiece_tokens_keep_their_word_boundary_and_wordpiece_is_kept(metaspace):
    raw = metaspace.convert_ids_to_tokens(metaspace("The cat sat")["input_ids"])
    assert any(t.startswith("▁") for t in raw)
    out = to_str_tokens(metaspace, "The cat sat")
    assert not any("▁" in t for t in out)
    assert "".join(out).strip() == "The cat sat" and " sat" in "".join(out)
    _, tok = tiny_bert()
    ids = tok("the cat sat")["input_ids"]
    assert to_str_tokens(tok, ids) == tok.convert_ids_to_tokens(ids)  # [CLS] the cat sat [SEP]


def test_bad_input_is_refused_by_name(byte_bpe):
    with pytest.raises(AttnkitError, match="to_str_tokens takes a string or a sequence of integer token ids"):
        to_str_tokens(byte_bpe, [["a"]])
    with pytest.raises(AttnkitError, match="to_str_tokens"):
        to_str_tokens(byte_bpe, [1.5, 2.0])


def test_exported_from_attnkit():
    assert attnkit.to_str_tokens is to_str_tokens
    assert "to_str_tokens" in dir(attnkit)


def test_attention_maps_of_a_byte_level_decoder_show_readable_tokens(byte_bpe):
    model = tiny_decoder("llama", vocab=len(byte_bpe))
    maps = attnkit.attention_maps(TEXT, (model, byte_bpe))
    assert maps.tokens == to_str_tokens(byte_bpe, TEXT)
    assert " is" in maps.tokens and "\n" in maps.tokens
    assert "Ġ" not in repr(maps) and "↵" in repr(maps) and "\n" not in repr(maps)
    labels = list(maps.to_pandas(0, 0).index)
    assert f"{maps.tokens.index(' is')}: is" in labels and any(label.endswith(":↵") for label in labels)
