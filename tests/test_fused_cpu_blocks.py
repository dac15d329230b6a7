"""The CPU kernel's flash blocking (csrc/cpu/fused_attention_rows.h): query blocks × key blocks with an online
softmax, every feature sum rescaled as a row's max grows. The cases the online form adds (docs/cuda.md, "The CPU
kernel"), each against the executable spec (attnkit/reference.py), once per CPU capability this machine runs, with
the real blocks (BQ = 64/128, BK = 512) and with small ones forced by ATTNKIT_CPU_BLOCKS ("BQxBK") so that a few
dozen keys cross several blocks.

Tolerance: the blocks change the order of summation (the softmax sums and every feature sum are accumulated per key
block at the block's base, then rescaled by exp(m_old − m_new)), so results are not bit-equal across block sizes:
the output's error against the reference is at most twice PyTorch's own fp32 error (eager attention) plus 2e-6 (a
few float32 ulps of the accumulated sums), features agree with the fp32 reference to 1e-5 absolute, as tests/test_fused_cpu.py asks of every path. Each block size is deterministic run to run.
"""
from __future__ import annotations

import math

import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import CLS, COMMA, NO_INTER, NO_INTRA, PERIOD, SEP, feature_names
from attnkit.reference import reference_attention

from .test_decoder_op import in_dtype

if not (ops.has_kernel("cpu") and ops.has_kernel("cpu", "attnkit::fused_attention_lse")):
    pytest.skip("attnkit._C has no blocked CPU kernel (extension not built)", allow_module_level=True)

N = 8
CAPABILITIES = ops.cpu_capabilities()[::-1]
KV = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)
SINK = torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0])


@pytest.fixture(params=CAPABILITIES)
def capability(request, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_CAPABILITY", request.param)
    return request.param


def make(B=2, H=6, Hkv=3, L=37, D=16, seed=0, lengths=None, specials=0.1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=g).transpose(1, 2)
    k, v = (torch.randn(B, L, Hkv, D, generator=g).transpose(1, 2) for _ in range(2))
    lengths = torch.as_tensor([L] * B if lengths is None else lengths, dtype=torch.int64)
    r = torch.rand(B, L, generator=g)
    tc = torch.zeros(B, L, dtype=torch.int32)
    tc[r < specials] = COMMA
    tc[r < specials / 2] = PERIOD
    tc[:, 0] = CLS
    tc[:, L // 2] = SEP
    sid = (torch.arange(L) >= L // 3).int().expand(B, L).contiguous()
    return q, k, v, lengths, tc, sid


def run(q, k, v, lengths, tc=None, sid=None, *, want_features=True, **kw):
    return ops.attention(q, k, v, lengths, tc, sid, num_windows=N, want_features=want_features, backend="fused", **kw)


def check(q, k, v, lengths, tc=None, sid=None, **kw):
    out, feats = run(q, k, v, lengths, tc, sid, **kw)
    ref_out, ref_feats = reference_attention(q, k, v, lengths, tc, sid, num_windows=N, want_features=True, **kw)
    assert torch.equal(out.isnan(), ref_out.isnan()) and torch.equal(feats.isnan(), ref_feats.isnan())
    # FlashAttention-style yardstick: the output's distance from the (fp32) reference is at most twice PyTorch's own
    # fp32 error on these inputs (eager softmax(QKᵀ)V in fp32 against the same in fp64) plus a floor. Large scores
    # (the ramp test: |score| ~ 40, ulp 4e-6) carry float32 rounding of a few 1e-6 in any fp32 attention, the
    # reference's included.
    dec = {a: kw[a] for a in ("kv_head", "causal", "sliding_window", "softcap", "sink") if a in kw}
    exact = in_dtype(q.double(), k.double(), v.double(), lengths, **dec)
    own_err = (in_dtype(q, k, v, lengths, **dec).double() - exact).nan_to_num().abs().max().item()
    err = (out - ref_out).nan_to_num().abs().max().item()
    assert err <= 2 * own_err + 2e-6, f"fused err {err:.3g} > 2 × torch's fp32 err {own_err:.3g} + 2e-6"
    torch.testing.assert_close(feats.nan_to_num(), ref_feats.nan_to_num(), atol=1e-5, rtol=0)
    return out, feats


CASES = {
    "full": dict(),
    "causal_gqa": dict(causal=True, kv_head=KV),
    "everything": dict(causal=True, kv_head=KV, sliding_window=11, softcap=3.0, sink=SINK),
    "window_not_causal": dict(sliding_window=9, sink=SINK),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("blocks,L", [("5x16", 15), ("5x16", 16), ("5x16", 17), ("5x16", 33), ("7x8", 40),
                                      ("64x512", 511), ("64x512", 512), ("64x512", 513), ("128x512", 1025)])
def test_block_edges(capability, monkeypatch, case, blocks, L):
    """L = BK − 1, BK, BK + 1, 2·BK + 1, and BQ that does not divide L (5, 7), with padding (n < L) and n = 1."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    if L > 64 and capability != CAPABILITIES[-1]:
        pytest.skip("the real block sizes run on the best capability only (time)")
    B = 3 if L <= 64 else 1
    lengths = [L, max(1, L - 6), 1][:B]
    check(*make(B=B, L=L, seed=L, lengths=lengths), **CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_special_keys(capability, monkeypatch, case):
    """Half of the keys special (four classes), key blocks of 48: each row's block holds more special keys than one
    vector of them (their class sums go 16 keys per gather, the last vector partial), and causal and windowed rows
    see only part of a block's special keys."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "9x48")
    q, k, v, lengths, tc, sid = make(B=2, L=130, seed=21, lengths=[130, 77], specials=0.5)
    tc[:, 60:70] = SEP
    out, feats = check(q, k, v, lengths, tc, sid, **CASES[case])
    names = feature_names(N, sink="sink" in CASES[case])
    for cls in ("cls", "sep", "comma", "period"):
        assert (feats[..., names.index(cls)] > 0).any(), cls


@pytest.mark.parametrize("case", ["full", "everything"])
def test_sentence_runs_and_scattered_sentences(capability, monkeypatch, case):
    """The intra/inter masses where each sentence is one run of keys (a range sum over the row's run; ids in any
    order, padding with another id) and where a sentence comes back later in the sample (a compare per key), in one
    batch, across key blocks."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "7x16")
    q, k, v, lengths, tc, _ = make(B=3, L=70, seed=8, lengths=[70, 52, 61])
    sid = torch.zeros(3, 70, dtype=torch.int32)
    sid[0] = torch.tensor([5] * 20 + [2] * 30 + [9] * 20)  # runs, ids not increasing
    sid[1, :52] = torch.tensor([1] * 10 + [0] * 25 + [3] * 17)
    sid[1, 52:] = 7  # padding: another id
    sid[2] = torch.tensor(([0] * 9 + [1] * 6) * 4 + [2] * 10)  # sentences 0 and 1 come back: not runs
    out, feats = check(q, k, v, lengths, tc, sid, **CASES[case])
    names = feature_names(N, sink="sink" in CASES[case])
    intra = feats[..., names.index("intra")]
    assert ((intra > 0.05) & (intra < 0.95)).all()  # every sample has several sentences


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("blocks,L,D", [("13x21", 40, 13), ("7x16", 37, 40), ("64x512", 45, 8), ("9x48", 130, 33)])
def test_products_in_place_and_through_blas(capability, monkeypatch, case, blocks, L, D):
    """The tile's two products computed in place (small tiles, csrc/cpu/vec_util.h small_qk/small_pv: 8, 4 and single
    rows, key and head-size tails shorter than a vector) and through BLAS (ATTNKIT_CPU_SMALL_PRODUCTS=0): each
    against the reference, and the two within float32 rounding of each other (they sum in another order)."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    inputs = make(B=3, L=L, D=D, seed=D, lengths=[L, L - 9, 1])
    results = {}
    for products in ("0", "1000000000"):
        monkeypatch.setenv("ATTNKIT_CPU_SMALL_PRODUCTS", products)
        results[products] = check(*inputs, **CASES[case])
    (out0, feats0), (out1, feats1) = results.values()
    torch.testing.assert_close(out1, out0, atol=2e-6, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(feats1, feats0, atol=1e-5, rtol=0, equal_nan=True)


def test_small_products_setting_is_checked(monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_SMALL_PRODUCTS", "-3")
    with pytest.raises(AttnkitError, match="ATTNKIT_CPU_SMALL_PRODUCTS must be an integer >= 0, got -3"):
        run(*make(B=1, L=8))


def test_block_sizes_agree_and_are_deterministic(monkeypatch):
    q, k, v, lengths, tc, sid = make(L=50, lengths=[50, 31], seed=3)
    kw = CASES["everything"]
    results = {}
    for blocks in ("3x4", "16x16", "64x512"):
        monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
        a, b = run(q, k, v, lengths, tc, sid, **kw), run(q, k, v, lengths, tc, sid, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # run to run: the same bits
        results[blocks] = a
    for out, feats in results.values():
        torch.testing.assert_close(out, results["64x512"][0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(feats, results["64x512"][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("extra", [dict(), dict(renormalize=True, region=torch.tensor([NO_INTRA, NO_INTER] * 3,
                                                                                       dtype=torch.int32)),
                                   dict(sink=SINK, renormalize=True), dict(key_scale="random"),
                                   dict(causal=True, softcap=30.0)])
def test_the_max_of_a_row_appears_in_a_later_key_block(capability, monkeypatch, extra):
    """Scores grow with the key position, by ~40 over the row, so each row's max moves at every key block: the
    output and every feature sum (classes, self, windows, prev/next, entropy, max, intra/inter, the sink's mass)
    must be rescaled, or they would be off by factors up to e^40."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "4x6")
    L = 40
    q, k, v, lengths, tc, sid = make(L=L, seed=11, lengths=[40, 29])
    q = q.clone()
    q[..., 0] = 1.0
    k = k.clone()
    k[..., 0] = torch.linspace(0, 40 * 4, L)  # × scaling 1/4: a ramp of 40 over the keys
    if extra.get("key_scale") == "random":
        extra = dict(extra, key_scale=torch.rand(2, 6, L, generator=torch.Generator().manual_seed(1)) + 0.05)
    out, feats = check(q, k, v, lengths, tc, sid, **extra)
    assert torch.isfinite(feats).all()
    names = feature_names(N, sink="sink" in extra)
    assert (feats[..., names.index("max")] > 0.3).all()  # the rows really are peaked on late keys


def test_a_first_key_block_of_minus_inf_scores(capability, monkeypatch):
    """Every key of the first block scores −inf: the row's base stays −inf through it (no exp(−inf + inf) = NaN),
    the later blocks carry the whole mass."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "4x8")
    q, k, v, lengths, tc, sid = make(L=30, seed=4, lengths=[30, 19])
    q, k = q.clone(), k.clone()
    q[..., 0] = 1.0
    k[:, :, :8, 0] = -math.inf
    for kw in (dict(), dict(sink=SINK), dict(sliding_window=12), dict(key_scale=torch.rand(2, 6, 30) + 0.1)):
        out, feats = check(q, k, v, lengths, tc, sid, **kw)
        assert torch.isfinite(out).all() and torch.isfinite(feats).all()
    # causal: rows 0..7 see only −inf keys — undefined (NaN), as the reference says
    out, feats = check(q, k, v, lengths, tc, sid, causal=True)
    assert out[:, :8].isnan().all() and feats.isnan().all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_scores_in_a_later_key_block(capability, monkeypatch, bad):
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "4x8")
    q, k, v, lengths, tc, sid = make(L=30, seed=5, lengths=[30, 19])
    q, k = q.clone(), k.clone()
    q[..., 0] = 1.0
    k[0, 1, 21, 0] = bad  # sample 0, KV head 1 (query heads 2, 3): key 21, in the third block
    out, feats = check(q, k, v, lengths, tc, sid, kv_head=KV)
    assert out[0, :, 2:4].isnan().all() and feats[0, 2:4].isnan().all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(feats[1]).all() and torch.isfinite(feats[0, :2]).all()
    out, feats = check(q, k, v, lengths, tc, sid, kv_head=KV, causal=True)
    assert torch.isfinite(out[0, :21]).all() and out[0, 21:, 2:4].isnan().all()


def test_sink_with_renormalize_and_regions(capability, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "5x7")
    q, k, v, lengths, tc, sid = make(L=33, seed=6, lengths=[33, 20])
    region = torch.tensor([NO_INTRA, NO_INTER, 0, NO_INTER, NO_INTRA, 0], dtype=torch.int32)
    for causal in (False, True):
        check(q, k, v, lengths, tc, sid, sink=SINK, renormalize=True, region=region, causal=causal, kv_head=KV)


def test_norm_weighting_with_zero_key_scales(capability, monkeypatch):
    """g = 0 keys: weight 0 in the features (ln g is taken as 0 there, never −inf·0); a (sample, head) whose keys
    all have g = 0 has all-zero features."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "4x8")
    q, k, v, lengths, tc, sid = make(L=30, seed=7, lengths=[30, 19])
    g = torch.rand(2, 6, 30, generator=torch.Generator().manual_seed(2))
    g[g < 0.3] = 0.0
    g[0, 4] = 0.0
    for kw in (dict(), dict(causal=True, sink=SINK, kv_head=KV)):
        out, feats = check(q, k, v, lengths, tc, sid, key_scale=g, **kw)
        assert (feats[0, 4] == 0).all() and torch.isfinite(feats).all()


def test_causal_row_zero_and_a_one_token_sample(capability, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "4x8")
    q, k, v, lengths, tc, sid = make(L=20, seed=8, lengths=[20, 1])
    out, feats = check(q, k, v, lengths, tc, sid, causal=True, kv_head=KV)
    names = feature_names(N)
    # sample 1 has one token: it attends only to itself (a CLS, so its class bucket, entropy 0)
    assert feats[1, :, names.index("cls")].eq(1).all() and feats[1, :, names.index("entropy")].eq(0).all()
    # causal row 0 attends only to key 0: out = v[kv head][0]
    torch.testing.assert_close(out[0, 0], v[0, KV.long(), 0], atol=1e-6, rtol=0)


def test_lse_matches_aten_flash_attention(capability, monkeypatch):
    """attnkit::fused_attention_lse: the natural-log log-sum-exp of the scaled scores per row (B×H×L), as ATen's
    _scaled_dot_product_flash_attention_for_cpu returns it, over several key blocks."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "8x16")
    q, k, v, lengths, tc, sid = make(B=1, L=50, seed=9)
    kk, vv = k[:, KV.long()], v[:, KV.long()]
    for causal in (False, True):
        out, _, lse = torch.ops.attnkit.fused_attention_lse(q, k, v, lengths, None, None, 0.25, N, None, None, False,
                                                            None, False, None, KV, causal)[:3]
        a_out, a_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kk, vv, is_causal=causal,
                                                                                  scale=0.25)[:2]
        torch.testing.assert_close(lse, a_lse, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(out, a_out.transpose(1, 2), atol=2e-6, rtol=1e-5)


def test_lse_reconstructs_the_weights_with_decoder_arguments():
    """out = gate · Σ exp(score − lse) · v: the lse is the log of the denominator actually used (the sink included;
    with renormalize the kept keys); padded rows outside the window (no key) +inf, mode zero +inf."""
    q, k, v, lengths, tc, sid = make(L=24, seed=10, lengths=[24, 3])
    out, _, lse = torch.ops.attnkit.fused_attention_lse(q, k, v, lengths, None, None, 0.25, N, None, None, False,
                                                        None, False, None, KV, True, 4, 2.0, SINK)[:3]
    kk, vv = k[:, KV.long()], v[:, KV.long()]
    s = 2.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.25 / 2.0)
    pos = torch.arange(24)
    vis = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)
    vis = vis[None, None] & (pos < lengths[:, None])[:, None, None, :]
    p = torch.where(vis, torch.exp(s - lse[..., None]), 0.0)
    rows = vis.any(-1).expand(2, 6, 24)
    torch.testing.assert_close(torch.where(rows[..., None], p @ vv, 0.0), out.transpose(1, 2), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(p.sum(-1) + torch.exp(SINK.view(1, 6, 1) - lse), rows.float(),
                               atol=1e-6, rtol=0)
    assert torch.isinf(lse[1, :, 7:]).all() and (lse[1, :, 7:] > 0).all()  # padded rows s >= 3 + 4: no key
    mode = torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.int32)
    _, _, lse0 = torch.ops.attnkit.fused_attention_lse(q, k, v, lengths, None, None, 0.25, N, mode, None, False,
                                                       None, False, None, KV, True)[:3]
    assert (lse0[:, 0] == math.inf).all() and torch.isfinite(lse0[0, 1:]).all()


def _fewer_queries() -> bool:
    try:
        return bool(torch.ops.attnkit.cpu_fewer_queries())
    except (AttributeError, RuntimeError):
        return False


@pytest.mark.skipif(not _fewer_queries(), reason="a kernel that does not take Lq < L")
@pytest.mark.parametrize("Lq", [1, 3, 29])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fewer_queries_are_the_last_rows_of_a_full_call(capability, monkeypatch, case, Lq):
    """A KV-cache step (q of Lq < L rows, the last Lq key positions; attnkit/reference.py): the output and lse are
    the full call's last Lq rows (causal, window, distance, prev/next counted from L − Lq); a sample whose length
    ends before the query rows (n <= L − Lq) has features 0, not NaN."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "4x8")
    L = 30
    q, k, v, lengths, tc, sid = make(L=L, seed=12, lengths=[30, 20])
    kw = dict(CASES[case])
    args = [kw.get(a) for a in ("kv_head", "causal", "sliding_window", "softcap", "sink")]
    args[1] = bool(args[1])

    def call(qq):
        return torch.ops.attnkit.fused_attention_lse(qq, k, v, lengths, tc, sid, 0.25, N, None, None, False, None,
                                                     True, None, *args)[:3]

    full_out, _, full_lse = call(q)
    out, feats, lse = call(q[:, :, L - Lq:])
    assert out.shape == (2, Lq, 6, 16) and lse.shape == (2, 6, Lq)
    assert feats.shape == (2, 6, len(feature_names(N, sink="sink" in kw)))
    # the blocks start at different keys in the two calls: the order of summation differs (a few ulps)
    torch.testing.assert_close(out, full_out[:, L - Lq:], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse[..., L - Lq:], atol=2e-6, rtol=1e-6)
    if L - Lq >= 20:  # sample 1 (n = 20) has no valid query row
        assert (feats[1] == 0).all()
    assert torch.isfinite(feats[0]).all()


def test_lse_op_fake_and_schema():
    """The lse op's fake kernel (attnkit/ops.py) gives the real kernel's shapes and dtypes (torch.compile, meta)."""
    q, k, v, lengths, tc, sid = make(L=12, seed=13, lengths=[12, 7])
    op = torch.ops.attnkit.fused_attention_lse.default
    for extra in ((KV, True, 4, 2.0, SINK), (None, False, None, None, None)):
        # (symmetric_window, want_max_logit): a B×H 4th output
        for tail in [(), (False, True)] if ops.fused_max_logit("cpu") else [()]:
            torch.library.opcheck(op, (q, k, v, lengths, tc, sid, 0.25, N, None, None, False, None, True, None) + extra
                                  + tail, test_utils=("test_schema", "test_faketensor"))


# --- each head's max logit from the kernel's own pass (attnkit::fused_attention_lse, want_max_logit) ----------
needs_max_logit = pytest.mark.skipif(not ops.fused_max_logit("cpu"), reason="a build whose op has no max logit")


def _loop_max_logit(q, k, lengths, scaling, kv, causal=False, window=None):
    """B×H by explicit loops over the valid rows and the keys each sees, in float64 (independent of the reference)."""
    B, H, L, _ = q.shape
    out = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        i = torch.arange(n)
        ok = torch.ones(n, n, dtype=torch.bool)
        if causal:
            ok &= i[:, None] >= i[None, :]
        if window is not None:
            ok &= i[:, None] - i[None, :] < window
        for h in range(H):
            s = q[b, h, :n].double() @ k[b, int(kv[h]), :n].double().T * scaling
            out[b, h] = s[ok].max()
    return out


MAX_CASES = {"full": dict(), "causal": dict(causal=True), "causal_gqa": dict(causal=True, kv_head=KV),
             "window": dict(causal=True, sliding_window=5), "window_not_causal": dict(sliding_window=9),
             "softcap": dict(causal=True, softcap=0.5), "sink": dict(causal=True, sink=SINK + 10),
             "everything": CASES["everything"]}


@needs_max_logit
@pytest.mark.parametrize("blocks", [None, "4x8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(MAX_CASES))
def test_max_logit_of_the_op_equals_the_reference(case, dtype, blocks, monkeypatch, capability):
    """want_max_logit: B×H, the largest scaled score over the valid rows (s < n) and the keys each sees, before the
    soft-cap, the sink no key (docs/features.md §9): attnkit.reference.max_logits and explicit loops, with padding
    (n = 1 included), across key and query blocks, fp32 and bf16 (scores in fp32 from the bf16 values)."""
    from attnkit.reference import max_logits

    if blocks:
        monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    kw = MAX_CASES[case]
    kv = kw.get("kv_head", torch.arange(6, dtype=torch.int32))
    q, k, v, lengths, tc, sid = make(B=3, Hkv=3 if "kv_head" in kw else 6, lengths=[37, 20, 1], seed=21)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    causal, window = kw.get("causal", False), kw.get("sliding_window")
    args = (q, k, v, lengths, tc, sid, 0.3, N, None, None, False, None, True, None, kw.get("kv_head"), causal, window,
            kw.get("softcap"), kw.get("sink"))
    out, feats, lse, ml = torch.ops.attnkit.fused_attention_lse(*args, want_max_logit=True)
    assert ml.shape == (3, 6) and ml.dtype == torch.float32
    want = max_logits(q.float(), k.float(), lengths, 0.3, kv_head=kw.get("kv_head"), causal=causal,
                      sliding_window=window)
    torch.testing.assert_close(ml, want, atol=1e-5, rtol=1e-6)
    loops = _loop_max_logit(q.float(), k.float(), lengths, 0.3, kv, causal, window)
    torch.testing.assert_close(ml.double(), loops, atol=1e-5, rtol=1e-6)
    if kw.get("softcap"):  # before the cap: above it where a score passes c
        assert (ml > kw["softcap"]).any()
    # the other outputs are the op's without it; without it the max logit is B×0
    out0, feats0, lse0, ml0 = torch.ops.attnkit.fused_attention_lse(*args)
    assert ml0.shape == (3, 0)
    assert torch.equal(out, out0) and torch.equal(feats, feats0) and torch.equal(lse, lse0)


@needs_max_logit
def test_max_logit_of_heads_the_tasks_do_not_measure():
    """Heads in mode zero or uniform compute no scores, and a row whose softmax is undefined (a NaN sink, a +inf or
    NaN score) stops reading its keys: their max logit comes from the head's scores, exactly as defined (NaN scores
    propagate; a NaN sink is no key)."""
    q, k, v, lengths, tc, sid = make(Hkv=6, lengths=[37, 9], seed=22)
    mode = torch.tensor([1, 2, 0, 0, 0, 0], dtype=torch.int32)
    sink = torch.tensor([0.0, 0.0, float("nan"), 0.0, 0.0, 0.0])
    q = q.clone()
    q[0, 3, 5, 0] = float("inf")  # row 5 of head 3, sample 0: +inf (and −inf) scores
    q[1, 4, 2, :] = float("nan")  # a NaN row of a valid query
    q[1, 5, 20, :] = float("nan")  # a NaN in a padded row (s >= n = 9): not counted
    ml = torch.ops.attnkit.fused_attention_lse(q, k, v, lengths, None, None, 0.3, N, mode, None, False, None, False,
                                               None, None, True, None, None, sink, want_max_logit=True)[3]
    from attnkit.reference import max_logits

    want = max_logits(q, k, lengths, 0.3, causal=True)
    assert torch.equal(ml.isnan(), want.isnan()) and ml[1, 4].isnan() and not ml[1, 5].isnan()
    torch.testing.assert_close(ml.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("kw", [dict(sliding_window=12), dict(sliding_window=12, causal=True, kv_head=KV),
                                dict(sliding_window=12, key_scale="random")])
def test_keys_before_a_rows_window_with_minus_inf_scores(capability, monkeypatch, kw):
    """A task of 32 rows streams keys from its first row's window: its later rows do not see the first keys,
    which score −inf. Their class buckets gather only the special keys they see (a vector's unused lanes must
    not read a score outside the row, where 0 · −inf would be NaN)."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "32x64")
    q, k, v, lengths, tc, sid = make(L=40, seed=6, lengths=[40, 33], specials=0.3)
    q, k = q.clone(), k.clone()
    q[..., 0] = 1.0
    k[:, :, :2, 0] = -math.inf
    if kw.get("key_scale") == "random":
        kw = dict(kw, key_scale=torch.rand(2, 6, 40, generator=torch.Generator().manual_seed(2)) + 0.05)
    out, feats = check(q, k, v, lengths, tc, sid, **kw)
    if kw.get("causal"):  # causal rows 0 and 1 see only −inf keys: undefined (NaN) as in the reference
        assert torch.isfinite(out[:, 2:]).all()
    else:
        assert torch.isfinite(out).all() and torch.isfinite(feats).all()


# --- the query heads of one KV head in one task (FusedCpuParams::GH, fused_attention.cpp) --------------------------
GROUP_CASES = {
    "plain": dict(),
    # a zeroed and a uniform head inside a task's heads, dropped keys, gates, renormalisation
    "interventions": dict(mode=torch.tensor([0, 1, 2, 0, 0, 2], dtype=torch.int32),
                          region=torch.tensor([NO_INTRA, 0, 0, NO_INTER, 0, 0], dtype=torch.int32),
                          gates=torch.tensor([1.0, 1.0, 1.0, 0.5, 2.0, 0.0]), renormalize=True),
    "decoder": dict(causal=True, sliding_window=11, softcap=3.0, sink=SINK),
    "key_scale": dict(causal=True, key_scale="random"),
    "bias": dict(bias="random"),
}


@pytest.mark.parametrize("case", sorted(GROUP_CASES))
@pytest.mark.parametrize("Hkv", [2, 3])
@pytest.mark.parametrize("blocks,L,D,products", [("5x16", 37, 16, None), ("5x16", 37, 16, "0"), ("7x8", 40, 33, "0"),
                                                 ("64x512", 130, 64, None)])
def test_the_heads_of_a_kv_head_in_one_task_give_the_bits_of_one_head_per_task(capability, monkeypatch, case, Hkv,
                                                                              blocks, L, D, products):
    """The heads that share a KV head run in one task by default: each key block's scores and outputs of all of them
    come from one product of their stacked query rows (BLAS) or from one transposed key block (the products in
    place). Every output is bit for bit that of one head per task (ATTNKIT_CPU_GROUP_HEADS=1): the output, the
    features, the log-sum-exp and the max logit, with a zeroed and a uniform head among a task's heads, padding
    (n = 1 included), several query and key blocks, and odd head sizes; and it agrees with the reference."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    if products is not None:
        monkeypatch.setenv("ATTNKIT_CPU_SMALL_PRODUCTS", products)
    q, k, v, lengths, tc, sid = make(B=3, H=6, Hkv=Hkv, L=L, D=D, seed=L + Hkv, lengths=[L, L - 9, 1])
    kw = dict(GROUP_CASES[case], kv_head=torch.arange(6, dtype=torch.int32) // (6 // Hkv))
    g = torch.Generator().manual_seed(5)
    if kw.get("key_scale") == "random":
        kw["key_scale"] = torch.rand(3, 6, L, generator=g) + 0.05
    if kw.get("bias") == "random":
        kw["bias"] = torch.randn(3, 6, L, L, generator=g)
    results = {}
    for group in ("1", ""):  # one head per task; the default (every head of a KV head)
        monkeypatch.setenv("ATTNKIT_CPU_GROUP_HEADS", group)
        if "bias" in kw:  # (the lse op takes no bias)
            results[group] = run(q, k, v, lengths, tc, sid, **kw)
        else:
            p = dict(kw, mode=kw.get("mode"), region=kw.get("region"), gates=kw.get("gates"))
            results[group] = torch.ops.attnkit.fused_attention_lse(
                q, k, v, lengths, tc, sid, D ** -0.5, N, p["mode"], p["region"], bool(kw.get("renormalize")),
                p["gates"], True, kw.get("key_scale"), kw["kv_head"], bool(kw.get("causal")),
                kw.get("sliding_window"), kw.get("softcap"), kw.get("sink"),
                **({"symmetric_window": False, "want_max_logit": True} if ops.fused_max_logit("cpu") else {}))
    for one, grouped in zip(results["1"], results[""]):
        torch.testing.assert_close(grouped, one, rtol=0, atol=0, equal_nan=True)
    check(q, k, v, lengths, tc, sid, **kw)


def test_heads_that_do_not_share_a_kv_head_with_their_neighbours_run_alone(capability, monkeypatch):
    """kv_head [0, 1, 2, 0, 1, 2] (heads of one KV head not next to each other): one head per task, as the reference."""
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "5x16")
    monkeypatch.setenv("ATTNKIT_CPU_SMALL_PRODUCTS", "0")
    q, k, v, lengths, tc, sid = make(B=2, L=37, seed=9, lengths=[37, 12])
    check(q, k, v, lengths, tc, sid, kv_head=torch.tensor([0, 1, 2, 0, 1, 2], dtype=torch.int32), causal=True)


def test_group_heads_setting_is_checked(monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_GROUP_HEADS", "0")
    with pytest.raises(AttnkitError, match="ATTNKIT_CPU_GROUP_HEADS must be an integer >= 1, got 0"):
        run(*make(B=1, L=8), kv_head=KV)
