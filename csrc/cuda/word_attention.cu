// CUDA kernel of attnkit::word_attention (semantics: csrc/cpu/word_attention.cpp, attnkit/words.py).
//
// One block per (query row s, head h, sample b). The block stages the query row and the row's n scores in
// shared memory, takes the softmax (block max and sum), scatters the weights into per-word sums to[w]
// (shared atomics), finds the arg-max word other than the row's own (lowest index on ties) and adds
// to[·] / (pieces of its own word) into words[b, h, own, ·] with global atomics. Only one row of scores
// exists per block; no L×L map is written. Memory per block: (D + L + W) floats + W ints of shared memory.
// The host side (argument checks, allocation, registration) is in cuda_api.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "fused_attention_params.h"

namespace attnkit {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Block-wide reductions over kThreads threads; `scratch` holds kWarps values. Every thread gets the result.
__device__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
  for (int i = 1; i < kWarps; ++i) r = fmaxf(r, scratch[i]);
  return r;
}

__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = 0.f;
  for (int i = 0; i < kWarps; ++i) r += scratch[i];
  return r;
}

// (value, index) arg-max; larger value wins, lower index on ties; index -1 means "none".
__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
  if (i2 < 0) return;
  if (i < 0 || v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    better(v, i, v2, i2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
  for (int w = 1; w < kWarps; ++w) better(v, i, sv[w], si[w]);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    word_attention_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                          const int64_t* __restrict__ lengths, const int32_t* __restrict__ word_id, float* words,
                          int64_t* __restrict__ row_word, float* __restrict__ row_weight, int H, int L, int D, int W,
                          float scaling) {
  extern __shared__ float smem[];
  __shared__ float red_v[kWarps];
  __shared__ int red_i[kWarps];
  float* qs = smem;          // D
  float* sc = qs + D;        // L scores, then weights
  float* to = sc + L;        // W word sums
  int* cnt = reinterpret_cast<int*>(to + W);  // W piece counts
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  int n = int(lengths[b]);
  n = n < 0 ? 0 : (n > L ? L : n);
  if (s >= n) return;  // block-uniform; the host preset row_word = -1, row_weight = 0
  const int tid = threadIdx.x;
  const int64_t bh = int64_t(b) * H + h;
  const scalar_t* qrow = q + (bh * L + s) * D;
  const scalar_t* kbase = k + bh * L * D;
  const int32_t* wid = word_id + int64_t(b) * L;

  for (int d = tid; d < D; d += kThreads) qs[d] = to_float(qrow[d]);
  for (int w = tid; w < W; w += kThreads) {
    to[w] = 0.f;
    cnt[w] = 0;
  }
  __syncthreads();
  float mx = -FLT_MAX;
  for (int t = tid; t < n; t += kThreads) {
    const scalar_t* krow = kbase + int64_t(t) * D;
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += qs[d] * to_float(krow[d]);
    acc *= scaling;
    sc[t] = acc;
    mx = fmaxf(mx, acc);
    const int w = wid[t];
    if (w >= 0 && w < W) atomicAdd(&cnt[w], 1);
  }
  mx = block_max(mx, red_v);
  float z = 0.f;
  for (int t = tid; t < n; t += kThreads) {
    const float e = __expf(sc[t] - mx);
    z += e;
    const int w = wid[t];
    if (w >= 0 && w < W) atomicAdd(&to[w], e);
  }
  z = block_sum(z, red_v);  // its barriers also publish to[] and cnt[]
  const float inv = 1.f / z;
  const int own = wid[s];
  float best_v = 0.f;
  int best = -1;
  for (int w = tid; w < W; w += kThreads)
    if (w != own && cnt[w] > 0) better(best_v, best, to[w] * inv, w);
  block_argmax(best_v, best, red_v, red_i);
  if (tid == 0) {
    row_word[bh * L + s] = best;
    row_weight[bh * L + s] = best < 0 ? 0.f : best_v;
  }
  if (own >= 0 && own < W) {
    const float f = inv / float(cnt[own]);
    float* dst = words + (bh * W + own) * W;
    for (int w = tid; w < W; w += kThreads) atomicAdd(&dst[w], to[w] * f);
  }
}

}  // namespace

void run_word_attention(const WordAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.L), static_cast<unsigned>(p.H), static_cast<unsigned>(p.B));
  const size_t shared = size_t(word_attention_shared_bytes(p.D, p.L, p.W));
#define ATTNKIT_LAUNCH(CT)                                                                                       \
  word_attention_kernel<CT><<<grid, kThreads, shared, stream>>>(                                               \
      reinterpret_cast<const CT*>(p.q), reinterpret_cast<const CT*>(p.k), p.lengths, p.word_id, p.words,          \
      p.row_word, p.row_weight, p.H, p.L, p.D, p.W, p.scaling)
  if (p.dtype == WordAttentionParams::kFloat32) {
    ATTNKIT_LAUNCH(float);
  } else if (p.dtype == WordAttentionParams::kFloat16) {
    ATTNKIT_LAUNCH(__half);
  } else {
    ATTNKIT_LAUNCH(__nv_bfloat16);
  }
#undef ATTNKIT_LAUNCH
}

}  // namespace cuda
}  // namespace attnkit
