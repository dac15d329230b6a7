"""Fewer queries than keys (a step of generation with a KV cache; attnkit/reference.py, "Fewer queries than keys"):
the Lq query rows are the last Lq key positions. Against an independent eager implementation over all L rows
(tests/test_decoder_reference.py: an explicit mask, a plain softmax), whose last Lq rows they must equal — outputs,
weights, interventions — and features counted from its maps over those rows only (tests/synthetic.py,
features_from_maps with first_row). Then the dispatch (attnkit.ops.attention), the argument checks and the fake
kernel's shapes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import CLS, COMMA, OTHER, SEP
from attnkit.reference import attention_weights, reference_attention

from .synthetic import features_from_maps
from .test_decoder_reference import eager

B, H, HKV, L, D, NW = 3, 4, 2, 9, 8, 4


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g) * 1.5
    k = torch.randn(B, HKV, L, D, generator=g)
    v = torch.randn(B, HKV, L, D, generator=g)
    lengths = torch.tensor([9, 7, 4])
    classes = torch.full((B, L), OTHER, dtype=torch.int32)
    classes[:, 0] = CLS
    classes[0, 5], classes[1, 3], classes[0, 8] = SEP, COMMA, CLS
    sid = (torch.arange(L)[None] >= torch.tensor([5, 3, 9])[:, None]).int()
    return q, k, v, lengths, classes, sid


DECODER = [dict(causal=True), dict(causal=True, sliding_window=3), dict(causal=True, softcap=2.0),
           dict(causal=True, sink=torch.tensor([0.5, -1.0, 2.0, 0.0])), dict(causal=False)]


@pytest.mark.parametrize("dec", DECODER, ids=["causal", "window", "softcap", "sink", "bidirectional"])
@pytest.mark.parametrize("Lq", [1, 3, 6])
def test_the_last_rows_equal_those_of_the_full_forward_and_features_count_them(dec, Lq):
    q, k, v, lengths, classes, sid = tensors()
    o = L - Lq
    window = dec.get("sliding_window")
    want_out, p = eager(q, k, v, lengths, causal=dec["causal"], window=window, softcap=dec.get("softcap"),
                        sink=dec.get("sink"))
    out, feats = reference_attention(q[:, :, o:], k, v, lengths, classes, sid, want_features=True, num_windows=NW,
                                     **dec)
    assert out.shape == (B, Lq, H, D)
    valid = (torch.arange(o, L)[None] < lengths[:, None])  # B × Lq: rows s < n
    torch.testing.assert_close(out[valid].double(), want_out[:, o:][valid], atol=2e-5, rtol=1e-5)
    w = attention_weights(q[:, :, o:], k, lengths, D**-0.5, **dec)
    torch.testing.assert_close(w.double().transpose(1, 2)[valid], p[:, :, o:].transpose(1, 2)[valid],
                               atol=2e-6, rtol=1e-5)
    maps = [p.numpy()]
    want = features_from_maps(maps, lengths.tolist(), classes.numpy(), sid.numpy(), NW, sink="sink" in dec,
                              first_row=o)[:, 0]
    np.testing.assert_allclose(feats.numpy(), want, atol=2e-5)
    # sample 2 (4 tokens) has no row among the last 3 or fewer: features 0, not NaN
    if o >= 4:
        assert float(feats[2].abs().max()) == 0.0


def test_interventions_on_the_last_rows():
    from attnkit.features import KEEP, NO_INTER, NO_INTRA, UNIFORM, ZERO

    q, k, v, lengths, classes, sid = tensors(1)
    mode = torch.tensor([UNIFORM, ZERO, KEEP, KEEP], dtype=torch.int32)
    region = torch.tensor([0, 0, NO_INTRA, NO_INTER], dtype=torch.int32)
    gates = torch.tensor([0.5, 1.0, 2.0, 1.5])
    kw = dict(mode=mode, region=region, renormalize=True, gates=gates, causal=True, sliding_window=6)
    full, full_f = reference_attention(q, k, v, lengths, classes, sid, want_features=True, num_windows=NW, **kw)
    for Lq in (1, 2, 5):
        o = L - Lq
        out, _ = reference_attention(q[:, :, o:], k, v, lengths, classes, sid, num_windows=NW, **kw)
        valid = torch.arange(o, L)[None] < lengths[:, None]
        torch.testing.assert_close(out[valid], full[:, o:][valid], atol=1e-6, rtol=1e-5)
    # uniform: 1/m over the m keys the last row sees (a window of 6 at position 8 of sample 0: keys 3..8)
    w = attention_weights(q[:, :, L - 1:], k, lengths, D**-0.5, sid, mode, None, False, causal=True, sliding_window=6)
    torch.testing.assert_close(w[0, 0, 0], (torch.arange(L) >= 3).float() / 6)
    # all rows from position 0 on are the full forward: its features exactly
    _, f = reference_attention(q, k, v, lengths, classes, sid, want_features=True, num_windows=NW, **kw)
    torch.testing.assert_close(f, full_f)


def test_the_dispatch_runs_fewer_queries_on_a_kernel_that_takes_them_else_on_the_reference(monkeypatch):
    q, k, v, lengths, classes, sid = tensors(2)
    want = reference_attention(q[:, :, -1:], k, v, lengths, classes, sid, want_features=True, causal=True)
    got = ops.attention(q[:, :, -1:], k, v, lengths, classes, sid, want_features=True, causal=True, backend="auto")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    # a plain step (no features, no intervention: ops.plain_step, one call of sdpa) equals the reference too
    for dec in DECODER[:2] + DECODER[4:]:
        for Lq, n in ((1, lengths), (4, lengths), (1, torch.full((B,), L))):  # the last: every key seen, no mask
            want = reference_attention(q[:, :, -Lq:], k, v, n, **dec)[0]
            got = ops.attention(q[:, :, -Lq:], k, v, n, backend="auto", **dec)[0]
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # a padded row outside a window sees no key: 0, as the reference says
    short = torch.tensor([2, 7, 4])
    got = ops.plain_step(q[:, :, -1:], k, v, short, D**-0.5, True, 3)[0]
    assert float(got[0].abs().max()) == 0.0
    torch.testing.assert_close(got, reference_attention(q[:, :, -1:], k, v, short, causal=True, sliding_window=3)[0])
    if not ops.has_kernel("cpu") or ops.fused_fewer_queries("cpu"):
        return
    with pytest.raises(AttnkitError, match="the cpu kernel does not take fewer queries than keys \\(1 queries, 9 "
                                           "keys: a KV-cache step\\)"):
        ops.attention(q[:, :, -1:], k, v, lengths, causal=True, backend="fused")
    # a CPU kernel that says it takes them gets them
    calls = []
    monkeypatch.setattr(ops, "_CPU_FEWER_QUERIES", True)

    def fake_op(q, *args):
        calls.append(q.shape)
        return want

    monkeypatch.setattr(torch.ops.attnkit, "fused_attention", fake_op, raising=False)
    ops.attention(q[:, :, -1:], k, v, lengths, classes, sid, want_features=True, causal=True, backend="auto")
    assert calls == [(B, H, 1, D)]
    assert not ops.fused_fewer_queries("cuda")


def test_arguments_are_checked_over_the_keys():
    q, k, v, lengths, classes, sid = tensors()
    with pytest.raises(AttnkitError, match="L >= q's 9 rows"):
        reference_attention(q, k[:, :, :5], v[:, :, :5], lengths.clamp(max=5))
    with pytest.raises(AttnkitError, match="lengths must lie in \\[1, L\\] = \\[1, 9\\]"):
        reference_attention(q[:, :, -2:], k, v, torch.tensor([9, 10, 4]))
    with pytest.raises(AttnkitError, match="sentence_id must have shape \\[3, 9\\]"):
        reference_attention(q[:, :, -2:], k, v, lengths, None, sid[:, -2:])
    with pytest.raises(AttnkitError, match="token_class must have shape \\[3, 9\\]"):
        reference_attention(q[:, :, -2:], k, v, lengths, classes[:, -2:])


@pytest.mark.skipif(not ops.extension_loaded(), reason="the compiled extension's op has the fake kernel")
def test_the_fake_kernel_gives_one_output_row_per_query():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, lengths, classes, sid = tensors()
    q2 = q[:, :, -2:].contiguous()
    mode = FakeTensorMode()
    fq, fk, fv, fl = (mode.from_tensor(t) for t in (q2, k, v, lengths))
    with mode:
        out, feats = torch.ops.attnkit.fused_attention(fq, fk, fv, fl, None, None, 0.35, NW, None, None, False, None,
                                                       True)
    assert tuple(out.shape) == (B, 2, H, D) and tuple(feats.shape) == (B, H, 5 + NW + 7)
