"""One machine's extraction pipeline: planned batches → tokenisation workers → model replicas → results in order.

    planned batches ──► TokenizerPool (worker processes on pipes of their own, at most `prefetch` tasks in flight;
                        a CPU run's caller tokenises the next batches itself while the task it needs is not
                        ready; workers=0: in turn with the forwards, on the calling thread)
                    ──► one CPU replica: forwards on the calling thread, in runs of batches
                        GPUs, several replicas: one DeviceRunner thread each (pinned memory, non-blocking copies)
                    ──► results put back in plan order on the calling thread

Tokenisation can run ahead of the model in worker processes, so a fast device is not left waiting for the
tokenizer. A GPU replica runs in its own thread (the heavy work releases the GIL), which queues copies and kernels
while the caller tokenises. A single CPU replica runs on the calling thread: a second thread running torch would
own a second OpenMP team and change how every wait of the process behaves (attnkit/engine/openmp.py,
docs/pipeline.md §4); its workers and torch threads may be chosen from the first batches' rates
(attnkit/engine/tuning.py). Results reach the caller in plan order whatever device finished first, so sums and
checkpoints are exactly those of the plain loop.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import numpy as np
import torch

from ..errors import AttnkitError, check_int
from ..process import TOKENIZER_THREADS, allowed, tokenizer_threads_off, torch_threads
from ..tokens import Batch, EncodedArrays, Encoder
from .devices import device_labels
from .forward import unit_features
from .openmp import available_cores
from .plan import PlannedBatch, segment_chars, take_forwards
from .tuning import AUTO, HOLD_BYTES, PipelineChoice, Replanner, Stopwatch, calibrate, check_threads, clamp_workers


def default_workers(device_type: str = "cuda") -> int:
    """Tokenisation workers when none are asked for. GPUs outrun one tokenizer by far: the cores not needed to
    drive them, at most 8. A CPU model runs torch's threads on every core, and a tokenising process beside them
    takes a core from a team that waits for its slowest thread at every parallel region (docs/pipeline.md §4):
    none, the calling thread tokenises between forwards (a few percent of a CPU forward's time)."""
    if device_type == "cpu":
        return 0
    return max(0, min(8, available_cores() - 1))


def max_workers() -> int:
    """The most tokenisation workers a run may ask for: one per core this process may use (more only queue
    for the same cores, and each is a process with its own copy of the tokenizer)."""
    return available_cores()


def check_workers(workers) -> int | str:
    """`workers` when it is "auto" or an integer ≥ 0; else an AttnkitError naming `workers`. A run uses at most
    `max_workers()` of them, and says so (attnkit/engine/tuning.py)."""
    return workers if workers == AUTO else check_int(workers, "workers", minimum=0)


# --- tokenisation in worker processes ---------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """A worker must not outlive its run: a parent killed by SIGKILL cannot shut the pool down, and a forked
    worker still holds the ends of its own task queue, so it would wait forever. Linux: ask the kernel to
    kill us with the parent; elsewhere: a thread that watches the parent."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # died before prctl took effect
            os._exit(1)
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="attnkit-parent-watch", daemon=True).start()


def _worker_main(tasks, results, encoder, parent: int) -> None:
    """A tokenisation worker process: tasks (lists of batches' segments) from `tasks`, in order, and for each one
    ("ok", its arrays, the seconds tokenising them took: the run re-measures its plan with them) or ("error", which
    batch, the failure) to `results`, in the same order. A thread of its own sends them, so the worker goes on with
    the next task while the parent is inside a forward and has not read the last one yet. None or the end of
    `tasks` ends it."""
    _die_with_parent(parent)
    # A forked worker inherits the parent's objects (torch, transformers, the user's own): its first full
    # collection would scan them all and write to their pages (copy-on-write), a stall of a few hundred
    # milliseconds in which the run waits for this worker. They live as long as the worker, so the collector
    # leaves them alone and sees only what the worker makes. (The parent's collector is not touched.)
    if getattr(sys, "_is_gil_enabled", lambda: True)():  # (a free-threaded build marks each object to freeze it)
        gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it saves a checkpoint)
    # A forked worker inherits the parent's Python handlers: the parent's SIGTERM handler (which turns SIGTERM
    # into KeyboardInterrupt to save a checkpoint) would make a worker that the pool terminates print a
    # traceback. A worker just ends on SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ[TOKENIZER_THREADS] = "false"
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send() -> None:
        with contextlib.suppress(OSError):  # the parent has gone: nobody to tell
            while (item := outbox.get()) is not None:
                results.send(item)

    sender = threading.Thread(target=send, name="attnkit-send", daemon=True)
    sender.start()
    outbox.put(("ready",))
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            break
        if task is None:
            break
        out, t = [], time.perf_counter()
        for j, segments in enumerate(task):
            try:
                out.append(encoder.encode_arrays(segments))
            except Exception as exc:
                why = str(exc) if isinstance(exc, AttnkitError) else f"{type(exc).__name__}: {exc}"
                outbox.put(("error", j, why))
                break
        else:
            outbox.put(("ok", out, time.perf_counter() - t))
    outbox.put(None)
    sender.join()


def _mp_context():
    """fork on Linux, as PyTorch's DataLoader does: workers start at once and need no `if __name__ ==
    "__main__"` guard in the user's script. The pool is made before any device thread starts, and a worker
    runs only the tokenizer (no torch operation, so no thread pool inherited in a forked state is touched).
    Elsewhere spawn (macOS, Windows: scripts need the guard there, as with DataLoader)."""
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


WORKER_DIED = "a tokenisation worker process died (killed, or out of memory)"
PIPE_BYTES = 1 << 20  # a task pipe's buffer where the system lets it grow (Linux: up to /proc/sys/fs/pipe-max-size)


class _Worker:
    """One tokenisation process and its two pipes. The parent sends tasks and reads their results itself, in
    order, on the calling thread: no pool manager thread or queue feeder thread competing with the forwards for
    the GIL and the cores."""

    def __init__(self, ctx, encoder: Encoder):
        tasks_end, self.tasks = ctx.Pipe(duplex=False)
        self.results, results_end = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_worker_main, name="attnkit-tokenise", daemon=True,
                                   args=(tasks_end, results_end, encoder, os.getpid()))
        self.process.start()
        tasks_end.close()  # the worker holds the other ends alone: its death is an end of file here
        results_end.close()
        self.pipe_bytes = 0  # the task pipe's buffer where it could be grown to PIPE_BYTES
        set_size = getattr(fcntl, "F_SETPIPE_SZ", None)  # (None where fcntl is: Windows)
        if set_size is not None:  # room for the tasks in flight: sending them never waits for the worker
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.tasks.fileno(), set_size, PIPE_BYTES)
                self.pipe_bytes = PIPE_BYTES
        self.pending: collections.deque = collections.deque()  # bytes of each task sent and not read back

    def has_room(self, nbytes: int) -> bool:
        """Whether a task of `nbytes` (pickled) may be sent now: while fewer than TASKS_IN_FLIGHT are pending,
        always; beyond that (a pool the caller helps) only while it fits in the pipe's buffer beside those not yet
        read back, so that sending never waits for the worker while the caller could be running forwards."""
        return len(self.pending) < TASKS_IN_FLIGHT or sum(self.pending) + nbytes <= self.pipe_bytes

    def send(self, data: memoryview) -> None:
        """Send a task pickled by `pickled` (what `Connection.send` would send; the worker's `recv` reads it)."""
        try:
            self.tasks.send_bytes(data)
        except OSError:  # its end of the pipe is closed: the worker has died
            raise AttnkitError(WORKER_DIED) from None
        self.pending.append(len(data))

    @staticmethod
    def pickled(task: list[PlannedBatch]) -> memoryview:
        return ForkingPickler.dumps([pb.segments for pb in task])

    def receive_result(self) -> tuple:
        """The result of the oldest task sent (waiting for it)."""
        message = self.receive()
        self.pending.popleft()
        return message

    def ready(self) -> bool:
        """Whether the next result (or the worker's end) can be read without waiting."""
        return self.results.poll()

    def receive(self) -> tuple:
        """The next message from the worker (waiting for it); an AttnkitError when the worker has died."""
        ready = multiprocessing.connection.wait([self.results, self.process.sentinel])
        if self.results in ready:  # a message the worker sent before it ended is still read
            with contextlib.suppress(EOFError, OSError):
                return self.results.recv()
        raise AttnkitError(WORKER_DIED)

    def stop(self) -> None:
        """End the worker now: it holds nothing worth waiting for (SIGTERM ends it without a traceback)."""
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.tasks.close()
        self.results.close()


TASK_BATCHES = 8  # forwards' worth of planned batches per task sent to a tokenisation worker
TASK_CHARS = 200_000  # and at most about this much text (a task pipe holds the tasks in flight)
TASKS_IN_FLIGHT = 3  # tasks per worker sent and not yet read back
# ... where the caller tokenises too (`help_here`): between two reads the caller runs a run of forwards and may
# tokenise a batch of its own, and a worker with fewer tasks queued runs dry in the meantime
HELPED_TASKS = 8


def workers_for_plan(planned: Iterable[PlannedBatch], workers: int,
                     group: int = TASK_BATCHES) -> tuple[int, Iterator[PlannedBatch]]:
    """(workers the plan can use, the same planned batches): no more workers than the plan has tasks for (a
    plan of 3 batches is one task: one worker), found by reading ahead at most `workers` tasks of the plan,
    which the returned iterator yields again."""
    it = iter(planned)
    if workers <= 0:
        return 0, it
    head = take_forwards(it, workers * group)
    n = sum(pb.n_forwards for pb in head)
    return min(workers, max(1, -(-n // group))), itertools.chain(head, it)


class TokenizerPool:
    """Tokenise planned batches in `workers` processes, in order, with at most `prefetch` tasks of `group`
    batches in flight; task k goes to worker k mod `workers`, so each worker's results come back in plan order.
    `workers=0` tokenises on the calling thread. A task carries several batches because each round trip to a
    worker costs the parent process CPU time (pickling, a wake-up) that a small batch would pay alone.

    `help_here`: while the task the caller waits for is not done, the caller tokenises the next planned batch
    itself instead of waiting (at most `prefetch` × `group` such batches ahead), so a run bound by tokenising keeps
    every core busy with one worker fewer than cores (workers + the caller, never more processes than cores).
    Batches still come out in plan order.

    `encode(planned)`: how the caller tokenises a batch (by default `encoder.encode_arrays` of its segments);
    `on_task(n_tokens, seconds)` hears how long each worker task took (a re-planning run times its tokenising)."""

    def __init__(self, encoder: Encoder, workers: int, prefetch: int | None = None, group: int = TASK_BATCHES,
                 help_here: bool = False, encode: Callable | None = None, on_task: Callable | None = None):
        check_workers(workers)
        self.encoder = encoder
        self.encode = encode or (lambda pb: encoder.encode_arrays(pb.segments))
        self.on_task = on_task
        self.workers = workers
        self.group = max(1, group)
        self.prefetch = prefetch or max(2, (HELPED_TASKS if help_here else TASKS_IN_FLIGHT) * workers)
        self.help_here = help_here
        self.helped = 0  # batches the caller tokenised while waiting for a worker
        self._procs: list[_Worker] = []

    def __enter__(self) -> TokenizerPool:
        try:
            with warnings.catch_warnings():  # Python >= 3.12 warns about fork in a threaded process
                warnings.simplefilter("ignore", DeprecationWarning)
                for _ in range(self.workers):  # every worker starts now, before any device thread exists
                    self._procs.append(_Worker(_mp_context(), self.encoder))
            for w in self._procs:
                w.receive()  # "ready": its tokenizer is loaded
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for w in procs:
            w.stop()

    def _next_task(self, it: Iterator[PlannedBatch]) -> list[PlannedBatch]:
        """The next planned batches for one worker: `group` forwards' worth of them, fewer where their text passes
        TASK_CHARS (estimated from each batch's first segment, its longest in the plan's order)."""
        task, chars, n = [], 0, 0
        for pb in it:
            task.append(pb)
            chars += segment_chars(pb.segments[0]) * len(pb.segments)
            n += pb.n_forwards
            if n >= self.group or chars >= TASK_CHARS:
                break
        return task

    def map(self, planned: Iterable[PlannedBatch]) -> Iterator[tuple[PlannedBatch, EncodedArrays]]:
        if not self._procs:
            for pb in planned:
                yield pb, self.encode(pb)
            return
        # in plan order: (planned batches, the worker tokenising them, or their arrays made here)
        slots: collections.deque = collections.deque()
        it = iter(planned)
        exhausted = False
        sent = in_flight = here = 0  # tasks sent; tasks sent and not yet read; forwards made here, not yet taken
        unsent = None  # (the next task, pickled): it waits for room in its worker's pipe
        while True:
            while not exhausted and in_flight < self.prefetch:
                worker = self._procs[sent % len(self._procs)]
                if unsent is None:
                    task = self._next_task(it)
                    if not task:
                        exhausted = True
                        break
                    unsent = (task, _Worker.pickled(task))
                if not worker.has_room(len(unsent[1])):
                    break
                worker.send(unsent[1])
                slots.append((unsent[0], worker))
                unsent = None
                sent += 1
                in_flight += 1
            if not slots:
                if not exhausted:  # cannot happen: a worker with nothing pending has room for any task
                    raise RuntimeError("attnkit's tokenisation pool stopped before the end of the plan")
                return
            task, source = slots[0]
            waiting = isinstance(source, _Worker) and not source.ready()
            if waiting and self.help_here and not exhausted and here < self.prefetch * self.group:
                if unsent is not None:  # its batches come next in the plan: the caller takes them from the front
                    it, unsent = itertools.chain(unsent[0], it), None
                pb = next(it, None)
                if pb is None:
                    exhausted = True
                else:
                    slots.append(([pb], [self.encode(pb)]))
                    here += pb.n_forwards
                    self.helped += 1
                continue
            slots.popleft()
            if isinstance(source, _Worker):
                in_flight -= 1
                message = source.receive_result()
                if message[0] == "error":
                    raise AttnkitError(f"tokenising batch {task[message[1]].index} failed in a worker: "
                                       f"{message[2]}")
                arrays = message[1]
                if self.on_task is not None:
                    self.on_task(sum(a.n_tokens for a in arrays), message[2])
            else:
                here -= task[0].n_forwards
                arrays = source
            yield from zip(task, arrays)


# --- model replicas -----------------------------------------------------------------------------------------
@dataclass
class BatchResult:
    planned: PlannedBatch
    features: np.ndarray  # B × layers × heads × F, float32
    n_tokens: int
    n_truncated: int
    device: str
    full_lengths: np.ndarray | None = None


class Replica:
    """One model replica and what it measured (`tokens`, for the progress bar's rates per replica)."""

    def __init__(self, label: str, model, forward: Callable):
        self.label = label
        self.model = model
        self.device = next(model.parameters()).device
        self.forward = forward  # (model, batch on device) -> B×layers×heads×F tensor on the device
        self.tokens = 0

    def result(self, planned: PlannedBatch, feats: torch.Tensor, arrays: EncodedArrays) -> BatchResult:
        self.tokens += arrays.n_tokens
        return BatchResult(planned, feats.numpy(), arrays.n_tokens, arrays.n_truncated, self.label,
                           arrays.full_lengths)

    def features(self, planned: PlannedBatch, arrays: EncodedArrays, to_device: Callable[[Batch], Batch]):
        """The per-sample rows of a planned batch (or unit: attnkit/engine/plan.py) on the device."""
        return unit_features(self.forward, self.model, arrays, planned.batch_size, to_device)

    def measure(self, planned: PlannedBatch, arrays: EncodedArrays) -> BatchResult:
        """One batch, synchronously, on the calling thread (a CPU replica)."""
        return self.result(planned, self.features(planned, arrays, lambda b: b.to(self.device)), arrays)


class DeviceRunner(threading.Thread):
    """Runs one replica on a thread of its own: takes (planned, arrays) from `inbox`, puts `BatchResult`s (or an
    exception) in `outbox`. On CUDA, a batch's features are copied back while the next forward is already
    queued."""

    def __init__(self, replica: Replica, inbox: queue.Queue, outbox: queue.Queue):
        super().__init__(name=f"attnkit-{replica.label}", daemon=True)
        self.replica = replica
        self.inbox, self.outbox = inbox, outbox

    def run(self) -> None:
        rep = self.replica
        cuda = rep.device.type == "cuda"
        pending = None  # (planned, features on host, event, arrays)
        try:
            if cuda:
                torch.cuda.set_device(rep.device)
            while True:
                item = self.inbox.get()
                if item is None:
                    break
                planned, arrays = item
                if not cuda:
                    self.outbox.put(rep.measure(planned, arrays))
                    continue
                feats = rep.features(planned, arrays, lambda b: b.pin_memory().to(rep.device, non_blocking=True))
                host = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
                host.copy_(feats, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                if pending is not None:
                    self._deliver(*pending)
                pending = (planned, host, event, arrays)
            if pending is not None:
                self._deliver(*pending)
        except BaseException as exc:  # reported to the caller, which stops the run with a checkpoint
            self.outbox.put(exc)

    def _deliver(self, planned, host, event, arrays: EncodedArrays) -> None:
        event.synchronize()
        self.outbox.put(self.replica.result(planned, host, arrays))


def runs_on_caller(devices: Sequence) -> bool:
    """Whether the batches run on the calling thread: one replica, on the CPU. Then the forward runs where the
    caller's own torch code runs, in the OpenMP regime of its thread (attnkit/engine/openmp.py), and tokenisation
    (workers=0) takes turns with it instead of competing for the cores. GPUs and several replicas get a thread
    each: a GPU thread queues the next batch's copies and kernels while the caller tokenises."""
    return len(devices) == 1 and torch.device(devices[0]).type == "cpu"


def run_pipeline(models: Sequence, encoder: Encoder, planned: Iterable[PlannedBatch], forward: Callable, *,
                 workers: int | str = 0, threads: int | str | None = None, prefetch: int | None = None,
                 on_result: Callable[[BatchResult], None], on_progress: Callable[[list], None] | None = None,
                 on_choice: Callable[[PipelineChoice], None] | None = None,
                 stopwatch: Stopwatch | None = None) -> PipelineChoice:
    """Measure every planned batch on the replicas in `models`; `on_result` sees the results in plan order.
    `workers`/`threads` "auto": chosen from the first batches' rates and chosen again as the run goes
    (attnkit/engine/tuning.py; a single CPU replica; with GPUs "auto" workers is `default_workers`); `threads` None
    keeps torch's thread count; the run sets the count it uses and restores the caller's at the end. `on_choice`
    sees the choice before the run and again after each change of it (the same object, changed). `stopwatch`: how
    the work is timed (tests script a machine with one)."""
    if not models:
        raise AttnkitError("no model replica to run")
    check_workers(workers)
    threads = torch.get_num_threads() if threads is None else check_threads(threads)
    if not allowed("torch_threads"):  # ATTNKIT_TORCH_THREADS=0: the caller's count, whatever was asked
        threads = torch.get_num_threads()
    devices = [next(m.parameters()).device for m in models]
    replicas = [Replica(lab, m, forward) for lab, m in zip(device_labels(devices), models)]
    here = runs_on_caller(devices)
    with contextlib.ExitStack() as restore:  # the caller's thread count, and its tokenizer setting on the CPU
        before = restore.enter_context(torch_threads())
        if here:
            restore.enter_context(tokenizer_threads_off())
            watch = stopwatch or Stopwatch()
            choice, probe, planned = calibrate(lambda pb: encoder.encode_arrays(pb.segments),
                                               lambda pb, arrays: _measure_here(replicas[0], pb, arrays),
                                               planned, workers, threads, max_workers(), watch)
            if on_choice is not None:
                on_choice(choice)
            _run_on_caller(replicas[0], encoder, planned, probe, Replanner(choice, watch, workers, threads),
                           prefetch, on_result, on_progress, on_choice)
            return choice
        w = default_workers(devices[0].type) if workers == AUTO else workers
        w, note = clamp_workers(w, max_workers())
        n = before if threads == AUTO else threads
        choice = PipelineChoice(w, n, "default" if workers == AUTO else "given", max_workers(), note=note)
        if on_choice is not None:
            on_choice(choice)
        torch.set_num_threads(choice.threads)
        n_workers, planned = workers_for_plan(planned, choice.workers)
        with TokenizerPool(encoder, n_workers, prefetch) as pool:
            # Every batch the workers may hold can also wait for a device: the workers are never held back by
            # a full device queue, and a device never waits while tokenised batches sit in a finished task.
            _run_threaded(replicas, pool.map(planned), pool.prefetch * pool.group + 2 * len(replicas), on_result,
                          on_progress)
    return choice


class _Gate:
    """The planned batches one tokenisation pool takes: all of them, or those read before `close` (a re-plan that
    changes the workers lets the pool finish what it was given, and a new pool takes the rest, in plan order)."""

    def __init__(self, it: Iterator):
        self.it, self.open = it, True

    def __iter__(self) -> _Gate:
        return self

    def __next__(self):
        if not self.open:
            raise StopIteration
        return next(self.it)

    def close(self) -> None:
        self.open = False


def _nbytes(arrays: EncodedArrays, res: BatchResult) -> int:
    return res.features.nbytes + sum(a.nbytes for a in (*arrays.inputs.values(), arrays.token_class,
                                                        arrays.sentence_id) if hasattr(a, "nbytes"))


class _Held:
    """A CPU run's results on their way to `on_result`, in plan order. While the run's thread count may still
    change (`holding`), they are held back with their arrays and the count they ran with; `release` delivers them,
    measuring again with the final count those that ran with another (numbers can depend on the count:
    docs/pipeline.md §3), so a re-planned run gives the numbers of the same run with its final choice given."""

    def __init__(self, replica: Replica, on_result, on_progress, holding: bool):
        self.replica, self.on_result, self.on_progress = replica, on_result, on_progress
        self.holding = holding
        self.items: list = []
        self.bytes = 0
        self.done = 0  # segments of the plan measured (held or delivered)

    def add(self, planned: PlannedBatch, arrays: EncodedArrays, res: BatchResult, threads: int) -> None:
        self.done = planned.end
        if self.holding:
            self.items.append((planned, arrays, res, threads))
            self.bytes += _nbytes(arrays, res)
        else:
            self._deliver(res)

    def flush(self) -> None:
        """Deliver what is held as it ran: the run was interrupted or failed, and its checkpoint keeps this work (a
        resumed run's numbers depend on the thread count the resume runs with anyway: docs/pipeline.md §4)."""
        self.holding = False
        items, self.items, self.bytes = self.items, [], 0
        for _, _, res, _ in items:
            self._deliver(res)

    def release(self, threads: int) -> None:
        self.holding = False
        items, self.items, self.bytes = self.items, [], 0
        if any(n != threads for *_, n in items):
            torch.set_num_threads(threads)
        for planned, arrays, res, n in items:
            self._deliver(res if n == threads else _measure_here(self.replica, planned, arrays))

    def _deliver(self, res: BatchResult) -> None:
        self.on_result(res)
        if self.on_progress is not None:
            self.on_progress([self.replica])


def _run_on_caller(replica: Replica, encoder: Encoder, planned: Iterator, probe, replan: Replanner, prefetch,
                   on_result, on_progress, on_choice) -> None:
    """A single CPU replica's run: forwards on the calling thread, tokenising in `choice.workers` processes and on
    the calling thread while it waits for them; every REPLAN_SECONDS `replan` compares what the run measures with
    the plan and may change the workers (this pool finishes the tasks it was given, a new one takes the rest) and,
    while the results are held, the threads (attnkit/engine/tuning.py)."""
    choice, watch = replan.choice, replan.watch
    held = _Held(replica, on_result, on_progress, replan.threads_open)
    if probe is not None:
        for (pb, arrays), res in zip(probe.encoded, probe.results):
            held.add(pb, arrays, res, probe.threads)

    def encode(pb: PlannedBatch) -> EncodedArrays:
        arrays, seconds = watch.time("tokenise", lambda a: a.n_tokens, encoder.encode_arrays, pb.segments)
        replan.observe("tokenise", arrays.n_tokens, seconds)
        return arrays

    def on_task(n_tokens: int, seconds: float) -> None:
        replan.observe("tokenise", n_tokens, watch.took("tokenise", n_tokens, seconds))

    def measure(pb: PlannedBatch, arrays: EncodedArrays) -> tuple:
        n = torch.get_num_threads()
        res, seconds = watch.time("forward", arrays.n_tokens, _measure_here, replica, pb, arrays, threads=n)
        replan.observe("forward", arrays.n_tokens, seconds, n)
        return pb, arrays, res, n

    try:
        _replanned_runs(encoder, planned, replan, held, prefetch, encode, on_task, measure, on_choice)
    except BaseException:
        held.flush()
        raise
    held.release(choice.threads)


def _replanned_runs(encoder, planned, replan, held, prefetch, encode, on_task, measure, on_choice) -> None:
    """`_run_on_caller`'s runs of forwards, a tokenisation pool for each choice of workers."""
    choice = replan.choice
    it = iter(planned)
    while (first := next(it, None)) is not None:
        gate = _Gate(itertools.chain([first], it))

        def after_run(gate=gate) -> None:
            if held.holding and held.bytes >= HOLD_BYTES:
                replan.fix_threads()
            if replan.due():
                was = (choice.workers, choice.threads)
                if replan.recheck(held.done):
                    gate.close()  # this pool finishes the tasks it was given; a new one takes the rest
                if (choice.workers, choice.threads) != was and on_choice is not None:
                    on_choice(choice)
            if held.holding and not replan.threads_open:
                held.release(choice.threads)
            if torch.get_num_threads() != replan.threads_now():
                torch.set_num_threads(replan.threads_now())

        torch.set_num_threads(replan.threads_now())
        n_workers, src = workers_for_plan(gate, choice.workers)
        with TokenizerPool(encoder, n_workers, prefetch, help_here=True, encode=encode, on_task=on_task) as pool:
            _run_here(pool.map(src), measure, held.add, after_run)


def _measure_here(replica: Replica, planned: PlannedBatch, arrays: EncodedArrays) -> BatchResult:
    try:
        return replica.measure(planned, arrays)
    except AttnkitError:
        raise
    except Exception as exc:  # as from a device thread: one line naming the failure
        raise AttnkitError(f"the model on one device failed: {type(exc).__name__}: {exc}") from exc


RUN_BATCHES = 16  # forwards in one run of `_run_here`: at most this many
RUN_SECONDS = 0.05  # and about this much forward time


def _run_here(encoded, measure: Callable, deliver: Callable, after_run: Callable | None = None) -> None:
    """The batches on the calling thread, in runs: a run's batches are tokenised (or received) together, their
    forwards run back to back (`measure`), and their results are delivered together (`deliver`). Each kind of work
    then keeps its code and data in the core's caches: a small model's forward right after tokenising a batch takes
    markedly longer than one right after another forward. A run holds at most RUN_BATCHES forwards and about
    RUN_SECONDS of them, so a large model's progress and checkpoints still follow every batch, and a worker's queued
    tasks outlast a run (counted in forwards, not in units: a run of 16 units would leave a tokenise-bound run's
    worker idle). `after_run` follows each run (the re-plan's turn)."""
    size = 1
    encoded = iter(encoded)
    while items := take_forwards(encoded, size, planned=lambda item: item[0]):
        t = time.perf_counter()
        results = [measure(planned, arrays) for planned, arrays in items]
        per_forward = (time.perf_counter() - t) / sum(planned.n_forwards for planned, _ in items)
        for res in results:
            deliver(*res)
        if after_run is not None:
            after_run()
        size = max(1, min(RUN_BATCHES, int(RUN_SECONDS / max(per_forward, 1e-9))))


def _run_threaded(replicas, encoded, max_in_flight, on_result, on_progress) -> None:
    inbox: queue.Queue = queue.Queue()
    outbox: queue.Queue = queue.Queue()
    runners = [DeviceRunner(rep, inbox, outbox) for rep in replicas]
    for r in runners:
        r.start()
    order: collections.deque = collections.deque()  # dispatched batch indices, in plan order
    done: dict = {}
    exhausted = False
    try:
        while True:
            while not exhausted and len(order) < max_in_flight:
                item = next(encoded, None)
                if item is None:
                    exhausted = True
                    break
                order.append(item[0].index)
                inbox.put(item)
            if not order:
                break
            res = outbox.get()
            if isinstance(res, BaseException):
                if isinstance(res, AttnkitError):
                    raise res
                raise AttnkitError(f"the model on one device failed: {type(res).__name__}: {res}") from res
            done[res.planned.index] = res
            while order and order[0] in done:
                on_result(done.pop(order.popleft()))
            if on_progress is not None:
                on_progress(replicas)
    finally:
        with contextlib.suppress(queue.Empty):
            while True:
                inbox.get_nowait()
        for _ in runners:
            inbox.put(None)
        for r in runners:
            r.join(timeout=60)
