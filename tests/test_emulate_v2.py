"""The tile algorithm of the single-pass CUDA kernel (tools/emulate_v2_kernel.py, an fp32 emulation of
csrc/cuda/fused_attention_v2_kernel.cuh) against the reference, on lengths at and around the tile edges.

This checks the algorithm on any machine: tile order, masking of the tail tile, online rescaling of every
feature sum, run-length buckets per thread, quad sums, the two normalisers. tests/test_fused_cuda.py
checks the CUDA code itself on a GPU.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from attnkit.features import ALL, CLS, COMMA, KEEP, NO_INTER, NO_INTRA, PERIOD, SEP, UNIFORM, ZERO
from attnkit.reference import reference_attention

_spec = importlib.util.spec_from_file_location(
    "emulate_v2_kernel", Path(__file__).resolve().parent.parent / "tools" / "emulate_v2_kernel.py")
emulator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emulator)

MODES = torch.tensor([KEEP, KEEP, KEEP, UNIFORM, ZERO], dtype=torch.int32)
REGIONS = torch.tensor([ALL, NO_INTRA, NO_INTER, NO_INTER, ALL], dtype=torch.int32)


def inputs(L, lengths, *, H=5, D=8, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q, k, v = (torch.randn(B, H, L, D, generator=g) * scale for _ in range(3))
    tc = torch.zeros(B, L, dtype=torch.int32)
    pick = torch.rand(B, L, generator=g)
    tc[pick < 0.1] = COMMA
    tc[(pick >= 0.1) & (pick < 0.15)] = PERIOD
    sid = torch.zeros(B, L, dtype=torch.int32)
    for b, n in enumerate(lengths):
        tc[b, 0] = CLS
        tc[b, n - 1] = SEP
        sid[b, n // 2:] = 7
        sid[b, (3 * n) // 4:] = -3
    return q, k, v, torch.tensor(lengths), tc, sid


def compare(q, k, v, lengths, tc, sid, **kw):
    want_out, want_f = reference_attention(q, k, v, lengths, tc, sid, want_features=True, **kw)
    got_out, got_f = emulator.emulate(q, k, v, lengths, tc, sid, **kw)
    torch.testing.assert_close(got_out, want_out.float(), rtol=1e-4, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(got_f, want_f, rtol=1e-4, atol=2e-6, equal_nan=True)
    return got_f


@pytest.mark.parametrize("L,lengths", [(1, [1]), (70, [1, 70]), (130, [63, 64, 65]), (130, [127, 128, 129]),
                                       (130, [1, 130])])
@pytest.mark.parametrize("renormalize", [False, True])
def test_tile_edges_every_mode_and_region(L, lengths, renormalize):
    q, k, v, lengths, tc, sid = inputs(L, lengths, seed=L + len(lengths))
    compare(q, k, v, lengths, tc, sid, scaling=0.4, mode=MODES, region=REGIONS, renormalize=renormalize)


@pytest.mark.parametrize("num_windows", [1, 5, 16, 64])
def test_key_scale_and_window_counts(num_windows):
    q, k, v, lengths, tc, sid = inputs(100, [100, 37], seed=num_windows)
    g = torch.rand(2, 5, 100, generator=torch.Generator().manual_seed(1)) * 3
    g[0, 0, :10] = 0.0  # keys that vanish from the norm-weighted row
    compare(q, k, v, lengths, tc, sid, scaling=0.35, num_windows=num_windows, mode=MODES, region=REGIONS,
            key_scale=g)


def test_sharp_rows_rescale_every_sum():
    # scores that grow along the keys: the row max changes in every tile, so every sum is rescaled often
    L = 200
    q, k, v, lengths, tc, sid = inputs(L, [200, 150], seed=3)
    ramp = torch.linspace(0, 6, L)
    k = k + ramp[None, None, :, None]
    q = q.abs() + 1.0
    f = compare(q, k, v, lengths, tc, sid, scaling=0.5, mode=MODES, region=REGIONS)
    assert torch.isfinite(f).all()


def test_first_tile_all_minus_inf_then_finite():
    # for row block 0, every score of the first key tile is -inf; later keys are finite. The base of the
    # exponent must stay 0 until a finite score appears (not -inf - -inf = NaN)
    L = 140
    q, k, v, lengths, tc, sid = inputs(L, [140], H=1, seed=5)
    q[..., 0] = 1e20
    k[..., 0] = 0.0
    k[0, 0, :64, 0] = -1e20
    f = compare(q, k, v, lengths, tc, sid, scaling=1.0)
    assert torch.isfinite(f).all()


def test_one_minus_inf_key_and_undefined_rows():
    L = 80
    q, k, v, lengths, tc, sid = inputs(L, [80, 50], H=2, seed=6)
    q[..., 0] = 1e20
    k[..., 0] = 0.0
    k[0, 0, 5, 0] = -1e20  # one -inf score in every row of (0, 0): entropy stays finite
    k[1, 1, 3, 0] = math.inf  # +inf scores: rows of (1, 1) are undefined, its features NaN
    f = compare(q, k, v, lengths, tc, sid, scaling=1.0)
    assert torch.isfinite(f[0, 0]).all() and torch.isnan(f[1, 1]).all()


def test_thread_columns_cover_each_tile_once():
    cols = sorted(c for ql in range(emulator.QUAD) for c in emulator.thread_columns(ql))
    assert cols == list(range(emulator.BLOCK_N))
    for ql in range(emulator.QUAD):  # each thread visits its keys in ascending order (run lengths)
        c = emulator.thread_columns(ql)
        assert c == sorted(c)


@pytest.mark.parametrize("n, N", [(1100, 16), (200, 4), (300, 2), (77, 1), (5000, 64), (129, 3)])
def test_window_cuts_give_the_division_windows(n, N):
    # v2's cut path: where a warp's vote passes, w_lo + (d >= cut) is floor(d·N/n) (clamped) for every key a lane
    # holds; and the vote passes somewhere for these sizes, so the path is exercised
    BLOCK_M, BLOCK_N, QUAD = emulator.BLOCK_M, emulator.BLOCK_N, emulator.QUAD
    passed = 0
    for row0 in range(0, n, BLOCK_M):
        rows = torch.arange(row0, row0 + BLOCK_M)
        for key0 in range(0, n, BLOCK_N):
            lo, at, vote = emulator.window_cuts(rows, key0, n, N)
            passed += int(vote.sum())
            for ql in range(QUAD):
                d = (key0 + torch.tensor(emulator.thread_columns(ql))[None, :] - rows[:, None]).abs()
                want = torch.div(d * N, n, rounding_mode="floor").clamp(max=N - 1)
                got = lo[:, ql, None] + (d >= at[:, ql, None]).long()
                assert torch.equal(got[vote], want[vote])
    assert passed > 0
