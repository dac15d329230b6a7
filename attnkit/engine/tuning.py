"""A pipeline that plans itself (docs/pipeline.md §4, "Workers and threads, chosen by measuring"): on this
machine's CPU, how many tokenisation worker processes and how many torch threads a run uses, chosen from how fast
its first batches tokenise and run forwards, as a user with a stopwatch would.

    first batches: tokenised on the calling thread (timed) ─► forwards with the process's threads (timed), and
                   again with a single thread when tokenising is not negligible ─► `choose` ─► the rest of the run
    the rest of the run: every REPLAN_SECONDS its own tokenising and forwards (timed as they run) are compared with
                   the plan's rates; when one is off by more than DRIFT, the plan is measured again and chosen again
                   (`Replanner`)

Each rate is that of the fastest timed batch: a batch the system held up says nothing about the configuration.
Yet a plan measured on one timed unit (the first warms up; a unit of short texts is tokenised in a few
milliseconds) can be measured during a moment the machine gave to others, and would hold for the whole run: so
the run keeps measuring.

The first batches' results are kept when the chosen thread count is the one they ran with; otherwise they are
measured again with the chosen count, so a run's numbers are those of a run with the chosen settings given by hand
(docs/pipeline.md §3). `--workers`/`--threads` given by the user are kept as given (workers at most the cores).
A re-plan never changes a number either: workers only tokenise, and the thread count may change only while the
results measured since the run's start are held back (attnkit/engine/local.py measures again those of another
count before they are delivered); once it has held for SETTLE_SECONDS, only the workers change.
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
REPLAN_SECONDS = 1.0  # how often a run compares the rates it measures as it goes with its plan's
DRIFT = 1.5  # a rate this many times faster or slower than the plan's: the plan no longer holds
GAIN = 0.9  # a new choice is taken when its estimated time per token is below this share of the current one's
SETTLE_SECONDS = 4.0  # the thread count stays open this long after the start and after each change of it
HOLD_BYTES = 64 << 20  # and only while the results held back meanwhile take less memory than this
MAX_THREAD_CHANGES = 2  # and for this many changes at most: a machine whose load keeps changing would otherwise keep
#                         the results held and measure them again at every change


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
    replans: list = field(default_factory=list)  # each change made during the run (`Replanner`), for meta.json
    initial: tuple | None = None  # (workers, threads) chosen at the start, once a re-plan changed them

    def line(self) -> str:
        """The one line a run prints at its start, and after each change of plan."""
        text = (f"pipeline: {self.workers} tokenisation worker(s), {self.threads} torch thread(s) on {self.cores} "
                f"core(s)")
        if self.replans:
            last = self.replans[-1]
            rates = ", ".join(f"{float(r):,.0f} at {n} thread(s)" for n, r in last["forward_tokens_per_s"].items())
            return text + (f" (re-planned after {last['after_segments']:,} segment(s), {last['seconds']:.1f} s: "
                           f"tokenising {last['tokenise_tokens_per_s']:,.0f} tok/s per process, forward {rates})")
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
        if self.replans:
            out["initial"] = {"workers": self.initial[0], "threads": self.initial[1]}
            out["replans"] = [dict(r) for r in self.replans]
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


class Stopwatch:
    """How the pipeline times its work (tokenising, forwards) and reads the time between re-checks. This one reads
    the process's clock; a test gives its own, whose `took` says how long each piece of work took on the machine it
    scripts (busy, then quiet, ...) and whose `now` advances with it: the decisions then never race a real clock."""

    def now(self) -> float:
        return time.perf_counter()

    def took(self, kind: str, n_tokens: int, seconds: float, threads: int | None = None) -> float:
        """The seconds `kind` ("tokenise": one process; "forward": with `threads`) took for `n_tokens` tokens;
        `seconds` is what the clock measured."""
        return seconds

    def time(self, kind: str, n_tokens, fn, *args, threads: int | None = None):
        """(fn(*args), its seconds); `n_tokens` may be a function of the result."""
        t = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t
        return out, self.took(kind, n_tokens(out) if callable(n_tokens) else n_tokens, dt, threads)


@dataclass
class Probe:
    """The first batches of a run, tokenised and run by `calibrate` (their results, to deliver or redo)."""

    encoded: list  # (planned, arrays)
    results: list
    threads: int


def _tokens(arrays) -> int:
    return arrays.n_tokens


def calibrate(encode: Callable, measure: Callable, planned: Iterable, workers=AUTO, threads=AUTO,
              cores: int | None = None, stopwatch: Stopwatch | None = None
              ) -> tuple[PipelineChoice, Probe | None, Iterator]:
    """Decide (workers, threads) for a run whose batches run on the calling thread. `encode(planned)` tokenises
    a planned batch, `measure(planned, arrays)` runs its forward and returns its result. Returns the choice, the
    probe (results of the first batches with `probe.threads`, or None) and the planned batches not yet read."""
    cores = cores or available_cores()
    watch = stopwatch or Stopwatch()
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
        arrays, dt = watch.time("tokenise", _tokens, encode, pb)
        res, df = watch.time("forward", arrays.n_tokens, measure, pb, arrays, threads=probe_threads)
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
            one = [watch.time("forward", arrays.n_tokens, measure, pb, arrays, threads=1)[1] / arrays.n_tokens
                   for pb, arrays in encoded]
        finally:
            torch.set_num_threads(probe_threads)
        rates[1] = 1 / max(min(one[1:]), 1e-12)  # the first warms up the new thread count
    w, n = choose(tokenise, forward_rates(rates, cores), cores, workers, threads)
    choice = PipelineChoice(w, n, "measured", cores, tokenise, rates, note)
    return choice, Probe(encoded, results, probe_threads), rest


class Replanner:
    """Re-measures a measured plan as the run goes (docs/pipeline.md §4, "... and measured again as the run goes").

    The run reports its work as it does it (`observe`: tokenising by the calling thread and by each worker task,
    forwards by planned unit), and every REPLAN_SECONDS asks `recheck`. When the fastest rate of the interval, of
    tokenising or of the forwards at the current thread count, is off by more than DRIFT from the plan's, the plan
    no longer holds: its rates become the measured ones, and while the thread count is open the next run of
    forwards is measured with the other measured count (`exploring`: a quiet machine's second thread cannot be
    estimated from a busy one's); then `choose` decides again, and a choice whose estimate is below GAIN of the
    current one's is taken and recorded (`PipelineChoice.replans`).

    The thread count is open from the start until a re-check finds the plan holding SETTLE_SECONDS or more after
    the count last changed (or the caller's held results reach HOLD_BYTES: `fix_threads`): the results are held
    back meanwhile, and those of another count measured again (attnkit/engine/local.py), so that no number changes.
    It closes at once after its MAX_THREAD_CHANGES-th change. After that, re-plans
    change the workers only. A machine that stays busy keeps its busy plan (its rates hold); one that becomes quiet
    measures faster and is planned again."""

    def __init__(self, choice: PipelineChoice, stopwatch: Stopwatch, workers=AUTO, threads=AUTO):
        self.choice, self.watch = choice, stopwatch
        self.active = choice.how == "measured" and (workers == AUTO or threads == AUTO)
        self.workers_given, self.threads_given = workers, threads
        self.threads_open = self.active and threads == AUTO
        self.tokenise = choice.tokenise
        self.rates = dict(choice.forward)  # forward rates of the thread counts measured
        self.t0 = self.last = self.threads_since = stopwatch.now()
        self.exploring: int | None = None  # a thread count the next run of forwards measures
        self.thread_changes = 0
        self._best: dict = {}  # ("tokenise",) or ("forward", threads) -> the fastest rate since the last re-check

    @property
    def forward(self) -> dict:
        return forward_rates(self.rates, self.choice.cores)

    def threads_now(self) -> int:
        """The thread count the next forwards run with."""
        return self.exploring or self.choice.threads

    def observe(self, kind: str, n_tokens: int, seconds: float, threads: int | None = None) -> None:
        if self.active and n_tokens > 0 and seconds > 0:
            key = (kind,) if kind == "tokenise" else (kind, threads)
            self._best[key] = max(self._best.get(key, 0.0), n_tokens / seconds)

    def due(self) -> bool:
        return self.active and (self.exploring is not None or self.watch.now() - self.last >= REPLAN_SECONDS)

    def fix_threads(self) -> None:
        self.threads_open = False
        self.exploring = None

    def recheck(self, done: int) -> bool:
        """Compare what the run measured since the last re-check with the plan, and choose again when it no longer
        holds (`done`: segments of the plan measured so far, for the record). Whether the workers changed."""
        now = self.watch.now()
        best, self._best, self.last = self._best, {}, now
        current = self.choice.threads
        if self.exploring is not None:  # the run just measured at another thread count
            n, self.exploring = self.exploring, None
            if ("forward", n) in best:
                self.rates[n] = best[("forward", n)]
            return self._choose(done, now)
        tok, fwd = best.get(("tokenise",)), best.get(("forward", current))
        if not any(r is not None and not 1 / DRIFT <= r / plan <= DRIFT
                   for r, plan in ((tok, self.tokenise), (fwd, self.forward.get(current)))):
            if self.threads_open and now - self.threads_since >= SETTLE_SECONDS:
                self.fix_threads()
            return False
        if tok is not None:
            self.tokenise = tok
        if fwd is not None:  # the other counts as measured before, scaled alike until measured again
            scale = fwd / self.forward[current]
            self.rates = {n: r * scale for n, r in self.rates.items()}
        others = [n for n in (min(self.rates), max(self.rates)) if n != current]
        if self.threads_open and self.threads_given == AUTO and others:
            self.exploring = others[0]
            return False
        return self._choose(done, now)

    def _choose(self, done: int, now: float) -> bool:
        c = self.choice
        threads = self.threads_given if not self.threads_open else AUTO
        threads = c.threads if threads == AUTO and not self.threads_open else threads
        forward = self.forward
        w, n = choose(self.tokenise, forward, c.cores, self.workers_given, threads)
        if (w, n) == (c.workers, c.threads) or c.threads not in forward or n not in forward:
            return False
        if (seconds_per_token(w, n, self.tokenise, forward, c.cores)
                >= GAIN * seconds_per_token(c.workers, c.threads, self.tokenise, forward, c.cores)):
            return False
        if c.initial is None:
            c.initial = (c.workers, c.threads)
        changed = w != c.workers
        if n != c.threads:
            self.threads_since = now
            self.thread_changes += 1
            if self.thread_changes >= MAX_THREAD_CHANGES:
                self.fix_threads()
        c.workers, c.threads = w, n
        c.replans.append({"after_segments": done, "seconds": round(now - self.t0, 2), "workers": w, "threads": n,
                          "tokenise_tokens_per_s": round(self.tokenise, 1),
                          "forward_tokens_per_s": {str(k): round(r, 1) for k, r in sorted(self.rates.items())}})
        return changed


__all__ = ["AUTO", "PipelineChoice", "Probe", "Replanner", "Stopwatch", "calibrate", "check_threads", "choose",
           "clamp_workers", "forward_rates", "seconds_per_token"]
