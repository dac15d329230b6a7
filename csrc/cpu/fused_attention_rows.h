// The tasks of the CPU kernel of attnkit::fused_attention (csrc/cpu/fused_attention_kernel.h says how the
// kernel is split; semantics: attnkit/reference.py). Included only by the units built once per instruction
// set (csrc/cpu/capability/*.cpp), which define CPU_CAPABILITY first.
//
// A task is (sample b, head h, tile of TQ query rows). Row s sees the keys [lo_s, hi_s): hi_s = n (causal:
// min(n, s + 1)), lo_s = 0 (sliding window W: max(0, s − W + 1)). Both bounds grow with s, so the tile's rows
// see only keys [lo of its first row, hi of its last row): the task computes S = Q_tile · K[that range]ᵀ into a
// per-thread buffer with BLAS and never touches the keys outside it (a causal forward skips the tiles above
// the diagonal: about half the work of a full one). Then, row by row and in one vectorised pass over the keys
// the row sees, the softmax numerators e = exp(s − max) (soft-capped scores first; a sink logit joins the max
// and the denominator), the intervention (uniform mode replaces e by 1, the region zeroes the dropped keys)
// and the sums the features need. Every feature is linear in the row's weights except the entropy, which
// follows in closed form from the same sums, so the row is never normalised: the row's factor c (1/Z, or
// 1/Σkept with renormalize; the sink's numerator counts in both) multiplies the features and, after the
// second BLAS product O_tile = E · V[range], the output rows (together with the head's gate). Nothing of size
// L×L exists beyond the per-thread tile.
#pragma once

#include "vec_util.h"

#include "fused_attention_kernel.h"

#include "../feature_slots.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attnkit::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int kAll = kRegionAll, kNoIntra = kRegionNoIntra, kNoInter = kRegionNoInter;

struct RowStats {
  float Z, Zk, S2, I, Mx;
  float Es;  // the sink's numerator exp(sink − m) (0 without a sink, and in uniform mode)
  // The row's softmax is undefined (a NaN or +inf score, or every score −inf; a NaN or +inf sink):
  // numerics policy in attnkit/reference.py — the row's output and its (sample, head)'s features become NaN.
  bool undefined;
};

// One pass over the len scores a row sees (in place → numerators e, dropped keys 0). REGION: kAll,
// kNoIntra, kNoInter. sidf: those keys' sentence ids as floats (needed when FEAT or REGION != kAll); they
// are dense per-sample ranks, so comparing them as floats is exact. sink: the head's sink logit, −inf
// for none.
template <bool FEAT, int REGION>
RowStats row_pass(float* x, int64_t len, bool uniform, const float* sidf, float sid_s, float sink) {
  // A +inf score or all −inf show in m (so may a NaN: at::vec::maximum propagates it, std::max in the
  // scalar tail does not); NaN scores are also flagged lane by lane below. A −inf score among finite
  // ones is fine: its weight is 0, as in torch.softmax.
  const float m = uniform ? 0.f : std::max(range_max(x, len), sink);
  if (!uniform && (!std::isfinite(m) || std::isnan(sink))) {
    RowStats r{};
    r.undefined = true;
    return r;
  }
  Vec mv(m), one(1.f), zero(0.f), sv(sid_s);
  Vec Zv(0.f), Zkv(0.f), S2v(0.f), Iv(0.f), Mxv(0.f), NaNv(0.f);
  int64_t i = 0;
  for (; i + kW <= len; i += kW) {
    const Vec xv = Vec::loadu(x + i);
    if (!uniform) NaNv = NaNv | xv.isnan();  // all-ones lanes where a score is NaN
    Vec y = uniform ? zero : xv - mv;
    Vec e = uniform ? one : y.exp_u20();
    Zv = Zv + e;
    if constexpr (FEAT || REGION != kAll) {
      Vec same = Vec::loadu(sidf + i).eq(sv);
      if constexpr (REGION == kNoIntra) e = e * (one - same);
      if constexpr (REGION == kNoInter) e = e * same;
      if constexpr (REGION != kAll) Zkv = Zkv + e;
      if constexpr (FEAT) {
        // Σ e·y over the row; a −inf score (weight 0) must add 0, not 0·(−inf) = NaN
        S2v = at::vec::fmadd(e, at::vec::maximum(y, Vec(-1e30f)), S2v);
        Iv = at::vec::fmadd(e, same, Iv);
        Mxv = at::vec::maximum(Mxv, e);
      }
    }
    e.store(x + i);
  }
  auto sum = [](Vec& v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); };
  RowStats r{sum(Zv), 0.f, 0.f, 0.f, 0.f, 0.f, NaNv.zero_mask() != (1 << kW) - 1};
  if constexpr (REGION != kAll) r.Zk = sum(Zkv);
  if constexpr (FEAT) {
    r.S2 = sum(S2v);
    r.I = sum(Iv);
    r.Mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, Mxv);
  }
  for (; i < len; ++i) {
    float y = uniform ? 0.f : x[i] - m;
    if (!uniform && std::isnan(x[i])) r.undefined = true;
    float e = uniform ? 1.f : std::exp(y);
    r.Z += e;
    if constexpr (FEAT || REGION != kAll) {
      float same = sidf[i] == sid_s ? 1.f : 0.f;
      if constexpr (REGION == kNoIntra) e *= 1.f - same;
      if constexpr (REGION == kNoInter) e *= same;
      if constexpr (REGION != kAll) r.Zk += e;
      if constexpr (FEAT) {
        r.S2 += e * std::max(y, -1e30f);
        r.I += e * same;
        r.Mx = std::max(r.Mx, e);
      }
    }
    x[i] = e;
  }
  if constexpr (REGION == kAll) r.Zk = r.Z;
  // the sink takes mass (in the denominator) and adds no value; uniform heads give it none
  r.Es = uniform ? 0.f : std::exp(sink - m);
  return r;
}

using RowFn = RowStats (*)(float*, int64_t, bool, const float*, float, float);

RowFn pick_row_fn(bool feat, int region) {
  static const RowFn table[2][3] = {
      {row_pass<false, kAll>, row_pass<false, kNoIntra>, row_pass<false, kNoInter>},
      {row_pass<true, kAll>, row_pass<true, kNoIntra>, row_pass<true, kNoInter>}};
  return table[feat ? 1 : 0][region];
}

// x[0..len) = c · tanh(x / c) (Gemma 2's logit soft-capping).
void softcap_inplace(float* x, int64_t len, float c) {
  const float inv = 1.f / c;
  const Vec cv(c), iv(inv);
  int64_t i = 0;
  for (; i + kW <= len; i += kW) ((Vec::loadu(x + i) * iv).tanh() * cv).store(x + i);
  for (; i < len; ++i) x[i] = c * std::tanh(x[i] * inv);
}

}  // namespace

void fused_attention_tasks(const FusedCpuParams& p, int64_t begin, int64_t end, const FusedCpuScratch& w) {
  const int64_t H = p.H, L = p.L, D = p.D, N = p.N, TQ = p.TQ;
  const int64_t R = kNumBucketSlots(int(N));  // first per-row feature slot
  const int64_t F0 = kNumFeatures(int(N));
  const int64_t os_row = H * D;  // stride between query rows of one (b, h) in B×L×H×D
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* S = w.S;
  float* diag = w.diag;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t tile = task % p.n_tiles, bh = task / p.n_tiles, h = bh % H, b = bh / H;
    const int64_t r0 = tile * TQ, tq = std::min(TQ, L - r0);
    const int64_t n = p.n[b];
    float* o = p.out + b * L * os_row + r0 * os_row + h * D;
    if (p.mode[h] == kModeZero) {  // weights all 0: output 0, features 0
      for (int64_t r = 0; r < tq; ++r) std::fill(o + r * os_row, o + r * os_row + D, 0.f);
      continue;
    }
    const bool uniform = p.mode[h] == kModeUniform;
    // the keys row s sees: [lo(s), hi(s)), both non-decreasing in s
    auto lo_of = [&](int64_t s) { return p.window > 0 ? std::max<int64_t>(0, s - p.window + 1) : int64_t(0); };
    auto hi_of = [&](int64_t s) { return p.causal ? std::min(n, s + 1) : n; };
    const int64_t klo = std::min(lo_of(r0), hi_of(r0)), khi = hi_of(r0 + tq - 1);
    const int64_t nk = std::max<int64_t>(0, khi - klo);  // the tile's key range, ld of S
    const int64_t kvh = p.kv_head[h];
    const float* qt = p.q + b * p.qs0 + h * p.qs1 + r0 * p.qs2;
    const float* kt = p.k + b * p.ks0 + kvh * p.ks1 + klo * p.ks2;
    const float* vt = p.v + b * p.vs0 + kvh * p.vs1 + klo * p.vs2;
    // S (row-major tq×nk, ld nk) == column-major Sᵀ (nk×tq) = K[klo:khi] (nk×D) · Q_tileᵀ
    if (!uniform && nk > 0) {
      // BLAS skips the product when alpha is 0; scaling by 0 afterwards keeps NaN/inf scores NaN.
      const float alpha = p.scaling != 0.0 ? static_cast<float>(p.scaling) : 1.f;
      p.gemm('T', 'N', nk, tq, D, alpha, kt, p.ks2, qt, p.qs2, S, nk);
      if (p.scaling == 0.0) scale_inplace(S, tq * nk, 0.f);
    }
    const RowFn fn = pick_row_fn(p.want_features, p.region[h]);
    const float* sidf = p.sidf == nullptr ? nullptr : p.sidf + b * L;
    const float sink = p.sink == nullptr ? neg_inf : p.sink[h];
    const int32_t* special = p.special + 2 * p.special_at[b];
    const int64_t n_special = p.special_at[b + 1] - p.special_at[b];
    double* acc = p.want_features ? p.partial + task * p.FA : nullptr;
    bool task_undefined = false;
    for (int64_t r = 0; r < tq; ++r) {
      const int64_t s = r0 + r;
      const int64_t lo = std::min(lo_of(s), hi_of(s)), hi = hi_of(s);
      float* row = S + r * nk;
      // keys of the tile this row does not see: weight 0 (and never read as scores)
      std::fill(row, row + (lo - klo), 0.f);
      std::fill(row + (hi - klo), row + nk, 0.f);
      if (hi == lo) {  // a padded row outside the window sees nothing: weight 0, output 0
        w.row_c[r] = 0.f;
        continue;
      }
      float* x = row + (lo - klo);
      const int64_t len = hi - lo;
      if (!uniform && p.softcap > 0.f) softcap_inplace(x, len, p.softcap);
      const bool feat_row = p.want_features && s < n;
      const float* sid_row = sidf == nullptr ? nullptr : sidf + lo;
      const float sid_s = sidf == nullptr ? 0.f : sidf[s];
      const RowStats st = feat_row ? fn(x, len, uniform, sid_row, sid_s, sink)
                                   : pick_row_fn(false, p.region[h])(x, len, uniform, sid_row, sid_s, sink);
      const float zk = st.Zk + st.Es;
      const float c = st.undefined ? std::numeric_limits<float>::quiet_NaN()
                      : p.renormalize ? (zk > 0.f ? 1.f / zk : 0.f)
                                      : 1.f / (st.Z + st.Es);
      w.row_c[r] = c * p.gate[h];  // an undefined row: NaN output
      if (!feat_row) continue;
      if (st.undefined) {  // NaN features for the whole (sample, head): see fill below
        task_undefined = true;
        continue;
      }
      // --- features of row s: weights w = fc · fe[t] over t in [lo, hi) (fe indexed by key position) ---
      // fe are the numerators e (dropped keys 0) with their normaliser c; with a key scale g (norm
      // weighting) they are e·g with c = 1 / Σ e·g (the sink, having no value, gets 0), and the row's sums
      // are recomputed for them.
      const float* fe = row - klo;
      float fc = c, fZk = st.Zk, fS2 = st.S2, fI = st.I, fMx = st.Mx, fsink = c * st.Es;
      if (p.key_scale != nullptr) {
        const float* g = p.key_scale + (b * H + h) * L;
        double zg = 0.0, s2 = 0.0, in = 0.0;
        float mx = 0.f;
        for (int64_t t = lo; t < hi; ++t) {
          const float xg = fe[t] * g[t];
          w.scaled_row[t] = xg;
          zg += xg;
          if (xg > 0.f) s2 += static_cast<double>(xg) * std::log(xg);  // Σ x·ln x: the entropy term
          if (sidf != nullptr && sidf[t] == sidf[s]) in += xg;
          mx = std::max(mx, xg);
        }
        fe = w.scaled_row;
        fZk = static_cast<float>(zg);
        fc = zg > 0.0 ? static_cast<float>(1.0 / zg) : 0.f;
        fS2 = static_cast<float>(s2);
        fI = sidf != nullptr ? static_cast<float>(in) : fZk;
        fMx = mx;
        fsink = 0.f;
      }
      // Distance windows: accumulate the weighted row into diag[t − s + n − 1]; the windows are sums
      // of diag over |offset| ranges, folded once per tile. Special keys move from their window to
      // their class bucket below.
      axpy(fc, fe + lo, diag + (n - 1 - s + lo), len);
      double* a = acc;
      bool self_special = false;
      for (int64_t j = 0; j < n_special; ++j) {
        const int64_t t = special[2 * j];
        if (t < lo || t >= hi) continue;  // a key the row does not see: weight 0
        const int cl = special[2 * j + 1];
        const double wt = static_cast<double>(fc) * fe[t];
        a[class_slot(cl)] += wt;
        if (t != s) {
          const int64_t d = t > s ? t - s : s - t;
          a[kSlotFirstWindow + (d * N) / n] -= wt;
        } else {
          self_special = true;
        }
      }
      if (!self_special) a[kSlotSelf] += static_cast<double>(fc) * fe[s];
      const float T = fc * fZk;
      const float H_ent = fc > 0.f ? std::max(0.f, -fc * fS2 - fc * std::log(fc) * fZk) : 0.f;
      const float intra = fc * fI;
      a[R + kRowPrev] += s - 1 >= lo ? fc * fe[s - 1] : 0.f;
      a[R + kRowNext] += s + 1 < hi ? fc * fe[s + 1] : 0.f;
      a[R + kRowEntropy] += H_ent;
      a[R + kRowMax] += fc * fMx;
      a[R + kRowIntra] += intra;
      a[R + kRowInter] += std::max(0.f, T - intra);
      if (p.token_class != nullptr && p.token_class[b * L + s] == kClassCls) a[F0] += H_ent;
      a[F0 + 1] += fsink;
    }
    if (p.want_features && r0 < n) {  // fold the diagonal sums this tile touched into the distance windows
      double* a = acc;
      const int64_t last = std::min(r0 + tq, n) - 1;  // the tile's last valid row
      const int64_t off_lo = std::max<int64_t>(klo - last, 1 - n), off_hi = std::min<int64_t>(khi - 1 - r0, n - 1);
      for (int64_t off = off_lo; off <= off_hi; ++off) {
        if (off != 0) a[kSlotFirstWindow + ((off > 0 ? off : -off) * N) / n] += diag[n - 1 + off];
      }
      if (off_hi >= off_lo) std::fill(diag + (n - 1 + off_lo), diag + (n + off_hi), 0.f);
    }
    if (task_undefined) std::fill(acc, acc + p.FA, std::numeric_limits<double>::quiet_NaN());
    // O_tile (row-major tq×D, ld H·D) == column-major Oᵀ (D×tq) = V[klo:khi]ᵀ (D×nk) · Eᵀ (nk×tq)
    // (written into the fp32 output)
    if (nk > 0) {
      p.gemm('N', 'N', D, tq, nk, 1.f, vt, p.vs2, S, nk, o, os_row);
    } else {
      for (int64_t r = 0; r < tq; ++r) std::fill(o + r * os_row, o + r * os_row + D, 0.f);
    }
    for (int64_t r = 0; r < tq; ++r) scale_inplace(o + r * os_row, D, w.row_c[r]);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace attnkit::cpu
