// Range checks of the fused op's device-resident integer arguments (lengths in [1, L], mode and region
// codes in 0..2, KV heads in [0, Hkv), token classes in 0..4 at valid positions), reported to the host in one ArgReport so
// that the host raises an error naming the argument, the position and the value.
#include <cuda_runtime.h>

#include "fused_attention_params.h"

namespace attnkit {
namespace cuda {
namespace {

// Records (i, v) unless another bad entry of this kind was recorded first.
__device__ __forceinline__ void claim(long long* index, long long* value, long long i, long long v) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(index), ~0ull, static_cast<unsigned long long>(i)) == ~0ull) {
    *value = v;
  }
}

// One thread per entry of the largest argument checked: B lengths, H codes or B·L token classes.
__host__ __device__ __forceinline__ long long work_items(const ArgCheckParams& p) {
  long long total = (long long)p.B * p.L;
  if (p.B > total) total = p.B;
  if (p.H > total) total = p.H;
  return total;
}

__global__ void check_arguments_kernel(const ArgCheckParams p) {
  const long long total = work_items(p);
  ArgReport* r = p.report;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    if (p.check_lengths && i < p.B) {
      const long long n = p.lengths[i];
      if (n < 1 || n > p.L) claim(&r->len_index, &r->len_value, i, n);
    }
    if (p.mode != nullptr && i < p.H) {
      const int m = p.mode[i];
      if (m < kModeKeep || m > kModeUniform) claim(&r->mode_index, &r->mode_value, i, m);
    }
    if (p.kv_head != nullptr && i < p.H) {
      const int g = p.kv_head[i];
      if (g < 0 || g >= p.Hkv) claim(&r->kv_index, &r->kv_value, i, g);
    }
    if (p.region != nullptr && i < p.H) {
      const int g = p.region[i];
      if (g < kRegionAll || g > kRegionNoInter) claim(&r->region_index, &r->region_value, i, g);
    }
    if (p.token_class != nullptr && i < (long long)p.B * p.L) {
      const long long b = i / p.L, t = i % p.L;
      if (t < p.lengths[b]) {
        const int c = p.token_class[i];
        if (c < kClassOther || c > kClassPeriod) claim(&r->class_index, &r->class_value, i, c);
      }
    }
  }
}

}  // namespace

void run_check_arguments(const ArgCheckParams& params, cudaStream_t stream) {
  const long long total = work_items(params);
  if (total == 0) return;
  const int threads = 256;
  const long long blocks = (total + threads - 1) / threads;
  check_arguments_kernel<<<int(blocks < 1024 ? blocks : 1024), threads, 0, stream>>>(params);
}

}  // namespace cuda
}  // namespace attnkit
