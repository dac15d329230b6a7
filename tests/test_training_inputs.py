"""The input checks of the training tools (attnkit/training/checks.py, docs/training.md) and their cleanup when the
user's code raises (issue 47): bad input to `track`, `StatsLogger`, `AttnkitCallback` and `qk_clip` is refused by
name before anything runs, valid input of other types (numpy and 0-d tensor scalars, a feature as a string, an
upper-case suffix) works, no statistic or row is silently wrong or lost, and a KeyboardInterrupt raised inside a
tracked forward (a plain `track` block, a Trainer step) leaves nothing of attnkit's attached to the model."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.models import runtime_of
from attnkit.training import DEFAULT_FEATURES, StatsLogger, qk_clip, track

from .synthetic import tiny_decoder

STATS = {"entropy": torch.tensor([[0.5, 1.0], [1.5, 2.0]]), "max_logit": torch.tensor([[3.0, 4.0], [5.0, 6.0]])}


def batch(n=3, seed=1, vocab=120):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, 9), generator=g)
    mask = (torch.arange(9)[None] < torch.tensor([9, 6, 3, 8, 5][:n])[:, None]).long()
    return ids, mask


def samples(ids, mask):
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i].masked_fill(mask[i] == 0, -100)}
            for i in range(len(ids))]


def read_csv(path):
    import pandas as pd

    return pd.read_csv(path)


# -- track ------------------------------------------------------------------------------------------------------------

def test_track_takes_none_as_the_default_features_and_refuses_bad_arguments_by_name():
    model = attnkit.instrument(tiny_decoder("llama"))
    ids, mask = batch()
    with track(model, features=None) as t:
        model(input_ids=ids, attention_mask=mask)
        assert t.features == DEFAULT_FEATURES and set(t.read()) == set(DEFAULT_FEATURES)
    for features, message in ((5, "features"), ([1], "features"), ((), "at least one"),
                              (("entropy", "entropy"), "twice")):
        with pytest.raises(AttnkitError, match=message):
            with track(model, features=features):
                pass
    with pytest.raises(AttnkitError, match="num_windows"):
        with track(model, num_windows=0):
            pass
    with pytest.raises(AttnkitError, match="model"):
        with track("llama"):
            pass
    assert runtime_of(model).tracker is None


# -- cleanup when the user's code raises (issue 47) -------------------------------------------------------------------

class InterruptOnCall:
    """A forward hook that raises KeyboardInterrupt on its `at`-th call (1-based), deterministically."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


def assert_nothing_attached(model):
    from attnkit.ops import cpu_allocator_holders

    rt = runtime_of(model)
    assert rt.tracker is None
    assert rt.inputs is None and rt._outer_inputs == []
    assert "forward" not in vars(model)  # no wrapper of the forward left behind
    assert cpu_allocator_holders() == 0


def test_a_keyboard_interrupt_inside_a_tracked_forward_detaches_the_tracker():
    model = attnkit.instrument(tiny_decoder("llama"))
    fresh = copy.deepcopy(model)
    ids, mask = batch()
    hook = model.model.layers[1].mlp.register_forward_hook(InterruptOnCall(1))  # after layer 1's attention
    with pytest.raises(KeyboardInterrupt):
        with track(model, features=("entropy", "max_logit")):
            model(input_ids=ids, attention_mask=mask)
    hook.remove()
    assert_nothing_attached(model)

    def tracked(m):
        with track(m, features=("entropy", "max_logit")) as t, torch.no_grad():
            m(input_ids=ids, attention_mask=mask)
            return t.read()

    got, want = tracked(model), tracked(fresh)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)


# -- StatsLogger ------------------------------------------------------------------------------------------------------

def test_stats_logger_refuses_a_missing_folder_a_directory_and_other_types_by_name(tmp_path):
    with pytest.raises(AttnkitError, match="missing"):
        StatsLogger(tmp_path / "missing" / "heads.csv")
    assert not (tmp_path / "missing").exists()
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(AttnkitError, match="directory"):
        StatsLogger(tmp_path / "d.csv")
    with pytest.raises(AttnkitError, match="path"):
        StatsLogger(5)
    with pytest.raises(AttnkitError, match="csv or .parquet"):
        StatsLogger(tmp_path / "s.txt")
    (tmp_path / "file").write_text("x")
    with pytest.raises(AttnkitError, match="tensorboard"):
        StatsLogger(tensorboard=tmp_path / "file")


def test_stats_logger_suffixes_are_case_insensitive(tmp_path):
    import pandas as pd

    with StatsLogger(tmp_path / "X.CSV") as log:
        log.log(1, STATS)
    with StatsLogger(tmp_path / "Y.Parquet") as log:
        log.log(1, STATS)
    assert len(read_csv(tmp_path / "X.CSV")) == 8 and len(pd.read_parquet(tmp_path / "Y.Parquet")) == 8


def test_stats_logger_steps_are_integers(tmp_path):
    with StatsLogger(tmp_path / "s.csv") as log:
        for bad in (1.7, 2.0, True, "3", torch.tensor(1.5), torch.tensor([1, 2]), -1):
            with pytest.raises(AttnkitError, match="step"):
                log.log(bad, STATS)
        log.log(np.int64(3), STATS)
        log.log(torch.tensor(4), STATS)
        log.log(np.array(5), STATS)
    df = read_csv(tmp_path / "s.csv")
    assert sorted(set(df.step)) == [3, 4, 5] and len(df) == 24


def test_stats_logger_refuses_statistics_that_are_no_layers_by_heads_table(tmp_path):
    with StatsLogger(tmp_path / "s.csv") as log:
        for bad, message in ((list(STATS.values()), "dict"), ({"entropy": torch.tensor([0.5, 1.0])}, "layers × heads"),
                             ({"entropy": [[0.5]]}, "tensor"), ({3: torch.zeros(1, 1)}, "feature names"),
                             ({"entropy": torch.zeros(1, 1, 1)}, "layers × heads")):
            with pytest.raises(AttnkitError, match=message):
                log.log(1, bad)
        log.log(1, {"entropy": np.array([[0.25, 0.5]])})  # a numpy table is one too
    df = read_csv(tmp_path / "s.csv")
    assert df.value.tolist() == [0.25, 0.5]


def test_a_csv_that_holds_another_table_is_refused_and_left_as_it_was(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(AttnkitError, match="another table"):
        StatsLogger(other)
    assert other.read_text() == "epoch,loss\n1,0.5\n"
    ours = tmp_path / "ours.csv"  # a file this logger wrote is appended to
    with StatsLogger(ours) as log:
        log.log(1, STATS)
    with StatsLogger(ours) as log:
        log.log(2, STATS)
    df = read_csv(ours)
    assert list(df.columns) == ["step", "feature", "layer", "head", "value"] and sorted(set(df.step)) == [1, 2]
    other_parquet = tmp_path / "other.parquet"
    import pandas as pd

    pd.DataFrame({"epoch": [1]}).to_parquet(other_parquet)
    with pytest.raises(AttnkitError, match="another table"):
        StatsLogger(other_parquet)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_rows_logged_after_close_are_written(tmp_path, suffix):
    import pandas as pd

    path = tmp_path / f"s{suffix}"
    log = StatsLogger(path)
    log.log(1, STATS)
    log.close()
    log.log(2, STATS)
    log.close()
    df = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    assert sorted(df.step.tolist()) == [1] * 8 + [2] * 8


# -- qk_clip ----------------------------------------------------------------------------------------------------------

def test_qk_clip_takes_any_real_scalar_tau_and_refuses_others_by_name():
    model = attnkit.instrument(tiny_decoder("llama", n_layers=1))
    m = torch.tensor([[8.0, 2.0, 3.0, 1.0]])
    want = [p.clone() for p in model.parameters()]
    base = copy.deepcopy(model)
    qk_clip(base, m, 5.0)
    for tau in (np.float32(5), np.int64(5), torch.tensor(5.0), torch.tensor(5)):
        clipped = copy.deepcopy(model)
        fq, fk = qk_clip(clipped, m, tau)
        assert float(fq[0, 0]) == pytest.approx(math.sqrt(5 / 8))
        for a, b in zip(clipped.parameters(), base.parameters()):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    for bad in (True, np.bool_(True), float("nan"), float("inf"), 0, -1.0, "5", torch.tensor([5.0]), None):
        with pytest.raises(AttnkitError, match="tau"):
            qk_clip(model, m, bad)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want))


def test_qk_clip_leaves_a_head_with_a_non_finite_max_logit_alone():
    """An infinite max logit has no finite factor that brings it to tau (sqrt(tau / inf) is 0, which would erase the
    head's q and its KV group's k): such a head, like a NaN one, changes nothing, and its KV group is scaled by its
    finite heads only."""
    model = attnkit.instrument(tiny_decoder("llama", n_layers=1))  # 4 heads, KV groups {0, 1} and {2, 3}
    q = model.model.layers[0].self_attn.q_proj.weight
    k = model.model.layers[0].self_attn.k_proj.weight
    q0, k0 = q.detach().clone(), k.detach().clone()
    fq, fk = qk_clip(model, torch.tensor([[float("inf"), 2.0, float("-inf"), 8.0]]), 5.0)
    assert fq[0].tolist() == pytest.approx([1.0, 1.0, 1.0, math.sqrt(5 / 8)])
    assert fk[0].tolist() == pytest.approx([1.0, math.sqrt(5 / 8)])
    torch.testing.assert_close(q[:8], q0[:8], atol=0, rtol=0)  # head 0: inf, untouched
    torch.testing.assert_close(k[:8], k0[:8], atol=0, rtol=0)  # KV group 0: no finite head over tau
    torch.testing.assert_close(k[8:], k0[8:] * math.sqrt(5 / 8))
