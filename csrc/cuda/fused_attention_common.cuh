// Device helpers shared by both fused attention kernels (v1: fused_attention_kernel.cuh, v2:
// fused_attention_v2_kernel.cuh): conversions, the region rule, and the early exits for bad codes and
// for mode zero, which must behave identically in both.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fused_attention_params.h"

namespace attnkit {
namespace cuda {

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Keep key t of row s under the region intervention? (sentence ids are 0 everywhere when absent).
__device__ __forceinline__ bool region_keeps(int region, bool same_sentence) {
  return region == kRegionAll || (region == kRegionNoIntra ? !same_sentence : same_sentence);
}

// The per-(sample, head) values every block of both kernels starts from.
struct HeadSetup {
  int n;          // valid keys, clamped into [1, L] so nothing is read out of range
  int mode, region;
  int kv;  // the KV head this query head reads
  float gate;
  bool bad_codes;  // a length or code the host could not check (CUDA graph capture) is out of range
};

__device__ __forceinline__ HeadSetup head_setup(const FusedParams& p, int b, int h) {
  HeadSetup s;
  const int64_t n_raw = p.lengths[b];
  s.n = int(n_raw < 1 ? 1 : (n_raw > p.L ? p.L : n_raw));
  s.mode = p.mode != nullptr ? p.mode[h] : kModeKeep;
  s.region = p.region != nullptr ? p.region[h] : kRegionAll;
  s.gate = p.gates != nullptr ? p.gates[h] : 1.f;
  s.kv = p.kv_head != nullptr ? p.kv_head[h] : h;
  s.bad_codes = n_raw < 1 || n_raw > p.L || s.mode < kModeKeep || s.mode > kModeUniform || s.region < kRegionAll ||
                s.region > kRegionNoInter || s.kv < 0 || s.kv >= p.Hkv;
  return s;
}

// Rows [row0, row0 + rows) of out[b, :, h, :] (contiguous B×L×H×D) set to `value`.
template <typename T>
__device__ __forceinline__ void fill_output_rows(const FusedParams& p, int b, int h, int head_dim, int row0, int rows,
                                                 float value, int tid, int nthreads) {
  T* out = reinterpret_cast<T*>(p.out) + (int64_t(b) * p.L * p.H + h) * head_dim;
  const int64_t row_stride = int64_t(p.H) * head_dim;
  for (int idx = tid; idx < rows * head_dim; idx += nthreads) {
    const int s = row0 + idx / head_dim;
    if (s < p.L) out[int64_t(s) * row_stride + idx % head_dim] = from_float<T>(value);
  }
}

// Early exits. Bad codes (numerics policy, attnkit/reference.py): NaN output and NaN features, never a
// plausible number. Mode zero: the head outputs 0 and its weights, hence its features, are 0.
// Returns true when the block is done.
template <typename T>
__device__ __forceinline__ bool early_exit(const FusedParams& p, const HeadSetup& s, int b, int h, int head_dim,
                                           int row0, int rows, int tid, int nthreads) {
  if (s.bad_codes) {
    fill_output_rows<T>(p, b, h, head_dim, row0, rows, NAN, tid, nthreads);
    if (p.features != nullptr) {
      float* gfeat = p.features + (int64_t(b) * p.H + h) * p.num_features;
      for (int i = tid; i < p.num_features; i += nthreads) atomicAdd(&gfeat[i], NAN);
    }
    return true;
  }
  if (s.mode == kModeZero) {
    fill_output_rows<T>(p, b, h, head_dim, row0, rows, 0.f, tid, nthreads);
    return true;
  }
  return false;
}

}  // namespace cuda
}  // namespace attnkit
