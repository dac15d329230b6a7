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

    from attnkit import hf_attention

    real = hf_attention.attention

    def rounding_backend(*args, **kwargs):
        out, feats = real(*args, **kwargs)
        if feats is not None and feats.numel():
            feats = feats - 2e-11  # every empty bucket (0) becomes slightly negative
        return out, feats

    monkeypatch.setattr(hf_attention, "attention", rounding_backend)
    model = attnkit.load_model()
    feats = attnkit.extract(["A short text.", "Another one here."], model, backend="reference", progress=False)
    win_15 = feats.feature("win_15")
    assert np.all(feats.mean >= 0) and np.all(win_15 == 0)  # two short texts: nothing 15/16 of a row away
