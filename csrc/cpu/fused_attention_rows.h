// The tasks of the CPU kernel of attnkit::fused_attention (csrc/cpu/fused_attention_kernel.h says how the
// kernel is split; semantics: attnkit/reference.py). Included only by the units built once per instruction
// set (csrc/cpu/capability/*.cpp), which define CPU_CAPABILITY first.
//
// Flash-style blocking, as ATen's CPU flash attention and the Triton kernel (attnkit/kernels/triton_attention.py)
// do it. A task is (sample b, head h, block of BQ query rows; query row i is key position s = off + i, off = L − Lq
// being 0 except in a KV-cache step). Row s sees the keys [lo_s, hi_s): hi_s = n, the sample's keys
// (cross-attention: nk, the other sequence's; its rows s < n are the valid ones) (causal: min(n, s + 1); a symmetric
// window W: min(n, s + W)), lo_s = 0 (sliding window W: max(0, s − W + 1)); both bounds grow with s, so the block's
// rows see only keys [lo of its first row, hi of its last row), which the task streams in key blocks of BK (never
// the keys outside: a causal forward skips the blocks above the diagonal, a window those outside it). Per key block:
//   * S = Q_blk · K_blkᵀ with BLAS into a fixed per-thread tile (BQ × BK floats);
//   * per row, over the keys it sees in the block: soft-capping, the block max, and when it exceeds the row's
//     running max m (which starts at the sink logit, −inf without one), every running sum of the row — the
//     output accumulator, the softmax denominators and every feature sum — is rescaled by exp(m_old − m_new)
//     (the entropy sum A = Σ w·(s − m) also shifts by (m_old − m_new)·Σw);
//   * one vectorised pass: e = exp(s − m) in place (uniform mode: 1; the region zeroes dropped keys), with
//     Z, the kept mass, A, the max weight and the intra-sentence mass; with a key scale g (norm weighting) the
//     feature weights are e·g (A gains ln g, precomputed per key) in a row of their own;
//   * the distance windows as range sums of the row's OTHER keys (times a 0/1 mask) over each window's keys
//     (bounds from a per-sample table, no division per key; a task whose keys fit one block adds its rows to
//     per-offset sums instead and folds them once), the special keys the row sees summed per class by gathers
//     (about 10% of a text's keys: cheaper than a compare per class and key), self / prev / next read at the
//     diagonal;
//   * O_blk += E · V_blk with BLAS (beta = 1 after the first key block).
// At the end each row's factor c (1/Z, or 1/Σkept with renormalize; the sink's numerator counts in both)
// scales the output (with the head's gate) and the features, which are summed per task in a fixed order
// (determinism). Nothing of size L per row, or L×L, exists: the scratch is fixed in size.
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

// The per-row online state (floats, kRowStateSlots(N) per row). Every sum is at the exponent base m.
//   m: running max (sink included); Z: Σe over the keys seen; Zk: Σe over the kept keys (region);
//   Zf: Σw, w the feature weights (e kept, times g under a key scale); A: Σ w·(s − m + ln g);
//   Mx: max w; I: Σ w over the row's own sentence; self, prev, next; cls[4]; bad: the row's softmax is
//   undefined (a NaN or +inf score, a NaN sink); ML (slot sPad): the largest score the row saw, before any
//   soft-cap (its max logit, docs/features.md §9); Dist: Σ w·‖grid(s) − grid(t)‖ over the patch keys (a patch row
//   of an image, docs/features.md "Image heads"); Near[kRingSlots]: Σ w over the patch keys with squared grid
//   distance below 1, 4, 16, 64, and over all patch keys (the ring masses are their differences); AlOff: Σ w·|t − p|,
//   AlNear: Σ w over |t − ⌊p + 1/2⌋| <= 1 (p the row's aligned key position: alignment features); win[N].
enum : int64_t {
  sM = 0, sZ, sZk, sZf, sA, sMx, sI, sSelf, sPrev, sNext, sCls0, sCls1, sCls2, sCls3, sBad, sPad, sDist, sNear,
  sAlOff = sNear + kRingSlots, sAlNear, sWin
};
static_assert(sWin == kRowStateFixed, "kRowStateSlots counts the slots before the windows");

struct BlockSums {
  float Z, Zk, Zf, A, Mx, I;
};

// Whether exp_pass sums the max weight itself (a region or a key scale: the weights are not plain e); else it is
// exp(block max − m).
constexpr bool pass_sums_max(int region, bool ks) { return region != kAll || ks; }

// One pass over the len scores a row sees in a block (x, in place → kept numerators e). m: the row's base
// (finite); the caller has checked the scores (range_max: no NaN, no +inf). REGION: kAll, kNoIntra, kNoInter
// (needs sidf). FEAT: the feature sums; KS: feature weights e·g written to pc (g, lg = ln g aligned with x); SID:
// intra-sentence mass by comparing sidf with sid_s (dense ranks as floats: exact). The max weight Mx is summed
// only where weights are not plain e (a region or a key scale): otherwise it is exp(block max − m), which the
// caller knows (MX).
template <bool FEAT, int REGION, bool KS, bool SID>
BlockSums exp_pass(float* x, int64_t len, bool uniform, float m, const float* sidf, float sid_s, const float* g,
                   const float* lg, float* pc) {
  constexpr bool MX = pass_sums_max(REGION, KS);
  const Vec mv(m), one(1.f), zero(0.f), sv(sid_s), floor_v(-1e30f);
  Vec Zv(0.f), Zkv(0.f), Zfv(0.f), Av(0.f), Mxv(0.f), Iv(0.f);
  // full vectors, then the tail by partial loads with its missing lanes' weights set to 0 (short rows are all
  // tail: no scalar exp)
  for (int64_t i = 0; i < len; i += kW) {
    const int64_t cnt = std::min<int64_t>(kW, len - i);
    auto load = [&](const float* ptr) { return Vec::loadu(ptr + i, cnt); };  // (a full count loads a whole vector)
    const Vec y = uniform ? zero : load(x) - mv;
    Vec e = uniform ? one : y.exp_u20();
    if (cnt < kW) e = Vec::set(zero, e, cnt);
    Zv = Zv + e;
    Vec same = one;
    if constexpr (REGION != kAll || (FEAT && SID)) same = load(sidf).eq(sv);
    if constexpr (REGION == kNoIntra) e = e * (one - same);
    if constexpr (REGION == kNoInter) e = e * same;
    if constexpr (REGION != kAll) Zkv = Zkv + e;
    if constexpr (FEAT) {
      // a −inf score (weight 0) must add 0 to A, not 0·(−inf) = NaN
      const Vec yc = at::vec::maximum(y, floor_v);
      Vec w = e;
      if constexpr (KS) {
        w = e * load(g);
        w.store(pc + i, cnt);
        Zfv = Zfv + w;
        Av = at::vec::fmadd(w, yc + load(lg), Av);
      } else {
        Av = at::vec::fmadd(w, yc, Av);
      }
      if constexpr (MX) Mxv = at::vec::maximum(Mxv, w);
      if constexpr (SID) Iv = at::vec::fmadd(w, same, Iv);
    }
    e.store(x + i, cnt);
  }
  auto sum = [](Vec& v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); };
  BlockSums r{sum(Zv), 0.f, 0.f, 0.f, 0.f, 0.f};
  if constexpr (REGION != kAll) r.Zk = sum(Zkv);
  if constexpr (FEAT) {
    if constexpr (KS) r.Zf = sum(Zfv);
    r.A = sum(Av);
    if constexpr (MX) r.Mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, Mxv);
    if constexpr (SID) r.I = sum(Iv);
  }
  if constexpr (REGION == kAll) r.Zk = r.Z;
  if constexpr (!KS) r.Zf = r.Zk;
  return r;
}

using PassFn = BlockSums (*)(float*, int64_t, bool, float, const float*, float, const float*, const float*, float*);

template <bool FEAT, bool KS, bool SID>
PassFn pick_region(int region) {
  if (region == kNoIntra) return exp_pass<FEAT, kNoIntra, KS, SID>;
  if (region == kNoInter) return exp_pass<FEAT, kNoInter, KS, SID>;
  return exp_pass<FEAT, kAll, KS, SID>;
}

PassFn pick_pass(bool feat, int region, bool ks, bool sid) {
  if (!feat) return pick_region<false, false, false>(region);
  if (ks) return sid ? pick_region<true, true, true>(region) : pick_region<true, true, false>(region);
  return sid ? pick_region<true, false, true>(region) : pick_region<true, false, false>(region);
}

// x[0..len) = c · tanh(x / c) (Gemma 2's logit soft-capping).
void softcap_inplace(float* x, int64_t len, float c) {
  const float inv = 1.f / c;
  const Vec cv(c), iv(inv);
  int64_t i = 0;
  for (; i + kW <= len; i += kW) ((Vec::loadu(x + i) * iv).tanh() * cv).store(x + i);
  for (; i < len; ++i) x[i] = c * std::tanh(x[i] * inv);
}

// Σ w[i]·mask[i] over [0, len) (mask nullptr: Σ w[i]), the tail by a partial load: a distance window's mass of the
// OTHER keys (mask: 1 for OTHER, 0 for a special key). (at::vec's loadu(p, count) loads a whole vector when count
// is its size, here and below.)
inline float masked_sum(const float* w, const float* mask, int64_t len) {
  Vec acc(0.f);
  for (int64_t i = 0; i < len; i += kW) {
    const int64_t cnt = std::min<int64_t>(kW, len - i);
    const Vec wv = Vec::loadu(w + i, cnt);
    if (mask == nullptr) acc = acc + wv;
    else acc = at::vec::fmadd(wv, Vec::loadu(mask + i, cnt), acc);
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
}

// The special keys at positions pos[0..cnt) (increasing, all in [k0, k0 + len of w)), of classes cls[0..cnt) (as
// floats): their weights w[t − k0] summed per class into out[0..4) (CLS, SEP, COMMA, PERIOD), a vector of keys per gather.
inline void class_sums(const float* w, int64_t k0, const int32_t* pos, const float* cls, int64_t cnt, float* out) {
  using IVec = at::vec::Vectorized<int32_t>;
  const IVec base(static_cast<int32_t>(k0)), izero(0);
  const Vec c1(1.f), c2(2.f), c3(3.f), c4(4.f);
  Vec a1(0.f), a2(0.f), a3(0.f), a4(0.f);
  for (int64_t j = 0; j < cnt; j += kW) {
    const int64_t m = std::min<int64_t>(kW, cnt - j);
    // a partial load fills the lanes past cnt with class 0 (OTHER: no bucket) and with position 1, clamped to
    // offset ≥ 0: an address in the block's weights, finite there (the score row is 0 outside the row's keys), so
    // the lane adds 0. A whole vector is loaded as one: at::vec's AVX2 int32 load with a count copies through the
    // stack even when the count is the vector's size (a stall on every gather; AVX-512's is a masked load).
    const IVec at_pos = m == kW ? IVec::loadu(pos + j) : IVec::loadu(pos + j, static_cast<int32_t>(m));
    const IVec idx = at::vec::maximum(at_pos - base, izero);
    const Vec cv = Vec::loadu(cls + j, m);
    const Vec wv = at::vec::gather<sizeof(float)>(w, idx);
    a1 = at::vec::fmadd(wv, cv.eq(c1), a1);
    a2 = at::vec::fmadd(wv, cv.eq(c2), a2);
    a3 = at::vec::fmadd(wv, cv.eq(c3), a3);
    a4 = at::vec::fmadd(wv, cv.eq(c4), a4);
  }
  auto sum = [](Vec& v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); };
  out[0] += sum(a1), out[1] += sum(a2), out[2] += sum(a3), out[3] += sum(a4);
}

// A patch row's grid sums over the patch keys [0, len) (mask: 1 for a patch key, 0 otherwise; the missing lanes of
// the tail load as 0 and add 0): st[sDist] += Σ w·mask·‖(row, col) − (rs, cs)‖, and st[sNear + j] += Σ w·mask over
// the keys whose squared distance is below kRingSquared[j] (the last: every patch key). Squared distances of integer
// grid positions are exact integers in float, so a key at a ring's bound falls in the ring it starts.
inline void grid_sums(const float* w, const float* row, const float* col, const float* mask, int64_t len, float rs,
                      float cs, float* st) {
  const Vec rv(rs), cv(cs);
  Vec dist(0.f), near[kRingSlots];
  for (int64_t j = 0; j < kRingSlots; ++j) near[j] = Vec(0.f);
  for (int64_t i = 0; i < len; i += kW) {
    const int64_t cnt = std::min<int64_t>(kW, len - i);
    const Vec dr = Vec::loadu(row + i, cnt) - rv, dc = Vec::loadu(col + i, cnt) - cv;
    const Vec d2 = at::vec::fmadd(dr, dr, dc * dc);
    const Vec wm = Vec::loadu(w + i, cnt) * Vec::loadu(mask + i, cnt);
    dist = at::vec::fmadd(wm, d2.sqrt(), dist);
    for (int64_t j = 0; j + 1 < kRingSlots; ++j) near[j] = at::vec::fmadd(wm, d2.lt(Vec(kRingSquared[j])), near[j]);
    near[kRingSlots - 1] = near[kRingSlots - 1] + wm;
  }
  auto sum = [](Vec& v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); };
  st[sDist] += sum(dist);
  for (int64_t j = 0; j < kRingSlots; ++j) st[sNear + j] += sum(near[j]);
}

// A row's alignment sums over the keys [t0, t0 + len) (w indexed by t − t0; the missing lanes of the tail load as 0
// and add 0): st[sAlOff] += Σ w·|t − pos| and st[sAlNear] += Σ w over the keys within 1 of near (three at most).
inline void align_sums(const float* w, int64_t t0, int64_t len, double pos, int64_t near, float* st) {
  const Vec pv(static_cast<float>(pos));
  Vec off(0.f);
  for (int64_t i = 0; i < len; i += kW) {
    const int64_t cnt = std::min<int64_t>(kW, len - i);
    const Vec d = (Vec::arange(static_cast<float>(t0 + i), 1.f) - pv).abs();
    off = at::vec::fmadd(Vec::loadu(w + i, cnt), d, off);
  }
  st[sAlOff] += at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, off);
  for (int64_t t = std::max(t0, near - 1); t < std::min(t0 + len, near + 2); ++t) st[sAlNear] += w[t - t0];
}

// One key block holds every key of the task's rows (L <= BK, the short texts): each row's weights are final after
// their one block, so the OTHER keys' weights (mask: 1 for OTHER, 0 for a special key; nullptr: all OTHER),
// normalised (fc), go to diag[t − s], and the task folds diag into the distance windows once (2N range sums per
// task, not per row: narrow windows cost nothing per row).
inline void diag_pass(const float* w, const float* mask, int64_t len, float fc, float* diag) {
  const Vec fcv(fc);
  for (int64_t i = 0; i < len; i += kW) {
    const int64_t cnt = std::min<int64_t>(kW, len - i);
    Vec add = Vec::loadu(w + i, cnt) * fcv;
    if (mask != nullptr) add = add * Vec::loadu(mask + i, cnt);
    (Vec::loadu(diag + i, cnt) + add).store(diag + i, cnt);
  }
}

// The row's running max grows from m_old (finite) by delta > 0: every sum moves to the new base.
void rescale_row(float* st, float* o, int64_t D, int64_t N, float delta) {
  const float alpha = std::exp(-delta);
  st[sA] = alpha * (st[sA] - delta * st[sZf]);
  for (int64_t j = sZ; j <= sCls3; ++j)
    if (j != sA) st[j] *= alpha;
  for (int64_t j = sDist; j < sWin; ++j) st[j] *= alpha;
  scale_inplace(st + sWin, N, alpha);
  scale_inplace(o, D, alpha);
}

}  // namespace

void fused_attention_tasks(const FusedCpuParams& p, int64_t begin, int64_t end, const FusedCpuScratch& w) {
  const int64_t H = p.H, L = p.L, D = p.D, N = p.N, BQ = p.BQ, BK = p.BK, GH = p.GH;
  const int64_t RS = kRowStateSlots(N);
  const int64_t R = kNumBucketSlots(int(N));  // first per-row feature slot
  const int64_t F0 = kNumFeatures(int(N));
  const int64_t os_row = H * D;  // stride between query rows of one (b, h) in B×L×H×D
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float pos_inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // One (sample, head, query block) of the task: its head's settings and its part of the scratch.
  struct Unit {
    int64_t h;
    bool uniform;
    int region;
    float sink;
    const float *qt, *g, *lg;  // its query rows; the key scale and ln g (nullptr: none)
    PassFn pass_feat, pass_plain;
    float *o, *lse, *acc, *state, *diag;
    double* a;  // its feature sums (nullptr: not wanted)
    int64_t task;  // its index among the (sample, head, query block)s: of its partial sums and max logit
  };
  Unit units[kMaxGroupedHeads];
  const int64_t n_groups = H / GH;
  for (int64_t item = begin; item < end; ++item) {
    // query blocks in zigzag order (0, last, 1, last − 1, ...): any run of tasks holds light and heavy
    // causal blocks alike, so at::parallel_for's contiguous chunks get even work
    const int64_t i_blk = item % p.n_qblk, bg = item / p.n_qblk, h0 = (bg % n_groups) * GH, b = bg / n_groups;
    const int64_t qblk = (i_blk % 2 == 0) ? i_blk / 2 : p.n_qblk - 1 - i_blk / 2;
    const int64_t r0 = qblk * BQ, bq = std::min(BQ, p.Lq - r0);
    const int64_t n = p.n[b];  // the valid query rows are s < n
    const int64_t nk = p.nk == nullptr ? n : p.nk[b];  // the keys (cross-attention: the other sequence's)
    const int64_t s0 = p.off + r0;  // the key position of the block's first query row
    // the keys row s sees: [lo(s), hi(s)), both non-decreasing in s (empty when lo(s) >= hi(s))
    auto lo_of = [&](int64_t s) { return p.window > 0 ? std::max<int64_t>(0, s - p.window + 1) : int64_t(0); };
    auto hi_of = [&](int64_t s) {
      const int64_t hi = p.causal ? std::min(nk, s + 1) : nk;
      return p.symmetric_window ? std::min(hi, s + p.window) : hi;
    };
    const int64_t khi = hi_of(s0 + bq - 1), klo = std::min(lo_of(s0), khi);
    // one key block for the whole task: windows through diag (offset t − s, from dbase) folded once per task
    const bool one_block = p.want_features && khi - klo <= BK;
    const int64_t dbase = klo - (s0 + bq - 1);
    const int64_t kvh = p.kv_head[h0];  // (every head of the task's: fused_attention.cpp groups only those)
    const float* sidf = p.sidf == nullptr ? nullptr : p.sidf + b * L;
    const bool sid_feat = sidf != nullptr && !p.one_sentence[b];
    const bool sid_run = sid_feat && p.sid_runs[b];  // intra by a range sum over the row's sentence
    const int32_t* sp_pos = p.special_pos + p.special_at[b];
    const float* sp_cls = p.special_cls + p.special_at[b];
    const int64_t n_special = p.special_at[b + 1] - p.special_at[b];
    const int32_t* win_of = p.win_of == nullptr ? nullptr : p.win_of + b * p.WL;
    const int64_t* win_lo = p.win_lo == nullptr ? nullptr : p.win_lo + b * (N + 1);
    const int32_t* tcls = p.token_class == nullptr ? nullptr : p.token_class + b * L;
    // the class of the row at position s (cross-attention: the queries' own classes)
    const int32_t* qcls = !p.cross ? tcls : p.query_class == nullptr ? nullptr : p.query_class + b * p.Lq;
    // an image's patch grid (never with cross-attention: fused_attention.cpp refuses grid with key_lengths)
    const float* g_row = p.grid_row == nullptr ? nullptr : p.grid_row + b * L;
    const float* g_col = p.grid_col == nullptr ? nullptr : p.grid_col + b * L;
    const float* g_mask = p.grid_mask == nullptr ? nullptr : p.grid_mask + b * L;
    // the task's heads (a zeroed one is done here: weights all 0, output 0, features 0); unit u's scores, output
    // accumulator and row state follow the previous unit's, as one product of the stacked heads writes them
    int64_t n_units = 0;
    bool any_scores = false;  // a unit whose scores are read (not uniform)
    for (int64_t gi = 0; gi < GH; ++gi) {
      const int64_t h = h0 + gi, task = (b * H + h) * p.n_qblk + i_blk;
      float* o = p.out + b * p.Lq * os_row + r0 * os_row + h * D;
      float* lse = p.lse == nullptr ? nullptr : p.lse + (b * H + h) * p.Lq + r0;
      if (p.mode[h] == kModeZero) {
        for (int64_t r = 0; r < bq; ++r) std::fill(o + r * os_row, o + r * os_row + D, 0.f);
        if (lse != nullptr) std::fill(lse, lse + bq, pos_inf);
        continue;
      }
      Unit& u = units[n_units];
      u.h = h, u.task = task, u.o = o, u.lse = lse;
      u.a = p.want_features ? p.partial + task * p.FA : nullptr;
      u.uniform = p.mode[h] == kModeUniform;
      u.region = p.region[h];
      u.sink = p.sink == nullptr ? neg_inf : p.sink[h];
      u.qt = p.q + b * p.qs0 + h * p.qs1 + r0 * p.qs2;
      u.g = p.key_scale == nullptr ? nullptr : p.key_scale + (b * H + h) * L;
      u.lg = p.key_scale == nullptr ? nullptr : p.log_key_scale + (b * H + h) * L;
      u.pass_feat = pick_pass(p.want_features, u.region, u.g != nullptr, sid_feat && !sid_run);
      u.pass_plain = pick_pass(false, u.region, false, false);
      u.acc = w.acc + gi * bq * D;
      u.state = w.state + gi * BQ * RS;
      u.diag = w.diag + gi * (BQ + BK);
      // the rows' state: base m (the sink logit, uniform 0), every sum 0
      for (int64_t r = 0; r < bq; ++r) {
        float* st = u.state + r * RS;
        std::fill(st, st + RS, 0.f);
        st[sM] = u.uniform ? 0.f : u.sink;
        st[sBad] = (!u.uniform && std::isnan(u.sink)) ? 1.f : 0.f;
        st[sPad] = neg_inf;  // the row's max logit so far
      }
      any_scores = any_scores || !u.uniform;
      ++n_units;
    }
    if (n_units == 0) continue;
    // The heads' products stacked (through BLAS): one product of (GH · bq) query rows, read as one contiguous
    // operand (w.qc, given by fused_attention.cpp where it stacks them at all), per key block. MKL computes an element
    // of a product of fewer than 4 columns (bq < 4) or of a single row (kb = 1) another way than the products one
    // head at a time: those keep one product per head, so that every element has the bits it has without the
    // grouping (tests/test_fused_cpu_blocks.py; measured on MKL's Zen kernels).
    const bool stack = w.qc != nullptr && bq >= 4;
    if (stack && any_scores)
      for (int64_t gi = 0; gi < GH; ++gi) {
        const float* qh = p.q + b * p.qs0 + (h0 + gi) * p.qs1 + r0 * p.qs2;
        for (int64_t r = 0; r < bq; ++r) std::copy(qh + r * p.qs2, qh + r * p.qs2 + D, w.qc + (gi * bq + r) * D);
      }
    // unit u's scores of a block of kb keys: row-major bq × kb, after the previous heads' (as the stacked product
    // writes them)
    auto scores_of = [&](const Unit& u, int64_t kb) { return w.S + (u.h - h0) * bq * kb; };
    bool first = true;
    for (int64_t k0 = klo; k0 < khi; k0 += BK) {
      const int64_t kb = std::min(BK, khi - k0);
      // S (row-major bq×kb, ld kb) == column-major Sᵀ (kb×bq) = K_blk (kb×D) · Q_blkᵀ, for every head of the task
      if (any_scores) {
        const float* kt = p.k + b * p.ks0 + kvh * p.ks1 + k0 * p.ks2;
        // BLAS skips the product when alpha is 0; scaling by 0 afterwards keeps NaN/inf scores NaN.
        const float alpha = p.scaling != 0.0 ? static_cast<float>(p.scaling) : 1.f;
        if (p.small_products) {
          transpose_keys(kt, p.ks2, kb, D, w.kt);
          for (int64_t ui = 0; ui < n_units; ++ui)
            if (!units[ui].uniform) small_qk_t(units[ui].qt, p.qs2, w.kt, bq, kb, D, alpha, scores_of(units[ui], kb));
        } else if (stack && kb >= 2) {
          p.gemm('T', 'N', kb, GH * bq, D, alpha, kt, p.ks2, w.qc, D, 0.f, w.S, kb);
        } else {
          for (int64_t ui = 0; ui < n_units; ++ui)
            if (!units[ui].uniform)
              p.gemm('T', 'N', kb, bq, D, alpha, kt, p.ks2, units[ui].qt, p.qs2, 0.f, scores_of(units[ui], kb), kb);
        }
        if (p.scaling == 0.0) scale_inplace(w.S, GH * bq * kb, 0.f);
      }
      // the special keys of this block
      const int64_t j0 = std::lower_bound(sp_pos, sp_pos + n_special, static_cast<int32_t>(k0)) - sp_pos;
      const int64_t j1 = std::lower_bound(sp_pos + j0, sp_pos + n_special, static_cast<int32_t>(k0 + kb)) - sp_pos;
      for (int64_t ui = 0; ui < n_units; ++ui) {
        const Unit& u = units[ui];
        const int64_t h = u.h;
        const bool uniform = u.uniform;
        const int region = u.region;
        const float sink = u.sink;
        const float* g = u.g;
        const float* lg = u.lg;
        float* S = scores_of(u, kb);
        float* acc = u.acc;
        float* diag = u.diag;
        if (!uniform && p.bias != nullptr) {  // the bias of the block's rows (query rows r0 + r) and keys [k0, k0 + kb)
          const float* bias = p.bias + b * p.bias_bs + (h * p.Lq + r0) * L + k0;
          for (int64_t r = 0; r < bq; ++r) axpy(1.f, bias + r * L, S + r * kb, kb);
        }
        for (int64_t r = 0; r < bq; ++r) {
          const int64_t s = s0 + r;
          float* row = S + r * kb;
          float* st = u.state + r * RS;
          const int64_t lo = std::max(lo_of(s), k0), hi = std::min(hi_of(s), k0 + kb);
          if (hi <= lo || st[sBad] != 0.f) {  // sees no key of this block (or is already undefined): weight 0
            std::fill(row, row + kb, 0.f);
            continue;
          }
          std::fill(row, row + (lo - k0), 0.f);
          std::fill(row + (hi - k0), row + kb, 0.f);
          float* x = row + (lo - k0);
          const int64_t len = hi - lo;
          float m = st[sM];
          float mb = 0.f;  // the block's max score (uniform: all scores taken as 0)
          if (!uniform) {
            if (p.softcap > 0.f && p.max_logit != nullptr) st[sPad] = std::max(st[sPad], range_max(x, len));
            if (p.softcap > 0.f) softcap_inplace(x, len, p.softcap);
            mb = range_max(x, len);
            if (p.softcap <= 0.f) st[sPad] = std::max(st[sPad], mb);  // the max logit (NaN: the row is bad, below)
            if (std::isnan(mb) || mb == pos_inf) {  // the softmax is undefined (numerics policy of the reference)
              st[sBad] = 1.f;
              std::fill(x, x + len, 0.f);
              continue;
            }
            if (mb > m) {
              if (m != neg_inf) rescale_row(st, acc + r * D, D, N, mb - m);
              st[sM] = m = mb;
            }
            if (m == neg_inf) {  // every score so far −inf (and no sink): weight 0, unless one is NaN
              for (int64_t i = 0; i < len; ++i)
                if (std::isnan(x[i])) st[sBad] = 1.f;
              std::fill(x, x + len, 0.f);
              continue;
            }
          }
          const bool feat_row = p.want_features && s < n;
          const int64_t koff = lo - k0;
          float* pc = g != nullptr ? w.pc : nullptr;
          const BlockSums bs = (feat_row ? u.pass_feat : u.pass_plain)(
              x, len, uniform, m, sidf == nullptr ? nullptr : sidf + lo, sidf == nullptr ? 0.f : sidf[s],
              g == nullptr ? nullptr : g + lo, lg == nullptr ? nullptr : lg + lo, pc == nullptr ? nullptr : pc + koff);
          st[sZ] += bs.Z;
          st[sZk] += bs.Zk;
          if (!feat_row) continue;
          st[sZf] += bs.Zf;
          st[sA] += bs.A;
          st[sMx] = std::max(st[sMx], pass_sums_max(region, g != nullptr) ? bs.Mx : std::exp(mb - m));
          st[sI] += bs.I;
          // the feature weights of this block's keys, indexed by t − k0
          const float* fw = pc != nullptr ? pc : row;
          if (sid_run) {
            const int64_t i0 = std::max<int64_t>(lo, p.sent_lo[b * L + s]), i1 = std::min<int64_t>(hi, p.sent_hi[b * L + s]);
            if (i1 > i0) st[sI] += range_sum(fw + (i0 - k0), i1 - i0);
          }
          if (g_mask != nullptr && g_mask[s] != 0.f)  // a patch row: its distance to the patch keys it sees
            grid_sums(fw + (lo - k0), g_row + lo, g_col + lo, g_mask + lo, len, g_row[s], g_col[s], st);
          if (p.align) {  // the row's aligned key position: its own (s), or cross-attention's proportional one
            const double pos = !p.cross ? double(s) : n > 1 ? double(s * (nk - 1)) / double(n - 1) : 0.0;
            align_sums(fw + (lo - k0), lo, len, pos, static_cast<int64_t>(std::floor(pos + 0.5)), st);
          }
          // distance windows (d = |t − s| ≥ 1): sums of the OTHER keys' weights over each window's keys, left of
          // s then right; the special keys' weights go to their class bucket in the same pass
          float* win = st + sWin;
          const float* other = p.other_mask == nullptr ? nullptr : p.other_mask + b * L + k0;  // indexed by t − k0
          const float* om = other == nullptr ? nullptr : other + (lo - k0);                       // indexed by t − lo
          if (one_block) {  // the row's sums are final: normalise now (as the epilogue does) and add to diag
            const float Es = (uniform || p.sink == nullptr) ? 0.f : std::exp(sink - m);
            const float den = p.renormalize ? st[sZk] + Es : st[sZ] + Es;
            float fc = den > 0.f ? 1.f / den : 0.f;
            if (g != nullptr) fc = st[sZf] > 0.f ? 1.f / st[sZf] : 0.f;
            diag_pass(fw + (lo - k0), om, len, fc, diag + (lo - s - dbase));  // (offset 0, the own key: never folded)
          } else {
            for (int64_t t_hi = std::min(hi, s); t_hi > lo;) {
              const int32_t j = win_of[s - (t_hi - 1)];
              const int64_t t_lo = std::max(lo, s - win_lo[j + 1] + 1);
              win[j] += masked_sum(fw + (t_lo - k0), om == nullptr ? nullptr : om + (t_lo - lo), t_hi - t_lo);
              t_hi = t_lo;
            }
            for (int64_t t_lo = std::max(lo, s + 1); t_lo < hi;) {
              const int32_t j = win_of[t_lo - s];
              const int64_t t_hi = std::min(hi, s + win_lo[j + 1]);
              win[j] += masked_sum(fw + (t_lo - k0), om == nullptr ? nullptr : om + (t_lo - lo), t_hi - t_lo);
              t_lo = t_hi;
            }
          }
          // the special keys the row sees (its own key too) to their class buckets
          const int32_t* ja = lo > k0 ? std::lower_bound(sp_pos + j0, sp_pos + j1, static_cast<int32_t>(lo)) : sp_pos + j0;
          const int32_t* jb = hi < k0 + kb ? std::lower_bound(ja, sp_pos + j1, static_cast<int32_t>(hi)) : sp_pos + j1;
          static_assert(sCls1 == sCls0 + 1 && sCls3 == sCls0 + 3 && kSlotCls == 0 && kSlotPeriod == 3,
                        "class buckets in class order");
          if (jb > ja) class_sums(fw, k0, ja, sp_cls + (ja - sp_pos), jb - ja, st + sCls0);
          if (s >= lo && s < hi) {  // the row's own key: self, or its class bucket
            if (tcls == nullptr || tcls[s] == kClassOther) st[sSelf] += fw[s - k0];  // (else: in its class bucket)
          }
          if (s - 1 >= lo && s - 1 < hi) st[sPrev] += fw[s - 1 - k0];
          if (s + 1 >= lo && s + 1 < hi) st[sNext] += fw[s + 1 - k0];
        }
      }
      // O_blk (column-major D×bq, ld D) (+)= V_blkᵀ (D×kb) · Eᵀ (kb×bq), for every head of the task (a zeroed
      // head's rows in the stacked product are never read)
      const float* vt = p.v + b * p.vs0 + kvh * p.vs1 + k0 * p.vs2;
      if (p.small_products) {
        for (int64_t ui = 0; ui < n_units; ++ui)
          small_pv(scores_of(units[ui], kb), kb, vt, p.vs2, bq, D, !first, units[ui].acc);
      } else if (stack && kb >= 2 && n_units == GH) {
        p.gemm('N', 'N', D, GH * bq, kb, 1.f, vt, p.vs2, w.S, kb, first ? 0.f : 1.f, w.acc, D);
      } else {
        for (int64_t ui = 0; ui < n_units; ++ui)
          p.gemm('N', 'N', D, bq, kb, 1.f, vt, p.vs2, scores_of(units[ui], kb), kb, first ? 0.f : 1.f,
                 units[ui].acc, D);
      }
      first = false;
    }

    for (int64_t ui = 0; ui < n_units; ++ui) {
      const Unit& u = units[ui];
      const int64_t h = u.h;
      const bool uniform = u.uniform;
      const float* g = u.g;
      double* a = u.a;
      float* diag = u.diag;
      if (first) std::fill(u.acc, u.acc + bq * D, 0.f);  // no key for any row of the block
      if (one_block && !first) {  // fold diag into the windows: offsets ±[win_lo[j], win_lo[j + 1]), then clear it
        const int64_t dlen = khi - klo + bq - 1;  // offsets [dbase, dbase + dlen)
        for (int64_t j = 0; j < N; ++j) {
          const int64_t wl = std::max<int64_t>(1, win_lo[j]), wh = win_lo[j + 1];
          if (wh <= wl) continue;
          double sum = 0.0;
          // positive offsets [wl, wh) and negative offsets (−wh, −wl]
          const int64_t p_lo = std::max(wl, dbase), p_hi = std::min(wh, dbase + dlen);
          if (p_hi > p_lo) sum += range_sum(diag + (p_lo - dbase), p_hi - p_lo);
          const int64_t n_lo = std::max(-wh + 1, dbase), n_hi = std::min(-wl + 1, dbase + dlen);
          if (n_hi > n_lo) sum += range_sum(diag + (n_lo - dbase), n_hi - n_lo);
          a[kSlotFirstWindow + j] += sum;
        }
        std::fill(diag, diag + dlen, 0.f);
      }

      // --- epilogue: output rows, log-sum-exp, features
      bool task_undefined = false;
      float task_max = neg_inf;  // the max logit of the block's valid rows (NaN: a bad row; the host recomputes it)
      for (int64_t r = 0; r < bq; ++r) {
        const int64_t s = s0 + r;
        float* orow = u.o + r * os_row;
        const float* st = u.state + r * RS;
        if (lo_of(s) >= hi_of(s)) {  // a padded row outside the window sees nothing: weight 0, output 0
          std::fill(orow, orow + D, 0.f);
          if (u.lse != nullptr) u.lse[r] = pos_inf;
          continue;
        }
        const float m = st[sM];
        const bool bad = st[sBad] != 0.f || (!uniform && !std::isfinite(m));
        const float Es = (uniform || p.sink == nullptr || bad) ? 0.f : std::exp(u.sink - m);
        const float den = p.renormalize ? st[sZk] + Es : st[sZ] + Es;
        const float c = bad ? nan : (den > 0.f ? 1.f / den : 0.f);
        const float* arow = u.acc + r * D;
        const float cg = c * p.gate[h];
        for (int64_t d = 0; d < D; ++d) orow[d] = arow[d] * cg;
        if (u.lse != nullptr) u.lse[r] = bad ? nan : (den > 0.f ? m + std::log(den) : pos_inf);
        if (s < n && !std::isnan(task_max)) task_max = bad ? nan : std::max(task_max, st[sPad]);
        if (!p.want_features || s >= n) continue;
        if (bad) {  // NaN features for the whole (sample, head)
          task_undefined = true;
          continue;
        }
        // the feature weights w = fc · (kept e, times g under a key scale); the sink has no value under g
        float fc = c, fZ = st[sZk], fsink = c * Es;
        if (g != nullptr) {
          fZ = st[sZf];
          fc = fZ > 0.f ? 1.f / fZ : 0.f;
          fsink = 0.f;
        }
        const double dc = fc;
        for (int j = 0; j < 4; ++j) a[kSlotCls + j] += dc * st[sCls0 + j];
        a[kSlotSelf] += dc * st[sSelf];
        if (!one_block)  // (one_block: the windows are in diag, folded above)
          for (int64_t j = 0; j < N; ++j) a[kSlotFirstWindow + j] += dc * st[sWin + j];
        const float T = fc * fZ;
        const float H_ent = fc > 0.f ? std::max(0.f, -fc * st[sA] - fc * std::log(fc) * fZ) : 0.f;
        const float intra = sid_feat ? fc * st[sI] : T;
        a[R + kRowPrev] += fc * st[sPrev];
        a[R + kRowNext] += fc * st[sNext];
        a[R + kRowEntropy] += H_ent;
        a[R + kRowMax] += fc * st[sMx];
        a[R + kRowIntra] += intra;
        a[R + kRowInter] += std::max(0.f, T - intra);
        if (qcls != nullptr && qcls[s] == kClassCls) a[F0] += H_ent;
        a[F0 + 1] += fsink;
        if (g_mask != nullptr && g_mask[s] != 0.f) {  // the distance, then each ring's mass (a difference of Near)
          a[F0 + 2] += dc * st[sDist];
          a[F0 + 3] += dc * st[sNear];
          for (int64_t j = 1; j < kRingSlots; ++j) a[F0 + 3 + j] += dc * (st[sNear + j] - st[sNear + j - 1]);
        }
        if (p.align) a[kAlignSlot(F0)] += dc * st[sAlOff], a[kAlignSlot(F0) + 1] += dc * st[sAlNear];
      }
      if (task_undefined) std::fill(a, a + p.FA, std::numeric_limits<double>::quiet_NaN());
      if (p.max_logit != nullptr) p.max_logit[u.task] = task_max;
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace attnkit::cpu
