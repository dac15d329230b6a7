"""`attnkit detect-heads MODEL -o RUN`: previous-token, duplicate-token, induction and retrieval heads of a decoder
(docs/analysis.md, "Detecting heads of decoders"; the library: attnkit/jobs/detect.py)."""
from __future__ import annotations

import click

from .options import OutputPath, cli_errors, echo_for, int_range, shared

KIND_NAMES = ("previous", "duplicate", "induction", "retrieval")


def _kinds(ctx, param, value):
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    bad = [k for k in kinds if k not in KIND_NAMES]
    if bad or not kinds:
        raise click.BadParameter(f"{value!r}: give kinds from {', '.join(KIND_NAMES)}, separated by commas",
                                 ctx=ctx, param=param)
    return kinds


@click.command("detect-heads")
@click.argument("model")
@click.option("-o", "--out", "out", type=OutputPath(file_okay=False), required=True,
              help="Directory to write detected_heads.csv and detected_heads.json into (a run directory of the same "
                   "model, so that its report shows them, or a new one).")
@click.option("--kinds", default="previous,duplicate,induction", show_default=True, callback=_kinds,
              help="Comma-separated: previous, duplicate, induction (repeated random tokens), retrieval "
                   "(needle in a haystack).")
@click.option("--length", type=int_range("length"), default=50, show_default=True,
              help="Tokens of each random sequence (repeated once).")
@click.option("--sequences", "n_sequences", type=int_range("n_sequences"), default=100, show_default=True,
              help="Random sequences (and needle-in-a-haystack inputs for retrieval).")
@click.option("--seed", type=int_range("seed"), default=0, show_default=True,
              help="Seed of the random tokens and needles.")
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False), default=None,
              help="retrieval: the plain-text corpus the haystacks come from (default: attnkit's default corpus).")
@shared("device", "overwrite", "quiet")
@click.option("--top", type=int_range("top"), default=5, show_default=True, help="Heads printed per kind.")
@cli_errors
def detect_heads_cmd(model, out, kinds, length, n_sequences, seed, corpus, device, overwrite, quiet, top):
    """Score every head of MODEL (a local causal language model, or smollm2) as a previous-token, duplicate-token,
    induction or retrieval head; writes OUT/detected_heads.csv (layer, head, one column per kind) and
    OUT/detected_heads.json (the settings). MODEL `default` is the embedded MiniLM, as for every command (an
    encoder: refused, detection needs causal attention). A bar counts the sequences scored (-q: none); what
    --overwrite removed is said on stderr either way."""
    from ..jobs.detect_options import DetectOptions, preflight_detect
    from ..run.locking import check_not_in_use

    check_not_in_use(out)  # a directory another command holds is refused first, as the job's lock would
    opts = DetectOptions(model=model, out=out, kinds=kinds, length=length, n_sequences=n_sequences, seed=seed,
                         corpus=corpus, device=device, overwrite=overwrite, quiet=quiet)
    preflight_detect(opts)  # refusals that need no model come before torch is imported
    from ..jobs.detect import run_detect_heads

    df, paths, removed = run_detect_heads(opts)
    for kind in kinds:
        best = df.sort_values(kind, ascending=False, na_position="last").head(top)
        click.echo(f"{kind}: " + ", ".join(f"L{r.layer}H{r.head} {getattr(r, kind):.3f}" for r in best.itertuples()))
    click.echo("wrote " + ", ".join(str(p) for p in paths))
    if removed:
        echo_for()(removed, err=True)


__all__ = ["detect_heads_cmd"]
