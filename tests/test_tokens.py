"""Token classes and sentence ids from real tokenizer output (BERT- and RoBERTa-style vocabularies)."""

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
