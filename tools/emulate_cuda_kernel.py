"""A slow, line-by-line NumPy emulation of csrc/cuda/fused_attention_kernel.cuh, checked against the reference.

Not a test of the CUDA code itself (that needs a GPU: tests/test_fused_cuda.py); it checks the kernel's
*algorithm* where no GPU exists: per-thread halves of 32 keys, per-tile online max/sum with the kept sum
or count, the half combination, Z / log Z of the final weights, run-length window buckets flushed to the
block accumulator, the feature index layout (prev .. cls_entropy after the windows) and the final
division; and the decoder arguments (the visited key tiles of a causal / windowed block, the keys each row sees,
the KV head of each query head, soft-capping, the sink merged into the max and the denominators and its
feature). Keep it in step with the kernel when the kernel's math changes.

    python tools/emulate_cuda_kernel.py     # prints max differences against reference_attention
"""
import math
import sys

import numpy as np
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from attnkit.reference import reference_attention

BM, BN = 64, 64
def window_of(d, N, n):
    w = int(np.float32(d) * np.float32(N) / np.float32(n))
    dn = d * N
    if w * n > dn: w -= 1
    elif (w + 1) * n <= dn: w += 1
    return min(w, N - 1)
def kernel(q, k, v, lengths, tc, sid, scaling, N, mode, region, renorm, gates, kv_head=None, causal=False, window=0,
           softcap=0.0, sink=None):
    B, H, L, D = q.shape
    F0 = 5 + N + 7
    F = F0 + (sink is not None)
    out = np.zeros((B, L, H, D), np.float32); feats = np.zeros((B, H, F), np.float32)
    for b in range(B):
        n = max(1, min(int(lengths[b]), L))
        for h in range(H):
            md, rg = int(mode[h]), int(region[h])
            if md == 1: continue
            kvh = h if kv_head is None else int(kv_head[h])
            S = (q[b, h] @ k[b, kvh].T).astype(np.float32) * np.float32(scaling)
            if softcap > 0: S = np.float32(softcap) * np.tanh(S / np.float32(softcap))
            use_scores = md == 0; need_kept = renorm and rg != 0
            KPT = BN // 2
            def hi_of(row, n=n): return min(n, row + 1) if causal else n
            def lo_of(row, n=n): return min(max(0, row - window + 1) if window > 0 else 0, hi_of(row, n))
            for row0 in range(0, L, BM):
                feat_s = np.zeros(F, np.float32)
                kt_begin = lo_of(row0) // BN
                kt_end = (hi_of(min(row0 + BM, L) - 1) + BN - 1) // BN
                for r in range(BM):
                    s = row0 + r
                    if s >= L: continue
                    rsid = sid[b, s]; rcls = tc[b, s]
                    key_lo, key_hi = lo_of(s), hi_of(s)
                    halves = []
                    for half in range(2):
                        m, l, lk, ck = -np.inf, 0.0, 0.0, 0
                        for kt in range(kt_begin, kt_end):
                            keys = [kt * BN + half * KPT + j for j in range(KPT)]
                            keys = [t for t in keys if key_lo <= t < key_hi]
                            if use_scores:
                                if not keys: continue
                                mloc = max(S[s, t] for t in keys); mn = max(m, mloc)
                                sc = math.exp(m - mn) if m > -np.inf else 0.0
                                l *= sc; lk *= sc; m = mn
                                for t in keys:
                                    e = math.exp(S[s, t] - m); l += e
                                    keep = rg == 0 or ((sid[b, t] == rsid) != (rg == 1))
                                    if need_kept and keep: lk += e
                            elif need_kept:
                                ck += sum(1 for t in keys if (rg == 0 or ((sid[b, t] == rsid) != (rg == 1))))
                        halves.append((m, l, lk, ck))
                    (m1, l1, lk1, c1), (m2, l2, lk2, c2) = halves
                    m = max(m1, m2)
                    s1 = 0 if m1 == -np.inf else math.exp(m1 - m); s2 = 0 if m2 == -np.inf else math.exp(m2 - m)
                    l = l1 * s1 + l2 * s2; lk = lk1 * s1 + lk2 * s2; ck = c1 + c2
                    e_sink = 0.0
                    if use_scores and sink is not None:  # the sink joins the max and the denominators
                        mn = max(m, float(sink[h])); sc = 0.0 if m == -np.inf else math.exp(m - mn)
                        l *= sc; lk *= sc; m = mn
                        e_sink = math.exp(float(sink[h]) - m); l += e_sink; lk += e_sink
                    if use_scores:
                        z = lk if need_kept else l; inv_z = 1 / z if z > 0 else 0; log_z = math.log(z) if z > 0 else 0
                    else:
                        c = ck if need_kept else key_hi - key_lo; inv_z = 1 / c if c > 0 else 0; log_z = math.log(c) if c > 0 else 0
                    acc = np.zeros(11); o = np.zeros(D)
                    for half in range(2):
                        wcur, wacc = -1, 0.0
                        for kt in range(kt_begin, kt_end):
                            for j in range(KPT):
                                t = kt * BN + half * KPT + j
                                w = 0.0
                                if key_lo <= t < key_hi:
                                    same = sid[b, t] == rsid
                                    keep = rg == 0 or (same != (rg == 1))
                                    if use_scores:
                                        e = S[s, t] - m; w = math.exp(e) * inv_z if keep else 0; logw = e - log_z
                                    else:
                                        w = inv_z if keep else 0; logw = -log_z
                                    if s < n and w > 0:
                                        kc = tc[b, t]
                                        if 1 <= kc <= 4: acc[kc - 1] += w
                                        elif t == s: acc[4] += w
                                        else:
                                            wi = window_of(abs(s - t), N, n)
                                            if wi != wcur:
                                                if wcur >= 0: feat_s[5 + wcur] += wacc
                                                wcur, wacc = wi, w
                                            else: wacc += w
                                        if t == s - 1: acc[5] += w
                                        if t == s + 1: acc[6] += w
                                        acc[7] -= w * logw; acc[8] = max(acc[8], w)
                                        if same: acc[9] += w
                                        else: acc[10] += w
                                if t < L and w: o += w * v[b, kvh, t]
                        if wcur >= 0: feat_s[5 + wcur] += wacc
                    out[b, s, h] = o * gates[h]
                    if s < n:
                        feat_s[:5] += acc[:5]; feat_s[N + 5:N + 11] += acc[5:11]
                        if rcls == 1: feat_s[N + 11] += acc[7]
                        if sink is not None: feat_s[F0] += e_sink * inv_z
                feats[b, h] += feat_s
        ncls = max(1, int(sum(tc[b, :n] == 1)))
        feats[b] /= n; feats[b, :, F0 - 1] *= n / ncls
    return out, feats

torch.manual_seed(0)
B, H, L, D = 2, 9, 150, 16
q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
lengths = torch.tensor([150, 67])
tc = torch.zeros(B, L, dtype=torch.int32); tc[:, 0] = 1; tc[0, 149] = 2; tc[1, 66] = 2; tc[:, 10::13] = 3; tc[:, 7::17] = 4
sid = torch.zeros(B, L, dtype=torch.int32); sid[0, 70:] = 1; sid[1, 30:] = 1; sid[1, 50:] = 2
mode = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=torch.int32); region = torch.tensor([0, 1, 2] * 3, dtype=torch.int32)
gates = torch.linspace(0.5, 1.5, H)
for N in (16, 5):
  for renorm in (False, True):
    ref_out, ref_f = reference_attention(q, k, v, lengths, tc, sid, scaling=D ** -0.5, num_windows=N, mode=mode,
                                         region=region, renormalize=renorm, gates=gates, want_features=True)
    out, f = kernel(q.numpy(), k.numpy(), v.numpy(), lengths.numpy(), tc.numpy(), sid.numpy(), D ** -0.5, N,
                    mode.numpy(), region.numpy(), renorm, gates.numpy())
    print(N, renorm, "out maxdiff", np.abs(out - ref_out.numpy()).max(), "feat maxdiff", np.abs(f - ref_f.numpy()).max(),
          "feat max rel", (np.abs(f - ref_f.numpy()) / (np.abs(ref_f.numpy()) + 1e-6)).max())

# the decoder arguments (csrc/cuda/fused_attention_kernel.cuh, "Decoder arguments" in docs/cuda.md)
Hkv = 3
k3, v3 = (torch.randn(B, Hkv, L, D) for _ in range(2))
kv_head = torch.tensor([0, 0, 0, 1, 2, 2, 2, 1, 0], dtype=torch.int32)
sink = torch.linspace(-1.0, 2.0, H)
for kw in (dict(causal=True), dict(causal=True, window=20, softcap=2.0, sink=sink), dict(window=70, sink=sink)):
  for renorm in (False, True):
    ref_out, ref_f = reference_attention(q, k3, v3, lengths, tc, sid, scaling=D ** -0.5, num_windows=5, mode=mode,
                                         region=region, renormalize=renorm, gates=gates, want_features=True,
                                         kv_head=kv_head, causal=kw.get("causal", False),
                                         sliding_window=kw.get("window"), softcap=kw.get("softcap"), sink=kw.get("sink"))
    out, f = kernel(q.numpy(), k3.numpy(), v3.numpy(), lengths.numpy(), tc.numpy(), sid.numpy(), D ** -0.5, 5,
                    mode.numpy(), region.numpy(), renorm, gates.numpy(), kv_head=kv_head.numpy(),
                    causal=kw.get("causal", False), window=kw.get("window", 0), softcap=kw.get("softcap", 0.0),
                    sink=None if kw.get("sink") is None else kw["sink"].numpy())
    print(sorted(kw), renorm, "out maxdiff", np.abs(out - ref_out.numpy()).max(), "feat maxdiff",
          np.abs(f - ref_f.numpy()).max())
