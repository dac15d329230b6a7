"""Many corpus inputs as one stream: resolving paths, directories, globs and "-" into sources (up front,
reading nothing), then streaming their segments in order."""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import io
import json
import os
import sys
from pathlib import Path

from ..errors import AttnkitError, arg, check_int
from ..run.rundir import is_run_dir
from .sources import SOURCES, DatasetSource, Source, is_datasets_dir
from .streams import is_stream_path, split_compression

FORMATS = ("auto", "text", "jsonl", "squad", "tsv", "parquet", "datasets")
TEXT_UNITS = ("auto", "line", "paragraph", "file")
# extensions a directory is searched for (each also with .gz, .zst or .zstd after it)
EXTENSIONS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".json": "squad", ".tsv": "tsv", ".csv": "tsv",
              ".parquet": "parquet"}
_GLOB_CHARS = set("*?[")
# bump when a reader changes what it yields for the same bytes and settings
_READER_VERSION = 1


def default_corpus_path() -> Path:
    """The small English corpus shipped with attnkit (used when no corpus is given)."""
    return Path(__file__).parent.parent / "data" / "default_corpus.txt"


def _format_of(path: str) -> tuple[str | None, str | None]:
    """(format or None when the extension is unknown, compression) from a file name."""
    compression, inner = split_compression(path)
    return EXTENSIONS.get(Path(inner).suffix.lower()), compression


def _sort_key(path: str):
    return Path(path).parts


def _directory_files(root: str) -> list[str]:
    """Corpus files under `root`, recursively, sorted by path; a datasets directory counts as one input.
    Hidden files and folders (".name") are skipped, and so are attnkit run directories below `root`."""
    found = []

    def stop(exc: OSError):  # a folder that cannot be listed: its files would be left out without a word
        raise unreadable(exc.filename or root, exc)

    for dirpath, dirnames, filenames in os.walk(root, onerror=stop):
        if dirpath != root and is_datasets_dir(dirpath):
            found.append(os.path.normpath(dirpath))
            dirnames[:] = []
            continue
        if dirpath != root and is_run_dir(dirpath):
            dirnames[:] = []  # attnkit's own output (meta.json, clusters.json, tables) is not corpus text
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(os.path.normpath(os.path.join(dirpath, f)) for f in filenames
                     if not f.startswith(".") and _format_of(f)[0] is not None)
    return sorted(found, key=_sort_key)


def _check_datasets_dir(path: str):
    if (Path(path) / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in Path(path).iterdir() if is_datasets_dir(d))
        raise AttnkitError(f"{path} holds the splits {', '.join(splits) or '(none)'} of a datasets DatasetDict: "
                           f"give one of them (e.g. {os.path.join(path, splits[0] if splits else 'train')})")


def resolve_paths(paths) -> list[tuple[str, str]]:
    """(kind, path) for every input, kind "file", "dir-file" (found in a directory), "datasets" or "stdin"."""
    out = []
    for given in paths:
        p = str(given)
        if p == "-":
            out.append(("stdin", "-"))
        elif os.path.isdir(p):
            if is_datasets_dir(p):
                _check_datasets_dir(p)
                out.append(("datasets", p))
                continue
            files = _directory_files(p)
            if not files:
                raise AttnkitError(f"corpus directory {p!r} holds no corpus files "
                                   f"({', '.join(EXTENSIONS)}, optionally .gz/.zst, or a datasets directory)")
            for f in files:
                if os.path.isdir(f):
                    _check_datasets_dir(f)
                out.append(("datasets" if os.path.isdir(f) else "dir-file", f))
        elif os.path.exists(p):
            out.append(("file", p))
        elif _GLOB_CHARS & set(p):
            out.extend(_glob_inputs(p))
        else:
            raise AttnkitError(f"corpus file {p!r} does not exist")
    seen = {}
    for kind, p in out:
        key = "-" if kind == "stdin" else os.path.realpath(p)
        if key in seen:
            what = "standard input ('-')" if kind == "stdin" else f"corpus file {p!r}"
            raise AttnkitError(f"{what} is given twice" + ("" if kind == "stdin" else
                                                           f" (also as {seen[key]!r}); each input is read once"))
        seen[key] = p
    return out


def unreadable(path: str, exc: OSError) -> AttnkitError:
    """The error for a folder of the corpus that cannot be listed: a corpus read without some of its files
    would be measured silently short."""
    return AttnkitError(f"cannot read corpus folder {path!r}: {exc.strerror or exc} (make it readable, or give "
                        "the inputs without it)")


def expand_glob(pattern: str) -> list[str]:
    """The paths a shell pattern matches, as glob.glob(pattern, recursive=True) finds them (hidden names only
    by a pattern that starts with "."), except that `**` does not descend into symbolic links to folders, as a
    folder given by name is not searched through them: a link loop ("data/**" with data/x -> ..) cannot make
    the search endless. A folder on the way that cannot be listed is an error naming it."""
    if "**" not in pattern:
        return glob.glob(pattern)
    parts = pattern.split(os.sep)
    base = ""
    if parts[0] == "":  # absolute
        base, parts = os.sep, parts[1:]
    while parts and not glob.has_magic(parts[0]) and len(parts) > 1:
        base, parts = os.path.join(base, parts[0]) if base else parts[0], parts[1:]
    walk = _GlobWalk(base)
    walk.walk(base, parts)
    return list(walk.found)


class _GlobWalk:
    """The search of `expand_glob` below the pattern's fixed `base`; `found` the matches in order (a dict: once
    each)."""

    def __init__(self, base: str):
        self.base = base
        self.found: dict[str, None] = {}

    @staticmethod
    def entries(folder: str):
        try:
            with os.scandir(folder or os.curdir) as it:
                return sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise unreadable(folder or os.curdir, exc) from None

    @staticmethod
    def join(folder: str, name: str) -> str:
        return os.path.join(folder, name) if folder else name

    def walk(self, folder: str, rest: list[str]) -> None:
        if not rest:
            self.found[folder] = None
        elif rest[0] == "**":
            self.any_depth(folder, rest)
        elif not glob.has_magic(rest[0]):
            self.named(folder, rest[0], rest[1:])
        else:
            self.matching(folder, rest[0], rest[1:])

    def any_depth(self, folder: str, rest: list[str]) -> None:
        tail = rest[1:]
        if tail:
            self.walk(folder, tail)
        else:  # "x/**" matches x/ itself, then everything below it
            self.found[self.join(folder, "") if folder == self.base else folder] = None
        for e in self.entries(folder):
            if e.name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=False):
                self.walk(e.path if folder else e.name, rest)
            elif not tail:
                self.found[self.join(folder, e.name)] = None

    def named(self, folder: str, head: str, tail: list[str]) -> None:
        path = self.join(folder, head)
        if tail:
            if os.path.isdir(path):
                self.walk(path, tail)
        elif os.path.lexists(path):
            self.found[path] = None

    def matching(self, folder: str, head: str, tail: list[str]) -> None:
        for e in self.entries(folder):
            if e.name.startswith(".") and not head.startswith("."):
                continue
            if fnmatch.fnmatchcase(e.name, head):
                path = self.join(folder, e.name)
                if not tail:
                    self.found[path] = None
                elif e.is_dir():
                    self.walk(path, tail)


def _glob_inputs(pattern: str) -> list[tuple[str, str]]:
    """Inputs matched by a shell pattern, sorted: files as if named, directories searched; a file reached
    twice by one pattern ("data/**") is read once, and a matched directory without corpus files is skipped."""
    items, seen, datasets_dirs = [], set(), []
    for match in sorted(expand_glob(pattern), key=_sort_key):
        if os.path.isdir(match) and not is_datasets_dir(match):
            found = [("datasets" if os.path.isdir(f) else "dir-file", f) for f in _directory_files(match)]
        else:
            found = resolve_paths([match])
        for kind, p in found:
            key = os.path.realpath(p)
            if key in seen or any(key.startswith(d + os.sep) for d in datasets_dirs):
                continue  # already matched, or a file inside a datasets directory matched as a whole
            if kind == "datasets":
                _check_datasets_dir(p)
                datasets_dirs.append(key)
            seen.add(key)
            items.append((kind, p))
    if not items:
        raise AttnkitError(f"corpus pattern {pattern!r} matches no file")
    return sorted(items, key=lambda item: _sort_key(item[1]))


def check_columns(columns) -> tuple | None:
    """The text column and the optional pair column, as a tuple: `columns` is None, one or two names, or
    "COL" / "COL,COL2". An empty name is refused (the one check of `columns`: the command line's
    --columns comes here too)."""
    if columns is None:
        return None
    if isinstance(columns, str):
        columns = [c.strip() for c in columns.split(",")]
    columns = tuple(columns)
    if not 1 <= len(columns) <= 2:
        raise AttnkitError(f"{arg('columns')} takes one or two column names (e.g. sentence1,sentence2), got "
                           f"{', '.join(map(str, columns)) or 'none'}")
    if not all(isinstance(c, str) and c.strip() for c in columns):
        raise AttnkitError(f"{arg('columns')} holds an empty column name: {', '.join(map(repr, columns))}")
    return columns


class Corpus:
    """Segments of several inputs, streamed source after source (see `open_corpus`).

    Iterating yields the non-blank segments of every source in order, at most `limit` in all, and raises
    AttnkitError at the end when there were none. Each pass reads the files again and gives the same
    segments; a corpus with standard input can be iterated once. A finished pass records on each source
    how many segments it gave (`describe()["n_segments"]`). Corpora of files pickle (for worker processes).
    """

    def __init__(self, sources: list[Source], limit: int | None = None):
        self.sources = sources
        self.limit = limit
        self._stream_read = False
        self._passed = False  # a pass over the segments was completed (or stopped at the limit)

    def __iter__(self):
        streams = [s for s in self.sources if s.is_stream]
        if streams:
            if self._stream_read:
                what = "standard input" if streams[0].path == "-" else f"{streams[0].name} (a pipe)"
                raise AttnkitError(f"{what} can be read only once: this corpus was already read")
            self._stream_read = True
        return self._segments()

    def _segments(self):
        counts = [0] * len(self.sources)
        total = 0
        for i, source in enumerate(self.sources):
            if self.limit is not None and total >= self.limit:
                break
            stream = source.segments()
            try:
                for seg in stream:
                    yield seg
                    counts[i] += 1
                    total += 1
                    if self.limit is not None and total >= self.limit:
                        break
            finally:
                stream.close()
        if total == 0:
            if len(self.sources) == 1:
                src = self.sources[0]
                raise AttnkitError(f"corpus {src.name!r} has no text ({src.format} format)")
            raise AttnkitError(f"the corpus has no text in any of its {len(self.sources)} inputs")
        for source, n in zip(self.sources, counts):
            source.n_segments = n
        self._passed = True

    def check_has_text(self) -> None:
        """Raise the AttnkitError of an empty pass now, reading up to the first segment, so a command refuses an
        empty corpus before it loads a model and starts its progress bar. A corpus with a stream is not read
        (a stream can be read once): an empty stream is named at the end of its pass."""
        if self.has_streams:
            return
        segments = self._segments()
        try:
            next(segments, None)
        finally:
            segments.close()

    def describe(self) -> list[dict]:
        """Per input: path, format, compression, text_unit, columns, squad_pairs, sha256, n_segments (the
        segments taken from it by the last complete pass, `limit` included; None before one)."""
        return [s.describe() for s in self.sources]

    @property
    def has_streams(self) -> bool:
        """Some input is read once, as a stream (standard input, a pipe): the corpus can be read once, and its
        fingerprint is known after that pass."""
        return any(s.is_stream for s in self.sources)

    def fingerprint(self) -> str:
        """sha256 over the inputs' content hashes (in order) and reading settings; file paths do not enter, so
        a moved corpus keeps its fingerprint. Files are hashed by streaming their bytes; a stream is hashed as
        the pass reads it, so its fingerprint is known after the pass (of the bytes the pass read, when a limit
        stopped it early: a stream cannot be read on to its end, it may have none)."""
        items = []
        for s in self.sources:
            digest = s.sha256()
            if digest is None and s.is_stream and self._passed:
                # a stream the pass stopped reading early (limit): what identifies it is the bytes it gave
                items.append({"sha256_of_bytes_read": s.bytes_read_sha256(), **s.settings()})
                continue
            if digest is None:
                raise AttnkitError(f"the content hash of {s.name} is known only after reading it (a stream is "
                                   "hashed while it is read)")
            items.append({"sha256": digest, **s.settings()})
        doc = {"reader": _READER_VERSION, "limit": self.limit, "sources": items}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()

    def summary(self, max_lines: int = 20) -> str:
        """One line per input saying how it is read (the first `max_lines`, then a count of the rest)."""
        lines = [s.summary_line() for s in self.sources[:max_lines]]
        rest = self.sources[max_lines:]
        if rest:
            formats = sorted({s.format for s in rest})
            lines.append(f"... and {len(rest)} more inputs ({', '.join(formats)})")
        return "\n".join(lines)

    def __repr__(self):
        return f"Corpus({len(self.sources)} inputs, limit={self.limit})"


def open_corpus(paths=None, fmt: str = "auto", *, text_unit: str = "auto", columns=None, squad_pairs: bool = False,
                limit: int | None = None, stdin=None, pairs: bool = False) -> Corpus:
    """A `Corpus` over `paths` (None or [] means the built-in corpus): files, directories (searched
    recursively for known extensions, sorted by path), shell globs (recursive "**", sorted), "-" for standard
    input (`stdin`, a binary stream; default sys.stdin.buffer; text unless `fmt` says otherwise) and
    `datasets` directories written by save_to_disk. `fmt` other than auto applies to every file. Everything
    is resolved and checked here; nothing is read until the corpus is iterated. `pairs`: an encoder–decoder's
    corpus (docs/seq2seq.md): every segment a (source, target) pair, from two columns (or fields), guessed
    `source`/`target` when `columns` names none; a format of single texts is refused by name."""
    if fmt not in FORMATS:
        raise AttnkitError(f"unknown corpus format {fmt!r} ({arg('fmt')}); use one of {', '.join(FORMATS)}")
    if text_unit not in TEXT_UNITS:
        raise AttnkitError(f"unknown text unit {text_unit!r}; use line, paragraph, file or auto")
    if limit is not None:
        check_int(limit, "limit")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths or []) or [default_corpus_path()]
    columns = check_columns(columns)
    options = dict(text_unit=text_unit, columns=columns, squad_pairs=squad_pairs, pairs=pairs)
    sources = []
    for kind, p in resolve_paths(paths):
        if kind == "stdin":
            stream_fmt = "text" if fmt == "auto" else fmt
            if stream_fmt in ("parquet", "datasets"):
                raise AttnkitError(f"{stream_fmt} cannot be read from standard input: give the path")
            stream = stdin if stdin is not None else sys.stdin
            if stream is None:  # Python leaves sys.stdin None when file descriptor 0 is closed (`<&-`)
                raise AttnkitError("'-' reads standard input, but standard input is closed: pipe the corpus in, or "
                                   "give its path")
            if isinstance(stream, io.TextIOBase) or hasattr(stream, "buffer"):
                stream = stream.buffer  # bytes under a text stream: attnkit decodes (and names bad bytes) itself
            sources.append(SOURCES[stream_fmt]("-", None, stdin=stream, **options))
            continue
        if kind == "datasets":
            if fmt not in ("auto", "datasets"):
                raise AttnkitError(f"{p!r} is a datasets directory, not {fmt}: drop {arg('fmt')} or use datasets")
            sources.append(DatasetSource(p, None, **options))
            continue
        detected, compression = _format_of(p)
        file_fmt = (detected or "text") if fmt == "auto" else fmt
        if file_fmt == "datasets":
            raise AttnkitError(f"{p!r} is a file, not a datasets directory (save_to_disk)")
        if file_fmt == "parquet" and compression:
            raise AttnkitError(f"{p!r}: Parquet cannot be read through {compression} (it compresses its own "
                               f"columns): decompress the file")
        stream = is_stream_path(p)
        if stream and file_fmt == "parquet":
            raise AttnkitError(f"{p!r} is a pipe, not a file: Parquet cannot be read as a stream (save it to a file)")
        sources.append(SOURCES[file_fmt](p, compression, stream=stream, **options))
    return Corpus(sources, limit)


def read_corpus(path, fmt: str = "auto", *, text_unit: str = "auto", squad_pairs: bool = False,
                columns=None, limit: int | None = None) -> list:
    """All segments of one input (a file, directory, glob or datasets directory) as a list."""
    return list(open_corpus([path], fmt, text_unit=text_unit, columns=columns, squad_pairs=squad_pairs,
                            limit=limit))


def corpus_of_run(run, meta: dict, corpus=None, fmt: str = "auto", *, squad_pairs: bool = False, columns=None,
                  limit: int | None = None, pairs: bool = False) -> Corpus:
    """The corpus a run measured, to read it again (JS distances, example maps): `corpus` when given, else the
    inputs recorded in the run's `meta` (meta.json), read as the run read them and checked to be the same
    bytes (their SHA-256). `pairs`: read (source, target) pairs, as an encoder–decoder's run did (`open_corpus`)."""
    text_unit = "auto"
    given = corpus
    if corpus is None:
        reading = (meta.get("settings") or {}).get("reading")
        if isinstance(reading, dict) and reading.get("images"):
            raise AttnkitError(f"{run} measured images (attnkit extract --images): they are no text to read again")
        if isinstance(reading, dict) and reading.get("paths"):
            paths = reading["paths"]
            fmt, text_unit = reading.get("format") or "auto", reading.get("text_unit") or "auto"
            columns, squad_pairs = columns or reading.get("columns"), bool(reading.get("squad_pairs"))
        else:  # runs written before several inputs were possible
            paths = [meta.get("corpus")]
            fmt = meta.get("format", fmt) or fmt
            squad_pairs = bool(meta.get("squad_pairs", squad_pairs))
            columns = columns or meta.get("columns")
            text_unit = meta.get("text_unit", "auto")
        missing = [p for p in paths if not p or p == "-" or not Path(p).exists() or is_stream_path(p)]
        if missing:
            why = " (it was read as a stream)" if missing[0] == "-" or is_stream_path(missing[0]) else ""
            raise AttnkitError(f"{run}/meta.json names no readable corpus ({missing[0]!r}{why}): pass "
                               f"{arg('corpus')} PATH")
        corpus = paths
        limit = limit or meta.get("n_segments")
    texts = open_corpus(corpus, fmt, text_unit=text_unit, squad_pairs=squad_pairs, columns=columns, limit=limit,
                        pairs=pairs)
    if given is None:
        _check_same_inputs(run, meta, texts)
    return texts


def _check_same_inputs(run, meta: dict, texts: Corpus) -> None:
    """The run's inputs, read again, must be the bytes it measured (meta.json keeps their SHA-256): numbers
    from an edited corpus would be saved into the run as if they belonged to it."""
    recorded = meta.get("inputs")
    if not isinstance(recorded, list) or len(recorded) != len(texts.sources):
        return  # runs written before inputs were recorded: nothing to compare with
    for source, rec in zip(texts.sources, recorded):
        want = rec.get("sha256") if isinstance(rec, dict) else None
        if want and source.sha256() != want:
            raise AttnkitError(f"{source.name} changed since {run} was measured (its SHA-256 differs from "
                               f"meta.json's): extract again, or pass the corpus with {arg('corpus')}")
