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
    for features, message in ((5, "features"), ([1], "features"), ((), "no feature"),
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
    rt = runtime_of(model)
    assert rt.tracker is None
    assert rt.open_forwards == 0
    assert "forward" not in vars(model)  # no wrapper of the forward left behind
    assert attnkit.process_changes() == []


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


# -- AttnkitCallback --------------------------------------------------------------------------------------------------

def test_callback_checks_its_arguments_in_its_constructor(tmp_path):
    from attnkit.training import AttnkitCallback

    assert AttnkitCallback(features="entropy").features == ("entropy",)
    assert AttnkitCallback(features="entropy", qk_clip_tau=5.0).features == ("entropy", "max_logit")
    assert AttnkitCallback(features=None).features == DEFAULT_FEATURES
    assert AttnkitCallback(qk_clip_tau=np.float32(5)).tau == 5.0
    assert AttnkitCallback(qk_clip_tau=torch.tensor(5.0)).tau == 5.0
    for bad in (-1.0, 0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(AttnkitError, match="qk_clip_tau"):
            AttnkitCallback(qk_clip_tau=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(AttnkitError, match="every"):
            AttnkitCallback(every=bad)
    with pytest.raises(AttnkitError, match="features"):
        AttnkitCallback(features=[1])
    with pytest.raises(AttnkitError, match="missing"):
        AttnkitCallback(path=tmp_path / "missing" / "heads.csv")


def trainer(model, cb, tmp_path, data, steps=2, **kwargs):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, max_steps=steps,
                             learning_rate=0.0, report_to=[], use_cpu=True, logging_strategy="no",
                             save_strategy="no", disable_tqdm=True, **kwargs.pop("args", {}))
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[cb], **kwargs)


def test_the_callback_counts_only_training_forwards(tmp_path):
    """With an evaluation at the start and after every step (other texts, in eval mode), the statistics logged are
    those of a training without evaluation: only the training steps' forwards count."""
    from attnkit.training import AttnkitCallback

    model = attnkit.instrument(tiny_decoder("llama"))
    train = samples(*batch())
    held_out = samples(*batch(seed=7))
    plain = AttnkitCallback(features=("entropy", "max_logit"), every=1)
    trainer(copy.deepcopy(model), plain, tmp_path, train).train()
    evaluated = AttnkitCallback(features=("entropy", "max_logit"), every=1)
    trainer(model, evaluated, tmp_path, train, eval_dataset=held_out,
            args=dict(eval_strategy="steps", eval_steps=1, eval_on_start=True, per_device_eval_batch_size=3)).train()
    assert [s for s, _ in evaluated.history] == [1, 2]
    for (_, a), (_, b) in zip(plain.history, evaluated.history):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=0, rtol=0)


def test_the_callback_under_gradient_checkpointing_gives_the_same_statistics(tmp_path):
    """The forward that checkpointing re-runs inside the backward takes the tracked path again (torch checks that
    it saves what the first run saved) and is counted once."""
    from attnkit.training import AttnkitCallback

    model = attnkit.instrument(tiny_decoder("llama"))
    data = samples(*batch())
    plain = AttnkitCallback(features=("entropy", "max_logit"), every=1)
    trainer(copy.deepcopy(model), plain, tmp_path, data).train()
    checkpointed = AttnkitCallback(features=("entropy", "max_logit"), every=1)
    trainer(model, checkpointed, tmp_path, data, args=dict(gradient_checkpointing=True)).train()
    assert model.model.gradient_checkpointing
    for (_, a), (_, b) in zip(plain.history, checkpointed.history):
        for name in a:
            torch.testing.assert_close(b[name], a[name])


def test_the_callback_refuses_a_model_qk_clip_cannot_scale_before_the_first_step(tmp_path):
    from attnkit.training import AttnkitCallback

    model = attnkit.instrument(tiny_decoder("qwen3"))
    before = [p.detach().clone() for p in model.parameters()]
    cb = AttnkitCallback(features="entropy", qk_clip_tau=1.0)
    with pytest.raises(AttnkitError, match="q_norm"):
        trainer(model, cb, tmp_path, samples(*batch())).train()
    assert cb.history == [] and runtime_of(model).tracker is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_subclass_of_the_callback_tracks_the_same_steps(tmp_path):
    """The step's forwards are those made by the code that called the callback event: a subclass's own frames in
    between (its on_step_begin calling the callback's) do not hide the Trainer's loop."""
    from attnkit.training import AttnkitCallback

    class Sub(AttnkitCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            return super().on_step_begin(args, state, control, **kwargs)

    model = attnkit.instrument(tiny_decoder("llama"))
    data = samples(*batch())
    plain, sub = AttnkitCallback(features="entropy", every=1), Sub(features="entropy", every=1)
    trainer(copy.deepcopy(model), plain, tmp_path, data, steps=1).train()
    trainer(model, sub, tmp_path, data, steps=1).train()
    assert not sub.history[0][1]["entropy"].isnan().any()
    torch.testing.assert_close(sub.history[0][1]["entropy"], plain.history[0][1]["entropy"])


def test_the_callback_refuses_data_parallel_by_name():
    from types import SimpleNamespace

    from attnkit.training import AttnkitCallback

    model = attnkit.instrument(tiny_decoder("llama"))
    with pytest.raises(AttnkitError, match="DataParallel"):
        AttnkitCallback(features="entropy").on_train_begin(SimpleNamespace(n_gpu=2), None, None, model=model)
    assert_nothing_attached(model)


# -- cleanup of the callback when training raises (issue 47) ----------------------------------------------------------

def test_a_keyboard_interrupt_inside_a_trainer_step_leaves_nothing_attached(tmp_path):
    """KeyboardInterrupt from a forward hook in the second training step: afterwards the model is not tracked (its
    forwards add nothing to the callback's tracker), `track` works on it, and `train()` again with the same callback
    gives the statistics of a fresh copy of the model (learning rate 0: the weights do not move)."""
    from attnkit.training import AttnkitCallback

    model = attnkit.instrument(tiny_decoder("llama"))
    fresh = copy.deepcopy(model)
    ids, mask = batch()
    data = samples(ids, mask)
    cb = AttnkitCallback(features=("entropy", "max_logit", "cls"), every=1, path=tmp_path / "heads.csv")
    hook = model.model.layers[1].mlp.register_forward_hook(InterruptOnCall(2))
    with pytest.raises(KeyboardInterrupt):
        trainer(model, cb, tmp_path, data, steps=3).train()
    hook.remove()
    assert [s for s, _ in cb.history] == [1]
    assert len(read_csv(tmp_path / "heads.csv")) == 3 * 2 * 4  # the first step's rows are on disk
    assert_nothing_attached(model)
    seen = cb.tracker.samples
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # a forward outside training: not recorded
    assert cb.tracker.samples == seen
    assert_nothing_attached(model)

    with track(model, features=("entropy",)) as t, torch.no_grad():  # track is not refused
        model(input_ids=ids, attention_mask=mask)
        assert t.samples == 3
    assert_nothing_attached(model)

    trainer(model, cb, tmp_path, data, steps=2).train()
    again = AttnkitCallback(features=("entropy", "max_logit", "cls"), every=1)
    trainer(fresh, again, tmp_path, data, steps=2).train()
    assert [s for s, _ in cb.history] == [1, 1, 2]
    for (_, got), (_, want) in zip(cb.history[1:], again.history):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)
    assert_nothing_attached(model)
    assert len(read_csv(tmp_path / "heads.csv")) == 3 * 3 * 2 * 4  # the second training appended its rows


def test_an_exception_outside_the_forwards_of_a_step_leaves_the_model_untracked(tmp_path):
    """An error raised between the forwards of a step (here by another callback after the second optimiser step):
    `track` replaces the tracker the step left, the model's later forwards outside training are not recorded, the
    rows logged so far are written (Parquet, kept until the logger closes), and the next training works."""
    from transformers import TrainerCallback

    from attnkit.training import AttnkitCallback

    class Fails(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:  # the second step
                raise RuntimeError("a failing callback")

    import pandas as pd

    model = attnkit.instrument(tiny_decoder("llama"))
    ids, mask = batch()
    cb = AttnkitCallback(features="entropy", every=1, path=tmp_path / "heads.parquet")
    t = trainer(model, cb, tmp_path, samples(ids, mask))
    t.add_callback(Fails())
    with pytest.raises(RuntimeError, match="a failing callback"):
        t.train()
    seen = cb.tracker.samples
    with track(model, features="entropy") as mine, torch.no_grad():  # the tracker left behind is replaced
        model(input_ids=ids, attention_mask=mask)
        assert mine.samples == 3
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert cb.tracker.samples == seen
    assert_nothing_attached(model)
    assert pd.read_parquet(tmp_path / "heads.parquet").step.tolist() == [1] * 8  # the step logged, written
    trainer(model, cb, tmp_path, samples(ids, mask)).train()
    assert [s for s, _ in cb.history] == [1, 1, 2]
    assert pd.read_parquet(tmp_path / "heads.parquet").step.tolist() == [1] * 16 + [2] * 8
