"""Corpus readers: many inputs → one stream of segments (a str, or a (str, str) pair).

Formats, chosen by extension (under an optional .gz / .zst / .zstd) or `fmt`:
  text      (.txt, .text, other)  one segment per line, or paragraphs separated by blank lines
  jsonl     (.jsonl)              one object per line: "text" and optional "text_pair", or named fields
  squad     (.json)               SQuAD 1.1/2.0: the paragraph contexts, or (question, context) pairs
  tsv       (.tsv, .csv)          a header row; the text column(s) chosen by name (GLUE files work as they are)
  parquet   (.parquet)            the text column(s) chosen like TSV columns
  datasets  (a directory)         written by Hugging Face datasets' save_to_disk; columns as for TSV
Inputs are files, directories (recursive), shell globs and "-" (standard input). Every reader streams
(SQuAD JSON, one document, excepted) and names the file and line of what it cannot read.
"""
from .inputs import (
                     FORMATS,
                     TEXT_UNITS,
                     Corpus,
                     check_columns,
                     corpus_of_run,
                     default_corpus_path,
                     open_corpus,
                     read_corpus,
)
from .sources import TEXT_COLUMN_GUESSES, Source, read_table

__all__ = ["FORMATS", "TEXT_COLUMN_GUESSES", "TEXT_UNITS", "Corpus", "Source", "check_columns", "corpus_of_run",
           "default_corpus_path",
           "open_corpus", "read_corpus", "read_table"]
