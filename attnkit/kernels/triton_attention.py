"""The Triton kernel of `attnkit::fused_attention` for fp16/bf16 CUDA tensors (docs/cuda.md, "The Triton kernel").

One program owns BM query rows of one (sample, head) and streams the keys in tiles of BN, as FlashAttention does;
every feature of docs/features.md is a per-row fp32 sum kept online beside the output. The semantics are those
of `attnkit.reference.reference_attention` (and the decoder arguments of the op: `kv_head`, `causal`,
`sliding_window`, `softcap`, `sink`). What the review (issue 28) asks of the algorithm, at Triton's level:

* scores in log2 units, x = s · scaling · log2 e (soft-capped first when asked);
* **lazy rescaling**: the exponent base m_ref of the block's rows moves only when a block-uniform vote finds a row
  whose tile max exceeds it by more than TAU = 8 (so p = 2^(x − m_ref) ≤ 2^8, exact in fp32 and in P's fp16/bf16);
  then the output and every feature sum are rescaled together;
* **entropy = log Z − Σ p·s kept online**: A = Σ p·(x − m_ref) is one multiply-add per score, rescaled as
  A ← 2^−δ (A − δ·Σp) when the base moves; at the end H = ln 2 · (log2 Z − A / Z);
* **block-uniform branches**: masks only in tiles that need them (the tail, the causal diagonal, the window edge);
  class masses only for classes present in the tile; self/prev/next only in tiles that touch the diagonal;
  `intra` as a row sum when the tile and the block are one sentence; distance windows as one row sum when every row
  of the tile stays in one window, else a loop over the few windows the tile spans, with the windows' edges
  computed per row (no division per score);
* **decoders**: causal tiles above the diagonal and tiles outside a sliding window are skipped by the loop bounds,
  not masked; a query head reads its KV head (`kv_head`), K/V are never repeated; the sink logit joins the
  denominator at the end;
* **deterministic features**: each program writes its rows' feature sums to its own slot of a
  B×H×blocks×(F + 2) buffer (plain stores, no atomics), reduced over the blocks in a fixed order by `torch.sum`.

Under Triton's CPU interpreter (`TRITON_INTERPRET=1`) the same code runs on CPU tensors
(tests/test_triton_attention.py). The interpreter multiplies bf16 `tl.dot` operands wrongly
(triton-lang/triton#11584), so the dots run in fp32 there (DOT_DTYPE) and in the input dtype on a GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..errors import AttnkitError
from ..features import num_features
from ..reference import AttentionParams

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634
TAU = 8.0  # log2 units the exponent base may lag behind a row's max (lazy rescaling)
_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# tiles and warps on a GPU (autotuned on a lent GPU later, docs/cuda.md); the interpreter uses small tiles
GPU_BLOCK_M, GPU_BLOCK_N, GPU_WARPS, GPU_STAGES = 64, 64, 4, 2


def _interpreter_index_shim() -> None:
    """Triton 3.6's interpreter holds a scalar as a 1-element array and turns it into a loop bound with int(array),
    which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"): a loop whose trip count is read from
    memory then fails under TRITON_INTERPRET=1. Make that conversion read the one element (interpreter only; the
    compiled kernel is untouched)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_attnkit_shim", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._attnkit_shim = True
    interpreter._patch_lang_tensor = patch


if INTERPRET:
    _interpreter_index_shim()


@triton.jit
def _live_sum(val, live):
    return tl.sum(tl.where(live, val, 0.0), 0)


@triton.jit
def _fused_attention_kernel(
    Q, K, V, O, LEN, TC, SID, MODE, REGION, GATES, KS, KVH, SINK, PART,
    q_sb, q_sh, q_sl, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl,
    H, L, NBLK, PF, N, scale_log2, softcap_log2, inv_softcap, window,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WB: tl.constexpr,
    FEATURES: tl.constexpr, HAS_TC: tl.constexpr, HAS_SID: tl.constexpr, HAS_MODE: tl.constexpr,
    HAS_REGION: tl.constexpr, HAS_GATES: tl.constexpr, HAS_KS: tl.constexpr, HAS_SINK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, RENORM: tl.constexpr,
    IN_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, TAU: tl.constexpr,
):
    LN2: tl.constexpr = 0.6931471805599453
    NONE_YET: tl.constexpr = -3.0e38  # the base before a row meets a finite score (finite: no inf − inf)
    BIG: tl.constexpr = 2147483647
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    n = tl.load(LEN + b).to(tl.int32)
    row0 = pid_m * BM
    rows = row0 + tl.arange(0, BM)
    dcol = tl.arange(0, D)
    in_l = rows < L
    kvh = tl.load(KVH + h)
    q_ptr = Q + b.to(tl.int64) * q_sb + h.to(tl.int64) * q_sh
    k_ptr = K + b.to(tl.int64) * k_sb + kvh.to(tl.int64) * k_sh
    v_ptr = V + b.to(tl.int64) * v_sb + kvh.to(tl.int64) * v_sh
    q = tl.load(q_ptr + rows[:, None] * q_sl + dcol[None, :], mask=in_l[:, None], other=0.0).to(DOT_DTYPE)

    is_uniform = False
    is_zero = False
    md = 0
    if HAS_MODE:
        md = tl.load(MODE + h)
        is_uniform = md == 2
        is_zero = md == 1
    rg = 0
    if HAS_REGION:
        rg = tl.load(REGION + h)
    sid_r = tl.zeros([BM], tl.int32)
    r_lo = 0
    r_hi = 0
    if HAS_SID:
        sid_r = tl.load(SID + b * L + rows, mask=in_l, other=0)
        r_lo = tl.min(tl.where(rows < n, sid_r, BIG), 0)
        r_hi = tl.max(tl.where(rows < n, sid_r, -BIG), 0)

    m_ref = tl.full([BM], NONE_YET, tl.float32)
    m_true = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)   # Σ p over the keys the row sees
    lk = tl.zeros([BM], tl.float32)    # Σ p over the keys a region intervention keeps
    zc = tl.zeros([BM], tl.float32)    # Σ p·g: the mass the features describe under a key scale g
    ent = tl.zeros([BM], tl.float32)   # A = Σ pc·(x − m_ref + log2 g)
    mc = tl.full([BM], float("-inf"), tl.float32)  # max of x + log2 g over kept keys (region / key scale)
    cls_acc = tl.zeros([BM, 4], tl.float32)
    self_acc = tl.zeros([BM], tl.float32)
    win = tl.zeros([BM, WB], tl.float32)
    prev = tl.zeros([BM], tl.float32)
    nxt = tl.zeros([BM], tl.float32)
    intra = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    ccol = tl.arange(0, 4)
    wcol = tl.arange(0, WB)

    # the key tiles any row of the block sees: causal rows stop at the block's last row, a sliding window starts
    # W − 1 keys before the block's first row (loop bounds, not masks)
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, row0 + BM)
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(row0 - window + 1, 0) // BN) * BN
    for k0 in range(lo, hi, BN):
        cols = k0 + tl.arange(0, BN)
        kin = cols < n
        k = tl.load(k_ptr + cols[:, None] * k_sl + dcol[None, :], mask=kin[:, None], other=0.0).to(DOT_DTYPE)
        v = tl.load(v_ptr + cols[:, None] * v_sl + dcol[None, :], mask=kin[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:  # softcap · tanh(s · scaling / softcap), tanh from exp2 (the interpreter has no tanh)
            y = tl.exp2(s * (2.0 * 1.4426950408889634 * inv_softcap))
            x = (1.0 - 2.0 / (y + 1.0)) * softcap_log2
        else:
            x = s * scale_log2
        if HAS_MODE:
            x = tl.where(is_uniform, 0.0, x)
        needs_mask = k0 + BN > n
        if CAUSAL:
            needs_mask = needs_mask | (k0 + BN - 1 > row0)
        if HAS_WINDOW:
            needs_mask = needs_mask | (row0 + BM - 1 - k0 >= window)
        if needs_mask:
            vis = kin[None, :] & (rows[:, None] >= 0)
            if CAUSAL:
                vis = vis & (cols[None, :] <= rows[:, None])
            if HAS_WINDOW:
                vis = vis & (rows[:, None] - cols[None, :] < window)
            x = tl.where(vis, x, float("-inf"))

        m_tile = tl.max(x, 1)
        m_true = tl.maximum(m_true, m_tile)
        if tl.max(m_tile - m_ref, 0) > TAU:  # block-uniform vote: some row outgrew its base
            m_new = tl.maximum(m_ref, m_tile)
            alpha = tl.exp2(m_ref - m_new)
            delta = m_new - m_ref
            acc = acc * alpha[:, None]
            if FEATURES:
                if HAS_KS:
                    ent = alpha * (ent - delta * zc)
                elif HAS_REGION:
                    ent = alpha * (ent - delta * lk)
                else:
                    ent = alpha * (ent - delta * l_i)
                zc = zc * alpha
                cls_acc = cls_acc * alpha[:, None]
                self_acc = self_acc * alpha
                win = win * alpha[:, None]
                prev = prev * alpha
                nxt = nxt * alpha
                intra = intra * alpha
            l_i = l_i * alpha
            lk = lk * alpha
            m_ref = m_new

        arg = x - m_ref[:, None]
        p = tl.exp2(arg)
        l_i += tl.sum(p, 1)
        pk = p
        if HAS_REGION:
            if HAS_SID:
                ksid_r = tl.load(SID + b * L + cols, mask=kin, other=0)
                same = sid_r[:, None] == ksid_r[None, :]
            else:
                same = (rows[:, None] >= 0) & (cols[None, :] >= 0)
            keep = tl.where(rg == 1, same == 0, tl.where(rg == 2, same, (rows[:, None] >= 0)))
            pk = tl.where(keep, p, 0.0)
            lk += tl.sum(pk, 1)
        acc += tl.dot(pk.to(IN_DTYPE).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)

        if FEATURES:
            argc = tl.maximum(arg, -1.0e30)  # p = 0 at a masked key: p·arg stays 0
            pc = pk
            if HAS_KS:
                g = tl.load(KS + bh.to(tl.int64) * L + cols, mask=kin, other=0.0)
                lg = tl.where(g > 0, tl.log2(g), 0.0)
                pc = pk * g[None, :]
                zc += tl.sum(pc, 1)
                ent += tl.sum(pc * (argc + lg[None, :]), 1)
                mc = tl.maximum(mc, tl.max(tl.where(pc > 0, x + lg[None, :], float("-inf")), 1))
            else:
                ent += tl.sum(pc * argc, 1)
                if HAS_REGION:
                    mc = tl.maximum(mc, tl.max(tl.where(pk > 0, x, float("-inf")), 1))
            tile_sum = tl.sum(pc, 1)
            # classes: only those present in the tile; the other keys' mass feeds self and the windows
            po = pc
            if HAS_TC:
                kc = tl.load(TC + b * L + cols, mask=kin, other=0)
                if tl.max(kc, 0) > 0:
                    for c in tl.static_range(4):
                        if tl.max((kc == c + 1).to(tl.int32), 0) > 0:
                            sc = tl.sum(tl.where(kc[None, :] == c + 1, pc, 0.0), 1)
                            cls_acc += tl.where(ccol[None, :] == c, sc[:, None], 0.0)
                    po = tl.where(kc[None, :] == 0, pc, 0.0)
            po_sum = tl.sum(po, 1)
            # the diagonal's neighbourhood: self, prev, next
            touch = (k0 <= row0 + BM) & (k0 + BN >= row0)
            diag = (k0 < row0 + BM) & (k0 + BN > row0)
            if touch:
                dd = cols[None, :] - rows[:, None]
                self_acc += tl.sum(tl.where(dd == 0, po, 0.0), 1)
                prev += tl.sum(tl.where(dd == -1, pc, 0.0), 1)
                nxt += tl.sum(tl.where(dd == 1, pc, 0.0), 1)
            # distance windows w = floor(d·N/n), d = |s − t| ≥ 1: per row, the windows of the tile's keys form
            # a contiguous range [w_lo, w_hi]; window w holds d in [ceil(w·n/N), ceil((w+1)·n/N))
            k_last = tl.minimum(k0 + BN, n) - 1
            dmin = tl.maximum(tl.maximum(k0 - rows, rows - k_last), 0)
            dmax = tl.maximum(tl.abs(rows - k0), tl.abs(rows - k_last))
            w_lo = tl.minimum(tl.maximum(dmin, 1) * N // n, N - 1)
            w_hi = tl.minimum(dmax * N // n, N - 1)
            span = tl.max(w_hi - w_lo, 0) + 1
            if (span == 1) & (diag == 0):  # every row of the tile in one window: one row sum
                win += tl.where(wcol[None, :] == w_lo[:, None], po_sum[:, None], 0.0)
            else:
                dist = tl.abs(cols[None, :] - rows[:, None])
                for j in range(0, span):
                    w = w_lo + j
                    lo_c = tl.maximum((w * n + N - 1) // N, 1)
                    hi_c = tl.where(w >= N - 1, BIG, ((w + 1) * n + N - 1) // N)
                    inw = (dist >= lo_c[:, None]) & (dist < hi_c[:, None])
                    sw = tl.sum(tl.where(inw, po, 0.0), 1)
                    win += tl.where(wcol[None, :] == w[:, None], sw[:, None], 0.0)
            # intra: a row sum when the tile's keys and the block's rows are one sentence
            if HAS_SID:
                ksid = tl.load(SID + b * L + cols, mask=kin, other=0)
                k_lo = tl.min(tl.where(kin, ksid, BIG), 0)
                k_hi = tl.max(tl.where(kin, ksid, -BIG), 0)
                if (r_lo == r_hi) & (k_lo == k_hi) & (k_lo == r_lo):
                    intra += tile_sum
                elif (r_lo == r_hi) & ((k_lo > r_hi) | (k_hi < r_lo)):
                    intra += 0.0
                else:
                    intra += tl.sum(tl.where(sid_r[:, None] == ksid[None, :], pc, 0.0), 1)

    # ---- epilogue: output rows
    sink_mass = tl.zeros([BM], tl.float32)
    if HAS_SINK:
        sink2 = tl.load(SINK + h).to(tl.float32) * 1.4426950408889634
        sink_mass = tl.where(is_uniform, 0.0, tl.exp2(sink2 - m_ref))
    l_tot = l_i + sink_mass
    if HAS_REGION:
        kept = lk
    else:
        kept = l_i
    if RENORM:  # the kept keys and the sink rescaled together to sum 1
        den = kept + sink_mass
    else:
        den = l_tot
    # the softmax is undefined for a row that sees a key (or has a sink) but no finite score, or a NaN / +inf
    # one; a padded row that sees no key (a sliding window) and has no sink gets weight 0 everywhere
    sees_lo = tl.zeros([BM], tl.int32)
    if HAS_WINDOW:
        sees_lo = tl.maximum(rows - window + 1, 0)
    sees_hi = tl.zeros([BM], tl.int32) + n - 1
    if CAUSAL:
        sees_hi = tl.minimum(sees_hi, rows)
    undefined = ((sees_lo <= sees_hi) | HAS_SINK) & (((l_tot > 0) & (l_tot < float("inf"))) == 0)
    if HAS_MODE:
        undefined = undefined & (md == 0)
    o = tl.where(den[:, None] > 0, acc / den[:, None], 0.0)
    o = tl.where(undefined[:, None], float("nan"), o)
    if HAS_GATES:
        o = o * tl.load(GATES + h)
    o = tl.where(is_zero, 0.0, o)
    o_ptr = O + ((b.to(tl.int64) * L + rows[:, None]) * H + h) * D + dcol[None, :]
    tl.store(o_ptr, o.to(IN_DTYPE), mask=in_l[:, None])

    # ---- epilogue: this block's feature sums (its own slot of the partial buffer: no atomics)
    if FEATURES:
        zf = den
        if HAS_KS:  # norm weighting: the weights times g, renormalised over the keys (the sink has no value: 0)
            kept = zc
            zf = zc
        inv = tl.where(zf > 0, 1.0 / zf, 0.0)
        entropy = tl.where(zf > 0, LN2 * (kept * inv * tl.log2(tl.where(zf > 0, zf, 1.0)) - ent * inv), 0.0)
        if HAS_KS or HAS_REGION:
            mx = tl.where(kept > 0, tl.exp2(mc - m_ref) * inv, 0.0)
        else:
            mx = tl.exp2(m_true - m_ref) * inv
        if HAS_SID:
            intra_r = intra * inv
            inter_r = kept * inv - intra_r
        else:
            intra_r = kept * inv
            inter_r = tl.zeros([BM], tl.float32)
        live = (rows < n) & (is_zero == 0)
        valid = rows < n
        out = PART + (bh.to(tl.int64) * NBLK + pid_m) * PF

        tl.store(out + ccol, tl.sum(tl.where(live[:, None], cls_acc * inv[:, None], 0.0), 0))
        tl.store(out + 4, _live_sum(self_acc * inv, live))
        wsum = tl.sum(tl.where(live[:, None], win * inv[:, None], 0.0), 0)
        tl.store(out + 5 + wcol, wsum, mask=wcol < N)
        c0 = 5 + N
        tl.store(out + c0, _live_sum(prev * inv, live))
        tl.store(out + c0 + 1, _live_sum(nxt * inv, live))
        tl.store(out + c0 + 2, _live_sum(entropy, live))
        tl.store(out + c0 + 3, _live_sum(mx, live))
        tl.store(out + c0 + 4, _live_sum(intra_r, live))
        tl.store(out + c0 + 5, _live_sum(inter_r, live))
        if HAS_TC:
            tc_r = tl.load(TC + b * L + rows, mask=in_l, other=0)
            is_cls = valid & (tc_r == 1)
            tl.store(out + c0 + 6, tl.sum(tl.where(is_cls & live, entropy, 0.0), 0))
            tl.store(out + PF - 2, tl.sum(is_cls.to(tl.float32), 0))
        else:
            tl.store(out + c0 + 6, 0.0)
            tl.store(out + PF - 2, 0.0)
        if HAS_SINK:
            if HAS_KS:
                tl.store(out + c0 + 7, 0.0)
            else:
                tl.store(out + c0 + 7, _live_sum(sink_mass * inv, live))
        tl.store(out + PF - 1, tl.sum((valid & undefined).to(tl.float32), 0))


def _kv_heads(kv_head, H: int, Hkv: int, device) -> torch.Tensor:
    """The KV head of each query head (contract 1 of the decoder op): given, identity, or even groups."""
    if kv_head is not None:
        kv = kv_head.to(device=device, dtype=torch.int32).contiguous()
        if tuple(kv.shape) != (H,):
            raise AttnkitError(f"kv_head must have shape [{H}], got {list(kv.shape)}")
        return kv
    if Hkv == H:
        return torch.arange(H, dtype=torch.int32, device=device)
    if Hkv < 1 or H % Hkv:
        raise AttnkitError(f"k and v have {Hkv} heads, which do not divide q's {H}: pass kv_head")
    return torch.div(torch.arange(H, device=device), H // Hkv, rounding_mode="floor").to(torch.int32)


def _opt(t, dtype, device):
    return None if t is None else t.to(device=device, dtype=dtype).contiguous()


def fused_attention(q, k, v, lengths, *args, block_m: int | None = None, block_n: int | None = None, **params):
    """The op's Triton implementation: (out B×L×H×D in q's dtype, features B×H×F fp32 or B×H×0).

    q: B×H×L×D fp16/bf16 (D a power of two ≥ 16); k, v: B×Hkv×L×D. The other arguments are the op's (by position
    in the schema's order, or by keyword: `attnkit.reference.AttentionParams`); their values are those the op's other
    backends take (checked by `attnkit.ops.attention` before it gets here). With `sink`, the features end with
    one more column, `sink` (its mass per row, averaged like the others; 0 under a key scale).
    """
    p = AttentionParams(*args, **params)
    num_windows, want_features, sliding_window, softcap = p.num_windows, p.want_features, p.sliding_window, p.softcap
    if p.cross or p.bias is not None:
        raise AttnkitError("the Triton kernel takes neither cross-attention (key_lengths) nor a bias: "
                           "attnkit.ops.attention runs those on the reference (docs/cuda.md)")
    if p.grid is not None and p.want_features:
        raise AttnkitError("the Triton kernel does not measure an image's patch grid (grid): attnkit.ops.attention "
                           "runs such calls on the reference (docs/cuda.md)")
    if p.alignment and p.want_features:
        raise AttnkitError("the Triton kernel does not measure the alignment features (alignment): "
                           "attnkit.ops.attention runs such calls on the reference (docs/cuda.md)")
    if q.dtype not in _DTYPES:
        raise AttnkitError(f"the Triton kernel takes float16 or bfloat16 inputs, got {q.dtype}")
    B, H, L, D = q.shape
    Hkv = k.shape[1]
    if D < 16 or D & (D - 1):
        raise AttnkitError(f"the Triton kernel needs a head dim that is a power of two >= 16, got {D}")
    p.check_layout(q, k, v, lengths)  # the op's contract, as every backend checks it
    if p.symmetric_window:  # untested on a GPU: attnkit.ops.attention runs it on the reference (docs/cuda.md)
        raise AttnkitError("the Triton kernel does not take symmetric_window (a bidirectional sliding window); "
                           "attnkit.ops.attention runs such calls on the reference")
    dev = q.device
    scaling = D ** -0.5 if p.scaling is None else p.scaling
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    F = num_features(num_windows) + (1 if p.sink is not None else 0)
    out = torch.empty((B, L, H, D), dtype=q.dtype, device=dev)
    if B == 0 or H == 0 or L == 0:
        return out, torch.zeros((B, H, F if want_features else 0), dtype=torch.float32, device=dev)
    bm = block_m or (16 if INTERPRET else GPU_BLOCK_M)
    bn = block_n or (16 if INTERPRET else GPU_BLOCK_N)
    nblk = triton.cdiv(L, bm)
    pf = F + 2  # + the CLS-row count and the undefined-row count
    part = torch.empty((B, H, nblk, pf) if want_features else (1,), dtype=torch.float32, device=dev)
    lengths = lengths.to(device=dev, dtype=torch.int64).contiguous()
    tc = _opt(p.token_class, torch.int32, dev)
    sid = _opt(p.sentence_id, torch.int32, dev)
    md = _opt(p.mode, torch.int32, dev)
    rg = _opt(p.region, torch.int32, dev)
    gt = _opt(p.gates, torch.float32, dev)
    ks = _opt(p.key_scale, torch.float32, dev) if want_features else None
    sk = _opt(p.sink, torch.float32, dev)
    kvh = _kv_heads(p.kv_head, H, Hkv, dev)
    dummy = lengths  # a pointer for the arguments a constexpr flag switches off
    in_dtype = _DTYPES[q.dtype]
    num_windows = int(num_windows)
    _fused_attention_kernel[(nblk, B * H)](
        q, k, v, out, lengths, tc if tc is not None else dummy, sid if sid is not None else dummy,
        md if md is not None else dummy, rg if rg is not None else dummy, gt if gt is not None else dummy,
        ks if ks is not None else dummy, kvh, sk if sk is not None else dummy, part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        H, L, nblk, pf, num_windows, float(scaling) * LOG2E, float(softcap or 1.0) * LOG2E,
        float(scaling) / float(softcap or 1.0), int(sliding_window or 0),
        D=D, BM=bm, BN=bn, WB=triton.next_power_of_2(num_windows + 1),
        FEATURES=bool(want_features), HAS_TC=tc is not None, HAS_SID=sid is not None, HAS_MODE=md is not None,
        HAS_REGION=rg is not None, HAS_GATES=gt is not None, HAS_KS=ks is not None, HAS_SINK=sk is not None,
        CAUSAL=bool(p.causal), HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        RENORM=bool(p.renormalize), IN_DTYPE=in_dtype, DOT_DTYPE=tl.float32 if INTERPRET else in_dtype,
        DOT_PRECISION="ieee" if INTERPRET else None, TAU=TAU,
        **({} if INTERPRET else {"num_warps": GPU_WARPS, "num_stages": GPU_STAGES}),
    )
    if not want_features:
        return out, torch.zeros((B, H, 0), dtype=torch.float32, device=dev)
    return out, finalize_features(part, lengths, num_windows)


def compile_for_gpu(arch: int = 90, dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, num_windows: int = 16,
                    block_m: int = GPU_BLOCK_M, block_n: int = GPU_BLOCK_N, **flags):
    """The kernel compiled ahead of time for an NVIDIA GPU of compute capability `arch` (no GPU needed: Triton's
    own ptxas), with the constexpr `flags` given (FEATURES=True, CAUSAL=True, ...; the others False). Returns
    Triton's compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`). Not under the interpreter."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRET:
        raise AttnkitError("compile_for_gpu needs the compiler: unset TRITON_INTERPRET")
    fn = _fused_attention_kernel
    tdt = _DTYPES[dtype]
    names = ("FEATURES", "HAS_TC", "HAS_SID", "HAS_MODE", "HAS_REGION", "HAS_GATES", "HAS_KS", "HAS_SINK", "CAUSAL",
             "HAS_WINDOW", "HAS_SOFTCAP", "RENORM")
    unknown = set(flags) - set(names)
    if unknown:
        raise AttnkitError(f"unknown kernel flags {sorted(unknown)}: use {', '.join(names)}")
    const = dict(D=head_dim, BM=block_m, BN=block_n, WB=triton.next_power_of_2(num_windows + 1),
                 IN_DTYPE=tdt, DOT_DTYPE=tdt, DOT_PRECISION=None, TAU=TAU, **{n: bool(flags.get(n)) for n in names})
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LEN": "*i64", "TC": "*i32", "SID": "*i32",
           "MODE": "*i32", "REGION": "*i32", "GATES": "*fp32", "KS": "*fp32", "KVH": "*i32", "SINK": "*fp32",
           "PART": "*fp32"}
    ptr.update({n: "*fp16" for n in ("Q", "K", "V", "O")} if dtype == torch.float16 else {})
    sig = {n: ptr.get(n) or ("constexpr" if n in const else
                             "fp32" if n in ("scale_log2", "softcap_log2", "inv_softcap") else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": GPU_WARPS, "num_stages": GPU_STAGES})


def finalize_features(part: torch.Tensor, lengths: torch.Tensor, num_windows: int) -> torch.Tensor:
    """B×H×F features from the kernel's B×H×blocks×(F + 2) partial sums: summed over the blocks in a fixed order
    (bit-identical run to run), divided by the sample's length (cls_entropy: by its number of CLS rows), NaN
    for a (sample, head) with an undefined valid row (the reference's numerics policy)."""
    tot = part.sum(2)  # B×H×(F + 2)
    F = tot.shape[-1] - 2
    n = lengths.to(torch.float32).clamp(min=1).view(-1, 1, 1)
    feats = tot[..., :F] / n
    ce = 5 + num_windows + 6  # cls_entropy: the mean over the CLS rows
    feats[..., ce] = tot[..., ce] / tot[..., F].clamp(min=1)
    return torch.where(tot[..., F + 1:F + 2] > 0, float("nan"), feats)


__all__ = ["fused_attention", "finalize_features", "compile_for_gpu", "INTERPRET"]
