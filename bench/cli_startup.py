"""How long the command line takes to answer --help, --version, VERB --help, a usage error and refusals that need no
model (a missing corpus file, an output directory under a file, `ablate --experiment types` without --clusters, a run
directory that is not one, ablate data with a wrong column, a run with NaN heads not recorded as removed, detect-heads
without a model or over earlier results), for two checkouts side by side (interleaved rounds, median). The test of the
cause is structural (tests/test_cli_startup.py: no torch/transformers/sklearn in sys.modules); this measures what a
user waits.

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
         ["extract", "missing.txt", "-o", "out"], ["extract", "cols.tsv", "-o", "cols.tsv/sub"],
         ["ablate", "default", "--task", "stsb", "--data", ".", "--experiment", "types"],
         ["cluster", "."], ["distances", "."],
         ["ablate", "default", "--task", "stsb", "--data", "cols.tsv", "--experiment", "heads"],
         ["ablate", "default", "--task", "stsb", "--data", "pairs.tsv", "--experiment", "patching"],
         ["report", "damaged"], ["detect-heads", "nomodel", "-o", "out"], ["detect-heads", "smollm2", "-o", "held"])
FILES = {"cols.tsv": "s1\ts2\tscore\na b\tc d\t1.0\na c\tb d\t2.0\n",  # no sentence1/sentence2 columns
         "pairs.tsv": "clean\tcorrupted\nthe cat\tthe dog\na b\tc d\n",  # patching pairs without `reference`
         "held/detected_heads.csv": "layer,head\n"}  # results of an earlier detect-heads
DAMAGED = ("import numpy as np\nfrom tests.synthetic import layered_truth, make_features\n"
           "f = make_features(layered_truth(2, 4)); f.mean[1, 2] = np.nan; f.save('damaged')")  # NaN, not removed


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
        for name, text in FILES.items():
            (Path(cwd) / name).parent.mkdir(exist_ok=True)
            (Path(cwd) / name).write_text(text)
        subprocess.run([sys.executable, "-c", DAMAGED], cwd=cwd, check=True,
                       env={**os.environ, "PYTHONPATH": str(a.after.resolve())})
        for args in CASES:
            times = {"before": [], "after": []}
            for _ in range(a.repeats):
                times["before"].append(once(a.before, args, cwd))
                times["after"].append(once(a.after, args, cwd))
            b, f = statistics.median(times["before"]), statistics.median(times["after"])
            print(f"attnkit {' '.join(args):<70} before {b:6.2f} s   after {f:6.2f} s   {b / f:5.1f}x")


if __name__ == "__main__":
    main()
