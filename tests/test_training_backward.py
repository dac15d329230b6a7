"""The op's backward without an L×L map (attnkit/kernels/backward.py, docs/training.md "The backward").

Gradients of q, k, v, gates and sink logits against autograd through an independent eager attention (written here:
GQA by repeat_interleave, the mask as an explicit L×L tensor, the sink as an extra softmax column): fp32 to 1e-5;
bf16 within twice PyTorch's own bf16 error (the same eager attention run in bf16) plus a small floor, both measured
against the eager attention in fp64. Then opcheck, torch.compile, tiny transformers decoders and encoders (left and
right padding) against eager, and a peak-memory check at L = 4096 in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from attnkit import ops
from attnkit.features import DEFAULT_NUM_WINDOWS
from attnkit.kernels import backward as bw
from attnkit.reference import AttentionParams, reference_attention

BACKENDS = ["reference"] + (["fused"] if ops.has_kernel("cpu") and ops.fused_decoder() else [])


def eager(q, k, v, lengths, *, kv_head=None, causal=False, window=None, softcap=None, sink=None, gates=None,
          scaling=None):
    """Plain attention in q's dtype, B×L×H×D like the op: every map L×L, autograd does the rest."""
    B, H, L, D = q.shape
    scaling = D**-0.5 if scaling is None else scaling
    if k.shape[1] != H:
        index = (kv_head.long() if kv_head is not None else torch.arange(H) // (H // k.shape[1]))
        k, v = k[:, index], v[:, index]
    s = (q @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)
    seen = (i[None, None, :] < lengths[:, None, None])  # B×1×L keys
    seen = seen & ((i[:, None] >= i[None, :]) if causal else True)
    if window is not None:
        seen = seen & (i[:, None] - i[None, :] < window)
    s = s.masked_fill(~seen[:, None], float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype).view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    p = torch.nan_to_num(torch.softmax(s, -1)[..., :L])
    vv = v.masked_fill(~(i[None, :] < lengths[:, None])[:, None, :, None], 0.0)
    out = p @ vv
    if gates is not None:
        out = out * gates.to(out.dtype).view(1, H, 1, 1)
    return out.transpose(1, 2)


KV = torch.tensor([0, 0, 0, 1, 2, 2], dtype=torch.int32)  # uneven groups, named per query head
CASES = {
    "encoder": dict(),
    "encoder_gates": dict(gates=True),
    "causal": dict(causal=True),
    "causal_gqa": dict(causal=True, hkv=2),
    "causal_gqa_gates": dict(causal=True, hkv=2, gates=True),
    "gqa_kv_head": dict(causal=True, hkv=3, kv_head=KV),
    "window": dict(causal=True, sliding_window=5, hkv=3),
    "softcap": dict(causal=True, softcap=2.0),
    "sink": dict(causal=True, sink=True, hkv=2),
    "everything": dict(causal=True, sliding_window=4, softcap=1.5, sink=True, gates=True, hkv=3, kv_head=KV),
}


def make(case, B=3, H=6, L=23, D=16, dtype=torch.float32, seed=0, lengths=(23, 11, 1)):
    c = CASES[case]
    g = torch.Generator().manual_seed(seed)
    hkv = c.get("hkv", H)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, hkv, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    gates = torch.rand(H, generator=g, dtype=torch.float64) + 0.5 if c.get("gates") else None
    sink = torch.randn(H, generator=g, dtype=torch.float64) if c.get("sink") else None
    if gates is not None:
        gates[1] = 0.0  # a zero gate still gets its gradient (the output before the gate)
    kw = {name: c[name] for name in ("causal", "sliding_window", "softcap", "kv_head") if name in c}
    w = torch.randn(B, L, H, D, generator=g, dtype=torch.float64)
    return (q, k, v, gates, sink), torch.tensor(lengths), kw, w


def grads_of(fn, leaves, w, dtype):
    # q, k, v in `dtype`; gates and sink logits are fp32 parameters (fp64 in the exact computation)
    xs = [None if t is None else t.detach().to(dtype if i < 3 or dtype == torch.float64 else torch.float32)
          .requires_grad_() for i, t in enumerate(leaves)]
    out = fn(*xs)
    (out.to(torch.float64) * w).sum().backward()
    return [None if t is None else t.grad.to(torch.float64) for t in xs]


def op_fn(lengths, kw, backend):
    def fn(q, k, v, gates, sink):
        return ops.attention(q, k, v, lengths, scaling=0.3, gates=gates, sink=sink, backend=backend, **kw)[0]
    return fn


def eager_fn(lengths, kw):
    def fn(q, k, v, gates, sink):
        return eager(q, k, v, lengths, kv_head=kw.get("kv_head"), causal=kw.get("causal", False),
                     window=kw.get("sliding_window"), softcap=kw.get("softcap"), sink=sink, gates=gates, scaling=0.3)
    return fn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_gradients_equal_eager(case, backend):
    leaves, lengths, kw, w = make(case)
    got = grads_of(op_fn(lengths, kw, backend), leaves, w, torch.float32)
    want = grads_of(eager_fn(lengths, kw), leaves, w, torch.float64)
    for name, a, b in zip("q k v gates sink".split(), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert got[0].abs().sum() > 0 and got[2].abs().sum() > 0
    if CASES[case].get("sink"):
        assert got[4].abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["encoder_gates", "causal_gqa", "window", "everything"])
def test_bf16_gradients_within_twice_pytorchs_own_error(case, backend):
    leaves, lengths, kw, w = make(case, L=40, lengths=(40, 17, 3))
    leaves = [None if t is None else t.to(torch.bfloat16).to(torch.float64) for t in leaves]  # exact in bf16
    exact = grads_of(eager_fn(lengths, kw), leaves, w, torch.float64)
    own = grads_of(eager_fn(lengths, kw), leaves, w, torch.bfloat16)
    got = grads_of(op_fn(lengths, kw, backend), leaves, w, torch.bfloat16)
    for name, g, o, x in zip("q k v gates sink".split(), got, own, exact):
        if x is None:
            continue
        err, err_own = (g - x).abs().max().item(), (o - x).abs().max().item()
        assert err <= 2 * err_own + 1e-3, (name, err, err_own)


def test_which_way_computes_the_gradients():
    q = torch.zeros(1, 2, 4, 8)
    assert bw.uses_aten(q, None, None, None)
    assert not bw.uses_aten(q, 4, None, None) and not bw.uses_aten(q, None, 2.0, None)
    assert not bw.uses_aten(q, None, None, torch.zeros(2))


@pytest.mark.parametrize("case", ["encoder", "causal_gqa", "everything"])
def test_tiles_of_few_rows_give_the_same_gradients(case, monkeypatch):
    """The tiled backward with tiles of a few rows (a remainder tile too) equals one tile of every row."""
    leaves, lengths, kw, w = make(case)
    monkeypatch.setattr(bw, "uses_aten", lambda *a: False)
    whole = grads_of(op_fn(lengths, kw, "reference" if not BACKENDS[1:] else "fused"), leaves, w, torch.float32)
    monkeypatch.setattr(bw, "TILE_ELEMENTS", 3 * 6 * 23 * 4)  # 4 rows per tile over 23 rows
    assert bw._block_rows(3, 6, 23) == 4
    tiled = grads_of(op_fn(lengths, kw, "reference" if not BACKENDS[1:] else "fused"), leaves, w, torch.float32)
    for a, b in zip(whole, tiled):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="the compiled op is not built")
@pytest.mark.parametrize("case", ["causal_gqa", "window"])
def test_padded_keys_holding_nan_get_zero_gradients_and_leak_nothing(case):
    """(Autograd through the reference itself, backend "reference", lets 0 · NaN into dq: the op's backward drops
    the padded keys first, as the reference's forward does.)"""
    leaves, lengths, kw, w = make(case)
    q, k, v = (t.clone() for t in leaves[:3])
    k[1, :, 11:] = float("nan")
    v[1, :, 11:] = float("nan")
    got = grads_of(op_fn(lengths, kw, "fused"), (q, k, v, None, None), w, torch.float32)
    assert all(torch.isfinite(g).all() for g in got[:3])
    assert (got[1][1, :, 11:] == 0).all() and (got[2][1, :, 11:] == 0).all()


def test_interventions_keep_the_reference_backward():
    """mode/region/renormalize: the gradients of the reference itself (it builds the maps; docs/training.md)."""
    leaves, lengths, kw, w = make("encoder")
    mode = torch.tensor([0, 1, 2, 0, 0, 0], dtype=torch.int32)

    def ref(q, k, v, gates, sink):
        return reference_attention(q, k, v, lengths, scaling=0.3, mode=mode)[0]

    for backend in BACKENDS:
        def fn(q, k, v, gates, sink, backend=backend):
            return ops.attention(q, k, v, lengths, scaling=0.3, mode=mode, backend=backend)[0]
        got = grads_of(fn, leaves, w, torch.float32)
        want = grads_of(ref, leaves, w, torch.float32)
        for a, b in zip(got[:3], want[:3]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="the compiled op is not built")
def test_opcheck_with_the_new_backward():
    leaves, lengths, kw, _ = make("everything", B=2, L=9, lengths=(9, 5))
    q, k, v, gates, sink = (t.float() for t in leaves)
    op = torch.ops.attnkit.fused_attention.default
    for extra in ((kw["kv_head"], True, 4, 1.5, sink.clone().requires_grad_()), (None, True, None, None, None)):
        kk, vv = (k, v) if extra[0] is not None else (torch.randn(2, 6, 9, 16),) * 2
        args = (q.clone().requires_grad_(), kk.clone().requires_grad_(), vv, lengths, None, None, 0.3, 4, None, None,
                False, gates.clone().requires_grad_(), False, None) + extra
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                     "test_aot_dispatch_static"))


@pytest.mark.skipif(len(BACKENDS) < 2, reason="the compiled op is not built")
@pytest.mark.parametrize("case", ["causal_gqa", "everything"])
def test_torch_compile_forward_and_backward(case):
    leaves, lengths, kw, w = make(case)
    fn = op_fn(lengths, kw, "fused")
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    want = grads_of(fn, leaves, w, torch.float32)
    got = grads_of(compiled, leaves, w, torch.float32)
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


MEMORY_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    torch.set_num_threads(1)
    from attnkit import ops
    L, H, D, how = 4096, 4, 32, sys.argv[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
    lengths = torch.tensor([L - 5])
    kw = dict(causal=True) if how != "window" else dict(causal=True, sliding_window=512, softcap=30.0)
    backend = "fused" if ops.has_kernel("cpu") and ops.fused_decoder() else "reference"
    # the control, "maps": a mode (every head kept) sends the backward to the reference, which builds L×L maps,
    # as every backward did before
    mode = torch.zeros(H, dtype=torch.int32) if how == "maps" else None
    out, _ = ops.attention(q, k, v, lengths, backend=backend, mode=mode, **kw)
    go = torch.randn_like(out)
    def status_kb(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    # the backward's own peak: reset the peak RSS to the current RSS first (ru_maxrss cannot be reset, so a higher
    # peak earlier in the process would hide the backward's)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kb("VmRSS")
    out.backward(go)
    after = status_kb("VmHWM")
    print(json.dumps({"rise_mb": (after - before) / 1024, "backend": backend}))
""")


def peak_rise_mb(how: str) -> dict:
    """{"rise_mb": the peak RSS rise of one backward, "backend": the op's backend} in a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, how], capture_output=True, text=True, env=env,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_backward_at_4096_rises_far_below_the_maps():
    """The 4 heads' fp32 L×L maps at L = 4096 take 256 MB; a backward that builds them (the control: the reference's,
    which every backward ran before) raises peak RSS by several times that. The new backward, by ATen's kernel and
    by tiles (window + soft-cap), must rise by less than half of one set of maps (its tiles and O(L) buffers)."""
    maps = 4 * 4096 * 4096 * 4 / 2**20
    control = peak_rise_mb("maps")
    assert control["rise_mb"] > 4 * maps, control  # the measurement sees L×L maps when they are there
    for how in ("aten", "window"):
        rise = peak_rise_mb(how)
        assert rise["rise_mb"] < maps / 2, (how, rise, control)


from .synthetic import DECODER_KINDS, tiny_bert, tiny_decoder, tiny_encoder  # noqa: E402


def _param_grads(model, **inputs):
    model.zero_grad()
    out = model(**inputs)
    logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
    mask = inputs["attention_mask"].bool()
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits[mask] * w[mask]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_like_eager(eager, ours, **inputs):
    """Every weight's gradient through attnkit against eager's, both fp32: within 1e-5 plus 1e-3 of the largest
    gradient of that weight. The blocked CPU kernel sums scores in another order than eager (key blocks, online
    rescaling), which moves single elements by about 1e-5 where the weight's gradients reach 0.05 (seen: Gemma 3's
    o_proj, 1.6e-5); a wrong gradient is off by the gradient's own size. (A float64 eager is no truth here: its
    masks give NaN rows under left padding, and gpt-oss's grouped matmul takes no float64.)"""
    a = _param_grads(eager, **inputs)
    b = _param_grads(ours, **inputs)
    assert a.keys() == b.keys() and a
    for name in a:
        scale = float(a[name].abs().max())
        torch.testing.assert_close(b[name], a[name], atol=1e-5 + 1e-3 * scale, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", DECODER_KINDS)
def test_tiny_decoders_train_like_eager(kind, side):
    """Every weight's gradient of a tiny decoder (causal, GQA, windows, soft-caps, sinks as the kind has them)
    through attnkit equals eager's (`_assert_grads_like_eager`), with right and left padding."""
    import copy

    import attnkit

    eager = tiny_decoder(kind)
    ours = attnkit.instrument(copy.deepcopy(eager))
    lengths = [9, 6, 3]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (3, 9), generator=g)
    mask = (torch.arange(9)[None] < torch.tensor(lengths)[:, None]).long()
    if side == "left":
        mask = mask.flip(1)
    _assert_grads_like_eager(eager, ours, input_ids=ids, attention_mask=mask)


def test_a_tiny_encoder_trains_like_eager():
    import copy

    import attnkit

    eager = tiny_bert(n_heads=4)[0]
    eager.set_attn_implementation("eager")
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids = torch.randint(9, eager.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(11)[None] < torch.tensor([11, 7, 2])[:, None]).long()
    _assert_grads_like_eager(eager, ours, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_tiny_modernbert_trains_like_eager(side):
    """ModernBERT: global layers and a local one (a bidirectional sliding window, |s − t| ≤ 2), every weight's
    gradient equal to eager's with right and left padding."""
    import copy

    import attnkit

    eager = tiny_encoder("modernbert", n_layers=3)
    eager.set_attn_implementation("eager")
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids = torch.randint(5, 120, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(11)[None] < torch.tensor([11, 7, 2])[:, None]).long()
    if side == "left":
        mask = mask.flip(1)
    _assert_grads_like_eager(eager, ours, input_ids=ids, attention_mask=mask)


# --- the forward's saved output and log-sum-exp (attnkit::fused_attention_lse; docs/training.md, "The backward") ---
HAS_LSE = len(BACKENDS) > 1 and ops.has_kernel("cpu", ops._LSE_OP)
needs_lse = pytest.mark.skipif(not HAS_LSE, reason="the compiled op has no fused_attention_lse")


def _spy_aten(monkeypatch) -> list:
    """Make the recompute (`stats`) raise and record, per ATen backward, whether it got the forward's saved pair."""
    def no_recompute(*a, **kw):
        raise AssertionError("the backward recomputed O and lse although the forward saved them")

    calls = []
    real = bw._aten_backward

    def spy(*a, saved=None, **kw):
        calls.append(saved is not None)
        return real(*a, saved=saved, **kw)

    monkeypatch.setattr(bw, "stats", no_recompute)
    monkeypatch.setattr(bw, "_aten_backward", spy)
    return calls


def _saved_pair_grads_equal_eager(leaves, lengths, kw, w, names, monkeypatch):
    """The fused op's fp32 gradients of `names` (in the order of `leaves`), taken by ATen's backward on the
    forward's saved out and lse (the recompute raises), equal eager's fp64 ones to 1e-5; returns them."""
    calls = _spy_aten(monkeypatch)
    got = grads_of(op_fn(lengths, kw, "fused"), leaves, w, torch.float32)
    assert calls == [True]
    want = grads_of(eager_fn(lengths, kw), leaves, w, torch.float64)
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return got


@needs_lse
@pytest.mark.parametrize("lengths", [(23, 11, 1), (23, 23, 23)])
@pytest.mark.parametrize("case", ["encoder", "causal", "causal_gqa", "gqa_kv_head"])
def test_saved_lse_gradients_equal_eager(case, lengths, monkeypatch):
    """No gates, no window/soft-cap/sink, fused CPU: the backward uses the forward's out and lse (the recompute
    raises here) and its gradients equal eager's to 1e-5 — padded rows, causal, GQA (even and uneven groups)."""
    _saved_pair_grads_equal_eager(*make(case, lengths=lengths), "q k v".split(), monkeypatch)


@needs_lse
def test_saved_lse_bf16_within_twice_pytorchs_own_error(monkeypatch):
    leaves, lengths, kw, w = make("causal_gqa", L=40, lengths=(40, 17, 3))
    leaves = [None if t is None else t.to(torch.bfloat16).to(torch.float64) for t in leaves]
    exact = grads_of(eager_fn(lengths, kw), leaves, w, torch.float64)
    own = grads_of(eager_fn(lengths, kw), leaves, w, torch.bfloat16)
    calls = _spy_aten(monkeypatch)
    got = grads_of(op_fn(lengths, kw, "fused"), leaves, w, torch.bfloat16)
    assert calls == [True]
    for name, g, o, x in zip("q k v".split(), got, own, exact):
        err, err_own = (g - x).abs().max().item(), (o - x).abs().max().item()
        assert err <= 2 * err_own + 1e-3, (name, err, err_own)


@needs_lse
@pytest.mark.parametrize("case", ["encoder_gates", "causal_gqa_gates"])
def test_gates_save_the_ungated_output_and_skip_the_recompute(case, monkeypatch):
    """Gates (a zero gate included): the op runs ungated and the gates multiply its output outside it, so the saved
    output is the one ATen's backward wants (the recompute raises here) and autograd gives each gate Σ dO ∘ O_h; the
    gradients of q, k, v and the gates equal eager's to 1e-5; without gradients the output equals the gated op's."""
    leaves, lengths, kw, w = make(case)
    got = _saved_pair_grads_equal_eager(leaves, lengths, kw, w, "q k v gates".split(), monkeypatch)
    assert got[3][1] != 0  # the zero gate's gradient: the head's output before the gate
    q, k, v, gates = (t.float() for t in leaves[:4])
    with torch.no_grad():
        plain = ops.attention(q, k, v, lengths, scaling=0.3, gates=gates, backend="fused", **kw)[0]
    trained = ops.attention(q.requires_grad_(), k, v, lengths, scaling=0.3, gates=gates, backend="fused", **kw)[0]
    torch.testing.assert_close(trained.detach(), plain, atol=1e-6, rtol=1e-6)


@needs_lse
def test_an_unpadded_batch_gives_aten_no_key_mask(monkeypatch):
    """No sample padded: ATen's backward gets no key mask (its mask-free path, as sdpa's) and the gradients are
    eager's; with padding it gets the additive mask."""
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    masks = []

    def spy(*a, attn_mask=None, **kw):
        masks.append(attn_mask)
        return real(*a, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", spy)
    for lengths in ((23, 23, 23), (23, 11, 1)):
        leaves, lengths, kw, w = make("causal_gqa_gates", lengths=lengths)
        got = grads_of(op_fn(lengths, kw, "fused"), leaves, w, torch.float32)
        want = grads_of(eager_fn(lengths, kw), leaves, w, torch.float64)
        for a, b in zip(got[:4], want[:4]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert masks[0] is None and masks[1] is not None and len(masks) == 2


@needs_lse
def test_inference_keeps_the_plain_op():
    """Which calls take the lse op (`saves_lse`); without a gradient (inference, extraction) the forward never
    takes it."""
    leaves, lengths, kw, w = make("encoder_gates")
    q, k, v = (t.float() for t in leaves[:3])
    plain = AttentionParams()
    assert not ops.saves_lse(q, k, v, plain)  # no tensor requires grad
    qg = q.clone().requires_grad_()
    assert ops.saves_lse(qg, k, v, plain)
    with torch.no_grad():
        assert not ops.saves_lse(qg, k, v, plain)
    assert ops.saves_lse(qg, k, v, AttentionParams(gates=torch.ones(6)))  # gates: multiplied outside the op
    assert not ops.saves_lse(qg, k, v, AttentionParams(mode=torch.zeros(6, dtype=torch.int32)))  # a mode
    assert not ops.saves_lse(qg, k, v, AttentionParams(sliding_window=4))  # a sliding window
    assert not ops.saves_lse(qg[:, :, :5], k, v, plain)  # fewer queries than keys
    with torch.no_grad():  # inference: the plain op's outputs, as before
        a = ops.attention(q, k, v, lengths, scaling=0.3, want_features=True, backend="fused")
    b = torch.ops.attnkit.fused_attention(q, k, v, lengths, None, None, 0.3, DEFAULT_NUM_WINDOWS, None, None,
                                          False, None, True, None, None, False, None, None, None)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@needs_lse
def test_opcheck_of_the_lse_op_with_its_backward():
    leaves, lengths, kw, _ = make("causal_gqa", B=2, L=9, lengths=(9, 5))
    q, k, v = (t.float() for t in leaves[:3])
    op = torch.ops.attnkit.fused_attention_lse.default
    args = (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), lengths, None, None,
            0.3, 4, None, None, False, None, False, None, None, True, None, None, None)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                 "test_aot_dispatch_static"))


@needs_lse
def test_torch_compile_through_the_saved_lse(monkeypatch):
    leaves, lengths, kw, w = make("causal_gqa")
    fn = op_fn(lengths, kw, "fused")
    want = grads_of(eager_fn(lengths, kw), leaves, w, torch.float64)
    calls = _spy_aten(monkeypatch)
    torch._dynamo.reset()
    got = grads_of(torch.compile(fn, fullgraph=True, backend="aot_eager"), leaves, w, torch.float32)
    assert calls and all(calls)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_lse
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_tiny_llama_trains_like_eager_on_the_saved_lse(side, monkeypatch):
    """Left and right padding through a model: every layer's backward takes the saved pair, none recomputes."""
    import copy

    import attnkit

    eager_model = tiny_decoder("llama")
    ours = attnkit.instrument(copy.deepcopy(eager_model))
    ids = torch.randint(3, 120, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(9)[None] < torch.tensor([9, 6, 3])[:, None]).long()
    if side == "left":
        mask = mask.flip(1)
    a = _param_grads(eager_model, input_ids=ids, attention_mask=mask)
    calls = _spy_aten(monkeypatch)
    b = _param_grads(ours, input_ids=ids, attention_mask=mask)
    assert calls and all(calls)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
