"""attnkit/cli/export.py: `attnkit export` writes a run's features as CSV or Parquet, or CSV to stdout, and
refuses outputs it cannot write."""
import numpy as np
import pandas as pd
from click.testing import CliRunner

from attnkit.cli.export import export_cmd

FEATS = dict(L=2, H=4, seed=3)  # the synthetic run of the `feats` and `run` fixtures (conftest.py)


def invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


def test_export_csv_and_parquet_columns_and_values(run, feats, tmp_path):
    r = invoke(export_cmd, [run])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(run / "features.csv")
    names = feats.names
    assert list(df.columns) == ["layer", "head"] + names + [f"{n}_std" for n in names]
    assert len(df) == 2 * 4
    row = df[(df["layer"] == 1) & (df["head"] == 2)].iloc[0]
    np.testing.assert_allclose(row[names].to_numpy(float), feats.mean[1, 2], rtol=1e-12)
    np.testing.assert_allclose(row[[f"{n}_std" for n in names]].to_numpy(float), feats.std[1, 2], rtol=1e-12)
    r = invoke(export_cmd, [run, "-o", tmp_path / "f.parquet"])
    assert r.exit_code == 0, r.output
    pq = pd.read_parquet(tmp_path / "f.parquet")
    assert list(pq.columns) == list(df.columns)
    np.testing.assert_array_equal(pq.to_numpy(), pd.read_csv(run / "features.csv").to_numpy())
    r = invoke(export_cmd, [run, "--format", "parquet", "-q"])
    assert r.exit_code == 0 and r.output == "" and (run / "features.parquet").is_file()


def test_export_to_stdout_and_bad_outputs(run, tmp_path):
    r = invoke(export_cmd, [run, "-o", "-"])
    assert r.exit_code == 0 and r.output.splitlines()[0].startswith("layer,head,cls,")
    assert len(r.output.splitlines()) == 1 + 8
    r = invoke(export_cmd, [run, "-o", "-", "--format", "parquet"])
    assert r.exit_code == 1 and "only CSV" in r.output
    (tmp_path / "f").write_text("x")
    r = invoke(export_cmd, [run, "-o", tmp_path / "f" / "x.csv"])
    assert r.exit_code == 1 and "exists and is not a directory" in r.output
    r = invoke(export_cmd, [run, "-o", tmp_path / "f" / "sub" / "x.csv"])
    assert r.exit_code == 1 and "is a file, not a directory" in r.output
    (run / "meta.json").write_text('{"n_samples": "abc"}')
    r = invoke(export_cmd, [run, "-o", "-"])
    assert r.exit_code == 1 and "meta.json: field n_samples: expected an integer" in r.output




def test_export_writes_max_logit_last_when_the_run_holds_it(feats, tmp_path):
    import dataclasses

    m = np.arange(8, dtype=np.float64).reshape(2, 4) * 1.5 - 3.0
    m[0, 1] = np.nan  # a removed head's: an empty cell
    dataclasses.replace(feats, max_logit=m).save(tmp_path / "run")
    r = invoke(export_cmd, [tmp_path / "run", "-o", tmp_path / "t.csv"])
    assert r.exit_code == 0 and "stds, max_logit;" in r.output, r.output
    df = pd.read_csv(tmp_path / "t.csv")
    assert list(df.columns) == ["layer", "head"] + feats.names + [f"{n}_std" for n in feats.names] + ["max_logit"]
    np.testing.assert_array_equal(df["max_logit"].to_numpy().reshape(2, 4), m)
    r = invoke(export_cmd, [tmp_path / "run", "-o", tmp_path / "t.parquet"])
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(pd.read_parquet(tmp_path / "t.parquet")["max_logit"].to_numpy().reshape(2, 4), m)
