"""`attnkit prune`: remove attention heads physically and write the smaller model (docs/pruning.md; the job:
attnkit/ablation/prune.py)."""
from __future__ import annotations

import click

from .options import OutputPath, cli_errors, echo_for, quiet_option


@click.command("prune")
@click.argument("model")
@click.option("--heads", default=None, metavar="LIST",
              help="Heads to remove, 0-based: L2H5,L3H1 (L4: every head of layer 4).")
@click.option("--importance", type=click.Path(exists=True), default=None, metavar="FILE",
              help="importance.json of `attnkit ablate --experiment importance` (or its output directory): remove "
                   "heads in the order its iterative pruning removed them.")
@click.option("--fraction", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="With --importance: the share of all heads to remove, in (0, 1].")
@click.option("-o", "--out", "out", required=True, type=OutputPath(file_okay=False),
              help="Directory to write the pruned model (with its tokenizer) into.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists (once the new model is written).")
@quiet_option
@cli_errors
def prune_cmd(model, heads, importance, fraction, out, overwrite, quiet):
    """Remove attention heads of MODEL (a local model directory, `default` for the embedded MiniLM, `smollm2` for the
    embedded decoder) from its query, key, value and output projections (a grouped-query decoder's KV head goes
    with its last query head), and write the smaller model to OUT.

    A layer may keep any number of heads; one with none left keeps its residual path only. The pruned model's
    hidden states equal those of MODEL with the same heads zeroed. Load it with attnkit.load_model(OUT) (every
    attnkit command takes it), or with transformers through attnkit.arch.load_pruned_model(OUT)."""
    from ..ablation.options import PruneOptions, preflight_prune
    from ..run.locking import check_not_in_use

    check_not_in_use(out)  # a directory another command holds is refused first, as the job's lock would
    opts = PruneOptions(model=model, out=out, heads=heads, importance=importance, fraction=fraction,
                        overwrite=overwrite)
    preflight_prune(opts)  # refusals that need no model come before torch is imported
    from ..ablation.prune import describe, run_prune

    res = run_prune(opts, echo=None if quiet else echo_for())
    for line in describe(res):
        click.echo(line)


__all__ = ["prune_cmd"]
