"""Sentence ids of a forward without an attnkit batch (the rules: attnkit/hf_attention.py's docstring, "Sentence
ids"): the user's (`attnkit.sentences`), else derived once per forward from its recorded inputs (`Forward`)."""
from __future__ import annotations

import torch

from ..errors import AttnkitError
from ..tokens import sentence_ids as segment_sentence_ids
from .context import Forward
from .layout import rolled
from .runtime import Runtime


def _segments_by_separators(ids: list[int], separators) -> list:
    """Segment of each token (None for a separator): a run of separators followed by more tokens
    closes a segment, so `<s> A </s></s> B </s>` and `[CLS] A [SEP] B [SEP]` have segments 0 and 1."""
    seq, segment, after_separator = [], 0, False
    for tok in ids:
        if tok in separators:
            seq.append(None)
            after_separator = True
            continue
        if after_separator:
            segment += 1
            after_separator = False
        seq.append(segment)
    return seq


def sentence_ids_from_inputs(input_ids, token_type_ids, lengths: list[int], L: int, separator_ids) -> torch.Tensor:
    """B×L int32 sentence ids from a forward's inputs (rule 3 of the module docstring); padding gets 0.
    `token_type_ids` None: none given, or the model's token types mark no segments. Raises
    AttnkitError naming the first sample where no sentence structure can be found."""
    separators = set(separator_ids)
    out = torch.zeros((len(lengths), L), dtype=torch.int32)
    for b, n in enumerate(lengths):
        types = None if token_type_ids is None else token_type_ids[b, :n].tolist()
        ids = None if input_ids is None else input_ids[b, :n].tolist()
        if types is not None and len(set(types)) > 1:
            seq = types
        elif ids is not None and separators:
            seq = _segments_by_separators(ids, separators)
        elif types is not None:
            seq = types  # one type: a single text, as the tokenizer gives a pair's segments two types
        elif ids is None:
            raise AttnkitError(
                f"region interventions need sentence ids, but sample {b} of this forward has no token_type_ids "
                "that separate segments and no input_ids (inputs_embeds) to find separator tokens in: "
                + _HOW_TO_GIVE)
        else:
            raise AttnkitError(
                f"region interventions need sentence ids, but sample {b} of this forward has no token_type_ids "
                "that separate segments and the model names no separator token (attnkit.instrument(model, "
                "tokenizer=tokenizer) tells it): " + _HOW_TO_GIVE)
        out[b, :n] = torch.tensor(segment_sentence_ids(ids or [0] * n, seq), dtype=torch.int32)
    return out


_HOW_TO_GIVE = "give them with attnkit.sentences(model, ids) or attnkit.intervene(model, iv, sentences=ids)"


def forward_sentence_ids(rt: Runtime, forward: Forward, B: int, L: int, lengths: torch.Tensor, device,
                         offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Sentence ids for a forward without an attnkit batch: the user's, else from the forward's inputs (derived once
    per forward, `Forward.derived`, with the model's separators `rt.separator_ids`). With `offsets` (a left-padded
    batch, see `padding_of`) they are those of the samples moved to the front."""
    if forward.sentences is not None:
        given = forward.sentences.to(device)
        return given if offsets is None else rolled(given, offsets, 1)
    inputs = forward.inputs
    if inputs is None or any(t is not None and tuple(t.shape) != (B, L)
                             for t in (inputs.input_ids, inputs.token_type_ids)):
        raise AttnkitError(
            "region interventions need sentence ids, but attnkit did not see this forward's inputs "
            "(attention ran outside a forward of the instrumented model): " + _HOW_TO_GIVE)
    ids = forward.derived.get("sentence_id")
    if ids is None:
        types = inputs.token_type_ids if rt.segment_types else None
        input_ids = inputs.input_ids
        if offsets is not None:  # the samples' tokens at the front, as the op sees them
            input_ids, types = (None if t is None else rolled(t, offsets.to(t.device), 1) for t in (input_ids, types))
        ids = sentence_ids_from_inputs(input_ids, types, lengths.tolist(), L, rt.separator_ids)
    ids = forward.derived["sentence_id"] = ids.to(device)
    return ids


def check_sentences_shape(given: torch.Tensor | None, B: int, L: int) -> None:
    """The user's sentence ids `given` (None: none) fit a batch of B × L tokens."""
    if given is not None and tuple(given.shape) != (B, L):
        raise AttnkitError(
            f"attnkit.sentences gave sentence ids of shape {tuple(given.shape)}, but the model got a "
            f"batch of {B} × {L} tokens: give one id per token of the padded batch")
