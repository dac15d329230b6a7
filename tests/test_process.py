"""Every change attnkit makes to the process (attnkit/process.py, docs/process.md): listed while it holds, undone
when its scope ends (KeyboardInterrupt included), kept from happening by its opt-out variable; no allocator of
attnkit's in any forward; the cores of a container read from its cgroup; meta.json's
OpenMP variables only those libgomp read."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import process
from attnkit.engine import openmp
from attnkit.engine.forward import forward_features, measuring
from attnkit.errors import AttnkitError
from attnkit.models import attention_modules
from attnkit.tokens import Batch
from tests.synthetic import tiny_bert, tiny_decoder

ROOT = Path(__file__).resolve().parent.parent


def batch_of(model, B=2, L=7):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(100, model.config.vocab_size), (B, L), generator=g)
    lengths = torch.tensor([L, L - 2][:B])
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    return Batch({"input_ids": ids, "attention_mask": mask}, lengths, torch.zeros(B, L, dtype=torch.long),
                 torch.zeros(B, L, dtype=torch.int32), 0)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_attnkits_forwards_and_the_users_leave_the_allocator_alone(kind):
    """attnkit has no CPU allocator of its own (docs/process.md, "Memory on the CPU": jemalloc or mimalloc, preloaded,
    reach the peak it reached): neither its measuring forwards nor a user's change anything in the process."""
    model = attnkit.instrument(tiny_bert()[0] if kind == "bert" else tiny_decoder(kind))
    seen = []
    hook = attention_modules(model)[0].register_forward_pre_hook(lambda *_: seen.append(attnkit.process_changes()))
    batch = batch_of(model)
    with torch.inference_mode():
        model(**batch.inputs)  # the user's forward
    with measuring(model, num_windows=4):
        forward_features(model, batch)  # attnkit's
    hook.remove()
    assert seen == [[], []]
    assert "cpu_allocator" not in process.OPT_OUTS and not hasattr(torch.ops.attnkit, "hold_cpu_allocator")


def test_an_opt_out_takes_0_or_1_and_names_a_bad_value(monkeypatch):
    monkeypatch.setenv("ATTNKIT_TORCH_THREADS", "off")
    with pytest.raises(AttnkitError, match="ATTNKIT_TORCH_THREADS must be 0 .* got 'off'"):
        process.allowed("torch_threads")
    monkeypatch.setenv("ATTNKIT_TORCH_THREADS", "1")
    assert process.allowed("torch_threads")
    monkeypatch.setenv("ATTNKIT_TORCH_THREADS", "0")
    assert not process.allowed("torch_threads")


def test_a_scoped_variable_is_listed_and_restored_on_a_keyboard_interrupt(monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    with pytest.raises(KeyboardInterrupt), process.tokenizer_threads_off():
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
        [change] = [c for c in process.process_changes() if c.name == "tokenizer_threads"]
        assert change.opt_out == "ATTNKIT_TOKENIZER_THREADS=0" and "TOKENIZERS_PARALLELISM=false" in change.what
        raise KeyboardInterrupt
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    assert not [c for c in process.process_changes() if c.name == "tokenizer_threads"]
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    with process.tokenizer_threads_off():
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.setenv("ATTNKIT_TOKENIZER_THREADS", "0")
    with process.tokenizer_threads_off() as changed:
        assert not changed and os.environ["TOKENIZERS_PARALLELISM"] == "true"


def test_torch_threads_come_back_on_a_keyboard_interrupt():
    before = torch.get_num_threads()
    with pytest.raises(KeyboardInterrupt), process.torch_threads():
        torch.set_num_threads(before + 1)
        assert [c.name for c in process.process_changes() if c.name == "torch_threads"] == ["torch_threads"]
        raise KeyboardInterrupt
    assert torch.get_num_threads() == before
    assert not [c for c in process.process_changes() if c.name == "torch_threads"]


def test_a_run_with_the_threads_opt_out_keeps_the_callers_count(monkeypatch):
    from attnkit.engine.local import run_pipeline
    from attnkit.engine.plan import plan_batches
    from attnkit.tokens import Encoder

    model, tok = tiny_bert()
    model = attnkit.instrument(model)
    before = torch.get_num_threads()
    counts = []

    def forward(m, b):
        counts.append(torch.get_num_threads())
        with measuring(m, num_windows=4):
            return forward_features(m, b)

    monkeypatch.setenv("ATTNKIT_TORCH_THREADS", "0")
    texts = ["the cat sat on the mat ."] * 4
    run_pipeline([model], Encoder(tok, max_length=16), plan_batches(texts, 2), forward, threads=before + 1,
                 on_result=lambda r: None)
    assert counts and set(counts) == {before} and torch.get_num_threads() == before


def test_process_changes_is_empty_when_nothing_is_held():
    """In a fresh process: `import attnkit` holds only the import hook (until transformers loads, or never with
    ATTNKIT_IMPORT_HOOK=0); nothing after."""
    code = ("import attnkit, json; a = [c.name for c in attnkit.process_changes()]; import transformers; "
            "print(json.dumps([a, [c.name for c in attnkit.process_changes()]]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [["import_hook"], []]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "ATTNKIT_IMPORT_HOOK": "0"}, capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == [[], []]


def test_openmp_variables_stay_only_until_torch_loads_and_meta_records_what_libgomp_read():
    """The command line's regime reaches libgomp and no later subprocess; a variable set after torch loaded is
    not recorded as the regime."""
    code = """
import json, os, subprocess, sys
from attnkit.engine import openmp
from attnkit import process
regime = openmp.configure(others=lambda: 2.0)
during = os.environ.get("OMP_WAIT_POLICY")
import torch
after = os.environ.get("OMP_WAIT_POLICY")
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                       capture_output=True, text=True).stdout.strip()
os.environ["GOMP_SPINCOUNT"] = "5"  # too late: libgomp has read its variables
print(json.dumps([regime, during, after, child, openmp.wait_regime(), [c.name for c in process.process_changes()]]))
"""
    env = {k: v for k, v in os.environ.items() if k not in openmp.VARIABLES}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    # the import hook of `import attnkit` stays: this script never imports transformers
    assert json.loads(out.stdout) == ["OMP_WAIT_POLICY=PASSIVE", "PASSIVE", None, "None", "OMP_WAIT_POLICY=PASSIVE",
                                      ["import_hook"]]


def test_a_variable_set_after_torch_loaded_is_not_in_effect(monkeypatch):
    """Where attnkit did not watch torch load (a notebook that imported torch first), a variable counts only if the
    process started with it."""
    monkeypatch.setitem(process._openmp, "read", None)
    values, how = process.openmp_in_effect({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "7"}, {"torch": torch},
                                           starting=lambda: {"GOMP_SPINCOUNT": "7"})
    assert values == {"GOMP_SPINCOUNT": "7"} and how == "set when the process started"


# --- the cores a container may use ----------------------------------------------------------------------------
def test_cpu_quota_from_cgroup_v2_and_v1(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert openmp.cpu_quota([v2]) is None
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert openmp.cpu_quota([v2]) == 1.5
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert openmp.cpu_quota([v1]) is None
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    assert openmp.cpu_quota([tmp_path / "missing", v1]) == 3.0
    assert openmp.cpu_quota([tmp_path / "missing"]) is None


def test_the_cores_are_the_fewer_of_the_affinity_and_the_quota():
    affinity = len(os.sched_getaffinity(0))
    assert openmp.available_cores(lambda: None) == affinity
    assert openmp.available_cores(lambda: 0.5) == 1
    assert openmp.available_cores(lambda: 1.5) == min(affinity, 2)
    assert openmp.available_cores(lambda: affinity + 10.0) == affinity


def test_the_process_own_cgroup_is_read_first(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/a\n1:cpu,cpuacct:/box/1\n0::/box/1\n")
    dirs = openmp.cgroup_dirs(tmp_path / "fs", proc)
    assert dirs[:3] == [tmp_path / "fs" / "cpu,cpuacct" / "box/1", tmp_path / "fs" / "cpu" / "box/1",
                        tmp_path / "fs" / "box/1"]
    assert dirs[-3:] == [tmp_path / "fs", tmp_path / "fs" / "cpu", tmp_path / "fs" / "cpu,cpuacct"]


# --- whether the machine is busy, as a container sees it ------------------------------------------------------
def _stat(proc, tid: int, state: str, name: str = "python (x) y") -> None:
    (proc / str(tid)).mkdir(parents=True)
    (proc / str(tid) / "stat").write_text(f"{tid} ({name}) {state} 1 2 3\n")


def test_a_cgroup_lists_its_threads_v2_before_v1(tmp_path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    (v1 / "tasks").write_text("7\n8\n")
    assert openmp.cgroup_threads([tmp_path / "missing", v1]) == [7, 8]
    (v2 / "cgroup.threads").write_text("3\n4\n5\n")
    assert openmp.cgroup_threads([v2, v1]) == [3, 4, 5]
    (v2 / "cgroup.threads").write_text("")  # an empty list says nothing: the next directory's
    assert openmp.cgroup_threads([v2, v1]) == [7, 8]
    assert openmp.cgroup_threads([tmp_path / "missing"]) is None


def test_runnable_threads_read_each_state_and_skip_exited_ones(tmp_path):
    _stat(tmp_path, 10, "R")
    _stat(tmp_path, 11, "S")
    _stat(tmp_path, 12, "R", name="a) R (b")  # a command name with parentheses and an R: the state is after the last
    _stat(tmp_path, 13, "D")
    assert openmp.runnable_threads([10, 11, 12, 13, 99], proc=tmp_path) == 2  # 99 has exited


def test_a_limited_container_counts_its_own_cgroup_not_the_host(tmp_path):
    _stat(tmp_path, 1, "R")  # this thread, reading
    _stat(tmp_path, 2, "R")
    _stat(tmp_path, 3, "R")
    _stat(tmp_path, 4, "S")

    def count(tids):
        return openmp.runnable_threads(tids, proc=tmp_path)

    # two other runnable threads in the container, whatever the host's run queue says
    assert openmp.runnable_others(samples=2, seconds=0.0, threads=lambda: [1, 2, 3, 4], count=count) == 2.0
    # a cgroup that lists no threads: the host's run queue, as outside a container
    host = openmp.host_runnable()
    others = openmp.runnable_others(samples=1, seconds=0.0, threads=lambda: None, count=count)
    assert (others is None) == (host is None) and (others is None or others >= 0)


def test_ray_workers_are_told_the_regime_only_on_this_machine(monkeypatch):
    pytest.importorskip("ray")
    from attnkit.engine.ray import workers

    monkeypatch.setattr(process, "openmp_in_effect", lambda: ({"OMP_WAIT_POLICY": "PASSIVE"}, "read at torch's import"))
    assert workers.worker_env(local=True) == {"TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    assert workers.worker_env(local=False) == {"TOKENIZERS_PARALLELISM": "false"}
