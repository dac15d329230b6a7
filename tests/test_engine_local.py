"""The corpus-scale pipeline: the batch plan, tokenisation workers, several replicas, failures, and the CLI
job around them. Every path must give the numbers of the plain in-process loop."""
import collections
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

import attnkit
from attnkit.corpus import default_corpus_path
from attnkit.engine import ExtractionState, ExtractSettings, local, run_extraction
from attnkit.engine.forward import device_forward, length_batches, measuring, unit_features
from attnkit.engine.plan import (
    GROUP_BATCHES,
    GROUP_CHARS,
    batches_of_window,
    group_batches,
    plan_batches,
    segment_chars,
    windows,
)
from attnkit.errors import AttnkitError
from attnkit.tokens import Batch, Encoder


def real_segments(n_pairs: int = 100) -> list:
    """A few hundred real English segments: the sentences of the built-in corpus, then pairs of them."""
    text = default_corpus_path().read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    pairs = [(sentences[i], sentences[-1 - i]) for i in range(n_pairs)]
    return sentences + pairs


@pytest.fixture(scope="module")
def segments():
    segs = real_segments()
    assert len(segs) >= 200
    return segs


def test_plan_is_windowed_length_sort():
    segs = [f"{'x' * n}" for n in (3, 9, 1, 7, 5, 2, 8)]
    assert [len(w) for w in windows(segs, 3)] == [3, 3, 1]
    assert batches_of_window(["bb", "a", "ccc", "dd"], 2) == [["ccc", "bb"], ["dd", "a"]]  # stable, longest first
    plan = list(plan_batches(segs, 2, 3))
    assert [[len(s) for s in pb.segments] for pb in plan] == [[9, 3], [1], [7, 5], [2], [8]]
    assert [(pb.index, pb.start, pb.window) for pb in plan] == [(0, 0, 0), (1, 2, 0), (2, 3, 1), (3, 5, 1), (4, 6, 2)]
    # resuming at a batch boundary gives the rest of the same plan
    assert [pb.index for pb in plan_batches(segs, 2, 3, skip_segments=5)] == [3, 4]
    with pytest.raises(AttnkitError, match="not a batch boundary"):
        list(plan_batches(segs, 2, 3, skip_segments=4))
    with pytest.raises(AttnkitError, match="past the end"):
        list(plan_batches(segs, 2, 3, skip_segments=9))
    with pytest.raises(AttnkitError, match="window"):
        list(plan_batches(segs, 2, 0))



def test_a_grouped_plan_joins_whole_batches_of_the_character_order_into_units():
    rng = np.random.default_rng(0)
    segs = [" ".join(["word"] * int(n)) for n in rng.integers(1, 40, 150)] + [("a b", "c")] * 7
    plain = list(plan_batches(segs, 4, 64))
    units = list(plan_batches(segs, 4, 64, grouped=True))
    # the same segments in the same order (the character plan), cut at batch boundaries into fewer pieces
    assert [p for pb in units for p in pb.positions] == [p for pb in plain for p in pb.positions]
    assert [pb.index for pb in units] == list(range(len(units))) and len(units) < len(plain)
    for pb in units:
        assert pb.batch_size == 4 and 1 <= pb.n_forwards <= GROUP_BATCHES
        assert pb.segments == [segs[p] for p in pb.positions]
        last_of_window = pb.end == min(len(segs), (pb.window + 1) * 64)
        assert len(pb.segments) % 4 == 0 or last_of_window
        if pb.n_forwards > 1:
            assert sum(segment_chars(x) for x in pb.segments) <= GROUP_CHARS
    # starts are unit boundaries: resuming there gives the rest of the same plan, elsewhere is refused
    cut = units[3]
    assert [pb.index for pb in plan_batches(segs, 4, 64, grouped=True, skip_segments=cut.start)] == \
        [pb.index for pb in units[3:]]
    with pytest.raises(AttnkitError, match="not a batch boundary"):
        list(plan_batches(segs, 4, 64, grouped=True, skip_segments=cut.start + 4))
    # long texts: a unit of a single batch (its text alone passes GROUP_CHARS)
    long = ["word " * (GROUP_CHARS // 20)] * 12
    assert [pb.n_forwards for pb in plan_batches(long, 4, 64, grouped=True)] == [1, 1, 1]
    # forwards of one sample have no padding to save: their batches stay alone
    assert [len(pb.segments) for pb in plan_batches(segs, 1, 64, grouped=True)] == [1] * len(segs)
    assert group_batches([10] * 19) == [GROUP_BATCHES, GROUP_BATCHES, 3]
    assert group_batches([GROUP_CHARS, 1, 1, GROUP_CHARS - 1, 1]) == [1, 2, 2]


def test_a_units_forwards_take_its_samples_by_token_count(minilm):
    """A unit's forwards hold `batch_size` samples each, longest in tokens first (ties in plan order), each padded
    to its own longest; the rows come back in the unit's order, each exactly what the forward of its own batch,
    tokenised alone, gives."""
    model, tok = minilm
    enc = Encoder(tok, max_length=32)
    # characters and tokens disagree: long words are single characters' worth of tokens, punctuation many
    segs = ["a, b, c, d, e, f, g.", "extraordinarily", "x", "one two three", "...!!!", "internationalisation",
            "it is", "a b c d e f g h i j"]
    arrays = enc.encode_arrays(segs)
    parts = length_batches(arrays.lengths, 3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(segs)))
    seen = [arrays.lengths[p].tolist() for p in parts]
    assert [len(p) for p in parts] == [3, 3, 2]
    flat = [n for part in seen for n in part]
    assert flat == sorted(arrays.lengths.tolist(), reverse=True)
    assert length_batches(arrays.lengths, 8) is None and length_batches(arrays.lengths, None) is None
    widths = []

    def forward(m, batch):
        widths.append(batch.inputs["input_ids"].shape[1])
        return device_forward(m, batch)

    with measuring(model, backend="reference"):
        rows = unit_features(forward, model, arrays, 3, lambda b: b)
        for p in parts:
            alone = device_forward(model, Batch.from_arrays(enc.encode_arrays([segs[i] for i in p])))
            torch.testing.assert_close(rows[torch.from_numpy(p)], alone, rtol=0, atol=0)
    assert widths == [max(s) for s in seen]


def test_an_extraction_pads_little_where_characters_misjudge_tokens(minilm):
    """Texts whose characters say little about their tokens (numbers and punctuation against long words): the
    forwards of a run pad far less than batches sorted by characters would, and the numbers are those of the
    batches of the character plan to rounding."""
    model, tok = minilm
    rng = np.random.default_rng(3)
    words = ["internationalisation", "a", "1,2", "x.y", "extraordinary", "!?", "cat"]
    segs = [" ".join(rng.choice(words, int(k))) for k in rng.integers(2, 12, 96)]
    padded = []
    real = local.unit_features

    def recording(forward, m, arrays, batch_size, to_device):
        def counted(m, batch):
            padded.append(batch.inputs["input_ids"].numel())
            return forward(m, batch)
        return real(counted, m, arrays, batch_size, to_device)

    settings = ExtractSettings(max_length=48, batch_size=8, backend="reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local, "unit_features", recording)
        acc = run_extraction(model, tok, segs, settings, workers=0).accumulator
    enc = Encoder(tok, max_length=48)
    char_batches = [enc.encode_arrays(pb.segments) for pb in plan_batches(segs, 8, 4096)]
    assert len(padded) == len(char_batches)
    assert sum(padded) < 0.9 * sum(a.inputs["input_ids"].size for a in char_batches)
    with measuring(model, backend="reference"):
        rows = [device_forward(model, Batch.from_arrays(a)).double().numpy() for a in char_batches]
    mean = np.concatenate(rows).mean(0)
    # per-sample features do not depend on the batch a sample shares (its own rows only); the matrix products'
    # rounding may, with another padded width: float32's resolution
    np.testing.assert_allclose(acc.sum / acc.n_samples, mean, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_workers_and_replicas_give_the_numbers_of_the_plain_loop(minilm, segments):
    model, tok = minilm
    kw = dict(max_length=40, batch_size=16, backend="auto")
    base = attnkit.extract(segments, (model, tok), **kw)
    assert base.n_samples == len(segments)
    for extra in (dict(workers=2), dict(devices="cpu,cpu"), dict(workers=2, devices="cpu,cpu")):
        other = attnkit.extract(segments, (model, tok), **kw, **extra)
        assert other.n_samples == base.n_samples and other.n_tokens == base.n_tokens
        np.testing.assert_allclose(other.mean, base.mean, rtol=1e-12, atol=0, err_msg=str(extra))
        np.testing.assert_allclose(other.std, base.std, rtol=1e-12, atol=1e-15, err_msg=str(extra))
    # another window changes the batches (so float rounding), never the per-sample features
    small = attnkit.extract(segments, (model, tok), **kw, window=37)
    np.testing.assert_allclose(small.mean, base.mean, rtol=1e-6, atol=1e-7)


def test_resume_point_continues_the_same_plan(minilm, segments):
    model, tok = minilm
    segs = segments[:60]
    settings = ExtractSettings(max_length=24, batch_size=8, window=25, backend="reference")
    full = run_extraction(model, tok, segs, settings).accumulator
    first = run_extraction(model, tok, segs[:25], settings).accumulator  # window 0 alone: 25 segments, 4 batches
    rest = run_extraction(model, tok, segs, settings, resume=ExtractionState(first, 25), workers=1).accumulator
    np.testing.assert_allclose(rest.sum, full.sum, rtol=1e-12)
    assert rest.n_samples == full.n_samples == 60


class _Boom(Exception):
    pass


def test_failing_worker_ends_the_run_with_a_message(minilm, segments, monkeypatch):
    from attnkit.tokens import Encoder

    model, tok = minilm
    original = Encoder.encode_arrays

    def failing(self, segs):
        if any("grandmother" in (s if isinstance(s, str) else s[0]) for s in segs):
            raise _Boom("tokenizer exploded")
        return original(self, segs)

    monkeypatch.setattr(Encoder, "encode_arrays", failing)  # workers fork after this, so they fail too
    with pytest.raises(AttnkitError, match="tokenising batch .* failed in a worker: _Boom: tokenizer exploded"):
        run_extraction(model, tok, segments, ExtractSettings(max_length=24, batch_size=8, backend="reference"),
                       workers=2)


def test_killed_worker_ends_the_run_instead_of_hanging(minilm, segments):
    model, tok = minilm
    victims = []
    seen = {"n": 0}

    def on_batch(*_):
        seen["n"] += 1
        if seen["n"] == 2:  # kill one tokenisation worker in the middle of the run
            import multiprocessing

            kids = multiprocessing.active_children()
            assert kids
            victims.append(kids[0].pid)
            os.kill(kids[0].pid, signal.SIGKILL)

    done = {}

    def target():
        try:
            run_extraction(model, tok, segments * 3, ExtractSettings(max_length=24, batch_size=4, backend="reference"),
                           workers=2, on_batch=on_batch)
            done["result"] = "finished"
        except AttnkitError as exc:
            done["result"] = str(exc)

    th = threading.Thread(target=target)
    th.start()
    th.join(timeout=120)
    assert not th.is_alive(), "the run hung after a worker died"
    assert victims and "worker process died" in done["result"]


def test_replica_failure_is_reported(minilm, segments):
    from attnkit.engine.local import run_pipeline
    from attnkit.tokens import Encoder

    model, tok = minilm

    def broken(m, batch):
        raise RuntimeError("device lost")

    with pytest.raises(AttnkitError, match="device lost"):
        run_pipeline([model, model], Encoder(tok, max_length=16), plan_batches(segments, 8, 64), broken,
                     on_result=lambda r: None)


def test_devices_are_parsed_and_checked():
    import torch

    from attnkit.engine.devices import device_labels, parse_devices

    assert [str(d) for d in parse_devices("cpu,cpu")] == ["cpu", "cpu"]
    assert device_labels(parse_devices("cpu,cpu")) == ["cpu#0", "cpu#1"]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert [str(d) for d in parse_devices("all")] == ([f"cuda:{i}" for i in range(gpus)] or ["cpu"])
    with pytest.raises(AttnkitError, match="unknown device"):
        parse_devices("tpu:0")
    with pytest.raises(AttnkitError, match="empty entry"):
        parse_devices("cpu,,cpu")


def test_max_length_too_short_for_pairs_is_refused(minilm):
    from attnkit.tokens import Encoder

    _, tok = minilm
    with pytest.raises(AttnkitError, match="too short for text pairs"):
        Encoder(tok, max_length=4).encode_arrays([("a question", "a context")])
    arrays = Encoder(tok, max_length=5).encode_arrays([("one two three", "four five six")])
    assert arrays.inputs["input_ids"].shape[1] == 5 and arrays.n_truncated == 1
    assert arrays.full_lengths.tolist() == [9]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc to find child processes")
def test_workers_die_with_a_killed_run(tmp_path, paused_extract):
    """SIGKILL leaves no chance to shut the pool down: the workers must still not outlive the run."""
    import select

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"Line number {i} of a corpus, long enough to take a while.\n" for i in range(2000)))
    # the run stands still after its first checkpoint, its workers running (tests/paused_extract.py); threads
    # given too, so no result is held back while a thread count is measured (its first checkpoint could then
    # come after the last batch, the workers gone)
    proc = paused_extract(["extract", corpus, "-o", tmp_path / "r", "-q", "--workers", 2, "--threads", 1,
                           "--backend", "reference", "--max-length", 16, "--checkpoint-every", 1])

    def children(pid):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    workers = children(proc.pid)
    assert len(workers) == 2, workers
    pidfds = {p: os.pidfd_open(p) for p in workers}  # readable once the process has exited
    proc.kill()
    proc.wait(timeout=30)
    for pid, fd in pidfds.items():
        ready, _, _ = select.select([fd], [], [], 30)  # the kernel kills them with their parent (PR_SET_PDEATHSIG)
        os.close(fd)
        assert ready or not running(pid), f"tokenisation worker {pid} outlived its run"


def test_api_arguments_of_the_wrong_kind_are_refused(minilm):
    for kw, message in ((dict(max_length=32.5), "max_length must be an integer"),
                        (dict(observers=[1]), "observers must be callables"),
                        (dict(batch_size=0), "batch_size must be a positive integer")):
        with pytest.raises(AttnkitError, match=message):
            attnkit.extract(["a b"], minilm, **kw)


# --- issue 21 -------------------------------------------------------------------------------------------------
def test_workers_do_not_inherit_the_parents_sigterm_handler(minilm, monkeypatch):
    """The extract job turns SIGTERM into KeyboardInterrupt in its process (to save a checkpoint); a worker that
    inherited that handler printed a traceback when the pool terminated it."""
    from attnkit.engine.local import TokenizerPool
    from attnkit.tokens import Encoder

    _, tok = minilm
    monkeypatch.setattr(Encoder, "encode_arrays", lambda self, segs: signal.getsignal(signal.SIGTERM))

    def parents_handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, parents_handler)
    try:
        with TokenizerPool(Encoder(tok, max_length=16), workers=1) as pool:
            seen = [handler for _, handler in pool.map(plan_batches(["a b", "c d"], 1, 8))]
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == [signal.SIG_DFL, signal.SIG_DFL]


def test_workers_are_bounded_by_the_cores_and_by_the_plan():
    from attnkit.engine.local import TASK_BATCHES, check_workers, default_workers, max_workers, workers_for_plan

    assert check_workers(max_workers()) == max_workers()
    assert check_workers(10**11) == 10**11  # accepted; a run uses at most one per core, and says so (tuning.py)
    with pytest.raises(AttnkitError, match=r"^workers must be an integer of at least 0, got -1$"):
        check_workers(-1)
    n_batches = 2 * TASK_BATCHES + 2  # 3 tasks
    plan = list(plan_batches([f"s{i}" for i in range(n_batches)], 1, 4))
    for asked, used in ((8, 3), (2, 2), (0, 0)):
        n, again = workers_for_plan(iter(plan), asked)
        assert n == used and list(again) == plan  # read ahead, then given back whole
    # a CPU model's team of torch threads has every core: its batches are tokenised in turn with its forwards
    assert default_workers("cpu") == 0


def _record_forward_threads(monkeypatch, record):
    """Make extraction's forward call `record()` (on whatever thread runs it) before the real forward."""
    import importlib

    from attnkit.engine.forward import device_forward

    def forward(m, batch):
        record()
        return device_forward(m, batch)

    monkeypatch.setattr(importlib.import_module("attnkit.engine.extract"), "device_forward", forward)


def test_a_cpu_forward_runs_on_the_calling_thread(minilm, segments, monkeypatch):
    """libgomp's threads wait by spinning while one thread runs torch and sleep once a second thread has (docs/
    pipeline.md §4): a device thread made short inputs 1.5x slower than the caller's own loop. A CPU forward runs on
    the thread that called, with or without tokenisation workers, also when that is not the main thread (whose
    torch has run: this process loaded the model there)."""
    model, tok = minilm
    idents = []
    _record_forward_threads(monkeypatch, lambda: idents.append(threading.get_ident()))
    settings = ExtractSettings(max_length=16, batch_size=8, backend="reference")
    for workers in (0, 1):
        idents.clear()
        run_extraction(model, tok, segments[:20], settings, workers=workers)
        assert idents and set(idents) == {threading.get_ident()}, workers
    idents.clear()
    caller = {}

    def call():
        caller["ident"] = threading.get_ident()
        run_extraction(model, tok, segments[:20], settings)

    th = threading.Thread(target=call)
    th.start()
    th.join()
    assert len(idents) == 3 and set(idents) == {caller["ident"]} != {threading.get_ident()}


def test_gpus_and_several_replicas_get_a_thread_each(minilm, segments, monkeypatch):
    """A GPU keeps a device thread (it queues the next batch's copies and kernels while the caller tokenises);
    several replicas run side by side on threads of their own."""
    import torch

    from attnkit.engine.devices import replicate
    from attnkit.engine.local import runs_on_caller

    assert runs_on_caller([torch.device("cpu")])
    assert not runs_on_caller([torch.device("cuda:0")])
    assert not runs_on_caller([torch.device("cuda:0"), torch.device("cuda:1")])
    assert not runs_on_caller([torch.device("cpu"), torch.device("cpu")])
    model, tok = minilm
    idents = set()
    _record_forward_threads(monkeypatch, lambda: idents.add(threading.get_ident()))
    run_extraction(model, tok, segments[:40], ExtractSettings(max_length=16, batch_size=8, backend="reference"),
                   replicas=replicate(model, [torch.device("cpu")] * 2)[1:])
    assert idents and threading.get_ident() not in idents


# --- issue 38: the caller tokenises while it waits; tasks; the tokenizer's own threads ---------------------------
def _arrays_equal(a, b) -> bool:
    return (a.inputs.keys() == b.inputs.keys() and all(np.array_equal(a.inputs[k], b.inputs[k]) for k in a.inputs)
            and np.array_equal(a.lengths, b.lengths) and np.array_equal(a.token_class, b.token_class)
            and np.array_equal(a.sentence_id, b.sentence_id) and a.n_tokens == b.n_tokens)


class _CallerGate:
    """Tokenisation workers wait at `passing()` until the calling process has passed it 3 times itself (`here`
    counts the caller's passes), or until `release` exists otherwise; after 60 s a worker gives up, and its run
    fails. No `release`: nobody waits."""

    def __init__(self, release=None):
        self.parent, self.release, self.here = os.getpid(), release, 0

    def passing(self) -> None:
        if os.getpid() != self.parent:  # a worker: wait for the caller
            deadline = time.monotonic() + 60
            while self.release is not None and not self.release.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the caller never tokenised a batch itself")
                time.sleep(0.005)
        else:
            self.here += 1
            if self.release is not None and self.here == 3:
                self.release.touch()


@pytest.mark.parametrize("help_here", [True, False])
def test_the_caller_tokenises_while_a_worker_is_busy_and_batches_stay_in_plan_order(minilm, segments, tmp_path,
                                                                                    monkeypatch, help_here):
    """A worker that cannot go on until the caller has tokenised 3 batches itself: with `help_here` the caller does
    so instead of waiting, and the batches still come out in plan order with the arrays of the plain loop. Without
    it the caller only waits (the worker is released at once)."""
    from attnkit.engine.local import TokenizerPool
    from attnkit.tokens import Encoder

    _, tok = minilm
    release = tmp_path / "release"
    gate = _CallerGate(release)
    original = Encoder.encode_arrays

    def gated(self, segs):
        gate.passing()
        return original(self, segs)

    if not help_here:
        release.touch()
    monkeypatch.setattr(Encoder, "encode_arrays", gated)  # the worker forks after this
    encoder = Encoder(tok, max_length=24)
    plan = list(plan_batches(segments[:120], 4, 40))
    with TokenizerPool(encoder, workers=1, prefetch=2, help_here=help_here) as pool:  # batches left to help with
        got = list(pool.map(iter(plan)))
        helped = pool.helped
    monkeypatch.setattr(Encoder, "encode_arrays", original)
    assert [pb.index for pb, _ in got] == [pb.index for pb in plan]
    plain = [encoder.encode_arrays(pb.segments) for pb in plan]
    assert all(_arrays_equal(a, b) for (_, a), b in zip(got, plain))
    assert helped >= 3 if help_here else helped == 0
    assert helped == gate.here


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork on Linux only")
def test_a_forked_worker_leaves_the_objects_it_inherits_out_of_its_collections(minilm, monkeypatch):
    """A worker's full collection would scan every object forked from the parent (torch, transformers) and write
    to their pages: it stalled a run for a few hundred milliseconds. They are frozen in the worker, and the
    parent's collector is left as it was."""
    import gc

    from attnkit.engine.local import TokenizerPool
    from attnkit.tokens import Encoder

    parent, before = os.getpid(), gc.get_freeze_count()

    def report(self, segs):  # runs in the worker: its frozen objects, as the task's failure
        if os.getpid() != parent:
            raise RuntimeError(f"frozen {gc.get_freeze_count()} of {len(gc.get_objects()) + gc.get_freeze_count()}")
        return []

    monkeypatch.setattr(Encoder, "encode_arrays", report)  # the worker forks after this
    with TokenizerPool(Encoder(minilm[1], max_length=24), workers=1) as pool:
        with pytest.raises(AttnkitError, match="frozen") as err:
            list(pool.map(iter(plan_batches(["a line"] * 4, 2, 100))))
    frozen, total = map(int, re.search(r"frozen (\d+) of (\d+)", str(err.value)).groups())
    assert frozen > 0.9 * total and frozen > 10_000  # about everything: torch and transformers are loaded
    assert gc.get_freeze_count() == before


class _Marker:
    """An encoder whose "arrays" name the batch they came from (the pool passes them on as they are): a run of
    `map` whose tasks are megabytes of text costs no tokenizer time. Its workers wait at `gate`."""

    def __init__(self, gate: _CallerGate):
        self.gate = gate

    def encode_arrays(self, segments):
        self.gate.passing()
        return (segments[0][-6:], len(segments))


@pytest.mark.parametrize("help_here", [True, False])
@pytest.mark.parametrize("char", ["a", "語"])
def test_a_pool_returns_every_batch_in_order_whatever_its_text_weighs(char, help_here):
    """Megabytes of text (3 bytes a character in UTF-8 for "語") through 2 workers: every planned batch comes back
    once, in plan order, whether the tasks fit in a task pipe or wait for room there."""
    from attnkit.engine.local import TokenizerPool

    texts = [char * 12_000 + f"{i:06d}" for i in range(300)]  # 8 a task: 96,000 characters, 288 KB for "語"
    plan = list(plan_batches(texts, 1, 10**6))
    with TokenizerPool(_Marker(_CallerGate()), workers=2, help_here=help_here) as pool:
        got = list(pool.map(iter(plan)))
    assert [pb.index for pb, _ in got] == [pb.index for pb in plan]
    assert [arrays for _, arrays in got] == [(t[-6:], 1) for t in texts]


def test_a_full_task_pipe_never_stops_the_caller(tmp_path):
    """A worker that cannot go on until the caller has tokenised 3 batches itself, with tasks of 288 KB each: the
    caller sends what fits in the worker's pipe and tokenises the next batches itself. Were it to send a task that
    does not fit, it would wait for a worker that waits for it (the worker gives up after 60 s, and the run
    fails)."""
    from attnkit.engine.local import TokenizerPool

    texts = ["語" * 12_000 + f"{i:06d}" for i in range(120)]
    plan = list(plan_batches(texts, 1, 10**6))
    gate = _CallerGate(tmp_path / "release")
    with TokenizerPool(_Marker(gate), workers=1, help_here=True) as pool:
        got = list(pool.map(iter(plan)))
        helped = pool.helped
    assert [pb.index for pb, _ in got] == [pb.index for pb in plan]
    assert [arrays for _, arrays in got] == [(t[-6:], 1) for t in texts]
    assert helped >= 3 and helped == gate.here


def test_a_task_holds_fewer_batches_where_their_text_is_long(minilm):
    from attnkit.engine.local import TASK_BATCHES, TASK_CHARS, TokenizerPool
    from attnkit.tokens import Encoder

    pool = TokenizerPool(Encoder(minilm[1], max_length=24), workers=1)
    short = iter(plan_batches(["a short line"] * (3 * TASK_BATCHES), 1, 10**6))
    assert len(pool._next_task(short)) == TASK_BATCHES
    long_text = "word " * (TASK_CHARS // 10)  # two of them pass TASK_CHARS
    long = iter(plan_batches([long_text] * 6, 1, 10**6))
    assert len(pool._next_task(long)) == 2 and len(pool._next_task(long)) == 2
    pairs = iter(plan_batches([(long_text, long_text)] * 3, 1, 10**6))  # a pair counts both sides
    assert len(pool._next_task(pairs)) == 1


def test_tasks_in_flight_stay_within_the_task_pipe():
    """A worker always takes TASKS_IN_FLIGHT tasks; a pool the caller helps keeps up to HELPED_TASKS in flight,
    but only while their bytes fit in the task pipe's buffer (where it could be grown), so sending never blocks."""
    from attnkit.engine.local import HELPED_TASKS, PIPE_BYTES, TASKS_IN_FLIGHT, TokenizerPool, _Worker

    w = object.__new__(_Worker)  # its bookkeeping only, no process
    w.pipe_bytes, w.pending = PIPE_BYTES, collections.deque([PIPE_BYTES] * (TASKS_IN_FLIGHT - 1))
    assert w.has_room(PIPE_BYTES)  # fewer than TASKS_IN_FLIGHT: always
    w.pending = collections.deque([100_000] * 8)
    assert w.has_room(PIPE_BYTES - 800_000) and not w.has_room(PIPE_BYTES - 800_000 + 1)
    w.pipe_bytes = 0  # the pipe could not be grown: TASKS_IN_FLIGHT, as before
    w.pending = collections.deque([100] * TASKS_IN_FLIGHT)
    assert not w.has_room(1)
    assert TokenizerPool(None, 2, help_here=True).prefetch == 2 * HELPED_TASKS > 2 * TASKS_IN_FLIGHT
    assert TokenizerPool(None, 2).prefetch == 2 * TASKS_IN_FLIGHT
    assert TokenizerPool(None, 2, prefetch=5, help_here=True).prefetch == 5


def test_a_cpu_run_turns_the_tokenizers_own_threads_off_and_back(minilm, segments, monkeypatch):
    """Torch's threads have the cores: the caller tokenises with the Rust tokenizer's threads off during the run,
    as the workers do, and the caller's setting comes back after it (also after a failure)."""
    from attnkit.tokens import Encoder

    model, tok = minilm
    original = Encoder.encode_arrays
    seen = []

    fail = []

    def recording(self, segs):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        if fail and len(seen) > 1:  # the failing run's second planned unit (attnkit/engine/plan.py)
            raise AttnkitError("the tokenizer failed")
        return original(self, segs)

    monkeypatch.setattr(Encoder, "encode_arrays", recording)
    for before in (None, "true"):
        if before is None:
            monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        else:
            monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)
        seen.clear()
        run_extraction(model, tok, segments[:12], ExtractSettings(max_length=24, batch_size=4, backend="reference"),
                       workers=0)
        assert seen and set(seen) == {"false"}
        assert os.environ.get("TOKENIZERS_PARALLELISM") == before
    fail.append(True)
    seen.clear()
    with pytest.raises(AttnkitError, match="the tokenizer failed"):
        run_extraction(model, tok, segments[:40], ExtractSettings(max_length=24, batch_size=4, backend="reference"),
                       workers=0)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == "true"
