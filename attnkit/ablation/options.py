"""What `attnkit ablate` and `attnkit prune` take, and the checks of it that need no model: option combinations,
paths and output conflicts. The jobs (job.py, prune.py) run them first; the command line runs them before it
imports torch (`preflight_ablate`, `preflight_prune`), so that a refusal comes at once. This module imports
nothing heavy (tests/test_cli_startup.py holds it to that)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..embedded import check_model_max_length, model_config
from ..errors import AttnkitError, arg, check_int
from ..features import read_heads
from ..run.files import LOCK_FILE, OWNER_FILE
from ..run.model_dir import DECODER_TYPES, check_model_dir, default_model_path
from ..run.outputs import check_output_place
from .data import read_task_data
from .names import EXPERIMENTS, IMAGE_TASKS, N_BOOT, PAIR_TASKS, task_max_length

DEFAULT_MODES = {"layers": "uniform", "patching": "patch"}  # when no mode is given: zero, but layers uniform
MEAN_EXPERIMENTS = ("heads", "layers", "types")  # the experiments that --mode mean applies to


def check_task_for_model(task_name: str, config, model: str) -> None:
    """A task that reads (source, target) pairs (PAIR_TASKS) needs an encoder–decoder, and an encoder–decoder
    needs one of them: refused by name (`config`: the model's config, or its config.json as a dict; None: unknown,
    nothing to check)."""
    if config is None:
        return
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    mtype = get("model_type")
    if task_name in PAIR_TASKS and not get("is_encoder_decoder"):
        raise AttnkitError(f"{arg('task_name', task_name)} scores an encoder–decoder's target given its source; "
                           f"{model!r} holds a {mtype!r} model, which is not an encoder–decoder")
    if task_name not in PAIR_TASKS and get("is_encoder_decoder"):
        raise AttnkitError(f"{model!r} holds a {mtype!r} encoder–decoder, which {arg('task_name', task_name)} cannot "
                           f"score: use {' or '.join(arg('task_name', t) for t in PAIR_TASKS)} with (source, target) "
                           "pairs")
    if task_name in IMAGE_TASKS:  # a text model, a vision transformer without a classification head, one tower
        from .image_data import check_classifier, check_two_towers

        check = check_two_towers if task_name == "zero-shot-image" else check_classifier
        check(config if isinstance(config, dict) else config.to_dict(), model)
    elif get("image_size") is not None and get("patch_size") is not None:
        raise AttnkitError(f"{model!r} holds a {mtype!r} vision transformer, which takes images: use "
                           f"{' or '.join(arg('task_name', t) for t in IMAGE_TASKS)} with labelled images")


@dataclass
class AblateOptions:
    """Everything `attnkit ablate` takes (its options, by their Python names)."""

    model: str
    task_name: str
    data: str
    experiment: str
    clusters: str | None = None
    mode: str | None = None
    limit: int | None = None
    sample: int | None = None
    batch_size: int = 32
    glue_task: str | None = None
    step: float = 0.1
    no_layer_norm: bool = False
    renormalize: bool = False
    device: str | None = None
    out: str | None = None
    quiet: bool = False
    overwrite: bool = False
    metric: str | None = None  # patching: how the model's output is scored
    mean_corpus: tuple = ()  # --mode mean: the corpus the heads' means come from (default: the evaluated inputs)
    resamples: int = N_BOOT  # bootstrap resamples (0: no intervals)
    stack: int | None = None  # settings per forward (None: as memory allows)
    max_length: int | None = None  # tokens per input (None: the task's default, `task_max_length`)
    decode: bool = False  # seq2seq: also translate greedily and score BLEU and chrF (translation.py)
    max_new_tokens: int | None = None  # decode: tokens per translation (None: from the targets' lengths)
    labels: str | None = None  # zero-shot-image: the classes, separated by commas (None: the data's labels)
    template: str | None = None  # zero-shot-image: a class's prompt, {} the class (None: image_data.DEFAULT_TEMPLATE)
    regions: str | None = None  # image tasks: "quadrants" or a .npy map of region ids (None: one region per image)


def check_ablate_options(opts: AblateOptions) -> None:
    """Refuse options that contradict each other, before any work."""
    if opts.model == "default" and opts.task_name != "stsb":
        raise AttnkitError(f"the embedded MiniLM is a sentence-embedding model without a {opts.task_name} head; "
                           f"give a local model fine-tuned for {opts.task_name} (or use {arg('task_name', 'stsb')})")
    if opts.experiment not in EXPERIMENTS:
        raise AttnkitError(f"unknown {arg('experiment')} {opts.experiment!r}; use one of {', '.join(EXPERIMENTS)}")
    if opts.experiment == "types" and opts.clusters is None:
        raise AttnkitError(f"{arg('experiment', 'types')} needs {arg('clusters')} RUN (a run directory with "
                           "clusters.json)")
    if opts.sample is not None:
        check_int(opts.sample, "sample")
    if opts.experiment == "patching" and opts.mode is not None:
        raise AttnkitError(f"{arg('experiment', 'patching')} patches heads: {arg('mode')} does not apply")
    if opts.experiment != "patching" and opts.metric is not None:
        raise AttnkitError(f"{arg('metric')} is for {arg('experiment', 'patching')}")
    if opts.mode == "mean" and opts.experiment not in MEAN_EXPERIMENTS:
        raise AttnkitError(f"{arg('mode', 'mean')} applies to the experiments {', '.join(MEAN_EXPERIMENTS)}")
    if opts.mode == "mean" and opts.task_name in PAIR_TASKS:  # head_means reads single texts, not pairs
        raise AttnkitError(f"{arg('mode', 'mean')} is not built for {arg('task_name', opts.task_name)}: the heads' "
                           "means of an encoder–decoder are not measured over pairs yet; use mode zero or uniform")
    if opts.task_name in IMAGE_TASKS and (opts.mode == "mean" or opts.max_length is not None):
        what = arg("mode", "mean") if opts.mode == "mean" else arg("max_length")
        raise AttnkitError(f"{what} is not for {arg('task_name', opts.task_name)}: "
                           + ("the heads' means are measured over texts only" if opts.mode == "mean"
                              else "every image becomes the model's patches, with no tokens to cut"))
    if opts.task_name != "zero-shot-image" and (opts.labels is not None or opts.template is not None):
        raise AttnkitError(f"{arg('labels') if opts.labels is not None else arg('template')} is for "
                           f"{arg('task_name', 'zero-shot-image')}")
    if opts.regions is not None:
        if opts.task_name not in IMAGE_TASKS:
            raise AttnkitError(f"{arg('regions')} is for the image tasks ({', '.join(IMAGE_TASKS)}): a text's regions "
                               "are its sentences")
        from .image_data import read_regions

        read_regions(opts.regions)
    if opts.mean_corpus and opts.mode != "mean":
        raise AttnkitError(f"{arg('mean_corpus')} is for {arg('mode', 'mean')}")
    check_int(opts.resamples, "resamples")
    if opts.stack is not None:
        check_int(opts.stack, "stack")
    check_int(task_max_length(opts.task_name, opts.max_length), "max_length", minimum=2)
    if opts.resamples != 0 and opts.resamples < 10:
        raise AttnkitError(f"{arg('resamples')} must be 0 (no intervals) or at least 10, got {opts.resamples}")
    check_decode_options(opts)


def check_decode_options(opts: AblateOptions) -> None:
    """Greedy decoding is for the tasks of an encoder–decoder, needs sacrebleu, and bounds its translations only
    when on."""
    if opts.max_new_tokens is not None:
        if not opts.decode:
            raise AttnkitError(f"{arg('max_new_tokens')} is for {arg('decode', True)}")
        check_int(opts.max_new_tokens, "max_new_tokens")
    if not opts.decode:
        return
    if opts.task_name not in PAIR_TASKS or opts.experiment == "patching":
        raise AttnkitError(f"{arg('decode', True)} translates with an encoder–decoder: it is for "
                           f"{arg('task_name', 'seq2seq')} (any experiment but patching), not "
                           f"{opts.task_name} {opts.experiment}")
    from .translation import require_sacrebleu

    require_sacrebleu()


def output_paths(out, experiment: str) -> list[str]:
    """The files `attnkit ablate --experiment E -o OUT` writes (docs/files.md, "The ablation tables")."""
    return [os.path.join(out, f"{experiment}.{ext}")
            for ext in ("csv", "json", "md", "examples.csv", "png", "meta.json")]


def ablate_out(opts: AblateOptions) -> str:
    """Where `attnkit ablate` writes: `opts.out`, else ablation-<task>-<experiment> in the working directory."""
    from ..run.outputs import check_output_path

    return check_output_path(opts.out) or f"ablation-{opts.task_name}-{opts.experiment}"


def preflight_ablate(opts: AblateOptions) -> dict | None:
    """What `attnkit ablate` can refuse without a model, before torch is imported: the options, the model
    directory and the tokens per input against its positions (its config.json), the data (read and checked as its
    task reads it: attnkit.ablation.data), the mean corpus (unless it
    is standard input, which can be read once only), the clusters file (its schema; the model's shape is checked
    once it is loaded), and earlier results in the output directory that only `overwrite` replaces. Returns the
    content of the clusters file as read here (None: no --clusters), for the job to use as it is."""
    from ..corpus import open_corpus
    from ..run.clusters import load_clusters
    from ..run.files import REPORT_FILE
    from ..run.outputs import check_no_file_in_the_way
    from ..run.overwrite import claim_outputs

    check_ablate_options(opts)
    out = ablate_out(opts)
    check_no_file_in_the_way(out)
    data = read_task_data(opts.task_name, opts.data, experiment=opts.experiment, glue_task=opts.glue_task,
                          metric=opts.metric)
    if opts.mean_corpus and "-" not in opts.mean_corpus:
        open_corpus(list(opts.mean_corpus)).check_has_text()
    claim_outputs(output_paths(out, opts.experiment), opts.overwrite, stale=[os.path.join(out, REPORT_FILE)])
    if opts.model != "default":
        check_model_dir(str(opts.model))
    config = model_config(opts.model)
    mtype = (config or {}).get("model_type")
    check_task_for_model(opts.task_name, config, opts.model)
    if opts.task_name == "image-classification":  # every label a class of the model's
        from .image_data import label_ids

        label_ids(data, config, opts.model)
    elif opts.task_name == "zero-shot-image":  # every label one of the classes
        from .image_data import zero_shot_classes

        zero_shot_classes(data, opts.labels, opts.template)
    if opts.task_name == "mlm" and mtype in DECODER_TYPES:  # (an unknown decoder is refused as it loads)
        raise AttnkitError(f"{arg('task_name', 'mlm')} scores a masked language model (an encoder); {opts.model!r} "
                           f"holds a {mtype!r} decoder: use {arg('task_name', 'lm')} for its next-token loss")
    if opts.max_length is not None:  # a length asked for: config.json is enough (a default is fitted to the model)
        check_model_max_length(opts.model, opts.max_length)
    return None if opts.clusters is None else load_clusters(opts.clusters)


@dataclass
class PruneOptions:
    """Everything `attnkit prune` takes (its options, by their Python names)."""

    model: str
    out: str
    heads: str | None = None
    importance: str | None = None
    fraction: float | None = None
    overwrite: bool = False


def check_fraction(fraction) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise AttnkitError(f"{arg('fraction')} must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def check_prune_options(opts: PruneOptions) -> None:
    """Refuse `attnkit prune` options that contradict each other or name no head (no model needed: heads are
    range-checked against the model later)."""
    if opts.heads is None and opts.importance is None and opts.fraction is not None:
        raise AttnkitError(f"{arg('fraction')} needs {arg('importance')} FILE: the order in which to remove heads")
    if (opts.heads is None) == (opts.importance is None):
        raise AttnkitError(f"give the heads to remove with {arg('heads')} or {arg('importance')} (with "
                           f"{arg('fraction')}), one of the two")
    if opts.heads is not None:
        if opts.fraction is not None:
            raise AttnkitError(f"{arg('fraction')} goes with {arg('importance')}, not with {arg('heads')}")
        if not read_heads(opts.heads):
            raise AttnkitError(f"{arg('heads')} names no head: write heads as L2H5,L3H1 (or L4 for a whole layer)")
        return
    if opts.fraction is None:
        raise AttnkitError(f"{arg('importance')} needs {arg('fraction')}: the share of all heads to remove")
    check_fraction(opts.fraction)


def check_out(out: Path, model_path: str, overwrite: bool) -> None:
    """Refuse an output path that is a file, the model itself, or a directory that is there and not empty
    (without `overwrite`); with `overwrite`, a directory that is not a model directory (prune replaces only what
    it could have written: files, config.json among them). Called before the model loads, and again under the
    output's lock."""
    if out.exists() and not out.is_dir():
        raise AttnkitError(f"{arg('out')} {str(out)!r} exists and is not a directory")
    if out.exists() and out.resolve() == Path(model_path).resolve():
        raise AttnkitError(f"{arg('out')} {str(out)!r} is the model being pruned: write the pruned model elsewhere")
    held = sorted(p.name for p in out.iterdir() if p.name not in (LOCK_FILE, OWNER_FILE)) if out.is_dir() else []
    if held and not overwrite:
        raise AttnkitError(f"{arg('out')} {str(out)!r} already exists: use {arg('overwrite', True)} to replace it, "
                           f"or another {arg('out')}")
    folders = [n for n in held if (out / n).is_dir() or (out / n).is_symlink()]
    if held and ("config.json" not in held or folders):
        why = f"it holds {folders[0]!r}" if folders else "it holds no config.json"
        raise AttnkitError(f"{arg('out')} {str(out)!r} is not a model directory ({why}): {arg('overwrite', True)} "
                           f"replaces only a model directory; write elsewhere")


def prune_inputs(opts: PruneOptions, path: str) -> list:
    """What `attnkit prune` reads, as the write path names them (attnkit.run.outputs.check_output_place)."""
    return [("the model being pruned", path), ("the importance file", opts.importance)]


def preflight_prune(opts: PruneOptions) -> None:
    """What `attnkit prune` can refuse without a model, before torch is imported."""
    check_prune_options(opts)
    path = default_model_path() if opts.model == "default" else str(opts.model)
    check_model_dir(path)
    check_output_place(opts.out, prune_inputs(opts, path), whole=True)  # as the write path will, the place first
    check_out(Path(opts.out), path, opts.overwrite)


__all__ = ["DEFAULT_MODES", "MEAN_EXPERIMENTS", "AblateOptions", "PruneOptions", "ablate_out", "check_ablate_options",
           "check_fraction", "check_out", "check_prune_options", "output_paths", "prune_inputs", "preflight_ablate",
           "preflight_prune"]
