"""The CUDA kernels of attnkit::fused_attention and attnkit::js_distances against the reference.

Skipped when CUDA is unavailable or the extension was built without its CUDA kernels. Comparisons:
  * out: the fused error against the fp32 reference is at most 2× the error PyTorch itself makes when it
    computes the same attention (same interventions) in the input dtype (FlashAttention's test rule);
    fp32 outputs to 1e-5 absolute / 1e-4 relative.
  * features: 1e-4 relative in fp32 (1e-3 for fp16/bf16 inputs, whose scores differ by summation order).
  * js_distances: against a chunked fp64 PyTorch implementation written out in this file.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnkit.features import (
    ALL,
    CLS,
    COMMA,
    KEEP,
    NO_INTER,
    NO_INTRA,
    OTHER,
    PERIOD,
    SEP,
    UNIFORM,
    ZERO,
    feature_names,
    num_features,
)
from attnkit.ops import attention, has_kernel
from attnkit.reference import (
    _key_mask,
    intervene_weights,
    reference_attention,
    reference_js_distances,
    resolve_kv_head,
    visible_keys,
)

HAS_CUDA_KERNEL = torch.cuda.is_available() and has_kernel("cuda")
pytestmark = pytest.mark.skipif(not HAS_CUDA_KERNEL, reason="needs a GPU and attnkit._C built with CUDA")

DEV = "cuda"
LOWP = (torch.float16, torch.bfloat16)
# every (mode, region) pair once, one per head
MODE_REGION = [(m, r) for m in (KEEP, ZERO, UNIFORM) for r in (ALL, NO_INTRA, NO_INTER)]


def make_inputs(B, H, L, D, dtype, lengths, *, seed=0, sentences=True, classes=True, scale=1.0):
    """q, k, v as transformers passes them: B×H×L×D views of B×L×H×D memory."""
    g = torch.Generator().manual_seed(seed)

    def proj():
        return (torch.randn(B, L, H, D, generator=g) * scale).to(DEV, dtype).transpose(1, 2)

    q, k, v = proj(), proj(), proj()
    lengths = torch.tensor(lengths, dtype=torch.int64)
    token_class = sentence_id = None
    if classes:
        token_class = torch.full((B, L), OTHER, dtype=torch.int32)
        pick = torch.rand(B, L, generator=g)
        token_class[pick < 0.08] = COMMA
        token_class[(pick >= 0.08) & (pick < 0.14)] = PERIOD
        for b, n in enumerate(lengths.tolist()):
            token_class[b, 0] = CLS
            token_class[b, n - 1] = SEP
            if n > 4:
                token_class[b, n // 2] = SEP
        token_class = token_class.to(DEV)
    if sentences:
        sentence_id = torch.zeros(B, L, dtype=torch.int32)
        for b, n in enumerate(lengths.tolist()):
            sentence_id[b, n // 2 + 1:] = 1
            sentence_id[b, (3 * n) // 4 + 1:] = 2
        sentence_id = sentence_id.to(DEV)
    return q, k, v, lengths.to(DEV), token_class, sentence_id


def pytorch_same_dtype(q, k, v, lengths, sentence_id, mode, region, renormalize, gates, scaling):
    """Attention as PyTorch computes it in the input dtype (the error yardstick of the 2× rule)."""
    L = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~_key_mask(lengths, L)[:, None, None, :], float("-inf"))
    w = torch.softmax(scores, dim=-1)
    w = intervene_weights(w, lengths, sentence_id, mode, region, renormalize)
    out = torch.matmul(w, v)
    if gates is not None:
        out = out * gates.to(out.dtype).view(1, -1, 1, 1)
    return out.transpose(1, 2)


def fused(q, k, v, lengths, token_class, sentence_id, *, num_windows=16, mode=None, region=None,
          renormalize=False, gates=None, want_features=True, scaling=None, key_scale=None):
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.attnkit.fused_attention(q, k, v, lengths, token_class, sentence_id, float(scaling),
                                             num_windows, mode, region, renormalize, gates, want_features,
                                             key_scale)


def check(q, k, v, lengths, token_class, sentence_id, *, num_windows=16, mode=None, region=None,
          renormalize=False, gates=None, feature_rtol=None, key_scale=None):
    scaling = q.shape[-1] ** -0.5
    out, feats = fused(q, k, v, lengths, token_class, sentence_id, num_windows=num_windows, mode=mode,
                       region=region, renormalize=renormalize, gates=gates, key_scale=key_scale)
    ref_out, ref_feats = reference_attention(
        q.float(), k.float(), v.float(), lengths, token_class, sentence_id, scaling=scaling,
        num_windows=num_windows, mode=mode, region=region, renormalize=renormalize, gates=gates,
        want_features=True, key_scale=key_scale)
    B, H, L, D = q.shape
    assert out.shape == (B, L, H, D) and out.dtype == q.dtype
    assert feats.shape == (B, H, num_features(num_windows)) and feats.dtype == torch.float32
    assert torch.isfinite(out).all()
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    else:
        pt = pytorch_same_dtype(q, k, v, lengths, sentence_id, mode, region, renormalize, gates, scaling)
        err = (out.float() - ref_out).abs().max().item()
        pt_err = (pt.float() - ref_out).abs().max().item()
        assert err <= 2 * pt_err + 1e-5, f"fused error {err} > 2 × PyTorch's {q.dtype} error {pt_err}"
    rtol = feature_rtol or (1e-4 if q.dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(feats, ref_feats, rtol=rtol, atol=rtol * 0.1)
    return out, feats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_every_mode_and_region(dtype, renormalize):
    H = len(MODE_REGION)
    L = 77
    q, k, v, lengths, tc, sid = make_inputs(3, H, L, 64, dtype, [L, 40, 9], seed=1)
    mode = torch.tensor([m for m, _ in MODE_REGION], dtype=torch.int32, device=DEV)
    region = torch.tensor([r for _, r in MODE_REGION], dtype=torch.int32, device=DEV)
    out, feats = check(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize)
    zero_heads = [h for h, (m, _) in enumerate(MODE_REGION) if m == ZERO]
    assert (out[:, :, zero_heads] == 0).all() and (feats[:, zero_heads] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_key_scale_weighs_the_features_only(dtype, renormalize):
    H = len(MODE_REGION)
    q, k, v, lengths, tc, sid = make_inputs(3, H, 150, 64, dtype, [150, 70, 1], seed=31)
    mode = torch.tensor([m for m, _ in MODE_REGION], dtype=torch.int32, device=DEV)
    region = torch.tensor([r for _, r in MODE_REGION], dtype=torch.int32, device=DEV)
    g = torch.rand(3, H, 150, generator=torch.Generator().manual_seed(3)).to(DEV) * 4
    g[0, 0, :20] = 0.0
    out, feats = check(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize, key_scale=g)
    plain_out, plain_feats = fused(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)  # the output does not see the key scale
    assert not torch.allclose(feats, plain_feats)


def test_kernel_choice_is_checked(monkeypatch):
    q, k, v, lengths, tc, sid = make_inputs(1, 2, 16, 32, torch.float16, [16], seed=9)
    monkeypatch.setenv("ATTNKIT_CUDA_KERNEL", "v9")
    with pytest.raises(RuntimeError, match="ATTNKIT_CUDA_KERNEL must be 'v1', 'v2' or 'triton', got 'v9'"):
        fused(q, k, v, lengths, tc, sid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_head_dims_with_gates(dtype, D):
    q, k, v, lengths, tc, sid = make_inputs(2, 3, 150, D, dtype, [150, 71], seed=2)
    gates = torch.tensor([1.0, 0.5, -2.0], device=DEV)
    check(q, k, v, lengths, tc, sid, gates=gates)


@pytest.mark.parametrize("L", [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lengths_around_tile_edges(L, dtype):
    lengths = [L, max(1, L // 2 + 1), 1]
    q, k, v, lengths, tc, sid = make_inputs(3, 2, L, 32, dtype, lengths, seed=L)
    check(q, k, v, lengths, tc, sid)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_sequence_4096(dtype):
    L = 4096
    q, k, v, lengths, tc, sid = make_inputs(2, 2, L, 64, dtype, [L, 3001], seed=3)
    mode = torch.tensor([KEEP, UNIFORM], dtype=torch.int32, device=DEV)
    region = torch.tensor([NO_INTER, NO_INTRA], dtype=torch.int32, device=DEV)
    check(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=True)


def test_padding_rows_attend_like_eager_and_give_no_features():
    L = 70
    q, k, v, lengths, tc, sid = make_inputs(2, 2, L, 64, torch.float32, [L, 1], seed=4)
    out, feats = check(q, k, v, lengths, tc, sid)
    # a sample with one valid token: every row (padded ones too) puts all its weight on key 0
    torch.testing.assert_close(out[1], v[1, :, :1].transpose(0, 1).expand(L, -1, -1), rtol=1e-5, atol=1e-6)
    names = feature_names(16)
    one_row = dict(zip(names, feats[1, 0].tolist()))
    assert one_row["max"] == pytest.approx(1.0) and one_row["entropy"] == pytest.approx(0.0, abs=1e-6)
    assert one_row["sep"] == pytest.approx(1.0)  # token 0 of that sample is its closing [SEP]
    assert one_row["prev"] == 0 and one_row["next"] == 0
    # padded keys must not change anything: garbage (even inf) after n is ignored
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 1:] = float("inf")
    v2[1, :, 1:] = float("nan")
    out2, feats2 = fused(q, k2, v2, lengths, tc, sid)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(feats2, feats)


@pytest.mark.parametrize("num_windows", [1, 5, 16, 64, 65, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_num_windows(num_windows, dtype):
    # (more than 64 windows: v2 hands the call to v1)
    q, k, v, lengths, tc, sid = make_inputs(2, 2, 96, 32, dtype, [96, 37], seed=5)
    _, feats = check(q, k, v, lengths, tc, sid, num_windows=num_windows)
    buckets = feats[..., : 5 + num_windows].sum(-1)
    torch.testing.assert_close(buckets, torch.ones_like(buckets), rtol=1e-5, atol=1e-5)


def decoder_same_dtype(q, k, v, lengths, kv_head, scaling, *, causal=False, sliding_window=None, softcap=None,
                       sink=None):
    """Decoder attention as PyTorch computes it in the input dtype (the yardstick of the 2× rule): K/V heads
    repeated per query head, soft-capping, the keys each row sees (`visible_keys`), the sink as one more logit per
    row."""
    B, H, L, _ = q.shape
    kv = resolve_kv_head(H, k.shape[1], kv_head, q.device)
    scores = torch.matmul(q, k[:, kv].transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible_keys(lengths, L, causal, sliding_window), float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.to(scores.dtype).view(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
    w = torch.softmax(scores, dim=-1)[..., :L]
    return torch.matmul(w, v[:, kv]).transpose(1, 2)


DECODER_CASES = [
    dict(causal=True),
    dict(causal=True, sliding_window=37),
    dict(sliding_window=20),
    dict(causal=True, softcap=2.0, sink=[0.5, -1.0, 2.0, 0.0]),
    dict(causal=True, sink=[1.0, 0.0, -0.5, 3.0], kv_head=[1, 0, 1, 1]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODER_CASES, ids=["causal", "causal-window", "window", "softcap-sink",
                                                     "sink-uneven-kv-heads"])
def test_decoder_arguments(monkeypatch, dtype, case):
    # v1 takes the decoder arguments (docs/cuda.md): four query heads on two K/V heads, lengths around its 64-row
    # tiles (130 keys: three tiles; 65; 1), against the fp32 reference
    monkeypatch.setenv("ATTNKIT_CUDA_KERNEL", "v1")
    L, H, Hkv, D = 130, 4, 2, 64
    q, _, _, lengths, tc, sid = make_inputs(3, H, L, D, dtype, [L, 65, 1], seed=41)
    _, k, v, _, _, _ = make_inputs(3, Hkv, L, D, dtype, [L, 65, 1], seed=42, classes=False, sentences=False)
    case = {name: torch.tensor(x, dtype=torch.int32 if name == "kv_head" else torch.float32, device=DEV)
            if isinstance(x, list) else x for name, x in case.items()}
    scaling = D ** -0.5
    out, feats = attention(q, k, v, lengths, tc, sid, backend="fused", scaling=scaling, num_windows=16,
                           want_features=True, **case)
    ref_out, ref_feats = reference_attention(q.float(), k.float(), v.float(), lengths, tc, sid, scaling=scaling,
                                             num_windows=16, want_features=True, **case)
    assert feats.shape == (3, H, num_features(16, sink="sink" in case)) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    else:
        window = {n: case[n] for n in ("causal", "sliding_window", "softcap", "sink") if n in case}
        pt = decoder_same_dtype(q, k, v, lengths, case.get("kv_head"), scaling, **window)
        rows = _key_mask(lengths, L)  # the yardstick's padded rows may see no key at all (NaN)
        err, pt_err = ((x.float() - ref_out.float())[rows].abs().max().item() for x in (out, pt))
        assert err <= 2 * pt_err + 1e-5, f"fused error {err} > 2 × PyTorch's {dtype} error {pt_err}"
    rtol = 1e-4 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(feats, ref_feats, rtol=rtol, atol=rtol * 0.1)
    if case.get("causal"):
        assert (feats[..., feature_names(16).index("next")] == 0).all()  # a causal row never sees the next key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_without_classes_or_sentences_and_sharp_scores(dtype):
    # large-magnitude inputs make near-one-hot rows (exp underflow paths, max close to 1)
    q, k, v, lengths, tc, sid = make_inputs(2, 4, 90, 64, dtype, [90, 50], seed=6,
                                            classes=False, sentences=False, scale=3.0)
    region = torch.tensor([ALL, NO_INTRA, NO_INTER, ALL], dtype=torch.int32, device=DEV)
    check(q, k, v, lengths, None, None, region=region, renormalize=True)


def test_strided_and_contiguous_inputs_agree():
    q, k, v, lengths, tc, sid = make_inputs(2, 3, 50, 64, torch.float16, [50, 20], seed=7)
    wide = torch.randn(2, 3, 50, 128, device=DEV, dtype=torch.float16)
    q_odd = wide[..., ::2]  # stride 2 on D: the wrapper must copy
    out_a, feats_a = fused(q_odd, k, v, lengths, tc, sid)
    out_b, feats_b = fused(q_odd.contiguous(), k.contiguous(), v.contiguous(), lengths, tc, sid)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    torch.testing.assert_close(feats_a, feats_b)  # feature sums use atomics: order may differ


def test_want_features_false():
    q, k, v, lengths, tc, sid = make_inputs(2, 2, 40, 32, torch.float16, [40, 11], seed=8)
    out, feats = fused(q, k, v, lengths, tc, sid, want_features=False)
    out_f, _ = fused(q, k, v, lengths, tc, sid, want_features=True)
    assert feats.shape == (2, 2, 0)
    torch.testing.assert_close(out, out_f, rtol=0, atol=0)
    lengths_cpu = lengths.cpu()  # a host lengths tensor is accepted too
    out_c, _ = fused(q, k, v, lengths_cpu, tc, sid, want_features=False)
    torch.testing.assert_close(out_c, out, rtol=0, atol=0)


def test_bad_arguments_are_named():
    q, k, v, lengths, tc, sid = make_inputs(1, 2, 16, 32, torch.float16, [16], seed=9)
    with pytest.raises(RuntimeError, match="head dim"):
        fused(q[..., :24], k[..., :24], v[..., :24], lengths, tc, sid)
    with pytest.raises(RuntimeError, match="k must have q's dtype"):
        fused(q, k.float(), v, lengths, tc, sid)
    with pytest.raises(RuntimeError, match="token_class"):
        fused(q, k, v, lengths, tc.long(), sid)
    with pytest.raises(RuntimeError, match="lengths"):
        fused(q, k, v, torch.tensor([16, 16], device=DEV), tc, sid)


# --- issue 10 part 1 and the numerics policy of issue 12 --------------------------------------------

_MISALIGNED_SCRIPT = """
import torch, attnkit.ops
from tests.test_fused_cuda import make_inputs, fused
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    B, H, L, D = 2, 2, 40, 64
    q, k, v, lengths, tc, sid = make_inputs(B, H, L, D, dtype, [40, 17], seed=20)
    def misaligned(t):
        buf = torch.zeros(t.numel() + 1, device="cuda", dtype=dtype)
        view = buf[1:].view(B, H, L, D)  # contiguous, address 1 element past a 16-byte boundary
        view.copy_(t)
        assert view.is_contiguous() and view.data_ptr() % 16 != 0
        return view
    out_a, feats_a = fused(misaligned(q), misaligned(k), misaligned(v), lengths, tc, sid)
    torch.cuda.synchronize()
    out_b, feats_b = fused(q.contiguous(), k.contiguous(), v.contiguous(), lengths, tc, sid)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    torch.testing.assert_close(feats_a, feats_b)
print("ok")
"""


def test_misaligned_contiguous_operands_are_copied():
    # in a subprocess: before the fix the 16-byte loads fault, which kills the CUDA context for good
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _MISALIGNED_SCRIPT], cwd=root, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_codes_and_lengths_on_the_device_are_range_checked():
    from attnkit import ops
    from attnkit.errors import AttnkitError

    q, k, v, lengths, tc, sid = make_inputs(2, 3, 20, 32, torch.float16, [20, 9], seed=21)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    cases = [
        (dict(mode=i32(0, 3, 0)), r"mode codes must be 0, 1 or 2, got 3 at head 1"),
        (dict(region=i32(0, 0, -2)), r"region codes must be 0, 1 or 2, got -2 at head 2"),
        (dict(scaling=float("inf")), "scaling must be a finite number"),
        (dict(num_windows=0), "num_windows must be >= 1"),
    ]
    for kw, match in cases:
        with pytest.raises(RuntimeError, match=match):
            fused(q, k, v, lengths, tc, sid, **kw)
    for bad in ([0, 9], [20, 21]):
        for where in (DEV, "cpu"):
            with pytest.raises(RuntimeError, match=r"lengths must lie in \[1, L\] = \[1, 20\]"):
                fused(q, k, v, torch.tensor(bad, device=where), tc, sid)
    tc_bad = tc.clone()
    tc_bad[1, 3] = 9
    with pytest.raises(RuntimeError, match=r"token_class codes must be 0..4, got 9 at \[1, 3\]"):
        fused(q, k, v, lengths, tc_bad, sid)
    tc_bad[1, 3] = 0
    tc_bad[1, 15] = 9  # past lengths[1] = 9: padding, not read
    fused(q, k, v, lengths, tc_bad, sid)
    # a checked tensor written in place is checked again (version counter)
    mode = i32(0, 1, 2)
    fused(q, k, v, lengths, tc, sid, mode=mode)
    mode[2] = 5
    with pytest.raises(RuntimeError, match="mode codes"):
        fused(q, k, v, lengths, tc, sid, mode=mode)
    with pytest.raises(AttnkitError, match="mode codes"):
        ops.attention(q, k, v, lengths, tc, sid, mode=mode, backend="fused")
    torch.cuda.synchronize()  # the context survived every refusal


def _same_nan_pattern(a, b, atol):
    assert torch.equal(a.isnan(), b.isnan()), "NaN positions differ"
    torch.testing.assert_close(a.nan_to_num(0.0), b.nan_to_num(0.0), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_inputs_follow_the_reference(dtype):
    B, H, L = 3, 4, 70
    q, k, v, lengths, tc, sid = make_inputs(B, H, L, 64, dtype, [70, 31, 70], seed=22)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q[0, 0, 3, 5] = float("nan")  # one undefined row
    k[1, 1, 4, 0] = float("inf")  # rows with q[..., 0] > 0 score +inf
    q[2, 2, 65:] = float("nan")  # the last rows of a full sample
    v[2, 3, 7, 1] = float("nan")  # reaches the output, not the features
    q[1, 0, 50] = float("nan")  # a padded query row (n = 31)
    k[1, 3, 40:] = float("inf")  # padded keys: ignored
    v[1, 3, 40:] = float("nan")
    mode = torch.tensor([KEEP, KEEP, KEEP, KEEP], dtype=torch.int32, device=DEV)
    region = torch.tensor([NO_INTRA, ALL, NO_INTER, ALL], dtype=torch.int32, device=DEV)
    for renormalize in (False, True):
        out, feats = fused(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize)
        ref_out, ref_feats = reference_attention(q.float(), k.float(), v.float(), lengths, tc, sid,
                                                 mode=mode, region=region, renormalize=renormalize,
                                                 want_features=True)
        _same_nan_pattern(out.float(), ref_out, 1e-5 if dtype == torch.float32 else 2e-2)
        _same_nan_pattern(feats, ref_feats, 1e-4 if dtype == torch.float32 else 1e-3)
        assert feats[0, 0].isnan().all() and feats[1, 1].isnan().all() and feats[2, 2].isnan().all()
        assert torch.isfinite(feats[2, 3]).all() and torch.isfinite(feats[1, 3]).all()


def test_large_sentence_ids_compare_as_integers():
    q, k, v, lengths, tc, sid = make_inputs(2, 3, 40, 32, torch.float32, [40, 25], seed=23)
    region = torch.tensor([ALL, NO_INTRA, NO_INTER], dtype=torch.int32, device=DEV)
    base = fused(q, k, v, lengths, tc, sid, region=region)
    big = fused(q, k, v, lengths, tc, sid + 2**24, region=region)
    torch.testing.assert_close(big[0], base[0], rtol=0, atol=0)
    torch.testing.assert_close(big[1], base[1])


def test_too_little_shared_memory_is_a_clear_error(monkeypatch):
    # float32 with head dim 128 needs ~77 KB per block (over the 48 KB default): pretend the GPU allows 60 KB
    q, k, v, lengths, tc, sid = make_inputs(1, 1, 16, 128, torch.float32, [16], seed=24)
    monkeypatch.setenv("ATTNKIT_CUDA_SMEM_LIMIT", "60000")
    with pytest.raises(RuntimeError, match=r"float32 kernel for head dim 128 with features needs \d+ bytes") as err:
        fused(q, k, v, lengths, tc, sid)
    assert torch.cuda.get_device_name() in str(err.value)
    monkeypatch.delenv("ATTNKIT_CUDA_SMEM_LIMIT")
    fused(q, k, v, lengths, tc, sid)  # the real limit of this GPU


def _capture(fn):
    """Warm up `fn` on a side stream, capture it in a CUDA graph; returns (graph, its outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def test_cuda_graph_capture_of_the_op():
    q, k, v, lengths, tc, sid = make_inputs(2, 3, 50, 64, torch.float16, [50, 21], seed=25)
    static = [t.clone() for t in (q, k, v)]
    graph, (out, feats) = _capture(lambda: fused(*static, lengths, tc, sid))
    q2, k2, v2, *_ = make_inputs(2, 3, 50, 64, torch.float16, [50, 21], seed=26)
    for dst, src in zip(static, (q2, k2, v2)):
        dst.copy_(src)
    graph.replay()
    want_out, want_feats = fused(q2, k2, v2, lengths, tc, sid)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(feats, want_feats)
    # host lengths cannot be copied inside a capture: refused by name (the CPU tensor exists before the
    # capture: torch itself refuses a device-to-host copy inside one)
    host_lengths = lengths.cpu()
    with pytest.raises(RuntimeError, match="lengths are on the CPU while a CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fused(*static, host_lengths, tc, sid)


def test_cuda_graph_capture_of_an_instrumented_forward():
    """A whole instrumented forward (padding mask → lengths on the device, features via the runtime
    batch) captured in a CUDA graph and replayed on new inputs equals eager."""
    from transformers import BertConfig, BertModel

    import attnkit
    from attnkit.engine import measuring
    from attnkit.tokens import Batch

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=128, max_position_embeddings=64)).to(DEV).eval()
    attnkit.instrument(model)
    B, L = 3, 24
    lengths = torch.tensor([24, 10, 17], device=DEV)
    mask = (torch.arange(L, device=DEV)[None] < lengths[:, None]).long()

    def ids(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(5, 100, (B, L), generator=g).to(DEV) * mask

    static_ids = ids(1)
    tc = torch.zeros(B, L, dtype=torch.int32, device=DEV)
    tc[:, 0] = CLS
    sid = (torch.arange(L, device=DEV)[None] >= 8).int().expand(B, L).contiguous()
    with torch.inference_mode():
        # plain forward: lengths_from_mask on the device, no host sync inside the capture
        graph, out = _capture(lambda: model(input_ids=static_ids, attention_mask=mask).last_hidden_state)
        static_ids.copy_(ids(2))
        graph.replay()
        torch.testing.assert_close(out, model(input_ids=static_ids, attention_mask=mask).last_hidden_state,
                                   rtol=1e-4, atol=1e-4)
        # with features
        batch = Batch({"input_ids": static_ids, "attention_mask": mask}, lengths, tc, sid, 0)
        with measuring(model) as rt, rt.batch_of(batch):
            def step():
                rt.features = {}
                hidden = model(**batch.inputs).last_hidden_state
                return hidden, torch.stack([rt.features[i] for i in range(2)], 1)

            graph, (hidden, feats) = _capture(step)
            static_ids.copy_(ids(3))
            graph.replay()
            want_hidden, want_feats = step()
        torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats, want_feats, rtol=1e-4, atol=1e-5)


# --- Jensen-Shannon distances ----------------------------------------------------------------------

def random_attention(B, M, L, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, M, L, L, generator=g) * 2.0
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    attn = torch.softmax(scores, -1)
    attn[:, 1] = attn[:, 0]  # identical heads: distance exactly 0
    attn[:, 2, :, 0] = 0.0  # exact zeros in p and not in q
    attn = attn * mask[:, None, :, None]  # padded rows 0 (they are skipped anyway)
    return attn


@pytest.mark.parametrize("B,M,L,lengths", [(3, 40, 70, [70, 33, 1]), (2, 144, 128, [128, 100])])
def test_js_distances(B, M, L, lengths):
    attn = random_attention(B, M, L, lengths, seed=M).to(DEV)
    lengths_t = torch.tensor(lengths)
    ref = reference_js_distances(attn, lengths_t).cpu()
    got = torch.ops.attnkit.js_distances(attn, lengths_t.to(DEV)).cpu()
    assert got.dtype == torch.float64 and got.shape == (M, M)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())
    assert got[0, 1] == 0 and got[1, 0] == 0 and (got.diagonal() == 0).all()
    torch.testing.assert_close(got, got.T, rtol=0, atol=0)


# --- compute-sanitizer ------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("compute-sanitizer") is None and not os.path.exists(
    "/usr/local/cuda/bin/compute-sanitizer"), reason="compute-sanitizer not installed")
def test_compute_sanitizer_clean():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tools", "sanitize_cuda.sh")
    proc = subprocess.run(["bash", script], cwd=root, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# --- end to end -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extract_on_cuda_matches_the_cpu_reference(dtype):
    """attnkit.extract on the GPU (fused kernel, whole instrumented model, pairs with padding) gives the
    features the CPU reference gives: 1e-4 relative in fp32, the model's own bf16 drift otherwise."""
    import attnkit

    _, tok = attnkit.load_model(device="cpu")
    texts = ["The cat sat on the mat, and then it slept.", ("A question?", "An answer, with a comma."),
             "Short.", "One more sentence that is a little longer than the others, to pad the rest."] * 3
    got = attnkit.extract(texts, model=attnkit.load_model(device=DEV, dtype=dtype), max_length=32, batch_size=5,
                          backend="fused")
    want = attnkit.extract(texts, model=attnkit.load_model(device="cpu"), max_length=32, batch_size=5,
                           backend="reference")
    assert got.n_samples == want.n_samples == len(texts) and got.n_tokens == want.n_tokens
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    np.testing.assert_allclose(got.mean, want.mean, rtol=tol, atol=tol * 0.1)
    del tok
