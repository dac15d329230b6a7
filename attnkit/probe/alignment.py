"""Which word each word piece belongs to.

Two ways, both ending in a per-token word id (-1 for special tokens and pieces of no usable word):
  * `align_word_ids`: pre-split words (CoNLL-U) encoded with `is_split_into_words=True`; the fast
    tokenizer's `word_ids()` are the alignment.
  * `align_offsets`: running text and each word's character span (spaCy); a piece belongs to the one word
    its character offsets overlap. A piece overlapping two words (e.g. spaCy splits "cannot" into "can" +
    "not" but the tokenizer keeps one piece) makes both words unaligned.
A word is aligned when it has at least one piece and shares none with another word. Unaligned words
(including those whose pieces were cut by truncation) are no candidates and their relations are not
scored; they are counted.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Alignment:
    word_id: list[int]         # per token of the encoded sample, -1: special token or unaligned piece
    aligned: list[bool]        # per word
    n_truncated: int = 0       # words without a piece because the sample was truncated
    n_split: int = 0           # words sharing a piece with another word (offsets only)
    n_no_piece: int = 0        # other words without a piece (e.g. whitespace words)

    @property
    def n_unaligned(self) -> int:
        return self.aligned.count(False)


def align_word_ids(word_ids: list, n_words: int) -> Alignment:
    """From a fast tokenizer's `word_ids()` (None for special tokens) over `n_words` pre-split words."""
    ids = [-1 if w is None else int(w) for w in word_ids]
    seen = set(ids)
    aligned = [w in seen for w in range(n_words)]
    missing = aligned.count(False)
    return Alignment(ids, aligned, n_truncated=missing)


def align_offsets(offsets: list, special: list, spans: list, text: str, truncated: bool) -> Alignment:
    """From per-token character `offsets` ((start, end), special tokens marked in `special`) and per-word
    character `spans` in `text`. `truncated`: the encoding lost tokens at the end (words after its last piece
    are then counted as truncated; whitespace-only words never are: they have no piece in any case)."""
    text_length = len(text)
    # character -> word (spans do not overlap)
    char_word = [-1] * (text_length + 1)
    for w, (a, e) in enumerate(spans):
        for c in range(a, e):
            char_word[c] = w
    ids, split = [], set()
    for (a, e), sp in zip(offsets, special):
        if sp or e <= a:
            ids.append(-1)
            continue
        hit = {char_word[c] for c in range(a, min(e, text_length)) if char_word[c] >= 0}
        if len(hit) == 1:
            ids.append(hit.pop())
        else:
            split |= hit
            ids.append(-1)
    if split:
        ids = [-1 if w in split else w for w in ids]
    has_piece = set(ids)
    last_char = max((e for (a, e), sp in zip(offsets, special) if not sp and e > a), default=0)
    aligned, n_trunc, n_none = [], 0, 0
    for w, (a, e) in enumerate(spans):
        ok = w in has_piece and w not in split
        aligned.append(ok)
        if not ok and w not in split:
            if truncated and a >= last_char and text[a:e].strip():
                n_trunc += 1
            else:
                n_none += 1
    return Alignment(ids, aligned, n_truncated=n_trunc, n_split=len(split), n_no_piece=n_none)
