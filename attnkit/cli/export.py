"""`attnkit export RUN`: a run's per-head features as one table, CSV or Parquet."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import AttnkitError
from ..run.outputs import TABLE_FORMATS
from .options import OutputPath, cli_errors, echo_for, run_argument


def _format_of(out: Path | None, fmt: str | None) -> str:
    if fmt:
        return fmt
    if out is not None and out.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    return "csv"


@click.command("export")
@run_argument()
@click.option("--format", "fmt", type=click.Choice(TABLE_FORMATS), default=None,
              help="csv or parquet [default: from the -o suffix (.parquet/.pq), else csv].")
@click.option("-o", "--out", "out", type=OutputPath(dir_okay=False, allow_dash=True, path_type=Path), default=None,
              help="Output file; '-' writes CSV to stdout [default: RUN/features.csv or RUN/features.parquet].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("-q", "--quiet", is_flag=True, help="Do not print where the table was written.")
@cli_errors
def export_cmd(run, fmt, out, overwrite, quiet):
    """Write the features of RUN as a table: one row per head.

    \b
    Columns, in order:
      layer, head          0-based layer and head of the row
      kind, kind_layer     only for an encoder-decoder's run: the layer's kind
                           (encoder, decoder, cross) and its layer within that
                           kind (docs/seq2seq.md)
      <feature>            corpus mean of each feature, one column per feature in
                           the order of RUN/features.npz `names` (cls, sep, comma,
                           period, self, win_0..win_N-1, prev, next, entropy, max,
                           intra, inter, cls_entropy)
      <feature>_std        then the standard deviation over samples of each feature,
                           in the same order
      max_logit            last, only when RUN was extracted with --max-logit: each
                           head's max logit over the corpus
    A head removed by pruning has no features: its cells are empty (NaN).
    """
    from ..run.files import FEATURES_FILE, META_FILE
    from ..run.head_features import HeadFeatures, features_table
    from ..run.locking import output_file
    from ..run.outputs import check_output_place, write_table
    from ..run.overwrite import claim_outputs

    fmt = _format_of(out if out is not None and str(out) != "-" else None, fmt)
    to_stdout = out is not None and str(out) == "-"
    if to_stdout and fmt != "csv":
        raise AttnkitError("only CSV can be written to stdout (-o -); give a file for Parquet")
    feats = HeadFeatures.load(run)
    if to_stdout:
        click.echo(features_table(feats).to_csv(index=False), nl=False)
        return
    out = out if out is not None else run / f"features.{fmt}"
    inputs = [("the run's features", run / FEATURES_FILE), ("the run's meta.json", run / META_FILE)]
    check_output_place(out, inputs)  # before the overwrite check: an input is never offered for replacing
    claim = claim_outputs([out], overwrite)
    df = features_table(feats)  # pandas: only once the output has passed its checks
    with output_file(out, "attnkit export", inputs=inputs):  # locked when it writes into a run directory
        write_table(df, out, fmt)
    if not quiet:
        n_feats = len(feats.names)
        removed = (f"; {feats.n_removed} head(s) removed by pruning have empty (NaN) cells" if feats.n_removed
                   else "")
        click.echo(f"wrote {out} ({len(df)} rows, one per head × {df.shape[1]} columns: layer, head, "
                   + ("kind, kind_layer, " if feats.layer_kinds is not None else "")
                   + f"{n_feats} feature means and their {n_feats} stds"
                   + (", max_logit" if feats.max_logit is not None else "") + f"; {fmt}{removed})")
        if claim.removed_message():
            echo_for()(claim.removed_message(), err=True)


__all__ = ["export_cmd"]
