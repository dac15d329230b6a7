"""A dependency-parsed sentence, whatever parsed it (a CoNLL-U file or spaCy)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import AttnkitError

ROOT = -1  # head index of the root word


@dataclass
class ParsedSentence:
    """`words[i]` has syntactic head `heads[i]` (0-based word index, ROOT for the root) by relation
    `relations[i]`. `text` and `spans` (character offsets of each word in `text`) are set when the words
    come from running text (spaCy); CoNLL-U sentences have pre-split words and no spans."""

    words: list[str]
    heads: list[int]
    relations: list[str]
    text: str | None = None
    spans: list[tuple[int, int]] | None = None
    where: str = ""  # file and line, for messages

    def __post_init__(self):
        n = len(self.words)
        if len(self.heads) != n or len(self.relations) != n or (self.spans is not None and len(self.spans) != n):
            raise AttnkitError(f"{self.where}: words, heads, relations (and spans) must have one entry per word")
        for i, h in enumerate(self.heads):
            if h != ROOT and not 0 <= h < n:
                raise AttnkitError(f"{self.where}: word {i + 1} ({self.words[i]!r}) has head {h + 1}, outside the "
                                   f"sentence of {n} words")
            if h == i:
                raise AttnkitError(f"{self.where}: word {i + 1} ({self.words[i]!r}) is its own head")
