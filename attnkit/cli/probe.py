"""`attnkit probe`: Clark et al. 2019's syntax probes (docs/probes.md; the job: attnkit/probe/run.py)."""
from __future__ import annotations

from pathlib import Path

import click

from .options import SEED, OutputPath, cli_errors, echo_for, int_range, shared


@click.command("probe")
@click.argument("corpus", nargs=-1, metavar="CORPUS...")
@click.option("-o", "--out", "out", default="attnkit-probe", show_default=True, type=OutputPath(path_type=Path),
              help="Run directory to write (probe.csv, probe.json, best_heads.txt, probe_heatmap.png).")
@shared("model")
@click.option("--parser", type=click.Choice(["auto", "spacy", "conllu"]), default="auto", show_default=True,
              help="conllu: read gold parses from CoNLL-U files; spacy: parse the corpus with spaCy "
                   "(pip install 'attnkit[syntax]'); auto: conllu when every input ends in .conllu/.conll.")
@shared("format", "columns", "limit", "max-length", "batch-size", "device", "dtype", "backend", batch_size=16)
@click.option("--min-count", default=10, show_default=True, type=int_range("min_count"),
              help="Relations with fewer scored dependencies are left out of the table and heatmap (not the CSV).")
@click.option("--relation", default=None, help="Heatmap of this relation [default: each head's best relation].")
@click.option("--train-fraction", default=0.5, show_default=True, type=click.FloatRange(0, 1, min_open=True,
                                                                                         max_open=True),
              help="Share of sentences the attention-only probe is trained on (UAS on the rest).")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the train/test split.")
@click.option("--count-root", is_flag=True,
              help="Score root words too, as Clark et al.'s code does: their head is ROOT, which no attention "
                   "head predicts, so they count as wrong (in their relation and in '(all)').")
@click.option("--baseline", type=click.Choice(["any", "clark"]), default="any", show_default=True,
              help="Offset baseline: any = the best of every offset that occurs; clark = the best of the offsets "
                   "-3..2, clamped to the sentence as in Clark et al.'s code.")
@shared("overwrite")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def probe(corpus, out, model_path, parser, fmt, columns, limit, max_length, batch_size, device, dtype, backend,
          min_count, relation, train_fraction, seed, count_root, baseline, overwrite, quiet):
    """Which heads track syntax: per head and dependency relation, accuracy against the parses of CORPUS.

    Clark et al. 2019, Sec. 4-5: per dependent, how often its gold head is the word it attends to most
    (dep->head) or the word that attends most to it (dep<-head, the transposed mode of Clark's code), against
    the best fixed-offset baseline; and an attention-only logistic probe's UAS. With --parser spacy, the corpus
    is read as `attnkit extract` reads it; each line or text column value is one text, both sides of a pair are
    parsed separately. See docs/probes.md."""
    from ..probe.options import ProbeOptions, preflight_probe
    from ..run.locking import check_not_in_use

    check_not_in_use(out)  # a directory another command holds is refused first, as the job's lock would
    source = click.get_current_context().get_parameter_source("max_length")
    if source is click.core.ParameterSource.DEFAULT:  # not asked for: cut to a model with fewer positions
        max_length = None

    opts = ProbeOptions(paths=list(corpus), out=out, model_path=model_path, parser=parser, fmt=fmt,
                        columns=columns, limit=limit, max_length=max_length, batch_size=batch_size, device=device,
                        dtype=dtype, backend=backend, min_count=min_count, relation=relation,
                        train_fraction=train_fraction, seed=seed, count_root=count_root, baseline=baseline,
                        overwrite=overwrite, quiet=quiet)
    preflight_probe(opts)  # refusals that need no model come before torch is imported
    from ..probe.run import run_probe

    run_probe(opts, echo=echo_for())


__all__ = ["probe"]
