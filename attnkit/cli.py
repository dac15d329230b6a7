"""The `attnkit` command line: extract, cluster, distances, ablate, report."""
from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import click

from .errors import AttnkitError, cli_errors


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="attnkit")
def main():
    """Measure what the attention heads of transformer encoders do, over whole corpora.

    \b
    Typical session:
      attnkit extract corpus.txt -o run      per-head features (features.npz, meta.json)
      attnkit cluster run                    head types (clusters.json)
      attnkit report run                     figures and report.html
      attnkit ablate default --task stsb --data dev.tsv --experiment heads

    Models are local directories (no hub downloads); the default is the embedded MiniLM.
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover - cosmetic only
        pass


def _columns(value):
    if value is None:
        return None
    cols = tuple(c.strip() for c in value.split(",") if c.strip())
    if not 1 <= len(cols) <= 2:
        raise click.BadParameter("give one column, or two separated by a comma (e.g. sentence1,sentence2)")
    return cols


@main.command()
@click.argument("corpus", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", "model_path", default=None, metavar="PATH",
              help="Local model directory (transformers format). Default: the embedded MiniLM (6 layers × 12 heads).")
@click.option("--format", "fmt", type=click.Choice(["auto", "text", "jsonl", "squad", "tsv"]), default="auto",
              show_default=True, help="Corpus format; auto goes by extension (.txt .jsonl .json .tsv .csv).")
@click.option("--text-unit", type=click.Choice(["auto", "line", "paragraph"]), default="auto", show_default=True,
              help="Plain text: one segment per line, or per blank-line-separated paragraph (auto: paragraphs if the "
                   "file has blank lines between text).")
@click.option("--columns", default=None, metavar="COL[,COL2]",
              help="TSV/CSV: the text column, and optionally the pair column (default: guessed, e.g. sentence1,sentence2).")
@click.option("--squad-pairs", is_flag=True, help="SQuAD JSON: measure (question, context) pairs instead of contexts.")
@click.option("--max-length", default=128, show_default=True, type=click.IntRange(min=2),
              help="Tokens per sample; longer segments are truncated (and counted).")
@click.option("--batch-size", default=None, type=click.IntRange(min=1), help="Samples per batch [default: 16 CPU, 64 GPU].")
@click.option("--device", default=None, help="cpu, cuda or cuda:N [default: cuda if available].")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True)
@click.option("--num-windows", default=16, show_default=True, type=click.IntRange(min=1),
              help="Distance windows of the distance feature (Guan et al.).")
@click.option("--sentences", is_flag=True, help="Also split segments into sentences after . ! ? (for intra/inter).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Measure only the first N segments.")
@click.option("--backend", type=click.Choice(["auto", "fused", "reference"]), default="auto", show_default=True,
              help="fused: the compiled op; reference: pure PyTorch; auto: fused when built.")
@click.option("-o", "--out", "out", default="attnkit-run", show_default=True, type=click.Path(path_type=Path),
              help="Run directory to write.")
@click.option("--resume", is_flag=True, help="Continue the interrupted run in --out from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace a finished run in --out (only once the new one finishes).")
@click.option("--checkpoint-every", default=20, show_default=True, type=click.IntRange(min=1),
              help="Write a checkpoint every N batches (and always on interruption).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def extract(corpus, model_path, fmt, text_unit, columns, squad_pairs, max_length, batch_size, device, dtype,
            num_windows, sentences, limit, backend, out, resume, overwrite, checkpoint_every, quiet):
    """Measure per-head attention features over CORPUS (default: a small built-in English corpus).

    Writes OUT/features.npz (arrays mean, std: layers × heads × features; names) and OUT/meta.json
    (model, corpus, counts, settings, versions, backend). Interrupted runs (Ctrl-C, kill) keep a
    checkpoint; `--resume` continues them to the same numbers as an uninterrupted run.
    """
    from .corpus import default_corpus_path, read_corpus
    from .extraction import check_max_length, run_extraction
    from .models import default_model_path, load_model
    from .ops import backend_label
    from .rundir import RunDir, corpus_fingerprint

    if resume and overwrite:
        raise AttnkitError("--resume and --overwrite contradict each other: choose one")
    run = RunDir(out)
    if not resume:
        run.check_new(overwrite)
    corpus_path = corpus or default_corpus_path()
    segments = read_corpus(corpus_path, fmt, text_unit=text_unit, squad_pairs=squad_pairs,
                           columns=_columns(columns), limit=limit)
    model_name = str(model_path) if model_path else default_model_path()
    settings = {
        "model": str(Path(model_name).resolve()) if Path(model_name).exists() else model_name,
        "corpus": str(Path(corpus_path).resolve()),
        "format": fmt,
        "text_unit": text_unit,
        "squad_pairs": squad_pairs,
        "columns": ",".join(_columns(columns)) if columns else None,
        "corpus_sha256": corpus_fingerprint(segments),
        "n_segments": len(segments),
        "max_length": max_length,
        "batch_size": batch_size,
        "dtype": dtype,
        "num_windows": num_windows,
        "split_sentences": sentences,
    }
    acc, start, n_truncated = None, 0, 0
    if resume:
        if not run.has_checkpoint() and run.is_finished():
            RunDir.check_settings(run.finished_settings(), settings)
            click.echo(f"{out} is already complete; nothing to resume.")
            return
        acc, start, n_truncated = run.load_checkpoint(settings)
    model, tokenizer = load_model(model_path, device=device, dtype=dtype)
    check_max_length(model, max_length)
    dev = next(model.parameters()).device
    label = backend_label(backend, dev)
    if not quiet:
        click.echo(f"attnkit extract: {len(segments)} segments from {corpus_path}, model {model.config.model_type} "
                   f"({len(model._attnkit_modules)} layers × {model.config.num_attention_heads} heads), backend {label}, "
                   f"device {dev}" + (f", resuming at segment {start}" if resume else ""), err=True)

    progress = {"acc": acc, "next": start, "trunc": n_truncated, "batches": 0}

    def on_batch(acc_, next_index, trunc):
        progress.update(acc=acc_, next=next_index, trunc=n_truncated + trunc)
        progress["batches"] += 1
        if progress["batches"] % checkpoint_every == 0 and next_index < len(segments):
            run.save_checkpoint(acc_, next_index, n_truncated + trunc, settings)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    t0 = time.perf_counter()
    try:
        acc, trunc = run_extraction(
            model, tokenizer, segments, max_length=max_length, batch_size=batch_size, num_windows=num_windows,
            split_sentences=sentences, backend=backend, accumulator=acc, start=start, on_batch=on_batch,
            progress=not quiet,
        )
    except KeyboardInterrupt:
        if progress["acc"] is not None and progress["next"] > start:
            run.save_checkpoint(progress["acc"], progress["next"], progress["trunc"], settings)
            click.echo(f"\ninterrupted after {progress['next']} of {len(segments)} segments; checkpoint saved. "
                       f"Continue with: attnkit extract ... -o {out} --resume", err=True)
        else:
            click.echo("\ninterrupted before the first batch finished; nothing saved.", err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    elapsed = time.perf_counter() - t0
    n_truncated += trunc
    meta = {
        "status": "complete",
        "model": settings["model"],
        "model_type": model.config.model_type,
        "corpus": settings["corpus"],
        **{k: settings[k] for k in ("format", "text_unit", "squad_pairs", "columns", "n_segments", "max_length",
                                    "num_windows")},
        "n_truncated": n_truncated,
        "backend": label,
        "device": str(dev),
        "settings": settings,
        "feature_names": acc.names,
        "versions": _versions(),
        "elapsed_s": round(elapsed, 3),
    }
    features = acc.result(meta)
    run.finish(features)
    tok_s = (acc.n_tokens / elapsed) if elapsed > 0 and not resume else None
    click.echo(f"measured {features.n_samples} samples, {features.n_tokens} tokens "
               f"({n_truncated} truncated to {max_length} tokens) in {elapsed:.1f}s"
               + (f" ({tok_s:,.0f} tokens/s)" if tok_s else "") + f"; wrote {out}/features.npz, meta.json")


def _add_commands() -> None:
    from .ablation.commands import ablate
    from .analysis.commands import COMMANDS
    from .export import export_cmd

    for cmd in (*COMMANDS, ablate, export_cmd):
        main.add_command(cmd)


_add_commands()


def _versions() -> dict:
    import numpy
    import torch
    import transformers

    from . import __version__

    return {"attnkit": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__, "python": sys.version.split()[0]}


if __name__ == "__main__":  # pragma: no cover
    main()
