// Tile shapes and shared-memory layout of the fused attention kernel, per (element type, head dim).
// Kernel-free (plain constexpr arithmetic), so the host API (fused_attention_api.cu) can compute the
// shared memory a configuration needs before launching it, without including the kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace attnkit {
namespace cuda {

template <typename T_, int kHeadDim_>
struct FusedTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of 16");
  // fp16/bf16 use tensor cores (WMMA 16×16×16, fp32 accumulation); fp32 uses a plain FMA path so that
  // its error stays at fp32 level (TF32 would not).
  static constexpr bool kUseMma = !std::is_same_v<T, float>;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = kUseMma ? 64 : 32;
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static_assert(kBlockM == 16 * kWarps, "each warp owns 16 rows");
  static_assert(kThreads == 2 * kBlockM, "two threads per row");
  static constexpr int kKeysPerThread = kBlockN / 2;
  static constexpr int kVec = 16 / int(sizeof(T));  // elements per 16-byte load
  // Shared-memory row strides (elements). Padding breaks bank conflicts; every WMMA fragment pointer
  // stays 32-byte aligned (16 rows × stride × sizeof is a multiple of 32; 16 columns are 32 bytes).
  static constexpr int kLdQ = kHeadDim + (kUseMma ? 8 : 4);  // Q, K and V tiles
  static constexpr int kLdS = kBlockN + 4;                   // fp32 scores
  static constexpr int kLdP = kUseMma ? kBlockN + 8 : kLdS;  // weights in T (fp32 path: in place in S)
  static constexpr int kQBytes = kBlockM * kLdQ * int(sizeof(T));
  static constexpr int kKBytes = kBlockN * kLdQ * int(sizeof(T));
  static constexpr int kSBytes = kBlockM * kLdS * 4;
  static constexpr int kPBytes = kUseMma ? kBlockM * kLdP * int(sizeof(T)) : 0;
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + kKBytes;
  static constexpr int kOffS = kOffV + kKBytes;
  static constexpr int kOffP = kOffS + kSBytes;
  static constexpr int kOffMeta = kOffP + kPBytes;  // key sentence ids, classes and scales: 3 × kBlockN words
  static constexpr int kOffFeat = kOffMeta + 3 * kBlockN * 4;
  static_assert(kOffK % 32 == 0 && kOffV % 32 == 0 && kOffS % 32 == 0 && kOffP % 32 == 0, "alignment");
  static constexpr int smem_bytes(int num_features) { return kOffFeat + 4 * num_features; }
  // Output staging (tensor-core path): a warp's 16-row band of S holds up to this many fp32 columns.
  static constexpr int kStageCols = kBlockN < kHeadDim ? kBlockN : kHeadDim;
};

}  // namespace cuda
}  // namespace attnkit
