"""Many corpus inputs (files, directories, globs, stdin, compressed, Parquet, datasets) as one stream:
open_corpus / Corpus, on tiny files written by the tests."""
import datetime
import hashlib
import io
import itertools
import json
import os
import shutil

import numpy as np
import pytest

from attnkit.corpus import open_corpus, read_corpus
from attnkit.errors import AttnkitError


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


@pytest.fixture()
def tree(tmp_path):
    """A corpus directory of several formats, with files a directory search must skip."""
    root = tmp_path / "corpus"
    write(root / "b.txt", "bee one\nbee two\n")
    write(root / "a.jsonl", json.dumps({"text": "ay"}) + "\n" + json.dumps({"text": "q", "text_pair": "c"}) + "\n")
    write(root / "sub" / "dev.tsv", "idx\tsentence1\tsentence2\n0\tleft\tright\n")
    write(root / "sub" / "deeper" / "z.txt", "zed\n")
    write(root / "notes.md", "not a corpus file\n")
    write(root / ".hidden.txt", "hidden\n")
    write(root / ".git" / "x.txt", "hidden too\n")
    return root


def test_directory_is_searched_recursively_in_path_order(tree):
    corpus = open_corpus([tree])
    assert [os.path.relpath(s.path, tree) for s in corpus.sources] == [
        "a.jsonl", "b.txt", os.path.join("sub", "deeper", "z.txt"), os.path.join("sub", "dev.tsv")]
    assert list(corpus) == ["ay", ("q", "c"), "bee one", "bee two", "zed", ("left", "right")]
    assert list(corpus) == list(open_corpus([str(tree)]))  # iterating again (and str paths) gives the same


def test_globs_and_explicit_files_keep_the_given_order(tree):
    corpus = open_corpus([str(tree / "**" / "*.txt")])
    assert [os.path.basename(s.path) for s in corpus.sources] == ["b.txt", "z.txt"]  # sorted, recursive, no hidden
    corpus = open_corpus([tree / "sub" / "dev.tsv", tree / "b.txt"])
    assert list(corpus) == [("left", "right"), "bee one", "bee two"]
    # an explicit file of unknown extension is read as text
    assert read_corpus(tree / "notes.md") == ["not a corpus file"]


def test_limit_counts_over_all_sources(tree):
    corpus = open_corpus([tree / "b.txt", tree / "a.jsonl", tree / "sub" / "dev.tsv"], limit=3)
    assert [d["n_segments"] for d in corpus.describe()] == [None, None, None]
    assert list(corpus) == ["bee one", "bee two", "ay"]
    assert [d["n_segments"] for d in corpus.describe()] == [2, 1, 0]
    assert len(list(open_corpus([tree], limit=100))) == 6


def test_describe_says_how_each_input_was_read(tree):
    corpus = open_corpus([tree / "b.txt", tree / "sub" / "dev.tsv", tree / "a.jsonl"])
    list(corpus)
    txt, tsv, jsonl = corpus.describe()
    st = (tree / "b.txt").stat()
    mtime = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert txt == {"path": str(tree / "b.txt"), "format": "text", "compression": None, "text_unit": "line",
                   "columns": None, "squad_pairs": None,
                   "sha256": hashlib.sha256((tree / "b.txt").read_bytes()).hexdigest(), "n_segments": 2,
                   "size": st.st_size, "mtime": mtime}
    assert tsv["format"] == "tsv" and tsv["columns"] == ["sentence1", "sentence2"] and tsv["n_segments"] == 1
    assert jsonl["columns"] == ["text", "text_pair"] and jsonl["n_segments"] == 2
    summary = corpus.summary().splitlines()
    assert summary[0].startswith(f"{tree / 'b.txt'}: text, one segment per line (auto")
    assert summary[1] == f"{tree / 'sub' / 'dev.tsv'}: tsv, pairs from columns sentence1 + sentence2"
    assert summary[2] == f"{tree / 'a.jsonl'}: jsonl, texts from field text (pairs with text_pair where present)"


def test_summary_of_many_inputs_is_bounded(tmp_path):
    for i in range(30):
        write(tmp_path / f"f{i:02d}.txt", f"line {i}\n")
    lines = open_corpus([tmp_path]).summary(max_lines=5).splitlines()
    assert len(lines) == 6 and lines[-1] == "... and 25 more inputs (text)"


def test_fingerprint_follows_content_and_settings_not_location(tree, tmp_path):
    paths = [tree / "b.txt", tree / "sub" / "dev.tsv"]
    fp = open_corpus(paths).fingerprint()
    assert open_corpus(paths).fingerprint() == fp
    moved = tmp_path / "moved"
    shutil.copytree(tree, moved)
    assert open_corpus([moved / "b.txt", moved / "sub" / "dev.tsv"]).fingerprint() == fp
    assert open_corpus(paths[::-1]).fingerprint() != fp  # order is part of the corpus
    assert open_corpus(paths, text_unit="paragraph").fingerprint() != fp
    assert open_corpus(paths, text_unit="line").fingerprint() == fp  # what auto resolved to
    assert open_corpus(paths, columns=("sentence2",)).fingerprint() != fp
    assert open_corpus(paths, limit=2).fingerprint() != fp
    corpus = open_corpus(paths)
    assert corpus.fingerprint() == fp
    write(tree / "b.txt", "bee one\nbee twO\n")
    assert corpus.fingerprint() != fp  # the same Corpus notices the change


def test_a_same_size_rewrite_within_one_clock_tick_is_noticed(tmp_path, monkeypatch):
    """A filesystem with a coarse clock gives a rewrite of the same size the same modification time (and the
    inode stays): the stat key cannot tell, so a recently modified file is hashed again."""
    import attnkit.corpus.sources as sources

    path = tmp_path / "c.txt"
    write(path, "one\n")
    st = path.stat()
    corpus = open_corpus([path])
    fp = corpus.fingerprint()
    write(path, "two\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same tick
    assert path.stat().st_ino == st.st_ino and corpus.fingerprint() != fp
    old = st.st_mtime_ns - 3600 * 10**9  # a file untouched for an hour is hashed once, then trusted
    os.utime(path, ns=(old, old))
    calls = []
    real = sources.hash_file
    monkeypatch.setattr(sources, "hash_file", lambda p: calls.append(p) or real(p))
    first = corpus.fingerprint()
    assert corpus.fingerprint() == first and len(calls) == 1


def test_text_unit_auto_decides_from_a_bounded_look_ahead(tmp_path):
    late_gap = write(tmp_path / "late.txt", "".join(f"line {i}\n" for i in range(10_050)) + "\nlast\n")
    corpus = open_corpus([late_gap])
    assert corpus.describe()[0]["text_unit"] == "line"  # the blank line is past the first 10,000 lines
    assert len(list(corpus)) == 10_051
    early_gap = write(tmp_path / "early.txt", "a\nb\n\nc\n" + "".join(f"line {i}\n" for i in range(10_050)))
    assert open_corpus([early_gap]).describe()[0]["text_unit"] == "paragraph"


def test_jsonl_fields_named_or_guessed(tmp_path):
    p = write(tmp_path / "qa.jsonl", '{"question": "Q1", "sentence": "S1", "label": 0}\n\n'
                                     '{"question": "Q2", "sentence": "S2", "label": 1}\n')
    assert read_corpus(p) == [("Q1", "S1"), ("Q2", "S2")]
    assert read_corpus(p, columns=("sentence",)) == ["S1", "S2"]
    assert read_corpus(p, columns="sentence,question") == [("S1", "Q1"), ("S2", "Q2")]
    with pytest.raises(AttnkitError, match=r'qa.jsonl:1: each line needs a string field "nope"'):
        read_corpus(p, columns=("nope",))
    with pytest.raises(AttnkitError, match=r'qa.jsonl:1: "label" must be a string'):
        read_corpus(p, columns=("question", "label"))
    write(p, '{"a": "x"}\n')
    with pytest.raises(AttnkitError, match=r"qa.jsonl:1: cannot tell which field holds the text; name it with "
                                           r"columns \(fields are: a\)"):
        read_corpus(p)
    write(p, '["not", "an object"]\n')
    with pytest.raises(AttnkitError, match=r"qa.jsonl:1: each line must be a JSON object, got list"):
        read_corpus(p)


SQUAD_OK = {"data": [{"title": "T", "paragraphs": [{"context": "C.", "qas": [{"question": "Q?", "id": "1"}]}]}]}


@pytest.mark.parametrize("doc, where", [
    ({"data": "abc"}, r'field data: expected an array, got a string \("abc"\)'),
    ([SQUAD_OK], r"expected an object, got an array \(.*\)"),
    ({"version": "1.1"}, "missing 'data'"),
    ({"data": ["abc"]}, r'field data\[0\]: expected an object, got a string \("abc"\)'),
    ({"data": [{"paragraphs": 7}]}, r"field data\[0\].paragraphs: expected an array, got an integer \(7\)"),
    ({"data": [{"paragraphs": ["text"]}]}, r'field data\[0\].paragraphs\[0\]: expected an object, got a string \("text"\)'),
    ({"data": [{"paragraphs": [{"qas": []}]}]}, r"field data\[0\].paragraphs\[0\]: missing 'context'"),
    ({"data": [{"paragraphs": [{"context": 3}]}]},
     r"field data\[0\].paragraphs\[0\].context: expected a string, got an integer \(3\)"),
    ({"data": [{"paragraphs": [{"context": "C.", "qas": "Q?"}]}]},
     r'field data\[0\].paragraphs\[0\].qas: expected an array, got a string \("Q\?"\)'),
    ({"data": [{"paragraphs": [{"context": "C.", "qas": [1]}]}]},
     r"field data\[0\].paragraphs\[0\].qas\[0\]: expected an object, got an integer \(1\)"),
    ({"data": [{"paragraphs": [{"context": "C.", "qas": [{"id": "1"}]}]}]},
     r"field data\[0\].paragraphs\[0\].qas\[0\]: missing 'question'"),
    ({"data": [{"paragraphs": [{"context": "C.", "qas": [{"question": None}]}]}]},
     r"field data\[0\].paragraphs\[0\].qas\[0\].question: expected a string, got null \(null\)"),
])
@pytest.mark.parametrize("pairs", [False, True])
def test_malformed_squad_structure_names_file_and_field(tmp_path, doc, where, pairs):
    p = write(tmp_path / "s.json", json.dumps(doc))
    with pytest.raises(AttnkitError, match=rf"s.json is not SQuAD-format JSON: {where}$"):
        read_corpus(p, squad_pairs=pairs)


def test_squad_through_open_corpus(tmp_path):
    p = write(tmp_path / "s.json", json.dumps(SQUAD_OK))
    corpus = open_corpus([p], squad_pairs=True)
    assert list(corpus) == [("Q?", "C.")]
    assert corpus.describe()[0]["squad_pairs"] is True and corpus.summary().endswith("(question, context) pairs")


# --- issue 12: line endings and CSV quotes -----------------------------------------------------------------
def test_cr_only_line_endings_split_into_lines(tmp_path):
    p = write(tmp_path / "mac.txt", b"first line\rsecond line\rthird\r")
    assert read_corpus(p) == ["first line", "second line", "third"]
    q = write(tmp_path / "mixed.txt", b"a\r\nb\rc\nd")
    assert read_corpus(q) == ["a", "b", "c", "d"]
    paras = write(tmp_path / "paras.txt", b"a\rb\r\rc\r")
    assert read_corpus(paras) == ["a b", "c"]
    tsv = write(tmp_path / "mac.tsv", b"sentence\tlabel\rone\t1\rtwo\t0\r")
    assert read_corpus(tsv) == ["one", "two"]


def test_line_splitting_matches_universal_newlines_at_any_chunk_size():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from attnkit.corpus.streams import raw_lines

    @settings(max_examples=150, deadline=None)
    @given(st.text(alphabet="ab\r\n", max_size=40), st.integers(1, 7))
    def check(text, chunk):
        expected = [l.rstrip("\n") for l in io.StringIO(text, newline=None).readlines()]
        got = [b.decode() for b in raw_lines(io.BytesIO(text.encode()), "x", chunk_size=chunk)]
        assert got == expected

    check()


def test_csv_quoted_newlines_are_kept_but_an_unclosed_quote_is_refused(tmp_path):
    ok = write(tmp_path / "ok.csv", 'text,label\n"two\nlines, quoted",1\nplain,0\n')
    assert read_corpus(ok) == ["two\nlines, quoted", "plain"]
    eof = write(tmp_path / "eof.csv", 'text,label\nfine,1\n"never closed,0\nmore,1\nand more,0\n')
    with pytest.raises(AttnkitError, match=r"eof.csv:3: a quoted field opened on this line is never closed"):
        read_corpus(eof)
    rows = "".join(f"row {i},0\n" for i in range(300))
    long = write(tmp_path / "long.csv", 'text,label\nfine,1\n"opens here,1\n' + rows + 'late" quote,1\n')
    with pytest.raises(AttnkitError, match=r"long.csv:3: a quoted field opened on this line runs past 200 lines"):
        read_corpus(long)
    junk = write(tmp_path / "junk.csv", 'text,label\n"quoted" junk,1\n')
    with pytest.raises(AttnkitError, match=r"junk.csv:2: malformed CSV"):
        read_corpus(junk)


def test_read_table_reports_the_line_a_row_starts_on(tmp_path):
    from attnkit.corpus import read_table

    p = write(tmp_path / "t.csv", 'a,b\n"x\ny",1\nz,2\n')
    assert read_table(p) == (["a", "b"], [(2, ["x\ny", "1"]), (4, ["z", "2"])])


# --- errors -------------------------------------------------------------------------------------------------
def test_bad_inputs_are_one_line_errors_naming_the_path(tree, tmp_path):
    cases = [
        (lambda: open_corpus([tmp_path / "missing.txt"]), r"corpus file '.*missing.txt' does not exist"),
        (lambda: open_corpus([str(tmp_path / "*.nothing")]), r"corpus pattern '.*\*.nothing' matches no file"),
        (lambda: open_corpus([write(tmp_path / "empty" / "x.md", "x").parent]),
         r"corpus directory '.*empty' holds no corpus files"),
        (lambda: open_corpus(["-", "-"], stdin=io.BytesIO(b"x")), r"standard input \('-'\) is given twice"),
        (lambda: open_corpus([tree, tree / "b.txt"]), r"corpus file '.*b.txt' is given twice"),
        (lambda: open_corpus([tree], fmt="xml"), r"unknown corpus format 'xml'"),
        (lambda: open_corpus([tree], text_unit="word"), r"unknown text unit 'word'"),
        (lambda: open_corpus([tree], limit=0), r"limit must be a positive integer, got 0"),
        (lambda: open_corpus([tree], columns=("a", "b", "c")), r"columns takes one or two column names"),
        (lambda: open_corpus([tree], columns="a,"), r"columns holds an empty column name"),
    ]
    for make, message in cases:
        with pytest.raises(AttnkitError, match=message) as info:
            make()
        assert "\n" not in str(info.value)


def test_no_text_in_any_input_is_refused_at_the_end(tmp_path):
    a = write(tmp_path / "a.txt", "\n \n")
    b = write(tmp_path / "b.tsv", "text\n \n")
    with pytest.raises(AttnkitError, match="has no text in any of its 2 inputs"):
        list(open_corpus([a, b]))
    assert list(open_corpus([a, write(tmp_path / "c.txt", "words\n")])) == ["words"]



def test_an_empty_corpus_of_files_is_named_before_a_pass(tmp_path):
    a = write(tmp_path / "a.txt", "\n \n")
    b = write(tmp_path / "b.tsv", "text\n \n")
    with pytest.raises(AttnkitError, match="has no text in any of its 2 inputs"):
        open_corpus([a, b]).check_has_text()
    corpus = open_corpus([a, write(tmp_path / "c.txt", "one\ntwo\n")])
    corpus.check_has_text()  # reads up to the first segment: the corpus still gives every segment after it
    assert list(corpus) == ["one", "two"] and corpus.describe()[1]["n_segments"] == 2
    open_corpus(["-"], stdin=io.BytesIO(b"")).check_has_text()  # a stream is not read before its pass


# --- compression --------------------------------------------------------------------------------------------
def _gzip(data):
    import gzip

    return gzip.compress(data)


def _zstd(data):
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


PLAIN = {
    "c.txt": "one line\nanother line\n\npara two\n",
    "c.jsonl": json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "q", "text_pair": "p"}) + "\n",
    "c.tsv": "sentence1\tsentence2\nleft\tright\nup\tdown\n",
    "c.csv": 'text,label\n"quoted, with comma",1\nplain,0\n',
    "c.json": json.dumps(SQUAD_OK),
}


@pytest.mark.parametrize("name", sorted(PLAIN))
@pytest.mark.parametrize("suffix, compress, compression", [(".gz", _gzip, "gzip"), (".zst", _zstd, "zstd"),
                                                          (".zstd", _zstd, "zstd")])
def test_compressed_files_read_like_the_plain_ones(tmp_path, name, suffix, compress, compression):
    plain = write(tmp_path / "plain" / name, PLAIN[name])
    packed = write(tmp_path / "packed" / (name + suffix), compress(PLAIN[name].encode()))
    expected = read_corpus(plain)
    assert len(expected) >= 1
    corpus = open_corpus([packed])
    assert list(corpus) == expected
    info = corpus.describe()[0]
    assert info["compression"] == compression and info["format"] == open_corpus([plain]).describe()[0]["format"]
    assert info["sha256"] == hashlib.sha256(packed.read_bytes()).hexdigest()  # of the raw (compressed) bytes
    assert f"({compression})" in corpus.summary()
    # a directory search finds compressed files too
    assert list(open_corpus([packed.parent])) == expected


def test_multi_member_gzip_and_multi_frame_zstd_are_read_to_the_end(tmp_path):
    gz = write(tmp_path / "m.txt.gz", _gzip(b"first\n") + _gzip(b"second\n"))
    zst = write(tmp_path / "m.txt.zst", _zstd(b"first\n") + _zstd(b"second\n"))
    assert read_corpus(gz) == read_corpus(zst) == ["first", "second"]


def test_corrupt_compressed_data_is_named(tmp_path):
    fake = write(tmp_path / "fake.txt.gz", b"plain text, not gzip\n")
    with pytest.raises(AttnkitError, match=r"fake.txt.gz: cannot decompress"):
        read_corpus(fake)
    cut = write(tmp_path / "cut.txt.gz", _gzip(b"some words\n" * 1000)[:-30])
    with pytest.raises(AttnkitError, match=r"cut.txt.gz: cannot decompress"):
        read_corpus(cut)
    junk = write(tmp_path / "junk.txt.zst", b"\x00" * 64)
    with pytest.raises(AttnkitError, match=r"junk.txt.zst: cannot decompress"):
        read_corpus(junk)
    bad_utf8 = write(tmp_path / "bad.txt.zst", _zstd(b"fine\nbad \xfe here\n"))
    with pytest.raises(AttnkitError, match=r"bad.txt.zst:2: not valid UTF-8 \(byte 0xfe at column 5\)"):
        read_corpus(bad_utf8)


# --- standard input ---------------------------------------------------------------------------------------
def test_stdin_is_read_once_and_hashed(tmp_path):
    data = b"from stdin\r\nsecond\n"
    corpus = open_corpus(["-", write(tmp_path / "f.txt", "from file\n")], stdin=io.BytesIO(data))
    assert corpus.sources[0].path == "-"
    with pytest.raises(AttnkitError, match="known only after reading it"):
        corpus.fingerprint()
    assert corpus.sources[0].sha256() is None  # not read yet
    assert corpus.summary().splitlines()[0].startswith("<stdin>: text, one segment per line")
    assert list(corpus) == ["from stdin", "second", "from file"]
    info = corpus.describe()[0]
    assert info["sha256"] == hashlib.sha256(data).hexdigest() and info["n_segments"] == 2
    assert len(corpus.fingerprint()) == 64
    with pytest.raises(AttnkitError, match="standard input can be read only once"):
        list(corpus)


def test_stdin_formats_and_compression(tmp_path):
    jsonl = PLAIN["c.jsonl"].encode()
    assert list(open_corpus(["-"], "jsonl", stdin=io.BytesIO(jsonl))) == ["x", ("q", "p")]
    assert list(open_corpus(["-"], "tsv", stdin=io.BytesIO(PLAIN["c.tsv"].encode()))) == [("left", "right"),
                                                                                           ("up", "down")]
    corpus = open_corpus(["-"], "jsonl", stdin=io.BytesIO(_gzip(jsonl)))
    assert list(corpus) == ["x", ("q", "p")] and corpus.describe()[0]["compression"] == "gzip"
    assert list(open_corpus(["-"], stdin=io.BytesIO(_zstd(b"a\n\nb\n")))) == ["a", "b"]
    with pytest.raises(AttnkitError, match="parquet cannot be read from standard input"):
        open_corpus(["-"], "parquet", stdin=io.BytesIO(b""))


# --- Parquet and datasets directories ---------------------------------------------------------------------
def test_parquet_columns_named_or_guessed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2500  # several record batches
    table = pa.table({"id": list(range(n)), "question": [f"q{i}" for i in range(n)],
                      "sentence": [None if i == 7 else f"s{i}" for i in range(n)]})
    path = tmp_path / "qa.parquet"
    pq.write_table(table, path, row_group_size=1000)
    corpus = open_corpus([path])
    assert list(itertools.islice(corpus, 7)) == [(f"q{i}", f"s{i}") for i in range(7)]
    # a pair with a null side is not measured as (text, ""): the row is named
    with pytest.raises(AttnkitError, match=r"qa.parquet: row 8: the pair column 'sentence' is null"):
        list(open_corpus([path]))
    assert corpus.describe()[0]["columns"] == ["question", "sentence"]
    assert corpus.summary() == f"{path}: parquet, pairs from columns question + sentence"
    only = read_corpus(path, columns=("sentence",))
    assert len(only) == n - 1 and "s7" not in only  # the null is a blank segment, skipped
    with pytest.raises(AttnkitError, match=r"qa.parquet: column 'id' holds int64, not text"):
        read_corpus(path, columns=("id",))
    pq.write_table(pa.table({"x": [1.5], "y": ["a"]}), tmp_path / "odd.parquet")
    with pytest.raises(AttnkitError, match=r"odd.parquet: no usable text column; name one with columns "
                                           r"\(columns are: x \(double\), y \(string\)\)"):
        read_corpus(tmp_path / "odd.parquet")
    assert read_corpus(tmp_path / "odd.parquet", columns="y") == ["a"]


def test_unreadable_parquet_is_named(tmp_path):
    fake = write(tmp_path / "fake.parquet", "just text\n")
    with pytest.raises(AttnkitError, match=r"fake.parquet: not a readable Parquet file"):
        read_corpus(fake)
    with pytest.raises(AttnkitError, match=r"Parquet cannot be read through gzip"):
        open_corpus([write(tmp_path / "x.parquet.gz", _gzip(b"x"))])


def _save_dataset(path, columns):
    import datasets

    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


def test_datasets_directory_is_read_in_batches(tmp_path):
    n = 2100
    ds = _save_dataset(tmp_path / "nli", {"premise": [f"p{i}" for i in range(n)],
                                          "hypothesis": [f"h{i}" for i in range(n)], "label": [i % 3 for i in range(n)]})
    corpus = open_corpus([ds])
    segs = list(corpus)
    assert segs == [(f"p{i}", f"h{i}") for i in range(n)]
    info = corpus.describe()[0]
    assert info["format"] == "datasets" and info["columns"] == ["premise", "hypothesis"] and info["n_segments"] == n
    assert len(info["sha256"]) == 64
    assert corpus.summary() == f"{ds}: datasets (save_to_disk), pairs from columns premise + hypothesis"
    assert read_corpus(ds, columns=("hypothesis",))[:2] == ["h0", "h1"]
    # inside a directory tree a datasets directory is one input (its .json files are not SQuAD)
    write(tmp_path / "extra.txt", "extra\n")
    tree = open_corpus([tmp_path])
    assert [s.format for s in tree.sources] == ["text", "datasets"]
    assert len(list(tree)) == n + 1
    # the content hash follows the data
    fp = corpus.fingerprint()
    shutil.rmtree(ds)
    _save_dataset(ds, {"premise": ["other"], "hypothesis": ["data"], "label": [0]})
    assert open_corpus([ds]).fingerprint() != fp


def test_datasets_directory_errors(tmp_path):
    import datasets

    nums = _save_dataset(tmp_path / "nums", {"a": [1, 2], "b": [0.5, 1.5]})
    with pytest.raises(AttnkitError, match=r"nums: no usable text column; name one with columns "
                                           r"\(columns are: a \(.*int64.*\), b \(.*float64.*\)\)"):
        read_corpus(nums)
    with pytest.raises(AttnkitError, match=r"nums: column 'a' holds .*, not text"):
        read_corpus(nums, columns="a")
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]}),
                          "test": datasets.Dataset.from_dict({"text": ["u"]})}).save_to_disk(str(splits))
    with pytest.raises(AttnkitError, match=r"splits holds the splits test, train of a datasets DatasetDict: "
                                           r"give one of them"):
        open_corpus([splits])
    assert read_corpus(splits / "train") == ["t"]
    with pytest.raises(AttnkitError, match=r"is a datasets directory, not tsv"):
        open_corpus([nums], "tsv")


# --- streaming --------------------------------------------------------------------------------------------
class _CountingFile:
    """A file object that counts the bytes read through it."""

    def __init__(self, fh, counter):
        self._fh, self._counter = fh, counter

    def read(self, n=-1):
        data = self._fh.read(n)
        self._counter.append(len(data))
        return data

    def close(self):
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_the_first_segment_of_a_large_file_reads_only_its_start(tmp_path, monkeypatch):
    import attnkit.corpus.sources as sources

    big = tmp_path / "big.txt"
    with open(big, "w") as fh:
        for i in range(200_000):
            fh.write(f"segment number {i} of a corpus far larger than one read\n")
    size = big.stat().st_size
    assert size > 10_000_000
    read = []
    real_open = sources.open_file
    monkeypatch.setattr(sources, "open_file", lambda p: _CountingFile(real_open(p), read))
    first = next(iter(open_corpus([big], text_unit="line")))
    assert first == "segment number 0 of a corpus far larger than one read"
    assert sum(read) <= 1 << 16  # one chunk
    read.clear()
    it = iter(open_corpus([big]))  # auto text unit: a bounded look-ahead first
    assert next(it) == first
    assert sum(read) <= 2 << 20


def test_reading_a_whole_compressed_corpus_keeps_memory_small(tmp_path):
    import tracemalloc

    lines = "".join(f"line {i} of a generated corpus, long enough to matter in memory\n" for i in range(60_000))
    path = write(tmp_path / "big.jsonl.gz", _gzip("".join(json.dumps({"text": l}) + "\n"
                                                          for l in lines.splitlines()).encode()))
    del lines
    corpus = open_corpus([path])
    tracemalloc.start()
    try:
        n = sum(1 for _ in corpus)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 60_000
    assert peak < 1 << 20, f"peak {peak / 2**20:.1f} MiB for a {n}-segment corpus of ~4.5 MB"


def test_recursive_glob_reads_each_file_once_and_datasets_dirs_whole(tree):
    _save_dataset(tree / "ds", {"text": ["from the dataset"]})
    (tree / "empty_dir").mkdir()
    corpus = open_corpus([str(tree / "**")])
    assert [os.path.relpath(s.path, tree) for s in corpus.sources] == [
        "a.jsonl", "b.txt", "ds", "notes.md", os.path.join("sub", "deeper", "z.txt"), os.path.join("sub", "dev.tsv")]
    assert "from the dataset" in list(corpus)


def test_json_that_is_not_text_is_refused(tmp_path):
    deep = write(tmp_path / "deep.jsonl", "[" * 100_000 + "\n")
    with pytest.raises(AttnkitError, match=r"deep.jsonl:1: JSON nested too deeply"):
        read_corpus(deep)
    lone = write(tmp_path / "lone.jsonl", '{"text": "ok"}\n{"text": "bad \\ud800 escape"}\n')
    with pytest.raises(AttnkitError, match=r'lone.jsonl:2: field "text": holds a lone surrogate escape \(\\ud800\)'):
        read_corpus(lone)
    doc = {"data": [{"paragraphs": [{"context": "C.", "qas": [{"question": "Q\ud83d?"}]}]}]}
    squad = write(tmp_path / "s.json", json.dumps(doc))
    with pytest.raises(AttnkitError, match=r"s.json: data\[0\].paragraphs\[0\].qas\[0\].question: holds a lone"):
        read_corpus(squad, squad_pairs=True)
    assert read_corpus(squad) == ["C."]


def test_stdin_given_as_a_text_stream_is_read_as_bytes():
    text = io.TextIOWrapper(io.BytesIO("caf\u00e9\rnext\r".encode()), encoding="latin-1")
    assert list(open_corpus(["-"], stdin=text)) == ["caf\u00e9", "next"]


def test_a_corpus_of_files_can_be_sent_to_worker_processes(tree):
    import pickle

    corpus = open_corpus([tree])
    corpus.describe()  # plans and hashes are cached on the sources: they travel too
    copy = pickle.loads(pickle.dumps(corpus))
    assert list(copy) == list(corpus)
    assert [list(s.segments()) for s in copy.sources] == [list(s.segments()) for s in corpus.sources]
    assert copy.fingerprint() == corpus.fingerprint()


def test_column_names_with_newlines_keep_errors_on_one_line(tmp_path):
    p = write(tmp_path / "h.csv", '"multi\nline",other\nx,y\n')
    with pytest.raises(AttnkitError, match=r"h.csv: cannot tell which column holds the text; .*"
                                           r"\(columns are: 'multi\\nline', other\)$") as info:
        read_corpus(p)
    assert "\n" not in str(info.value)
    assert read_corpus(p, columns=("multi\nline",)) == ["x"]


# --- issue 21: streams, cut compressed files, link loops, unreadable folders, ambiguous tables ---------------------
def test_standard_input_streams_past_the_look_ahead_and_is_hashed_at_its_end():
    from attnkit.corpus.streams import PEEK_LINES

    tsv = "sentence\tlabel\n" + "".join(f"row number {i}\t1\n" for i in range(500))  # past the 200-line table peek
    text = "".join(f"line {i}\n" for i in range(PEEK_LINES + 50))  # past the text look-ahead
    for fmt, data, n in (("tsv", tsv, 500), ("text", text, PEEK_LINES + 50)):
        corpus = open_corpus(["-"], fmt, stdin=io.BytesIO(data.encode()))
        assert corpus.describe()[0]["sha256"] is None  # not at its end yet
        assert sum(1 for _ in corpus) == n
        assert corpus.describe()[0]["sha256"] == hashlib.sha256(data.encode()).hexdigest()
        assert len(corpus.fingerprint()) == 64


def test_a_pipe_is_read_once_as_a_stream(tmp_path):
    """Process substitution (`<(cat good.txt)`) names a pipe: reading it for the look-ahead, for its hash and then
    for the segments would give the segments an empty pipe."""
    import threading

    good = write(tmp_path / "good.txt", "one line\nanother line\nthird line\n")
    data = good.read_bytes()
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(w, data), os.close(w)))
    writer.start()
    try:
        corpus = open_corpus([good, f"/dev/fd/{r}"])
        assert list(corpus) == ["one line", "another line", "third line"] * 2
        writer.join()
        first, second = corpus.describe()
        assert second["sha256"] == first["sha256"] == hashlib.sha256(data).hexdigest()
        assert second["n_segments"] == 3 and second["size"] is None
        with pytest.raises(AttnkitError, match=r"/dev/fd/\d+ \(a pipe\) can be read only once"):
            list(corpus)
    finally:
        os.close(r)


@pytest.mark.parametrize("cut", ["half", "last bytes"])
def test_a_cut_zstd_file_is_an_error_naming_it(tmp_path, cut):
    data = _zstd(b"".join(b"Line %d of the file.\n" % i for i in range(20000)))
    data = data[: len(data) // 2] if cut == "half" else data[:-3]
    path = write(tmp_path / "cut.txt.zst", data)
    with pytest.raises(AttnkitError, match=r"^.*cut.txt.zst: cannot decompress \(the zstd data ends inside a frame: "
                                           r"the file is truncated\)$"):
        read_corpus(path)
    whole = write(tmp_path / "two.txt.zst", _zstd(b"a\nb\n") + _zstd(b"c\n"))  # frames end cleanly: fine
    assert read_corpus(whole) == ["a", "b", "c"]


def test_a_glob_through_a_link_loop_ends_and_reads_each_file_once(tmp_path):
    root = tmp_path / "data"
    write(root / "a.txt", "alpha\n")
    write(root / "sub" / "b.txt", "beta\n")
    (root / "sub" / "loop").symlink_to(root, target_is_directory=True)
    (root / "sub" / "loop2").symlink_to(root / "sub", target_is_directory=True)
    corpus = open_corpus([f"{root}/**"])
    assert [s.path for s in corpus.sources] == [str(root / "a.txt"), str(root / "sub" / "b.txt")]
    assert list(corpus) == ["alpha", "beta"]
    assert [s.path for s in open_corpus([f"{root}/**/b.txt"]).sources] == [str(root / "sub" / "b.txt")]


def test_an_unreadable_folder_of_the_corpus_is_named(tmp_path, monkeypatch):
    """A folder that cannot be listed (as root, permissions cannot make one: os.scandir is made to refuse it)
    would leave its files out of the measurement without a word."""
    root = tmp_path / "data"
    write(root / "a.txt", "alpha\n")
    write(root / "locked" / "b.txt", "beta\n")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.path.basename(os.fspath(path)) == "locked":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    for given in ([root], [f"{root}/**/*.txt"]):
        with pytest.raises(AttnkitError, match=r"^cannot read corpus folder '.*locked': Permission denied"):
            open_corpus(given)


def test_a_tsv_field_holding_a_bare_cr_stays_one_row(tmp_path):
    path = write(tmp_path / "cr.tsv", b"sentence\tlabel\nfirst\rhalf of one field\t1\nsecond row\t0\n")
    assert read_corpus(path) == ["first\rhalf of one field", "second row"]
    crlf = write(tmp_path / "crlf.tsv", b"sentence\tlabel\r\nfirst\r\nsecond\r\n")
    assert read_corpus(crlf) == ["first", "second"]


def test_a_column_named_twice_is_ambiguous(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tsv = write(tmp_path / "dup.tsv", "sentence\tsentence\nleft\tright\n")
    with pytest.raises(AttnkitError, match=r"dup.tsv: the column name 'sentence' occurs 2 times"):
        read_corpus(tsv)
    assert read_corpus(write(tmp_path / "ok.tsv", "sentence\tsentence\tlabel\nx\ty\t1\n"), columns=("label",)) == ["1"]
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
    pq.write_table(table, tmp_path / "dup.parquet")
    with pytest.raises(AttnkitError, match=r"dup.parquet: the column name 'text' occurs 2 times"):
        read_corpus(tmp_path / "dup.parquet")
    jsonl = write(tmp_path / "dup.jsonl", '{"text": "first", "text": "second"}\n')
    with pytest.raises(AttnkitError, match=r"dup.jsonl:1: an object names the field 'text' twice"):
        read_corpus(jsonl)


def test_a_folder_is_a_run_directory_by_its_files_not_by_a_name(tmp_path):
    from attnkit.run.head_features import HeadFeatures

    root = tmp_path / "data"
    write(root / "a.txt", "alpha\n")
    write(root / "shards" / "b.txt", "beta\n")  # a corpus folder named like the Ray engine's
    write(root / "other" / "features.npz", b"not attnkit's")
    write(root / "other" / "c.txt", "gamma\n")
    run = root / "run"
    HeadFeatures(np.zeros((1, 2, 3)), np.zeros((1, 2, 3)), ["a", "b", "c"], 1, 2).save(run)
    write(run / "notes.txt", "a run's file, not corpus text\n")
    assert sorted(read_corpus(root)) == ["alpha", "beta", "gamma"]


def test_a_pair_with_one_empty_side_is_refused_by_file_and_row(tmp_path):
    """Issue 46 item 7: a TSV pair with one side empty was measured as (text, "") without a word; it is refused as a
    null side is, naming the file, the row and the column, in every reader of pairs from columns (TSV/CSV, JSON
    Lines with named fields, Parquet). A row empty on both sides is a blank segment, skipped as before."""
    tsv = write(tmp_path / "d.tsv", "sentence1\tsentence2\nA cat.\tA dog.\n\t\nA bird.\t \nlast\tone\n")
    with pytest.raises(AttnkitError) as e:
        list(open_corpus([tsv]))
    assert str(e.value) == (f"{tsv}:4: the pair column 'sentence2' is empty; drop or fill such rows (or name one text "
                            "column with columns)")
    assert read_corpus(tsv, columns=("sentence1",)) == ["A cat.", "A bird.", "last"]
    csv_ = write(tmp_path / "d.csv", "a,b\nx,y\n,z\n")
    with pytest.raises(AttnkitError, match=r"d.csv:3: the pair column 'a' is empty"):
        list(open_corpus([csv_], columns=("a", "b")))
    jsonl = write(tmp_path / "d.jsonl", '{"q": "x", "s": "y"}\n{"q": "x", "s": ""}\n')
    with pytest.raises(AttnkitError, match=r"d.jsonl:2: the pair column 's' is empty"):
        list(open_corpus([jsonl], columns=("q", "s")))
    optional = write(tmp_path / "o.jsonl", '{"text": "x", "text_pair": "y"}\n{"text": "z", "text_pair": ""}\n')
    assert list(open_corpus([optional])) == [("x", "y"), "z"]  # text_pair "" is no pair, as documented
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q0", "q1"], "sentence": ["s0", "  "]}), tmp_path / "p.parquet")
    with pytest.raises(AttnkitError, match=r"p.parquet: row 2: the pair column 'sentence' is empty"):
        list(open_corpus([tmp_path / "p.parquet"]))
