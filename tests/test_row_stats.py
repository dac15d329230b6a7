"""`attnkit::row_stats` (docs/analysis.md, "Per-row statistics"): the weight of each query row on a given key and
its arg-max key, for causal, grouped-query, sliding-window, soft-capped and sink attention; the CPU kernel against
the reference, the reference against weights built the plain way."""
import pytest
import torch

from attnkit import AttnkitError
from attnkit.words import op_available, reference_row_stats, row_stats

needs_kernel = pytest.mark.skipif(not op_available("cpu", "attnkit::row_stats"),
                                  reason="the compiled extension has no row_stats kernel")


def _inputs(B=3, H=6, Hkv=2, L=37, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    lengths = torch.tensor([L, L - 5, 9][:B])
    target = torch.randint(-1, L, (B, L), generator=g)
    return q, k, lengths, target


def _plain(q, k, lengths, target, scaling, kv_head, causal, window, softcap, sink):
    """Every weight, row by row, with Python loops over the keys each row sees."""
    B, H, L, _ = q.shape
    mass = torch.zeros(B, H, L, dtype=torch.float64)
    key = torch.full((B, H, L), -1)
    weight = torch.zeros(B, H, L, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for h in range(H):
            kk = k[b, kv_head[h]].double()
            for s in range(n):
                seen = [t for t in range(n) if (not causal or t <= s) and (window is None or s - t < window)]
                x = (kk[seen] @ q[b, h, s].double()) * scaling
                if softcap is not None:
                    x = softcap * torch.tanh(x / softcap)
                z = torch.exp(x).sum() + (torch.exp(sink[h].double()) if sink is not None else 0)
                a = torch.exp(x) / z
                tt = int(target[b, s])
                mass[b, h, s] = a[seen.index(tt)] if tt in seen else 0.0
                key[b, h, s] = seen[int(torch.argmax(a))]
                weight[b, h, s] = a.max()
    return mass, key, weight


CASES = [dict(), dict(causal=True), dict(causal=True, sliding_window=5), dict(causal=True, softcap=2.0),
         dict(causal=True, sink=True), dict(kv_head=[0, 1, 1, 1, 0, 1], causal=True), dict(sliding_window=4)]


@pytest.mark.parametrize("case", CASES, ids=[",".join(c) or "plain" for c in CASES])
def test_reference_equals_weights_row_by_row(case):
    q, k, lengths, target = _inputs(B=2, L=13, seed=1)
    kw = dict(case)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5]) if kw.pop("sink", False) else None
    kv = kw.pop("kv_head", None)
    kvh = kv if kv is not None else [h // 3 for h in range(6)]
    got = reference_row_stats(q, k, lengths, target, 0.4, kv, sink=sink, **kw)
    want = _plain(q, k, lengths, target, 0.4, kvh, kw.get("causal", False), kw.get("sliding_window"),
                  kw.get("softcap"), sink)
    for b, n in enumerate(lengths.tolist()):
        assert torch.allclose(got.target_mass[b, :, :n].double(), want[0][b, :, :n], atol=1e-6)
        assert torch.equal(got.argmax_key[b, :, :n], want[1][b, :, :n])
        assert torch.allclose(got.argmax_weight[b, :, :n].double(), want[2][b, :, :n], atol=1e-6)
        assert (got.argmax_key[b, :, n:] == -1).all() and (got.target_mass[b, :, n:] == 0).all()
    # row blocks give the same numbers as all rows at once
    blocked = reference_row_stats(q, k, lengths, target, 0.4, kv, sink=sink, block=4, **kw)
    for a, b in zip(got, blocked):
        assert torch.allclose(a.double(), b.double(), atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=[",".join(c) or "plain" for c in CASES])
@pytest.mark.parametrize("L", [37, 150])  # one tile, and several (64 rows each) with a partial last one
def test_cpu_kernel_equals_reference(case, L):
    q, k, lengths, target = _inputs(L=L, seed=L)
    kw = dict(case)
    sink = torch.linspace(-1, 1, 6) if kw.pop("sink", False) else None
    kv = kw.pop("kv_head", None)
    ref = reference_row_stats(q, k, lengths, target, 0.3, kv, sink=sink, **kw)
    got = row_stats(q, k, lengths, target, scaling=0.3, kv_head=kv, sink=sink, backend="fused", **kw)
    assert torch.allclose(got.target_mass, ref.target_mass, atol=1e-6)
    assert torch.allclose(got.argmax_weight, ref.argmax_weight, atol=1e-6)
    assert torch.equal(got.argmax_key, ref.argmax_key)


@needs_kernel
def test_cpu_kernel_half_inputs_and_fake():
    q, k, lengths, target = _inputs()
    got = row_stats(q.bfloat16(), k.bfloat16(), lengths, target, causal=True, backend="fused")
    ref = reference_row_stats(q.bfloat16().float(), k.bfloat16().float(), lengths, target, 8 ** -0.5, causal=True)
    assert torch.allclose(got.target_mass, ref.target_mass, atol=1e-5)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        out = torch.ops.attnkit.row_stats(fq, fk, mode.from_tensor(lengths), mode.from_tensor(target), 0.3, None,
                                          True)
    assert [tuple(t.shape) for t in out] == [(3, 6, 37)] * 3 and out[1].dtype == torch.int64


def test_bad_arguments_are_named():
    q, k, lengths, target = _inputs()
    with pytest.raises(AttnkitError, match="kv_head"):
        row_stats(q, k, lengths, target, kv_head=[0, 1, 2, 0, 1, 0])
    with pytest.raises(AttnkitError, match="divide"):
        row_stats(q, k[:, :1].repeat(1, 4, 1, 1), lengths, target)
    with pytest.raises(AttnkitError, match="target"):
        row_stats(q, k, lengths, target + 100)
    # no target: every mass is 0, the arg-max is still there
    out = row_stats(q, k, lengths, None, causal=True)
    assert (out.target_mass == 0).all() and (out.argmax_key[:, :, 0] == 0).all()
