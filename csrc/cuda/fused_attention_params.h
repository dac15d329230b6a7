// Plain-data parameters and launchers shared by the host API (cuda_api.cpp, compiled by the C++ compiler)
// and the kernel files (.cu, compiled by nvcc). Deliberately free of ATen and of kernel code: the heavy
// template instantiations live in one generated .cu per (kernel, dtype, head dim), built in parallel.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../feature_slots.h"

namespace attnkit {
namespace cuda {

// The most windows a launch supports: the per-block feature accumulator lives in shared memory and the
// window index is computed with 32-bit products d * num_windows (d < 2^12 for L <= 4096).
constexpr int kMaxNumWindows = 1024;

struct FusedParams {
  // q, k, v: B×H×L×D with unit stride on D; strides in elements (multiples of 16 bytes / sizeof(T)).
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride_b, q_stride_h, q_stride_l;
  int64_t k_stride_b, k_stride_h, k_stride_l;
  int64_t v_stride_b, v_stride_h, v_stride_l;
  // out: contiguous B×L×H×D in q's dtype.
  void* out;
  const int64_t* lengths;      // [B]
  const int32_t* token_class;  // [B, L] contiguous, or nullptr (all OTHER)
  const int32_t* sentence_id;  // [B, L] contiguous, or nullptr (one sentence)
  const int32_t* mode;         // [H] or nullptr (keep)
  const int32_t* region;       // [H] or nullptr (all)
  const float* gates;          // [H] or nullptr (1)
  const float* key_scale;      // [B, H, L] contiguous, or nullptr: features weigh key t by key_scale (norm
                               // weighting, docs/features.md); the output is unchanged
  float* features;             // [B, H, F] fp32 zero-initialised sums, or nullptr when not wanted
  int B, H, L;
  int num_windows;             // N; F = kNumFeatures(N) (csrc/feature_slots.h), + 1 with a sink
  int num_features;            // F
  float scaling;
  bool renormalize;
  // Decoder arguments (docs/features.md, section 8; v1 only — the host runs every call with one on v1):
  const int32_t* kv_head;      // [H] or nullptr (head h reads KV head h): k and v are B×Hkv×L×D
  int Hkv;                     // KV heads (k.size(1)); kv_head values outside [0, Hkv) make the head NaN
  const float* sink;           // [H] or nullptr: a logit per head in each row's softmax denominator; the
                               // feature `sink` (its mass) is then the last one, slot kNumFeatures(N)
  bool causal;                 // row s sees keys t <= s
  int window;                  // sliding window W: row s sees keys t > s − W; 0: none
  float softcap;               // scores become softcap·tanh(score / softcap); 0: none
};

// One explicit specialisation per (kernel, element type, head dim) lives in a generated file
// csrc/cuda/instantiations/fused_attention_<kernel>_<dtype>_hdim<D>.cu (tools/generate_kernels.py).
// v1 (fused_attention_kernel.cuh): two passes over the keys, fp32/fp16/bf16, any number of windows.
// v2 (fused_attention_v2_kernel.cuh): one pass, tensor cores through CuTe, fp16/bf16, at most
// kMaxWindowsV2 windows. ATTNKIT_CUDA_KERNEL picks one (docs/pipeline.md, "CUDA kernels").
template <typename T, int kHeadDim>
void run_fused_attention_v1(const FusedParams& params, cudaStream_t stream);
template <typename T, int kHeadDim>
void run_fused_attention_v2(const FusedParams& params, cudaStream_t stream);
// Dynamic shared memory of one v2 block (defined beside each v2 instantiation, where its CuTe traits are).
template <typename T, int kHeadDim>
int fused_attention_v2_smem_bytes(bool features, int num_windows);
constexpr int kMaxWindowsV2 = 64;

// Divides the per-(sample, head) sums by n (and cls_entropy, slot kNumFeatures(N) − 1, by the number of CLS
// rows).
void run_finalize_features(const FusedParams& params, cudaStream_t stream);

// Device-side argument check (csrc/cuda/check_arguments.cu): the host cannot read device tensors without
// a sync, so one small kernel finds a bad entry of each kind and the host reads this report once.
// Every index is -1 (all bits set) when nothing is wrong; class_index is b * L + t.
struct ArgReport {
  long long len_index, len_value;
  long long mode_index, mode_value;
  long long region_index, region_value;
  long long class_index, class_value;
  long long kv_index, kv_value;
};

struct ArgCheckParams {
  const int64_t* lengths;      // [B] device; checked when check_lengths (else known to lie in [1, L])
  const int32_t* mode;         // [H] or nullptr
  const int32_t* region;       // [H] or nullptr
  const int32_t* token_class;  // [B, L] or nullptr; checked at valid positions t < lengths[b]
  const int32_t* kv_head;      // [H] or nullptr; checked to lie in [0, Hkv)
  bool check_lengths;
  int B, H, L, Hkv;
  ArgReport* report;           // device memory, every byte 0xff before the launch
};

void run_check_arguments(const ArgCheckParams& params, cudaStream_t stream);

struct JsParams {
  const float* attn;        // B×M×L×L contiguous
  const int64_t* lengths;   // [B]
  double* out;              // M×M, zero-initialised
  int B, M, L;
};

void run_js_distances(const JsParams& params, cudaStream_t stream);

// attnkit::word_attention (csrc/cuda/word_attention.cu): one block per (row, head, sample).
struct WordAttentionParams {
  enum Dtype { kFloat32, kFloat16, kBFloat16 };
  const void* q;             // B×H×L×D contiguous, dtype
  const void* k;
  const int64_t* lengths;    // [B]
  const int32_t* word_id;    // [B, L]
  float* words;              // B×H×W×W, zero-initialised
  int64_t* row_word;         // B×H×L, -1-initialised
  float* row_weight;         // B×H×L, zero-initialised
  int B, H, L, D, W;
  float scaling;
  Dtype dtype;
};
constexpr int64_t kWordAttentionMaxShared = 48 * 1024;  // bytes of dynamic shared memory without an opt-in
constexpr int64_t word_attention_shared_bytes(int64_t D, int64_t L, int64_t W) {
  return (D + L + W) * int64_t(sizeof(float)) + W * int64_t(sizeof(int));
}
void run_word_attention(const WordAttentionParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnkit
