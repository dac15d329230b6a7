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
        cycle = head_cycle(self.heads)
        if cycle:
            raise AttnkitError(f"{self.where}: the heads form a cycle through words "
                               f"{', '.join(str(i + 1) for i in cycle)}: not a dependency tree")

    def check_one_root(self) -> None:
        """Refuse a sentence whose words have no root or more than one (a CoNLL-U sentence is one tree)."""
        roots = [i + 1 for i, h in enumerate(self.heads) if h == ROOT]
        if len(roots) != 1:
            raise AttnkitError(f"{self.where}: a sentence has one root word (HEAD 0), this one has "
                               + (f"{len(roots)}: words {', '.join(map(str, roots))}" if roots else "none")
                               + ": not a dependency tree")


def head_cycle(heads: list[int]) -> list[int]:
    """The words (0-based) of a cycle that following `heads` from some word runs into, or [] when every word
    reaches a root."""
    state = [0] * len(heads)  # 0: not seen, 1: on the current path, 2: reaches a root
    for start in range(len(heads)):
        path, i = [], start
        while i != ROOT and state[i] == 0:
            state[i] = 1
            path.append(i)
            i = heads[i]
        if i != ROOT and state[i] == 1:
            return path[path.index(i):]
        for j in path:
            state[j] = 2
    return []
