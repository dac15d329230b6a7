"""Click command `attnkit compare-models A B CORPUS`: head-by-head similarity of two models' attention."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import cli_errors


def _model_arg(value: str):
    return None if value in ("default", "") else value


@click.command("compare-models")
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@click.argument("corpus", nargs=-1, metavar="[CORPUS]...")
@click.option("--format", "fmt", default="auto", show_default=True, help="Corpus format (as `attnkit extract`).")
@click.option("--columns", default=None, metavar="COL[,COL2]", help="Text column(s) of a table.")
@click.option("--squad-pairs", is_flag=True, help="SQuAD JSON: (question, context) pairs.")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Only the first N segments.")
@click.option("--max-length", default=128, show_default=True, type=click.IntRange(min=2))
@click.option("--batch-size", default=None, type=click.IntRange(min=1), help="Samples per batch.")
@click.option("--num-windows", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--sentences", is_flag=True, help="Also split segments into sentences (for intra/inter).")
@click.option("--backend", type=click.Choice(["auto", "fused", "reference"]), default="auto", show_default=True)
@click.option("--device", default=None, help="cpu, cuda or cuda:N.")
@click.option("-o", "--out", default="attnkit-compare", show_default=True, type=click.Path(path_type=Path),
              help="Directory for compare_models.json, compare_models.npz and figures/compare_models.png.")
@click.option("--svg/--no-svg", default=True, show_default=True, help="Also save the figure as SVG.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def compare_models_cmd(model_a, model_b, corpus, fmt, columns, squad_pairs, limit, max_length, batch_size,
                       num_windows, sentences, backend, device, out, svg, quiet):
    """Compare the attention of models A and B (local directories, or 'default' for the embedded MiniLM)
    head by head over CORPUS (default: the built-in corpus), tokenised once with A's tokenizer: the mean
    cosine of each head's attention rows, the flattened-map cosine of Kovaleva et al. (2019, Sec. 5), and each
    head's feature shift (B − A). The maps are computed from q and k one row block at a time, never stored."""
    from ..engine.compare import compare_models
    from ..corpus import open_corpus

    texts = open_corpus(list(corpus), fmt, columns=columns, squad_pairs=squad_pairs, limit=limit)
    res = compare_models(texts, _model_arg(model_a), _model_arg(model_b), max_length=max_length,
                         batch_size=batch_size, num_windows=num_windows, split_sentences=sentences,
                         backend=backend, device=device, progress=not quiet)
    path = res.save(out, svg=svg)
    click.echo(f"{res.n_samples} samples, {res.n_rows} query rows; mean row cosine per layer (B vs A):")
    for l, (rc, mc) in enumerate(zip(res.row_cosine.mean(1), res.map_cosine.mean(1))):
        click.echo(f"  L{l:<3} rows {rc:.4f}  maps {mc:.4f}  least similar head H{int(res.row_cosine[l].argmin())} "
                   f"({res.row_cosine[l].min():.4f})")
    click.echo(f"wrote {path}")


COMMANDS = (compare_models_cmd,)
