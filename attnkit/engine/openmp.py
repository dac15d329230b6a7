"""How torch's OpenMP threads wait between parallel regions while the local engine runs a CPU forward
(docs/pipeline.md §4, "Which thread runs a CPU forward").

torch's CPU build runs its parallel regions on GNU OpenMP (libgomp). Between regions, a team's threads wait for
the next one: they spin for a while (about 300,000 rounds) before they sleep in the kernel, unless the process
has more OpenMP threads than CPUs: then they spin only 100 rounds ("throttled"). Every thread that starts a
parallel region owns a team that lives as long as the thread, so the regime is the process's, not the thread's:
  - one team (only the calling thread runs torch): waits spin. On free cores a region starts and ends in
    microseconds; on an oversubscribed machine a spinning thread burns the time slice its partner needs, and
    short inputs (many small regions) became 5-20× slower;
  - two teams (a second thread ran torch, e.g. a device thread after model loading): waits sleep, and every
    region pays a wake-up: on free cores short inputs were 1.5× slower, on a busy machine this is the fast regime.
The engine therefore runs a CPU forward on the calling thread (so a run is in the regime the caller's own torch
code is in), and picks short waits by holding `ShortWaits` only while other tasks are waiting for the CPUs
(`cpu_oversubscribed`). The regime changes no number: the same operations run with the same threads.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

PRESSURE_FILE = "/proc/pressure/cpu"
BUSY_PRESSURE = 20.0  # percent of the last 10 s in which some runnable task waited for a CPU
RECHECK_SECONDS = 2.0


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_oversubscribed(pressure_file: str = PRESSURE_FILE) -> bool:
    """Whether other tasks wait for the CPUs: the kernel's CPU pressure ("some avg10", the share of the last 10 s
    in which a runnable task waited) above BUSY_PRESSURE percent; where the kernel reports no pressure, the
    1-minute load average above the CPUs plus one (this run's own team counts up to the CPUs)."""
    try:
        with open(pressure_file) as f:
            some = f.readline().split()
        return float(some[1].split("=")[1]) > BUSY_PRESSURE
    except (OSError, IndexError, ValueError):
        pass
    try:
        return os.getloadavg()[0] > available_cores() + 1
    except OSError:
        return False


class ShortWaits:
    """While held, a parked thread owns an OpenMP team of `threads` (it ran one parallel region and waits):
    the process then has more OpenMP threads than CPUs, and libgomp's waits spin briefly and sleep. Released, the
    thread ends and its team with it (libgomp counts its threads down again)."""

    NAME = "attnkit-short-waits"

    def __init__(self, threads: int):
        self.threads = max(2, threads)  # a team of one runs no parallel region
        self._release = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._thread is not None

    def hold(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        self._release.clear()

        def park():
            torch.set_num_threads(self.threads)  # this thread's team: as large as the forward's
            torch.ones(1 << 20).add_(1)  # one parallel region (ATen splits 1M elements over the threads)
            ready.set()
            self._release.wait()

        self._thread = threading.Thread(target=park, name=self.NAME, daemon=True)
        self._thread.start()
        ready.wait()

    def release(self) -> None:
        if self._thread is None:
            return
        self._release.set()
        self._thread.join()
        self._thread = None


class WaitPolicy:
    """For a run of CPU forwards on the calling thread: before each batch (`update`), at most every `every`
    seconds, ask `oversubscribed()` and hold or release `ShortWaits` to match. `close()` releases."""

    def __init__(self, oversubscribed: Callable[[], bool] | None = None, every: float | None = None,
                 threads: int | None = None):
        self.oversubscribed = oversubscribed or cpu_oversubscribed
        self.every = RECHECK_SECONDS if every is None else every
        self.waits = ShortWaits(torch.get_num_threads() if threads is None else threads)
        self._checked = None

    def update(self) -> None:
        now = time.monotonic()
        if self._checked is not None and now - self._checked < self.every:
            return
        self._checked = now
        if self.oversubscribed():
            self.waits.hold()
        else:
            self.waits.release()

    def close(self) -> None:
        self.waits.release()


__all__ = ["BUSY_PRESSURE", "RECHECK_SECONDS", "ShortWaits", "WaitPolicy", "available_cores", "cpu_oversubscribed"]
