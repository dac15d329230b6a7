"""`attnkit ablate`: intervention experiments on a model and a local task dataset."""
from __future__ import annotations

import os
import time

import click

from ..errors import AttnkitError, cli_errors
from ..ablation.experiments import EXPERIMENTS, TaskEvaluator, run_experiment, save_figure
from ..ablation.tasks import TASKS, get_task


@click.command("ablate")
@click.argument("model")
@click.option("--task", "task_name", type=click.Choice(TASKS), required=True, help="Evaluation task.")
@click.option("--data", type=click.Path(exists=True, dir_okay=True), required=True,
              help="Local data: STS-B/GLUE TSV, SQuAD JSON, or a text corpus for mlm.")
@click.option("--experiment", type=click.Choice(EXPERIMENTS), required=True)
@click.option("--clusters", "clusters", type=click.Path(exists=True), default=None,
              help="Run directory (or clusters.json) with head types; needed by --experiment types.")
@click.option("--mode", type=click.Choice(["zero", "uniform"]), default=None,
              help="How heads are disabled (heads: zero, layers: uniform, importance pruning: zero by default).")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Use only the first N examples of the file (as --limit does in every attnkit command).")
@click.option("--sample", type=click.IntRange(min=1), default=None,
              help="Use N examples spread evenly over the file (data files are often sorted by genre, so the "
                   "first N can be a biased sample). Applied after --limit.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--glue-task", default=None, help="GLUE task of --data when it cannot be told from the header.")
@click.option("--step", type=float, default=0.1, show_default=True, help="importance: share pruned per step.")
@click.option("--no-layer-norm", is_flag=True, help="importance: do not normalise scores per layer.")
@click.option("--renormalize", is_flag=True,
              help="types: rescale what is left of each attention row after removing intra/inter attention.")
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available).")
@click.option("-o", "--out", "out", type=click.Path(file_okay=False), default=None,
              help="Output directory (default: ablation-<task>-<experiment>).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@cli_errors
def ablate(model, task_name, data, experiment, clusters, mode, limit, sample, batch_size, glue_task, step,
           no_layer_norm, renormalize, device, out, quiet):
    """Disable heads, layers or head types of MODEL (a local model directory, or `default` for the embedded
    MiniLM) and measure the task metric; writes CSV/JSON/Markdown tables and a PNG figure."""
    from ..run.head_features import write_json
    from ..interventions import load_clusters
    from ..run.locking import run_lock
    from ..models import load_model
    from ..run.outputs import ensure_writable_dir

    if model == "default" and task_name != "stsb":
        raise AttnkitError(f"the embedded MiniLM is a sentence-embedding model without a {task_name} head; "
                           f"give a local model fine-tuned for {task_name} (or use --task stsb)")
    if experiment == "types" and clusters is None:
        raise AttnkitError("--experiment types needs --clusters RUN (a run directory with clusters.json)")
    out = out or f"ablation-{task_name}-{experiment}"
    ensure_writable_dir(out)  # before the work: a bad -o fails now, not after the experiment
    task = get_task(task_name, data, glue_task=glue_task)
    if limit is not None:
        task.head(limit)
    with run_lock(out, "attnkit ablate"):
        m, tok = load_model(None if model == "default" else model, device=device, task=task.model_task)
        evaluate = TaskEvaluator(task, m, tok, limit=sample, batch_size=batch_size)
        shape = (m.config.num_hidden_layers, m.config.num_attention_heads)
        head_types = load_clusters(clusters, shape) if clusters else None
        mode = mode or {"layers": "uniform"}.get(experiment, "zero")
        t0 = time.perf_counter()
        table = run_experiment(
            experiment, m, evaluate, task.main_metric, mode=mode, head_types=head_types,
            losses=lambda: task.losses(m, tok, limit=sample, batch_size=1), step=step,
            normalize_layers=not no_layer_norm, renormalize=renormalize, progress=not quiet,
        )
        paths = table.save(out)
        name = "default (embedded MiniLM)" if model == "default" else model
        fig = save_figure(table, shape, out, title=f"{name}: {task_name} {experiment}")
        meta = {"model": name, "task": task_name, "data": os.path.abspath(data), "experiment": experiment,
                "mode": mode, "renormalize": renormalize, "limit": limit, "sample": sample,
                "n_examples": table.rows[0].get("n"), "clusters": os.path.abspath(clusters) if clusters else None,
                "seconds": round(time.perf_counter() - t0, 1)}
        if head_types is not None:
            meta["type_counts"] = head_types.counts()
        write_json(os.path.join(out, f"{experiment}.meta.json"), meta)
    click.echo(f"{name} · {task_name} · {experiment} (mode {mode}) · {table.rows[0].get('n')} examples"
               + (f" · types {head_types.counts()}" if head_types is not None else ""))
    click.echo(table.to_markdown())
    if experiment == "importance":
        click.echo(f"\nheads by importance (most first): {table.extra['ranking']}")
    click.echo(f"\nwrote {paths['csv']}, {paths['json']}, {paths['md']}, {fig}")
