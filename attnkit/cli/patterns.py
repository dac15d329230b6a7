"""`attnkit patterns RUN`: Kovaleva et al.'s pattern types of every (example, head) (docs/patterns.md)."""
from __future__ import annotations

import click

from ..analysis.patterns import BLOCK_INTRA_MIN, MIX_PART_MIN, STRUCTURED_MIN
from .options import cli_errors, echo_for, int_range, run_argument, shared

SHARE = click.FloatRange(0.0, 1.0)


def _head_class(ctx, param, value):
    """--list L2H5:vertical → (layer, head, class)."""
    if value is None:
        return None
    import re

    m = re.fullmatch(r"L(\d+)H(\d+):(.+)", value.strip())
    if not m:
        raise click.BadParameter(f"{value!r}: write a head and a class, e.g. L2H5:vertical", ctx=ctx, param=param)
    return int(m.group(1)), int(m.group(2)), m.group(3)


@click.command("patterns")
@run_argument()
@click.option("--pairs", type=click.Choice(["auto", "yes", "no"]), default="auto", show_default=True,
              help="Whether examples are text pairs (block needs two segments); auto: an example whose head "
                   "puts any mass on another sentence (inter > 0).")
@click.option("--structured-min", default=STRUCTURED_MIN, show_default=True, type=SHARE,
              help="v + d at least this: vertical, diagonal or vertical+diagonal (v = cls + sep, d = prev + next + "
                   "self).")
@click.option("--mix-part-min", default=MIX_PART_MIN, show_default=True, type=SHARE,
              help="Both v and d at least this (in a structured example): vertical+diagonal.")
@click.option("--block-intra-min", default=BLOCK_INTRA_MIN, show_default=True, type=SHARE,
              help="intra at least this (in a pair): block.")
@click.option("--list", "listing", default=None, metavar="LxHy:CLASS", callback=_head_class,
              help="Only list the examples that put one head in one class (e.g. L2H5:vertical), most clearly first, "
                   "with their texts; writes nothing.")
@click.option("--list-max", default=10, show_default=True, type=int_range("list_max"),
              help="How many examples --list shows.")
@shared("overwrite", "svg")
@click.option("-q", "--quiet", is_flag=True, help="Print only the paths written, not the table of shares.")
@cli_errors
def patterns_cmd(run, pairs, structured_min, mix_part_min, block_intra_min, listing, list_max, overwrite, svg, quiet):
    """Classify every (example, head) of RUN into Kovaleva et al.'s five pattern types (vertical, diagonal,
    vertical+diagonal, block, heterogeneous) by the rules in docs/patterns.md; needs RUN/per_sample.npy
    (`attnkit extract --per-sample`). Writes RUN/patterns.json (shares), RUN/pattern_labels.npy (the class of
    every example and head) and RUN/figures/pattern_types.png (and .svg)."""
    from ..run.locking import check_not_in_use, output_directory

    if listing is None:  # (--list writes nothing)
        check_not_in_use(run)  # a directory another command holds is refused first, as the job's lock would
    from ..analysis.patterns import CLASSES, Rules, examples_of, run_patterns
    from ..run.outputs import os_errors

    flag = {"auto": None, "yes": True, "no": False}[pairs]
    rules = Rules(structured_min, mix_part_min, block_intra_min)
    if listing is not None:
        layer, head, cls = listing
        df, total = examples_of(run, layer, head, cls, n=list_max, pairs=flag, rules=rules)
        click.echo(f"L{layer}H{head} is {cls} on {total} examples" + (f"; the {len(df)} clearest:" if total else "."))
        for row, r in df.iterrows():
            text = r.get("text")
            if isinstance(text, str) and isinstance(r.get("text_pair"), str) and r["text_pair"]:
                text = f"{text} ||| {r['text_pair']}"
            where = f" (input {r['input']}, segment {r['position']})" if "input" in r else ""
            click.echo(f"  row {row}{where}: v {r['v']:.3f}  d {r['d']:.3f}  intra {r['intra']:.3f}"
                       + (f"  {text[:150]}" if isinstance(text, str) else ""))
        return
    with output_directory(run, "attnkit patterns"), os_errors(f"write into {run}"):
        written, data, removed = run_patterns(run, pairs=flag, svg=svg, rules=rules, overwrite=overwrite)
    if removed:
        echo_for()(removed, err=True)
    if data["weighting"] != "attention":
        click.echo(f"note: {run} holds {data['weighting']}-weighted features: Kovaleva et al.'s classes describe "
                   f"attention weights, these describe {data['weighting']}-weighted attention (patterns.json: "
                   "weighting)", err=True)
    if not quiet:
        gone = len(data["removed_heads"])
        click.echo(f"{data['n_examples']} examples × {data['n_layers']} layers × {data['n_heads']} heads"
                   + (f"; left out {gone} head(s) removed by pruning" if gone else ""))
        click.echo("layer  " + " ".join(f"{c:>17}" for c in CLASSES))
        for l in range(data["n_layers"]):
            click.echo(f"L{l:<5} " + " ".join("–".rjust(17) if data["per_layer"][c][l] is None
                                              else f"{data['per_layer'][c][l]:>17.1%}" for c in CLASSES))
        click.echo("all    " + " ".join(f"{data['overall'][c]:>17.1%}" for c in CLASSES))
    click.echo("wrote " + ", ".join(str(p) for p in written))


__all__ = ["patterns_cmd"]
