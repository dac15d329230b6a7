"""tools/gpu_check.sh: every call of the GPU check runs in its CPU form (--dry-run), so a lease never finds a
broken script; each call stands alone and leaves its steps, logs and JSON in its own output folder."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"
CALLS = {
    "build-bench": (["env", "build", "kernels", "ncu"], ["kernels.json"]),
    "tests": (["env", "build", "tests", "sanitize"], []),
    "extract": (["env", "extract512", "extract4096"], ["extract512.json", "extract4096.json"]),
}


def gpu_check(out, *args):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True, env=env,
                          timeout=400)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_call_dry_runs(tmp_path, call):
    steps, files = CALLS[call]
    res = gpu_check(tmp_path, call, "--dry-run")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == steps and all(r[1] == "ok" for r in rows), rows
    for name in files + ["summary.txt"] + [f"{s}.log" for s in steps]:
        assert (tmp_path / name).stat().st_size > 0, name


def test_unknown_call_is_refused(tmp_path):
    res = gpu_check(tmp_path, "everything")
    assert res.returncode == 2 and "unknown call everything" in res.stderr
