// Turns the per-(sample, head) feature sums of both fused kernels into means (docs/features.md, "Features"):
// every feature is divided by the number n of valid rows, except cls_entropy (the last feature but a sink's), which
// is divided by the number of valid rows whose token class is CLS (at least 1, as in the reference).
#include <cuda_runtime.h>

#include "fused_attention_params.h"

namespace attnkit {
namespace cuda {
namespace {

__global__ void finalize_features_kernel(const FusedParams p) {
  const int b = blockIdx.x;
  const int L = p.L;
  int n = int(p.lengths[b]);
  n = n < 1 ? 1 : (n > L ? L : n);
  int n_cls = 0;
  for (int s0 = 0; s0 < n; s0 += blockDim.x) {  // every thread runs the same trip count
    const int s = s0 + int(threadIdx.x);
    const bool is_cls = s < n && p.token_class != nullptr && p.token_class[int64_t(b) * L + s] == kClassCls;
    n_cls += __syncthreads_count(is_cls);
  }
  const float count_cls = float(n_cls > 1 ? n_cls : 1);
  const int F = p.num_features;
  const int cls_slot = kNumFeatures(p.num_windows) - 1;  // a sink's feature, if any, comes after it
  float* f = p.features + int64_t(b) * p.H * F;
  for (int idx = threadIdx.x; idx < p.H * F; idx += blockDim.x) {
    f[idx] = f[idx] / (idx % F == cls_slot ? count_cls : float(n));
  }
}

}  // namespace

void run_finalize_features(const FusedParams& params, cudaStream_t stream) {
  if (params.B == 0 || params.H == 0) return;
  finalize_features_kernel<<<params.B, 256, 0, stream>>>(params);
}

}  // namespace cuda
}  // namespace attnkit
