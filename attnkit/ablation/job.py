"""`attnkit ablate` as a job: disable heads, layers or head types of a model and measure a task's metric;
write the tables (CSV, JSON, Markdown), the figure and <experiment>.meta.json into an output directory
(formats: docs/files.md, "The ablation tables"; the experiments: docs/interventions.md).

The command line (attnkit/cli/ablate.py) parses options into `AblateOptions`; `run_ablation` does the rest and
returns what the command line prints. It never imports click.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import AttnkitError, arg, check_int
from ..interventions import load_clusters
from ..models import load_model
from ..run.files import HEAD_MEANS_FILE, REPORT_FILE
from ..run.locking import run_lock
from ..run.outputs import check_output_path, ensure_writable_dir, write_json
from ..run.overwrite import claim_outputs
from .experiments import EXPERIMENTS, ResultTable, TaskEvaluator, run_experiment
from .figures import save_figure
from .metrics import N_BOOT
from .patching import PatchingTask
from .tasks import get_task

DEFAULT_MODES = {"layers": "uniform", "patching": "patch"}  # when no mode is given: zero, but layers uniform
MEAN_EXPERIMENTS = ("heads", "layers", "types")  # the experiments that --mode mean applies to


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


@dataclass
class Ablation:
    """What `run_ablation` wrote: the table, the paths of its files and figure, the model's name, and the number
    of heads of each type (types experiment)."""

    table: ResultTable
    paths: dict
    figure: str
    model_name: str
    mode: str
    type_counts: dict | None = None
    removed: str | None = None  # what --overwrite removed


def _check(opts: AblateOptions) -> None:
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
    if opts.mean_corpus and opts.mode != "mean":
        raise AttnkitError(f"{arg('mean_corpus')} is for {arg('mode', 'mean')}")
    check_int(opts.resamples, "resamples")
    if opts.stack is not None:
        check_int(opts.stack, "stack")
    if opts.resamples != 0 and opts.resamples < 10:
        raise AttnkitError(f"{arg('resamples')} must be 0 (no intervals) or at least 10, got {opts.resamples}")


def _means(opts: AblateOptions, task, model, tokenizer, out: str, quiet: bool):
    """The heads' mean outputs for --mode mean, over --mean-corpus or the evaluated inputs, kept (and resumed)
    in OUT/head_means.npz."""
    from ..corpus import open_corpus
    from ..engine.head_means import head_means

    texts = open_corpus(list(opts.mean_corpus)) if opts.mean_corpus else task.segments(opts.sample)
    return head_means(texts, (model, tokenizer), max_length=task.max_length, batch_size=opts.batch_size,
                      checkpoint=os.path.join(out, HEAD_MEANS_FILE), progress=not quiet)


def run_ablation(opts: AblateOptions) -> Ablation:
    _check(opts)
    out = check_output_path(opts.out) or f"ablation-{opts.task_name}-{opts.experiment}"
    ensure_writable_dir(out)  # before the work: a bad output directory fails now, not after the experiment
    claim = claim_outputs(output_paths(out, opts.experiment), opts.overwrite, stale=[os.path.join(out, REPORT_FILE)])
    means_file = Path(out) / HEAD_MEANS_FILE  # without --overwrite, a rerun continues it (same settings only)
    if opts.overwrite and opts.mode == "mean" and means_file.exists():
        means_file.unlink()  # measured again: the model or its corpus may have changed under the same names
        claim.replaced.append(means_file)
    if opts.experiment == "patching":
        task = PatchingTask(opts.data, opts.task_name, opts.metric)
    else:
        task = get_task(opts.task_name, opts.data, glue_task=opts.glue_task)
    if opts.limit is not None:
        task.head(opts.limit)
    with run_lock(out, "attnkit ablate"):
        m, tok = load_model(None if opts.model == "default" else opts.model, device=opts.device,
                            task=task.model_task)
        evaluate = TaskEvaluator(task, m, tok, limit=opts.sample, batch_size=opts.batch_size, stack=opts.stack)
        shape = (m.config.num_hidden_layers, m.config.num_attention_heads)
        head_types = load_clusters(opts.clusters, shape) if opts.clusters else None
        mode = opts.mode or DEFAULT_MODES.get(opts.experiment, "zero")
        t0 = time.perf_counter()
        means = _means(opts, task, m, tok, out, opts.quiet) if mode == "mean" else None
        table = run_experiment(
            opts.experiment, m, evaluate, task.main_metric, mode=mode, head_types=head_types,
            losses=lambda: task.losses(m, tok, limit=opts.sample, batch_size=1), step=opts.step,
            normalize_layers=not opts.no_layer_norm, renormalize=opts.renormalize, progress=not opts.quiet,
            n_boot=opts.resamples, means=means, patching=task if opts.experiment == "patching" else None,
        )
        paths = table.save(out)
        name = "default (embedded MiniLM)" if opts.model == "default" else opts.model
        fig = save_figure(table, shape, out, title=f"{name}: {opts.task_name} {opts.experiment}")
        meta = {"model": name, "task": opts.task_name, "data": os.path.abspath(opts.data),
                "experiment": opts.experiment, "mode": mode, "renormalize": opts.renormalize, "limit": opts.limit,
                "sample": opts.sample, "n_examples": table.rows[0].get("n"),
                "clusters": os.path.abspath(opts.clusters) if opts.clusters else None,
                "bootstrap": table.extra["bootstrap"], "seconds": round(time.perf_counter() - t0, 1)}
        if head_types is not None:
            meta["type_counts"] = head_types.counts()
        if opts.experiment == "patching":
            meta["metric"] = task.metric
        if means is not None:
            meta["means"] = {"file": HEAD_MEANS_FILE, "n_tokens": means.n_tokens,
                             "corpus": [os.path.abspath(p) for p in opts.mean_corpus] or "the evaluated inputs"}
        paths["meta"] = os.path.join(out, f"{opts.experiment}.meta.json")
        write_json(paths["meta"], meta)
        claim.remove_stale()
    return Ablation(table, paths, fig, name, mode, head_types.counts() if head_types is not None else None,
                    claim.removed_message())


def output_paths(out, experiment: str) -> list[str]:
    """The files `attnkit ablate --experiment E -o OUT` writes (docs/files.md, "The ablation tables")."""
    return [os.path.join(out, f"{experiment}.{ext}")
            for ext in ("csv", "json", "md", "examples.csv", "png", "meta.json")]


__all__ = ["AblateOptions", "Ablation", "output_paths", "run_ablation"]
