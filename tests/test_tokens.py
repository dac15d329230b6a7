"""Token classes and sentence ids from real tokenizer output (BERT- and RoBERTa-style vocabularies)."""

import numpy as np

from attnkit.features import CLS, COMMA, OTHER, PERIOD, SEP
from attnkit.tokens import Encoder


def _row(batch, b=0):
    n = int(batch.lengths[b])
    return batch.token_class[b, :n].tolist(), batch.sentence_id[b, :n].tolist()


def test_bert_single_text_classes(minilm):
    _, tok = minilm
    enc = Encoder(tok, max_length=32)
    batch = enc(["Hi, there. Bye!"])
    toks = tok.convert_ids_to_tokens(batch.inputs["input_ids"][0, : int(batch.lengths[0])].tolist())
    assert toks == ["[CLS]", "hi", ",", "there", ".", "bye", "!", "[SEP]"]
    classes, sents = _row(batch)
    assert classes == [CLS, OTHER, COMMA, OTHER, PERIOD, OTHER, OTHER, SEP]
    assert sents == [0] * 8
    split = Encoder(tok, max_length=32, split_sentences=True)(["Hi, there. Bye!"])
    # a new sentence starts after "." ; [SEP] closes the last sentence
    assert _row(split)[1] == [0, 0, 0, 0, 0, 1, 1, 1]


def test_bert_pairs_padding_and_truncation(minilm):
    _, tok = minilm
    enc = Encoder(tok, max_length=10)
    batch = enc([("a b", "c d e"), "one two three four five six seven eight nine ten"])
    classes, sents = _row(batch, 0)
    # [CLS] a b [SEP] c d e [SEP]
    assert classes == [CLS, OTHER, OTHER, SEP, OTHER, OTHER, OTHER, SEP]
    assert sents == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.lengths.tolist() == [8, 10]
    assert batch.n_truncated == 1
    assert batch.inputs["attention_mask"][0].tolist() == [1] * 8 + [0] * 2  # right padding


def test_roberta_style_pairs(roberta_tokenizer):
    tok = roberta_tokenizer
    batch = Encoder(tok, max_length=64)([("The cat sat.", "Rivers bend, lakes form.")])
    ids = batch.inputs["input_ids"][0, : int(batch.lengths[0])].tolist()
    toks = tok.convert_ids_to_tokens(ids)
    classes, sents = _row(batch)
    assert toks[0] == "<s>" and classes[0] == CLS
    # <s> A </s> </s> B </s>: the first </s> closes A; the second follows it; B is sentence 1
    seps = [i for i, t in enumerate(toks) if t == "</s>"]
    assert len(seps) == 3 and all(classes[i] == SEP for i in seps)
    assert sents[seps[0]] == 0 and sents[seps[-1]] == 1
    for i, t in enumerate(toks):
        if t == ",":
            assert classes[i] == COMMA
        if t == ".":
            assert classes[i] == PERIOD
    assert sents[seps[1] + 1] == 1 and max(sents) == 1
    assert COMMA in classes and PERIOD in classes


def test_encoder_refuses_slow_tokenizer():
    import pytest

    from attnkit.errors import AttnkitError

    class Slow:
        is_fast = False

    with pytest.raises(AttnkitError, match="fast"):
        Encoder(Slow())


def _assert_same_arrays(got, want):
    assert got.inputs.keys() == want.inputs.keys()
    for k in want.inputs:
        np.testing.assert_array_equal(got.inputs[k], want.inputs[k], err_msg=k)
    for name in ("lengths", "token_class", "sentence_id", "full_lengths"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.n_truncated == want.n_truncated and got.n_tokens == want.n_tokens


def test_rows_of_a_batch_are_the_batch_of_those_segments_alone(minilm, decoder_tokenizer):
    """A planned unit is tokenised once and its forwards take its rows (attnkit/engine/plan.py): each set of rows
    must be exactly what tokenising those segments alone gives, padding width, truncation counts and the
    padding's token classes (a decoder pads with EOS) included."""
    _, tok = minilm
    long = "one two three four five six seven eight nine ten eleven twelve"
    segments = ["Hi, there. Bye!", ("a b", "c d e"), long, "x", (long, "and a second side."), "Short one."]
    for enc in (Encoder(tok, max_length=10, split_sentences=True), Encoder(tok, max_length=64)):
        whole = enc.encode_arrays(segments)
        for index in ([3], [5, 3], [2, 4, 0], [1, 0, 3, 5], list(range(len(segments)))[::-1]):
            _assert_same_arrays(whole.rows(np.array(index)), enc.encode_arrays([segments[i] for i in index]))
        for start, stop in ((0, 1), (1, 4), (3, 6)):  # spans: what a unit sorted once runs
            _assert_same_arrays(whole.span(start, stop), enc.encode_arrays(segments[start:stop]))
    dec = Encoder(decoder_tokenizer, max_length=12)
    texts = ["A longer text of the decoder, with a comma.", "Short.", "Mid length text here."]
    whole = dec.encode_arrays(texts)
    for index in ([1], [2, 1], [1, 2, 0]):
        _assert_same_arrays(whole.rows(np.array(index)), dec.encode_arrays([texts[i] for i in index]))
