"""Progress bars: a total (so an ETA) wherever the work can be known, the right label, units that read right."""
import io
import os
import threading

from attnkit.corpus import open_corpus
from attnkit.engine import progress
from attnkit.engine.progress import segment_bar

from .synthetic import layered_truth, make_features, tiny_bert


def _lines(tmp_path, n):
    p = tmp_path / "c.txt"
    p.write_text("".join(f"line {i} here.\n" for i in range(n)))
    return p


def test_a_corpus_of_files_gets_its_total_counted_in_the_background(tmp_path):
    corpus = open_corpus([_lines(tmp_path, 57)])
    bar = segment_bar("extract", corpus)
    bar.counter.join()
    assert bar.total == 57
    bar.close()
    limited = open_corpus([_lines(tmp_path, 57)], limit=20)
    bar = segment_bar("extract", limited)
    bar.counter.join()
    assert bar.total == 20
    bar.close()
    bar = segment_bar("extract", ["a", "b", "c"])  # a list knows its length: no thread
    assert bar.total == 3 and bar.counter is None
    bar.close()


def test_standard_input_is_not_read_twice(tmp_path):
    corpus = open_corpus(["-"], stdin=io.BytesIO(b"one\ntwo\n"))
    bar = segment_bar("extract", corpus)
    assert bar.counter is None and bar.total is None
    bar.close()
    assert list(corpus) == ["one", "two"]  # the one pass is left to the run


def test_a_pipe_is_not_read_twice(tmp_path):
    """A named pipe is a stream like standard input: counting it would leave nothing for the run."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    corpus = open_corpus([fifo])
    bar = segment_bar("extract", corpus)
    assert bar.counter is None and bar.total is None
    bar.close()

    def feed():
        with open(fifo, "wb") as f:  # blocks until the pass opens the pipe
            f.write(b"one\ntwo\n")

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    assert list(corpus) == ["one", "two"]
    writer.join(timeout=30)


def no_background_count(monkeypatch):
    """The background count never arrives (as when the run outpaces it): a deterministic stand-in for the race."""
    monkeypatch.setattr(progress, "count_in_background", lambda segments, bar: None)


def test_a_finished_run_ends_on_its_count_even_before_the_background_count(monkeypatch, tmp_path):
    no_background_count(monkeypatch)
    out = io.StringIO()
    bar = segment_bar("extract", open_corpus([_lines(tmp_path, 7)]), file=out)
    for _ in range(7):
        bar.update(1)
    assert bar.total is None
    bar.finish()
    assert bar.total == 7 and "7/7" in out.getvalue() and "100%" in out.getvalue()


def test_an_interrupted_run_does_not_claim_a_total(monkeypatch, tmp_path):
    no_background_count(monkeypatch)
    out = io.StringIO()
    bar = segment_bar("extract", open_corpus([_lines(tmp_path, 7)]), file=out)
    bar.update(3)
    bar.close()  # what an exception or Ctrl-C does: no finish
    assert bar.total is None and "3seg" in out.getvalue() and "/" not in out.getvalue().split("[")[0]


def test_distances_are_labelled_distances_with_a_total(tmp_path, capsys, monkeypatch):
    from attnkit.engine.distances import collect_distances

    no_background_count(monkeypatch)  # the total must come from the finished run, not from winning a race
    model, tok = tiny_bert()
    collect_distances(open_corpus([_lines(tmp_path, 9)]), (model, tok), max_length=16, progress=True)
    err = capsys.readouterr().err
    assert "distances: 100%" in err and "9/9" in err and "extract" not in err


def test_the_cluster_sweep_shows_clusterings_not_thousands(capsys):
    from attnkit.analysis.clustering import sweep

    sweep(make_features(layered_truth(L=3, H=6, seed=0)), ks=range(2, 5), n_stability=2, progress=True)
    err = capsys.readouterr().err
    assert "cluster sweep, k = 2..4" in err and "3/3" in err
    assert " clusterings/s" in err or "s/ clusterings" in err  # tqdm writes slow rates as seconds per step
    assert "k/s" not in err


def test_the_report_bar_knows_how_many_figures_it_draws(tmp_path, capsys):
    from attnkit.analysis.report import build_report

    make_features(layered_truth(L=3, H=4, seed=1)).save(tmp_path)
    build_report(tmp_path, svg=False, do_sweep=False, progress=True, k=3)  # (k given: no k sweep before the bar)
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "report: 100%" in err and "5/5" in err


def test_ray_log_lines_are_kept_off_the_terminal(tmp_path):
    """What Ray's C++ core writes to file descriptor 2 goes to a temporary file; attnkit's own messages (sys.stderr)
    stay on the terminal; the file goes when the run ends well and is named when it fails."""
    import subprocess
    import sys

    code = r'''
import os, sys
from attnkit.errors import AttnkitError
from attnkit.engine.ray.session import ray_logs_aside
with ray_logs_aside() as log:
    os.write(2, b"[E core_worker.cc] Actor ... max_restarts > 0\n")
    print("extract (ray): 60seg", file=sys.stderr)
print("kept" if os.path.exists(log) else "removed", file=sys.stderr)
try:
    with ray_logs_aside() as log:
        os.write(2, b"[E raylet] a real problem\n")
        raise AttnkitError("the Ray pipeline failed: a node died")
except AttnkitError as exc:
    print(exc, file=sys.stderr)
    print(open(log).read(), file=sys.stderr)
    os.unlink(log)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = out.stderr.splitlines()
    assert lines[0] == "extract (ray): 60seg" and lines[1] == "removed"
    assert "max_restarts" not in out.stderr
    assert lines[2].startswith("the Ray pipeline failed: a node died (Ray's own messages: ") and lines[2].endswith(".log)")
    assert lines[3] == "[E raylet] a real problem"


def test_the_bar_draws_no_total_less_start_and_one_end(tmp_path):
    """In a log, a bar once left a stray "0seg" line (drawn at its creation, before the background count gave it
    its total) and two 100% lines with different rates (the last update, then closing). Now it is first drawn at
    its first update and at 100% once, when it closes."""
    for n, steps in ((57, [16, 16, 16, 9]), (1, [1])):
        out = io.StringIO()
        bar = segment_bar("extract", open_corpus([_lines(tmp_path, n)]), file=out)
        bar.counter.join()
        assert out.getvalue() == ""  # counted, not drawn: nothing before the first update
        for k in steps:
            bar.update(k)
        bar.close()
        lines = [x for x in out.getvalue().replace("\r", "\n").splitlines() if x.strip()]
        assert lines and all(f"/{n} [" in x for x in lines), lines  # every line shows the total
        assert [x for x in lines if "100%" in x] == [lines[-1]], lines
