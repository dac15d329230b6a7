"""How torch's OpenMP threads wait between parallel regions: decided once per process, before torch loads, for
every command that runs a model (docs/pipeline.md §4, "How torch's threads wait").

torch's CPU build runs its parallel regions (every matrix product, GELU, layer norm of a forward) on GNU OpenMP,
libgomp. Between two regions a team's threads wait for the next one. libgomp reads how once, when it loads (when
torch is imported): OMP_WAIT_POLICY and GOMP_SPINCOUNT. Its default spins about 300,000 rounds (a few
milliseconds) before a waiting thread sleeps in the kernel; PASSIVE sleeps at once.
  - On free cores a region starts and ends in microseconds while the waits spin; sleeping waits pay a wake-up per
    region (GELU of 192×1536: 48 µs spinning, 129-139 µs sleeping), and short inputs run thousands of regions.
  - On an oversubscribed machine (another torch process, a test suite) a spinning thread burns the time slice its
    partner needs to reach the barrier: short inputs became 5-20× slower, ablate and detect-heads 2-4×.
So the regime is chosen from what the machine is doing when the process starts: `configure()` samples the
kernel's count of runnable tasks (/proc/loadavg, an instantaneous figure, unlike the load averages, which lag a run
of a few seconds by tens of seconds) for `SAMPLE_SECONDS`, before torch loads (this process then runs one thread
and no tokeniser), and
  - when other work is runnable beside this process (on average `BUSY_OTHERS` tasks or more), threads sleep at once
    (OMP_WAIT_POLICY=PASSIVE): measured beside another 2-thread torch process, short inputs ran 10-27× faster
    than with libgomp's spinning, and ablate and detect-heads 2-4× (docs/pipeline.md §4);
  - otherwise they spin a bounded `SPINCOUNT` rounds (about 0.1-0.3 ms, far longer than the gaps between the
    regions of one forward), then sleep: a machine that becomes busy during the run costs less than with
    libgomp's 300,000 rounds.
The command line calls it for every command (before any imports torch); a script may call it before its first
`import torch`. A value the user set wins. In a process that has already loaded torch (a notebook) nothing can
change any more, and the library runs in that process's regime. The regime changes no number: the same
operations run on the same threads.

This module imports nothing heavy (the command line calls it before torch is imported).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

SPINCOUNT = 10000  # rounds a waiting thread spins on a quiet machine before it sleeps (libgomp: 300,000)
BUSY_OTHERS = 0.5  # other runnable tasks, on average over the samples, from which the machine counts as busy
SAMPLE_SECONDS = 0.05
SAMPLES = 10
VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def runnable_others(samples: int = SAMPLES, seconds: float = SAMPLE_SECONDS) -> float | None:
    """Tasks runnable on the machine besides the calling thread, averaged over `samples` readings of
    /proc/loadavg's running count spread over `seconds`; None where the kernel does not say (not Linux)."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(seconds / samples)
    return sum(counts) / len(counts)


def wait_regime(environ=None) -> str:
    """How this process's OpenMP threads wait, as recorded in meta.json: the variables that decide it, or
    libgomp's default."""
    environ = os.environ if environ is None else environ
    set_ = [f"{k}={environ[k]}" for k in VARIABLES if environ.get(k)]
    return ", ".join(set_) if set_ else "libgomp default (GOMP_SPINCOUNT=300000)"


def configure(environ=None, modules=None, others: Callable[[], float | None] = runnable_others) -> str:
    """Choose how torch's threads wait, before torch is imported: OMP_WAIT_POLICY=PASSIVE when `others()` (other
    runnable tasks) is at least `BUSY_OTHERS`, else GOMP_SPINCOUNT=`SPINCOUNT`; nothing when the user set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT (theirs wins) or torch is already loaded (libgomp has read its variables
    and the process keeps its regime). Returns `wait_regime()` of the process."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "torch" in modules:
        return wait_regime(environ) + " (torch was already loaded)"
    if not any(environ.get(k) for k in VARIABLES):
        busy = others()
        if busy is not None and busy >= BUSY_OTHERS:
            environ["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            environ["GOMP_SPINCOUNT"] = str(SPINCOUNT)
    return wait_regime(environ)


__all__ = ["BUSY_OTHERS", "SPINCOUNT", "available_cores", "configure", "runnable_others", "wait_regime"]
