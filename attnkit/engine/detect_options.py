"""What `attnkit detect-heads` takes, and the checks of it that need no model: the kinds of heads, the model directory,
the corpus (read up to its first text), and where the results go (the one write path's checks, and earlier results
that only `overwrite` replaces). The command line runs `preflight_detect` before it imports torch, so that a refusal
comes at once; the job (detect.py) runs the same checks again under the output's lock. This module imports nothing
heavy (tests/test_cli_startup.py holds it to that)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..corpus import open_corpus
from ..errors import AttnkitError, arg
from ..run.files import DETECTED_HEADS_FILE, DETECTED_HEADS_META, REPORT_FILE
from ..run.model_dir import check_model_dir
from ..run.outputs import check_output_place
from ..run.overwrite import claim_outputs

KINDS = ("previous", "duplicate", "induction", "retrieval")
REPEAT_KINDS = ("previous", "duplicate", "induction")  # scored on repeated random tokens


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


def detect_inputs(opts: DetectOptions) -> list:
    """What `attnkit detect-heads` reads, as the write path names them (attnkit.run.outputs.check_output_place)."""
    return [("the model", opts.model), ("the corpus", opts.corpus)]


def detect_outputs(out) -> list:
    """The files `attnkit detect-heads -o OUT` writes (docs/files.md)."""
    return [os.path.join(out, DETECTED_HEADS_FILE), os.path.join(out, DETECTED_HEADS_META)]


def preflight_detect(opts: DetectOptions) -> None:
    """`attnkit detect-heads`'s refusals that need no model, before torch is imported."""
    check_kinds(opts.kinds)
    check_model_dir(str(opts.model))
    out = check_output_place(opts.out, detect_inputs(opts))
    if opts.corpus is not None:
        if not os.path.isfile(opts.corpus):
            raise AttnkitError(f"{arg('corpus')} {opts.corpus!r} is not a file")
        open_corpus([opts.corpus], text_unit="line").check_has_text()  # to its first text: a wrong format is named now
    if os.path.isdir(out):
        claim_outputs(detect_outputs(out), opts.overwrite, stale=[os.path.join(out, REPORT_FILE)])


__all__ = ["KINDS", "REPEAT_KINDS", "DetectOptions", "check_kinds", "detect_inputs", "detect_outputs",
           "preflight_detect"]
