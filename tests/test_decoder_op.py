"""The fused CPU kernel (csrc/cpu) with the decoder arguments — kv_head, causal, sliding_window, softcap, sink — against
the executable spec (attnkit/reference.py) and an independent eager implementation (tests/test_decoder_reference.py),
once per CPU capability build this machine runs (default, avx2, avx512: csrc/cpu/fused_attention_kernel.h).

Tolerance (FlashAttention style): the fused output's error against an fp32 reference of the same (rounded) inputs is
at most twice PyTorch's own error in that dtype (eager attention computed in the dtype, GQA by repeat_interleave)
plus a tiny floor; features agree with the reference to 1e-5.
"""
from __future__ import annotations

import math

import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import CLS, KEEP, NO_INTER, NO_INTRA, UNIFORM, ZERO, feature_names
from attnkit.reference import reference_attention

from .test_decoder_reference import eager, loop_features

if not (ops.has_kernel("cpu") and ops.fused_decoder()):
    pytest.skip("attnkit._C has no CPU kernel with the decoder arguments (extension not built)",
                allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-5, torch.float16: 1e-5}
N = 8


CAPABILITIES = ops.cpu_capabilities()[::-1]  # default first


@pytest.fixture(params=CAPABILITIES)
def capability(request, monkeypatch):
    """Runs the test once per CPU capability this machine supports, forced with ATTNKIT_CPU_CAPABILITY."""
    monkeypatch.setenv("ATTNKIT_CPU_CAPABILITY", request.param)
    assert torch.ops.attnkit.cpu_capability() == request.param
    return request.param


def make(B=2, H=6, Hkv=3, L=37, D=32, dtype=torch.float32, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=g).transpose(1, 2).to(dtype)  # transformers' layout: a transposed view
    k, v = (torch.randn(B, L, Hkv, D, generator=g).transpose(1, 2).to(dtype) for _ in range(2))
    if lengths is None:
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        lengths[0] = L
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    tc = torch.randint(0, 5, (B, L), generator=g, dtype=torch.int32)
    tc = torch.where(torch.rand(B, L, generator=g) < 0.6, torch.zeros_like(tc), tc)
    tc[:, 0] = CLS
    sid = torch.randint(0, 3, (B, L), generator=g, dtype=torch.int32)
    return q, k, v, lengths, tc, sid


def fused(q, k, v, lengths, tc=None, sid=None, *, want_features=True, num_windows=N, **kw):
    return ops.attention(q, k, v, lengths, tc, sid, num_windows=num_windows, want_features=want_features,
                         backend="fused", **kw)


def in_dtype(q, k, v, lengths, kv_head=None, causal=False, sliding_window=None, softcap=None, sink=None):
    """PyTorch's own attention computed in q's dtype (no upcast): the error yardstick."""
    B, H, L, D = q.shape
    idx = torch.arange(H) // (H // k.shape[1]) if kv_head is None else kv_head.long()
    k, v = k[:, idx], v[:, idx]
    s = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(L)
    vis = (pos[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        vis = vis & (pos[:, None] >= pos[None, :])
    if sliding_window is not None:
        vis = vis & (pos[:, None] - pos[None, :] < sliding_window)
    s = s.masked_fill(~vis, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(q.dtype).view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    p = torch.nan_to_num(torch.softmax(s, -1)[..., :L])
    return torch.matmul(p, v).transpose(1, 2)


def check(q, k, v, lengths, tc, sid, **kw):
    dtype = q.dtype
    want_features = kw.pop("want_features", True)
    out, feats = fused(q, k, v, lengths, tc, sid, want_features=want_features, **kw)
    assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    ref_out, ref_feats = reference_attention(q.float(), k.float(), v.float(), lengths, tc, sid, num_windows=N,
                                             want_features=want_features, **kw)
    decoder = {a: kw[a] for a in ("kv_head", "causal", "sliding_window", "softcap", "sink") if a in kw}
    own = in_dtype(q, k, v, lengths, **decoder).float()
    plain, _ = reference_attention(q.float(), k.float(), v.float(), lengths, **decoder)
    round_err = (ref_out.to(dtype).float() - ref_out).abs().max().item()
    torch_err = max((own - plain).abs().max().item(), round_err)
    err = (out.float() - ref_out).abs().max().item()
    assert err <= 2 * torch_err + FLOOR[dtype], f"{dtype}: fused err {err:.3g} > 2 × torch err {torch_err:.3g}"
    assert feats.shape == ref_feats.shape
    torch.testing.assert_close(feats, ref_feats, atol=1e-5, rtol=0)
    return out, feats


KV_UNEVEN = torch.tensor([0, 0, 0, 1, 2, 2], dtype=torch.int32)
SINK = torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0])
CASES = {
    "causal": dict(causal=True),
    "causal_gqa_uneven": dict(causal=True, kv_head=KV_UNEVEN),
    "gqa_even_default": dict(causal=True),  # Hkv = 3 divides H = 6: h // 2
    "gqa_permuted": dict(kv_head=torch.tensor([2, 1, 0, 0, 1, 2], dtype=torch.int32)),
    "window_small": dict(causal=True, sliding_window=4),
    "window_one": dict(causal=True, sliding_window=1),  # every row sees only itself
    "window_larger_than_L": dict(causal=True, sliding_window=500),
    "window_not_causal": dict(sliding_window=5),
    "softcap": dict(causal=True, softcap=1.5),
    "sink": dict(causal=True, sink=SINK),
    "sink_not_causal": dict(sink=SINK),
    "everything": dict(causal=True, kv_head=KV_UNEVEN, sliding_window=7, softcap=3.0, sink=SINK),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_matches_reference(case, dtype):
    check(*make(dtype=dtype, seed=len(case)), **CASES[case])


@pytest.mark.parametrize("L", [1, 2, 17, 130, 300])  # 130, 300: several row tiles
@pytest.mark.parametrize("case", ["causal", "everything", "window_small"])
def test_lengths_and_tiles(capability, case, L):
    B = 3
    lengths = [L, max(1, L // 2), 1]  # n = 1: row 0 sees only itself
    check(*make(B=B, L=L, seed=L, lengths=lengths), **CASES[case])


def test_against_independent_eager_and_loop_features(capability):
    q, k, v, lengths, tc, sid = make(B=2, L=11, D=16, seed=3, lengths=[11, 6])
    kw = dict(kv_head=KV_UNEVEN, causal=True, sliding_window=4, softcap=2.0, sink=SINK)
    out, feats = fused(q, k, v, lengths, tc, sid, **kw)
    e_out, p = eager(q, k, v, lengths, kv_head=KV_UNEVEN, causal=True, window=4, softcap=2.0, sink=SINK)
    torch.testing.assert_close(out.double(), e_out, atol=2e-6, rtol=1e-5)
    want = loop_features(p, lengths, tc, sid, N, 1 - p.sum(-1))
    torch.testing.assert_close(feats.double(), want, atol=1e-5, rtol=1e-5)
    assert feats.shape[-1] == len(feature_names(N, sink=True))
    total = feats[..., :5 + N].sum(-1) + feats[..., -1]
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)


@pytest.mark.parametrize("renormalize", [False, True])
def test_interventions_with_causal_rows(capability, renormalize):
    q, k, v, lengths, tc, sid = make(B=2, L=40, seed=7, lengths=[40, 23])
    kw = dict(causal=True, kv_head=KV_UNEVEN, sink=SINK, renormalize=renormalize,
              mode=torch.tensor([KEEP, UNIFORM, ZERO, KEEP, KEEP, UNIFORM], dtype=torch.int32),
              region=torch.tensor([NO_INTRA, NO_INTER, 0, NO_INTER, 0, NO_INTRA], dtype=torch.int32),
              gates=torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5, 1.0]))
    check(q, k, v, lengths, tc, sid, **kw)
    g = torch.rand(2, 6, 40, generator=torch.Generator().manual_seed(2)) + 0.1
    check(q, k, v, lengths, tc, sid, key_scale=g, sliding_window=9, **kw)


def test_all_keys_masked_but_one():
    """Scores −inf on every key but one: the row puts weight 1 on that key (and the sink its share)."""
    q, k, v, lengths, tc, sid = make(B=1, H=2, Hkv=2, L=20, seed=4, lengths=[20])
    k = k.clone()
    k[0, :, 1:] = 0.0
    q = q.clone()
    q[..., 0] = 1.0
    k[0, :, 1:, 0] = -math.inf  # every key but 0: score −inf (for every row; causal row 0 sees only key 0)
    k[0, :, 1:, 1:] = 0.0
    for kw in (dict(causal=True), dict(causal=True, sink=torch.tensor([0.0, 1.0])), dict()):
        out, f = fused(q, k, v, lengths, tc, sid, scaling=1.0, **kw)
        ref, rf = reference_attention(q, k, v, lengths, tc, sid, scaling=1.0, num_windows=N, want_features=True,
                                      **kw)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(f, rf, atol=1e-6, rtol=0)


def test_padded_rows_and_empty_windows():
    q, k, v, lengths, tc, sid = make(B=2, L=24, seed=5, lengths=[24, 3])
    out, f = check(q, k, v, lengths, tc, sid, causal=True, sliding_window=4)
    assert (out[1, 7:] == 0).all()  # padded rows s >= 3 + 4 see no key: 0, not NaN


def test_causal_skips_the_key_tiles_above_the_diagonal():
    """A NaN value at a late key reaches only the rows that see it (and the rows of its own tile, as 0·NaN):
    the tiles before it are never multiplied with it — the kernel skips them, it does not compute and mask."""
    q, k, v, lengths, tc, sid = make(B=1, H=2, Hkv=2, L=256, seed=6, lengths=[256])
    v = v.clone()
    v[0, :, 200] = float("nan")
    out, _ = fused(q, k, v, lengths, causal=True, want_features=False)
    assert torch.isfinite(out[0, :128]).all()
    assert out[0, 200:].isnan().all()
    # a window: keys before s − W + 1 are skipped as well
    v2 = make(B=1, H=2, Hkv=2, L=256, seed=6)[2].clone()
    v2[0, :, 10] = float("nan")
    out2, _ = fused(q, k, v2, lengths, causal=True, sliding_window=8, want_features=False)
    assert out2[0, 10:18].isnan().all() and torch.isfinite(out2[0, 128:]).all()


def test_gradients_with_decoder_arguments_match_reference():
    q, k, v, lengths, tc, sid = make(B=2, L=12, D=16, seed=8, lengths=[12, 7])
    grads = []
    for backend in ("fused", "reference"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        sink = SINK.clone().requires_grad_()
        gates = torch.tensor([1.0, 0.5, 1.5, 1.0, 2.0, 1.0], requires_grad=True)
        out, _ = ops.attention(*leaves, lengths, tc, sid, causal=True, kv_head=KV_UNEVEN, sliding_window=5,
                               softcap=2.0, sink=sink, gates=gates, backend=backend)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * w).sum().backward()
        grads.append([t.grad for t in leaves] + [sink.grad, gates.grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert grads[0][3].abs().sum() > 0  # the sink's gradient


def test_opcheck_and_compile_with_decoder_arguments():
    q, k, v, lengths, tc, sid = make(B=2, L=9, D=32, seed=1)
    op = torch.ops.attnkit.fused_attention.default
    for extra in ((KV_UNEVEN, True, 4, 2.0, SINK), (None, True, None, None, None), (None, False, 3, None, SINK)):
        args = (q, k, v, lengths, tc, sid, 0.2, N, None, None, False, torch.ones(6), True, None) + extra
        torch.library.opcheck(op, args)
    grad_args = (q.requires_grad_(), k, v, lengths, tc, sid, 0.2, N, None, None, False, None, False, None, KV_UNEVEN,
                 True, 4, 2.0, SINK.clone().requires_grad_())
    torch.library.opcheck(op, grad_args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    def f(q, k, v):
        out, feats = ops.attention(q * 1.0, k, v, lengths, tc, sid, num_windows=N, want_features=True, causal=True,
                                   kv_head=KV_UNEVEN, sliding_window=5, softcap=2.0, sink=SINK)
        return out.sum(-1), feats * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        a, fa = compiled(q, k, v)
        b, fb = f(q, k, v)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(fa, fb)
    assert fa.shape == (2, 6, len(feature_names(N, sink=True)))


def test_capability_choice_follows_torch_and_the_override(monkeypatch):
    monkeypatch.delenv("ATTNKIT_CPU_CAPABILITY", raising=False)
    torch_cap = torch.backends.cpu.get_cpu_capability().lower()
    expected = torch_cap if torch_cap in CAPABILITIES else CAPABILITIES[-1]
    assert torch.ops.attnkit.cpu_capability() == expected
    assert ops.cpu_capability() == expected
    for cap in CAPABILITIES:
        monkeypatch.setenv("ATTNKIT_CPU_CAPABILITY", cap.upper())  # case does not matter
        assert ops.cpu_capability() == cap
    monkeypatch.setenv("ATTNKIT_CPU_CAPABILITY", "sse9")
    q, k, v, lengths, tc, sid = make(B=1, L=4, seed=1)
    with pytest.raises(AttnkitError, match="ATTNKIT_CPU_CAPABILITY must be default, avx2 or avx512, got sse9"):
        fused(q, k, v, lengths)


def test_the_kernel_refuses_bad_decoder_arguments_by_name():
    q, k, v, lengths, tc, sid = make(B=1, L=5, seed=2)
    op = torch.ops.attnkit.fused_attention
    base = (q, k, v, lengths, None, None, 0.2, N, None, None, False, None, False, None)
    for extra, match in (((torch.tensor([0, 0, 1, 1, 2, 3], dtype=torch.int32),), r"kv_head must lie in \[0, Hkv\)"),
                         ((torch.zeros(6, dtype=torch.int64),), "kv_head must be Int"),
                         ((None, True, 0), "sliding_window must be an integer >= 1"),
                         ((None, True, None, -1.0), "softcap must be a finite number > 0"),
                         ((None, True, None, None, torch.zeros(5)), "sink must be Float of shape")):
        with pytest.raises(RuntimeError, match=match):
            op(*base, *extra)
    with pytest.raises(RuntimeError, match="give kv_head"):
        op(q, k[:, :2].repeat(1, 2, 1, 1), v[:, :2].repeat(1, 2, 1, 1), lengths, None, None, 0.2, N, None, None,
           False, None, False)


@pytest.mark.parametrize("aten", ["default", "avx2"])
def test_capability_follows_aten_cpu_capability(aten):
    """torch's own choice (ATEN_CPU_CAPABILITY lowers it) decides the build when ATTNKIT_CPU_CAPABILITY is unset."""
    import os
    import subprocess
    import sys

    if aten not in CAPABILITIES:
        pytest.skip(f"this CPU lacks {aten}")
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_CPU_CAPABILITY"} | {"ATEN_CPU_CAPABILITY": aten}
    code = "import torch; from attnkit import ops; print(torch.backends.cpu.get_cpu_capability(), ops.cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [aten.upper() if aten != "default" else "DEFAULT", aten]
