"""attnkit.track and QK-Clip (attnkit/training, docs/training.md): the tracked statistics against an independent
recomputation from eager maps and from q and k seen by an observer; the max logit against the reference; QK-Clip on
separate, GQA and fused projections (the max logits of the same batch after the clip are τ); the refusals."""
from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.kernels import statistics
from attnkit.models import observing
from attnkit.reference import max_logits
from attnkit.training import qk_clip, track

from .synthetic import tiny_bert, tiny_decoder

LENGTHS = [9, 6, 3]


def batch(side="right", vocab=120, low=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(low, vocab, (3, 9), generator=g)
    mask = (torch.arange(9)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return ids, (mask.flip(1) if side == "left" else mask)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 3)])
def test_blocked_max_logits_equal_the_reference_and_a_loop(causal, window, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 11, 8, generator=g)
    k = torch.randn(2, 2, 11, 8, generator=g)
    lengths = torch.tensor([11, 5])
    want = max_logits(q, k, lengths, 0.3, causal=causal, sliding_window=window)
    monkeypatch.setattr(statistics, "TILE_ELEMENTS", 2 * 4 * 11 * 3)  # blocks of 3 rows
    got = statistics.max_logits(q, k, lengths, 0.3, causal=causal, sliding_window=window)
    torch.testing.assert_close(got, want)
    for b in range(2):  # by hand: valid rows, the keys each sees
        for h in range(4):
            n = int(lengths[b])
            best = max(float(q[b, h, s] @ k[b, h // 2, t]) * 0.3 for s in range(n) for t in range(n)
                       if (not causal or t <= s) and (window is None or s - t < window))
            assert float(got[b, h]) == pytest.approx(best, rel=1e-5)


def eager_stats(model, ids, mask):
    """Entropy and first-token weight per layer × head, the mean over samples of each sample's mean over its rows,
    from eager's maps (the tokens of a left-padded sample moved to the front by hand)."""
    with torch.no_grad():
        maps = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    ent, cls = [], []
    for a in maps:
        e_l, c_l = np.zeros(a.shape[1]), np.zeros(a.shape[1])
        for b in range(a.shape[0]):
            keep = mask[b].bool()
            A = a[b][:, keep][:, :, keep].double().numpy()  # H × n × n
            p = np.where(A > 0, A, 1.0)
            e_l += (-(A * np.log(p)).sum(-1)).mean(-1)
            c_l += A[:, :, 0].mean(-1)
        ent.append(e_l / a.shape[0])
        cls.append(c_l / a.shape[0])
    return np.array(ent), np.array(cls)


class QKObserver:
    """Every layer's max logit from the q and k attention receives, by explicit loops over rows and keys."""

    decoder_arguments = True

    def __init__(self):
        self.max = {}

    def __call__(self, layer, q, k, lengths, scaling, causal=False, kv_head=None, sliding_window=None, **_):
        B, H, L, D = q.shape
        scaling = D**-0.5 if scaling is None else scaling
        out = torch.full((H,), float("-inf"))
        for b in range(B):
            n = int(lengths[b])
            for h in range(H):
                g = int(kv_head[h]) if kv_head is not None else h * k.shape[1] // H
                s = (q[b, h, :n].double() @ k[b, g, :n].double().T) * scaling
                i = torch.arange(n)
                ok = torch.ones(n, n, dtype=torch.bool)
                if causal:
                    ok &= i[:, None] >= i[None, :]
                if sliding_window is not None:
                    ok &= i[:, None] - i[None, :] < sliding_window
                out[h] = max(out[h], s[ok].max().float())
        self.max[layer] = torch.maximum(self.max.get(layer, out), out)


@pytest.mark.parametrize("kind, side", [("llama", "right"), ("mistral", "left"), ("gpt2", "right"),
                                        ("gpt_oss", "right")])
def test_tracked_statistics_equal_eager_maps(kind, side):
    eager = tiny_decoder(kind)
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids, mask = batch(side)
    obs = QKObserver()
    with track(ours, features=("entropy", "max_logit", "cls")) as tracker, observing(ours, [obs]):
        ours(input_ids=ids, attention_mask=mask)
        ours(input_ids=ids, attention_mask=mask)  # two steps: the mean of equal steps is the step's
        got = tracker.read()
    assert list(got) == ["entropy", "max_logit", "cls"]
    ent, cls = eager_stats(eager, ids, mask)
    np.testing.assert_allclose(got["entropy"].numpy(), ent, atol=2e-5)
    np.testing.assert_allclose(got["cls"].numpy(), cls, atol=2e-5)
    want_max = torch.stack([obs.max[i] for i in range(len(obs.max))])
    torch.testing.assert_close(got["max_logit"], want_max, atol=1e-5, rtol=1e-5)
    again = tracker.read()  # nothing since the last read
    assert all(t.isnan().all() for t in again.values())


def _no_second_pass(*_a, **_k):
    raise AssertionError("the max logit took a second q·kᵀ pass although the fused op measures it")


@pytest.mark.skipif(not attnkit.ops.fused_max_logit("cpu"), reason="a build whose CPU op has no max logit")
@pytest.mark.parametrize("kind, side", [("llama", "right"), ("mistral", "left"), ("gemma2", "right"),
                                        ("gpt_oss", "left")])
def test_tracked_max_logit_comes_from_the_op_without_a_second_pass(kind, side, monkeypatch):
    """On the fused CPU path the tracked max logit is the op's own (attnkit.kernels.statistics.max_logits raises
    here), in training (gradients: the lse op) and without gradients, and equals the observer's loops over q and k:
    GQA, left padding, Gemma 2's soft-cap and window, gpt-oss's sinks and window (the op's cases, the max logit
    before the cap among them: tests/test_fused_cpu_blocks.py)."""
    model = attnkit.instrument(tiny_decoder(kind))
    ids, mask = batch(side)
    obs = QKObserver()
    monkeypatch.setattr(statistics, "max_logits", _no_second_pass)
    # (and under its earlier name in the module, attnkit.training.track being the function)
    monkeypatch.setattr(sys.modules["attnkit.training.track"], "max_logits", _no_second_pass, raising=False)
    with track(model, features=("max_logit",)) as tracker, observing(model, [obs]):
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        trained = tracker.read()["max_logit"]
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        inferred = tracker.read()["max_logit"]
    want = torch.stack([obs.max[i] for i in range(len(obs.max))])
    torch.testing.assert_close(trained, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inferred, want, atol=1e-5, rtol=1e-5)


def test_max_logit_of_a_pruned_model_is_nan_for_removed_heads():
    """A pruned layer (one head of a grouped KV pair removed): the tracker and extraction's MaxLogitCollector give
    the kept heads the observer's max logit (from the op's own call) and the removed head NaN."""
    from attnkit.arch import prune_heads
    from attnkit.engine.extract import MaxLogitCollector

    model = attnkit.instrument(prune_heads(tiny_decoder("llama"), [(1, 2)]))
    ids, mask = batch("left")
    obs, collector = QKObserver(), MaxLogitCollector(2, 4)
    with track(model, features=("max_logit",)) as tracker, observing(model, [obs, collector]):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        got = tracker.read()["max_logit"]
    want = torch.stack([obs.max[i] for i in range(2)])
    kept = torch.ones(2, 4, dtype=torch.bool)
    kept[1, 2] = False
    for m in (got, torch.from_numpy(collector.result()).float()):
        assert m[1, 2].isnan() and not m[kept].isnan().any()
        torch.testing.assert_close(m[kept], want[kept], atol=1e-5, rtol=1e-5)


def test_tracking_in_training_with_gradients_and_dropout():
    """A training step under track: with attention dropout the output is eager's (the same dropout mask), the
    statistics describe the weights before dropout (those of eval mode), and gradients reach the weights."""
    eager = tiny_decoder("mistral")
    for m in eager.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.3
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids, mask = batch()
    eager.train()
    ours.train()
    torch.manual_seed(5)
    want = eager(input_ids=ids, attention_mask=mask).logits
    with track(ours, features=("entropy",)) as tracker:
        torch.manual_seed(5)
        got = ours(input_ids=ids, attention_mask=mask).logits
        stats = tracker.read()
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=1e-5)
    eager.eval()  # layer 0 sees the same input in eval mode (later layers see the dropout of the ones before)
    ent, _ = eager_stats(eager, ids, mask)
    np.testing.assert_allclose(stats["entropy"][0].numpy(), ent[0], atol=2e-5)
    got[valid].sum().backward()
    assert all(p.grad is not None for p in ours.parameters() if p.requires_grad and p.dim() > 1)


def test_gradient_checkpointing_counts_each_forward_once():
    model = attnkit.instrument(tiny_decoder("llama"))
    model.train()
    model.gradient_checkpointing_enable()
    ids, mask = batch()
    with track(model, features=("entropy", "max_logit")) as tracker:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        assert tracker.samples == 3 and tracker._counts[0] == 3


def test_track_refuses_unknown_features_and_nesting():
    model = attnkit.instrument(tiny_decoder("llama"))
    with pytest.raises(AttnkitError, match="cannot track 'entropie'"):
        with track(model, features=("entropie",)):
            pass
    with track(model, features="entropy"):
        with pytest.raises(AttnkitError, match="already tracked"):
            with track(model):
                pass
    assert attnkit.models.runtime_of(model).tracker is None


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox", "phi3", "bert"])
def test_qk_clip_brings_the_max_logits_to_tau(kind):
    """One layer (clipping a layer changes the inputs of the next): afterwards every head's max logit on the same
    batch is at most tau, a head over tau with its own k exactly tau, the largest of each KV group exactly tau, and
    heads below tau with their own k unchanged."""
    if kind == "bert":
        model = attnkit.instrument(tiny_bert(n_layers=1, n_heads=4)[0])
        ids, mask = batch(vocab=model.config.vocab_size, low=9)
    else:
        model = attnkit.instrument(tiny_decoder(kind, n_layers=1))
        ids, mask = batch()

    def measure():
        with track(model, features=("max_logit",)) as t, torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
            return t.read()["max_logit"][0]

    before = measure()
    tau = float(before.sort().values[before.numel() // 2])  # about half the heads pass it
    qk_clip(model, before[None], tau)
    after = measure()
    over = before > tau
    assert over.any() and (~over).any()
    H = model.config.num_attention_heads
    Hkv = getattr(model.config, "num_key_value_heads", None) or H
    assert (after <= tau * (1 + 1e-5)).all()
    group = torch.arange(H) // (H // Hkv)
    for kv in range(Hkv):
        top = before[group == kv].max()
        if top > tau:
            assert float(after[group == kv].max()) == pytest.approx(tau, rel=1e-5)
        elif Hkv == H:
            assert float(after[kv]) == pytest.approx(float(before[kv]), rel=1e-5)


def test_qk_clip_bounds_each_layer_on_the_inputs_it_measured():
    """What QK-Clip guarantees with several layers (docs/training.md): each layer's max logit computed from the inputs
    it had when measured is at most tau afterwards (the largest of each KV group exactly tau), so the first layer it
    scales is bounded on the same batch; a later layer's inputs are changed by the clip of those below, and on the
    same batch it is bounded only when its measured inputs are given back to it."""
    model = attnkit.instrument(tiny_decoder("llama", n_layers=2))
    ids, mask = batch()
    layer1 = model.model.layers[1]

    def measure():
        with track(model, features=("max_logit",)) as t, torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
            return t.read()["max_logit"]

    saved = {}
    hook = layer1.register_forward_pre_hook(lambda m, args: saved.update(h=args[0].clone()))
    before = measure()
    hook.remove()
    tau = float(before.min())  # every head of both layers passes it
    qk_clip(model, before, tau)
    after = measure()
    hook = layer1.register_forward_pre_hook(lambda m, args: (saved["h"],) + args[1:])
    replayed = measure()  # layer 1 on the hidden states it had when measured
    hook.remove()
    group = torch.arange(4) // 2
    for got in (after[0], replayed[1]):
        assert (got <= tau * (1 + 1e-5)).all()
        for kv in range(2):
            assert float(got[group == kv].max()) == pytest.approx(tau, rel=1e-5)
    assert not torch.allclose(after[1], replayed[1])  # on the same batch, layer 1 sees other inputs


def test_qk_clip_refuses_per_head_norms_and_bad_input():
    model = attnkit.instrument(tiny_decoder("qwen3"))
    m = torch.full((model.config.num_hidden_layers, model.config.num_attention_heads), 100.0)
    with pytest.raises(AttnkitError, match="q_norm"):
        qk_clip(model, m, 10.0)
    llama = attnkit.instrument(tiny_decoder("llama"))
    with pytest.raises(AttnkitError, match="tau"):
        qk_clip(llama, m, -1.0)
    with pytest.raises(AttnkitError, match="layers × heads"):
        qk_clip(llama, m[:1], 10.0)


def test_stats_logger_writes_csv_and_parquet(tmp_path):
    import pandas as pd

    from attnkit.training import StatsLogger

    stats = {"entropy": torch.tensor([[0.5, 1.0], [1.5, 2.0]]), "max_logit": torch.tensor([[3.0, 4.0], [5.0, 6.0]])}
    for name in ("s.csv", "s.parquet"):
        with StatsLogger(tmp_path / name) as log:
            log.log(10, stats)
            log.log(20, stats)
        df = pd.read_csv(tmp_path / name) if name.endswith("csv") else pd.read_parquet(tmp_path / name)
        assert list(df.columns) == ["step", "feature", "layer", "head", "value"] and len(df) == 16
        row = df[(df.step == 20) & (df.feature == "max_logit") & (df.layer == 1) & (df["head"] == 0)]
        assert row.value.tolist() == [5.0]
    with pytest.raises(AttnkitError, match="csv or .parquet"):
        StatsLogger(tmp_path / "s.txt")


def test_tensorboard_logging_or_a_named_refusal(tmp_path):
    from attnkit.training import StatsLogger

    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(AttnkitError, match="tensorboard"):
            StatsLogger(tensorboard=tmp_path / "tb")
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with StatsLogger(tensorboard=tmp_path / "tb") as log:
        log.log(3, {"entropy": torch.tensor([[0.25, 0.5]])})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("attnkit/entropy/L0H1")] == [0.5]


def test_trainer_callback_logs_and_clips(tmp_path):
    import pandas as pd
    from transformers import Trainer, TrainingArguments

    from attnkit.training import AttnkitCallback

    model = attnkit.instrument(tiny_decoder("llama", n_layers=1))
    ids, mask = batch()
    data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i].masked_fill(mask[i] == 0, -100)}
            for i in range(3)]
    with track(model, features=("max_logit",)) as t, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        tau = float(t.read()["max_logit"].min())  # every head passes it
    cb = AttnkitCallback(features=("entropy", "cls"), every=2, path=tmp_path / "heads.csv", qk_clip_tau=tau)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, max_steps=4,
                             learning_rate=0.0, report_to=[], use_cpu=True, logging_strategy="no",
                             save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    assert [s for s, _ in cb.history] == [2, 4]
    assert set(cb.history[0][1]) == {"entropy", "cls", "max_logit"}
    df = pd.read_csv(tmp_path / "heads.csv")
    assert len(df) == 2 * 3 * model.config.num_attention_heads
    assert attnkit.models.runtime_of(model).tracker is None  # the block closed at the end of training
    # learning rate 0: only QK-Clip changed the weights, by the max logits of the same three samples every step
    with track(model, features=("max_logit",)) as t, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        after = t.read()["max_logit"]
    assert float(after.max()) == pytest.approx(tau, rel=1e-5)


def test_autocast_trains_like_eager_and_compile_under_track_is_refused():
    """Mixed precision: q and k may arrive in fp32 (rotary embedding) and v in bf16; attnkit runs attention in the
    autocast dtype as eager's matmuls do, and its gradients are as far from fp32 eager's as eager's own bf16 ones
    (within twice). torch.compile of a tracked model is refused by name."""
    eager = tiny_decoder("llama")
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids, mask = batch()

    def grads(model, autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, attention_mask=mask).logits
        out.float()[mask.bool()].sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    exact = grads(eager, False)
    err_eager = (grads(eager, True) - exact).abs().max()
    err_ours = (grads(ours, True) - exact).abs().max()
    assert err_ours <= 2 * err_eager + 1e-6, (err_ours, err_eager)

    torch._dynamo.reset()
    compiled = torch.compile(lambda i, m: ours(input_ids=i, attention_mask=m).logits, backend="aot_eager")
    with track(ours, features=("entropy",)):
        with pytest.raises(AttnkitError, match="torch.compile"):
            compiled(ids, mask)


def test_forwards_in_inference_mode_are_tracked_and_paused_ones_are_not():
    model = attnkit.instrument(tiny_decoder("llama"))
    ids, mask = batch()
    with track(model, features=("entropy",)) as t:
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask)
        with t.paused(), torch.no_grad():
            model(input_ids=ids[:1], attention_mask=mask[:1])
        assert t.samples == 3
        model(input_ids=ids, attention_mask=mask)  # accumulating into what inference mode made
        assert t.samples == 6 and not t.read()["entropy"].is_inference()


def test_extract_returns_each_heads_max_logit_over_the_corpus():
    model, tok = tiny_bert(n_heads=4)
    texts = ["the cat sat on the mat.", ("a dog", "barked at the cat, twice."), "rivers bend."]
    obs = QKObserver()
    feats = attnkit.extract(texts, (model, tok), max_logit=True, observers=[obs], batch_size=2, max_length=32)
    want = torch.stack([obs.max[i] for i in range(len(obs.max))]).double().numpy()
    assert feats.max_logit.shape == (2, 4)
    np.testing.assert_allclose(feats.max_logit, want, rtol=1e-5, atol=1e-5)
    assert attnkit.extract(texts, (model, tok), max_length=32).max_logit is None
