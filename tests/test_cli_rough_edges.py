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
