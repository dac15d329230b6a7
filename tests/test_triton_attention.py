"""The Triton kernel of attnkit::fused_attention (attnkit/kernels/triton_attention.py) against the reference.

Its real code runs here on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), with 16×16 tiles so that small inputs cross tile edges: lengths 1, tile − 1, tile, tile + 1, odd and
several tiles, right padding, every mode and region with and without renormalisation, gates, key scales, more
than 64 windows, and the decoder arguments (causal, grouped KV heads, sliding windows, soft-capping, sinks).
Features must agree with the reference to fp32 rounding; outputs to the input dtype's rounding (P enters P·V in
the input dtype, as on a GPU). Interpreted launches take seconds: shapes stay tiny.
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch

# On a GPU (tools/gpu_check.sh tests: ATTNKIT_TRITON_DEVICE=cuda) the same cases run the compiled kernel; here the
# interpreter runs it: tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton (@triton.jit reads
# it at definition, Triton's own functions included)
DEV = "cuda" if os.environ.get("ATTNKIT_TRITON_DEVICE") == "cuda" else "cpu"
pytest.importorskip("triton")

from attnkit import ops  # noqa: E402
from attnkit.errors import AttnkitError  # noqa: E402
from attnkit.features import (  # noqa: E402
    ALL,
    CLS,
    COMMA,
    KEEP,
    NO_INTER,
    NO_INTRA,
    PERIOD,
    SEP,
    UNIFORM,
    ZERO,
    num_features,
)
from attnkit.kernels import triton_attention as ta  # noqa: E402
from attnkit.reference import reference_attention  # noqa: E402

# the interpreter's NumPy warns about the NaN and inf that the numerics tests feed it on purpose
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
TILE = 16  # the tile edges the lengths below are chosen around (BM = BN = TILE, on the GPU too)
MODE_REGION = [(m, r) for m in (KEEP, ZERO, UNIFORM) for r in (ALL, NO_INTRA, NO_INTER)]
OUT_ATOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def inputs(B, H, L, lengths, *, D=16, Hkv=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv or H, L, D, generator=g).to(dtype) for _ in range(2))
    lengths = torch.tensor(lengths)
    tc = torch.zeros(B, L, dtype=torch.int32)
    pick = torch.rand(B, L, generator=g)
    tc[pick < 0.1] = COMMA
    tc[(pick >= 0.1) & (pick < 0.18)] = PERIOD
    sid = torch.zeros(B, L, dtype=torch.int32)
    for b, n in enumerate(lengths.tolist()):
        tc[b, 0] = CLS
        tc[b, n - 1] = SEP
        sid[b, n // 2 + 1:] = 1
        sid[b, (3 * n) // 4 + 1:] = 2
    return tuple(t.to(DEV) for t in (q, k, v, lengths, tc, sid))


def run(*args, **kw):
    return ta.fused_attention(*args, block_m=TILE, block_n=TILE, **kw)


def compare(q, k, v, lengths, tc, sid, *, num_windows=16, **kw):
    """Runs the kernel and the reference; asserts they agree; returns the kernel's (out, features)."""
    kw = {name: t.to(DEV) if isinstance(t, torch.Tensor) else t for name, t in kw.items()}
    out, feats = run(q, k, v, lengths, tc, sid, None, num_windows, want_features=True, **kw)
    ref_out, ref_feats = reference_attention(q, k, v, lengths, tc, sid, num_windows=num_windows,
                                             want_features=True, **kw)
    assert feats.shape == ref_feats.shape
    torch.testing.assert_close(feats, ref_feats, rtol=1e-4, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=OUT_ATOL[q.dtype], equal_nan=True)
    return out, feats


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lengths_around_tile_edges(dtype):
    # tile 16: 1, tile − 1, tile, tile + 1, odd, several tiles (the batch is padded to 49)
    q, k, v, lengths, tc, sid = inputs(6, 1, 49, [49, 1, 15, 16, 17, 33], dtype=dtype, seed=1)
    compare(q, k, v, lengths, tc, sid)


@pytest.mark.parametrize("renormalize", [False, True])
def test_every_mode_and_region(renormalize):
    H = len(MODE_REGION)
    q, k, v, lengths, tc, sid = inputs(2, H, 33, [33, 17], seed=2)
    mode = torch.tensor([m for m, _ in MODE_REGION], dtype=torch.int32)
    region = torch.tensor([r for _, r in MODE_REGION], dtype=torch.int32)
    out, feats = compare(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize,
                         gates=torch.linspace(-1.5, 2.0, H))
    assert (out[:, :, 3:6] == 0).all() and (feats[:, 3:6] == 0).all()  # mode zero: exactly 0


def test_key_scale_with_regions_and_no_sentence_ids():
    q, k, v, lengths, tc, _ = inputs(2, 3, 33, [33, 18], seed=3)
    g = torch.rand(2, 3, 33, generator=torch.Generator().manual_seed(4)).to(DEV) * 3
    g[0, 0, :10] = 0.0
    compare(q, k, v, lengths, tc, None, key_scale=g, region=torch.tensor([ALL, NO_INTRA, NO_INTER], dtype=torch.int32))


@pytest.mark.parametrize("num_windows", [1, 100])
def test_windows_beyond_64(num_windows):
    q, k, v, lengths, tc, sid = inputs(2, 1, 40, [40, 23], seed=5)
    compare(q, k, v, lengths, tc, sid, num_windows=num_windows)


@pytest.mark.parametrize("case", [
    dict(causal=True),
    dict(causal=True, sliding_window=7),
    dict(sliding_window=20),
    dict(causal=True, softcap=2.0, sink=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    dict(causal=True, sink=torch.tensor([1.0, 0.0, -0.5, 3.0]), renormalize=True,
         mode=torch.tensor([KEEP, UNIFORM, ZERO, KEEP], dtype=torch.int32),
         region=torch.tensor([NO_INTER, ALL, ALL, NO_INTRA], dtype=torch.int32)),
], ids=["causal", "causal-window", "window", "softcap-sink", "sink-interventions"])
def test_decoder_arguments(case):
    # four query heads on two KV heads (even groups), and an uneven kv_head map in the last case
    q, k, v, lengths, tc, sid = inputs(2, 4, 40, [40, 19], Hkv=2, seed=6)
    if "mode" in case:
        case = dict(case, kv_head=torch.tensor([1, 0, 1, 1], dtype=torch.int32))
    out, feats = compare(q, k, v, lengths, tc, sid, **case)
    assert feats.shape[-1] == num_features(16, sink="sink" in case)
    if case.get("causal"):
        assert (feats[..., 5 + 16 + 1] == 0).all()  # next: a causal row never sees the next key


def test_causal_and_window_tiles_are_skipped_not_masked():
    # NaN in v at a valid key: rows whose tiles never contain that key stay finite only if the tile is skipped
    # (masking would multiply a zero weight by NaN)
    q, k, v, lengths, tc, sid = inputs(1, 1, 64, [64], seed=7)
    v[0, 0, 40] = float("nan")
    out, _ = run(q, k, v, lengths, tc, sid, None, 16, causal=True)
    assert torch.isfinite(out[0, :32]).all() and torch.isnan(out[0, 40:]).all()
    v[0, 0, 40] = 0.0
    v[0, 0, 0] = float("nan")
    out, _ = run(q, k, v, lengths, tc, sid, None, 16, causal=True, sliding_window=8)
    assert torch.isfinite(out[0, 32:]).all() and torch.isnan(out[0, :8]).all()


def test_nan_policy():
    q, k, v, lengths, tc, sid = inputs(2, 2, 20, [20, 12], seed=8)
    q[0, 1, 3] = float("nan")  # a valid row: every feature of (0, 1) NaN
    q[1, 0, 15] = float("nan")  # a padded row: features untouched
    k[1, 1, 4] = float("inf")  # a valid key: inf · q mixes signs, so NaN scores
    _, feats = compare(q, k, v, lengths, tc, sid)
    assert feats[0, 1].isnan().all() and feats[1, 1].isnan().all()
    assert torch.isfinite(feats[0, 0]).all() and torch.isfinite(feats[1, 0]).all()


def test_features_are_reduced_without_atomics():
    # determinism (issue 28 item 4): each program stores its own partial sums; no atomic may come back
    assert "atomic_" not in inspect.getsource(ta._fused_attention_kernel.fn)


@pytest.mark.skipif(DEV != "cpu", reason="the interpreter's op path (CPU tensors)")
def test_op_registration_compile_and_autograd():
    q, k, v, lengths, tc, sid = inputs(1, 2, 18, [18], seed=9)
    sink = torch.tensor([0.0, 1.0])
    args = (q, k, v, lengths, tc, sid, 0.25, 4, None, None, False, None, True, None, None, True, None, None, sink)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    out_m, feats_m = torch.ops.attnkit.fused_attention_triton(*meta)  # the fake kernel
    assert out_m.shape == (1, 18, 2, 16) and feats_m.shape == (1, 2, num_features(4, sink=True))

    compiled = torch.compile(lambda *a: torch.ops.attnkit.fused_attention_triton(*a), backend="eager",
                             fullgraph=True)
    out, feats = compiled(*args)
    ref_out, ref_feats = reference_attention(q, k, v, lengths, tc, sid, scaling=0.25, num_windows=4,
                                             want_features=True, causal=True, sink=sink)
    torch.testing.assert_close(feats, ref_feats, rtol=1e-4, atol=1e-5)

    qg = q.float().requires_grad_()
    qb = qg.to(torch.bfloat16)
    out, _ = torch.ops.attnkit.fused_attention_triton(qb, *args[1:])
    out.float().sum().backward()
    qr = q.float().requires_grad_()
    ref_out, _ = reference_attention(qr.to(torch.bfloat16), k, v, lengths, tc, sid, scaling=0.25, num_windows=4,
                                     causal=True, sink=sink)
    ref_out.float().sum().backward()
    torch.testing.assert_close(qg.grad, qr.grad)


@pytest.mark.skipif(DEV != "cpu", reason="the interpreter's op path (CPU tensors)")
def test_kernel_choice(monkeypatch):
    monkeypatch.setenv("ATTNKIT_CUDA_KERNEL", "v9")
    with pytest.raises(AttnkitError, match="ATTNKIT_CUDA_KERNEL must be 'v1', 'v2' or 'triton', got 'v9'"):
        ops.cuda_kernel()
    monkeypatch.setenv("ATTNKIT_CUDA_KERNEL", "triton")
    assert ops.cuda_kernel() == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v, lengths, tc, sid = inputs(1, 1, 4, [4], seed=10)
    with pytest.raises(AttnkitError, match="runs on CUDA tensors"):
        torch.ops.attnkit.fused_attention_triton(q, k, v, lengths, tc, sid, 0.25, 4, None, None, False, None,
                                                 False, None)


COMPILE = """
import sys, torch
from attnkit.kernels import triton_attention as ta
all_flags = dict(FEATURES=True, HAS_TC=True, HAS_SID=True, HAS_MODE=True, HAS_REGION=True, HAS_GATES=True,
                 HAS_KS=True, HAS_SINK=True, CAUSAL=True, HAS_WINDOW=True, HAS_SOFTCAP=True, RENORM=True)
for dtype, flags in ((torch.bfloat16, dict(FEATURES=True, HAS_TC=True, HAS_SID=True)), (torch.float16, all_flags)):
    k = ta.compile_for_gpu(90, dtype, **flags)
    assert ".target sm_90" in k.asm["ptx"] and len(k.asm["cubin"]) > 1000
print("compiled")
"""


@pytest.mark.skipif(DEV != "cpu", reason="the GPU runs the compiled kernel itself")
def test_compiles_for_sm90_without_a_gpu():
    # the interpreter runs the kernel's Python; this compiles it for an H100 (Triton's own ptxas, no GPU), which
    # catches what only the compiler checks (types, layouts, constexpr branches), for the extraction path and with
    # every flag on
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
