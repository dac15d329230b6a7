"""A small CoNLL-U reader (https://universaldependencies.org/format.html): the syntactic words of each
sentence with HEAD and DEPREL. Multiword-token lines (`3-4`) and empty nodes (`8.1`) are skipped: the
syntactic words are what dependencies relate. Relations keep their subtypes (`nmod:poss`)."""
from __future__ import annotations

from pathlib import Path

from ..corpus.streams import Lines, decompressed, open_file, split_compression
from ..errors import AttnkitError
from .sentences import ROOT, ParsedSentence


def _sentence(rows, where: str) -> ParsedSentence:
    words, heads, rels = [], [], []
    for lineno, cols in rows:
        if cols[0] != str(len(words) + 1):
            raise AttnkitError(f"{where}:{lineno}: word ID {cols[0]!r} out of order (expected {len(words) + 1})")
        try:
            head = int(cols[6])
        except ValueError:
            raise AttnkitError(f"{where}:{lineno}: HEAD {cols[6]!r} is not a number (unparsed sentence?)") from None
        words.append(cols[1])
        heads.append(ROOT if head == 0 else head - 1)
        rels.append(cols[7])
    sentence = ParsedSentence(words, heads, rels, where=f"{where}:{rows[0][0]}")
    sentence.check_one_root()
    return sentence


def check_conllu_path(path) -> None:
    if not Path(str(path)).exists():
        raise AttnkitError(f"CoNLL-U file {str(path)!r} does not exist")


def read_conllu(path) -> list[ParsedSentence]:
    """All sentences of one CoNLL-U file (may be .gz/.zst compressed), read through the corpus readers'
    streams (attnkit/corpus/streams.py): bad bytes, corrupt or truncated compressed data end in the same
    one-line errors as in `attnkit extract`. A sentence whose heads do not form one tree is refused, named."""
    path = str(path)
    check_conllu_path(path)
    sentences, rows = [], []
    with Lines(decompressed(open_file(path), split_compression(path)[0]), path) as lines:
        for lineno, line in lines:
            line = line.rstrip("\r\n")
            if not line.strip():
                if rows:
                    sentences.append(_sentence(rows, path))
                    rows = []
                continue
            if line.startswith("#"):
                continue
            cols = line.split("\t")
            if len(cols) != 10:
                raise AttnkitError(f"{path}:{lineno}: a CoNLL-U word line has 10 tab-separated columns, got "
                                   f"{len(cols)}")
            if "-" in cols[0] or "." in cols[0]:
                continue  # multiword token or empty node
            rows.append((lineno, cols))
    if rows:
        sentences.append(_sentence(rows, path))
    if not sentences:
        raise AttnkitError(f"{path}: no sentences found (is it CoNLL-U?)")
    return sentences
