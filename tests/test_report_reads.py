"""A run read once (issue 47): `attnkit report RUN` and `attnkit cluster RUN` open each file of the run once; what the
command checked before its work is what the work uses."""
import builtins
from collections import Counter
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from attnkit.analysis import cluster, save_clusters
from attnkit.cli.main import main

from .synthetic import layered_truth, make_features


def counting_opens(monkeypatch, run: Path) -> Counter:
    """Counts, by file name, the opens of files in `run` through `open` and `numpy.load` (the one .npz loader,
    attnkit/run/schemas.py, calls numpy.load)."""
    counts: Counter = Counter()
    real_open, real_load = builtins.open, np.load

    def note(path):
        p = Path(path) if isinstance(path, (str, Path)) else None
        if p is not None and p.parent == run:
            counts[p.name] += 1

    def open_(file, *args, **kwargs):
        if not str(file).endswith(".npz"):  # numpy.load opens the file it loads: counted there
            note(file)
        return real_open(file, *args, **kwargs)

    def load(file, *args, **kwargs):
        note(file)
        return real_load(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
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
