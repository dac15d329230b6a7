"""What `attnkit detect-heads` takes, and the checks of it that need no model: the kinds of heads, the model directory,
the corpus (read up to its first text), and where the results go (the one write path's checks, and earlier results
that only `overwrite` replaces). The command line runs `preflight_detect` before it imports torch, so that a refusal
comes at once; the job (detect.py) runs the same checks again under the output's lock. This module imports nothing
heavy (tests/test_cli_startup.py holds it to that)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..corpus import open_corpus
from ..embedded import model_config
from ..errors import AttnkitError, arg
from ..run.files import DETECTED_HEADS_FILE, DETECTED_HEADS_META, REPORT_FILE
from ..run.model_dir import check_model_dir, max_positions
from ..run.outputs import check_output_place
from ..run.overwrite import claim_outputs

KINDS = ("previous", "duplicate", "induction", "retrieval")
REPEAT_KINDS = ("previous", "duplicate", "induction")  # scored on repeated random tokens


def check_positions(model_or_config, n_tokens: int, what: str, remedy: str) -> None:
    """Refuse inputs longer than the model's position embeddings allow (a model with learned positions would fail
    deep inside; one with rotary positions would be measured beyond the context it was trained on). The model, its
    config, or its config.json as a dict (before the model loads); the positions as attnkit.run.model_dir counts
    them for every command."""
    limit = max_positions(model_or_config)
    if limit is not None and n_tokens > limit:
        cfg = getattr(model_or_config, "config", model_or_config)
        mtype = cfg.get("model_type") if isinstance(cfg, dict) else getattr(cfg, "model_type", None)
        raise AttnkitError(f"{what} take {n_tokens} tokens, more than the model's {limit} positions "
                           f"({mtype}): {remedy}")


def check_repeat_length(length: int, what: str) -> None:
    """Sequences of R = `length` tokens hold an induction target only when R ≥ 2: with R = 1 the token after the
    earlier copy is the row's own token."""
    if length < 2:
        raise AttnkitError(f"{what} of {length} token(s) hold no induction target (the token after the earlier copy "
                           "of the current one would be the current token itself): give at least 2")


def check_corpus_used(corpus, kinds) -> None:
    """A corpus is for retrieval's haystacks: given without retrieval among `kinds` it would go unused (and be
    recorded as used), so it is refused."""
    if corpus is not None and "retrieval" not in kinds:
        raise AttnkitError(f"{arg('corpus')} gives the haystacks of retrieval, which {arg('kinds')} does not ask for: "
                           f"add retrieval to {arg('kinds')}, or leave {arg('corpus')} out")


def check_kinds(kinds) -> tuple[str, ...]:
    """The kinds asked for, each once, in the order given; an unknown kind is refused."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise AttnkitError(f"unknown head kind {bad[0]!r}; use {', '.join(KINDS)}" if bad else
                           f"{arg('kinds')} names no kind of head; use {', '.join(KINDS)}")
    return tuple(dict.fromkeys(kinds))


@dataclass
class DetectOptions:
    """Everything `attnkit detect-heads` takes (its options, by their Python names)."""

    model: str
    out: str
    kinds: tuple = REPEAT_KINDS
    length: int = 50
    n_sequences: int = 100
    seed: int = 0
    corpus: str | None = None
    device: str | None = None
    overwrite: bool = False
    quiet: bool = False


def model_of(opts: DetectOptions) -> str | None:
    """The model as `load_model` takes it: `default` is the embedded MiniLM (None), as for every command."""
    return None if opts.model == "default" else opts.model


def detect_inputs(opts: DetectOptions) -> list:
    """What `attnkit detect-heads` reads, as the write path names them (attnkit.run.outputs.check_output_place)."""
    return [("the model", model_of(opts)), ("the corpus", opts.corpus)]


def detect_outputs(out) -> list:
    """The files `attnkit detect-heads -o OUT` writes (docs/files.md)."""
    return [os.path.join(out, DETECTED_HEADS_FILE), os.path.join(out, DETECTED_HEADS_META)]


def preflight_detect(opts: DetectOptions) -> None:
    """`attnkit detect-heads`'s refusals that need no model, before torch is imported."""
    kinds = check_kinds(opts.kinds)
    check_corpus_used(opts.corpus, kinds)
    repeat = [k for k in kinds if k in REPEAT_KINDS]
    if "induction" in repeat:
        check_repeat_length(opts.length, f"{arg('length')} sequences")
    if model_of(opts) is not None:
        check_model_dir(str(opts.model))
    out = check_output_place(opts.out, detect_inputs(opts))
    cfg = model_config(model_of(opts))  # positions from config.json, before anything is drawn or loaded
    if cfg is not None and repeat:
        check_positions(cfg, 2 * opts.length, f"the repeated sequences (2 × {opts.length} tokens)",
                        f"lower {arg('length')}")
    if opts.corpus is not None:
        if not os.path.isfile(opts.corpus):
            raise AttnkitError(f"{arg('corpus')} {opts.corpus!r} is not a file")
        open_corpus([opts.corpus], text_unit="line").check_has_text()  # to its first text: a wrong format is named now
    if os.path.isdir(out):
        claim_outputs(detect_outputs(out), opts.overwrite, stale=[os.path.join(out, REPORT_FILE)])


__all__ = ["KINDS", "REPEAT_KINDS", "DetectOptions", "check_kinds", "detect_inputs", "detect_outputs",
           "preflight_detect"]
