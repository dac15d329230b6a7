"""A pipeline that plans itself (attnkit/engine/tuning.py) and one thread regime for every command
(attnkit/engine/openmp.py): the choice from measured rates, what a run says and records, user values winning,
more workers than cores, one core, and numbers that do not depend on any of it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnkit
from attnkit.engine import local, openmp, tuning
from attnkit.engine.extract import ExtractSettings, run_extraction
from attnkit.engine.tuning import AUTO, choose, forward_rates

ROOT = Path(__file__).resolve().parent.parent


# --- the choice, from rates (tokens/s) ---------------------------------------------------------------------------
def test_a_tokenise_bound_run_gets_workers_and_a_forward_bound_run_none():
    # issue 38's tokenise-bound case on 2 cores: tokenising 4.9 s, forwards 2.4 s with 2 threads (3.6 s with 1)
    tok, fwd = 1 / 4.9, {2: 1 / 2.4, 1: 1 / 3.6}
    # one worker tokenises, the caller runs the forwards on one thread and tokenises in the time they leave it
    assert choose(tok, fwd, cores=2) == (1, 1)
    # MiniLM on sentences: tokenising is 5% of a forward
    assert choose(1 / 0.13, {2: 1 / 2.6, 1: 1 / 4.2}, cores=2) == (0, 2)
    # given values stay; the other is chosen around them
    assert choose(tok, fwd, cores=2, workers=0) == (0, 2)
    assert choose(tok, fwd, cores=2, threads=2) == (1, 2)  # ties go to fewer workers
    # without a 1-thread rate only the measured count is a candidate
    assert choose(tok, {2: 1 / 2.4}, cores=2)[1] == 2


def test_forward_rates_between_one_thread_and_the_most_measured():
    assert forward_rates({1: 100.0, 4: 250.0}, cores=4) == {1: 100.0, 2: 150.0, 3: 200.0, 4: 250.0}
    assert forward_rates({2: 80.0}, cores=2) == {2: 80.0}


def test_the_line_and_meta_say_what_was_chosen_and_why():
    c = tuning.PipelineChoice(2, 1, "measured", 2, 1000.0, {2: 500.0, 1: 300.0})
    assert c.line() == ("pipeline: 2 tokenisation worker(s), 1 torch thread(s) on 2 core(s) (measured: tokenising "
                        "1,000 tok/s per process, forward 300 at 1 thread(s), 500 at 2 thread(s))")
    assert c.meta() == {"workers": 2, "threads": 1, "how": "measured", "cores": 2, "tokenise_tokens_per_s": 1000.0,
                        "forward_tokens_per_s": {"1": 300.0, "2": 500.0}}


# --- runs ---------------------------------------------------------------------------------------------------------
SETTINGS = ExtractSettings(max_length=24, batch_size=4, backend="reference")


@pytest.fixture(scope="module")
def texts(minilm):
    return [f"Sentence {i}, with {'many ' * (i % 7)}words and a period." for i in range(60)]


def extracted(minilm, texts, **kw):
    model, tok = minilm
    chosen = []
    state = run_extraction(model, tok, texts, SETTINGS, on_choice=chosen.append, **kw)
    return state.accumulator, chosen


def test_a_measured_choice_gives_the_numbers_of_the_same_settings_given_by_hand(minilm, texts, monkeypatch):
    """Whatever is chosen, the run's numbers are those of a run given that choice: the probe batches measured with
    another thread count are measured again with the chosen one."""
    before = torch.get_num_threads()
    monkeypatch.setattr(local, "max_workers", lambda: 2)
    for forced in ((1, 1), (0, before), (2, before)):
        monkeypatch.setattr(tuning, "choose", lambda *a, forced=forced, **k: forced)
        auto, chosen = extracted(minilm, texts, workers=AUTO, threads=AUTO)
        assert len(chosen) == 1 and (chosen[0].workers, chosen[0].threads) == forced
        assert chosen[0].how == "measured" and chosen[0].tokenise > 0 and before in chosen[0].forward
        assert torch.get_num_threads() == before  # the caller's count is restored
        fixed, given = extracted(minilm, texts, workers=forced[0], threads=forced[1])
        assert given[0].how == "given"
        assert auto.n_samples == fixed.n_samples == len(texts) and auto.n_tokens == fixed.n_tokens
        np.testing.assert_allclose(auto.result({}).mean, fixed.result({}).mean, rtol=1e-12, atol=0)
        np.testing.assert_allclose(auto.result({}).std, fixed.result({}).std, rtol=1e-12, atol=1e-15)


def test_more_workers_than_cores_and_one_core_still_run_and_say_so(minilm, texts, monkeypatch):
    monkeypatch.setattr(local, "max_workers", lambda: 2)
    acc, chosen = extracted(minilm, texts, workers=5)
    assert acc.n_samples == len(texts) and chosen[0].workers == 2
    assert "5 workers asked for, more than the 2 core(s): 2 used" in chosen[0].line()
    monkeypatch.setattr(local, "max_workers", lambda: 1)
    acc, chosen = extracted(minilm, texts, workers=AUTO, threads=AUTO)
    assert acc.n_samples == len(texts)
    assert (chosen[0].workers, chosen[0].threads, chosen[0].how) == (0, 1, "one core")
    assert "on 1 core(s) (one core)" in chosen[0].line()


def test_a_short_run_is_not_measured(minilm, texts):
    acc, chosen = extracted(minilm, texts[:8], workers=AUTO, threads=AUTO)
    assert acc.n_samples == 8 and chosen[0].how == "short run" and chosen[0].workers == 0


# --- the thread regime ------------------------------------------------------------------------------------------
def test_the_regime_follows_the_machine_and_the_user_wins():
    env = {}
    assert openmp.configure(env, {}, others=lambda: 0.1) == f"GOMP_SPINCOUNT={openmp.SPINCOUNT}"
    env = {}
    assert openmp.configure(env, {}, others=lambda: 2.0) == "OMP_WAIT_POLICY=PASSIVE" and env == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    env = {"GOMP_SPINCOUNT": "123"}
    assert openmp.configure(env, {}, others=lambda: 2.0) == "GOMP_SPINCOUNT=123" and env == {"GOMP_SPINCOUNT": "123"}
    env = {}  # a notebook that has imported torch: libgomp has read its variables, nothing is set
    assert openmp.configure(env, {"torch": torch}, others=lambda: 2.0).endswith("(torch was already loaded)")
    assert env == {}
    others = openmp.runnable_others(samples=3, seconds=0.0)
    assert others is None or others >= 0


def cli_extract(out: Path, corpus: Path, env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in openmp.VARIABLES}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "attnkit.cli", "extract", str(corpus), "-o", str(out), "-q",
                          "--max-length", "16", "--batch-size", "4"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "meta.json").read_text())


def test_every_command_decides_before_torch_loads_and_no_number_changes(tmp_path):
    """The command line sets the regime before torch loads (meta.json records what libgomp read); a user's
    variable wins; spinning and sleeping waits give identical features."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"Line {i}, of the corpus." for i in range(12)) + "\n")
    chosen = cli_extract(tmp_path / "a", corpus, {})
    assert chosen["waits"] in (f"GOMP_SPINCOUNT={openmp.SPINCOUNT}", "OMP_WAIT_POLICY=PASSIVE")
    passive = cli_extract(tmp_path / "b", corpus, {"OMP_WAIT_POLICY": "PASSIVE"})
    assert passive["waits"] == "OMP_WAIT_POLICY=PASSIVE"
    spin = cli_extract(tmp_path / "c", corpus, {"GOMP_SPINCOUNT": "300000"})
    assert spin["waits"] == "GOMP_SPINCOUNT=300000"
    assert passive["threads"] == spin["threads"] and passive["pipeline"]["how"] == "short run"
    a, b = attnkit.HeadFeatures.load(tmp_path / "b"), attnkit.HeadFeatures.load(tmp_path / "c")
    np.testing.assert_array_equal(a.mean, b.mean)
    np.testing.assert_array_equal(a.std, b.std)


def test_the_thread_count_moves_no_number_beyond_blas_rounding(minilm, texts):
    """1 and 2 torch threads: the same batches, so the same numbers up to how BLAS splits a product over threads
    (docs/pipeline.md §3: 5.5e-9 of the largest value on one machine, bit-identical on another). The tolerance
    is that rounding, far below any difference a feature could show."""
    one, _ = extracted(minilm, texts, threads=1)
    two, _ = extracted(minilm, texts, threads=2, workers=2)
    a, b = one.result({}), two.result({})
    assert one.n_tokens == two.n_tokens
    scale = np.abs(a.mean).max()
    np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=1e-6 * scale)
