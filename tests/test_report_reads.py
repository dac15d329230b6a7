"""A run read once (issue 47): every command that reads a run directory (report, cluster, distances, export,
patterns, compare, ablate --clusters) opens each of its files (features.npz, meta.json, clusters.json,
per_sample.npy) at most once; what the command checked before its work is what the work uses."""
import builtins
import io
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis import cluster, save_clusters
from attnkit.cli.main import main

from .conftest import write_clusters_json
from .synthetic import WORDS, layered_truth, make_features, rich_run, tiny_bert


def counting_opens(monkeypatch, run: Path) -> Counter:
    """Counts, by file name, the opens of files in `run` through `open`, `io.open` (Path.open, Path.read_text) and
    `numpy.load` (the one .npz loader, attnkit/run/schemas.py, and the per-sample reader, attnkit/run/per_sample.py,
    call numpy.load; a .npy or .npz file is counted there, not at the opens numpy makes inside)."""
    counts: Counter = Counter()
    real_open, real_load = builtins.open, np.load

    def note(path):
        p = Path(path) if isinstance(path, (str, Path)) else None
        if p is not None and p.parent == run:
            counts[p.name] += 1

    def open_(file, *args, **kwargs):
        if not str(file).endswith((".npz", ".npy")):  # numpy.load opens the file it loads: counted there
            note(file)
        return real_open(file, *args, **kwargs)

    def load(file, *args, **kwargs):
        note(file)
        return real_load(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)  # Path.open and Path.read_text call io.open
    monkeypatch.setattr(np, "load", load)
    return counts


def test_report_opens_features_and_clusters_once(tmp_path, monkeypatch):
    run = tmp_path / "run"
    feats = make_features(layered_truth(L=3, H=6, seed=2))
    feats.save(run)
    save_clusters(run, cluster(feats, k=3, n_stability=2), feats)
    counts = counting_opens(monkeypatch, run)
    r = CliRunner().invoke(main, ["report", str(run), "--no-svg", "--examples", "0", "-q"])
    assert r.exit_code == 0, r.output
    assert (run / "report.html").is_file()
    assert counts["features.npz"] == 1 and counts["clusters.json"] == 1, counts
    assert counts["meta.json"] == 1, counts


def test_cluster_opens_features_once(tmp_path, monkeypatch):
    run = tmp_path / "run"
    make_features(layered_truth(L=3, H=6, seed=2)).save(run)
    counts = counting_opens(monkeypatch, run)
    r = CliRunner().invoke(main, ["cluster", str(run), "-k", "3", "--stability", "2", "--seeds", "1", "-q"])
    assert r.exit_code == 0, r.output
    assert counts["features.npz"] == 1 and counts["meta.json"] == 1, counts


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    """(a tiny BERT's model directory, a run of it over a small corpus recorded in its meta.json, that corpus)."""
    base = tmp_path_factory.mktemp("model-run")
    model, tok = tiny_bert(n_layers=2, n_heads=2)
    model.save_pretrained(base / "model")
    tok.save_pretrained(base / "model")
    corpus = base / "corpus.txt"
    corpus.write_text("\n".join(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6)) + "." for i in range(8)))
    r = CliRunner().invoke(main, ["extract", str(corpus), "--model", str(base / "model"), "-o", str(base / "run"),
                                  "--max-length", "16", "-q"])
    assert r.exit_code == 0, r.output
    return base / "model", base / "run", corpus


def copy_of(run: Path, tmp_path) -> Path:
    """A copy of `run` for a command that writes into it."""
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_distances_opens_features_and_meta_once(model_run, tmp_path, monkeypatch):
    _, source, _ = model_run
    run = copy_of(source, tmp_path)
    counts = counting_opens(monkeypatch, run)
    r = CliRunner().invoke(main, ["distances", str(run), "-q"])
    assert r.exit_code == 0, r.output
    assert (run / "distances.npz").is_file()
    assert counts["features.npz"] == 1 and counts["meta.json"] == 1, counts


@pytest.mark.parametrize("out", ["file", "-"])
def test_export_opens_features_and_meta_once(tmp_path, monkeypatch, out):
    run = tmp_path / "run"
    make_features(layered_truth(L=2, H=3, seed=1)).save(run)
    counts = counting_opens(monkeypatch, run)
    r = CliRunner().invoke(main, ["export", str(run), "-q"] + (["-o", "-"] if out == "-" else []))
    assert r.exit_code == 0, r.output
    assert (run / "features.csv").is_file() or r.output.startswith("layer,head,")
    assert counts["features.npz"] == 1 and counts["meta.json"] == 1, counts


@pytest.mark.parametrize("listing", [False, True])
def test_patterns_opens_the_run_and_its_per_sample_file_once(tmp_path, monkeypatch, listing):
    run = tmp_path / "run"
    rich_run(run)
    counts = counting_opens(monkeypatch, run)
    args = ["--list", "L0H0:vertical"] if listing else ["--overwrite", "--no-svg", "-q"]
    r = CliRunner().invoke(main, ["patterns", str(run), *args])
    assert r.exit_code == 0, r.output
    assert ("L0H0 is vertical on" in r.output) if listing else (run / "patterns.json").is_file()
    assert counts["features.npz"] <= 1 and counts["meta.json"] == 1 and counts["per_sample.npy"] == 1, counts


def test_patterns_still_names_a_per_sample_file_of_another_run(tmp_path):
    """The per_sample.npy the run attached is the one classified; one that does not fit the run is still refused
    with its reason (read again for it)."""
    run = tmp_path / "run"
    rich_run(run)
    other = tmp_path / "other"
    feats = make_features(layered_truth(L=3, H=4, seed=3))
    feats.n_samples = 31
    feats.save(other)
    for name in ("features.npz", "meta.json"):
        shutil.copy(other / name, run / name)
    r = CliRunner().invoke(main, ["patterns", str(run), "--overwrite", "--no-svg", "-q"])
    assert r.exit_code == 1 and "it is not this run's per-sample file" in r.output, r.output


def test_compare_opens_each_file_of_both_runs_once(tmp_path, monkeypatch):
    """Two weightings of one run, both clustered: the weighting comparison and the type comparison read each run's
    features.npz, meta.json and clusters.json once."""
    feats = make_features(layered_truth(L=3, H=6, seed=2))
    runs = []
    for name, weighting in (("a", "attention"), ("b", "norm")):
        f = replace(feats, meta={**feats.meta, "weighting": weighting})
        f.save(tmp_path / name)
        save_clusters(tmp_path / name, cluster(f, k=3, n_stability=2), f)
        runs.append(tmp_path / name)
    counts = [counting_opens(monkeypatch, run) for run in runs]
    r = CliRunner().invoke(main, ["compare", str(runs[0]), str(runs[1])])
    assert r.exit_code == 0, r.output
    assert "weightings:" in r.output and "heads changed type" in r.output, r.output
    for c in counts:
        assert c["features.npz"] == 1 and c["meta.json"] == 1 and c["clusters.json"] == 1, counts


def test_ablate_types_reads_the_clusters_once(model_run, tmp_path, monkeypatch):
    model, _, _ = model_run
    run = write_clusters_json(tmp_path / "run", [["diagonal", "vertical"], ["vertical", "diagonal"]])
    rng = np.random.default_rng(0)
    data = tmp_path / "stsb.tsv"
    data.write_text("index\tgenre\tsentence1\tsentence2\tscore\n" + "".join(
        f"{i}\tx\t{' '.join(rng.choice(WORDS, 4))}.\t{' '.join(rng.choice(WORDS, 4))}.\t{i % 5}\n" for i in range(6)))
    counts = counting_opens(monkeypatch, run)
    r = CliRunner().invoke(main, ["ablate", str(model), "--task", "stsb", "--data", str(data), "--experiment", "types",
                                  "--clusters", str(run), "-o", str(tmp_path / "out"), "-q"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "types.json").is_file()
    assert counts["clusters.json"] == 1, counts
