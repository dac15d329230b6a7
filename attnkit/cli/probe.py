"""The `attnkit probe` command (Clark et al. 2019 syntax probes)."""
from __future__ import annotations

from pathlib import Path

import click

from ..corpus import FORMATS
from ..errors import cli_errors


@click.command("probe")
@click.argument("corpus", nargs=-1, metavar="CORPUS...")
@click.option("-o", "--out", "out", default="attnkit-probe", show_default=True, type=click.Path(path_type=Path),
              help="Run directory to write (probe.csv, probe.json, best_heads.txt, probe_heatmap.png).")
@click.option("--model", "model_path", default=None, metavar="PATH",
              help="Local model directory (transformers format). Default: the embedded MiniLM.")
@click.option("--parser", type=click.Choice(["auto", "spacy", "conllu"]), default="auto", show_default=True,
              help="conllu: read gold parses from CoNLL-U files; spacy: parse the corpus with spaCy "
                   "(pip install 'attnkit[syntax]'); auto: conllu when every input ends in .conllu/.conll.")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="auto", show_default=True,
              help="Corpus format for --parser spacy (as in `attnkit extract`); each line or text column value is "
                   "one text, both sides of a pair are parsed separately.")
@click.option("--columns", default=None, metavar="COL[,COL2]", help="TSV/CSV/Parquet/JSONL text column(s).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Probe only the first N texts/sentences.")
@click.option("--max-length", default=128, show_default=True, type=click.IntRange(min=2),
              help="Tokens per sentence; words cut off by truncation are counted as unaligned.")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--device", default=None, help="cpu, cuda or cuda:N [default: cuda if available].")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True)
@click.option("--backend", type=click.Choice(["auto", "fused", "reference"]), default="auto", show_default=True,
              help="word_attention backend: fused (the compiled op), reference (PyTorch), auto.")
@click.option("--min-count", default=10, show_default=True, type=click.IntRange(min=1),
              help="Relations with fewer scored dependencies are left out of the table and heatmap (not the CSV).")
@click.option("--relation", default=None, help="Heatmap of this relation [default: each head's best relation].")
@click.option("--train-fraction", default=0.5, show_default=True, type=click.FloatRange(0, 1, min_open=True,
                                                                                         max_open=True),
              help="Share of sentences the attention-only probe is trained on (UAS on the rest).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the train/test split.")
@click.option("--overwrite", is_flag=True, help="Replace an existing probe run in --out.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def probe(corpus, out, model_path, parser, fmt, columns, limit, max_length, batch_size, device, dtype, backend,
          min_count, relation, train_fraction, seed, overwrite, quiet):
    """Which heads track syntax: per head and dependency relation, accuracy against the parses of CORPUS.

    Clark et al. 2019, Sec. 4-5: how often the most-attended other word is the gold head (dependent->head)
    or the dependent (head->dep), against the best fixed-offset baseline; and an attention-only logistic
    probe's UAS. See docs/probes.md."""
    from ..probe.run import ProbeOptions, run_probe

    cols = tuple(c.strip() for c in columns.split(",") if c.strip()) if columns else None
    run_probe(ProbeOptions(paths=list(corpus), out=out, model_path=model_path, parser=parser, fmt=fmt,
                           columns=cols, limit=limit, max_length=max_length, batch_size=batch_size, device=device,
                           dtype=dtype, backend=backend, min_count=min_count, relation=relation,
                           train_fraction=train_fraction, seed=seed, overwrite=overwrite, quiet=quiet),
              echo=click.echo)
