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

}  // namespace CPU_CAPABILITY
}  // namespace attnkit::cpu
