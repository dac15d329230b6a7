"""`attnkit extract`: per-head features of a corpus into a run directory (the job: attnkit/jobs/extract_job.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..features import DEFAULT_WINDOW
from .options import OutputPath, check_devices, cli_errors, command_line, echo_for, int_range, shared


@click.command()
@click.argument("corpus", nargs=-1, metavar="[CORPUS]...")
@click.option("--images", is_flag=True,
              help="CORPUS names images: image files, folders (searched recursively; other files skipped and "
                   "counted), DATASET_DIR:COLUMN (a datasets directory's image column) or 'embedded' (the default: "
                   "scikit-image's sample images, pip install 'attnkit[vision]'), read through the model's image "
                   "processor. The model must be a vision transformer (docs/features.md §10).")
@shared("model", "format")
@click.option("--text-unit", type=click.Choice(["auto", "line", "paragraph", "file"]), default="auto",
              show_default=True,
              help="Plain text: one segment per line, per blank-line-separated paragraph, or per whole file (long "
                   "documents; auto: paragraphs if the start of the file has blank lines between text).")
@shared("columns", "squad-pairs", "max-length", "batch-size")
@click.option("--window", default=DEFAULT_WINDOW, show_default=True, type=int_range("window"),
              help="Segments read ahead and sorted by length together: memory stays bounded by one window, padding "
                   "stays low. Part of the plan: resume with the same value.")
@shared("device")
@click.option("--devices", default=None, metavar="LIST", callback=check_devices,
              help="One model replica per device: 'all' (every GPU), or a list such as cuda:0,cuda:1 (cpu,cpu runs "
                   "two CPU replicas).")
@click.option("--workers", default=None, type=int_range("workers"),
              help="Tokenisation processes running ahead of the model (0: tokenise between forwards; at most one "
                   "per core is used) [default: on the CPU chosen from the first batches' rates; with GPUs the "
                   "CPU cores − 1, at most 8].")
@click.option("--threads", default=None, type=int_range("threads"),
              help="torch threads for the forwards [default: on the CPU chosen from the first batches' rates, "
                   "with --workers; otherwise torch's count]. The run prints and records what it chose.")
@shared("dtype", "num-windows", "sentences", "limit", "backend", "engine", "ray-address")
@click.option("-o", "--out", "out", default="attnkit-run", show_default=True,
              type=OutputPath(file_okay=False, path_type=Path), help="Run directory to write.")
@click.option("--resume", is_flag=True, help="Continue the interrupted run in --out from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace a finished run in --out (only once the new one finishes).")
@click.option("--checkpoint-every", default=None, type=int_range("checkpoint_every"), metavar="N",
              help="Also write a checkpoint once N batches were measured since the last one (at the end of the "
                   "planned unit that reaches N: short texts are planned 8 batches at a time). By default one is "
                   "written every 30 seconds of the run, and always when it is interrupted (Ctrl-C, SIGTERM) or "
                   "fails.")
@click.option("--per-sample", is_flag=True,
              help="Also keep every sample's features: OUT/per_sample.npy (float32, samples × layers × heads × "
                   "features, input order; memory-mapped) for `attnkit patterns`.")
@click.option("--weighting", type=click.Choice(["attention", "norm"]), default="attention", show_default=True,
              help="What the features describe: the attention weights, or the weights scaled per key by the norm of "
                   "the key's transformed vector ‖f_h(x_t)‖ (Kobayashi et al. 2020; docs/features.md). Part of the "
                   "run: resume with the same value.")
@click.option("--max-logit", "max_logit", is_flag=True,
              help="Also measure each head's max logit over the corpus (the largest scaled pre-softmax score a "
                   "query sees; docs/features.md §9), measured by the fused CPU kernel in its own pass (other "
                   "backends: one more blocked q·kᵀ pass per layer): array max_logit "
                   "(layers × heads) in OUT/features.npz. Local engine, one device. Part of the run: resume with the "
                   "same choice.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def extract(corpus, images, model_path, fmt, text_unit, columns, squad_pairs, max_length, batch_size, window, device,
            devices, workers, threads, dtype, num_windows, sentences, limit, backend, engine, ray_address, out, resume,
            overwrite, checkpoint_every, per_sample, weighting, max_logit, quiet):
    """Measure per-head attention features over CORPUS (default: a small built-in English corpus).

    CORPUS is any number of files, directories (searched recursively for corpus files), shell globs, or '-'
    for standard input; files may be gzip or zstd compressed. Segments are streamed: memory stays bounded
    whatever the corpus size.

    With --images, CORPUS names images (files, folders, DATASET_DIR:COLUMN; default: the embedded image set) and
    --model a vision transformer saved with its image processor; a folder's files of other kinds and its unreadable
    images are skipped and recorded in meta.json.

    Writes OUT/features.npz (arrays mean, std: layers × heads × features; names; with --max-logit, max_logit:
    layers × heads) and OUT/meta.json
    (model, inputs with their formats and content hashes, counts, settings, versions, backend). Interrupted
    runs (Ctrl-C, kill) keep a checkpoint; `--resume` continues them to the same numbers as an
    uninterrupted run.
    """
    from ..jobs.job_options import ExtractOptions, preflight_extract
    from ..run.locking import check_not_in_use

    check_not_in_use(out)  # a directory another command holds is refused first, as the job's lock would
    opts = ExtractOptions(
        paths=list(corpus), images=images, model_path=model_path, fmt=fmt, text_unit=text_unit, columns=columns,
        squad_pairs=squad_pairs, max_length=max_length, batch_size=batch_size, window=window, device=device,
        devices=devices, dtype=dtype, num_windows=num_windows, sentences=sentences, limit=limit, backend=backend,
        workers=workers, threads=threads, engine=engine, ray_address=ray_address, out=out, resume=resume,
        overwrite=overwrite, checkpoint_every=checkpoint_every, per_sample=per_sample, quiet=quiet, weighting=weighting,
        max_logit=max_logit)
    preflight_extract(opts)  # refusals that need no model come before torch is imported
    from ..jobs.extract_job import Interrupted, run_extract_job

    try:
        run_extract_job(opts, echo=echo_for())
    except Interrupted as exc:
        if exc.saved_after is None:
            click.echo("\ninterrupted before the first batch finished; nothing saved.", err=True)
        else:
            again = command_line(add=("--resume",), drop=("--overwrite",)) or f"attnkit extract ... -o {out} --resume"
            click.echo(f"\ninterrupted after {exc.saved_after} segments; checkpoint saved. Continue with: {again}",
                       err=True)
        sys.exit(128 + exc.signum)  # the shell's status for the signal: 130 after Ctrl-C, 143 after SIGTERM
