"""How torch's OpenMP threads wait between parallel regions: decided once per process, before torch loads, for
every command that runs a model (docs/pipeline.md §4, "How torch's threads wait").

torch's CPU build runs its parallel regions (every matrix product, GELU, layer norm of a forward) on GNU OpenMP,
libgomp. Between two regions a team's threads wait for the next one. libgomp reads how once, when it loads (when
torch is imported): OMP_WAIT_POLICY and GOMP_SPINCOUNT. Its default spins about 300,000 rounds (a few
milliseconds) before a waiting thread sleeps in the kernel; PASSIVE sleeps at once.
  - On free cores a region starts and ends in microseconds while the waits spin; sleeping waits pay a wake-up per
    region, and short inputs run thousands of regions.
  - On an oversubscribed machine (another torch process, a test suite) a spinning thread burns the time slice its
    partner needs to reach the barrier, and short inputs, ablate and detect-heads slow down several times
    (docs/pipeline.md §4 has the measurements).
So the regime is chosen from what the machine is doing when the process starts: `configure()` samples the
kernel's count of runnable tasks (/proc/loadavg, an instantaneous figure, unlike the load averages, which lag a run
of a few seconds by tens of seconds; in a limited container, its own cgroup's: below) for `SAMPLE_SECONDS`,
before torch loads (this process then runs one thread and no tokeniser), and
  - when other work is runnable beside this process (on average `BUSY_OTHERS` tasks or more), threads sleep at once
    (OMP_WAIT_POLICY=PASSIVE), which beside another torch process is far faster than libgomp's spinning
    (docs/pipeline.md §4);
  - otherwise they spin a bounded `SPINCOUNT` rounds (far longer than the gaps between the regions of one
    forward, far shorter than libgomp's default), then sleep: a machine that becomes busy during the run costs
    less than with libgomp's 300,000 rounds.
The command line calls it for every command (before any imports torch); a script may call it before its first
`import torch`. A value the user set wins. The variables stay in the environment only until torch has loaded
(attnkit.process.environ_until_torch), so a subprocess started later does not inherit them; ATTNKIT_OPENMP_WAITS=0
keeps attnkit from setting them (docs/process.md). meta.json records what libgomp read
(attnkit.process.openmp_in_effect), not what the environment says after it loaded. In a process that has already
loaded torch (a notebook) nothing can change any more, and the library runs in that process's regime. The regime
changes no number: the same operations run on the same threads.

The cores a process may use (`available_cores`) are those of its CPU affinity (a container's cpuset) and of its
cgroup's CPU quota (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us), whichever is fewer: a container
limited to 2 CPUs' time on a 64-core host runs no faster with 64 threads, only slower. The busy sample reads, in a
process so limited, the runnable threads of its own cgroup (v2 cgroup.threads, v1 tasks): /proc/loadavg counts the
host's, which compete for the host's cores, not for the container's quota (docs/process.md).

This module imports nothing heavy (the command line calls it before torch is imported).
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..process import OPENMP_VARIABLES, environ_until_torch, openmp_in_effect, watch_torch_import

SPINCOUNT = 10000  # rounds a waiting thread spins on a quiet machine before it sleeps (libgomp: 300,000)
BUSY_OTHERS = 0.5  # other runnable tasks, on average over the samples, from which the machine counts as busy
SAMPLE_SECONDS = 0.05
SAMPLES = 10
VARIABLES = OPENMP_VARIABLES
CGROUP = Path("/sys/fs/cgroup")
MAX_THREADS_READ = 2048  # threads of a cgroup read per sample at most (each a /proc/<tid>/stat)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def cgroup_dirs(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> list[Path]:
    """The directories that may hold this process's CPU limits, most specific first: its own cgroup (from
    /proc/self/cgroup: v2's "0::/path", v1's cpu controller), then the mount's root (what a container with a
    cgroup namespace sees as its own)."""
    out = []
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or parts[2] in ("", "/"):
            continue
        if parts[0] == "0" and parts[1] == "":
            out.append(root / parts[2].lstrip("/"))
        elif "cpu" in parts[1].split(","):
            out += [root / parts[1] / parts[2].lstrip("/"), root / "cpu" / parts[2].lstrip("/")]
    return out + [root, root / "cpu", root / "cpu,cpuacct"]


def cpu_quota(dirs: list[Path] | None = None) -> float | None:
    """The CPUs' worth of time the cgroup may use (quota / period), or None where it is not limited: the first of
    `dirs` with cgroup v2's cpu.max ("max 100000": none; "200000 100000": 2.0) or v1's cpu.cfs_quota_us (-1: none)
    and cpu.cfs_period_us."""
    for d in cgroup_dirs() if dirs is None else dirs:
        v2 = _read(d / "cpu.max")
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            if quota == "max":
                return None
            try:
                return int(quota) / int(period or 100000)
            except (ValueError, ZeroDivisionError):
                return None
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            try:
                q, p = int(quota), int(period)
            except ValueError:
                return None
            return q / p if q > 0 and p > 0 else None
    return None


def available_cores(quota: Callable[[], float | None] = cpu_quota) -> int:
    """The CPU cores this process may use: those of its affinity (the cpuset), no more than its cgroup's CPU quota
    (rounded up: a quota of 1.5 CPUs keeps two threads busy part of the time), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    q = quota()
    return max(1, min(cores, math.ceil(q))) if q else max(1, cores)


def cgroup_threads(dirs: list[Path] | None = None) -> list[int] | None:
    """The thread ids of this process's cgroup (v2 cgroup.threads, v1 tasks), from the first of `dirs` (most
    specific first: `cgroup_dirs`) that lists them; None where none does."""
    for d in cgroup_dirs() if dirs is None else dirs:
        text = _read(d / "cgroup.threads") or _read(d / "tasks")
        if text:
            try:
                return [int(t) for t in text.split()]
            except ValueError:
                continue
    return None


def runnable_threads(tids: list[int], proc: Path = Path("/proc")) -> int:
    """How many of the threads `tids` are runnable now (state R in /proc/<tid>/stat; one that has exited counts
    as not)."""
    n = 0
    for tid in tids:
        stat = _read(proc / str(tid) / "stat")
        if stat and stat.rpartition(")")[2].split()[:1] == ["R"]:
            n += 1
    return n


def host_runnable() -> int | None:
    """The kernel's count of runnable tasks on the machine (/proc/loadavg's fourth field), or None where it does not
    say (not Linux)."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def runnable_others(samples: int = SAMPLES, seconds: float = SAMPLE_SECONDS,
                    threads: Callable[[], list[int] | None] | None = None, count=runnable_threads) -> float | None:
    """Tasks runnable besides the calling thread, averaged over `samples` readings spread over `seconds`; None
    where the kernel does not say. Where the process is limited to fewer cores than the host has (`available_cores`:
    a container's cpuset or CPU quota) and its cgroup lists its threads (`threads`, default `cgroup_threads`),
    those of its own cgroup; otherwise the host's run queue (`host_runnable`)."""
    if threads is None:
        threads = cgroup_threads if available_cores() < (os.cpu_count() or 1) else (lambda: None)
    tids = threads()
    if tids and len(tids) > MAX_THREADS_READ:  # a cgroup as big as a host (its root): the host's figure is as good
        tids = None
    counts = []
    for i in range(samples):
        running = count(tids) if tids else host_runnable()
        if running is None:
            return None
        counts.append(running - 1)
        if i + 1 < samples:
            time.sleep(seconds / samples)
    return sum(counts) / len(counts)


def wait_regime(environ=None) -> str:
    """How this process's OpenMP threads wait, as recorded in meta.json: the variables that decided it (those
    libgomp read when torch loaded, attnkit.process.openmp_in_effect; of `environ` when given), or libgomp's
    default."""
    values = openmp_in_effect()[0] if environ is None else {k: environ[k] for k in VARIABLES if environ.get(k)}
    set_ = [f"{k}={v}" for k, v in values.items()]
    return ", ".join(set_) if set_ else "libgomp default (GOMP_SPINCOUNT=300000)"


def configure(environ=None, modules=None, others: Callable[[], float | None] = runnable_others) -> str:
    """Choose how torch's threads wait, before torch is imported: OMP_WAIT_POLICY=PASSIVE when `others()` (other
    runnable tasks) is at least `BUSY_OTHERS`, else GOMP_SPINCOUNT=`SPINCOUNT`; nothing when the user set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT (theirs wins) or torch is already loaded (libgomp has read its variables
    and the process keeps its regime). Returns the regime as `wait_regime` words it.
    `environ` None: the process's environment, which holds the variables only until torch has loaded
    (attnkit.process.environ_until_torch; nothing where ATTNKIT_OPENMP_WAITS=0); a mapping (os.environ itself, a
    test's dict) gets them for good."""
    target = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "torch" in modules:
        return wait_regime(target) + " (torch was already loaded)"
    if not any(target.get(k) for k in VARIABLES):
        busy = others()
        values = {"OMP_WAIT_POLICY": "PASSIVE"} if busy is not None and busy >= BUSY_OTHERS else {
            "GOMP_SPINCOUNT": str(SPINCOUNT)}
        if environ is not None:
            environ.update(values)
            if environ is os.environ:
                watch_torch_import("the OpenMP variables set for good (the caller passed os.environ)")
        elif not environ_until_torch(values):
            return wait_regime(target)  # opted out
        return wait_regime(values)
    return wait_regime(target)


__all__ = ["BUSY_OTHERS", "SPINCOUNT", "available_cores", "cgroup_dirs", "cgroup_threads", "configure", "cpu_quota",
           "host_runnable", "runnable_others", "runnable_threads", "wait_regime"]
