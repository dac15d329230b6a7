"""`attnkit compare-models A B [CORPUS]...`: head-by-head similarity of two models' attention (docs/compare.md)."""
from __future__ import annotations

from pathlib import Path

import click

from .options import OutputPath, cli_errors, echo_for, shared


def _model_arg(value: str):
    return None if value == "default" else value  # an empty path is refused by the loader, not taken as default


@click.command("compare-models")
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@click.argument("corpus", nargs=-1, metavar="[CORPUS]...")
@shared("format", "columns", "squad-pairs", "limit", "max-length", "batch-size", "num-windows", "sentences",
        "backend", "device")
@click.option("-o", "--out", default="attnkit-compare", show_default=True, type=OutputPath(path_type=Path),
              help="Directory for compare_models.json, compare_models.npz and figures/compare_models.png.")
@shared("svg", "overwrite")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def compare_models_cmd(model_a, model_b, corpus, fmt, columns, squad_pairs, limit, max_length, batch_size,
                       num_windows, sentences, backend, device, out, svg, overwrite, quiet):
    """Compare the attention of models A and B (local directories, or 'default' for the embedded MiniLM)
    head by head over CORPUS (default: the built-in corpus), tokenised once with A's tokenizer: the cosine of
    the flattened attention maps, averaged over samples (Kovaleva et al. 2019, Sec. 4.3, Fig. 5), the mean
    cosine of each head's attention rows, and each head's feature shift (B − A); the figure shows both
    cosines. The maps are computed from q and k one row block at a time, never stored."""
    import numpy as np

    from ..corpus import open_corpus
    from ..embedded import check_model_max_length
    from ..run.files import FIGURES_DIR, compare_models_outputs
    from ..run.locking import output_directory
    from ..run.model_dir import check_model_dir
    from ..run.outputs import check_write_target
    from ..run.overwrite import claim_outputs

    inputs = [("model A", _model_arg(model_a)), ("model B", _model_arg(model_b)),
              *(("a corpus input", p, True) for p in corpus)]
    with output_directory(out, "attnkit compare-models", inputs=inputs):  # checked before the work (and torch)
        check_write_target(out / FIGURES_DIR)  # a link leading out of OUT is refused before the work, too
        claim = claim_outputs(compare_models_outputs(out, svg=svg), overwrite)
        texts = open_corpus(list(corpus), fmt, columns=columns, squad_pairs=squad_pairs, limit=limit)
        texts.check_has_text()  # a wrong format or no text is named before torch is imported
        for m in (model_a, model_b):
            if _model_arg(m) is not None:
                check_model_dir(m)
            check_model_max_length(_model_arg(m), max_length)  # config.json is enough
        from ..jobs.compare import compare_models
        res = compare_models(texts, _model_arg(model_a), _model_arg(model_b), max_length=max_length,
                             batch_size=batch_size, num_windows=num_windows, split_sentences=sentences,
                             backend=backend, device=device, progress=not quiet)
        res.save(out, svg=svg)
    kept = ~res.removed
    gone = f"; left out {int(res.removed.sum())} head(s) removed by pruning from A or B" if res.removed.any() else ""
    click.echo(f"{res.n_samples} samples, {res.n_rows} query rows; per layer, mean over heads (B vs A) of the row "
               f"cosine and the flattened-map cosine (Kovaleva et al.){gone}:")
    for l in range(res.row_cosine.shape[0]):
        if not kept[l].any():
            click.echo(f"  L{l:<3} no head left")
            continue
        rows, maps = res.row_cosine[l][kept[l]], res.map_cosine[l][kept[l]]
        least = int(np.flatnonzero(kept[l])[rows.argmin()])
        click.echo(f"  L{l:<3} rows {rows.mean():.4f}  maps {maps.mean():.4f}  least similar head H{least} "
                   f"({rows.min():.4f})")
    click.echo("wrote " + ", ".join(str(p) for p in compare_models_outputs(out, svg=svg)))
    if claim.removed_message():
        echo_for()(claim.removed_message(), err=True)


__all__ = ["compare_models_cmd"]
