"""From text to batches: tokenisation, token classes and sentence ids (SPEC.md "Token classes and sentences").

Class of a token: CLS (the tokenizer's cls/bos token), SEP (sep/eos), COMMA (token string exactly
","), PERIOD (exactly "."), else OTHER. Sentence ids: the segments of a text pair are different
sentences; with `split_sentences`, a segment is also split after "."/"!"/"?" tokens. A special token
belongs to the sentence before it, so [CLS] is in the first sentence and a [SEP] in the one it closes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .errors import AttnkitError
from .features import CLS, COMMA, OTHER, PERIOD, SEP

Segment = Union[str, tuple]
SENTENCE_END = (".", "!", "?")


@dataclass
class Batch:
    """A tokenised, right-padded batch plus what the attention op needs about its tokens."""

    inputs: dict  # input_ids, attention_mask (and token_type_ids) as the model takes them
    lengths: torch.Tensor  # int64 B
    token_class: torch.Tensor  # int32 B×L
    sentence_id: torch.Tensor  # int32 B×L
    n_truncated: int  # samples longer than max_length, cut to it

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.inputs.items()}, self.lengths.to(device),
                     self.token_class.to(device), self.sentence_id.to(device), self.n_truncated)


def _ids(tokenizer, *names) -> set[int]:
    out = set()
    for name in names:
        tid = getattr(tokenizer, f"{name}_token_id", None)
        if tid is not None:
            out.add(int(tid))
    return out


def _exact_token_id(tokenizer, token: str) -> int | None:
    """Id of a vocabulary entry whose string is exactly `token`, if there is one."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id and token != tokenizer.unk_token:
        return None
    return int(tid) if tokenizer.convert_ids_to_tokens(int(tid)) == token else None


def sentence_ids(ids: list[int], sequence_ids: list, end_ids=()) -> list[int]:
    """Sentence id per token of one sample. `sequence_ids`: the segment of each token (None for a
    special token, which belongs to the sentence before it); a new segment starts a new sentence, and
    so does the token after one of `end_ids` (sentence-final tokens, when splitting sentences)."""
    out = []
    sid, prev_seq, pending = 0, None, False
    for tok, seq in zip(ids, sequence_ids):
        if seq is None:  # special token: belongs to the sentence before it
            out.append(sid)
            continue
        if (prev_seq is not None and seq != prev_seq) or pending:
            sid += 1
        pending = tok in end_ids
        prev_seq = seq
        out.append(sid)
    return out


class Encoder:
    """Turns lists of segments (str or (str, str)) into `Batch`es for one tokenizer."""

    def __init__(self, tokenizer, max_length: int = 128, split_sentences: bool = False):
        if not getattr(tokenizer, "is_fast", False):
            raise AttnkitError("attnkit needs a fast (Rust) tokenizer to locate segments")
        if max_length < 2:
            raise AttnkitError(f"max_length must be at least 2, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.split_sentences = split_sentences
        self.cls_ids = _ids(tokenizer, "cls", "bos")
        self.sep_ids = _ids(tokenizer, "sep", "eos")
        self.comma_id = _exact_token_id(tokenizer, ",")
        self.period_id = _exact_token_id(tokenizer, ".")
        self.end_ids = {i for i in (_exact_token_id(tokenizer, t) for t in SENTENCE_END) if i is not None}

    def token_classes(self, ids: torch.Tensor) -> torch.Tensor:
        cls = torch.full_like(ids, OTHER, dtype=torch.int32)
        for tid, code in ((self.comma_id, COMMA), (self.period_id, PERIOD)):
            if tid is not None:
                cls[ids == tid] = code
        for tid in self.sep_ids:
            cls[ids == tid] = SEP
        for tid in self.cls_ids:
            cls[ids == tid] = CLS
        return cls

    def sentence_ids(self, ids: list[int], sequence_ids: list) -> list[int]:
        return sentence_ids(ids, sequence_ids, self.end_ids if self.split_sentences else ())

    def __call__(self, segments: Sequence[Segment]) -> Batch:
        if not segments:
            raise AttnkitError("cannot encode an empty batch")
        items = [s if isinstance(s, str) else list(s) for s in segments]
        tok = self.tokenizer
        enc = tok(items, truncation=True, max_length=self.max_length, padding="longest",
                  return_tensors="pt", padding_side="right")
        # the Rust encodings keep what truncation cut off: no second tokenisation to count it
        n_truncated = sum(bool(e.overflowing) for e in enc.encodings)
        mask = enc["attention_mask"]
        lengths = mask.sum(-1).to(torch.int64)
        ids = enc["input_ids"]
        token_class = self.token_classes(ids)
        sentence = torch.zeros_like(ids, dtype=torch.int32)
        for b in range(ids.shape[0]):
            n = int(lengths[b])
            sid = self.sentence_ids(ids[b, :n].tolist(), enc.sequence_ids(b)[:n])
            sentence[b, :n] = torch.tensor(sid, dtype=torch.int32)
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        return Batch(inputs, lengths, token_class, sentence, n_truncated)
