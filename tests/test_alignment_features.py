"""The alignment features (docs/features.md, "Alignment features"; attnkit/reference.py, "Alignment"): `align_offset`
and `align_near` of every backend on the CPU against an independent computation from softmax weights written here
(tests/synthetic.py: `alignment_from_maps`, by loops), for cross-attention (Lq ≠ Lk, one query, one key, padding on
both sides), an encoder's rows, causal rows, a KV-cache step, interventions and norm weighting; the worked example of
docs/features.md; the argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import ALIGNMENT_FEATURES, UNIFORM, ZERO, feature_names, num_features
from attnkit.reference import aligned_positions, alignment_features, reference_attention

from .synthetic import alignment_from_maps

B, H, D, NW = 3, 4, 8, 4
BACKENDS = ["reference", "auto"]


def softmax_maps(q, k, scaling, visible):
    """fp64 B×H×Lq×Lk softmax weights over the keys `visible` (B×Lq×Lk bool) shows each row (0 elsewhere)."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scaling
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0)


def qkv(Lq, Lk, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Lq, D, generator=g) * 1.5).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    return q, k, v


def last_two(feats):
    return feats[..., -2:].double().numpy()


CROSS = [((5, 7), (5, 3, 1), (7, 4, 6)), ((7, 5), (7, 6, 2), (5, 5, 1)), ((1, 6), (1, 1, 1), (6, 2, 1)),
         ((6, 1), (6, 4, 1), (1, 1, 1)), ((9, 9), (9, 7, 3), (9, 8, 2)), ((3, 13), (3, 2, 3), (13, 9, 1))]


@pytest.mark.parametrize("shape,q_lengths,k_lengths", CROSS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_alignment_equals_the_maps(shape, q_lengths, k_lengths, dtype, backend):
    Lq, Lk = shape
    q, k, v = qkv(Lq, Lk, dtype=dtype)
    ql, kl = torch.tensor(q_lengths), torch.tensor(k_lengths)
    _, feats = ops.attention(q, k, v, ql, key_lengths=kl, want_features=True, num_windows=NW, alignment=True,
                             backend=backend)
    assert feats.shape == (B, H, num_features(NW, alignment=True))
    visible = (torch.arange(Lk)[None, None, :] < kl[:, None, None]).expand(B, Lq, Lk)
    p = softmax_maps(q.float(), k.float(), D**-0.5, visible).numpy()
    want = alignment_from_maps(p, ql, kl)
    # (bf16: the kernel's scores from bf16 inputs in fp32, as the cross tests allow)
    np.testing.assert_allclose(last_two(feats), want, atol=2e-5 if dtype == torch.float32 else 2e-3)
    # the features before them are those of a call without alignment
    _, plain = ops.attention(q, k, v, ql, key_lengths=kl, want_features=True, num_windows=NW, backend=backend)
    torch.testing.assert_close(feats[..., :-2], plain)


def self_visible(L, lengths, causal, Lq=None):
    Lq = L if Lq is None else Lq
    s = torch.arange(L - Lq, L)[:, None]
    t = torch.arange(L)[None, :]
    vis = (t[None] < lengths[:, None, None]).expand(len(lengths), Lq, L)
    return vis & (t <= s) if causal else vis


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_self_attention_rows_are_aligned_with_themselves(causal, dtype, backend):
    L = 9
    q, k, v = qkv(L, L, seed=1, dtype=dtype)
    lengths = torch.tensor([9, 5, 1])
    _, feats = ops.attention(q, k, v, lengths, want_features=True, num_windows=NW, causal=causal, alignment=True,
                             backend=backend)
    p = softmax_maps(q.float(), k.float(), D**-0.5, self_visible(L, lengths, causal)).numpy()
    want = alignment_from_maps(p, lengths)
    np.testing.assert_allclose(last_two(feats), want, atol=2e-5 if dtype == torch.float32 else 2e-3)
    if causal:  # causal row 0 sees only itself: offset 0, near 1 (the one-token sample has only that row)
        np.testing.assert_allclose(last_two(feats)[2], np.tile([0.0, 1.0], (H, 1)), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kv_cache_step_counts_its_rows_at_their_positions(backend):
    L, Lq = 10, 3
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    lengths = torch.tensor([10, 8, 6])  # the last: no valid row (positions 7..9 >= 6), features 0
    _, feats = ops.attention(q, k, v, lengths, want_features=True, num_windows=NW, causal=True, alignment=True,
                             backend=backend)
    p = softmax_maps(q, k, D**-0.5, self_visible(L, lengths, True, Lq)).numpy()
    np.testing.assert_allclose(last_two(feats), alignment_from_maps(p, lengths), atol=2e-5)
    assert not last_two(feats)[2].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gates_change_nothing_a_zeroed_head_has_none_and_a_uniform_head_spreads(backend):
    Lq, Lk = 4, 6
    q, k, v = qkv(Lq, Lk, seed=3)
    ql, kl = torch.tensor([4, 3, 1]), torch.tensor([6, 5, 2])
    mode = torch.tensor([0, ZERO, UNIFORM, 0], dtype=torch.int32)
    gates = torch.tensor([0.5, 1.0, 1.0, 2.0])
    _, feats = ops.attention(q, k, v, ql, key_lengths=kl, want_features=True, num_windows=NW, alignment=True,
                             mode=mode, gates=gates, backend=backend)
    visible = (torch.arange(Lk)[None, None, :] < kl[:, None, None]).expand(B, Lq, Lk)
    p = softmax_maps(q, k, D**-0.5, visible)
    p[:, 1] = 0.0
    p[:, 2] = visible.double() / kl[:, None, None].double()
    np.testing.assert_allclose(last_two(feats), alignment_from_maps(p.numpy(), ql, kl), atol=2e-5)
    assert not last_two(feats)[:, 1].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_weighting_and_a_sink_describe_the_feature_weights(backend):
    """Under a key scale g the rows are w·g renormalised, as for every feature; a sink's mass is on no key."""
    L = 7
    q, k, v = qkv(L, L, seed=4)
    lengths = torch.tensor([7, 6, 2])
    g = torch.rand(B, H, L, generator=torch.Generator().manual_seed(5)) + 0.1
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    _, feats = ops.attention(q, k, v, lengths, want_features=True, num_windows=NW, causal=True, alignment=True,
                             key_scale=g, backend=backend)
    p = softmax_maps(q, k, D**-0.5, self_visible(L, lengths, True))
    scaled = p * g[:, :, None, :].double()
    scaled = scaled / scaled.sum(-1, keepdim=True)
    np.testing.assert_allclose(last_two(feats), alignment_from_maps(scaled.numpy(), lengths), atol=2e-5)
    _, feats = ops.attention(q, k, v, lengths, want_features=True, num_windows=NW, causal=True, alignment=True,
                             sink=sink, backend=backend)
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(~self_visible(L, lengths, True)[:, None], float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    z = e.sum(-1, keepdim=True) + torch.exp(sink.double()[None, :, None, None] - s.amax(-1, keepdim=True))
    names = feature_names(NW, sink=True, alignment=True)
    assert names[-3:] == ["sink", *ALIGNMENT_FEATURES]
    np.testing.assert_allclose(last_two(feats), alignment_from_maps((e / z).numpy(), lengths), atol=2e-5)


def test_worked_example_of_features_md():
    """docs/features.md, "Alignment features": the cross-attention row of docs/seq2seq.md §3 (row 1 of a target of 7
    over a source of 5), then a target of 3 rows over a source of 5 keys."""
    row = torch.zeros(1, 1, 7, 5)
    row[0, 0, 1] = torch.tensor([0.10, 0.30, 0.40, 0.15, 0.05])
    p1 = aligned_positions(torch.tensor([7]), 7, 5, torch.tensor([5]))[0, 1].item()
    assert p1 == pytest.approx(2 / 3)
    # row 1's own values: the mean over the 7 rows times 7, the other rows being 0
    got = alignment_features(row, torch.tensor([7]), torch.tensor([5]))[0, 0] * 7
    torch.testing.assert_close(got, torch.tensor([1.21667, 0.80]), atol=1e-5, rtol=0)
    w = torch.tensor([[0.70, 0.20, 0.05, 0.05, 0.00],
                      [0.10, 0.20, 0.40, 0.20, 0.10],
                      [0.05, 0.05, 0.10, 0.20, 0.60]])[None, None]
    assert aligned_positions(torch.tensor([3]), 3, 5, torch.tensor([5]))[0].tolist() == [0.0, 2.0, 4.0]
    rows = alignment_from_maps(w[:, :, :1].numpy(), [1], [5])  # one row alone: p = 0
    np.testing.assert_allclose(rows[0, 0], [0.45, 0.90], atol=1e-6)
    got = alignment_features(w, torch.tensor([3]), torch.tensor([5]))[0, 0]
    # row 0: 0.20 + 0.10 + 0.15 = 0.45, near 0.90; row 1: 0.2 + 0.2 + 0.2 + 0.2 = 0.80, near 0.80; row 2:
    # 0.20 + 0.15 + 0.20 + 0.20 = 0.75, near 0.80
    torch.testing.assert_close(got, torch.tensor([(0.45 + 0.80 + 0.75) / 3, (0.90 + 0.80 + 0.80) / 3]))
    # a row at a fractional position: nq = 3 over nk = 4 puts row 1 at p = 1.5, r = 2 (keys 1, 2, 3)
    assert aligned_positions(torch.tensor([3]), 3, 4, torch.tensor([4]))[0, 1].item() == 1.5
    half = torch.tensor([0.1, 0.2, 0.3, 0.4])[None, None, None].expand(1, 1, 3, 4)
    got = alignment_features(half, torch.tensor([3]), torch.tensor([4]))[0, 0]
    want = alignment_from_maps(half.numpy(), [3], [4])[0, 0]
    np.testing.assert_allclose(got.numpy(), want, atol=1e-6)
    # near: keys 0, 1 (r = 0), keys 1, 2, 3 (r = 2), keys 2, 3 (r = 3)
    assert want[1] == pytest.approx((0.3 + 0.9 + 0.7) / 3)


def test_arguments_and_shapes():
    q, k, v = qkv(4, 6)
    ql, kl = torch.tensor([4, 3, 1]), torch.tensor([6, 5, 2])
    with pytest.raises(AttnkitError, match="alignment must be a bool"):
        ops.attention(q, k, v, ql, key_lengths=kl, want_features=True, alignment=1)
    with pytest.raises(AttnkitError, match="alignment must be a bool"):
        reference_attention(q, k, v, ql, key_lengths=kl, want_features=True, alignment="yes")
    for backend in BACKENDS:  # without features alignment changes nothing
        out, feats = ops.attention(q, k, v, ql, key_lengths=kl, alignment=True, backend=backend)
        ref, _ = ops.attention(q, k, v, ql, key_lengths=kl, backend=backend)
        assert feats.shape == (B, H, 0)
        torch.testing.assert_close(out, ref)
    qm, km, vm = (torch.empty_like(t, device="meta") for t in (q, k, v))
    _, fm = ops._fused_attention_fake(qm, km, vm, ql, *ops.AttentionParams(
        want_features=True, num_windows=NW, scaling=1.0, alignment=True).op_args())
    assert fm.shape == (B, H, num_features(NW, alignment=True))


@pytest.mark.skipif(not ops.fused_alignment("cpu"), reason="a build whose CPU kernel measures the alignment features")
@pytest.mark.parametrize("blocks", ["2x3", "1x1", "64x512"])
def test_the_cpu_kernel_equals_the_reference_in_every_block_layout(monkeypatch, blocks):
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    for Lq, Lk, extra in ((5, 11, {"key_lengths": torch.tensor([11, 4, 7])}), (11, 11, {"causal": True}),
                          (11, 11, {"sliding_window": 3}), (11, 11, {}),
                          (11, 11, {"region": torch.tensor([0, 1, 2, 0], dtype=torch.int32), "renormalize": True,
                                    "sentence_id": (torch.arange(11)[None] >= 4).int().expand(B, 11)})):
        q, k, v = qkv(Lq, Lk, seed=6)
        lengths = torch.tensor([5, 2, 1]) if "key_lengths" in extra else torch.tensor([11, 8, 3])
        args = dict(want_features=True, num_windows=NW, alignment=True, **extra)
        _, fused = ops.attention(q, k, v, lengths, backend="fused", **args)
        _, ref = ops.attention(q, k, v, lengths, backend="reference", **args)
        torch.testing.assert_close(fused, ref, atol=2e-5, rtol=1e-5)


def test_only_encoder_decoders_name_them():
    """attnkit.instrument turns the alignment features on for an encoder–decoder (every kind of layer), not for a
    model of one stack, whose features stay as before."""
    from attnkit.models import instrument, model_feature_names

    from .synthetic import tiny_bert, tiny_seq2seq

    bert = instrument(tiny_bert()[0])
    assert model_feature_names(bert, NW) == feature_names(NW)
    seq2seq = instrument(tiny_seq2seq("bart"))
    assert model_feature_names(seq2seq, NW) == feature_names(NW, alignment=True)
    assert feature_names(NW, alignment=True)[-2:] == list(ALIGNMENT_FEATURES)


@pytest.mark.skipif(not ops.fused_alignment("cpu"), reason="a build whose CPU kernel measures the alignment features")
def test_the_compiled_ops_take_alignment_with_their_fake_kernels_autograd_and_the_lse_op():
    L = 6
    q, k, v = qkv(L, L, seed=7)
    lengths = torch.tensor([6, 4, 2])
    p = ops.AttentionParams(want_features=True, num_windows=NW, scaling=D**-0.5, causal=True, alignment=True)
    torch.library.opcheck(torch.ops.attnkit.fused_attention.default, (q, k, v, lengths, *p.op_args()),
                          test_utils=("test_schema", "test_faketensor"))
    _, ref = ops.attention(q, k, v, lengths, want_features=True, num_windows=NW, causal=True, alignment=True,
                           backend="reference")
    # a gradient wanted: the lse op runs (its backward reuses the output); with the max logit measured in the op
    qg = q.clone().requires_grad_(True)
    assert ops.saves_lse(qg, k, v, p)
    out, feats, ml = ops.attention(qg, k, v, lengths, want_features=True, num_windows=NW, causal=True,
                                   alignment=True, want_max_logit=True)
    torch.testing.assert_close(feats, ref, atol=2e-5, rtol=1e-5)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    lse_args = (q, k, v, lengths, *p.op_args()[:ops._LSE_PARAMS], False, True, None, True)
    torch.library.opcheck(torch.ops.attnkit.fused_attention_lse.default, lse_args,
                          test_utils=("test_schema", "test_faketensor"))
    _, lse_feats, _, _ = torch.ops.attnkit.fused_attention_lse(*lse_args)
    torch.testing.assert_close(lse_feats, ref, atol=2e-5, rtol=1e-5)
