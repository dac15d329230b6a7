"""A pipeline plan that is measured again as the run goes (attnkit/engine/tuning.py `Replanner`, issue 46): a plan
measured during a moment the machine gave to others does not hold for the whole run, a machine that stays busy
keeps its plan, one that becomes quiet takes back both cores, and no re-plan changes a number.

Every measurement here is scripted (a `Stopwatch` that says how long each piece of work took on a machine whose
rates change with its own clock): nothing races the real machine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attnkit.engine import local, tuning
from attnkit.engine.extract import ExtractSettings, run_extraction
from attnkit.engine.tuning import AUTO, PipelineChoice, Replanner, choose
from attnkit.errors import AttnkitError
from attnkit.run.schemas import META_SCHEMA, validate


class Machine(tuning.Stopwatch):
    """A scripted machine: `phases` are (from second, tokenising tok/s per process, {threads: forward tok/s});
    its clock advances with the forwards it times (tokenising is scripted but moves no clock: how much of it the
    calling thread does while it waits for a worker depends on the real machine)."""

    def __init__(self, phases):
        self.t, self.phases = 0.0, phases

    def now(self) -> float:
        return self.t

    def rates(self):
        return [p for p in self.phases if p[0] <= self.t][-1]

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def took(self, kind, n_tokens, seconds, threads=None):
        _, tokenise, forward = self.rates()
        if kind == "tokenise":
            return n_tokens / tokenise
        dt = n_tokens / forward[threads]
        self.t += dt
        return dt


def measured(tokenise, forward, cores=2) -> PipelineChoice:
    """The choice `calibrate` makes from these rates."""
    w, n = choose(tokenise, tuning.forward_rates(forward, cores), cores)
    return PipelineChoice(w, n, "measured", cores, tokenise, dict(forward))


def interval(plan: Replanner, watch: Machine, tokenise=None, forward=None, threads=None) -> bool:
    """One REPLAN_SECONDS of the run, measuring these rates (tok/s of 1,000 tokens), then the re-check."""
    if tokenise is not None:
        plan.observe("tokenise", 1000, 1000 / tokenise)
    if forward is not None:
        plan.observe("forward", 1000, 1000 / forward, threads or plan.threads_now())
    watch.advance(tuning.REPLAN_SECONDS)
    return plan.recheck(done=100)


# --- the decisions, from scripted rates ----------------------------------------------------------------------------
def test_a_plan_measured_in_a_spike_is_measured_again_and_changed():
    """Issue 46's resume: tokenising measured at 6,174 tok/s (333,726 at the first start) made a forward-bound run
    take 1 worker and 1 thread. The run's own tokenising says otherwise: the plan is measured again, the other
    thread count included, and the run takes both cores for its forwards."""
    watch = Machine([])
    choice = measured(6_174, {2: 180_000, 1: 100_000})
    assert (choice.workers, choice.threads) == (1, 1)
    plan = Replanner(choice, watch)
    # the first interval: the worker's tasks tokenise at 333,726 tok/s, the forwards as measured
    assert not interval(plan, watch, tokenise=333_726, forward=100_000)
    assert plan.exploring == 2 and plan.threads_now() == 2 and not choice.replans  # the next run: 2 threads
    interval(plan, watch, forward=180_000, threads=2)
    assert plan.exploring is None and choice.threads == 2
    assert choice.initial == (1, 1) and len(choice.replans) == 1
    change = choice.replans[0]
    assert change["threads"] == 2 and change["workers"] == choice.workers and change["after_segments"] == 100
    assert change["tokenise_tokens_per_s"] == 333_726 and change["forward_tokens_per_s"] == {"1": 100_000.0,
                                                                                           "2": 180_000.0}
    assert change["seconds"] == 2 * tuning.REPLAN_SECONDS
    meta = choice.meta()
    assert meta["initial"] == {"workers": 1, "threads": 1} and meta["replans"] == [change]
    validate({"pipeline": meta}, META_SCHEMA, "meta.json")  # what meta.json's readers check
    with pytest.raises(AttnkitError, match=r"meta.json: field pipeline.replans\[0\].threads"):
        validate({"pipeline": dict(meta, replans=[dict(change, threads=0)])}, META_SCHEMA, "meta.json")
    assert meta["threads"] == 2  # the final choice: the count the numbers are those of
    assert "re-planned after 100 segment(s), 2.0 s: tokenising 333,726 tok/s" in choice.line()


def test_a_machine_that_stays_busy_keeps_the_busy_plan():
    """Busy from the start to the end: what the run measures agrees with the plan (within DRIFT, however it
    wavers), nothing changes, and once the plan held for SETTLE_SECONDS the thread count is fixed."""
    watch = Machine([])
    choice = measured(330_000, {2: 105_000, 1: 105_000})  # a 2-thread neighbour: a second thread buys nothing
    assert (choice.workers, choice.threads) == (1, 1)
    plan = Replanner(choice, watch)
    for tok, fwd in [(300_000, 90_000), (360_000, 115_000), (250_000, 80_000), (330_000, 105_000)] * 2:
        assert not interval(plan, watch, tokenise=tok, forward=fwd)
        assert plan.exploring is None
    assert (choice.workers, choice.threads) == (1, 1) and not choice.replans
    assert not plan.threads_open and "replans" not in choice.meta()


def test_a_machine_that_becomes_quiet_takes_back_both_cores():
    """Busy while measured (a second thread bought nothing), then quiet: the run measures faster than its plan,
    measures the second thread again, and runs the forwards on both cores."""
    watch = Machine([])
    choice = measured(330_000, {2: 105_000, 1: 105_000})
    plan = Replanner(choice, watch)
    interval(plan, watch, tokenise=330_000, forward=105_000)  # still busy
    interval(plan, watch, tokenise=1_000_000, forward=210_000)  # quiet: both rates off by more than DRIFT
    assert plan.exploring == 2
    interval(plan, watch, forward=400_000, threads=2)
    assert choice.threads == 2 and choice.replans[-1]["forward_tokens_per_s"] == {"1": 210_000.0, "2": 400_000.0}


def test_a_machine_whose_load_keeps_changing_changes_the_thread_count_twice_at_most():
    """Busy, quiet, busy, quiet...: each change of the thread count measures the held results again, so after the
    second the count is fixed (the results are delivered) and only the workers follow."""
    watch = Machine([])
    choice = measured(330_000, {2: 105_000, 1: 105_000})
    plan = Replanner(choice, watch)
    interval(plan, watch, tokenise=1_000_000, forward=210_000)  # quiet
    interval(plan, watch, forward=400_000, threads=2)
    assert choice.threads == 2 and plan.threads_open
    interval(plan, watch, tokenise=330_000, forward=105_000)  # busy again: a second thread buys nothing
    interval(plan, watch, forward=105_000, threads=1)
    assert choice.threads == 1 and not plan.threads_open and plan.exploring is None
    interval(plan, watch, tokenise=1_000_000, forward=210_000)  # quiet again: no exploring, the threads stay
    assert plan.exploring is None and choice.threads == 1
    assert [r["threads"] for r in choice.replans] == [2, 1]


def test_once_the_threads_are_fixed_a_replan_changes_the_workers_only():
    """After SETTLE_SECONDS of a plan that holds, the results are no longer held back: a later change of the
    thread count would change numbers already delivered, so only the workers follow the machine."""
    watch = Machine([])
    choice = measured(10_000_000, {2: 400_000, 1: 210_000})
    assert (choice.workers, choice.threads) == (0, 2)  # tokenising is negligible
    plan = Replanner(choice, watch)
    while plan.threads_open:
        interval(plan, watch, tokenise=10_000_000, forward=400_000)
    # tokenising slows fiftyfold: a worker takes it off the forwards' thread, the threads stay
    assert interval(plan, watch, tokenise=200_000, forward=400_000)
    assert plan.exploring is None and (choice.workers, choice.threads) == (1, 2)
    assert choice.replans[-1]["workers"] == 1


def test_given_values_are_kept_and_unmeasured_plans_are_not_replanned():
    watch = Machine([])
    plan = Replanner(measured(6_174, {2: 180_000, 1: 100_000}), watch, workers=1)  # --workers 1: threads only
    interval(plan, watch, tokenise=333_726, forward=100_000)
    interval(plan, watch, forward=180_000, threads=2)
    assert (plan.choice.workers, plan.choice.threads) == (1, 2)
    for how in ("given", "short run", "one core"):
        plan = Replanner(PipelineChoice(0, 2, how, 2), watch)
        assert not plan.active and not plan.threads_open and not plan.due()


# --- a run, on a scripted machine ----------------------------------------------------------------------------------
TEXTS = [f"Sentence {i}, with {'many ' * (i % 7)}words and a period." for i in range(96)]
SETTINGS = ExtractSettings(max_length=24, batch_size=1, backend="reference")  # a unit per sample: many re-checks


@pytest.fixture
def machine(monkeypatch):
    """A run on a scripted machine: 2 cores, torch at 2 threads, one planned unit per run of forwards (so where
    the re-checks fall does not depend on the real machine's speed), the thread count open to the end (so where
    the worker's tasks arrive cannot close it early). Rates are in tokens per second of the machine's own clock:
    a forward of 15 tokens takes about a tenth of a second."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(local, "max_workers", lambda: 2)
    monkeypatch.setattr(local, "RUN_BATCHES", 1)
    monkeypatch.setattr(tuning, "SETTLE_SECONDS", 1e9)
    yield lambda phases: monkeypatch.setattr(local, "Stopwatch", lambda: Machine(phases))
    torch.set_num_threads(before)


def run(minilm, **kw):
    model, tok = minilm
    chosen = []
    state = run_extraction(model, tok, TEXTS, SETTINGS, on_choice=chosen.append, **kw)
    return state.accumulator, chosen


def npz(acc, path):
    acc.result({}).save(path)
    with np.load(path / "features.npz") as f:
        return {k: f[k] for k in f.files}


def test_a_run_replanned_twice_gives_the_numbers_of_its_final_choice_given_by_hand(minilm, machine, tmp_path,
                                                                                   monkeypatch):
    """A spike while the run measures its plan (tokenising at 6 tok/s: 1 worker, 1 thread), then a quiet machine
    (the second thread comes back), then a neighbour that makes a second thread slower than one (back to 1): the
    results of the forwards that ran with 2 threads were held back and are measured again with 1, so the run's
    features.npz is the one of `--workers 1 --threads 1`, bit for bit. (Here 1 and 2 threads round alike, so the
    features are made to show the thread count they ran with, as a machine whose products round otherwise would.)"""
    unit_features = local.unit_features
    monkeypatch.setattr(local, "unit_features", lambda *a, **k: unit_features(*a, **k) + torch.get_num_threads())
    machine([(0.0, 6, {1: 100, 2: 180}), (1.0, 300, {1: 100, 2: 180}), (5.0, 300, {1: 90, 2: 60})])
    auto, chosen = run(minilm, workers=AUTO, threads=AUTO)
    choice = chosen[0]
    assert all(c is choice for c in chosen) and len(chosen) == 1 + len(choice.replans)  # a line per change
    assert choice.initial == (1, 1)
    assert [(r["workers"], r["threads"]) for r in choice.replans] == [(1, 2), (1, 1)]
    assert (choice.workers, choice.threads) == (1, 1)
    assert torch.get_num_threads() == 2  # the caller's count, restored
    machine([(0.0, 300, {1: 100, 2: 180})])
    given, chosen = run(minilm, workers=1, threads=1)
    assert chosen[0].how == "given" and not chosen[0].replans
    a, b = npz(auto, tmp_path / "auto"), npz(given, tmp_path / "given")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f"), k
    assert auto.n_samples == len(TEXTS) and np.array_equal(auto.m2, given.m2)


def test_a_quiet_run_is_not_replanned_and_delivers_every_result_once(minilm, machine):
    machine([(0.0, 300, {1: 100, 2: 180})])
    acc, chosen = run(minilm, workers=AUTO, threads=AUTO)
    assert not chosen[0].replans and len(chosen) == 1 and acc.n_samples == len(TEXTS)


def test_an_interrupted_run_delivers_what_it_held(minilm, machine, monkeypatch):
    """Ctrl-C while the results are held back: they are delivered as they ran, in plan order, so the checkpoint
    keeps them (raised from the forward itself, at a known unit: no signal races the run)."""
    machine([(0.0, 300, {1: 100, 2: 180})])
    calls = []
    unit_features = local.unit_features

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 20:  # the probe's 4 units ran twice (2 threads, then 1); 11 more units since
            raise KeyboardInterrupt
        return unit_features(*a, **k)

    monkeypatch.setattr(local, "unit_features", interrupted)
    delivered = []
    with pytest.raises(KeyboardInterrupt):
        run(minilm, workers=AUTO, threads=AUTO, on_batch=lambda state, res: delivered.append(res.planned.index))
    assert delivered == list(range(15))


def test_a_run_whose_tokenising_slows_takes_a_worker_midway_in_plan_order(minilm, machine, tmp_path):
    """Tokenising negligible at the start (no workers), fifty times slower from the second second: the run starts a
    worker for the rest of the plan (the first pool finishes what it was given) and delivers every result once, in
    plan order: its features.npz is the one of `--workers 1 --threads 2`."""
    machine([(0.0, 10_000, {1: 100, 2: 180}), (2.0, 200, {1: 100, 2: 180})])
    auto, chosen = run(minilm, workers=AUTO, threads=AUTO)
    choice = chosen[0]
    assert choice.initial == (0, 2) and [(r["workers"], r["threads"]) for r in choice.replans] == [(1, 2)]
    given, _ = run(minilm, workers=1, threads=2)
    a, b = npz(auto, tmp_path / "auto"), npz(given, tmp_path / "given")
    for k in a:
        assert np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f"), k
    assert auto.n_samples == len(TEXTS)


def test_the_page_states_the_rule_the_code_applies():
    """docs/pipeline.md §4 gives the re-plan's figures in words: they are tuning.py's."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text().split())
    assert tuning.REPLAN_SECONDS == 1.0 and "every second of the run" in text
    assert f"Within {tuning.DRIFT:g}× of the plan's" in text
    assert f"estimate is below {tuning.GAIN:g} of the current one's" in text
    assert f"has held for {tuning.SETTLE_SECONDS:g} s since the last change of threads" in text
    assert f"take less than {tuning.HOLD_BYTES >> 20} MiB" in text
    assert tuning.MAX_THREAD_CHANGES == 2 and "for two changes at most" in text
