"""Corpus readers: files → a list of segments (a str, or a (str, str) pair).

Formats, chosen by extension or `fmt`:
  text   (.txt, other)  one segment per line, or paragraphs separated by blank lines
  jsonl  (.jsonl)       one object per line with "text" and optional "text_pair"
  squad  (.json)        SQuAD 1.1/2.0: the paragraph contexts, or (question, context) pairs
  tsv    (.tsv, .csv)   a header row; the text column(s) chosen by name (GLUE files work as they are)
Every reader names the file and line of what it cannot read.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from .errors import AttnkitError

FORMATS = ("auto", "text", "jsonl", "squad", "tsv")
# TSV columns tried, in order, when none are named: (first, second or None)
_TSV_GUESSES = (("sentence1", "sentence2"), ("#1 String", "#2 String"), ("question1", "question2"),
                ("question", "sentence"), ("premise", "hypothesis"), ("sentence", None), ("text", None))


def default_corpus_path() -> Path:
    """The small English corpus shipped with attnkit (used when no corpus is given)."""
    return Path(__file__).parent / "data" / "default_corpus.txt"


def _lines(path: Path):
    """Yield (line number, decoded line without newline), naming the line of any bad byte."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise AttnkitError(f"corpus file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise AttnkitError(f"corpus path {str(path)!r} is a directory, not a file") from None
    except OSError as exc:
        raise AttnkitError(f"cannot read corpus file {str(path)!r}: {exc.strerror}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise AttnkitError(
                    f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                ) from None
            if lineno == 1:
                line = line.lstrip("\ufeff")
            yield lineno, line.rstrip("\r\n")


def read_text(path: Path, unit: str = "auto") -> list[str]:
    """`unit`: "line", "paragraph" (blank-line separated, lines joined by a space), or "auto"
    (paragraphs when the file has a blank line between text, else lines)."""
    lines = list(_lines(path))
    if unit not in ("auto", "line", "paragraph"):
        raise AttnkitError(f"unknown text unit {unit!r}; use line, paragraph or auto")
    if unit == "auto":
        texts = [i for i, (_, l) in enumerate(lines) if l.strip()]
        has_gap = any(b - a > 1 for a, b in zip(texts, texts[1:]))
        unit = "paragraph" if has_gap else "line"
    if unit == "line":
        return [l.strip() for _, l in lines if l.strip()]
    paragraphs, cur = [], []
    for _, l in lines:
        if l.strip():
            cur.append(l.strip())
        elif cur:
            paragraphs.append(" ".join(cur))
            cur = []
    if cur:
        paragraphs.append(" ".join(cur))
    return paragraphs


def read_jsonl(path: Path) -> list:
    out = []
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AttnkitError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise AttnkitError(f"{path}:{lineno}: each line needs a string field \"text\"")
        pair = obj.get("text_pair")
        if pair is not None and not isinstance(pair, str):
            raise AttnkitError(f"{path}:{lineno}: \"text_pair\" must be a string")
        out.append((obj["text"], pair) if pair else obj["text"])
    return out


def read_squad(path: Path, pairs: bool = False) -> list:
    """Contexts (each once, in file order), or (question, context) pairs with `pairs`."""
    text = "\n".join(l for _, l in _lines(path))
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AttnkitError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise AttnkitError(f"{path} is not SQuAD-format JSON (no top-level \"data\" list)")
    out, seen = [], set()
    for article in doc["data"]:
        for para in article.get("paragraphs", []):
            ctx = para.get("context")
            if not isinstance(ctx, str):
                raise AttnkitError(f"{path}: a paragraph of {article.get('title', '?')!r} has no \"context\" string")
            if pairs:
                out.extend((qa["question"], ctx) for qa in para.get("qas", []) if qa.get("question"))
            elif ctx not in seen:
                seen.add(ctx)
                out.append(ctx)
    return out


def read_table(path) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """Header and (line number, fields) rows of a delimited file: tabs, read literally (GLUE files hold
    unbalanced quotes), or commas for .csv. Bad bytes are named by file and line."""
    path = Path(path)
    delimiter = "," if path.suffix.lower() == ".csv" else "\t"
    lines = (l for _, l in _lines(path))
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    reader = csv.reader(lines, delimiter=delimiter, quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL)
    try:
        header = next(reader)
    except StopIteration:
        raise AttnkitError(f"{path} is empty") from None
    return header, list(enumerate(reader, 2))


def read_tsv(path: Path, columns: tuple | None = None) -> list:
    """Rows of a delimited file with a header. `columns`: (text column, optional pair column)."""
    header, rows = read_table(path)
    if columns:
        first, second = (list(columns) + [None])[:2]
        for c in (first, second):
            if c is not None and c not in header:
                raise AttnkitError(f"{path}: no column {c!r}; columns are: {', '.join(header)}")
    else:
        for first, second in _TSV_GUESSES:
            if first in header and (second is None or second in header):
                break
        else:
            raise AttnkitError(
                f"{path}: cannot tell which column holds the text; name it with --columns "
                f"(columns are: {', '.join(header)})"
            )
    i1 = header.index(first)
    i2 = header.index(second) if second else None
    out = []
    for rowno, row in rows:
        if not row or all(not c.strip() for c in row):
            continue
        need = max(i1, i2 or 0)
        if len(row) <= need:
            raise AttnkitError(f"{path}:{rowno}: row has {len(row)} fields, expected at least {need + 1}")
        out.append((row[i1], row[i2]) if i2 is not None else row[i1])
    return out


def detect_format(path: Path) -> str:
    ext = path.suffix.lower()
    return {".jsonl": "jsonl", ".json": "squad", ".tsv": "tsv", ".csv": "tsv"}.get(ext, "text")


def read_corpus(path, fmt: str = "auto", *, text_unit: str = "auto", squad_pairs: bool = False,
                columns: tuple | None = None, limit: int | None = None) -> list:
    """Read segments from `path` (see module docstring); refuse an empty result."""
    path = Path(path)
    if fmt not in FORMATS:
        raise AttnkitError(f"unknown corpus format {fmt!r}; use one of {', '.join(FORMATS)}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "text":
        segments = read_text(path, text_unit)
    elif fmt == "jsonl":
        segments = read_jsonl(path)
    elif fmt == "squad":
        segments = read_squad(path, pairs=squad_pairs)
    else:
        segments = read_tsv(path, columns)
    segments = [s for s in segments if (s.strip() if isinstance(s, str) else any(x.strip() for x in s))]
    if not segments:
        raise AttnkitError(f"corpus {str(path)!r} has no text ({fmt} format)")
    if limit is not None:
        if limit < 1:
            raise AttnkitError(f"--limit must be at least 1, got {limit}")
        segments = segments[:limit]
    return segments
