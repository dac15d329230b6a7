"""attnkit/cli/analysis.py: the conventions and output handling of cluster, report, compare and distances: -k,
-q, progress on stderr, outputs checked before the work, one-line errors, the run lock, warnings on stability."""
import errno
import html
import json
import os

import numpy as np
from click.testing import CliRunner

from attnkit.analysis import HeadDistances
from attnkit.cli.analysis import cluster_cmd, compare_cmd, distances_cmd, report_cmd
from attnkit.cli.export import export_cmd  # a writer into a locked run, too
from attnkit.cli.main import main

from .synthetic import layered_truth, make_features

FEATS = dict(L=2, H=4, seed=3)  # the synthetic run of the `feats` and `run` fixtures (conftest.py)


def invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


def test_k_short_and_long_option(run):
    for opt, k in (("-k", "3"), ("--k", "2")):  # the second replaces the first's clusters.json: --overwrite
        r = invoke(cluster_cmd, [run, opt, k, "--stability", "2", "-q"] + (["--overwrite"] if k == "2" else []))
        assert r.exit_code == 0, r.output
        assert json.loads((run / "clusters.json").read_text())["settings"]["k"] == int(k)


def test_every_command_takes_quiet():
    for name, cmd in main.commands.items():
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert {"-q", "--quiet"} <= opts, name


def test_cluster_sweep_shows_progress_on_stderr_unless_quiet(run):
    r = invoke(cluster_cmd, [run, "--sweep", "--stability", "1"])
    assert r.exit_code == 0, r.output
    assert "cluster sweep, k = 2..4" in r.stderr and "attnkit cluster:" in r.stderr
    assert "cluster sweep" not in r.stdout and "stability" in r.stdout
    # quiet: no progress; what --overwrite removed is still said (one line), as data is gone
    r = invoke(cluster_cmd, [run, "--sweep", "--stability", "1", "-q", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [f"--overwrite removed {run / 'clusters.json'}"]


def test_report_shows_progress_per_figure(run):
    assert invoke(cluster_cmd, [run, "-k", "3", "--stability", "1", "-q"]).exit_code == 0  # (no k sweep to wait for)
    r = invoke(report_cmd, [run, "--no-svg"])
    assert r.exit_code == 0, r.output
    assert "report:" in r.stderr and "figure" in r.stderr
    assert (run / "report.html").is_file()
    r = invoke(report_cmd, [run, "--no-svg", "-q", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("--overwrite removed ")


def test_report_refuses_incomplete_clusters_before_drawing(run):
    assert invoke(cluster_cmd, [run, "-k", "3", "--stability", "1", "-q"]).exit_code == 0
    data = json.loads((run / "clusters.json").read_text())
    del data["clusters"][0]["centroid"]
    (run / "clusters.json").write_text(json.dumps(data))
    r = invoke(report_cmd, [run, "-q"])
    assert r.exit_code == 1
    assert r.output.strip().endswith("clusters.json: field clusters[0]: missing 'centroid'")
    assert not (run / "figures").exists() and not (run / "report.html").exists()


def test_report_does_not_show_distances_of_another_shape(run):
    """Another model's distances.npz is listed under "Results not shown here" with the reason (issue 34 §2)."""
    HeadDistances(np.zeros((4, 4)), 10, 2, 2).save(run)
    assert invoke(cluster_cmd, [run, "-k", "3", "--stability", "1", "-q"]).exit_code == 0  # (no k sweep to wait for)
    r = invoke(report_cmd, [run, "-q", "--examples", "0"])
    assert r.exit_code == 0, r.output
    elsewhere = (run / "report.html").read_text().split('<section id="elsewhere">')[1].split("</section>")[0]
    assert "made with a model of 2 layers × 2 heads, the run's has 2 × 4" in html.unescape(elsewhere)


def test_report_refuses_non_finite_features(tmp_path, feats):
    from attnkit.run.head_features import HeadFeatures

    bad = HeadFeatures(feats.mean.copy(), feats.std, feats.names, 10, 100)
    bad.mean[1, 3, 2] = np.nan
    bad.save(tmp_path / "run")
    r = invoke(report_cmd, [tmp_path / "run", "-q"])
    assert r.exit_code == 1
    assert "features.npz holds NaN or infinite means for 1 head(s) (L1H3)" in r.output
    assert not (tmp_path / "run" / "report.html").exists()


def test_report_figures_path_that_is_a_file(run):
    (run / "figures").write_text("not a directory")
    r = invoke(report_cmd, [run, "-q"])
    assert r.exit_code == 1 and "figures directory" in r.output and "is not a directory" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_report_full_disk_is_one_line_and_leaves_no_temp_file(run, monkeypatch):
    real = os.replace

    def full(src, dst):
        if str(dst).endswith("report.html"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst)

    assert invoke(cluster_cmd, [run, "-k", "3", "--stability", "1", "-q"]).exit_code == 0  # (no k sweep to wait for)
    monkeypatch.setattr(os, "replace", full)
    r = invoke(report_cmd, [run, "--no-svg", "-q"])
    assert r.exit_code == 1 and r.output.strip() == f"Error: could not write {run / 'report.html'}: No space left on device"
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]


def test_compare_json_under_a_file_fails_before_the_work(run, tmp_path):
    assert invoke(cluster_cmd, [run, "-k", "3", "--stability", "1", "-q"]).exit_code == 0
    (tmp_path / "f").write_text("x")
    r = invoke(compare_cmd, [run, run, "--json", tmp_path / "f" / "cmp.json"])
    assert r.exit_code == 1 and "heads changed type" not in r.output
    assert r.output.strip() == f"Error: output directory {str(tmp_path / 'f')!r} exists and is not a directory"
    r = invoke(compare_cmd, [run, run, "--json", tmp_path / "out" / "cmp.json", "-q"])
    assert r.exit_code == 0 and json.loads((tmp_path / "out" / "cmp.json").read_text())["n_changed"] == 0


def test_compare_checks_clusters_against_the_run(run, tmp_path, feats):
    assert invoke(cluster_cmd, [run, "-k", "3", "--stability", "1", "-q"]).exit_code == 0
    other = tmp_path / "other"
    make_features(layered_truth(L=3, H=4, seed=1)).save(other)
    (other / "clusters.json").write_text((run / "clusters.json").read_text())  # 2 × 4 clusters in a 3 × 4 run
    r = invoke(compare_cmd, [run, other])
    assert r.exit_code == 1 and "covers 2 layers × 4 heads, but the run has 3 × 4" in r.output


def test_distances_without_a_corpus_is_one_line(run):
    r = invoke(distances_cmd, [run, "-q"])
    assert r.exit_code == 1 and "names no readable corpus" in r.output


def test_writers_into_a_locked_run_are_refused(run, tmp_path, lock_held):
    assert invoke(cluster_cmd, [run, "-k", "3", "--stability", "1", "-q"]).exit_code == 0
    before = (run / "clusters.json").read_text()
    with lock_held(run, "attnkit extract") as pid:
        want = f"Error: {run} is in use by `attnkit extract` (pid {pid}); wait for it to finish or choose another directory"
        for cmd, args in ((cluster_cmd, [run, "-q"]), (report_cmd, [run, "-q"]), (distances_cmd, [run, "-q"]),
                          (compare_cmd, [run, run, "--json", run / "cmp.json"]), (export_cmd, [run])):
            r = invoke(cmd, args)
            assert r.exit_code == 1 and r.output.strip().splitlines()[-1] == want, (cmd.name, r.output)
    assert (run / "clusters.json").read_text() == before
    assert not (run / "report.html").exists() and not (run / "cmp.json").exists()
    assert not (run / "features.csv").exists()
    # writing elsewhere needs no lock on the run
    r = invoke(export_cmd, [run, "-o", tmp_path / "x.csv"])
    assert r.exit_code == 0, r.output


def test_cluster_and_compare_commands_warn(tmp_path):
    from attnkit.cli.main import main

    truth = layered_truth(4, 12)
    for name, f in (("good", make_features(truth, noise=0.005)),
                    ("mush", make_features(truth, noise=0.02, structureless=True))):
        f.save(tmp_path / name)
    # Gaussian noise around one profile in the 21 buckets: in class shares (the default) it is one cloud stretched
    # along `dense`, which any half of the heads splits the same way at k = 2 (docs/analysis.md §2); in the buckets
    # it has no reproducible partition at all
    # (3 seeds, not the default 10: every k's mean stays below 0.3 here, far from the 0.8 that would make one stable)
    r = CliRunner().invoke(main, ["cluster", str(tmp_path / "mush"), "--stability", "4", "--seeds", "3", "-q",
                                  "--features", "distance", "-k", "4"])
    assert r.exit_code == 0, r.output
    assert "stability over 3 seeds" in r.output and "warning: stability" in r.output
    data = json.loads((tmp_path / "mush" / "clusters.json").read_text())
    assert data["stability"]["over_seeds"]["n_seeds"] == 3
    # no k is stable: the output leads with that, then the sweep (made without --sweep), what would help, and
    # only then the types; the summary line gives the mean over seeds before seed 0's value
    verdict = data["stability"]["assessment"]
    sweep = data["stability"]["sweep"]
    assert [row["k"] for row in sweep] == list(range(2, 9)) and verdict["stable"] is False
    assert verdict["any_k_stable"] is False and verdict["stable_ks"] == []
    best = max(sweep, key=lambda row: (row["stability_mean"], -row["k"]))
    assert verdict["most_stable_k"] == best["k"] and verdict["most_stable_value"] == best["stability_mean"]
    assert verdict["value"] == data["stability"]["over_seeds"]["mean"] and len(verdict["what_would_help"]) == 3
    out = r.stdout.splitlines()
    assert out[0] == (f"no k from 2 to 8 gives stable head types: stability (mean over seeds) is below 0.8 for every "
                      f"k; the most stable is k = {best['k']} ({best['stability_mean']:.3f})")
    assert out[1] == "stability by k (mean over seeds, min–max):"
    assert out.index("what would help:") < next(i for i, x in enumerate(out) if x.startswith("  0: "))
    assert any(x.startswith("  - more text: the features are means over ") for x in out)
    summary = next(x for x in out if "stability over 3 seeds" in x)
    assert summary.index("mean") < summary.index("seed 0:")
    r = CliRunner().invoke(main, ["cluster", str(tmp_path / "good"), "--stability", "4", "-q", "-k", "4"])
    assert r.exit_code == 0 and "warning" not in r.output
    good = json.loads((tmp_path / "good" / "clusters.json").read_text())["stability"]
    assert good["assessment"]["stable"] is True and good["sweep"] is None  # stable at the k given: no sweep unless asked
    assert r.stdout.splitlines()[0].startswith("4 layers × 12 heads, 3 features, kmeans, k = 4: stability over")
    r = CliRunner().invoke(main, ["compare", str(tmp_path / "good"), str(tmp_path / "mush")])
    assert r.exit_code == 0 and "unreliable" in r.output
