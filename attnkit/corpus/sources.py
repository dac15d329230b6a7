"""One corpus input each: how a file of one format turns into a stream of segments (a str, or a
(str, str) pair), what was decided while reading it (text unit, columns), and its content hash.

Every reader streams, except SQuAD JSON: a .json file is one document, parsed whole (json.loads) and then
checked against attnkit.run.schemas.SQUAD_SCHEMA. Blank segments are skipped here, so counts per source are
counts of real text.
"""
from __future__ import annotations

import csv
import datetime
import json
import stat
import sys
import time
from pathlib import Path

from ..errors import AttnkitError, arg
from ..run.schemas import SQUAD_SCHEMA, validate
from .streams import (
    PEEK_LINES,
    HashingReader,
    Lines,
    decompressed,
    hash_file,
    hash_files,
    open_file,
    sniffed,
    split_compression,
)

# Text columns (or JSONL fields) tried, in order, when none are named: (first, second or None)
TEXT_COLUMN_GUESSES = (("sentence1", "sentence2"), ("#1 String", "#2 String"), ("question1", "question2"),
                ("question", "sentence"), ("premise", "hypothesis"), ("sentence", None), ("text", None))
# An encoder–decoder's (source, target) columns (or fields) tried, in order, when none are named (docs/seq2seq.md)
PAIR_COLUMN_GUESSES = (("source", "target"), ("src", "tgt")) + tuple(g for g in TEXT_COLUMN_GUESSES if g[1])
# A quoted CSV field may hold newlines, but one that runs this many lines is an unclosed quote.
CSV_MAX_ROW_LINES = 200
STDIN_NAME = "<stdin>"

# A file rewritten within one tick of its filesystem's clock (up to 2 s on some) with the same size keeps its
# stat key: a hash is trusted only for a file last modified well before it was hashed (git's "racy" rule). A file
# dated in the future (a skewed clock) is hashed again each time: correct, at the cost of a read.
RACY_MTIME_NS = 2_000_000_000


def is_blank(segment) -> bool:
    return not segment.strip() if isinstance(segment, str) else not any(x.strip() for x in segment)


def check_pair(a: str, b: str, cols, where: str, pairs: bool = False) -> tuple[str, str]:
    """(a, b), a text pair from columns (or fields) `cols`, unless exactly one side is blank: refused as a null
    side is (`columns_to_segments`), since measuring (text, "") would be a silent answer about another input than
    the pair the data meant. A pair blank on both sides is a blank segment, skipped as every blank one is.
    `where`: the input and row, as messages name them; `pairs`: an encoder–decoder's (source, target) pair, which
    one column cannot replace."""
    if (not a.strip()) != (not b.strip()):
        col = cols[0] if not a.strip() else cols[1]
        hint = "" if pairs else f" (or name one text column with {arg('columns')})"
        raise AttnkitError(f"{where}: the pair column {col!r} is empty; drop or fill such rows{hint}")
    return a, b


def check_text(text: str, where: str) -> str:
    """`text`, refused when a JSON escape left a lone surrogate in it (not text; tokenizers fail on it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise AttnkitError(f"{where}: holds a lone surrogate escape (\\u{ord(text[exc.start]):04x}), which is "
                           f"not text") from None
    return text


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def parse_json(text: str, where: str, unique_keys: bool = False):
    """json.loads with one-line errors (syntax with its line, or nesting too deep). `unique_keys`: an object
    that names a key twice is refused (json.loads would keep the last value without a word)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys) if unique_keys else json.loads(text)
    except _DuplicateKey as exc:
        raise AttnkitError(f"{where}: an object names the field {str(exc)!r} twice; which value holds the text "
                           "is ambiguous") from None
    except json.JSONDecodeError as exc:
        line = f":{exc.lineno}" if ":" not in where else ""
        raise AttnkitError(f"{where}{line}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise AttnkitError(f"{where}: JSON nested too deeply") from None


def _names(names) -> str:
    """Column names for a one-line message (names holding newlines or other control characters quoted)."""
    return ", ".join(n if isinstance(n, str) and n.isprintable() else repr(n) for n in names) or "none"


class NoTextColumn(AttnkitError):
    """No column was named and none of the usual text columns is there."""


def choose_columns(available, columns, name: str, kind: str = "column", guesses=TEXT_COLUMN_GUESSES):
    """(first, second or None): the named `columns`, else the first of `guesses` present in `available`."""
    available = list(available)
    if columns:
        first, second = (list(columns) + [None])[:2]
        for c in (first, second):
            if c is not None and c not in available:
                raise AttnkitError(f"{name}: no {kind} {c!r}; {kind}s are: {_names(available)}")
        return _unique(available, (first, second), name, kind)
    for first, second in guesses:
        if first in available and (second is None or second in available):
            return _unique(available, (first, second), name, kind)
    raise NoTextColumn(f"{name}: cannot tell which {kind} holds the text; name it with {arg('columns')} "
                       f"({kind}s are: {_names(available)})")


def choose_pair_columns(available, columns, name: str, kind: str = "column") -> tuple[str, str]:
    """(source, target): an encoder–decoder's two columns (docs/seq2seq.md), the named `columns`, else the first
    of PAIR_COLUMN_GUESSES present in `available`, else the only two there are. One column is refused by name: an
    encoder–decoder measures pairs."""
    available = list(available)
    if columns is not None and len(columns) != 2:
        raise AttnkitError(f"{name}: an encoder–decoder measures (source, target) pairs: name two {kind}s with "
                           f"{arg('columns')} SOURCE,TARGET, not one")
    if not columns and len(available) == 2 and not any(a in available and b in available
                                                       for a, b in PAIR_COLUMN_GUESSES):
        return _unique(available, tuple(available), name, kind)
    try:
        return choose_columns(available, columns, name, kind, guesses=PAIR_COLUMN_GUESSES)
    except NoTextColumn:
        raise NoTextColumn(f"{name}: an encoder–decoder measures (source, target) pairs, but no {kind}s are named "
                           f"source and target: name them with {arg('columns')} SOURCE,TARGET ({kind}s are: "
                           f"{_names(available)})") from None


def _unique(available: list, chosen: tuple, name: str, kind: str) -> tuple:
    """`chosen` when each of its names occurs once in `available`: a header that names a column twice leaves
    open which one holds the text."""
    for c in chosen:
        if c is not None and available.count(c) > 1:
            raise AttnkitError(f"{name}: the {kind} name {c!r} occurs {available.count(c)} times, so which one "
                               f"holds the text is ambiguous; rename one ({kind}s are: {_names(available)})")
    return chosen


def _describe_columns(kind: str, first: str, second: str | None) -> str:
    return f"pairs from {kind}s {first} + {second}" if second else f"texts from {kind} {first}"


class Source:
    """One input: `.path` ("-" for standard input), `.format`, `.compression`; `.segments()` streams its
    non-blank segments; `.describe()` says how it was read."""

    format = "?"
    lone_cr: bool | None = True  # a lone "\r" ends a line (old Mac text); see streams.raw_lines

    def __init__(self, path: str, compression: str | None = None, *, text_unit: str = "auto",
                 columns=None, squad_pairs: bool = False, pairs: bool = False, stdin=None, stream: bool = False):
        self.path = str(path)
        self.pairs = pairs  # an encoder–decoder's corpus: every segment a (source, target) pair (docs/seq2seq.md)
        self.compression = compression
        self.text_unit, self.columns, self.squad_pairs = text_unit, columns, squad_pairs
        # Standard input (`stdin`, a binary stream) and files that are no regular files (`stream`: pipes, FIFOs,
        # process substitution) are read once, as streams: one shared line stream whose look-ahead (the plan)
        # is kept for the pass, hashed while it is read (the hash is known at its end).
        self._is_stdin = stdin is not None
        self._reader = HashingReader(stdin) if stdin is not None else None  # a stream's bytes, hashed as read
        self._pipe = bool(stream) and stdin is None
        self._stream_lines = None
        self._plan = None
        self._hash = None  # (stat key, when it was hashed (ns), sha256) of the last hash of a file
        self.n_segments = None  # segments taken from this source by the last complete pass over the corpus

    @property
    def name(self) -> str:
        """How messages name this input."""
        return STDIN_NAME if self._is_stdin else self.path

    @property
    def is_stream(self) -> bool:
        """Read once, as a stream (standard input, a pipe): it cannot be read again."""
        return self._is_stdin or self._pipe

    # --- what the reader decided -------------------------------------------------------------------
    def plan(self) -> dict:
        """The settings resolved from the start of the input (cached): text_unit, columns, ..."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> dict:
        return {}

    def _choose(self, available, kind: str = "column") -> tuple:
        """(first, second or None) of `available` columns (or fields): choose_columns, or with `pairs`
        choose_pair_columns."""
        if self.pairs:
            return choose_pair_columns(available, self.columns, self.name, kind)
        return choose_columns(available, self.columns, self.name, kind)

    def refuse_single_texts(self, what: str) -> None:
        """An encoder–decoder's corpus given a format of single texts (`what`)."""
        if self.pairs:
            raise AttnkitError(f"{self.name}: {what} holds single texts, but an encoder–decoder measures (source, "
                               "target) pairs: give TSV/CSV, JSONL, Parquet or datasets input with source and "
                               f"target columns (or name them with {arg('columns')} SOURCE,TARGET)")

    def segments(self):
        """The non-blank segments, streamed."""
        segments = self._read(self.plan())
        try:
            for seg in segments:
                if not is_blank(seg):
                    yield seg
        finally:
            segments.close()  # closes the file now when the consumer stops early

    def _read(self, plan):
        raise NotImplementedError

    # --- line-based formats ---------------------------------------------------------------------------
    def _lines(self) -> Lines:
        """A fresh line stream of a file; for a stream the one shared line stream (its look-ahead is kept
        for the pass that follows the plan)."""
        if self.is_stream:
            if self._stream_lines is None:
                if self._reader is None:  # a pipe: opened when first read (opening a FIFO waits for its writer)
                    self._reader = HashingReader(open_file(self.path), owns=True)
                compression, stream = sniffed(self._reader)  # gzip/zstd by magic bytes, whatever the name says
                self.compression = compression or self.compression
                self._stream_lines = Lines(decompressed(stream, self.compression), self.name, lone_cr=self.lone_cr)
            return self._stream_lines
        return Lines(decompressed(open_file(self.path), self.compression), self.path, lone_cr=self.lone_cr)

    def _close_lines(self, lines: Lines) -> None:
        """Close a line stream used for the plan (a stream's shared one stays open for the pass)."""
        if not self.is_stream:
            lines.close()

    # --- identity ---------------------------------------------------------------------------------------
    def sha256(self) -> str | None:
        """sha256 of the raw file bytes; for a stream the hash of what was read, once read to its end (None
        before)."""
        if self.is_stream:
            return self._reader.sha256.hexdigest() if self._reader is not None and self._reader.at_end else None
        try:
            st = Path(self.path).stat()
        except OSError:
            return hash_file(self.path)  # raises the one-line error
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # ctime: a rewrite that restores mtime
        if self._hash is None or self._hash[0] != key or st.st_mtime_ns >= self._hash[1] - RACY_MTIME_NS:
            self._hash = (key, time.time_ns(), hash_file(self.path))
        return self._hash[2]

    def bytes_read_sha256(self) -> str | None:
        """For a stream: sha256 of the bytes read from it so far (None for a file, or before any read)."""
        return self._reader.sha256.hexdigest() if self._reader is not None else None

    def describe(self) -> dict:
        plan = self.plan()
        return {"path": self.path, "format": self.format, "compression": self.compression,
                "text_unit": plan.get("text_unit"), "columns": plan.get("columns"),
                "squad_pairs": plan.get("squad_pairs"), "sha256": self.sha256(), "n_segments": self.n_segments,
                **self.file_state()}

    def file_state(self) -> dict:
        """{"size", "mtime"}: the input's size in bytes and modification time (ISO 8601, UTC) as it is now,
        to say how an input changed (None for a stream)."""
        if self.is_stream:
            return {"size": None, "mtime": None}
        try:
            st = Path(self.path).stat()
        except OSError:
            return {"size": None, "mtime": None}
        when = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
        return {"size": st.st_size if stat.S_ISREG(st.st_mode) else None,
                "mtime": when.isoformat(timespec="seconds").replace("+00:00", "Z")}

    def settings(self) -> dict:
        """What decides the segments besides the bytes (for the corpus fingerprint)."""
        plan = {k: v for k, v in self.plan().items() if k != "text_unit_auto"}  # how it was chosen does not matter
        return {"format": self.format, "compression": self.compression, **plan}

    def summary_line(self) -> str:
        how = f"{self._kind()} ({self.compression})" if self.compression else self._kind()
        return f"{self.name}: {how}, {self._how()}"

    def _kind(self) -> str:
        return self.format

    def _how(self) -> str:
        return ""

    def __repr__(self):
        return f"{type(self).__name__}({self.path!r})"


class TextSource(Source):
    """Plain text: one segment per line, or per paragraph (blank-line separated; its lines joined by a
    space), or the whole file (`file`: its lines joined by line breaks). `auto` picks paragraphs when the
    look-ahead (first 10,000 lines / 1 MB) has a blank line between text, else lines."""

    format = "text"

    def _make_plan(self):
        self.refuse_single_texts("plain text")
        unit = self.text_unit
        if unit != "auto":
            return {"text_unit": unit, "text_unit_auto": False}
        lines = self._lines()
        try:
            ahead = lines.peek()
        finally:
            self._close_lines(lines)
        texts = [i for i, (_, line) in enumerate(ahead) if line.strip()]
        gap = any(b - a > 1 for a, b in zip(texts, texts[1:]))
        return {"text_unit": "paragraph" if gap else "line", "text_unit_auto": True}

    def _read(self, plan):
        with self._lines() as lines:
            if plan["text_unit"] == "line":
                for _, line in lines:
                    yield line.strip()
                return
            if plan["text_unit"] == "file":  # the whole file, its line breaks kept (long documents, decoders)
                text = "\n".join(line.rstrip("\r\n") for _, line in lines).strip()
                if text:
                    yield text
                return
            cur = []
            for _, line in lines:
                line = line.strip()
                if line:
                    cur.append(line)
                elif cur:
                    yield " ".join(cur)
                    cur = []
            if cur:
                yield " ".join(cur)

    def _how(self):
        plan = self.plan()
        how = {"paragraph": "one segment per paragraph (blank-line separated)",
               "file": "the whole file as one segment"}.get(plan["text_unit"], "one segment per line")
        if plan["text_unit_auto"]:
            how += (f" (auto: {'a' if plan['text_unit'] == 'paragraph' else 'no'} blank line between text in its "
                    f"first {PEEK_LINES:,} lines)")
        return how


class JsonlSource(Source):
    """JSON Lines: one object per line. Fields: `columns`, else "text" with an optional "text_pair"
    (a pair where present), else the first of the TSV guesses present in the first object."""

    format = "jsonl"

    def _parse(self, lineno, line):
        obj = parse_json(line, f"{self.name}:{lineno}", unique_keys=True)
        if not isinstance(obj, dict):
            raise AttnkitError(f"{self.name}:{lineno}: each line must be a JSON object, got {type(obj).__name__}")
        return obj

    def _make_plan(self):
        if self.columns and not self.pairs:
            first, second = (list(self.columns) + [None])[:2]
            return {"columns": [c for c in (first, second) if c], "pair_optional": False}
        lines = self._lines()
        try:
            first_obj = lines.first(str.strip)
        finally:
            self._close_lines(lines)
        if self.pairs:  # every line needs both fields (a line without one is refused by name when read)
            if first_obj is None:
                return {"columns": list(self.columns or ("source", "target")), "pair_optional": False}
            source, target = self._choose(self._parse(*first_obj), kind="field")
            return {"columns": [source, target], "pair_optional": False}
        if first_obj is None or "text" in self._parse(*first_obj):
            return {"columns": ["text", "text_pair"], "pair_optional": True}
        obj = self._parse(*first_obj)
        first, second = choose_columns(obj, None, f"{self.name}:{first_obj[0]}", kind="field")
        return {"columns": [c for c in (first, second) if c], "pair_optional": False}

    def _read(self, plan):
        first, second = (plan["columns"] + [None])[:2]
        optional = plan["pair_optional"]
        with self._lines() as lines:
            for lineno, line in lines:
                if not line.strip():
                    continue
                obj = self._parse(lineno, line)
                text = obj.get(first)
                if not isinstance(text, str):
                    raise AttnkitError(f"{self.name}:{lineno}: each line needs a string field \"{first}\"")
                check_text(text, f"{self.name}:{lineno}: field \"{first}\"")
                if second is None:
                    yield text
                    continue
                pair = obj.get(second)
                if optional and pair is None:
                    yield text
                elif not isinstance(pair, str):
                    raise AttnkitError(f"{self.name}:{lineno}: \"{second}\" must be a string")
                else:
                    check_text(pair, f"{self.name}:{lineno}: field \"{second}\"")
                    if optional and not pair:  # a text_pair "" is no pair: the text alone, as without the field
                        yield text
                    else:
                        yield check_pair(text, pair, plan["columns"], f"{self.name}:{lineno}", self.pairs)

    def _how(self):
        plan = self.plan()
        if plan["pair_optional"]:
            return "texts from field text (pairs with text_pair where present)"
        return _describe_columns("field", *(plan["columns"] + [None])[:2])


class SquadSource(Source):
    """SQuAD JSON: the paragraph contexts (each once, in file order), or (question, context) pairs.
    The file is one JSON document, so it is read whole (unlike every other format)."""

    format = "squad"

    def _make_plan(self):
        if not self.squad_pairs:
            self.refuse_single_texts("SQuAD JSON without --squad-pairs")
        return {"squad_pairs": bool(self.squad_pairs)}

    def _read(self, plan):
        with self._lines() as lines:
            text = "\n".join(line for _, line in lines)
        doc = parse_json(text, self.name)
        validate(doc, SQUAD_SCHEMA, f"{self.name} is not SQuAD-format JSON")
        seen = set()
        for i, article in enumerate(doc["data"]):
            for j, para in enumerate(article.get("paragraphs", [])):
                where = f"{self.name}: data[{i}].paragraphs[{j}]"
                ctx = check_text(para["context"], f"{where}.context")
                if plan["squad_pairs"]:
                    for k, qa in enumerate(para.get("qas", [])):
                        if qa["question"]:
                            yield check_text(qa["question"], f"{where}.qas[{k}].question"), ctx
                elif ctx not in seen:
                    seen.add(ctx)
                    yield ctx

    def _kind(self):
        return "SQuAD JSON"

    def _how(self):
        return "(question, context) pairs" if self.plan()["squad_pairs"] else "paragraph contexts, each once"


def _delimiter(path: str) -> str:
    """Commas for .csv (also under .gz/.zst), tabs otherwise."""
    return "," if Path(split_compression(path)[1]).suffix.lower() == ".csv" else "\t"


def table_rows(lines: Lines, delimiter: str, name: str):
    """(line number where the row starts, fields) of a delimited stream. Tabs are read literally, one row per
    line split at every tab (GLUE files hold unbalanced quotes; a lone carriage return is field content);
    commas follow CSV quoting, strictly: a quoted field left open to the end of the file, or running past
    CSV_MAX_ROW_LINES lines, is refused naming the line where it started."""
    if delimiter == "\t":
        for lineno, line in lines:
            yield lineno, line.split("\t")
        return
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    state = {"start": 1, "last": 0}

    def feed():
        for lineno, line in lines:
            if lineno - state["start"] >= CSV_MAX_ROW_LINES:
                raise AttnkitError(f"{name}:{state['start']}: a quoted field opened on this line runs past "
                                   f"{CSV_MAX_ROW_LINES} lines (unclosed quote?)")
            state["last"] = lineno
            yield line + "\n"

    reader = csv.reader(feed(), delimiter=delimiter, strict=True)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            if "unexpected end of data" in str(exc):
                raise AttnkitError(f"{name}:{state['start']}: a quoted field opened on this line is never closed "
                                   f"(it runs to the end of the file)") from None
            kind = "CSV" if delimiter == "," else "TSV"
            raise AttnkitError(f"{name}:{state['last']}: malformed {kind} ({exc})") from None
        yield state["start"], row
        state["start"] = state["last"] + 1


def read_table(path) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """Header and (line number, fields) rows of a delimited file (optionally .gz/.zst): tabs, read
    literally, or commas for .csv. Bad bytes and unclosed quotes are named by file and line."""
    path = str(path)
    with Lines(decompressed(open_file(path), split_compression(path)[0]), path, lone_cr=None) as lines:
        rows = table_rows(lines, _delimiter(path), path)
        header = next(rows, None)
        if header is None:
            raise AttnkitError(f"{path} is empty")
        check_header(header[1], path)
        return header[1], list(rows)


def check_header(header: list[str], name: str) -> None:
    """Refuse a table header that holds a bare carriage return: its lines end with a lone CR (old Mac line
    ends), which tables do not take as line ends (a lone CR inside a field is field content)."""
    if any("\r" in h for h in header):
        raise AttnkitError(f"{name}:1: the header holds a carriage return: are its lines ended by a lone CR (old "
                           "Mac line ends)? Convert them to \\n")


class TableSource(Source):
    """TSV/CSV with a header row; the text column(s) named by `columns` or guessed (GLUE files work)."""

    format = "tsv"
    lone_cr = None  # the file's first line end decides: a lone "\r" inside a field is content, not a line end

    @property
    def delimiter(self) -> str:
        return "\t" if self.path == "-" else _delimiter(self.path)

    def _make_plan(self):
        lines = self._lines()
        try:
            ahead = lines.peek(max_lines=CSV_MAX_ROW_LINES)
        finally:
            self._close_lines(lines)
        if not ahead:
            raise AttnkitError(f"{self.name} is empty")
        header = next(table_rows(iter(ahead), self.delimiter, self.name))[1]
        check_header(header, self.name)
        first, second = self._choose(header)
        return {"columns": [c for c in (first, second) if c], "header": header}

    def _read(self, plan):
        header = plan["header"]
        idx = [header.index(c) for c in plan["columns"]]
        need = max(idx)
        with self._lines() as lines:
            rows = table_rows(lines, self.delimiter, self.name)
            next(rows, None)
            for rowno, row in rows:
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) <= need:
                    raise AttnkitError(f"{self.name}:{rowno}: row has {len(row)} fields, expected at least {need + 1}")
                yield row[idx[0]] if len(idx) == 1 else \
                    check_pair(row[idx[0]], row[idx[1]], plan["columns"], f"{self.name}:{rowno}", self.pairs)

    def settings(self):
        return {**super().settings(), "delimiter": self.delimiter}

    def _kind(self):
        return "csv" if self.delimiter == "," else "tsv"

    def _how(self):
        return _describe_columns("column", *(self.plan()["columns"] + [None])[:2])


def _plan_columns(fields: list, columns, name: str, is_text, pairs: bool = False) -> dict:
    """Choose text columns among the (name, type) `fields` (with `pairs`, an encoder–decoder's source and target
    columns); the chosen ones must hold text."""
    names_types = dict(fields)
    listing = [f"{_names([n])} ({t})" for n, t in fields]
    try:
        if pairs:
            first, second = choose_pair_columns([n for n, _ in fields], columns, name)
        else:
            first, second = choose_columns([n for n, _ in fields], columns, name)
    except NoTextColumn:
        if pairs:
            raise
        raise AttnkitError(f"{name}: no usable text column; name one with {arg('columns')} "
                           f"(columns are: {', '.join(listing) or 'none'})") from None
    for c in (first, second):
        if c is not None and not is_text(names_types[c]):
            raise AttnkitError(f"{name}: column {c!r} holds {names_types[c]}, not text")
    return {"columns": [c for c in (first, second) if c]}


def columns_to_segments(values: list[list], cols: list[str], name: str, first_row: int, pairs: bool = False):
    """Segments of a batch of column values (one list per chosen column; rows from `first_row`, 0-based). A
    null text is an empty text (a blank segment, skipped), but a null in a pair is refused: a pair with a
    missing side is not the pair the data meant, and measuring it as (text, "") would be a silent answer.
    `pairs`: an encoder–decoder's (source, target) columns (check_pair)."""
    if len(cols) == 1:
        yield from ("" if v is None else v for v in values[0])
        return
    for i, (a, b) in enumerate(zip(*values)):
        if a is None or b is None:
            col = cols[0] if a is None else cols[1]
            hint = "" if pairs else f" (or name one text column with {arg('columns')})"
            raise AttnkitError(f"{name}: row {first_row + i + 1}: the pair column {col!r} is null; drop or fill such "
                               f"rows{hint}")
        yield check_pair(a, b, cols, f"{name}: row {first_row + i + 1}", pairs)


class ParquetSource(Source):
    """Parquet, read a batch of rows at a time (pyarrow), only the text column(s)."""

    format = "parquet"
    batch_size = 1024

    def _file(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        open_file(self.path).close()  # the usual one-line errors for a missing or unreadable file
        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as exc:
            raise AttnkitError(f"{self.path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None

    def _make_plan(self):
        import pyarrow as pa

        schema = self._file().schema_arrow
        fields = [(f.name, f.type) for f in schema]

        def is_text(t):
            if pa.types.is_dictionary(t):
                t = t.value_type
            return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view",
                                                                                     lambda _: False)(t)

        return _plan_columns(fields, self.columns, self.path, is_text, self.pairs)

    def _read(self, plan):
        import pyarrow as pa

        pf = self._file()
        cols = plan["columns"]
        try:
            row = 0
            for batch in pf.iter_batches(batch_size=self.batch_size, columns=cols):
                yield from columns_to_segments([batch.column(c).to_pylist() for c in cols], cols, self.path, row,
                                               self.pairs)
                row += batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise AttnkitError(f"{self.path}: cannot read Parquet data ({str(exc).splitlines()[0]})") from None
        finally:
            pf.close()

    def _how(self):
        return _describe_columns("column", *(self.plan()["columns"] + [None])[:2])


def is_datasets_dir(path) -> bool:
    """A directory written by `datasets` save_to_disk: a Dataset (state.json and dataset_info.json), or a
    DatasetDict of splits (dataset_dict.json)."""
    p = Path(path)
    return p.is_dir() and ((p / "dataset_dict.json").is_file()
                           or all((p / f).is_file() for f in ("state.json", "dataset_info.json")))


class DatasetSource(Source):
    """A Hugging Face `datasets` directory (save_to_disk): memory-mapped Arrow, read in batches."""

    format = "datasets"
    batch_size = 1000

    def _dataset(self):
        import datasets

        p = Path(self.path)
        if not p.is_dir():
            raise AttnkitError(f"{self.path}: not a directory saved by datasets' save_to_disk")
        if (p / "dataset_dict.json").is_file():
            splits = sorted(d.name for d in p.iterdir() if is_datasets_dir(d))
            raise AttnkitError(f"{self.path} holds the splits {', '.join(splits)} of a DatasetDict: "
                               f"give one of them (e.g. {p / (splits[0] if splits else 'train')})")
        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid, ...
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise AttnkitError(f"{self.path}: cannot load the datasets directory ({msg})") from None
        return ds

    def _make_plan(self):
        import datasets

        features = self._dataset().features

        def is_text(feature):
            return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "string_view")

        return _plan_columns(list(features.items()), self.columns, self.path, is_text, self.pairs)

    def _read(self, plan):
        import pyarrow as pa

        cols = plan["columns"]
        ds = self._dataset().select_columns(cols)
        try:
            row = 0
            for batch in ds.iter(batch_size=self.batch_size):
                yield from columns_to_segments([batch[c] for c in cols], cols, self.path, row, self.pairs)
                row += len(batch[cols[0]])
        except (pa.ArrowException, OSError) as exc:
            raise AttnkitError(f"{self.path}: cannot read the datasets directory ({str(exc).splitlines()[0]})") \
                from None

    def _data_files(self) -> list[Path]:
        p = Path(self.path)
        try:
            state = json.loads((p / "state.json").read_text())
            files = [p / f["filename"] for f in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError):
            files = sorted(p.glob("*.arrow"))
        if not files:
            raise AttnkitError(f"{self.path}: a datasets directory without data files")
        return files

    def sha256(self):
        return hash_files(self._data_files())

    def _kind(self):
        return "datasets (save_to_disk)"

    def _how(self):
        return _describe_columns("column", *(self.plan()["columns"] + [None])[:2])


SOURCES = {cls.format: cls for cls in (TextSource, JsonlSource, SquadSource, TableSource, ParquetSource, DatasetSource)}
