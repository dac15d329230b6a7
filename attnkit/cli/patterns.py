"""`attnkit patterns RUN`: Kovaleva et al.'s pattern types of every (example, head) (docs/patterns.md)."""
from __future__ import annotations

import click

from .options import cli_errors, run_argument, shared


@click.command("patterns")
@run_argument()
@click.option("--pairs", type=click.Choice(["auto", "yes", "no"]), default="auto", show_default=True,
              help="Whether examples are text pairs (block needs two segments); auto: an example whose head "
                   "puts any mass on another sentence (inter > 0).")
@shared("svg")
@click.option("-q", "--quiet", is_flag=True, help="Print only the path written, not the table of shares.")
@cli_errors
def patterns_cmd(run, pairs, svg, quiet):
    """Classify every (example, head) of RUN into Kovaleva et al.'s five pattern types (vertical, diagonal,
    vertical+diagonal, block, heterogeneous) by the rules in docs/patterns.md; needs RUN/per_sample.npy
    (`attnkit extract --per-sample`). Writes RUN/patterns.json and RUN/figures/pattern_types.png."""
    from ..analysis.patterns import CLASSES, run_patterns
    from ..run.locking import run_lock
    from ..run.outputs import os_errors

    flag = {"auto": None, "yes": True, "no": False}[pairs]
    with run_lock(run, "attnkit patterns"), os_errors(f"write into {run}"):
        path, data = run_patterns(run, pairs=flag, svg=svg)
    if quiet:
        click.echo(f"wrote {path}")
        return
    click.echo(f"{data['n_examples']} examples × {data['n_layers']} layers × {data['n_heads']} heads")
    click.echo("layer  " + " ".join(f"{c:>17}" for c in CLASSES))
    for l in range(data["n_layers"]):
        click.echo(f"L{l:<5} " + " ".join(f"{data['per_layer'][c][l]:>17.1%}" for c in CLASSES))
    click.echo("all    " + " ".join(f"{data['overall'][c]:>17.1%}" for c in CLASSES))
    click.echo(f"wrote {path}")


__all__ = ["patterns_cmd"]
