"""`attnkit ablate`: intervention experiments on a model and a local task dataset (docs/interventions.md; the
job: attnkit/ablation/job.py)."""
from __future__ import annotations

import os

import click

from ..ablation.names import EXPERIMENTS, N_BOOT, TASKS
from .options import OutputPath, cli_errors, echo_for, int_range, shared


@click.command("ablate")
@click.argument("model")
@click.option("--task", "task_name", type=click.Choice(TASKS), required=True,
              help="Evaluation task (mlm, lm: the model's own masked-LM or next-token loss; image-classification: "
                   "a vision transformer's classifier on labelled images; zero-shot-image: CLIP or SigLIP with class "
                   "prompts, its vision tower ablated).")
@click.option("--data", required=True, metavar="PATH",
              help="Local data: STS-B/GLUE TSV, SQuAD JSON, or a text corpus for mlm and lm; for --experiment "
                   "patching a TSV/CSV of clean and corrupted inputs; for image-classification a folder of label "
                   "folders (DATA/cat/1.png) or DATASET_DIR:IMAGES[:LABELS] (docs/interventions.md).")
@click.option("--experiment", type=click.Choice(EXPERIMENTS), required=True,
              help="types, heads, layers, importance (gradient importance and pruning), patching, or best_head "
                   "(in every layer all heads but one, for each head kept; prints each layer's best).")
@click.option("--clusters", "clusters", type=click.Path(exists=True), default=None,
              help="Run directory (or clusters.json) with head types; needed by --experiment types.")
@click.option("--mode", type=click.Choice(["zero", "uniform", "mean"]), default=None,
              help="How heads are disabled (heads: zero, layers: uniform, importance pruning: zero by default); "
                   "mean (heads, layers, types) puts each head's mean output over a corpus in its place.")
@click.option("--mean-corpus", "mean_corpus", multiple=True, metavar="CORPUS",
              help="--mode mean: the corpus (any format attnkit extract reads; repeatable) that the heads' means come "
                   "from (default: the evaluated inputs). Kept in OUT/head_means.npz, which a rerun continues.")
@click.option("--metric", type=click.Choice(["cosine", "logit_diff"]), default=None,
              help="--experiment patching: cosine (task stsb, to each example's reference) or logit_diff (tasks mlm, "
                   "lm, glue: target minus foil).")
@click.option("--resamples", type=int_range("resamples"), default=N_BOOT, show_default=True,
              help="Bootstrap resamples of the examples for the intervals of each change (0: no intervals).")
@click.option("--stack", type=int_range("stack"), default=None,
              help="Settings evaluated per forward (default: as many as about 1 GiB allows; 1: one at a time).")
@shared("limit")
@click.option("--sample", type=int_range("sample"), default=None,
              help="Use N examples spread evenly over the file (data files are often sorted by genre, so the "
                   "first N can be a biased sample). Applied after --limit.")
@shared("max-length", max_length="128, squad 384; a language model's loss depends on it; cut to the positions "
                                "of a model with fewer, and said so")
@shared("batch-size", batch_size=32)
@click.option("--labels", default=None, metavar="NAMES",
              help="zero-shot-image: the classes, separated by commas (default: the data's labels).")
@click.option("--template", default=None,
              help="zero-shot-image: a class's prompt, {} standing for the class (default: 'a photo of a {}.').")
@click.option("--regions", default=None, metavar="quadrants|MAP.npy",
              help="Image tasks: the regions of each image's patches for the types experiment's intra/inter rows "
                   "(quadrants, or an H × W .npy map of integer region ids; default: one region per image).")
@click.option("--glue-task", default=None, help="GLUE task of --data when it cannot be told from the header.")
@click.option("--decode", is_flag=True,
              help="seq2seq: also translate every source greedily in each setting and score the translations "
                   "against the targets by corpus BLEU and chrF (sacrebleu: pip install attnkit[seq2seq]), beside "
                   "the loss, each change with its bootstrap interval.")
@click.option("--max-new-tokens", "max_new_tokens", type=int_range("max_new_tokens"), default=None,
              help="--decode: tokens per translation (default: 1.5 × the longest target's tokens + 5, within "
                   "--max-length).")
@click.option("--step", type=float, default=0.1, show_default=True, help="importance: share pruned per step.")
@click.option("--no-layer-norm", is_flag=True, help="importance: do not normalise scores per layer.")
@click.option("--renormalize", is_flag=True,
              help="types: rescale what is left of each attention row after removing intra/inter attention.")
@shared("device")
@click.option("-o", "--out", "out", type=OutputPath(file_okay=False), default=None,
              help="Output directory (default: ablation-<task>-<experiment>).")
@shared("overwrite")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@cli_errors
def ablate(model, task_name, data, experiment, clusters, mode, mean_corpus, metric, resamples, stack, limit, sample,
           max_length, batch_size, labels, template, regions, glue_task, decode, max_new_tokens, step, no_layer_norm,
           renormalize, device, out, overwrite, quiet):
    """Disable heads, layers or head types of MODEL (a local model directory, `default` for the embedded MiniLM,
    or `smollm2` for the embedded decoder SmolLM2-135M-Instruct, its install: docs/decoders.md), or patch its
    heads from clean into corrupted inputs, and measure the task metric; writes CSV/JSON/Markdown tables, every
    setting's per-example outputs and a PNG figure."""
    from ..ablation.options import AblateOptions, ablate_out, output_paths, preflight_ablate
    from ..run.locking import check_not_in_use

    opts = AblateOptions(
        model=model, task_name=task_name, data=data, experiment=experiment, clusters=clusters, mode=mode,
        limit=limit, sample=sample, batch_size=batch_size, glue_task=glue_task, step=step,
        no_layer_norm=no_layer_norm, renormalize=renormalize, device=device, out=out, quiet=quiet, metric=metric,
        mean_corpus=tuple(mean_corpus), resamples=resamples, stack=stack, overwrite=overwrite, max_length=max_length,
        decode=decode, max_new_tokens=max_new_tokens, labels=labels, template=template, regions=regions)
    check_not_in_use(ablate_out(opts))  # a directory another command holds is refused first, as the job's lock would
    clusters = preflight_ablate(opts)  # refusals that need no model come before torch is imported
    from ..ablation.job import run_ablation

    res = run_ablation(opts, clusters)
    if res.note and not quiet:  # (-q: meta.json records it, max_length_cut_from)
        echo_for()(res.note, err=True)
    table = res.table
    click.echo(f"{res.model_name} · {task_name} · {experiment} (mode {res.mode}) · {table.rows[0].get('n')} examples"
               + (f" · types {res.type_counts}" if res.type_counts is not None else "")
               + (f" · {len(table.extra['removed_heads'])} head(s) removed by pruning left out"
                  if table.extra.get("removed_heads") else ""))
    click.echo(table.to_markdown())
    if experiment == "importance":
        click.echo(f"\nheads by importance (most first): {table.extra['ranking']}")
    written = set(res.paths.values()) | {res.figure}
    click.echo("\nwrote " + ", ".join(p for p in output_paths(os.path.dirname(res.paths["csv"]), experiment)
                                      if p in written))
    if res.removed:
        echo_for()(res.removed, err=True)


__all__ = ["ablate"]
