// Small vectorised helpers for the CPU kernels, through at::vec. A unit built once per instruction set
// (csrc/cpu/capability/*.cpp) defines CPU_CAPABILITY (DEFAULT, AVX2, AVX512) and CPU_CAPABILITY_<X> before
// including this; other units get AVX2 when the build enables it, else at::vec's generic Vectorized (plain
// C++). Everything here lives in the inline namespace CPU_CAPABILITY, as at::vec does, so the copies built for
// different instruction sets never stand in for one another at link time.
#pragma once

#if !defined(CPU_CAPABILITY)
#if defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace attnkit::cpu {
inline namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

// Sum of p[0..len).
inline float range_sum(const float* p, int64_t len) {
  if (len <= 0) return 0.f;
  int64_t i = 0;
  float s = 0.f;
  if (len >= kW) {
    Vec acc(0.f);
    for (; i + kW <= len; i += kW) acc = acc + Vec::loadu(p + i);
    s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  }
  for (; i < len; ++i) s += p[i];
  return s;
}

// Sum of p[lo..hi) clipped to [0, n).
inline float clipped_sum(const float* p, int64_t lo, int64_t hi, int64_t n) {
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, n);
  return hi > lo ? range_sum(p + lo, hi - lo) : 0.f;
}

// Max of p[0..len) (−inf when empty), NaN when any element is NaN (the callers rely on it to find undefined rows).
// Four accumulators: one would wait on the latency of each max. The tail is one partial load, its missing lanes
// −inf: short rows (a sentence of 15 tokens) are all tail.
inline float range_max(const float* p, int64_t len) {
  const Vec ninf(-std::numeric_limits<float>::infinity());
  Vec a0 = ninf, a1 = ninf, a2 = ninf, a3 = ninf;
  int64_t i = 0;
  for (; i + 4 * kW <= len; i += 4 * kW) {
    a0 = at::vec::maximum(a0, Vec::loadu(p + i));
    a1 = at::vec::maximum(a1, Vec::loadu(p + i + kW));
    a2 = at::vec::maximum(a2, Vec::loadu(p + i + 2 * kW));
    a3 = at::vec::maximum(a3, Vec::loadu(p + i + 3 * kW));
  }
  for (; i + kW <= len; i += kW) a0 = at::vec::maximum(a0, Vec::loadu(p + i));
  if (i < len) a1 = at::vec::maximum(a1, Vec::set(ninf, Vec::loadu(p + i, len - i), len - i));
  a0 = at::vec::maximum(at::vec::maximum(a0, a1), at::vec::maximum(a2, a3));
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, a0);
}

inline void scale_inplace(float* p, int64_t len, float c) {
  int64_t i = 0;
  Vec cv(c);
  for (; i + kW <= len; i += kW) (Vec::loadu(p + i) * cv).store(p + i);
  for (; i < len; ++i) p[i] *= c;
}

// y[0..len) += a · x[0..len)
inline void axpy(float a, const float* x, float* y, int64_t len) {
  int64_t i = 0;
  Vec av(a);
  for (; i + kW <= len; i += kW) at::vec::fmadd(av, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < len; ++i) y[i] += a * x[i];
}

// The tile's products in place, for tiles too small for a BLAS call to pay (FusedCpuParams::small_products).
// Vectors run along the keys (scores) and along D (output), R rows at a time so that R independent chains of
// multiply-adds share each load; partial loads and stores cover the tails.

// Rows [r0, r0 + R) of small_qk.
template <int R>
inline void small_qk_rows(const float* q, int64_t qs, const float* kt, int64_t kb, int64_t D, float alpha, float* S,
                          int64_t r0) {
  const Vec av(alpha);
  for (int64_t j0 = 0; j0 < kb; j0 += kW) {
    const int64_t n = std::min(kW, kb - j0);
    Vec acc[R];
    for (int i = 0; i < R; ++i) acc[i] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec kv = Vec::loadu(kt + d * kb + j0, n);
      for (int i = 0; i < R; ++i) acc[i] = at::vec::fmadd(Vec(q[(r0 + i) * qs + d]), kv, acc[i]);
    }
    for (int i = 0; i < R; ++i) (acc[i] * av).store(S + (r0 + i) * kb + j0, n);
  }
}

// kt[d·kb + j] = k[j·ks + d] (j < kb, d < D): a key block transposed for small_qk_t, once for every head that reads it.
inline void transpose_keys(const float* k, int64_t ks, int64_t kb, int64_t D, float* kt) {
  for (int64_t j = 0; j < kb; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * kb + j] = k[j * ks + d];
}

// S[r·kb + j] = alpha · Σ_d q[r·qs + d] · kt[d·kb + j]  (r < bq, j < kb): each row's scores alone, whatever bq is.
inline void small_qk_t(const float* q, int64_t qs, const float* kt, int64_t bq, int64_t kb, int64_t D, float alpha,
                       float* S) {
  int64_t r = 0;
  for (; r + 8 <= bq; r += 8) small_qk_rows<8>(q, qs, kt, kb, D, alpha, S, r);
  for (; r + 4 <= bq; r += 4) small_qk_rows<4>(q, qs, kt, kb, D, alpha, S, r);
  for (; r < bq; ++r) small_qk_rows<1>(q, qs, kt, kb, D, alpha, S, r);
}

// Rows [r0, r0 + R) of small_pv.
template <int R>
inline void small_pv_rows(const float* S, int64_t kb, const float* v, int64_t vs, int64_t D, bool accumulate,
                          float* o, int64_t r0) {
  for (int64_t d0 = 0; d0 < D; d0 += kW) {
    const int64_t n = std::min(kW, D - d0);
    Vec acc[R];
    for (int i = 0; i < R; ++i) acc[i] = accumulate ? Vec::loadu(o + (r0 + i) * D + d0, n) : Vec(0.f);
    for (int64_t j = 0; j < kb; ++j) {
      const Vec vv = Vec::loadu(v + j * vs + d0, n);
      for (int i = 0; i < R; ++i) acc[i] = at::vec::fmadd(Vec(S[(r0 + i) * kb + j]), vv, acc[i]);
    }
    for (int i = 0; i < R; ++i) acc[i].store(o + (r0 + i) * D + d0, n);
  }
}

// o[r·D + d] (+)= Σ_j S[r·kb + j] · v[j·vs + d]  (r < bq, d < D); `accumulate` false: o is not read.
inline void small_pv(const float* S, int64_t kb, const float* v, int64_t vs, int64_t bq, int64_t D, bool accumulate,
                     float* o) {
  int64_t r = 0;
  for (; r + 8 <= bq; r += 8) small_pv_rows<8>(S, kb, v, vs, D, accumulate, o, r);
  for (; r + 4 <= bq; r += 4) small_pv_rows<4>(S, kb, v, vs, D, accumulate, o, r);
  for (; r < bq; ++r) small_pv_rows<1>(S, kb, v, vs, D, accumulate, o, r);
}

}  // namespace CPU_CAPABILITY
}  // namespace attnkit::cpu
