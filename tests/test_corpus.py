"""Corpus readers on tiny files written by the tests."""
import json

import pytest

from attnkit.corpus import default_corpus_path, read_corpus
from attnkit.errors import AttnkitError


def test_text_lines_and_paragraphs(tmp_path):
    p = tmp_path / "lines.txt"
    p.write_text("first line.\nsecond, line\n\n")
    assert read_corpus(p) == ["first line.", "second, line"]  # trailing blank line is no paragraph gap
    q = tmp_path / "paras.txt"
    q.write_text("a b\nc d.\n\n\ne f\n")
    assert read_corpus(q) == ["a b c d.", "e f"]
    assert read_corpus(q, text_unit="line") == ["a b", "c d.", "e f"]
    assert read_corpus(q, limit=1) == ["a b c d."]


def test_jsonl_with_pairs(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"text": "x y"}) + "\n\n" + json.dumps({"text": "q", "text_pair": "c"}) + "\n")
    assert read_corpus(p) == ["x y", ("q", "c")]
    p.write_text('{"text": "ok"}\n{"txt": "bad"}\n')
    with pytest.raises(AttnkitError, match=r"c.jsonl:2"):
        read_corpus(p)


def test_squad_contexts_and_pairs(tmp_path):
    doc = {"data": [{"title": "T", "paragraphs": [
        {"context": "Ctx one.", "qas": [{"question": "Q1?", "id": "1"}, {"question": "Q2?", "id": "2"}]},
        {"context": "Ctx one.", "qas": []},
        {"context": "Ctx two.", "qas": [{"question": "Q3?", "id": "3"}]}]}]}
    p = tmp_path / "s.json"
    p.write_text(json.dumps(doc))
    assert read_corpus(p) == ["Ctx one.", "Ctx two."]
    assert read_corpus(p, squad_pairs=True) == [("Q1?", "Ctx one."), ("Q2?", "Ctx one."), ("Q3?", "Ctx two.")]


def test_tsv_glue_style_and_named_columns(tmp_path):
    p = tmp_path / "dev.tsv"
    # GLUE files contain unbalanced quotes: they must be read literally
    p.write_text('index\tsentence1\tsentence2\tscore\n0\tA "quoted\tB.\t5.0\n1\tC\tD\t1.0\n')
    assert read_corpus(p) == [('A "quoted', "B."), ("C", "D")]
    assert read_corpus(p, columns=("sentence2",)) == ["B.", "D"]
    with pytest.raises(AttnkitError, match="no column 'nope'"):
        read_corpus(p, columns=("nope",))
    mrpc = tmp_path / "mrpc.tsv"
    mrpc.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t7\t8\tFirst one.\tSecond one.\n")
    assert read_corpus(mrpc) == [("First one.", "Second one.")]
    q = tmp_path / "odd.tsv"
    q.write_text("a\tb\n1\t2\n")
    with pytest.raises(AttnkitError, match="name it with columns"):
        read_corpus(q)


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(AttnkitError, match="does not exist"):
        read_corpus(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(AttnkitError, match="no text"):
        read_corpus(empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good line\nbad \xff byte\n")
    with pytest.raises(AttnkitError, match=r"bad.txt:2: not valid UTF-8 \(byte 0xff at column 5\)"):
        read_corpus(bad)
    # a directory is read recursively now; one without corpus files is refused by name
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.md").write_text("not a corpus\n")
    with pytest.raises(AttnkitError, match=r"corpus directory '.*notes' holds no corpus files"):
        read_corpus(notes)


def test_default_corpus_is_substantial():
    segs = read_corpus(default_corpus_path())
    assert len(segs) >= 30
    assert all("," in s and "." in s for s in segs)
