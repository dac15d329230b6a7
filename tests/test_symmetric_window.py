"""The op's bidirectional sliding window (`symmetric_window` with `sliding_window` W: row s sees the keys |s − t| < W,
ModernBERT's local layers; attnkit/reference.py, docs/features.md section 8): the reference's keys against
transformers' own mask function, then the fused CPU kernel against the reference — dtypes, n = 1, odd lengths,
windows of 1 and of the whole sample, padding, several row and key tiles, features, interventions, norm weighting,
the max logit, a KV-cache step and the backward — and the refusals (no window, cross-attention, CUDA and Triton, old
builds).

Tolerances as tests/test_decoder_op.py: the fused output's error against the fp32 reference is at most twice
PyTorch's own error in that dtype plus a tiny floor; features agree with the reference to 1e-5."""
from __future__ import annotations

import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import KEEP, NO_INTER, NO_INTRA, UNIFORM, ZERO
from attnkit.reference import max_logits, reference_attention, visible_keys

from .test_decoder_op import make  # q, k, v in transformers' transposed layout, lengths, classes, sentences

needs_kernel = pytest.mark.skipif(not ops.fused_symmetric_window("cpu"),
                                  reason="attnkit._C has no CPU kernel that takes symmetric_window (rebuild it)")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-5, torch.float16: 1e-5}
N = 8
CAPABILITIES = ops.cpu_capabilities()[::-1]  # default first


@pytest.fixture(params=CAPABILITIES)
def capability(request, monkeypatch):
    """Once per CPU capability build this machine runs (ATTNKIT_CPU_CAPABILITY)."""
    monkeypatch.setenv("ATTNKIT_CPU_CAPABILITY", request.param)
    return request.param


@pytest.mark.parametrize("half", [0, 1, 2, 5, 40])
def test_visible_keys_are_transformers_bidirectional_window(half):
    """transformers' mask for ModernBERT's local layers (create_bidirectional_sliding_window_mask: |q − kv| ≤ half,
    with the padding mask) is the op's window W = half + 1, the value ModernBertAttention passes, on every row."""
    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    L = 11
    lengths = torch.tensor([11, 6, 1])
    fn = sliding_window_bidirectional_mask_function(half)
    pos = torch.arange(L)
    theirs = torch.stack([fn(b, 0, pos[:, None], pos[None, :]) & (pos[None, :] < n)
                          for b, n in enumerate(lengths.tolist())])
    ours = visible_keys(lengths, L, sliding_window=half + 1, symmetric_window=True)[:, 0]
    assert torch.equal(ours, theirs.expand_as(ours))
    # with causal it is the causal window: the keys after s are not seen anyway
    causal = visible_keys(lengths, L, True, half + 1)
    assert torch.equal(visible_keys(lengths, L, True, half + 1, symmetric_window=True), causal)


def in_dtype(q, k, v, lengths, W, causal=False):
    """PyTorch's own attention with the bidirectional window, computed in q's dtype: the error yardstick."""
    B, H, L, D = q.shape
    idx = torch.arange(H) // (H // k.shape[1])
    s = torch.matmul(q, k[:, idx].transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(~visible_keys(lengths, L, causal, W, symmetric_window=True), float("-inf"))
    return torch.matmul(torch.nan_to_num(torch.softmax(s, -1)), v[:, idx]).transpose(1, 2)


def check(q, k, v, lengths, tc, sid, *, sliding_window, want_features=True, **kw):
    """The fused op against the reference with a bidirectional window of `sliding_window` (and `kw`)."""
    dtype = q.dtype
    kw = dict(kw, sliding_window=sliding_window, symmetric_window=True)
    out, feats = ops.attention(q, k, v, lengths, tc, sid, num_windows=N, want_features=want_features,
                               backend="fused", **kw)
    ref_out, ref_feats = reference_attention(q.float(), k.float(), v.float(), lengths, tc, sid, num_windows=N,
                                             want_features=want_features, **kw)
    plain, _ = reference_attention(q.float(), k.float(), v.float(), lengths, sliding_window=sliding_window,
                                   symmetric_window=True)
    own = in_dtype(q, k, v, lengths, sliding_window).float()
    torch_err = max((own - plain).abs().max().item(), (ref_out.to(dtype).float() - ref_out).abs().max().item())
    err = (out.float() - ref_out).abs().max().item()
    assert out.dtype == dtype and err <= 2 * torch_err + FLOOR[dtype], f"{dtype}: err {err:.3g}, torch {torch_err:.3g}"
    assert feats.shape == ref_feats.shape
    torch.testing.assert_close(feats, ref_feats, atol=1e-5, rtol=0)
    return out, feats


CASES = {
    "window_3": dict(sliding_window=3),
    "window_1": dict(sliding_window=1),  # every row sees only itself
    "window_past_L": dict(sliding_window=500),  # the whole sample: plain bidirectional attention
    "gqa_softcap_sink": dict(sliding_window=6, kv_head=torch.tensor([0, 0, 0, 1, 2, 2], dtype=torch.int32),
                             softcap=3.0, sink=torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0])),
    "with_causal": dict(sliding_window=4, causal=True),
}


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_matches_reference(case, dtype):
    check(*make(dtype=dtype, seed=len(case)), **CASES[case])  # L = 37, random lengths


@needs_kernel
def test_a_window_past_the_sample_is_plain_attention():
    q, k, v, lengths, tc, sid = make(L=37, seed=3)
    out, feats = ops.attention(q, k, v, lengths, tc, sid, num_windows=N, want_features=True, backend="fused",
                               sliding_window=37, symmetric_window=True)
    plain, pf = ops.attention(q, k, v, lengths, tc, sid, num_windows=N, want_features=True, backend="fused")
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(feats, pf, atol=1e-6, rtol=0)


@needs_kernel
@pytest.mark.parametrize("blocks", [None, "8x16", "5x7"])  # the default tiles; several row and key tiles
@pytest.mark.parametrize("L", [1, 2, 17, 131])
def test_lengths_and_tiles(capability, L, blocks, monkeypatch):
    """n = 1 (row 0 sees only itself), odd lengths, padded samples, and tiles smaller than a row's window or than
    the sample (ATTNKIT_CPU_BLOCKS), so a row's keys span several key blocks and its window spans tiles."""
    if blocks:
        monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", blocks)
    lengths = [L, max(1, L // 2), 1]
    for W in (1, 4, 13):
        check(*make(B=3, L=L, seed=L + W, lengths=lengths), sliding_window=W)


@needs_kernel
@pytest.mark.parametrize("renormalize", [False, True])
def test_interventions_and_norm_weighting(capability, renormalize):
    q, k, v, lengths, tc, sid = make(B=2, L=40, seed=7, lengths=[40, 23])
    kw = dict(renormalize=renormalize, mode=torch.tensor([KEEP, UNIFORM, ZERO, KEEP, KEEP, UNIFORM], dtype=torch.int32),
              region=torch.tensor([NO_INTRA, NO_INTER, 0, NO_INTER, 0, NO_INTRA], dtype=torch.int32),
              gates=torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5, 1.0]))
    check(q, k, v, lengths, tc, sid, sliding_window=5, **kw)
    g = torch.rand(2, 6, 40, generator=torch.Generator().manual_seed(2)) + 0.1
    check(q, k, v, lengths, tc, sid, sliding_window=9, key_scale=g, **kw)


@needs_kernel
def test_uniform_heads_spread_over_the_window():
    """Mode uniform: row s of a sample of n tokens puts 1/m on each of the m = min(n, s + W) − max(0, s − W + 1)
    keys of its window (the output is their mean value), written out here."""
    q, k, v, lengths, tc, sid = make(B=2, H=2, Hkv=2, L=12, D=16, seed=9, lengths=[12, 5])
    W = 3
    out, _ = ops.attention(q, k, v, lengths, mode=torch.tensor([UNIFORM, UNIFORM], dtype=torch.int32),
                           sliding_window=W, symmetric_window=True, backend="fused")
    for b, n in enumerate(lengths.tolist()):
        for s in range(n):
            keys = v[b, :, max(0, s - W + 1):min(n, s + W)]
            torch.testing.assert_close(out[b, s], keys.mean(1), atol=1e-6, rtol=1e-6)


@needs_kernel
def test_max_logit_over_the_window(capability):
    """The max logit the kernel measures (and the one the host recomputes for a uniform head) is the reference's over
    the keys each valid row sees."""
    q, k, v, lengths, tc, sid = make(B=3, L=29, seed=11, lengths=[29, 10, 1])
    q = q * 3
    for mode in (None, torch.tensor([KEEP, UNIFORM, KEEP, ZERO, KEEP, KEEP], dtype=torch.int32)):
        *_, ml = ops.attention(q, k, v, lengths, tc, sid, sliding_window=4, symmetric_window=True, mode=mode,
                               want_features=True, want_max_logit=True, backend="fused")
        want = max_logits(q.float(), k.float(), lengths, q.shape[-1] ** -0.5, sliding_window=4,
                          symmetric_window=True)
        torch.testing.assert_close(ml, want, atol=1e-5, rtol=1e-5)
        full = max_logits(q.float(), k.float(), lengths, q.shape[-1] ** -0.5)
        assert (want < full - 1e-3).any()  # the window hid the largest score of some head


@needs_kernel
def test_padded_rows_outside_the_window_and_skipped_tiles():
    """A padded row farther than the window from every token sees no key: output 0, not NaN. A NaN value at key 200
    reaches the rows whose window holds it, and never the row tiles whose windows end before it: their key blocks
    are skipped, not computed and masked."""
    q, k, v, lengths, tc, sid = make(B=2, L=24, seed=5, lengths=[24, 3])
    out, _ = check(q, k, v, lengths, tc, sid, sliding_window=4)
    assert (out[1, 3 + 4 - 1:] == 0).all() and out[1, :6].abs().sum() > 0
    q, k, v, lengths, tc, sid = make(B=1, H=2, Hkv=2, L=256, seed=6, lengths=[256])
    v = v.clone()
    v[0, :, 200] = float("nan")
    out, _ = ops.attention(q, k, v, lengths, sliding_window=8, symmetric_window=True, backend="fused")
    assert out[0, 193:208].isnan().all()
    assert torch.isfinite(out[0, :128]).all()


@needs_kernel
def test_a_kv_cache_step_is_the_full_calls_last_rows():
    q, k, v, lengths, tc, sid = make(B=2, L=21, seed=12, lengths=[21, 21])
    kw = dict(sliding_window=5, symmetric_window=True)
    full, _ = ops.attention(q, k, v, lengths, backend="fused", **kw)
    step, _ = ops.attention(q[:, :, -3:], k, v, lengths, backend="fused", **kw)
    ref, _ = reference_attention(q[:, :, -3:], k, v, lengths, **kw)
    torch.testing.assert_close(step, full[:, -3:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(step, ref, atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_reference(dtype):
    """The op's backward with a bidirectional window (the tiled backward) against autograd through the reference."""
    q, k, v, lengths, tc, sid = make(B=3, L=13, D=16, seed=8, lengths=[13, 7, 1], dtype=dtype)
    grads = []
    for backend in ("fused", "reference"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        gates = torch.tensor([1.0, 0.5, 1.5, 1.0, 2.0, 1.0], requires_grad=True)
        out, _ = ops.attention(*leaves, lengths, tc, sid, sliding_window=3, symmetric_window=True, gates=gates,
                               backend=backend)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out.float() * w).sum().backward()
        grads.append([t.grad.float() for t in leaves] + [gates.grad])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    # a loss on row 5 alone: only the keys of its window, 3 … 7, get a gradient
    kl = k.detach().clone().requires_grad_()
    out, _ = ops.attention(q, kl, v, lengths, sliding_window=3, symmetric_window=True, backend="fused")
    out[0, 5].float().sum().backward()
    reached = kl.grad[0].abs().sum((0, 2)) > 0
    assert reached.tolist() == [3 <= t <= 7 for t in range(13)]


@needs_kernel
def test_opcheck_with_a_symmetric_window():
    q, k, v, lengths, tc, sid = make(B=2, L=9, D=32, seed=1)
    op = torch.ops.attnkit.fused_attention.default
    # symmetric_window comes after cross-attention's key_lengths, key_class and bias (None here)
    args = (q, k, v, lengths, tc, sid, 0.2, N, None, None, False, None, True, None, None, False, 3, None, None,
            None, None, None, True)
    torch.library.opcheck(op, args)
    with pytest.raises(RuntimeError, match="symmetric_window needs a sliding_window"):
        op(q, k, v, lengths, None, None, 0.2, N, None, None, False, None, False, None, None, False, None, None, None,
           None, None, None, True)
    with pytest.raises(RuntimeError, match="takes no symmetric_window"):  # cross-attention: refused by name
        op(q, k, v, lengths, None, None, 0.2, N, None, None, False, None, False, None, None, False, 3, None, None,
           lengths, None, None, True)


def test_a_symmetric_window_with_cross_attention_is_refused():
    """A window over another sequence's keys is undefined: with key_lengths, symmetric_window is refused by name on
    every backend (with a sliding window, and without one)."""
    q, k, v, lengths, tc, sid = make(B=2, L=9, seed=3, lengths=[9, 4])
    for backend in ("reference", "auto"):
        with pytest.raises(AttnkitError, match="takes no symmetric_window"):
            ops.attention(q, k, v, lengths, key_lengths=lengths, sliding_window=3, symmetric_window=True,
                          backend=backend)
        with pytest.raises(AttnkitError, match="symmetric_window"):
            ops.attention(q, k, v, lengths, key_lengths=lengths, symmetric_window=True, backend=backend)


def test_a_symmetric_window_without_a_window_is_refused():
    q, k, v, lengths, tc, sid = make(B=1, L=5, seed=2)
    for backend in ("reference", "auto"):
        with pytest.raises(AttnkitError, match="symmetric_window needs a sliding_window"):
            ops.attention(q, k, v, lengths, symmetric_window=True, backend=backend)
    with pytest.raises(AttnkitError, match="symmetric_window must be a bool"):
        reference_attention(q, k, v, lengths, sliding_window=2, symmetric_window=1)


def test_cuda_and_triton_leave_it_to_the_reference():
    """No GPU kernel has run a bidirectional window: auto sends CUDA calls to the reference, and the Triton wrapper
    refuses it if called directly (here on CPU tensors under its interpreter's check, before any launch)."""
    assert not ops.fused_symmetric_window("cuda")
    pytest.importorskip("triton")
    from attnkit.kernels import triton_attention

    q, k, v, lengths, tc, sid = make(B=1, H=2, Hkv=2, L=5, D=16, dtype=torch.float16, seed=2)
    with pytest.raises(AttnkitError, match="Triton kernel does not take symmetric_window"):
        triton_attention.fused_attention(q, k, v, lengths, sliding_window=3, symmetric_window=True)


def test_an_old_build_runs_it_on_the_reference(monkeypatch):
    """A build of the extension from before the argument: auto computes the reference's result, fused refuses."""
    monkeypatch.setattr(ops, "_FUSED_SYMMETRIC", False)
    q, k, v, lengths, tc, sid = make(B=2, L=15, seed=4, lengths=[15, 8])
    kw = dict(sliding_window=3, symmetric_window=True)
    out, _ = ops.attention(q, k, v, lengths, backend="auto", **kw)
    ref, _ = reference_attention(q, k, v, lengths, **kw)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    if ops.has_kernel("cpu"):
        with pytest.raises(AttnkitError, match="does not take symmetric_window"):
            ops.attention(q, k, v, lengths, backend="fused", **kw)


def test_observers_weights_use_the_window():
    """compare-models' blocked weights (attnkit.jobs.compare.similarity_sums) with the window ModernBERT's observers
    pass equal sums over the reference's weights."""
    from attnkit.jobs.compare import similarity_sums
    from attnkit.reference import attention_weights

    q, k, _, lengths, _, _ = make(B=2, H=4, Hkv=4, L=15, D=16, seed=13, lengths=[15, 6])
    q2, k2 = q.flip(-1), k * 0.5
    dec = dict(sliding_window=3, symmetric_window=True)
    got = similarity_sums(q, k, q2, k2, lengths, 0.25, 0.25, max_elems=200, decoder_a=dec, decoder_b=dec)
    a, b = (attention_weights(x, y, lengths, 0.25, **dec) for x, y in ((q, k), (q2, k2)))
    rows = (torch.arange(15)[None, :] < lengths[:, None])[:, None, :]
    torch.testing.assert_close(got["ab"], ((a * b).sum(-1) * rows).sum(-1).double(), atol=1e-5, rtol=1e-5)
    plain = similarity_sums(q, k, q2, k2, lengths, 0.25, 0.25)
    assert (plain["ab"] - got["ab"]).abs().max() > 1e-3  # the window changed the weights
