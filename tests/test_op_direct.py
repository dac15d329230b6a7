"""The op's direct path (attnkit.ops._direct_args): a CPU call whose arguments are already what the compiled kernel
takes goes to it without the Python checks, conversions and routing. It must give the checked path's result bit for
bit, be taken where it should (or it saves nothing), be left wherever the checked path would do something else
(convert, route, keep a gradient), and refuse every bad input with the checked path's own error."""
import pytest
import torch

from attnkit import ops
from attnkit.errors import MAX_NUM_WINDOWS, AttnkitError
from attnkit.reference import AttentionParams, params_attention

pytestmark = pytest.mark.skipif(not ops._cpu_takes_all(), reason="needs a build whose CPU kernel takes every argument")

B, H, HKV, D = 3, 4, 2, 8


def _qkv(L, dtype=torch.float32, Lq=None, Hkv=H, Lk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq or L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, Lk or L, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _classes(L, seed=1):
    g = torch.Generator().manual_seed(seed)
    tc = torch.randint(0, 5, (B, L), generator=g, dtype=torch.int32)
    tc[:, 0] = 1
    return tc


def _cases():
    """(name, q, k, v, lengths, token_class, sentence_id, params): every kind of call the CPU kernel takes."""
    L = 9
    right = torch.tensor([9, 1, 5])  # right padding, n = 1 included
    g = torch.Generator().manual_seed(2)
    sid = torch.cat([torch.zeros(B, 4, dtype=torch.int32), torch.ones(B, 5, dtype=torch.int32)], 1)
    grid = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(3), indexing="ij"), -1).reshape(1, 9, 2)
    grid = grid.expand(B, 9, 2).clone().int()
    grid[:, 0] = -1
    yield "plain", *_qkv(L), right, None, None, {}
    yield "features", *_qkv(L), right, _classes(L), sid, {"want_features": True, "num_windows": 3}
    yield "bf16 features", *_qkv(L, torch.bfloat16), right, _classes(L), None, {"want_features": True}
    yield "fp16 odd length", *_qkv(7, torch.float16), torch.tensor([7, 3, 2]), _classes(7), None, {
        "want_features": True, "scaling": 0.5}
    yield "intervention", *_qkv(L), right, _classes(L), sid, {
        "want_features": True, "mode": torch.tensor([0, 1, 2, 0], dtype=torch.int32),
        "region": torch.tensor([1, 0, 2, 0], dtype=torch.int32), "renormalize": True,
        "gates": torch.rand(H, generator=g)}
    yield "norm weighting", *_qkv(L), right, _classes(L), None, {
        "want_features": True, "key_scale": torch.rand(B, H, L, generator=g)}
    yield "decoder", *_qkv(L, Hkv=HKV), right, _classes(L), None, {
        "want_features": True, "causal": True, "sliding_window": 4, "softcap": 20, "sink": torch.randn(H, generator=g),
        "kv_head": torch.tensor([1, 0, 1, 0], dtype=torch.int32)}
    yield "symmetric window", *_qkv(L), right, _classes(L), None, {
        "want_features": True, "sliding_window": 3, "symmetric_window": True}
    yield "a KV-cache step", *_qkv(L, Lq=2, Hkv=HKV), right.clamp(min=2), None, None, {"causal": True}
    yield "cross-attention", *_qkv(L, Lq=5, Lk=6), torch.tensor([5, 1, 3]), _classes(5), None, {
        "want_features": True, "key_lengths": torch.tensor([6, 2, 1]), "key_class": _classes(6, seed=3)}
    yield "bias", *_qkv(L), right, None, None, {"bias": torch.randn(1, H, L, L, generator=g)}
    yield "image grid and alignment", *_qkv(L), torch.tensor([9, 9, 4]), _classes(L), None, {
        "want_features": True, "grid": grid, "alignment": True}
    yield "all keys masked but one", *_qkv(L), torch.tensor([1, 1, 1]), _classes(L), None, {"want_features": True}
    q, k, v = _qkv(1)
    yield "n = 1", q, k, v, torch.ones(B, dtype=torch.int64), _classes(1), None, {"want_features": True,
                                                                                  "causal": True}


CASES = list(_cases())


def _spy(monkeypatch):
    """Records whether each call took the direct path."""
    taken = []
    real = ops._direct_args

    def spying(*args):
        got = real(*args)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(ops, "_direct_args", spying)
    return taken


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_direct_path_gives_the_checked_paths_bits(case, monkeypatch):
    _, q, k, v, n, tc, sid, params = case
    taken = _spy(monkeypatch)
    got = ops.attention(q, k, v, n, tc, sid, **params)
    assert taken == [True]  # these arguments need nothing of the checked path: the call went straight to the kernel
    want = ops._attention(q, k, v, n, AttentionParams.of(tc, sid, **params), "fused")
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    # and both are the reference's numbers (same tolerance as the other fused-against-reference tests)
    ref = params_attention(q.float(), k.float(), v.float(), n, AttentionParams.of(tc, sid, **params))
    tol = 2e-5 if q.dtype == torch.float32 else 2e-2
    valid = torch.arange(q.shape[2])[None, :] < (n if "key_lengths" in params or q.shape[2] == k.shape[2]
                                                 else n.clamp(max=q.shape[2]))[:, None]
    torch.testing.assert_close(got[0].float()[valid], ref[0][valid], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1], ref[1], atol=tol * 5, rtol=tol * 5, equal_nan=True)


def _inputs():
    q, k, v = _qkv(6)
    return q, k, v, torch.tensor([6, 4, 2])


@pytest.mark.parametrize("why, change", [
    ("int64 token classes are converted", lambda a: {**a, "tc": a["tc"].long()}),
    ("int32 lengths are converted", lambda a: {**a, "n": a["n"].int()}),
    ("fp64 gates are converted", lambda a: {**a, "gates": torch.ones(H, dtype=torch.float64)}),
    ("q needs a gradient", lambda a: {**a, "q": a["q"].clone().requires_grad_()}),
    ("a gate needs a gradient", lambda a: {**a, "gates": torch.ones(H).requires_grad_()}),
    ("a grid without features is dropped", lambda a: {**a, "want": False,
                                                      "grid": torch.full((B, 6, 2), -1, dtype=torch.int32)}),
    ("a bool given as softcap", lambda a: {**a, "softcap": True}),
    ("the reference asked for", lambda a: {**a, "backend": "reference"}),
])
def test_calls_the_checked_path_treats_otherwise_leave_the_direct_path(why, change, monkeypatch):
    q, k, v, n = _inputs()
    a = change({"q": q, "tc": _classes(6), "n": n, "gates": None, "want": True, "grid": None, "softcap": None,
                "backend": "auto"})
    kw = {"gates": a["gates"], "want_features": a["want"], "grid": a["grid"], "softcap": a["softcap"]}
    kw = {key: val for key, val in kw.items() if val is not None}
    taken = _spy(monkeypatch)
    if why == "a bool given as softcap":
        with pytest.raises(AttnkitError, match="softcap must be a finite number > 0, got True"):
            ops.attention(a["q"], k, v, a["n"], a["tc"], backend=a["backend"], **kw)
        assert taken == [False]
        return
    got = ops.attention(a["q"], k, v, a["n"], a["tc"], backend=a["backend"], **kw)
    assert taken == [False], why
    p = AttentionParams.of(a["tc"].int(), None, **{**kw, **({"gates": kw["gates"].float()} if "gates" in kw else {})})
    want = ops._attention(q, k, v, n, p, a["backend"])
    for x, y in zip(got, want):
        assert torch.equal(x.detach(), y)


def _bad_inputs():
    """(name, args, kwargs) the op refuses; each also a call whose tensors look ready for the kernel."""
    L = 5
    q, k, v = _qkv(L)
    n = torch.tensor([5, 3, 1])
    tc = _classes(L)
    yield "float lengths", (q, k, v, n.float()), {}
    yield "lengths above L", (q, k, v, torch.tensor([5, 6, 1])), {}
    yield "lengths of 0", (q, k, v, torch.tensor([5, 0, 1])), {}
    yield "lengths of the wrong shape", (q, k, v, n[:2]), {}
    yield "a 3-D q", (q[0], k, v, n), {}
    yield "k and v of different shapes", (q, k, v[:, :, :4], n), {}
    yield "head dim 0", (q[..., :0], k[..., :0], v[..., :0], n), {}
    yield "k of another dtype", (q, k.double(), v.double(), n), {}
    yield "q in fp64", (q.double(), k.double(), v.double(), n), {}
    yield "token classes of the wrong shape", (q, k, v, n, tc[:, :4]), {"want_features": True}
    yield "token class codes out of range", (q, k, v, n, tc + 5), {"want_features": True}
    yield "a bool num_windows", (q, k, v, n, tc), {"want_features": True, "num_windows": True}
    yield "a float num_windows", (q, k, v, n, tc), {"want_features": True, "num_windows": 2.0}
    yield "num_windows of 0", (q, k, v, n, tc), {"want_features": True, "num_windows": 0}
    yield "num_windows above the limit", (q, k, v, n, tc), {"want_features": True, "num_windows": MAX_NUM_WINDOWS + 1}
    yield "NaN scaling", (q, k, v, n), {"scaling": float("nan")}
    yield "a bool sliding_window", (q, k, v, n), {"sliding_window": True}
    yield "sliding_window of 0", (q, k, v, n), {"sliding_window": 0}
    yield "softcap of 0", (q, k, v, n), {"softcap": 0.0}
    yield "an int alignment", (q, k, v, n, tc), {"want_features": True, "alignment": 1}
    yield "symmetric_window without a window", (q, k, v, n), {"symmetric_window": True}
    yield "mode codes out of range", (q, k, v, n), {"mode": torch.tensor([0, 3, 0, 0], dtype=torch.int32)}
    yield "gates of the wrong shape", (q, k, v, n), {"gates": torch.ones(H + 1)}
    yield "key_scale of the wrong shape", (q, k, v, n, tc), {"want_features": True,
                                                            "key_scale": torch.ones(B, H, L + 1)}
    yield "an int32 grid of the wrong shape without features", (q, k, v, n), {
        "grid": torch.zeros(B, L, 3, dtype=torch.int32)}
    yield "kv_head out of range", (q, *_qkv(L, Hkv=HKV)[1:], n), {"kv_head": torch.tensor([0, 1, 2, 0],
                                                                                        dtype=torch.int32)}
    yield "KV heads that do not divide", (q, *_qkv(L, Hkv=3)[1:], n), {}
    yield "key_class without key_lengths", (q, k, v, n), {"key_class": tc}
    yield "cross-attention with causal", (q, k, v, n), {"key_lengths": n, "causal": True}
    yield "a bias of the wrong shape", (q, k, v, n), {"bias": torch.zeros(1, H, L, L + 1)}
    yield "a k that is not a tensor", (q, k.tolist(), v, n), {}


BAD = list(_bad_inputs())


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_are_refused_with_the_checked_paths_message(case):
    _, args, kwargs = case
    tc = args[4] if len(args) > 4 else None
    with pytest.raises(Exception) as checked:
        ops._attention(*args[:4], AttentionParams.of(tc, None, **kwargs), "auto")
    with pytest.raises(Exception) as direct:
        ops.attention(*args, **kwargs)
    assert type(direct.value) is type(checked.value)
    assert str(direct.value) == str(checked.value)
    assert isinstance(direct.value, AttnkitError), f"{case[0]}: {direct.value!r}"


@pytest.mark.parametrize("backend", ["bogus", None, "Reference", "FUSED"])
def test_an_unknown_backend_is_refused_as_before(backend):
    q, k, v, n = _inputs()
    with pytest.raises(AttnkitError, match="unknown backend"):
        ops.attention(q, k, v, n, backend=backend)


@pytest.mark.parametrize("flag, params, refusal", [
    ("_FUSED_SYMMETRIC", {"sliding_window": 2, "symmetric_window": True}, "does not take symmetric_window"),
    ("fused_bias", {"bias": torch.zeros(1, H, 6, 6)}, "does not take an additive bias"),
    ("_KERNELS", {}, "has no cpu kernel"),
])
def test_a_build_without_a_capability_is_asked_at_each_call(flag, params, refusal, monkeypatch):
    """The flags `_attention` routes by are read at each call (as a build without them, or a test, sets them): the
    direct path reads the same, so a call the kernel of this build would not take runs where the checked path says."""
    q, k, v, n = _inputs()
    if flag == "_KERNELS":
        monkeypatch.setitem(ops._KERNELS, ("cpu", ops._OP), False)
    elif flag == "fused_bias":
        monkeypatch.setattr(ops, "fused_bias", lambda device_type: False)
    else:
        monkeypatch.setattr(ops, flag, False)
    taken = _spy(monkeypatch)
    with pytest.raises(AttnkitError, match=refusal):
        ops.attention(q, k, v, n, backend="fused", **params)
    assert taken == [False]
    got = ops.attention(q, k, v, n, backend="auto", **params)
    want = params_attention(q, k, v, n, AttentionParams.of(None, None, **params))  # routed to the reference
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_traced_call_takes_the_checked_path(monkeypatch):
    """torch.jit.trace records what runs: the checked path's conversion of lengths stays in the trace, so the traced
    function takes int32 lengths as the untraced one does."""
    q, k, v, n = _inputs()
    taken = _spy(monkeypatch)
    with pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(lambda q, k, v, n: ops.attention(q, k, v, n)[0], (q, k, v, n), check_trace=False)
    assert taken == [False]
    assert torch.equal(traced(q, k, v, n.int()), ops.attention(q, k, v, n)[0])
