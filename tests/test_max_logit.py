"""Each head's max logit (docs/features.md §9) over the rows a call really has, against a few lines of plain torch
that know nothing of attnkit: a KV-cache step's query rows sit at their true positions Lk − Lq + i (attnkit/reference.py,
"Fewer queries than keys"), the max is over the keys each valid row sees (its causal and sliding-window keys),
taken before the soft-cap, and a sample with no valid row has max logit −inf. Every path agrees: the reference
(`attnkit.reference.max_logits`), the blocked pass (`attnkit.kernels.statistics.max_logits`, which
`attnkit.ops.attention` runs on the reference backend), the fused CPU op's own measure and the fake kernel's shapes."""
from __future__ import annotations

import pytest
import torch

from attnkit import ops, reference
from attnkit.kernels import statistics

B, H, LK, D, SCALE = 3, 4, 11, 8, 0.4
GQA = torch.tensor([0, 0, 1, 1], dtype=torch.int32)


def independent(q, k, key_ok, scaling, kv, causal, window):
    """B×H float64: the largest q_s·k_t·scaling over the query rows s at a token (key_ok[b, s]) and the keys t at a
    token that row sees. q holds the last Lq positions of the Lk keys; no row at a token: −inf."""
    Bq, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    s = torch.arange(Lk - Lq, Lk)[:, None]  # each query row's position
    t = torch.arange(Lk)[None, :]
    sees = key_ok[:, None, :] & key_ok[:, Lk - Lq:, None]  # B×Lq×Lk
    if causal:
        sees = sees & (t <= s)
    if window is not None:
        sees = sees & (s - t < window)
    out = torch.full((Bq, Hq), float("-inf"), dtype=torch.float64)
    for b in range(Bq):
        for h in range(Hq):
            scores = q[b, h].double() @ k[b, int(kv[h])].double().T * scaling
            if sees[b].any():
                out[b, h] = scores[sees[b]].max()
    return out


def tensors(seed, hkv=H):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, LK, D, generator=g) * 2
    k = torch.randn(B, hkv, LK, D, generator=g)
    v = torch.randn(B, hkv, LK, D, generator=g)
    return q, k, v


CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, sliding_window=3),
    "window_not_causal": dict(sliding_window=2),
    "softcap": dict(causal=True, softcap=0.5),
    "gqa_window_softcap": dict(causal=True, kv_head=GQA, sliding_window=4, softcap=1.0),
}


def paths(q, k, v, lengths, kw):
    """The max logit of every path for one call."""
    dec = {a: kw[a] for a in ("kv_head", "causal", "sliding_window") if a in kw}
    got = {"reference.max_logits": reference.max_logits(q, k, lengths, SCALE, **dec),
           "statistics.max_logits": statistics.max_logits(q, k, lengths, SCALE, **dec),
           "ops reference": ops.attention(q, k, v, lengths, scaling=SCALE, backend="reference", want_max_logit=True,
                                          **kw)[-1]}
    if ops.has_kernel("cpu"):
        got["ops fused"] = ops.attention(q, k, v, lengths, scaling=SCALE, backend="auto", want_max_logit=True,
                                         **kw)[-1]
    return got


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("Lq", [LK, 3, 1])
def test_right_padding_whole_calls_and_kv_cache_steps(case, Lq, monkeypatch):
    """Right padding (n = 11, 6 and 1): with Lq < Lk the rows past n are padding, and a step whose rows are all
    padding (n = 1, n = 6 with one query) has max logit −inf. Small blocks make the blocked pass take several."""
    monkeypatch.setattr(statistics, "TILE_ELEMENTS", 2 * B * H * LK)
    kw = CASES[case]
    q, k, v = tensors(1, hkv=2 if "kv_head" in kw else H)
    q = q[:, :, LK - Lq:]
    lengths = torch.tensor([LK, 6, 1])
    kv = kw.get("kv_head", torch.arange(H))
    key_ok = torch.arange(LK)[None] < lengths[:, None]
    want = independent(q, k, key_ok, SCALE, kv, kw.get("causal", False), kw.get("sliding_window"))
    if Lq < LK:
        assert want[1:].isneginf().all() if Lq == 1 else want[2].isneginf().all()
    for name, got in paths(q, k, v, lengths, kw).items():
        assert got.shape == (B, H) and got.dtype == torch.float32, name
        assert torch.equal(got.isneginf(), want.isneginf()), name
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-6, msg=name)
    if "softcap" in kw:  # taken before the cap: above it where a score passes c
        assert (want > kw["softcap"]).any()


@pytest.mark.parametrize("case", ["causal", "window", "gqa_window_softcap"])
def test_left_padded_steps_and_one_token_samples(case):
    """Left padding, as generation pads decoders: sample b's n_b tokens are the last n_b keys, and its step sees them
    as a call of the op on its own keys (attnkit/hf_attention.py moves them to the front) — the same max logit as
    positions counted in the padded frame. n = 1: the query sees itself only."""
    kw = CASES[case]
    q, k, v = tensors(2, hkv=2 if "kv_head" in kw else H)
    Lq = 2
    q = q[:, :, LK - Lq:]
    lengths = torch.tensor([LK, 5, 1])
    key_ok = torch.arange(LK)[None] >= (LK - lengths)[:, None]
    kv = kw.get("kv_head", torch.arange(H))
    want = independent(q, k, key_ok, SCALE, kv, kw.get("causal", False), kw.get("sliding_window"))
    for b in range(B):
        n = int(lengths[b])
        rows = min(Lq, n)
        one = (q[b:b + 1, :, Lq - rows:], k[b:b + 1, :, LK - n:], v[b:b + 1, :, LK - n:], lengths[b:b + 1])
        for name, got in paths(*one, kw).items():
            torch.testing.assert_close(got[0].double(), want[b], atol=1e-5, rtol=1e-6, msg=f"{name}, sample {b}")
    assert want[2].isfinite().all()  # n = 1: its own score


@pytest.mark.skipif(not ops.fused_max_logit("cpu"), reason="a build whose CPU op has no max logit")
def test_the_fused_cpu_op_measures_a_kv_cache_step_itself(monkeypatch):
    """A step's max logit comes from the CPU op's own pass (no second q·kᵀ pass), and the fake kernel gives the
    shapes of that call (B×H max logits, B×H×Lq log-sum-exp)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def no_second_pass(*a, **k):
        raise AssertionError("a second q·kᵀ pass although the CPU op measures the max logit")

    q, k, v = tensors(3)
    q = q[:, :, -2:]
    lengths = torch.tensor([LK, 10, 3])
    kw = dict(causal=True, sliding_window=3)
    want = independent(q, k, torch.arange(LK)[None] < lengths[:, None], SCALE, torch.arange(H), True, 3)
    monkeypatch.setattr(statistics, "max_logits", no_second_pass)
    got = ops.attention(q, k, v, lengths, scaling=SCALE, backend="fused", want_max_logit=True, **kw)[-1]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-6)
    mode = FakeTensorMode()
    fq, fk, fv, fl = (mode.from_tensor(t) for t in (q.contiguous(), k, v, lengths))
    with mode:
        out, feats, lse, ml = torch.ops.attnkit.fused_attention_lse(
            fq, fk, fv, fl, None, None, SCALE, 4, None, None, False, None, False, None, None, True, 3, None, None,
            want_max_logit=True)
    assert (tuple(out.shape), tuple(lse.shape), tuple(ml.shape)) == ((B, 2, H, D), (B, H, 2), (B, H))
