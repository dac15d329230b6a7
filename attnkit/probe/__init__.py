"""Syntax probes (Clark et al. 2019, Sec. 4-5): which heads attend from a word to its syntactic head or
dependents, against a fixed-offset baseline, and an attention-only dependency probe. See docs/probes.md."""
from .alignment import Alignment, align_offsets, align_word_ids
from .conllu import read_conllu
from .sentences import ParsedSentence

__all__ = ["Alignment", "ParsedSentence", "align_offsets", "align_word_ids", "read_conllu"]
