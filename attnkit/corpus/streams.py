"""Byte streams of corpus files: decompression by extension, universal-newline lines decoded as UTF-8
(naming the file and line of a bad byte), a bounded look-ahead, and content hashes. Nothing here holds
more than one chunk or one line of a file in memory."""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import stat
from collections import deque
from pathlib import Path

from ..errors import AttnkitError

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
CHUNK = 1 << 16
# look-ahead used to decide things from the start of a stream (text unit, header, first JSON object)
PEEK_LINES = 10_000
PEEK_CHARS = 1 << 20
_NEWLINE = re.compile(rb"\r\n|\r|\n")
_LINE_FEED = re.compile(rb"\r?\n")  # line ends of delimited tables: a lone "\r" there is field content


def split_compression(path: str) -> tuple[str | None, str]:
    """(compression or None, the file name without the compression suffix) from a path's extension."""
    name = Path(path).name
    suffix = Path(name).suffix.lower()
    if suffix in COMPRESSIONS:
        return COMPRESSIONS[suffix], name[: -len(suffix)]
    return None, name


def open_file(path: str):
    """The raw bytes of a file, with a one-line error for the usual OS failures."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise AttnkitError(f"corpus file {path!r} does not exist") from None
    except IsADirectoryError:
        raise AttnkitError(f"corpus path {path!r} is a directory, not a file") from None
    except OSError as exc:
        raise AttnkitError(f"cannot read corpus file {path!r}: {exc.strerror or exc}") from None


def decompressed(raw, compression: str | None):
    """A binary stream of the decompressed bytes of `raw` (which it owns and closes)."""
    if compression is None:
        return raw
    if compression == "gzip":
        return _Owning(gzip.GzipFile(fileobj=raw, mode="rb"), raw)
    if compression == "zstd":
        return _Zstd(raw)
    raise AttnkitError(f"unknown compression {compression!r}")


_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}


def sniffed(stream) -> tuple[str | None, object]:
    """(compression told by the first bytes, a stream that still yields those bytes) for a stream that has
    no file name (standard input)."""
    head = b""
    while len(head) < 4:
        more = stream.read(4 - len(head))
        if not more:
            break
        head += more
    compression = next((c for magic, c in _MAGIC.items() if head.startswith(magic)), None)
    return compression, _Prefixed(head, stream)


class _Prefixed:
    """`head` and then the rest of `stream`."""

    def __init__(self, head: bytes, stream):
        self._head, self._stream = head, stream

    def read(self, n=-1):
        if not self._head:
            return self._stream.read(n)
        if n is None or n < 0:
            data, self._head = self._head + self._stream.read(), b""
            return data
        data, self._head = self._head[:n], self._head[n:]
        return data

    def close(self):
        self._stream.close()


class _Closing:
    """`with stream:` for the streams of this module."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Owning(_Closing):
    """A stream that also closes the stream under it (GzipFile leaves its fileobj open). GzipFile raises
    EOFError when the data ends before the end-of-stream marker (a truncated file)."""

    def __init__(self, stream, under):
        self._stream, self._under = stream, under

    def read(self, n=-1):
        return self._stream.read(n)

    def close(self):
        try:
            self._stream.close()
        finally:
            self._under.close()


class _Zstd(_Closing):
    """The decompressed bytes of the zstd frames in `raw` (which it owns and closes). Unlike zstandard's
    stream_reader, which stops quietly where a cut file stops, the data must end where a frame ends: a file cut
    inside a frame raises EOFError when its end is reached."""

    IN_CHUNK = 1 << 14  # compressed bytes decompressed at a time (bounds the output held at once)

    def __init__(self, raw):
        import zstandard

        self._raw = raw
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = None  # the frame being decompressed (None between frames)
        self._out = bytearray()
        self._done = False

    def _feed(self, data: bytes) -> None:
        while data:
            if self._frame is None:
                self._frame = self._decompressor.decompressobj()
            self._out += self._frame.decompress(data)
            if not self._frame.eof:
                return
            data, self._frame = self._frame.unused_data, None  # the next frame may start right after

    def read(self, n=-1):
        while not self._done and (n is None or n < 0 or len(self._out) < n):
            data = self._raw.read(self.IN_CHUNK)
            if not data:
                self._done = True
                if self._frame is not None:
                    raise EOFError("the zstd data ends inside a frame: the file is truncated")
                break
            self._feed(data)
        k = len(self._out) if n is None or n < 0 else min(n, len(self._out))
        chunk = bytes(self._out[:k])
        del self._out[:k]
        return chunk

    def close(self):
        self._raw.close()


def read_chunk(stream, name: str, size: int = CHUNK) -> bytes:
    """One chunk of a (possibly compressed) stream; corrupt or truncated compressed data is named."""
    import zstandard

    try:
        return stream.read(size)
    except (OSError, EOFError, zstandard.ZstdError) as exc:  # gzip.BadGzipFile is an OSError
        raise AttnkitError(f"{name}: cannot decompress ({exc})") from None


def first_line_end(data: bytes) -> bool | None:
    """Whether the first line end in `data` is a lone "\\r" (True), "\\n" or "\\r\\n" (False), or None when
    `data` does not tell yet (no line end, or a "\\r" as its last byte)."""
    m = re.search(rb"[\r\n]", data)
    if m is None:
        return None
    i = m.start()
    if data[i:i + 1] == b"\n":
        return False
    return None if i + 1 == len(data) else data[i + 1:i + 2] != b"\n"


def raw_lines(stream, name: str, chunk_size: int = CHUNK, lone_cr: bool | None = True):
    """Lines of a binary stream without their ends; "\\n", "\\r\\n" and a lone "\\r" (old Mac files) each
    end a line. With `lone_cr` False only "\\n" and "\\r\\n" do (a lone "\\r" stays in the line); with None
    the stream's first line end decides (a file whose lines end with a lone "\\r" splits there, any other
    keeps a lone "\\r" inside its lines: delimited tables, whose fields may hold one). Reads fixed-size chunks,
    so a file is never held whole (a line is)."""
    pieces: list[bytes] = []  # the unfinished line, in chunks (joined once, so long lines stay linear)
    while True:
        chunk = read_chunk(stream, name, chunk_size)
        if not chunk:
            break
        if lone_cr is None:
            # undecided so far: the line read holds no line end but perhaps a "\r" as its last byte
            lone_cr = first_line_end(pieces[-1][-1:] + chunk if pieces else chunk)
            if lone_cr is None:
                pieces.append(chunk)
                continue
        if b"\n" not in chunk and (b"\r" not in chunk or not lone_cr):
            pieces.append(chunk)
            continue
        data = b"".join(pieces) + chunk if pieces else chunk
        held = lone_cr and data.endswith(b"\r")  # may be the first half of "\r\n": decide with the next chunk
        if held:
            data = data[:-1]
        parts = (_NEWLINE if lone_cr else _LINE_FEED).split(data)
        last = parts.pop()
        yield from parts
        pieces = [last, b"\r"] if held else [last]
    rest = b"".join(pieces)
    if rest:
        parts = (_NEWLINE if lone_cr or lone_cr is None else _LINE_FEED).split(rest)
        if not parts[-1]:
            parts.pop()
        yield from parts


def decoded_lines(stream, name: str, lone_cr: bool | None = True):
    """(line number, text) of a binary stream, UTF-8 decoded; a bad byte is named by file, line and column.
    A byte-order mark at the start is dropped. `lone_cr`: whether a lone "\\r" ends a line (raw_lines)."""
    for lineno, raw in enumerate(raw_lines(stream, name, lone_cr=lone_cr), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AttnkitError(
                f"{name}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            ) from None
        if lineno == 1:
            line = line.lstrip("\ufeff")
        yield lineno, line


class Lines:
    """(line number, text) pairs of a stream with a bounded look-ahead (`peek`) that iteration replays."""

    def __init__(self, stream, name: str, lone_cr: bool | None = True):
        self.name = name
        self._stream = stream
        self._it = decoded_lines(stream, name, lone_cr=lone_cr)
        self._ahead: deque = deque()

    def peek(self, max_lines: int = PEEK_LINES, max_chars: int = PEEK_CHARS) -> list:
        """Up to `max_lines` lines / about `max_chars` characters from the current position, not consumed."""
        chars = sum(len(l) for _, l in self._ahead)
        while len(self._ahead) < max_lines and chars < max_chars:
            item = next(self._it, None)
            if item is None:
                break
            self._ahead.append(item)
            chars += len(item[1])
        return list(self._ahead)[:max_lines]

    def first(self, predicate, max_lines: int = PEEK_LINES):
        """The first (line number, text) within `max_lines` whose text satisfies `predicate`, not consumed."""
        i = 0
        while i < max_lines:
            if i == len(self._ahead):
                item = next(self._it, None)
                if item is None:
                    return None
                self._ahead.append(item)
            if predicate(self._ahead[i][1]):
                return self._ahead[i]
            i += 1
        return None

    def __iter__(self):
        while True:
            while self._ahead:
                yield self._ahead.popleft()
            item = next(self._it, None)
            if item is None:
                return
            yield item

    def close(self):
        self._stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class HashingReader:
    """A binary stream that hashes what is read through it: the content hash of an input read once, as a
    stream (standard input, a pipe), known when it has been read to its end (`at_end`). It closes the stream
    under it only when it `owns` it (standard input is not ours to close)."""

    def __init__(self, stream, owns: bool = False):
        self._stream = stream
        self._owns = owns
        self.sha256 = hashlib.sha256()
        self.at_end = False

    def read(self, n=-1):
        data = self._stream.read(n)
        if data:
            self.sha256.update(data)
        elif n != 0:
            self.at_end = True
        return data

    def close(self):
        if self._owns:
            self._stream.close()


def is_stream_path(path: str) -> bool:
    """A path that names no regular file (a pipe, a FIFO, `<(...)` process substitution, a character device):
    its bytes can be read once only, as a stream."""
    if not path:
        return False
    try:
        mode = os.stat(path).st_mode
        return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)
    except (OSError, TypeError, ValueError):
        return False


def hash_file(path: str) -> str:
    """sha256 of a file's raw bytes (what `sha256sum` prints), streamed."""
    h = hashlib.sha256()
    with open_file(path) as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def hash_files(paths) -> str:
    """One sha256 over several files: each file's name and own sha256, in order."""
    h = hashlib.sha256()
    for path in paths:
        h.update(f"{Path(path).name}\0{hash_file(str(path))}\n".encode())
    return h.hexdigest()
