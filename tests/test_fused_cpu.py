"""The fused CPU kernels (csrc/cpu) against the executable spec (attnkit/reference.py).

Skipped as a whole when the extension `attnkit._C` is not built (attnkit then runs on the reference).
Tolerance (FlashAttention style): the fused output's error against an fp32 reference is at most twice
PyTorch's own error in the same dtype (eager softmax(QKᵀ)V computed in that dtype) plus a tiny
absolute floor; features agree with the reference to 1e-5.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import CLS, OTHER, SEP, num_features
from attnkit.reference import reference_attention, reference_js_distances

if not ops.has_kernel("cpu"):
    pytest.skip("attnkit._C has no CPU kernel (extension not built)", allow_module_level=True)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-5, torch.float16: 1e-5}


def make_inputs(B, H, L, D, dtype=torch.float32, seed=0, lengths=None, n_sent=3, transposed=True):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # what transformers passes: B×H×L×D views of B×L×H×D
        q, k, v = (torch.randn(B, L, H, D, generator=g).transpose(1, 2).to(dtype) for _ in range(3))
    else:
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(3))
    if lengths is None:
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        lengths[0] = L
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    tc = torch.randint(0, 5, (B, L), generator=g, dtype=torch.int32)
    tc = torch.where(torch.rand(B, L, generator=g) < 0.6, torch.zeros_like(tc), tc)  # mostly OTHER
    tc[:, 0] = CLS
    sid = torch.randint(0, n_sent, (B, L), generator=g, dtype=torch.int32)
    return q, k, v, lengths, tc, sid


def fused(q, k, v, lengths, tc, sid, *, mode=None, region=None, renormalize=False, gates=None,
          want_features=True, num_windows=16, scaling=None):
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.attnkit.fused_attention(q, k, v, lengths, tc, sid, scaling, num_windows, mode, region,
                                             renormalize, gates, want_features)


def ref(q, k, v, lengths, tc=None, sid=None, **kw):
    return reference_attention(q, k, v, lengths, tc, sid, **kw)


def eager_in_dtype(q, k, v, lengths):
    """PyTorch's own attention computed in q's dtype (no upcast): the error yardstick."""
    B, H, L, D = q.shape
    s = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5
    valid = torch.arange(L)[None, :] < lengths[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v).transpose(1, 2)


def valid_rows(x, lengths):
    """Mask B×L×H×D output to the valid query rows (padded rows are compared separately)."""
    L = x.shape[1]
    return (torch.arange(L)[None, :] < lengths[:, None])[:, :, None, None]


def check_case(q, k, v, lengths, tc, sid, **kw):
    dtype = q.dtype
    out, feats = fused(q, k, v, lengths, tc, sid, **kw)
    assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    # fp32 reference from the same (rounded) inputs
    ref_out, ref_feats = ref(q.float(), k.float(), v.float(), lengths, tc, sid, want_features=True,
                             **{k_: v_ for k_, v_ in kw.items() if k_ != "want_features"})
    own = eager_in_dtype(q, k, v, lengths).float()
    plain_ref, _ = ref(q.float(), k.float(), v.float(), lengths)
    # No op that returns `dtype` can beat the rounding of the exact answer to `dtype` (this matters when
    # eager is exact, e.g. L = 1, but gates or interventions scale the output).
    round_err = (ref_out.to(dtype).float() - ref_out).abs().max().item()
    torch_err = max((own - plain_ref).abs().max().item(), round_err)
    err = (out.float() - ref_out).abs().max().item()
    assert err <= 2 * torch_err + FLOOR[dtype], f"{dtype}: fused err {err:.3g} > 2 × torch err {torch_err:.3g}"
    if kw.get("want_features", True):
        assert feats.shape == ref_feats.shape
        np.testing.assert_allclose(feats.numpy(), ref_feats.numpy(), atol=1e-5, rtol=0)
    return out, feats


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 2, 17, 130, 700])  # 130, 700: several row tiles
def test_plain_matches_reference(dtype, L):
    check_case(*make_inputs(3, 2, L, 32, dtype, seed=L))


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_mode_region_combination(renormalize, dtype):
    # nine heads: every (mode, region) pair at once, plus gates
    combos = list(itertools.product(range(3), range(3)))
    H = len(combos)
    mode = torch.tensor([m for m, _ in combos], dtype=torch.int32)
    region = torch.tensor([r for _, r in combos], dtype=torch.int32)
    gates = torch.linspace(0.25, 2.0, H)
    q, k, v, lengths, tc, sid = make_inputs(3, H, 45, 32, dtype, seed=7, lengths=[45, 1, 23])
    check_case(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize, gates=gates)
    # and without sentence ids (one sentence: no_intra drops everything, no_inter nothing)
    check_case(q, k, v, lengths, tc, None, mode=mode, region=region, renormalize=renormalize)


def test_features_without_token_classes_and_not_wanted():
    q, k, v, lengths, tc, sid = make_inputs(2, 3, 33, 64, seed=3)
    check_case(q, k, v, lengths, None, None)
    out, feats = fused(q, k, v, lengths, tc, sid, want_features=False)
    assert feats.shape == (2, 3, 0)
    ref_out, _ = ref(q, k, v, lengths, tc, sid)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=0)


def test_padded_query_rows_match_eager_and_layouts():
    # padded query rows attend to the valid keys like eager attention; contiguous inputs work too
    for transposed in (True, False):
        q, k, v, lengths, tc, sid = make_inputs(3, 2, 40, 32, seed=11, lengths=[40, 1, 5], transposed=transposed)
        out, _ = fused(q, k, v, lengths, tc, sid, want_features=False)
        torch.testing.assert_close(out, eager_in_dtype(q, k, v, lengths), atol=2e-6, rtol=0)


def test_window_features_worked_by_hand():
    # one sample, one head, q = 0 → uniform weights 1/n over n = 4 keys; classes CLS, OTHER, OTHER, SEP
    n, N = 4, 2
    q = torch.zeros(1, 1, n, 32)
    k = torch.randn(1, 1, n, 32)
    v = torch.randn(1, 1, n, 32)
    tc = torch.tensor([[CLS, OTHER, OTHER, SEP]], dtype=torch.int32)
    _, f = fused(q, k, v, torch.tensor([n]), tc, None, num_windows=N)
    f = f[0, 0]
    assert f.shape[0] == num_features(N)
    # per row: cls 1/4, sep 1/4; self 1/4 on rows 1, 2; windows: d = 1 → w 0, d = 2, 3 → w 1
    # row 1: OTHER keys at d=1 (key 2) → win0 1/4; row 2: key 1 at d=1 → win0 1/4
    # rows 0, 3: OTHER keys 1, 2 at d = 1, 2 → win0 1/4, win1 1/4; self of rows 0 and 3 is a class bucket
    expected_buckets = [1 / 4, 1 / 4, 0, 0, (1 / 4 + 1 / 4) / 4, (1 / 4 * 4) / 4, (1 / 4 * 2) / 4]
    np.testing.assert_allclose(f[:7].numpy(), expected_buckets, atol=1e-6)
    np.testing.assert_allclose(f[7 + 2].item(), np.log(4), atol=1e-6)  # entropy
    np.testing.assert_allclose(f[7 + 3].item(), 0.25, atol=1e-6)  # max
    np.testing.assert_allclose(f[-1].item(), np.log(4), atol=1e-6)  # cls_entropy


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    B=st.integers(1, 4), H=st.integers(1, 4), L=st.integers(1, 512), D=st.sampled_from([32, 64]),
    dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), renormalize=st.booleans(),
    intervene=st.booleans(), use_gates=st.booleans(), n_sent=st.integers(1, 4), one_key=st.booleans(),
)
def test_random_shapes_hypothesis(B, H, L, D, dtype, seed, renormalize, intervene, use_gates, n_sent, one_key):
    q, k, v, lengths, tc, sid = make_inputs(B, H, L, D, dtype, seed=seed, n_sent=n_sent)
    if one_key:
        lengths[-1] = 1  # every key masked but one
    g = torch.Generator().manual_seed(seed)
    mode = torch.randint(0, 3, (H,), generator=g, dtype=torch.int32) if intervene else None
    region = torch.randint(0, 3, (H,), generator=g, dtype=torch.int32) if intervene else None
    gates = torch.rand(H, generator=g) * 2 if use_gates else None
    check_case(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize, gates=gates)


def test_input_validation_names_the_argument():
    q, k, v, lengths, tc, sid = make_inputs(2, 2, 8, 32)
    with pytest.raises(RuntimeError, match="lengths must be int64 of shape"):
        fused(q, k, v, lengths.int(), tc, sid)
    with pytest.raises(RuntimeError, match="lengths must lie in"):
        fused(q, k, v, torch.tensor([0, 8]), tc, sid)
    with pytest.raises(RuntimeError, match="k and v must have q's dtype"):
        fused(q, k.double(), v, lengths, tc, sid)
    with pytest.raises(RuntimeError, match="q must be float32, bfloat16 or float16"):
        fused(q.double(), k.double(), v.double(), lengths, tc, sid)
    with pytest.raises(RuntimeError, match="token_class must be Int"):
        fused(q, k, v, lengths, tc.long(), sid)
    with pytest.raises(RuntimeError, match="sentence_id must be Int"):
        fused(q, k, v, lengths, tc, sid[:, :4])
    with pytest.raises(RuntimeError, match="mode codes"):
        fused(q, k, v, lengths, tc, sid, mode=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="gates must be Float"):
        fused(q, k, v, lengths, tc, sid, gates=torch.ones(3))
    with pytest.raises(RuntimeError, match="k and v must have q's shape"):
        fused(q, k[:, :, :4], v, lengths, tc, sid)


def test_gradients_match_reference():
    q, k, v, lengths, tc, sid = make_inputs(2, 3, 12, 32, seed=5, lengths=[12, 7])
    mode = torch.tensor([0, 2, 0], dtype=torch.int32)
    region = torch.tensor([0, 0, 2], dtype=torch.int32)
    grads = []
    for use_fused in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        gates = torch.tensor([1.0, 0.5, 1.5], requires_grad=True)
        kw = dict(mode=mode, region=region, gates=gates)
        if use_fused:
            out, _ = fused(*leaves, lengths, tc, sid, want_features=False, **kw)
        else:
            out, _ = ref(*leaves, lengths, tc, sid, **kw)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * w).sum().backward()
        grads.append([t.grad for t in leaves] + [gates.grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert grads[0][3].abs().sum() > 0  # the gates' gradient (head importance) is not trivially zero


def test_opcheck():
    samples = [
        make_inputs(2, 2, 9, 32, seed=1),
        make_inputs(1, 3, 1, 64, seed=2),
        make_inputs(2, 2, 20, 32, torch.bfloat16, seed=3),
    ]
    for i, (q, k, v, lengths, tc, sid) in enumerate(samples):
        H = q.shape[1]
        mode = torch.full((H,), i % 3, dtype=torch.int32)
        region = torch.full((H,), (i + 1) % 3, dtype=torch.int32)
        args = (q, k, v, lengths, tc, sid, 0.2, 16, mode, region, bool(i % 2), torch.ones(H), True)
        torch.library.opcheck(torch.ops.attnkit.fused_attention.default, args)
    q, k, v, lengths, tc, sid = samples[0]
    grad_args = (q.requires_grad_(), k, v, lengths, tc, sid, 0.2, 16, None, None, False, None, False)
    torch.library.opcheck(torch.ops.attnkit.fused_attention.default, grad_args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    attn = torch.softmax(torch.randn(2, 3, 6, 6), -1)
    torch.library.opcheck(torch.ops.attnkit.js_distances.default, (attn, torch.tensor([6, 4])),
                          test_utils=("test_schema", "test_faketensor"))


def test_inside_torch_compile_fullgraph():
    q, k, v, lengths, tc, sid = make_inputs(2, 2, 24, 32, seed=9)

    def f(q, k, v):
        out, feats = torch.ops.attnkit.fused_attention(q * 1.0, k, v, lengths, tc, sid, 0.25, 16, None, None,
                                                       False, None, True)
        return out.sum(-1), feats * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a, fa = compiled(q, k, v)
    b, fb = f(q, k, v)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(fa, fb)


def test_js_distances_against_reference_and_scipy():
    spatial = pytest.importorskip("scipy.spatial.distance")
    g = torch.Generator().manual_seed(0)
    B, M, L = 3, 5, 21
    lengths = torch.tensor([21, 1, 9])
    valid = torch.arange(L)[None, :] < lengths[:, None]
    scores = torch.randn(B, M, L, L, generator=g) * 3
    attn = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), -1)
    attn = attn * valid[:, None, :, None]  # padded rows 0 as well
    got = torch.ops.attnkit.js_distances(attn, lengths)
    want = reference_js_distances(attn, lengths)
    assert got.dtype == torch.float64 and got.shape == (M, M)
    torch.testing.assert_close(got, want, atol=1e-5 * L, rtol=1e-5)
    assert torch.all(got.diagonal() == 0)
    i, j = 1, 3
    by_scipy = sum(
        spatial.jensenshannon(attn[b, i, s].double().numpy(), attn[b, j, s].double().numpy()) ** 2
        for b in range(B) for s in range(int(lengths[b]))
    )
    np.testing.assert_allclose(got[i, j].item(), by_scipy, rtol=1e-5)
    # ops.js_distances wrapper and a larger random case
    attn2 = torch.softmax(torch.randn(2, 7, 40, 40, generator=g), -1)
    torch.testing.assert_close(ops.js_distances(attn2, torch.tensor([40, 40])),
                               reference_js_distances(attn2, torch.tensor([40, 40])), atol=1e-4, rtol=1e-5)


# --- the model level: transformers with attn_implementation="attnkit" and attnkit.extract ----------------
def test_hf_model_fused_equals_eager_with_padding(minilm, minilm_eager):

    import attnkit

    from .synthetic import CallCounter

    model, tok = minilm
    batch = tok(["A short one.", "A much longer sentence, with commas, and a period at the end."],
                ["Pair text.", "Second."], padding=True, return_tensors="pt")
    eager = minilm_eager
    rt = attnkit.models.runtime_of(model)
    rt.backend = "fused"
    try:
        with torch.inference_mode(), rt.attached(CallCounter()) as counter:
            a = model(**batch).last_hidden_state
            b = eager(**batch).last_hidden_state
    finally:
        rt.backend = "auto"
    m = batch["attention_mask"].bool()
    assert counter.calls > 0
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)


def test_extract_fused_equals_reference(minilm):
    import attnkit

    texts = ["The cat sat on the mat.", ("Is it raining?", "No, it is sunny today."), "One, two, three."]
    fa = attnkit.extract(texts, minilm, backend="fused", batch_size=2)
    fr = attnkit.extract(texts, minilm, backend="reference", batch_size=2)
    np.testing.assert_allclose(fa.mean, fr.mean, atol=1e-5, rtol=0)
    np.testing.assert_allclose(fa.std, fr.std, atol=1e-5, rtol=0)


# --- argument checks, autograd of the features, numerics policy (issues 10 and 12) ----------------------

def test_codes_lengths_and_scalars_are_range_checked():
    q, k, v, lengths, tc, sid = make_inputs(2, 2, 8, 32)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cases = [
        (dict(mode=i32(0, 3)), "mode codes must be 0, 1 or 2, got 3"),
        (dict(mode=i32(-1, 0)), "mode codes"),
        (dict(region=i32(0, 7)), "region codes must be 0, 1 or 2, got 7"),
        (dict(num_windows=0), "num_windows must be >= 1"),
        (dict(scaling=float("inf")), "scaling must be a finite number"),
        (dict(scaling=float("nan")), "scaling must be a finite number"),
    ]
    for kw, match in cases:
        with pytest.raises(RuntimeError, match=match):
            fused(q, k, v, lengths, tc, sid, **kw)
    for bad in ([0, 8], [8, 9], [-1, 8]):
        with pytest.raises(RuntimeError, match=r"lengths must lie in \[1, L\]"):
            fused(q, k, v, torch.tensor(bad), tc, sid)
    tc_bad = tc.clone()
    tc_bad[1, 2] = 5
    with pytest.raises(RuntimeError, match=r"token_class codes must be 0..4, got 5 at \[1, 2\]"):
        fused(q, k, v, torch.tensor([8, 8]), tc_bad, sid)
    with pytest.raises(RuntimeError, match="head dim"):
        fused(q[..., :0], k[..., :0], v[..., :0], lengths, tc, sid, scaling=1.0)


def test_attention_wrapper_raises_attnkit_error():
    from attnkit.errors import AttnkitError

    q, k, v, lengths, tc, sid = make_inputs(2, 2, 8, 32)
    with pytest.raises(AttnkitError, match="mode codes"):
        ops.attention(q, k, v, lengths, tc, sid, mode=torch.tensor([0, 9]), backend="fused")
    with pytest.raises(AttnkitError, match="lengths must lie in"):
        ops.attention(q, k, v, torch.tensor([0, 8]), tc, sid, backend="fused")
    with pytest.raises(AttnkitError, match="scaling must be a finite number"):
        ops.attention(q, k, v, lengths, tc, sid, scaling=float("nan"), backend="fused")
    # the reference refuses the same arguments
    with pytest.raises(AttnkitError, match="mode codes"):
        ops.attention(q, k, v, lengths, tc, sid, mode=torch.tensor([0, 9]), backend="reference")
    with pytest.raises(AttnkitError, match="lengths must lie in"):
        ops.attention(q, k, v, torch.tensor([0, 8]), tc, sid, backend="reference")


def test_features_output_is_not_differentiable():
    q, k, v, lengths, tc, sid = make_inputs(2, 2, 8, 32, seed=4)
    q = q.detach().requires_grad_()
    out, feats = fused(q, k, v, lengths, tc, sid)
    assert out.grad_fn is not None
    assert feats.grad_fn is None and not feats.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        feats.sum().backward()
    out.sum().backward()  # the output still differentiates
    assert q.grad is not None and q.grad.abs().sum() > 0


def _same_nan_pattern_and_values(a, b, atol):
    assert torch.equal(a.isnan(), b.isnan()), "NaN positions differ"
    torch.testing.assert_close(a.nan_to_num(0.0), b.nan_to_num(0.0), atol=atol, rtol=0)


@pytest.mark.parametrize("renormalize", [False, True])
def test_non_finite_inputs_propagate_nan_like_the_reference(renormalize):
    B, H, L = 3, 4, 20
    q, k, v, lengths, tc, sid = make_inputs(B, H, L, 32, seed=12, lengths=[20, 11, 20])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q[0, 0, 3, 5] = float("nan")  # sample 0, head 0: row 3 undefined
    k[1, 1, 4, 0] = float("inf")  # sample 1, head 1: rows with q[..., 0] > 0 score +inf on key 4
    q[2, 2, 15:, :] = float("nan")  # sample 2 (n = 20), head 2: rows 15.. undefined
    v[2, 3, 7, 1] = float("nan")  # sample 2, head 3: NaN in v reaches the output, not the features
    q[1, 0, 15, :] = float("nan")  # sample 1, head 0: a padded query row (n = 11): no effect on features
    k[1, 3, 12:, :] = float("inf")  # sample 1, head 3: garbage in padded keys is ignored
    v[1, 3, 12:, :] = float("nan")
    mode = torch.tensor([0, 0, 0, 0], dtype=torch.int32)
    region = torch.tensor([1, 0, 2, 0], dtype=torch.int32)
    out, feats = fused(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize)
    ref_out, ref_feats = ref(q, k, v, lengths, tc, sid, mode=mode, region=region, renormalize=renormalize,
                             want_features=True)
    _same_nan_pattern_and_values(out, ref_out, 2e-6)
    _same_nan_pattern_and_values(feats, ref_feats, 1e-5)
    # what the policy says, spelled out on the fused result
    assert out[0, 3, 0].isnan().all() and not out[0, :3, 0].isnan().any() and not out[0, 4:, 0].isnan().any()
    assert feats[0, 0].isnan().all() and not feats[0, 1:].isnan().any()
    plus_inf_rows = q[1, 1, :, 0] > 0  # a −inf score (q[..., 0] < 0) only gives key 4 weight 0
    assert plus_inf_rows[:11].any() and not plus_inf_rows.all()
    assert torch.equal(out[1, :, 1].isnan().all(-1), plus_inf_rows) and not out[1, :, 1][~plus_inf_rows].isnan().any()
    assert feats[1, 1].isnan().all()
    assert feats[2, 2].isnan().all() and out[2, 15:, 2].isnan().all() and not out[2, :15, 2].isnan().any()
    assert out[2, :, 3].isnan().any() and not feats[2, 3].isnan().any()
    assert out[1, 15, 0].isnan().all() and not out[1, :11, 0].isnan().any() and not feats[1, 0].isnan().any()
    assert not out[1, :, 3].isnan().any() and not feats[1, 3].isnan().any()


def test_zero_and_uniform_heads_ignore_non_finite_scores():
    q, k, v, lengths, tc, sid = make_inputs(1, 2, 10, 32, seed=13, lengths=[10], transposed=False)
    q[0, :, 2, 0] = float("nan")
    v[0, 0, 5, 0] = float("nan")  # head 0 is zeroed: its output is exactly 0 anyway
    mode = torch.tensor([1, 2], dtype=torch.int32)
    out, feats = fused(q, k, v, lengths, tc, sid, mode=mode)
    ref_out, ref_feats = ref(q, k, v, lengths, tc, sid, mode=mode, want_features=True)
    assert (out[:, :, 0] == 0).all() and (ref_out[:, :, 0] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(feats).all()
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(feats, ref_feats, atol=1e-5, rtol=0)


def test_scaling_zero_keeps_nan_scores_nan():
    q, k, v, lengths, tc, sid = make_inputs(1, 1, 6, 32, seed=14, lengths=[6], transposed=False)
    k[0, 0, 2, 0] = float("inf")  # inf · 0 = NaN: the rows are undefined, even though BLAS skips alpha = 0
    out, feats = fused(q, k, v, lengths, tc, sid, scaling=0.0)
    ref_out, ref_feats = ref(q, k, v, lengths, tc, sid, scaling=0.0, want_features=True)
    assert out.isnan().all() and ref_out.isnan().all()
    assert feats.isnan().all() and ref_feats.isnan().all()


def test_sentence_ids_compare_as_integers():
    # 2^24 and 2^24 + 1 are the same float32: compared as floats they would be one sentence
    q, k, v, lengths, tc, _ = make_inputs(2, 3, 12, 32, seed=15, lengths=[12, 9])
    small = torch.zeros(2, 12, dtype=torch.int32)
    small[:, 6:] = 1
    big = small + 2**24
    huge = torch.where(small == 0, torch.full_like(small, -(2**31)), torch.full_like(small, 2**31 - 1))
    region = torch.tensor([0, 1, 2], dtype=torch.int32)
    base = fused(q, k, v, lengths, tc, small, region=region)
    for ids in (big, huge):
        got = fused(q, k, v, lengths, tc, ids, region=region)
        torch.testing.assert_close(got[0], base[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], base[1], atol=0, rtol=0)
        ref_out, ref_feats = ref(q, k, v, lengths, tc, ids, region=region, want_features=True)
        np.testing.assert_allclose(got[1].numpy(), ref_feats.numpy(), atol=1e-5, rtol=0)
    names = __import__("attnkit.features", fromlist=["feature_names"]).feature_names(16)
    inter = base[1][..., names.index("inter")]
    assert (inter[:, 0] > 0.1).all()  # two sentences really are seen


def test_a_row_with_one_minus_inf_score_matches_the_reference():
    """A masked key (score −inf) in a valid row: weight 0 on it, and entropies over the other keys (the fused
    kernel once gave entropy 0 and cls_entropy 0 here)."""
    names = __import__("attnkit.features", fromlist=["feature_names"]).feature_names(16)
    q, k, v, lengths, tc, sid = make_inputs(2, 3, 12, 32, seed=21, lengths=[12, 9], transposed=False)
    q[..., 0] = 1.0
    k[:, :, 4, 0] = float("-inf")  # every row of every head scores −inf on key 4, finite elsewhere
    out, feats = fused(q, k, v, lengths, tc, sid)
    ref_out, ref_feats = ref(q, k, v, lengths, tc, sid, want_features=True)
    assert torch.isfinite(out).all() and torch.isfinite(feats).all()
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(feats, ref_feats, atol=1e-5, rtol=0)
    for name in ("entropy", "cls_entropy"):
        assert (feats[..., names.index(name)] > 0.5).all()


def test_the_wrapper_refuses_what_the_reference_refuses_on_every_backend():
    """Head dim 0 (was a ZeroDivisionError before the fused op), float lengths (rounded by the fused op, refused by
    the reference), float codes: one message, whichever backend."""
    q, k, v, lengths, tc, sid = make_inputs(2, 2, 8, 32)
    q0 = torch.zeros(2, 2, 8, 0)
    cases = [((q0, q0, q0, lengths), {}, r"^head dim \(q.size\(3\)\) must be >= 1, got 0$"),
             ((q, k, v, lengths.float()), {}, r"^lengths must be an integer tensor, got torch.float32$"),
             ((q, k, v, lengths, tc.float()), {}, r"^token_class must be an integer tensor, got torch.float32$"),
             ((q, k, v, lengths), dict(mode=torch.zeros(2)), r"^mode must be an integer tensor, got torch.float32$"),
             ((q, k, v, lengths), dict(key_scale=torch.ones(2, 2, 8, dtype=torch.int64)),
              r"^key_scale must be a floating-point tensor, got torch.int64$"),
             # once a TypeError-like message from the compiled op, and an OverflowError from the reference
             ((q, k, v, lengths), dict(num_windows=10**20), r"^num_windows must be at most 1024, got 10{20}$"),
             ((q, k, v, lengths), dict(num_windows=1025), r"^num_windows must be at most 1024, got 1025$")]
    for args, kw, message in cases:
        for backend in ("fused", "reference"):
            with pytest.raises(AttnkitError, match=message):
                ops.attention(*args, want_features=True, backend=backend, **kw)
