"""Benchmark: how torch's OpenMP threads wait (attnkit/engine/openmp.py, docs/pipeline.md §4), for every command
that runs a model, on this machine as it is and beside another 2-thread torch process.

    python bench/regimes.py [--cases extract,ablate,detect] [--regimes auto,default,passive,30000,10000]
                            [--neighbour both|no|yes] [--repeats 3] [--n 1000]

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch loads, so every (case, regime) runs in a fresh
process, interleaved (the order rotates every round); the figures are medians of wall time and of CPU time (the
process and its children). Regimes:
  auto      what attnkit chooses (no variable set: the command line, or the extract child, calls
            attnkit.engine.openmp.configure before torch loads)
  default   libgomp's own: spin about 300,000 rounds before sleeping (GOMP_SPINCOUNT=300000)
  passive   sleep at once (OMP_WAIT_POLICY=PASSIVE)
  N         spin N rounds, then sleep (GOMP_SPINCOUNT=N)
Cases:
  extract   attnkit.extract on --n STS-B dev sentences (--stsb; about 15 tokens each), MiniLM, batches of 16:
            tokenisation inside the timing, model loading outside (the child reports its own figure)
  ablate    attnkit ablate smollm2 --task lm --data <built-in corpus> --experiment layers --limit 16 (whole command)
  detect    attnkit detect-heads smollm2 --sequences 4 --length 50 (whole command)
--neighbour yes runs each round beside `python -c <a 2-thread torch loop>` started for it (the second condition
of issue 38: another torch process that keeps two threads busy). The CPU model and the load average are printed
with every round.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGIMES = ("auto", "default", "passive", "30000", "10000")
STSB = ROOT.parent / "shared" / "data" / "stsb" / "dev.tsv"  # GLUE STS-B dev beside the repository
CONDITIONS = {"no": ("quiet",), "yes": ("neighbour",), "both": ("quiet", "neighbour")}

EXTRACT_CHILD = """
import csv, sys, time
sys.path.insert(0, sys.argv[3])
import attnkit
from attnkit.engine import openmp
regime = openmp.configure()
import torch
with open(sys.argv[1], newline="") as f:
    texts = [r["sentence1"] for r in csv.DictReader(f, delimiter="\\t", quoting=csv.QUOTE_NONE)][:int(sys.argv[2])]
model, tok = attnkit.load_model(device="cpu")
attnkit.extract(texts[:32], (model, tok), batch_size=16)  # warm-up
t, c = time.perf_counter(), time.process_time()
attnkit.extract(texts, (model, tok), batch_size=16)
print("RESULT", time.perf_counter() - t, time.process_time() - c, regime)
"""

NEIGHBOUR = """
import torch
torch.set_num_threads(2)
a = torch.randn(256, 256)
while True:
    for _ in range(50):
        a = torch.tanh(a @ a) * 0.5
"""


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def regime_env(regime: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if regime == "default":
        env["GOMP_SPINCOUNT"] = "300000"
    elif regime == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif regime != "auto":
        env["GOMP_SPINCOUNT"] = str(int(regime))
    return env


def run_case(case: str, regime: str, tmp: Path, n: int = 1000, ablate_limit: int = 16,
             stsb: str | Path = STSB) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one case in one regime, in a fresh process."""
    env = regime_env(regime)
    if case == "extract":
        cmd = [sys.executable, "-c", EXTRACT_CHILD, str(stsb), str(n), str(ROOT)]
    elif case == "ablate":
        cmd = [sys.executable, "-m", "attnkit.cli", "ablate", "smollm2", "--task", "lm", "--data",
               str(ROOT / "attnkit" / "data" / "default_corpus.txt"), "--experiment", "layers", "--limit",
               str(ablate_limit), "-o", str(tmp / "ablate"), "--overwrite", "-q"]
    elif case == "detect":
        cmd = [sys.executable, "-m", "attnkit.cli", "detect-heads", "smollm2", "--sequences", "4", "--length", "50",
               "-o", str(tmp / "detect"), "--overwrite", "-q"]
    else:
        raise SystemExit(f"unknown case {case!r}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(f"{case} ({regime}) failed:\n{out.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if case == "extract":
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1].split()
        return float(line[1]), float(line[2])
    return wall, cpu


def measure(cases, regimes=REGIMES, neighbour: str = "both", repeats: int = 3, n: int = 1000, ablate_limit: int = 16,
            stsb: str | Path = STSB) -> dict:
    """Every (condition, case, regime) of the module docstring, `repeats` interleaved rounds, printing every run and
    the table of medians. Returns {condition: {case: {regime: {"wall", "cpu", "over_best"}}}} (medians; over_best:
    the regime's wall time over the best regime's of that condition and case)."""
    cases, regimes = list(cases), list(regimes)
    stsb = Path(stsb).resolve()  # the runs start in a temporary directory: a path relative to here would not be found
    conditions = CONDITIONS[neighbour]
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, {load()}", flush=True)
    scratch = tempfile.TemporaryDirectory(prefix="attnkit-regimes-")  # removed on return or error
    tmp = Path(scratch.name)
    times: dict = {}
    for r in range(repeats):
        for cond in conditions:
            nb = None
            if cond == "neighbour":
                nb = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env=regime_env("default"))
                time.sleep(2)
            try:
                for case in cases:
                    order = regimes[r % len(regimes):] + regimes[:r % len(regimes)]
                    for regime in order:
                        wall, cpu = run_case(case, regime, tmp, n, ablate_limit, stsb)
                        times.setdefault((cond, case, regime), []).append((wall, cpu))
                        print(f"  round {r + 1} {cond:9s} {case:8s} {regime:8s} {wall:7.2f} s wall {cpu:7.2f} s CPU "
                              f"({load()})", flush=True)
            finally:
                if nb is not None:
                    nb.kill()
                    nb.wait()
    out: dict = {}
    print(f"medians of {repeats} ({cpu_model()}, {load()}):")
    print("| condition | case | " + " | ".join(regimes) + " |")
    print("|---|---|" + "---|" * len(regimes))
    for cond in conditions:
        for case in cases:
            med = {g: (statistics.median(w for w, _ in times[(cond, case, g)]),
                       statistics.median(c for _, c in times[(cond, case, g)])) for g in regimes}
            best = min(w for w, _ in med.values())
            out.setdefault(cond, {})[case] = {g: {"wall": w, "cpu": c, "over_best": w / best}
                                              for g, (w, c) in med.items()}
            print(f"| {cond} | {case} | " + " | ".join(f"{w:.2f} s ({w / best:.2f}×; CPU {c:.2f} s)"
                                                      for w, c in med.values()) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="extract,ablate,detect")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--neighbour", choices=sorted(CONDITIONS), default="both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n", type=int, default=1000, help="extract: STS-B sentences")
    ap.add_argument("--ablate-limit", type=int, default=16)
    ap.add_argument("--stsb", default=str(STSB))
    args = ap.parse_args()
    measure(args.cases.split(","), args.regimes.split(","), args.neighbour, args.repeats, args.n, args.ablate_limit,
            args.stsb)


if __name__ == "__main__":
    main()
