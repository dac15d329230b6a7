"""`attnkit export`: a run's per-head features as one table, CSV or Parquet."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import click

from ..errors import AttnkitError, cli_errors

FORMATS = ("csv", "parquet")


def features_table(features):
    """pandas DataFrame with one row per head: `layer`, `head`, then one column per feature mean (named
    as the feature) and one `<name>_std` per feature standard deviation (over samples), in the order
    of `features.names`."""
    return features.to_pandas().reset_index()


def write_table(df, path: Path, fmt: str) -> None:
    """Write `df` to `path` as CSV or Parquet (pyarrow), atomically."""
    from ..run.head_features import atomic_write

    if fmt == "csv":
        data = df.to_csv(index=False).encode("utf-8")
    else:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise AttnkitError("Parquet needs pyarrow (pip install pyarrow); or use --format csv") from None
        buf = io.BytesIO()
        df.to_parquet(buf, index=False, engine="pyarrow")
        data = buf.getvalue()
    atomic_write(path, lambda f: f.write(data))


def _format_of(out: Path | None, fmt: str | None) -> str:
    if fmt:
        return fmt
    if out is not None and out.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    return "csv"


@click.command("export")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="csv or parquet [default: from the -o suffix (.parquet/.pq), else csv].")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path), default=None,
              help="Output file; '-' writes CSV to stdout [default: RUN/features.csv or RUN/features.parquet].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("-q", "--quiet", is_flag=True, help="Do not print where the table was written.")
@cli_errors
def export_cmd(run, fmt, out, overwrite, quiet):
    """Write the features of RUN as a table: one row per head.

    \b
    Columns, in order:
      layer, head          0-based layer and head of the row
      <feature>            corpus mean of each feature, one column per feature in
                           the order of RUN/features.npz `names` (cls, sep, comma,
                           period, self, win_0..win_N-1, prev, next, entropy, max,
                           intra, inter, cls_entropy)
      <feature>_std        then the standard deviation over samples of each feature,
                           in the same order
    """
    from ..run.head_features import FEATURES_FILE, HeadFeatures
    from ..run.locking import run_lock
    from ..run.outputs import ensure_writable_dir

    fmt = _format_of(out if out is not None and str(out) != "-" else None, fmt)
    to_stdout = out is not None and str(out) == "-"
    if to_stdout and fmt != "csv":
        raise AttnkitError("only CSV can be written to stdout (-o -); give a file for Parquet")
    features = HeadFeatures.load(run)
    df = features_table(features)
    if to_stdout:
        click.echo(df.to_csv(index=False), nl=False)
        return
    default_out = out is None
    out = out if out is not None else run / f"features.{fmt}"
    if out.exists() and not (overwrite or default_out):
        raise AttnkitError(f"{out} exists: give --overwrite to replace it, or another -o")
    ensure_writable_dir(out.parent, "output directory")
    into_run = (out.parent / FEATURES_FILE).is_file()  # writing into a run directory: lock it
    with run_lock(out.parent, "attnkit export") if into_run else contextlib.nullcontext():
        write_table(df, out, fmt)
    if not quiet:
        click.echo(f"wrote {out} ({len(df)} heads × {df.shape[1] - 2} columns, {fmt})")


__all__ = ["export_cmd", "features_table", "write_table", "FORMATS"]
