"""Whether the features depend on torch's intra-op thread count, with and without MKL's strict reproducibility
mode (MKL_CBWR=AUTO,STRICT), on the embedded MiniLM over the built-in corpus. Each setting runs in a fresh
process (MKL reads MKL_CBWR when it loads); the figure is the largest difference of any per-sample feature,
relative to the largest value.

    python bench/threads.py [--limit 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

CHILD = """
import sys, numpy as np, torch
torch.set_num_threads(int(sys.argv[1]))
import attnkit
from attnkit.corpus import open_corpus
texts = list(open_corpus(None, limit=int(sys.argv[2])))
f = attnkit.extract(texts, per_sample=True)
np.save(sys.argv[3], f.per_sample)
print(torch.get_num_threads(), torch.backends.mkl.is_available())
"""


def run(threads: int, strict: bool, limit: int, out: str) -> np.ndarray:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if strict:
        env["MKL_CBWR"] = "AUTO,STRICT"
    r = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(limit), out], env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return np.load(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=64)
    a = p.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for strict in (False, True):
            x1 = run(1, strict, a.limit, f"{d}/a.npy")
            x2 = run(2, strict, a.limit, f"{d}/b.npy")
            res["MKL_CBWR=AUTO,STRICT" if strict else "default"] = float(np.abs(x1 - x2).max() / np.abs(x1).max())
    print(json.dumps({"threads": "1 vs 2", "limit": a.limit, "max relative difference": res}))


if __name__ == "__main__":
    main()
