"""An emulation of the tile algorithm of the single-pass CUDA kernel (csrc/cuda/fused_attention_v2_kernel.cuh).

It checks the kernel's *algorithm* where no GPU exists (tests/test_emulate_v2.py compares it with
attnkit.reference on adversarial lengths); the CUDA code itself is tested on a GPU by
tests/test_fused_cuda.py. What it reproduces, step for step, in fp32:

* blocks of 64 query rows, key tiles of 64 visited in ascending order, keys beyond n masked to -inf in the
  tail tile only;
* the m16n8 accumulator layout: a row is shared by the four threads of a quad, and quad lane q holds the
  key columns 8k + 2q and 8k + 2q + 1 of every tile, visited in that order;
* the online row max in log2 units, and the rescaling of *every* running sum by 2^(m_old − m_new): the
  softmax and kept sums, the feature mass, the entropy term A (A ← 2^−δ·(A − δ·zf)), intra, prev, next,
  the pending run-length sum and the row's bucket copies in shared memory;
* the exponent base 0 while every score so far is -inf;
* the run-length bucket sums (class, self, window) per thread, flushed into the thread's own copy when the
  bucket changes, and the final quad sums;
* the output normaliser (kept sum when renormalising a region), the features' own normaliser (the weighted
  kept sum under a key scale), entropy = (zf/Zf)·ln Zf − ln 2·A/Zf, max = 2^(mf − m)/Zf;
* the window cuts: where a warp's vote passes, the window of a key is w_lo + (d >= cut) (no division), checked here
  against the division for every key it applies to;
* the block's reduction over valid rows and the final division by n (cls_entropy: by the CLS rows).

Keep it in step with the kernel when the kernel's math changes.

    python tools/emulate_v2_kernel.py     # prints the largest differences against reference_attention
"""
from __future__ import annotations

import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from attnkit.features import (  # noqa: E402
    ALL,
    CLS,
    KEEP,
    NO_INTRA,
    OTHER,
    PERIOD,
    UNIFORM,
    ZERO,
    num_features,
)

BLOCK_M, BLOCK_N, QUAD = 64, 64, 4
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
SLOT_SELF, SLOT_WIN0 = 4, 5


def thread_columns(q: int) -> list[int]:
    """Key columns (within a tile) of quad lane q, in the order the kernel visits them."""
    return [8 * (j // 2) + 2 * q + (j % 2) for j in range(2 * BLOCK_N // 8)]


def window_cuts(rows: torch.Tensor, key0: int, n: int, N: int):
    """The kernel's window cuts for one tile: per (row, quad lane) the lowest window w_lo of the lane's keys and the
    first distance of window w_lo + 1, and which rows take the cut path (every lane of their warp's 16 rows sees its
    keys on one side, spanning at most two windows: the warp vote)."""
    lo = torch.zeros(len(rows), QUAD, dtype=torch.long)
    at = torch.zeros(len(rows), QUAD, dtype=torch.long)
    ok = torch.ones(len(rows), QUAD, dtype=torch.bool)
    for ql in range(QUAD):
        cols = thread_columns(ql)
        first, last = key0 + min(cols), key0 + max(cols)
        right = first > rows
        ok[:, ql] = right | (last < rows)
        d_min = torch.where(right, first - rows, rows - last).clamp(min=0)
        d_max = torch.where(right, last - rows, rows - first).clamp(min=0)
        w_lo = torch.div(d_min * N, n, rounding_mode="floor").clamp(max=N - 1)
        w_hi = torch.div(d_max * N, n, rounding_mode="floor").clamp(max=N - 1)
        ok[:, ql] &= w_hi - w_lo <= 1
        lo[:, ql] = w_lo
        at[:, ql] = torch.where(w_lo >= N - 1, 2**31 - 1, torch.div((w_lo + 1) * n + N - 1, N, rounding_mode="floor"))
    vote = ok.view(-1, 16 * QUAD).all(1).repeat_interleave(16)  # one warp: 16 rows × 4 quad lanes
    return lo, at, vote


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def emulate(q, k, v, lengths, token_class=None, sentence_id=None, *, scaling, num_windows=16, mode=None,
            region=None, renormalize=False, gates=None, key_scale=None):
    """(out B×L×H×D fp32, features B×H×F fp32) as the v2 kernel computes them, on the CPU."""
    B, H, L, D = q.shape
    N = num_windows
    FB = 5 + N
    F = num_features(N)
    q, k, v = (t.float() for t in (q, k, v))
    token_class = torch.zeros(B, L, dtype=torch.int64) if token_class is None else token_class.long()
    sentence_id = torch.zeros(B, L, dtype=torch.int64) if sentence_id is None else sentence_id.long()
    out = torch.zeros(B, L, H, D)
    feats = torch.zeros(B, H, F)
    scale_log2 = _f32(scaling * LOG2E)
    for b in range(B):
        n = max(1, min(int(lengths[b]), L))
        n_tiles = (n + BLOCK_N - 1) // BLOCK_N
        n_cls = int((token_class[b, :n] == CLS).sum())
        for h in range(H):
            md = KEEP if mode is None else int(mode[h])
            rg = ALL if region is None else int(region[h])
            gate = 1.0 if gates is None else float(gates[h])
            if md == ZERO:
                continue  # output 0, features 0
            use_scores = md == KEEP
            renorm_kept = renormalize and rg != ALL
            g_row = None if key_scale is None else key_scale[b, h].float()
            sums = torch.zeros(F)
            for row0 in range(0, L, BLOCK_M):
                rows = torch.arange(row0, row0 + BLOCK_M)
                valid = rows < n
                rsid = torch.where(rows < L, sentence_id[b, rows.clamp(max=L - 1)], 0)
                # per (row, quad lane) thread state
                shape = (BLOCK_M, QUAD)
                m_run = torch.full((BLOCK_M,), -math.inf if use_scores else 0.0)
                l_run, lk_run, zf, ent_a, intra, prev, nxt, run_acc = (torch.zeros(shape) for _ in range(8))
                mf = torch.full(shape, -math.inf)
                run_bucket = torch.full(shape, -1, dtype=torch.int64)
                buckets = torch.zeros(BLOCK_M, FB, QUAD)
                o = torch.zeros(BLOCK_M, D)
                qb = torch.zeros(BLOCK_M, D)
                qb[: max(0, min(L - row0, BLOCK_M))] = q[b, h, row0:row0 + BLOCK_M]
                for tile in range(n_tiles):
                    key0 = tile * BLOCK_N
                    keys = torch.arange(key0, key0 + BLOCK_N)
                    in_n = keys < n
                    kt = torch.zeros(BLOCK_N, D)
                    vt = torch.zeros(BLOCK_N, D)
                    kt[in_n] = k[b, h, keys[in_n]]
                    vt[in_n] = v[b, h, keys[in_n]]
                    kc = torch.where(in_n, token_class[b, keys.clamp(max=L - 1)], 0)
                    ks = torch.where(in_n, sentence_id[b, keys.clamp(max=L - 1)], 0)
                    gk = torch.ones(BLOCK_N) if g_row is None else torch.where(in_n, g_row[keys.clamp(max=L - 1)], 0.0)
                    x = (qb @ kt.T) * scale_log2 if use_scores else torch.zeros(BLOCK_M, BLOCK_N)
                    x[:, ~in_n] = -math.inf
                    if use_scores:
                        m_new = torch.maximum(m_run, x.max(1).values)
                        grow = m_new > m_run
                        first = m_run == -math.inf
                        sc = torch.where(first, 0.0, torch.exp2(m_run - m_new))
                        resc = grow & ~first
                        delta = (m_new - m_run)[:, None]
                        r2, r1 = resc[:, None], resc
                        ent_a = torch.where(r2, sc[:, None] * (ent_a - delta * zf), ent_a)
                        for t in (l_run, lk_run, zf, intra, prev, nxt, run_acc):
                            t.copy_(torch.where(r2, sc[:, None] * t, t))
                        o = torch.where(r1[:, None], sc[:, None] * o, o)
                        buckets = torch.where(r1[:, None, None], sc[:, None, None] * buckets, buckets)
                        m_run = torch.where(grow, m_new, m_run)
                    m_use = torch.where(m_run == -math.inf, 0.0, m_run)
                    p = torch.zeros(BLOCK_M, BLOCK_N)
                    cut_lo, cut_at, cut_rows = window_cuts(rows, key0, n, N)
                    for ql in range(QUAD):
                        for col in thread_columns(ql):
                            t = key0 + col
                            xr = x[:, col] - m_use
                            e = torch.exp2(xr)
                            same = ks[col] == rsid
                            keep = torch.ones_like(same) if rg == ALL else (same != (rg == NO_INTRA))
                            po = torch.where(keep, e, 0.0)
                            l_run[:, ql] += e
                            lk_run[:, ql] += po
                            p[:, col] = po
                            pf = po * gk[col]
                            lg = torch.log2(gk[col]) if key_scale is not None else _f32(0.0)
                            zf[:, ql] += pf
                            ent_a[:, ql] += pf * torch.clamp(xr + lg, min=-1e30)
                            intra[:, ql] += torch.where(same, pf, 0.0)
                            if key_scale is not None or rg != ALL:
                                peak = torch.maximum(mf[:, ql], x[:, col] + lg)  # the scaled score itself
                                mf[:, ql] = torch.where(keep, peak, mf[:, ql])
                            c = int(kc[col])
                            c = OTHER if c < OTHER or c > PERIOD else c
                            if c != OTHER:
                                bucket = torch.full((BLOCK_M,), c - 1)
                            else:
                                d = (t - rows).abs()
                                w = torch.div(d * N, n, rounding_mode="floor").clamp(max=N - 1)
                                bucket = torch.where(d == 0, SLOT_SELF, SLOT_WIN0 + w)
                                # the kernel's cut path (warps whose vote passed) must give the same windows
                                by_cut = SLOT_WIN0 + cut_lo[:, ql] + (d >= cut_at[:, ql]).long()
                                assert torch.equal(by_cut[cut_rows], bucket[cut_rows]), "window cut path differs"
                            prev[:, ql] += torch.where(rows - 1 == t, pf, 0.0)
                            nxt[:, ql] += torch.where(rows + 1 == t, pf, 0.0)
                            change = bucket != run_bucket[:, ql]  # rows past n too: the reduction drops them
                            flush = change & (run_bucket[:, ql] >= 0)
                            idx = flush.nonzero().flatten()
                            buckets[idx, run_bucket[idx, ql], ql] += run_acc[idx, ql]
                            run_acc[:, ql] = torch.where(change, pf, run_acc[:, ql] + pf)
                            run_bucket[:, ql] = torch.where(change, bucket, run_bucket[:, ql])
                    o = o + p @ vt
                # finish the rows
                for ql in range(QUAD):
                    idx = (valid & (run_bucket[:, ql] >= 0)).nonzero().flatten()
                    buckets[idx, run_bucket[idx, ql], ql] += run_acc[idx, ql]
                l, lk = l_run.sum(1), lk_run.sum(1)
                z_out = lk if renorm_kept else l
                inv_out = torch.where(z_out > 0, 1.0 / z_out, torch.where(z_out.isnan(), z_out, 0.0))
                stop = min(BLOCK_M, L - row0)
                out[b, row0:row0 + stop, h] = (o * (inv_out * gate)[:, None])[:stop]
                z, a = zf.sum(1), ent_a.sum(1)
                zfeat = z if key_scale is not None else z_out
                undefined = ~((l > 0) & (l < math.inf)) | a.isnan()
                if not use_scores:
                    undefined = torch.zeros(BLOCK_M, dtype=torch.bool)
                inv = torch.where(zfeat > 0, 1.0 / zfeat, 0.0)
                inv = torch.where(undefined, math.nan, inv)
                entropy = torch.where(zfeat > 0, (z * inv) * torch.log(zfeat) - LN2 * a * inv, 0.0)
                peak = mf.max(1).values if (key_scale is not None or rg != ALL) else m_run
                max_w = torch.where(peak > -math.inf, torch.exp2(peak - m_run) * inv, 0.0)
                if (undefined & valid).any():
                    sums[:] = math.nan
                bsum = buckets.sum(2) * inv[:, None]
                row_feats = torch.stack([prev.sum(1) * inv, nxt.sum(1) * inv, entropy, max_w, intra.sum(1) * inv,
                                         (z - intra.sum(1)) * inv], 1)
                is_cls = torch.zeros(BLOCK_M, dtype=torch.bool)
                in_l = rows < L
                is_cls[in_l] = token_class[b, rows[in_l]] == CLS
                cls_ent = torch.where(is_cls, entropy, 0.0)
                block = torch.cat([bsum, row_feats, cls_ent[:, None]], 1)
                sums += torch.where(valid[:, None], block, 0.0).sum(0)
            sums[:-1] /= n
            sums[-1] /= max(n_cls, 1)
            feats[b, h] = sums
    return out, feats


def main() -> None:
    from attnkit.reference import reference_attention

    torch.manual_seed(0)
    B, H, L, D = 2, 6, 150, 16
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    lengths = torch.tensor([150, 65])
    tc = torch.zeros(B, L, dtype=torch.int32)
    tc[:, 0] = CLS
    tc[:, 10::13] = 3
    tc[:, 7::17] = PERIOD
    sid = torch.zeros(B, L, dtype=torch.int32)
    sid[0, 70:] = 1
    sid[1, 30:] = 1
    mode = torch.tensor([KEEP, KEEP, KEEP, UNIFORM, UNIFORM, ZERO], dtype=torch.int32)
    region = torch.tensor([ALL, NO_INTRA, 2, ALL, NO_INTRA, ALL], dtype=torch.int32)
    for renorm in (False, True):
        for key_scale in (None, torch.rand(B, H, L)):
            args = dict(scaling=D ** -0.5, mode=mode, region=region, renormalize=renorm, key_scale=key_scale)
            ref_out, ref_f = reference_attention(q, k, v, lengths, tc, sid, want_features=True, **args)
            out, f = emulate(q, k, v, lengths, tc, sid, **args)
            print(f"renormalize={renorm} key_scale={key_scale is not None}: out max diff "
                  f"{(out - ref_out).abs().max():.2e}, features max diff {(f - ref_f).abs().max():.2e}")


if __name__ == "__main__":
    main()
