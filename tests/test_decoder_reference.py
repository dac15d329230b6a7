"""The decoder arguments of the executable spec (attnkit/reference.py; docs/features.md, section 8): kv_head,
causal, sliding_window, softcap and sink, against an independent eager implementation (an explicit L×L mask, a
plain softmax, repeat_interleave for grouped K/V) and features counted key by key in plain Python loops."""
from __future__ import annotations

import math

import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import ALL, CLS, KEEP, NO_INTER, NO_INTRA, OTHER, SEP, UNIFORM, ZERO, feature_names
from attnkit.reference import attention_weights, reference_attention

N = 4


def eager(q, k, v, lengths, *, kv_head=None, causal=False, window=None, softcap=None, sink=None, scaling=None):
    """Independent: GQA by repeat_interleave (kv_head sorted), the mask as an explicit L×L bool tensor, the
    sink as an extra softmax column that is dropped afterwards (transformers' gpt-oss eager attention)."""
    B, H, L, D = q.shape
    scaling = D**-0.5 if scaling is None else scaling
    if k.shape[1] != H:
        counts = torch.bincount(kv_head.long(), minlength=k.shape[1]) if kv_head is not None else None
        reps = counts if counts is not None else H // k.shape[1]
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = torch.zeros(B, 1, L, L, dtype=torch.bool)
    for b in range(B):
        for i in range(L):
            for j in range(L):
                mask[b, 0, i, j] = (j < lengths[b] and (not causal or j <= i)
                                    and (window is None or i - j < window))
    s = s.masked_fill(~mask, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    p = torch.softmax(s, -1)[..., :L]
    p = torch.nan_to_num(p)  # a padded row that sees no key
    vv = v.double().masked_fill(~(torch.arange(L)[None, :] < lengths[:, None])[:, None, :, None], 0.0)
    return (p @ vv).transpose(1, 2), p


def loop_features(p, lengths, classes, sid, nwin, sink_mass=None):
    """docs/features.md by hand: per row s < n, every key t < n, the definitions as written."""
    B, H, L, _ = p.shape
    F = len(feature_names(nwin, sink=sink_mass is not None))
    out = torch.zeros(B, H, F, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for h in range(H):
            acc = [0.0] * F
            cls_rows, cls_ent = 0, 0.0
            for s in range(n):
                row = [float(p[b, h, s, t]) for t in range(n)]
                for t, w in enumerate(row):
                    c = int(classes[b, t])
                    if c != OTHER:
                        acc[c - 1] += w
                    elif t == s:
                        acc[4] += w
                    else:
                        acc[5 + abs(s - t) * nwin // n] += w
                R = 5 + nwin
                acc[R] += row[s - 1] if s > 0 else 0.0
                acc[R + 1] += row[s + 1] if s + 1 < n else 0.0
                ent = -sum(w * math.log(w) for w in row if w > 0)
                acc[R + 2] += ent
                acc[R + 3] += max(row)
                acc[R + 4] += sum(w for t, w in enumerate(row) if sid[b, t] == sid[b, s])
                acc[R + 5] += sum(w for t, w in enumerate(row) if sid[b, t] != sid[b, s])
                if sink_mass is not None:
                    acc[-1] += float(sink_mass[b, h, s])
                if int(classes[b, s]) == CLS:
                    cls_rows += 1
                    cls_ent += ent
            vals = [a / n for a in acc]
            vals[5 + nwin + 6] = cls_ent / max(cls_rows, 1)
            out[b, h] = torch.tensor(vals, dtype=torch.float64)
    return out


def _inputs(B=2, H=6, Hkv=3, L=9, D=4, seed=0, lengths=(9, 6)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g)
    k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    classes = torch.zeros(B, L, dtype=torch.int32)
    classes[:, 0] = CLS
    classes[0, 4] = SEP
    classes[-1, 2] = 3  # comma
    sid = torch.zeros(B, L, dtype=torch.int32)
    sid[:, 5:] = 1
    return q, k, v, torch.tensor(lengths[:B]), classes, sid


CASES = [
    dict(causal=True),
    dict(causal=True, kv_head=[0, 0, 0, 1, 2, 2]),  # uneven groups (a pruned layer)
    dict(kv_head=None, causal=True),  # even groups by default: h // (H // Hkv)
    dict(causal=True, window=3),
    dict(causal=True, window=1),  # every row sees itself only
    dict(causal=True, window=20),  # larger than L: no effect
    dict(causal=False, window=3),  # one-sided: only the keys before s are limited
    dict(causal=True, softcap=1.5),
    dict(causal=True, sink=[0.5, -1.0, 2.0, 0.0, -3.0, 1.0]),
    dict(causal=True, kv_head=[2, 2, 1, 0, 0, 1], window=4, softcap=2.0, sink=[0.5, -1.0, 2.0, 0.0, -3.0, 1.0]),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_eager_and_loop_features(case):
    q, k, v, lengths, classes, sid = _inputs(seed=len(str(case)))
    kv_head = None if case.get("kv_head") is None else torch.tensor(case["kv_head"], dtype=torch.int32)
    sink = None if case.get("sink") is None else torch.tensor(case["sink"])
    kw = dict(kv_head=kv_head, causal=case.get("causal", False), sliding_window=case.get("window"),
              softcap=case.get("softcap"), sink=sink)
    out, feats = reference_attention(q, k, v, lengths, classes, sid, num_windows=N, want_features=True, **kw)
    if kv_head is not None and (kv_head.diff() < 0).any():  # eager's repeat_interleave wants sorted groups
        order = torch.argsort(kv_head, stable=True)
        inv = torch.argsort(order)
        e_out, p = eager(q[:, order], k, v, lengths, kv_head=kv_head[order], causal=kw["causal"],
                         window=kw["sliding_window"], softcap=kw["softcap"], sink=None if sink is None else sink[order])
        e_out, p = e_out[:, :, inv], p[:, inv]
    else:
        e_out, p = eager(q, k, v, lengths, kv_head=kv_head, causal=kw["causal"], window=kw["sliding_window"],
                         softcap=kw["softcap"], sink=sink)
    torch.testing.assert_close(out.double(), e_out, atol=1e-5, rtol=1e-5)
    maps = attention_weights(q, k, lengths, q.shape[-1] ** -0.5, sentence_id=sid, **kw)
    torch.testing.assert_close(maps.double(), p, atol=1e-6, rtol=1e-5)
    sink_mass = None if sink is None else 1 - p.sum(-1)
    want = loop_features(p, lengths, classes, sid, N, sink_mass)
    torch.testing.assert_close(feats.double(), want, atol=1e-5, rtol=1e-5)
    # the 5 + N buckets (plus the sink) sum to 1 for every sample and head
    total = feats[..., :5 + N].sum(-1) + (feats[..., -1] if sink is not None else 0)
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)
    if kw["causal"]:
        assert (feats[..., 5 + N + 1] == 0).all()  # next = 0: a causal row never sees s + 1


def test_causal_row_zero_sees_itself_and_features_by_hand():
    """n = 3, causal, all scores equal: row 0 sees {0}, row 1 {0, 1}, row 2 {0, 1, 2}."""
    q = torch.zeros(1, 1, 3, 2)
    k = torch.zeros(1, 1, 3, 2)
    v = torch.arange(6, dtype=torch.float32).view(1, 1, 3, 2)
    classes = torch.tensor([[CLS, OTHER, OTHER]], dtype=torch.int32)
    out, f = reference_attention(q, k, v, torch.tensor([3]), classes, causal=True, want_features=True,
                                 num_windows=2)
    w = attention_weights(q, k, torch.tensor([3]), 1.0, causal=True)[0, 0]
    torch.testing.assert_close(w, torch.tensor([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]]))
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])  # row 0: its own value
    got = dict(zip(feature_names(2), f[0, 0].tolist()))
    # cls: (1 + 1/2 + 1/3) / 3; self: (0 + 1/2 + 1/3) / 3 (row 0's self is the CLS key);
    # win_0 (d·2/3 < 1: d = 1): row 2's key 1 → (1/3) / 3; prev: (0 + 1/2 + 1/3) / 3
    assert got["cls"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert got["self"] == pytest.approx((1 / 2 + 1 / 3) / 3)
    assert got["win_0"] == pytest.approx((1 / 3) / 3)
    assert got["win_1"] == pytest.approx(0.0)
    assert got["prev"] == pytest.approx((1 / 2 + 1 / 3) / 3)
    assert got["next"] == 0.0
    assert got["entropy"] == pytest.approx((0 + math.log(2) + math.log(3)) / 3)
    assert got["max"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert got["cls_entropy"] == 0.0  # the CLS row (row 0) sees one key
    # a sink logit equal to the scores (0): rows put 1/2, 1/3, 1/4 on the sink and on each key they see
    _, fs = reference_attention(q, k, v, torch.tensor([3]), classes, causal=True, want_features=True,
                                num_windows=2, sink=torch.zeros(1))
    got = dict(zip(feature_names(2, sink=True), fs[0, 0].tolist()))
    assert got["sink"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)
    assert got["cls"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)
    assert sum(got[n] for n in ["cls", "self", "win_0", "win_1", "sink"]) == pytest.approx(1.0)


def test_interventions_on_causal_rows():
    q, k, v, lengths, classes, sid = _inputs(H=4, Hkv=4, L=6, lengths=(6, 4))
    sink = torch.tensor([1.0, 0.0, -1.0, 2.0])
    mode = torch.tensor([KEEP, UNIFORM, ZERO, KEEP], dtype=torch.int32)
    region = torch.tensor([NO_INTRA, ALL, ALL, NO_INTER], dtype=torch.int32)
    w = attention_weights(q, k, lengths, 0.5, sentence_id=sid, mode=mode, causal=True)
    # uniform: 1/(s+1) on each key t <= s; zero: nothing
    expect = torch.tril(torch.ones(6, 6)) / torch.arange(1, 7)[:, None]
    torch.testing.assert_close(w[0, 1], expect)
    assert (w[:, 2] == 0).all()
    _, f = reference_attention(q, k, v, lengths, classes, sid, num_windows=N, mode=mode, want_features=True,
                               causal=True, sink=sink)
    assert (f[:, 1, -1] == 0).all() and (f[:, 2] == 0).all()  # uniform and zero heads: no sink mass
    # regions keep the sink; renormalize rescales the kept keys with the sink to 1
    w_k, s_k = _weights_and_sink(q, k, lengths, sid, region, sink, renormalize=False)
    w_r, s_r = _weights_and_sink(q, k, lengths, sid, region, sink, renormalize=True)
    total = w_r.sum(-1) + s_r
    torch.testing.assert_close(total, torch.ones_like(total))
    torch.testing.assert_close(w_r * (w_k.sum(-1) + s_k)[..., None], w_k)
    _, f_r = reference_attention(q, k, v, lengths, classes, sid, num_windows=N, region=region, renormalize=True,
                                 want_features=True, causal=True, sink=sink)
    sums = f_r[..., :5 + N].sum(-1) + f_r[..., -1]
    torch.testing.assert_close(sums, torch.ones_like(sums))
    # a causal row 0 whose only key is dropped by no_intra keeps just its sink: 1 after renormalising
    assert s_r[0, 0, 0] == pytest.approx(1.0)


def _weights_and_sink(q, k, lengths, sid, region, sink, renormalize):
    return attention_weights(q, k, lengths, 0.5, sid, None, region, renormalize, causal=True, sink=sink,
                             return_sink=True)


def test_gates_key_scale_and_sink_under_norm_weighting():
    q, k, v, lengths, classes, sid = _inputs(H=2, Hkv=1, L=5, lengths=(5, 3))
    g = torch.rand(2, 2, 5) + 0.5
    sink = torch.tensor([0.3, 1.2])
    out, f = reference_attention(q, k, v, lengths, classes, sid, num_windows=N, want_features=True, causal=True,
                                 sink=sink, key_scale=g, gates=torch.tensor([2.0, 0.5]))
    out1, _ = reference_attention(q, k, v, lengths, causal=True, sink=sink)
    torch.testing.assert_close(out, out1 * torch.tensor([2.0, 0.5]).view(1, 1, 2, 1))
    assert (f[..., -1] == 0).all()  # the sink adds no value: weight 0 under norm weighting
    total = f[..., :5 + N].sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total))


def test_padded_row_outside_the_window_is_zero_not_nan():
    q, k, v, _, _, _ = _inputs(B=1, H=2, Hkv=2, L=8)
    out, f = reference_attention(q, k, v, torch.tensor([2]), causal=True, sliding_window=3, want_features=True)
    assert torch.isfinite(out).all() and torch.isfinite(f).all()
    assert (out[0, 5:] == 0).all()  # rows 5..7 see keys > s − 3 ≥ 3: none valid
    assert (out[0, 2:5] != 0).any(-1).any()  # row 2 still sees key 1


def test_nan_at_keys_a_row_does_not_see_is_never_read_into_features():
    q, k, v, lengths, classes, sid = _inputs(B=1, H=2, Hkv=2, L=6, lengths=(6,))
    k[0, :, 4] = float("nan")  # seen by rows 4 and 5 only
    out, f = reference_attention(q, k, v, lengths, causal=True, sliding_window=2, want_features=True)
    assert torch.isfinite(out[0, :4]).all() and out[0, 4:].isnan().all()
    assert f.isnan().all()  # rows 4, 5 are valid rows with an undefined softmax: NaN policy
    _, f2 = reference_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], torch.tensor([4]), causal=True,
                                want_features=True)
    assert torch.isfinite(f2).all()


def test_sink_gradient_and_softcap_gradient_flow():
    q, k, v, lengths, _, _ = _inputs(H=2, Hkv=1, L=5, lengths=(5, 2))
    sink = torch.tensor([0.2, -0.4], requires_grad=True)
    out, _ = reference_attention(q, k, v, lengths, causal=True, softcap=3.0, sink=sink)
    out.sum().backward()
    assert sink.grad is not None and (sink.grad != 0).all()


@pytest.mark.parametrize("kw,match", [
    (dict(kv_head=torch.tensor([0, 1, 2])), r"kv_head must have shape \[6\]"),
    (dict(kv_head=torch.tensor([0.0] * 6)), "kv_head must be an integer tensor"),
    (dict(kv_head=torch.tensor([0, 0, 1, 1, 2, 3])), r"kv_head must lie in \[0, Hkv\) = \[0, 3\), got 3 at head 5"),
    (dict(kv_head=torch.tensor([0, 0, 1, 1, -1, 2])), r"got -1 at head 4"),
    (dict(sliding_window=0), "sliding_window must be an integer >= 1"),
    (dict(sliding_window=2.5), "sliding_window must be an integer >= 1"),
    (dict(softcap=0.0), "softcap must be a finite number > 0"),
    (dict(softcap=float("inf")), "softcap must be a finite number > 0"),
    (dict(softcap=-1.0), "softcap must be a finite number > 0"),
    (dict(sink=torch.zeros(5)), r"sink must have shape \[6\]"),
    (dict(sink=torch.zeros(6, dtype=torch.int64)), "sink must be a floating-point tensor"),
])
def test_decoder_arguments_are_refused_by_name(kw, match):
    q, k, v, lengths, _, _ = _inputs()
    with pytest.raises(AttnkitError, match=match):
        reference_attention(q, k, v, lengths, **kw)
    with pytest.raises(AttnkitError, match=match):
        ops.attention(q, k, v, lengths, **kw)


def test_kv_heads_that_do_not_divide_need_kv_head():
    q, k, v, lengths, _, _ = _inputs(H=6, Hkv=4)
    with pytest.raises(AttnkitError, match="k and v have 4 heads and q 6: give kv_head"):
        reference_attention(q, k, v, lengths)
    reference_attention(q, k, v, lengths, kv_head=torch.tensor([0, 1, 2, 3, 3, 3]))
    with pytest.raises(AttnkitError, match="k and v must have q's shape"):
        reference_attention(q, k[:, :, :5], v[:, :, :5], lengths)


def test_auto_backend_runs_decoder_calls_on_the_reference_when_the_build_lacks_them(monkeypatch, caplog):
    q, k, v, lengths, classes, sid = _inputs()
    kw = dict(causal=True, sink=torch.ones(6), kv_head=torch.tensor([0, 0, 1, 1, 2, 2]))
    want = reference_attention(q, k, v, lengths, classes, sid, want_features=True, **kw)
    monkeypatch.setattr(ops, "_FUSED_DECODER", False)
    got = ops.attention(q, k, v, lengths, classes, sid, want_features=True, **kw)
    torch.testing.assert_close(got, want)
    assert "reference" not in caplog.text
    if ops.has_kernel("cpu"):
        with pytest.raises(AttnkitError, match="does not take kv_head, causal, sink"):
            ops.attention(q, k, v, lengths, backend="fused", **kw)
