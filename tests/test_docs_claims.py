"""What README.md, docs/ and the help texts state about the code, held against the code: the command list,
the default CUDA kernel, the dtype and arrays of the files `extract` writes, and the table `export` writes and
describes. Each of these had drifted (a user found float16 in a help text for a float32 file, v2 as the README's
default kernel where the code defaults to v1, a command missing from the list, a column count off by two)."""
import csv
import re
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from attnkit.cli.main import COMMANDS, main

from .synthetic import layered_truth, make_features

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def help_of(command: str) -> str:
    res = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())  # click wraps: compare with single spaces


def test_the_readme_lists_every_command_once_and_no_other():
    block = README.split("## Command line", 1)[1].split("```", 2)[1]
    listed = re.findall(r"^attnkit ([a-z-]+)", block, flags=re.M)
    assert sorted(listed) == sorted(c.name for c in COMMANDS), listed


def test_the_documented_default_cuda_kernel_is_the_code_s():
    source = (ROOT / "csrc" / "cuda" / "cuda_api.cpp").read_text()
    unset = re.search(r"if \(env == nullptr[^;]*?return KernelChoice::kV(\d)", source)
    assert unset, "cuda_api.cpp: the kernel chosen when ATTNKIT_CUDA_KERNEL is unset"
    default = f"v{unset.group(1)}"
    other = "v2" if default == "v1" else "v1"
    assert f"`{default}` is the default" in README and f"default `{default}`" in README
    assert f"`{other}` is the default" not in README and f"default `{other}`" not in README
    cuda = (ROOT / "docs" / "cuda.md").read_text()
    assert f"The default is `{default}`" in cuda and f"`{default}` (default)" in cuda


def test_the_per_sample_dtype_and_the_arrays_that_help_and_docs_state_are_those_written(tmp_path):
    from attnkit.run.per_sample import PerSampleWriter

    feats = make_features(layered_truth(2, 3))
    feats.save(tmp_path)
    w = PerSampleWriter(tmp_path, 2, 3, feats.names)
    w.add(np.arange(2), np.ones((2, 2, 3, len(feats.names)), dtype=np.float64))
    w.close()
    dtype = str(np.load(tmp_path / "per_sample.npy").dtype)
    assert dtype == "float32"
    from attnkit.cli.extract import extract

    option = next(p for p in extract.params if p.name == "per_sample").help
    assert f"OUT/per_sample.npy ({dtype}," in option and "float16" not in option
    text = help_of("extract")
    files = (ROOT / "docs" / "files.md").read_text()
    row = next(line for line in files.splitlines() if line.startswith("| `per_sample.npy`"))
    assert f"features, {dtype}," in row
    assert f"`RUN/per_sample.npy`, {dtype}" in README
    # "Writes OUT/features.npz (arrays mean, std: layers × heads × features; names; with --max-logit, max_logit: ...)"
    assert "OUT/features.npz (arrays mean, std: layers × heads × features; names; with --max-logit, max_logit:" in text
    with np.load(tmp_path / "features.npz") as z:
        assert sorted(z.files) == ["mean", "names", "std"] and z["mean"].shape == (2, 3, len(feats.names))


def test_export_states_the_table_it_writes(tmp_path):
    feats = make_features(layered_truth(3, 4))
    feats.save(tmp_path / "run")
    res = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "-o", str(tmp_path / "t.csv")])
    assert res.exit_code == 0, res.output
    with open(tmp_path / "t.csv") as f:
        rows = list(csv.reader(f))
    said = re.search(r"\((\d+) rows, one per head × (\d+) columns: layer, head, (\d+) feature means and their "
                     r"(\d+) stds; csv\)", res.output)
    assert said, res.output
    n_rows, n_cols, n_means, n_stds = (int(x) for x in said.groups())
    assert (n_rows, n_cols) == (len(rows) - 1, len(rows[0])) == (12, 2 + 2 * len(feats.names))
    assert n_means == n_stds == len(feats.names)
    assert rows[0][:2] == ["layer", "head"] and rows[0][2:2 + n_means] == feats.names
    assert rows[0][2 + n_means:] == [f"{n}_std" for n in feats.names]
