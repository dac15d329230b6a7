"""How long the command line takes to answer --help, --version, VERB --help, a usage error and refusals that need no
model (a missing corpus file, `ablate --experiment types` without --clusters, a run directory that is not one),
for two checkouts side by side (interleaved rounds, median). The test of the cause is structural
(tests/test_cli_startup.py: no torch/transformers/sklearn in sys.modules); this measures what a user waits.

    python bench/cli_startup.py --before /work/main --after . --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = (["--help"], ["--version"], ["extract", "--help"], ["extract", "--batch-size", "0"],
         ["extract", "missing.txt", "-o", "out"],
         ["ablate", "default", "--task", "stsb", "--data", ".", "--experiment", "types"],
         ["cluster", "."], ["distances", "."])


def once(checkout: Path, args: list[str], cwd: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", *args], env=env, cwd=cwd, capture_output=True)
    took = time.perf_counter() - start
    if r.returncode not in (0, 1, 2):  # 1: a refusal, 2: click's usage error
        raise SystemExit(f"{checkout}: attnkit {' '.join(args)} failed: {r.stderr.decode()[-300:]}")
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="checkout to compare with")
    p.add_argument("--after", type=Path, required=True, help="checkout measured")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as cwd:  # not a checkout: `python -m` must not find one in the cwd
        for args in CASES:
            times = {"before": [], "after": []}
            for _ in range(a.repeats):
                times["before"].append(once(a.before, args, cwd))
                times["after"].append(once(a.after, args, cwd))
            b, f = statistics.median(times["before"]), statistics.median(times["after"])
            print(f"attnkit {' '.join(args):<28} before {b:6.2f} s   after {f:6.2f} s   {b / f:5.1f}x")


if __name__ == "__main__":
    main()
