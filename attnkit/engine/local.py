"""One machine's extraction pipeline: planned batches → tokenisation workers → model replicas → results in order.

    planned batches ──► TokenizerPool (worker processes, at most `prefetch` batches in flight; workers=0: in turn
                        with the forwards, on the calling thread)
                    ──► one CPU replica: forwards on the calling thread
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
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import AttnkitError, check_int
from ..tokens import Batch, EncodedArrays, Encoder
from .devices import device_labels
from .openmp import available_cores
from .plan import PlannedBatch
from .tuning import AUTO, PipelineChoice, calibrate, check_threads, clamp_workers


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
_worker_encoder: Encoder | None = None


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


def _init_worker(tokenizer, max_length: int, split_sentences: bool, parent: int) -> None:
    global _worker_encoder
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it saves a checkpoint)
    # A forked worker inherits the parent's Python handlers: the parent's SIGTERM handler (which turns SIGTERM
    # into KeyboardInterrupt to save a checkpoint) would make a worker that the pool terminates print a
    # traceback. A worker just ends on SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = Encoder(tokenizer, max_length=max_length, split_sentences=split_sentences)


def _encode_in_worker(batches: list) -> list:
    return [_worker_encoder.encode_arrays(segments) for segments in batches]


def _mp_context():
    """fork on Linux, as PyTorch's DataLoader does: workers start at once and need no `if __name__ ==
    "__main__"` guard in the user's script. The pool is made before any device thread starts, and a worker
    runs only the tokenizer (no torch operation, so no thread pool inherited in a forked state is touched).
    Elsewhere spawn (macOS, Windows: scripts need the guard there, as with DataLoader)."""
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _worker_errors(pb: PlannedBatch):
    """A dead worker or a failure inside one becomes a one-line AttnkitError naming the batch."""
    try:
        yield
    except BrokenProcessPool:
        raise AttnkitError("a tokenisation worker process died (killed, or out of memory)") from None
    except AttnkitError:
        raise
    except Exception as exc:
        raise AttnkitError(f"tokenising batch {pb.index} failed in a worker: {type(exc).__name__}: {exc}") from None


TASK_BATCHES = 4  # planned batches per task sent to a tokenisation worker


def workers_for_plan(planned: Iterable[PlannedBatch], workers: int,
                     group: int = TASK_BATCHES) -> tuple[int, Iterator[PlannedBatch]]:
    """(workers the plan can use, the same planned batches): no more workers than the plan has tasks for (a
    plan of 3 batches is one task: one worker), found by reading ahead at most `workers` tasks of the plan,
    which the returned iterator yields again."""
    it = iter(planned)
    if workers <= 0:
        return 0, it
    head = list(itertools.islice(it, workers * group))
    return min(workers, max(1, -(-len(head) // group))), itertools.chain(head, it)


class TokenizerPool:
    """Tokenise planned batches in `workers` processes, in order, with at most `prefetch` tasks of `group`
    batches in flight. `workers=0` tokenises on the calling thread. A task carries several batches because each
    round trip to a worker costs the parent process CPU time (pickling, thread wake-ups) that a small batch
    would pay alone."""

    def __init__(self, encoder: Encoder, workers: int, prefetch: int | None = None, group: int = TASK_BATCHES):
        check_workers(workers)
        self.encoder = encoder
        self.workers = workers
        self.group = max(1, group)
        self.prefetch = prefetch or max(2, 3 * workers)
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> TokenizerPool:
        if self.workers:
            enc = self.encoder
            with warnings.catch_warnings():  # Python >= 3.12 warns about fork in a threaded process
                warnings.simplefilter("ignore", DeprecationWarning)
                self._executor = ProcessPoolExecutor(
                    self.workers, mp_context=_mp_context(), initializer=_init_worker,
                    initargs=(enc.tokenizer, enc.max_length, enc.split_sentences, os.getpid()))
            # start every worker now, before any device thread exists (fork copies only this thread)
            self._executor.submit(int).result()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        ex, self._executor = self._executor, None
        if ex is None:
            return
        procs = list(getattr(ex, "_processes", {}).values())
        ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:  # a worker stuck in a long batch must not keep the run from ending
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()

    def map(self, planned: Iterable[PlannedBatch]) -> Iterator[tuple[PlannedBatch, EncodedArrays]]:
        if self._executor is None:
            for pb in planned:
                yield pb, self.encoder.encode_arrays(pb.segments)
            return
        pending: collections.deque = collections.deque()  # (planned batches, future of their arrays)
        it = iter(planned)
        exhausted = False
        while True:
            while not exhausted and len(pending) < self.prefetch:
                task = list(itertools.islice(it, self.group))
                if not task:
                    exhausted = True
                    break
                with _worker_errors(task[0]):
                    pending.append((task, self._executor.submit(_encode_in_worker, [pb.segments for pb in task])))
            if not pending:
                return
            task, fut = pending.popleft()
            with _worker_errors(task[0]):
                arrays = fut.result()
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

    def measure(self, planned: PlannedBatch, arrays: EncodedArrays) -> BatchResult:
        """One batch, synchronously, on the calling thread (a CPU replica)."""
        return self.result(planned, self.forward(self.model, Batch.from_arrays(arrays).to(self.device)), arrays)


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
                batch = Batch.from_arrays(arrays).pin_memory().to(rep.device, non_blocking=True)
                feats = rep.forward(rep.model, batch)
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
                 on_choice: Callable[[PipelineChoice], None] | None = None) -> PipelineChoice:
    """Measure every planned batch on the replicas in `models`; `on_result` sees the results in plan order.
    `workers`/`threads` "auto": chosen from the first batches' rates (attnkit/engine/tuning.py; a single CPU
    replica; with GPUs "auto" workers is `default_workers`); `threads` None keeps torch's thread count; the run
    sets the count it uses and restores the caller's at the end. `on_choice` sees the choice before the run."""
    if not models:
        raise AttnkitError("no model replica to run")
    check_workers(workers)
    threads = torch.get_num_threads() if threads is None else check_threads(threads)
    devices = [next(m.parameters()).device for m in models]
    replicas = [Replica(lab, m, forward) for lab, m in zip(device_labels(devices), models)]
    before = torch.get_num_threads()
    try:
        if runs_on_caller(devices):
            choice, probe, planned = calibrate(lambda pb: encoder.encode_arrays(pb.segments),
                                               lambda pb, arrays: _measure_here(replicas[0], pb, arrays),
                                               planned, workers, threads, max_workers())
        else:
            w = default_workers(devices[0].type) if workers == AUTO else workers
            w, note = clamp_workers(w, max_workers())
            n = before if threads == AUTO else threads
            choice, probe = PipelineChoice(w, n, "default" if workers == AUTO else "given", max_workers(),
                                           note=note), None
        if on_choice is not None:
            on_choice(choice)
        torch.set_num_threads(choice.threads)
        n_workers, planned = workers_for_plan(planned, choice.workers)
        with TokenizerPool(encoder, n_workers, prefetch) as pool:  # workers start before any result is delivered
            encoded = pool.map(planned)
            if probe is not None:
                redo = probe.threads != choice.threads  # a run's numbers are those of its thread count (§3)
                for (pb, arrays), res in zip(probe.encoded, probe.results):
                    on_result(_measure_here(replicas[0], pb, arrays) if redo else res)
                    if on_progress is not None:
                        on_progress([replicas[0]])
            if runs_on_caller(devices):
                _run_here(replicas[0], encoded, on_result, on_progress)
            else:
                # Every batch the workers may hold can also wait for a device: the workers are never held back by
                # a full device queue, and a device never waits while tokenised batches sit in a finished task.
                _run_threaded(replicas, encoded, pool.prefetch * pool.group + 2 * len(replicas), on_result,
                              on_progress)
    finally:
        torch.set_num_threads(before)
    return choice


def _measure_here(replica: Replica, planned: PlannedBatch, arrays: EncodedArrays) -> BatchResult:
    try:
        return replica.measure(planned, arrays)
    except AttnkitError:
        raise
    except Exception as exc:  # as from a device thread: one line naming the failure
        raise AttnkitError(f"the model on one device failed: {type(exc).__name__}: {exc}") from exc


def _run_here(replica: Replica, encoded, on_result, on_progress) -> None:
    for planned, arrays in encoded:
        on_result(_measure_here(replica, planned, arrays))
        if on_progress is not None:
            on_progress([replica])


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
