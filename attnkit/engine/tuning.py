"""A pipeline that plans itself (docs/pipeline.md §4, "Workers and threads, chosen by measuring"): on this
machine's CPU, how many tokenisation worker processes and how many torch threads a run uses, chosen from how fast
its first batches tokenise and run forwards, as a user with a stopwatch would.

    first batches: tokenised on the calling thread (timed) ─► forwards with the process's threads (timed), and
                   again with a single thread when tokenising is not negligible ─► `choose` ─► the rest of the run

Each rate is that of the fastest timed batch: a batch the system held up says nothing about the configuration.

The first batches' results are kept when the chosen thread count is the one they ran with; otherwise they are
measured again with the chosen count, so a run's numbers are those of a run with the chosen settings given by hand
(docs/pipeline.md §3). `--workers`/`--threads` given by the user are kept as given (workers at most the cores).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..errors import check_int
from .openmp import available_cores
from .plan import take_forwards

AUTO = "auto"
PROBE_BATCHES = 4  # forwards tokenised and run before choosing (at least 2 planned batches: the first of them
#                   warms up and is not timed; a unit of a grouped plan runs several forwards)
MIN_BATCHES = 8  # a plan of fewer forwards is not worth measuring: workers 0, the process's threads
NEGLIGIBLE = 0.1  # tokenising below this share of a forward's time: more workers or fewer threads cannot help
OVERSUBSCRIBED = 1.1  # the estimate of a configuration with more busy threads than cores is this much worse


@dataclass
class PipelineChoice:
    """What a run uses (`workers`, `threads`), how it was decided (`how`: "measured", "given", "short run") and
    the rates behind it (tokens per second: `tokenise` on one core, `forward` by thread count)."""

    workers: int
    threads: int
    how: str
    cores: int
    tokenise: float | None = None
    forward: dict = field(default_factory=dict)
    note: str = ""

    def line(self) -> str:
        """The one line a run prints at its start."""
        text = (f"pipeline: {self.workers} tokenisation worker(s), {self.threads} torch thread(s) on {self.cores} "
                f"core(s)")
        if self.how == "measured":
            rates = ", ".join(f"{r:,.0f} at {n} thread(s)" for n, r in sorted(self.forward.items()))
            text += f" (measured: tokenising {self.tokenise:,.0f} tok/s per process, forward {rates})"
        else:
            text += f" ({self.how})"
        return text + (f"; {self.note}" if self.note else "")

    def meta(self) -> dict:
        """For meta.json."""
        out = {"workers": self.workers, "threads": self.threads, "how": self.how, "cores": self.cores}
        if self.tokenise is not None:
            out["tokenise_tokens_per_s"] = round(self.tokenise, 1)
            out["forward_tokens_per_s"] = {str(n): round(r, 1) for n, r in sorted(self.forward.items())}
        if self.note:
            out["note"] = self.note
        return out


def check_threads(threads) -> int | str:
    """`threads`: "auto" or an integer ≥ 1."""
    return threads if threads == AUTO else check_int(threads, "threads", minimum=1)


def seconds_per_token(workers: int, threads: int, tokenise: float, forward: dict, cores: int) -> float:
    """The estimated time per token of a run with `workers` and `threads`, from the rates (tokens/s): without
    workers the calling thread tokenises and runs forwards in turn; with workers, the calling thread runs the
    forwards and tokenises in the time they leave it (attnkit/engine/local.py's TokenizerPool `help_here`), so
    the run takes the longer of the forwards, the tokenising shared by the workers and the caller, and the CPU
    time of both spread over the cores. More busy threads than cores costs `OVERSUBSCRIBED`."""
    f = forward[threads]
    if workers == 0:
        return 1 / tokenise + 1 / f
    t = max(1 / f, (1 / tokenise + 1 / f) / (workers + 1), (1 / tokenise + threads / f) / cores)
    return t * (OVERSUBSCRIBED if workers + threads > cores else 1.0)


def forward_rates(measured: dict, cores: int) -> dict:
    """Forward rates for 1..cores threads from the measured ones (linear between 1 thread and the most measured;
    only the measured count when only one was measured)."""
    if len(measured) < 2:
        return dict(measured)
    lo, hi = min(measured), max(measured)
    out = dict(measured)
    for n in range(lo + 1, hi):
        out.setdefault(n, measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo))
    return out


def choose(tokenise: float, forward: dict, cores: int, workers=AUTO, threads=AUTO) -> tuple[int, int]:
    """(workers, threads) with the least `seconds_per_token`, among 0..cores workers and the thread counts in
    `forward` (a given value stays fixed); ties go to fewer workers, then more threads."""
    ws = range(cores + 1) if workers == AUTO else [workers]
    ts = sorted(forward) if threads == AUTO else [threads]
    best = None
    for w in ws:
        for n in ts:
            if n not in forward:
                continue
            key = (seconds_per_token(w, n, tokenise, forward, cores), w, -n)
            best = key if best is None or key < best else best
    if best is None:  # a given thread count that was not measured
        return (0 if workers == AUTO else workers), (max(forward) if threads == AUTO else threads)
    return best[1], -best[2]


def clamp_workers(workers, cores: int) -> tuple:
    """(workers to use, a note saying so): a count above the cores runs one worker per core (more would only
    queue for the same cores, each a process with its own tokenizer)."""
    if workers != AUTO and workers > cores:
        return cores, f"{workers} workers asked for, more than the {cores} core(s): {cores} used"
    return workers, ""


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


@dataclass
class Probe:
    """The first batches of a run, tokenised and run by `calibrate` (their results, to deliver or redo)."""

    encoded: list  # (planned, arrays)
    results: list
    threads: int


def calibrate(encode: Callable, measure: Callable, planned: Iterable, workers=AUTO, threads=AUTO,
              cores: int | None = None) -> tuple[PipelineChoice, Probe | None, Iterator]:
    """Decide (workers, threads) for a run whose batches run on the calling thread. `encode(planned)` tokenises
    a planned batch, `measure(planned, arrays)` runs its forward and returns its result. Returns the choice, the
    probe (results of the first batches with `probe.threads`, or None) and the planned batches not yet read."""
    cores = cores or available_cores()
    workers, note = clamp_workers(workers, cores)
    now = torch.get_num_threads()
    if workers != AUTO and threads != AUTO:
        return PipelineChoice(workers, threads, "given", cores, note=note), None, iter(planned)
    it = iter(planned)
    head = take_forwards(it, MIN_BATCHES, at_least=2)
    if sum(pb.n_forwards for pb in head) < MIN_BATCHES or len(head) < 2 or cores == 1:
        how = "one core" if cores == 1 else "short run"
        w = 0 if workers == AUTO else workers
        n = (cores if cores == 1 else now) if threads == AUTO else threads
        return PipelineChoice(w, n, how, cores, note=note), None, itertools.chain(head, it)
    probe = take_forwards(iter(head), PROBE_BATCHES, at_least=2)
    rest = itertools.chain(head[len(probe):], it)
    probe_threads = now if threads == AUTO else threads
    torch.set_num_threads(probe_threads)
    encoded, results, tok_s, fwd_s = [], [], [], []
    for i, pb in enumerate(probe):
        arrays, dt = _timed(encode, pb)
        res, df = _timed(measure, pb, arrays)
        encoded.append((pb, arrays))
        results.append(res)
        if i:  # the first batch warms up
            tok_s.append(dt / arrays.n_tokens)
            fwd_s.append(df / arrays.n_tokens)
    tokenise = 1 / max(min(tok_s), 1e-12)
    rates = {probe_threads: 1 / max(min(fwd_s), 1e-12)}
    if threads == AUTO and probe_threads > 1 and rates[probe_threads] / tokenise > NEGLIGIBLE:
        torch.set_num_threads(1)  # the probe's batches again with a single thread, for their time only
        try:
            one = [_timed(measure, pb, arrays)[1] / arrays.n_tokens for pb, arrays in encoded]
        finally:
            torch.set_num_threads(probe_threads)
        rates[1] = 1 / max(min(one[1:]), 1e-12)  # the first warms up the new thread count
    w, n = choose(tokenise, forward_rates(rates, cores), cores, workers, threads)
    choice = PipelineChoice(w, n, "measured", cores, tokenise, rates, note)
    return choice, Probe(encoded, results, probe_threads), rest


__all__ = ["AUTO", "PipelineChoice", "Probe", "calibrate", "check_threads", "choose", "clamp_workers", "forward_rates",
           "seconds_per_token"]
