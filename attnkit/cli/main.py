"""The `attnkit` command line: extract, cluster, distances, ablate, report."""
from __future__ import annotations

import logging
from pathlib import Path

import click

from ..corpus import FORMATS
from ..errors import cli_errors


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
    cols = tuple(c.strip() for c in value.split(","))
    if any(not c for c in cols):
        raise click.BadParameter(f"an empty column name in {value!r}")
    if not 1 <= len(cols) <= 2:
        raise click.BadParameter("give one column, or two separated by a comma (e.g. sentence1,sentence2)")
    return cols


@main.command()
@click.argument("corpus", nargs=-1, metavar="[CORPUS]...")
@click.option("--model", "model_path", default=None, metavar="PATH",
              help="Local model directory (transformers format). Default: the embedded MiniLM (6 layers × 12 heads).")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)),
              default="auto", show_default=True,
              help="Corpus format; auto goes by extension (.txt .jsonl .json .tsv .csv .parquet, also .gz/.zst) "
                   "and recognises datasets saved with save_to_disk. Needed for '-' (standard input) unless it is text.")
@click.option("--text-unit", type=click.Choice(["auto", "line", "paragraph"]), default="auto", show_default=True,
              help="Plain text: one segment per line, or per blank-line-separated paragraph (auto: paragraphs if the "
                   "start of the file has blank lines between text).")
@click.option("--columns", default=None, metavar="COL[,COL2]",
              help="TSV/CSV/Parquet/datasets/JSONL: the text column, and optionally the pair column "
                   "(default: guessed, e.g. sentence1,sentence2).")
@click.option("--squad-pairs", is_flag=True, help="SQuAD JSON: measure (question, context) pairs instead of contexts.")
@click.option("--max-length", default=128, show_default=True, type=click.IntRange(min=2),
              help="Tokens per sample; longer segments are truncated (counted, and a warning suggests a length "
                   "when many are).")
@click.option("--batch-size", default=None, type=click.IntRange(min=1), help="Samples per batch [default: 16 CPU, 64 GPU].")
@click.option("--window", default=4096, show_default=True, type=click.IntRange(min=1),
              help="Segments read ahead and sorted by length together: memory stays bounded by one window, padding "
                   "stays low. Part of the plan: resume with the same value.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N [default: cuda if available].")
@click.option("--devices", default=None, metavar="LIST",
              help="One model replica per device: 'all' (every GPU), or a list such as cuda:0,cuda:1 (cpu,cpu runs "
                   "two CPU replicas).")
@click.option("--workers", default=None, type=click.IntRange(min=0),
              help="Tokenisation processes running ahead of the model (0: tokenise between forwards) "
                   "[default: with GPUs the CPU cores − 1, at most 8; on the CPU one per 4 cores].")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True)
@click.option("--num-windows", default=16, show_default=True, type=click.IntRange(min=1),
              help="Distance windows of the distance feature (Guan et al.).")
@click.option("--sentences", is_flag=True, help="Also split segments into sentences after . ! ? (for intra/inter).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Measure only the first N segments.")
@click.option("--backend", type=click.Choice(["auto", "fused", "reference"]), default="auto", show_default=True,
              help="fused: the compiled op; reference: pure PyTorch; auto: fused when built.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: this machine's devices; ray: a Ray Data pipeline over a Ray cluster (pip install "
                   "'attnkit[distributed]'), resumable by shards.")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="Ray cluster to join (e.g. auto, or ray://head:10001) [default: start a local one].")
@click.option("-o", "--out", "out", default="attnkit-run", show_default=True, type=click.Path(path_type=Path),
              help="Run directory to write.")
@click.option("--resume", is_flag=True, help="Continue the interrupted run in --out from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace a finished run in --out (only once the new one finishes).")
@click.option("--checkpoint-every", default=20, show_default=True, type=click.IntRange(min=1),
              help="Write a checkpoint every N batches (also every 2 minutes, and always on interruption).")
@click.option("--per-sample", is_flag=True,
              help="Also keep every sample's features: OUT/per_sample.npy (float16, samples × layers × heads × "
                   "features, input order; memory-mapped) for `attnkit patterns`.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def extract(corpus, model_path, fmt, text_unit, columns, squad_pairs, max_length, batch_size, window, device,
            devices, workers, dtype, num_windows, sentences, limit, backend, engine, ray_address, out, resume,
            overwrite, checkpoint_every, per_sample, quiet):
    """Measure per-head attention features over CORPUS (default: a small built-in English corpus).

    CORPUS is any number of files, directories (searched recursively for corpus files), shell globs, or '-'
    for standard input; files may be gzip or zstd compressed. Segments are streamed: memory stays bounded
    whatever the corpus size.

    Writes OUT/features.npz (arrays mean, std: layers × heads × features; names) and OUT/meta.json
    (model, inputs with their formats and content hashes, counts, settings, versions, backend). Interrupted
    runs (Ctrl-C, kill) keep a checkpoint; `--resume` continues them to the same numbers as an
    uninterrupted run.
    """
    from ..engine.extract_job import ExtractOptions, run_extract_job

    run_extract_job(ExtractOptions(
        paths=list(corpus), model_path=model_path, fmt=fmt, text_unit=text_unit, columns=_columns(columns),
        squad_pairs=squad_pairs, max_length=max_length, batch_size=batch_size, window=window, device=device,
        devices=devices, dtype=dtype, num_windows=num_windows, sentences=sentences, limit=limit, backend=backend,
        workers=workers, engine=engine, ray_address=ray_address, out=out, resume=resume, overwrite=overwrite,
        checkpoint_every=checkpoint_every, per_sample=per_sample, quiet=quiet))


def _add_commands() -> None:
    from .ablate import ablate
    from .analysis import COMMANDS
    from .compare_models import COMMANDS as COMPARE_COMMANDS
    from .patterns import COMMANDS as PATTERN_COMMANDS
    from .export import export_cmd
    from .probe import probe

    for cmd in (*COMMANDS, *PATTERN_COMMANDS, *COMPARE_COMMANDS, ablate, export_cmd, probe):
        main.add_command(cmd)


_add_commands()


if __name__ == "__main__":  # pragma: no cover
    main()
