"""The command line's rough edges a new researcher hit (issue 35, item 4): Ctrl-C during start-up, the public
names of `attnkit`, ..."""
import os
import subprocess
import sys
from pathlib import Path

import attnkit

ROOT = Path(__file__).resolve().parent.parent

# Ctrl-C at the moment the command imports torch (the seconds of start-up), without racing a signal: the import
# itself raises KeyboardInterrupt, as Python does when SIGINT arrives during it
CTRL_C_AT_IMPORT = """
import sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
from attnkit.cli.main import main
main(sys.argv[1:], prog_name="attnkit")
"""


def test_ctrl_c_during_start_up_exits_130_like_ctrl_c_mid_run(tmp_path):
    corpus, out = tmp_path / "c.txt", tmp_path / "run"
    corpus.write_text("A line of text.\n")
    r = subprocess.run([sys.executable, "-c", CTRL_C_AT_IMPORT, "extract", str(corpus), "-o", str(out), "-q"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 130, r.stderr  # the shell's status for SIGINT; click alone says "Aborted!" and exits 1
    assert r.stderr.strip() == "interrupted."
    assert not out.exists()  # nothing was written


def test_dir_of_attnkit_is_its_api():
    names = dir(attnkit)
    assert names == sorted({*attnkit.__all__, "__version__", "register_attention"})
    assert not {"sys", "importlib", "attnkit_version"} & set(names)
    for name in names:
        assert getattr(attnkit, name) is not None


def test_features_are_never_negative_whatever_a_backend_rounds(monkeypatch):
    """A backend whose rounding leaves an empty bucket at -2e-11 (as the fused kernels did: win_15 =
    -1.96e-11): the features recorded from it, and their means, are clamped at 0."""
    import numpy as np

    from attnkit.attention import run as run_step

    real = run_step.attention

    def rounding_backend(*args, **kwargs):
        out, feats = real(*args, **kwargs)
        if feats is not None and feats.numel():
            feats = feats - 2e-11  # every empty bucket (0) becomes slightly negative
        return out, feats

    monkeypatch.setattr(run_step, "attention", rounding_backend)
    model = attnkit.load_model()
    feats = attnkit.extract(["A short text.", "Another one here."], model, backend="reference", progress=False)
    win_15 = feats.feature("win_15")
    assert np.all(feats.mean >= 0) and np.all(win_15 == 0)  # two short texts: nothing 15/16 of a row away


def test_progress_on_a_file_is_a_line_now_and_then_not_carriage_return_frames():
    """tqdm drawing 1000 steps over 100 (fake) seconds into a file: one line when the bar starts, one per 30 s,
    and the last frame when it ends; no '\\r'."""
    import io

    import pytest
    from tqdm import tqdm

    from attnkit.cli.options import ProgressLines

    now = [0.0]
    log = io.StringIO()
    lines = ProgressLines(log, every=30, clock=lambda: now[0])
    with pytest.raises(TypeError):
        lines.write(b"")  # a text stream, as the one it wraps: click probes with bytes
    lines.write("attnkit extract: 1 file\n")
    with tqdm(total=1000, file=lines, mininterval=0, miniters=1, unit="seg") as bar:
        for _ in range(1000):
            now[0] += 0.1
            bar.update(1)
    lines.write("measured 1000 samples\n")
    text = log.getvalue()
    assert "\r" not in text
    out = text.splitlines()
    assert out[0] == "attnkit extract: 1 file" and out[-1] == "measured 1000 samples"
    bars = out[1:-1]
    assert 3 <= len(bars) <= 5, bars  # start, about every 30 s of 100, end
    assert bars[-1].startswith("100%") and "1000/1000" in bars[-1]


def test_extract_into_a_pipe_writes_lines_not_carriage_return_frames(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"Line number {i} of the corpus.\n" for i in range(40)))
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "extract", str(corpus), "-o", str(tmp_path / "run"),
                        "--max-length", "16", "--backend", "reference", "--batch-size", "4"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "b'" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("attnkit extract: ") and lines[1].startswith("model bert (6 layers × 12 heads)")
    bars = [x for x in lines if x.startswith("extract:")]
    assert 1 <= len(bars) <= 3 and "40/40" in bars[-1], lines  # the bar's start and its last frame, as lines


def test_attention_maps_without_a_model_warns_when_another_model_was_loaded():
    """docs/analysis.md §8: no model means the embedded MiniLM; when the model last loaded in the session is
    another one, the call says so (a notebook that loaded SmolLM2 would otherwise get MiniLM's maps silently)."""
    import warnings

    import pytest

    from tests.synthetic import tiny_bert

    attnkit.load_model()  # the embedded MiniLM last: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attnkit.attention_maps("A cat.").weights.shape[:2] == (6, 12)
    model, tok = tiny_bert()
    attnkit.instrument(model, tok)
    with pytest.warns(UserWarning, match=r"attnkit\.attention_maps: no model given, so the embedded MiniLM, "
                                         r"although BertModel was loaded in this session") as caught:
        maps = attnkit.attention_maps("A cat.")
    assert maps.weights.shape[:2] == (6, 12)  # still MiniLM's maps, as documented
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(UserWarning, match=r"attnkit\.extract: no model given"):
        attnkit.instrument(model, tok)
        attnkit.extract(["A cat."], progress=False)
    with warnings.catch_warnings():  # the model given: nothing to say
        warnings.simplefilter("error")
        attnkit.attention_maps("A cat.", (model, tok), max_length=16)


def test_report_says_when_it_writes_clusters_json(tmp_path):
    from click.testing import CliRunner

    from attnkit.cli.main import main
    from tests.synthetic import layered_truth, make_features

    run = tmp_path / "run"
    make_features(layered_truth(2, 4)).save(run)
    r = CliRunner().invoke(main, ["report", str(run), "-k", "3", "--examples", "0", "--no-svg", "-q"])
    assert r.exit_code == 0, r.output
    assert (run / "clusters.json").is_file()
    said = [line for line in r.stdout.splitlines() if "clusters.json" in line]
    assert said == [f"wrote {run / 'clusters.json'} (the run had no head types: clustered now with k = 3, method "
                    "kmeans, seed 0; `attnkit cluster` chooses others)"], r.stdout


def test_ablate_help_names_smollm2():
    from click.testing import CliRunner

    from attnkit.cli.main import main

    r = CliRunner().invoke(main, ["ablate", "--help"], terminal_width=200)
    assert r.exit_code == 0
    assert "`smollm2` for the embedded decoder SmolLM2-135M-Instruct" in " ".join(r.output.split())
