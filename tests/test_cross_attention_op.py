"""Cross-attention in the op (attnkit/reference.py, "Cross-attention"; docs/seq2seq.md): queries from one sequence,
keys and values from another, each sample with its own query and key lengths, and T5's additive bias. Against an
independent eager computation here (an explicit key mask, a plain softmax) and features counted from its maps
(tests/synthetic.py: `cross_features_from_maps`, written from the definition in docs/features.md): outputs, weights, interventions, the
max logit, the backward, every backend on the CPU, and the argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import CLS, COMMA, OTHER, PERIOD, SEP, UNIFORM, ZERO
from attnkit.reference import attention_weights, max_logits, reference_attention

from .synthetic import cross_features_from_maps

B, H, D, NW = 3, 4, 8, 4


def eager_cross(q, k, v, key_lengths, scaling, bias=None):
    """(out B×Lq×H×D fp64, weights B×H×Lq×Lk fp64): every query row over the keys t < key_lengths."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scaling
    if bias is not None:
        s = s + bias.double()
    keys = torch.arange(k.shape[2])[None, :] < key_lengths[:, None]
    s = s.masked_fill(~keys[:, None, None, :], float("-inf"))
    p = torch.softmax(s, -1)
    return torch.matmul(p, v.double()).transpose(1, 2), p


def tensors(Lq=5, Lk=7, seed=0, dtype=torch.float32, q_lengths=(5, 3, 1), k_lengths=(7, 4, 6)):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Lq, D, generator=g) * 1.5).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    ql = torch.tensor([min(n, Lq) for n in q_lengths])
    kl = torch.tensor([min(n, Lk) for n in k_lengths])
    qc = torch.full((B, Lq), OTHER, dtype=torch.int32)
    qc[:, 0] = CLS
    kc = torch.full((B, Lk), OTHER, dtype=torch.int32)
    kc[:, 0] = CLS
    kc[0, Lk - 1] = SEP
    if Lk > 3:
        kc[1, 2], kc[2, 3] = COMMA, PERIOD
    return q, k, v, ql, kl, qc, kc


SHAPES = [(5, 7), (7, 5), (1, 6), (6, 1), (1, 1), (9, 9), (3, 13)]


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_cross_attention_equals_eager_and_features_count_its_maps(Lq, Lk, backend):
    q, k, v, ql, kl, qc, kc = tensors(Lq, Lk)
    scaling = D**-0.5
    want_out, p = eager_cross(q, k, v, kl, scaling)
    out, feats = ops.attention(q, k, v, ql, qc, key_lengths=kl, key_class=kc, want_features=True, num_windows=NW,
                               backend=backend)
    assert out.shape == (B, Lq, H, D) and feats.shape == (B, H, 5 + NW + 7)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-5)  # padded rows attend too (as eager)
    w = attention_weights(q, k, ql, scaling, key_lengths=kl)
    torch.testing.assert_close(w.double(), p, atol=2e-6, rtol=1e-5)
    want = cross_features_from_maps(p.numpy(), ql, kl, qc, kc, NW)
    np.testing.assert_allclose(feats.numpy(), want, atol=2e-5)
    np.testing.assert_allclose(feats[..., :5 + NW].sum(-1).numpy(), 1.0, atol=1e-5)


def test_all_keys_masked_but_one_and_odd_lengths():
    q, k, v, ql, kl, qc, kc = tensors(5, 7, k_lengths=(1, 1, 7), q_lengths=(3, 5, 2))
    out, feats = ops.attention(q, k, v, ql, qc, key_lengths=kl, key_class=kc, want_features=True, num_windows=NW)
    want_out, p = eager_cross(q, k, v, kl, D**-0.5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[0].double(), v[0, :, :1].double().expand(H, 5, D).transpose(0, 1))
    want = cross_features_from_maps(p.numpy(), ql, kl, qc, kc, NW)
    np.testing.assert_allclose(feats.numpy(), want, atol=2e-5)
    assert float(feats[0, :, 0].min()) == pytest.approx(1.0)  # the one key is CLS: all mass in `cls`


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v, ql, kl, qc, kc = tensors(4, 6, dtype=dtype)
    out, feats = ops.attention(q, k, v, ql, qc, key_lengths=kl, key_class=kc, want_features=True, num_windows=NW)
    assert out.dtype == dtype
    ref, rfeats = reference_attention(q.float(), k.float(), v.float(), ql, qc, key_lengths=kl, key_class=kc,
                                      want_features=True, num_windows=NW)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(feats, rfeats, atol=2e-2, rtol=2e-2)


def test_interventions_gates_key_scale_and_max_logit():
    q, k, v, ql, kl, qc, kc = tensors(5, 7)
    mode = torch.tensor([0, ZERO, UNIFORM, 0], dtype=torch.int32)
    gates = torch.tensor([1.0, 1.0, 1.0, 0.5])
    out, feats, ml = ops.attention(q, k, v, ql, qc, key_lengths=kl, key_class=kc, want_features=True,
                                   num_windows=NW, mode=mode, gates=gates, want_max_logit=True)
    want_out, p = eager_cross(q, k, v, kl, D**-0.5)
    uniform = (torch.arange(7)[None, :] < kl[:, None]).double()
    uniform = (uniform / uniform.sum(-1, keepdim=True))[:, None, :].expand(B, 5, 7)
    p[:, 1] = 0.0
    p[:, 2] = uniform
    want_out = torch.matmul(p, v.double()).transpose(1, 2) * gates.double().view(1, 1, H, 1)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-5)
    assert float(out[:, :, 1].abs().sum()) == 0.0
    want = cross_features_from_maps(p.numpy(), ql, kl, qc, kc, NW)
    want[:, 1] = 0.0  # a zeroed head has no weights: its features are 0
    np.testing.assert_allclose(feats.numpy(), want, atol=2e-5)
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * D**-0.5
    seen = (torch.arange(5)[None, :, None] < ql[:, None, None]) & (torch.arange(7)[None, None, :] < kl[:, None, None])
    want_ml = s.masked_fill(~seen[:, None], float("-inf")).amax((-1, -2))
    torch.testing.assert_close(ml.double(), want_ml, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(max_logits(q, k, ql, D**-0.5, key_lengths=kl).double(), want_ml, atol=1e-5, rtol=1e-5)
    # norm weighting: the features of the weights scaled per key
    g = torch.rand(B, H, 7) + 0.5
    _, nf = ops.attention(q, k, v, ql, qc, key_lengths=kl, key_class=kc, want_features=True, num_windows=NW,
                          key_scale=g)
    _, p = eager_cross(q, k, v, kl, D**-0.5)
    pw = p * g.double()[:, :, None, :]
    pw = pw / pw.sum(-1, keepdim=True)
    np.testing.assert_allclose(nf.numpy(), cross_features_from_maps(pw.numpy(), ql, kl, qc, kc, NW), atol=2e-5)


@pytest.mark.parametrize("batch_bias", [True, False])
def test_an_additive_bias_in_self_and_cross_attention(batch_bias):
    q, k, v, ql, kl, qc, kc = tensors(5, 7)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(B if batch_bias else 1, H, 5, 7, generator=g)
    want_out, p = eager_cross(q, k, v, kl, 1.0, bias)
    out, feats = ops.attention(q, k, v, ql, qc, key_lengths=kl, key_class=kc, scaling=1.0, bias=bias,
                               want_features=True, num_windows=NW)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(feats.numpy(), cross_features_from_maps(p.numpy(), ql, kl, qc, kc, NW), atol=2e-5)
    # self-attention with a bias (T5's encoder): the same sums over one sequence
    qs, ks, vs = q[:, :, :5], k[:, :, :5], v[:, :, :5]
    sb = bias[..., :5]
    lengths = torch.tensor([5, 4, 2])
    want_out, p = eager_cross(qs, ks, vs, lengths, 1.0, sb)
    out, _ = ops.attention(qs, ks, vs, lengths, scaling=1.0, bias=sb)
    valid = torch.arange(5)[None] < lengths[:, None]
    torch.testing.assert_close(out[valid].double(), want_out[valid], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
def test_backward_reaches_q_k_v_gates_and_the_bias(with_bias):
    """Without a bias the compiled CPU kernel runs the forward where it takes cross-attention (backend auto)."""
    q, k, v, ql, kl, qc, kc = tensors(5, 7)
    bias = torch.randn(1, H, 5, 7) if with_bias else torch.zeros(1, H, 5, 7)
    gates = torch.tensor([1.0, 0.5, 2.0, 1.0])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias, gates)]
    out, _ = ops.attention(*leaves[:3], ql, key_lengths=kl, bias=leaves[3] if with_bias else None, gates=leaves[4])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves if with_bias else leaves[:3] + leaves[4:], grad)
    if not with_bias:
        got = (*got[:3], torch.zeros_like(bias), got[3])
    ref = [t.clone().double().requires_grad_(True) for t in (q, k, v, bias, gates)]
    want_out, _ = eager_cross(ref[0], ref[1], ref[2], kl, D**-0.5, ref[3])
    want_out = want_out * ref[4].view(1, 1, H, 1)
    want = torch.autograd.grad(want_out, ref, grad.double())
    if not with_bias:
        want = (*want[:3], torch.zeros_like(bias).double(), want[4])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4)


def test_arguments_are_checked_by_name():
    q, k, v, ql, kl, qc, kc = tensors(5, 7)
    with pytest.raises(AttnkitError, match="key_lengths must lie in"):
        ops.attention(q, k, v, ql, key_lengths=torch.tensor([8, 1, 1]))
    with pytest.raises(AttnkitError, match="lengths must lie in \\[1, Lq\\]"):
        ops.attention(q, k, v, torch.tensor([6, 1, 1]), key_lengths=kl)
    with pytest.raises(AttnkitError, match="key_class must have shape"):
        ops.attention(q, k, v, ql, key_lengths=kl, key_class=qc)
    with pytest.raises(AttnkitError, match="give key_lengths"):
        ops.attention(q, k[:, :, :5], v[:, :, :5], ql, key_class=qc)
    for refused in (dict(causal=True), dict(region=torch.zeros(H, dtype=torch.int32)),
                    dict(sentence_id=torch.zeros(B, 7, dtype=torch.int32))):
        with pytest.raises(AttnkitError, match=f"takes no {next(iter(refused))}"):
            ops.attention(q, k, v, ql, key_lengths=kl, **refused)
    with pytest.raises(AttnkitError, match="bias must have shape"):
        ops.attention(q, k, v, ql, key_lengths=kl, bias=torch.zeros(B, H, 7, 5))
    with pytest.raises(AttnkitError, match="q's shape"):  # fewer keys than queries: cross-attention needs key_lengths
        ops.attention(q, k[:, :, :3], v[:, :, :3], ql)


def test_fake_kernel_shapes():
    q, k, v, ql, kl, qc, kc = tensors(5, 7)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, feats = torch.ops.attnkit.fused_attention_triton(
            fq, fk, fv, mode.from_tensor(ql), None, None, 1.0, NW, None, None, False, None, True, None, None, False,
            None, None, None, mode.from_tensor(kl), None, None)
    assert tuple(out.shape) == (B, 5, H, D) and tuple(feats.shape) == (B, H, 5 + NW + 7)


def test_worked_example_of_seq2seq_md():
    """docs/seq2seq.md, "Worked example": N = 4, source [CLS] le chat . [SEP], a target of 7 rows."""
    from attnkit.features import feature_names
    from attnkit.reference import bucket_index, row_features

    key_class = torch.tensor([[CLS, OTHER, OTHER, PERIOD, SEP]], dtype=torch.int32)
    nk = torch.tensor([5])
    names = ["cls", "sep", "comma", "period", "self", "win_0", "win_1", "win_2", "win_3"]
    idx = bucket_index(key_class, nk, 4, 7, 0)[0]
    table = {0: ["cls", "win_0", "win_1", "period", "sep"], 1: ["cls", "self", "win_0", "period", "sep"],
             2: ["cls", "win_0", "self", "period", "sep"], 6: ["cls", "win_3", "win_3", "period", "sep"]}
    assert {i: [names[j] for j in idx[i].tolist()] for i in table} == table
    w = torch.zeros(1, 1, 7, 5)
    w[0, 0, 1] = torch.tensor([0.10, 0.30, 0.40, 0.15, 0.05])
    # row 1 alone: the other rows (valid, weight 0) add 0 to every feature; undo the mean over the 7 rows
    got = dict(zip(feature_names(4), (row_features(w, torch.tensor([7]), None, None, 4, key_lengths=nk,
                                                   key_class=key_class)[0, 0] * 7).tolist()))
    row1 = {"cls": 0.10, "sep": 0.05, "comma": 0.0, "period": 0.15, "self": 0.30, "win_0": 0.40, "win_1": 0.0,
            "win_2": 0.0, "win_3": 0.0, "prev": 0.10, "next": 0.40, "entropy": 1.392, "max": 0.40, "intra": 1.0,
            "inter": 0.0}
    for k, v in row1.items():
        assert got[k] == pytest.approx(v, abs=5e-4), k


@pytest.mark.skipif(not ops.fused_cross("cpu"), reason="the compiled CPU kernel of this build takes no cross-attention")
@pytest.mark.parametrize("blocks", ["", "2x3", "1x1", "4x64"])
@pytest.mark.parametrize("Lq,Lk", [(5, 7), (11, 4), (1, 9), (6, 1)])
def test_the_cpu_kernel_equals_the_reference_in_every_block_layout(monkeypatch, blocks, Lq, Lk):
    """The compiled kernel's cross-attention (csrc/cpu: one key block per task, or several; rows past the source's end)
    against the reference: outputs, features (with a key scale too) and the max logit."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    q, k, v, ql, kl, qc, kc = tensors(Lq, Lk, q_lengths=(Lq, max(1, Lq - 2), 1), k_lengths=(Lk, max(1, Lk - 3), 1))
    mode = torch.tensor([0, ZERO, UNIFORM, 0], dtype=torch.int32)
    for extra in (dict(), dict(mode=mode, gates=torch.tensor([1.0, 1.0, 0.5, 2.0])),
                  dict(key_scale=torch.rand(B, H, Lk) + 0.1), dict(kv_head=torch.tensor([0, 0, 1, 1], dtype=torch.int32)),
                  dict(bias=torch.randn(B, H, Lq, Lk) * 2), dict(bias=torch.randn(1, H, Lq, Lk), mode=mode)):
        kk, vv = (k[:, :2], v[:, :2]) if "kv_head" in extra else (k, v)
        args = dict(key_lengths=kl, key_class=kc, want_features=True, num_windows=NW, **extra)
        out, feats, ml = ops.attention(q, kk, vv, ql, qc, backend="fused", want_max_logit=True, **args)
        ref, rfeats, rml = ops.attention(q, kk, vv, ql, qc, backend="reference", want_max_logit=True, **args)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(feats, rfeats, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ml, rml, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ops.fused_bias("cpu"), reason="the compiled CPU kernel of this build takes no bias")
@pytest.mark.parametrize("blocks", ["", "2x3", "1x1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_adds_a_bias_to_self_attention_as_the_reference_does(monkeypatch, blocks, dtype):
    """T5's self-attention (its encoder; its decoder, causal, and a KV-cache step of it) with a bias per sample or one
    for all, keys the bias masks (−inf), soft-capped scores and interventions: the compiled kernel against the
    reference, outputs of the valid rows and features."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    g = torch.Generator().manual_seed(5)
    L = 9
    q, k, v = ((torch.randn(B, H, L, D, generator=g) * 1.5).to(dtype) for _ in range(3))
    lengths = torch.tensor([9, 6, 1])
    tc = torch.full((B, L), OTHER, dtype=torch.int32)
    tc[:, 0], tc[0, 8], tc[1, 3] = CLS, SEP, COMMA
    mode = torch.tensor([0, ZERO, UNIFORM, 0], dtype=torch.int32)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for n_bias in (1, B):
        bias = torch.randn(n_bias, H, L, L, generator=g) * 3
        bias[..., 2] = float("-inf")  # key 2 is seen by no row
        for extra in (dict(), dict(causal=True), dict(causal=True, sliding_window=3), dict(softcap=4.0),
                      dict(mode=mode, gates=torch.tensor([1.0, 1.0, 0.5, 2.0]))):
            for rows in (slice(0, L), slice(L - 2, L)):  # every row, or a KV-cache step's last two
                args = dict(bias=bias[:, :, rows], want_features=True, num_windows=NW, **extra)
                if rows.start and "causal" not in extra:
                    continue  # a KV-cache step is a decoder's (causal)
                out, feats = ops.attention(q[:, :, rows], k, v, lengths, tc, backend="fused", **args)
                ref, rfeats = ops.attention(q[:, :, rows], k, v, lengths, tc, backend="reference", **args)
                valid = (torch.arange(L)[rows][None] < lengths[:, None])  # B × rows: the rows with a token
                torch.testing.assert_close(out[valid].float(), ref[valid].float(), **tol)
                torch.testing.assert_close(feats, rfeats, **tol)


@pytest.mark.skipif(not ops.fused_cross("cpu"), reason="the compiled CPU kernel of this build takes no cross-attention")
def test_the_compiled_op_passes_opcheck_and_refuses_a_bias_of_another_shape_by_name():
    q, k, v, ql, kl, qc, kc = tensors(5, 7)
    args = (q, k, v, ql, qc, None, D**-0.5, NW, None, None, False, None, True, None, None, False, None, None, None,
            kl, kc, None)
    torch.library.opcheck(torch.ops.attnkit.fused_attention.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with pytest.raises(RuntimeError, match="bias must be a float32 CPU tensor of shape"):
        torch.ops.attnkit.fused_attention(*args[:-1], torch.zeros(1, H, 7, 5))
    with pytest.raises(RuntimeError, match="takes no sentence_id, region, causal"):
        torch.ops.attnkit.fused_attention(*args[:15], True, *args[16:])
