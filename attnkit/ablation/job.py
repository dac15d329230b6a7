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

from ..embedded import model_config
from ..errors import arg
from ..interventions import Intervention, head_types_of, load_clusters
from ..models import layer_kinds, load_model
from ..run.files import HEAD_MEANS_FILE, REPORT_FILE
from ..run.identity import IDENTITY_FIELD, model_identity
from ..run.locking import output_directory
from ..run.outputs import write_json
from ..run.overwrite import claim_outputs
from .experiments import ResultTable, TaskEvaluator, run_experiment
from .figures import save_figure
from .image_tasks import ImageClassificationTask, ZeroShotImageTask
from .names import IMAGE_TASKS, task_max_length
from .options import (
    DEFAULT_MODES,
    AblateOptions,
    ablate_out,
    check_ablate_options,
    check_task_for_model,
    output_paths,
)
from .patching import PatchingTask
from .tasks import get_task


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
    note: str | None = None  # the task's default length cut to the model's positions


def add_layer_kinds(table: ResultTable, kinds: list) -> None:
    """An encoder–decoder's rows: after `layer`, the layer's `kind` (encoder, decoder, cross) and `kind_layer`, its
    index among the layers of that kind (docs/seq2seq.md); empty where a row names no layer."""
    for i, row in enumerate(table.rows):
        if "layer" not in row:
            continue
        layer = row["layer"]
        kind, index = (None, None) if layer is None else kinds[int(layer)]
        items = list(row.items())
        at = [k for k, _ in items].index("layer") + 1
        table.rows[i] = dict(items[:at] + [("kind", kind), ("kind_layer", index)] + items[at:])


def _mean_corpus(opts: AblateOptions):
    """--mean-corpus as `attnkit extract` reads its inputs ('-' is standard input), opened and checked for text
    before anything is written; None: the evaluated inputs."""
    if not opts.mean_corpus:
        return None
    from ..corpus import open_corpus

    corpus = open_corpus(list(opts.mean_corpus))
    if corpus.has_streams:  # read once, now: its segments are what the means (and their checkpoint) are made of
        return list(corpus)
    corpus.check_has_text()
    return corpus


def _means(opts: AblateOptions, corpus, task, model, tokenizer, out: str, quiet: bool):
    """The heads' mean outputs for --mode mean, over --mean-corpus or the evaluated inputs, kept (and resumed)
    in OUT/head_means.npz; with --overwrite measured again (the old file is replaced only by the new one's first
    save: a refused or failed command leaves it)."""
    from ..jobs.head_means import head_means

    texts = corpus if corpus is not None else task.segments(opts.sample)
    return head_means(texts, (model, tokenizer), max_length=task.max_length, batch_size=opts.batch_size,
                      checkpoint=os.path.join(out, HEAD_MEANS_FILE), progress=not quiet, fresh=opts.overwrite)


def run_ablation(opts: AblateOptions, clusters: dict | None = None) -> Ablation:
    """Run `attnkit ablate` as `opts` says. Everything that can be checked (options, data, the mean corpus, the
    output's place) is checked before the output is created; the output goes through the one write path
    (attnkit.run.locking.output_directory: locked, never an input, removed again if this call created it and
    failed), and --overwrite removes nothing before the new results are written. `clusters`: the content of
    `opts.clusters` as the command read it (`preflight_ablate`), used as it is; None reads it here, once."""
    check_ablate_options(opts)  # also checked by the command line before torch loads
    out = ablate_out(opts)
    if opts.experiment == "patching":
        task = PatchingTask(opts.data, opts.task_name, opts.metric)
        task.max_length = task_max_length(opts.task_name, opts.max_length)
        task.length_given = opts.max_length is not None
    elif opts.task_name == "zero-shot-image":
        task = ZeroShotImageTask(opts.data, opts.labels, opts.template, opts.regions)
    elif opts.task_name in IMAGE_TASKS:
        task = ImageClassificationTask(opts.data, opts.regions)
    else:
        task = get_task(opts.task_name, opts.data, glue_task=opts.glue_task, max_length=opts.max_length,
                        **({"decode": True, "max_new_tokens": opts.max_new_tokens} if opts.decode else {}))
    check_task_for_model(opts.task_name, model_config(opts.model), opts.model)  # before the model loads
    if opts.task_name in IMAGE_TASKS:  # every label a class of the model's, before it loads
        task.check_labels(model_config(opts.model), opts.model)
    if opts.limit is not None:
        task.head(opts.limit)
    corpus = _mean_corpus(opts)
    inputs = [("the model", None if opts.model == "default" else opts.model), ("the data", opts.data, True),
              *(("the mean corpus", p, True) for p in opts.mean_corpus)]
    with output_directory(out, "attnkit ablate", inputs=inputs):
        claim = claim_outputs(output_paths(out, opts.experiment), opts.overwrite,
                              stale=[os.path.join(out, REPORT_FILE)])
        means_file = Path(out) / HEAD_MEANS_FILE  # without --overwrite, a rerun continues it (same settings only)
        if opts.overwrite and opts.mode == "mean" and means_file.exists():
            claim.replaced.append(means_file)  # measured again: the model or its corpus may have changed
        if isinstance(task, ZeroShotImageTask):  # the vision tower of an image–text model; the prompts embedded
            m, tok = task.load(opts.model, opts.device)
        else:
            m, tok = load_model(None if opts.model == "default" else opts.model, device=opts.device,
                                task=task.model_task, max_length=opts.max_length)
        cut = task.fit_to(m)
        evaluate = TaskEvaluator(task, m, tok, limit=opts.sample, batch_size=opts.batch_size, stack=opts.stack)
        shape = Intervention.for_model(m).shape  # an encoder–decoder: its encoder, decoder and cross layers
        head_types = None
        if opts.clusters:
            head_types = (load_clusters(opts.clusters, shape) if clusters is None
                          else head_types_of(clusters, opts.clusters, shape))
        mode = opts.mode or DEFAULT_MODES.get(opts.experiment, "zero")
        t0 = time.perf_counter()
        means = _means(opts, corpus, task, m, tok, out, opts.quiet) if mode == "mean" else None
        table = run_experiment(
            opts.experiment, m, evaluate, task.main_metric, mode=mode, head_types=head_types,
            losses=lambda: task.losses(m, tok, limit=opts.sample, batch_size=1), step=opts.step,
            normalize_layers=not opts.no_layer_norm, renormalize=opts.renormalize, progress=not opts.quiet,
            n_boot=opts.resamples, means=means, patching=task if opts.experiment == "patching" else None,
        )
        if getattr(m.config, "is_encoder_decoder", False):
            add_layer_kinds(table, layer_kinds(m))
        paths = table.save(out)
        name = "default (embedded MiniLM)" if opts.model == "default" else opts.model
        fig = save_figure(table, shape, out, title=f"{name}: {opts.task_name} {opts.experiment}")
        meta = {"model": name, IDENTITY_FIELD: model_identity(m, None if opts.model == "default" else opts.model),
                "task": opts.task_name, "data": os.path.abspath(opts.data),
                "experiment": opts.experiment, "mode": mode, "renormalize": opts.renormalize,
                "max_length": task.max_length, **({} if cut is None else {"max_length_cut_from": cut}),
                "limit": opts.limit,
                "sample": opts.sample, "n_examples": table.rows[0].get("n"),
                "clusters": os.path.abspath(opts.clusters) if opts.clusters else None,
                "bootstrap": table.extra["bootstrap"], "seconds": round(time.perf_counter() - t0, 1)}
        if head_types is not None:
            meta["type_counts"] = head_types.counts()
        if opts.regions is not None:  # the images' regions (quadrants, or the map's file)
            meta["regions"] = opts.regions if opts.regions == "quadrants" else os.path.abspath(opts.regions)
        if opts.experiment == "patching":
            meta["metric"] = task.metric
        if opts.decode:  # greedy translations scored by sacrebleu (translation.py)
            meta["decode"] = {"method": "greedy", "max_new_tokens": task.decoding, "bleu": "sacrebleu corpus BLEU "
                              "(13a, exp smoothing)", "chrf": "sacrebleu corpus chrF (chrF2)"}
        if means is not None:
            meta["means"] = {"file": HEAD_MEANS_FILE, "n_tokens": means.n_tokens,
                             "corpus": [p if p == "-" else os.path.abspath(p) for p in opts.mean_corpus]
                             or "the evaluated inputs"}
        paths["meta"] = os.path.join(out, f"{opts.experiment}.meta.json")
        write_json(paths["meta"], meta)
        claim.remove_stale()
    note = None if cut is None else (f"attnkit ablate: inputs cut to the model's {task.max_length} positions (the "
                                     f"task's default {arg('max_length')} is {cut})")
    return Ablation(table, paths, fig, name, mode, head_types.counts() if head_types is not None else None,
                    claim.removed_message(), note)


__all__ = ["AblateOptions", "Ablation", "output_paths", "run_ablation"]
