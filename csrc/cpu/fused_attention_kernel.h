// The CPU kernel of attnkit::fused_attention, split in two (docs/cuda.md has the CUDA side; the semantics are
// attnkit/reference.py):
//   * csrc/cpu/fused_attention.cpp (built once): checks the arguments, prepares plain arrays (this struct),
//     runs the tasks with at::parallel_for and sums the features;
//   * csrc/cpu/fused_attention_rows.h: the tasks' vectorised code (scores, softmax, features, output), built
//     once per instruction set, as ATen builds its kernels (CPU_CAPABILITY): the translation units
//     csrc/cpu/capability/fused_attention_{default,avx2,avx512}.cpp (tools/generate_kernels.py) each define
//     attnkit::cpu::<CAPABILITY>::fused_attention_tasks; setup.py compiles each with its own flags, and the
//     host picks one at run time (the CPU capability torch reports, or $ATTNKIT_CPU_CAPABILITY).
// This header is all the two halves share: no ATen types, so the capability units include little beyond
// ATen's vector classes.
#pragma once

#include <cstdint>

namespace attnkit::cpu {

// Column-major C(m×n) = alpha · op(A) · op(B) (BLAS conventions); defined by the host (sgemm or ATen).
using GemmFn = void (*)(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                        int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc);

struct FusedCpuParams {
  int64_t B, H, L, D, N;  // N: distance windows
  int64_t TQ, n_tiles;    // query rows per task, row tiles per (sample, head)
  // fp32 operands: q B×H×L×D, k and v B×Hkv×L×D (unit stride along D)
  const float *q, *k, *v;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
  float* out;  // fp32 B×L×H×D
  // per head: mode, region, gate, KV head, sink logit (sink nullptr: none)
  const int32_t *mode, *region, *kv_head;
  const float *gate, *sink;
  // per sample: valid length; special keys (position, class) of sample b at special[special_at[b] ..
  // special_at[b + 1]); sentence ids as dense ranks (floats, B×L; nullptr: not needed); CLS-row flags
  const int64_t* n;
  const int32_t* special;  // pairs (position, class)
  const int64_t* special_at;
  const float* sidf;
  const int32_t* token_class;  // B×L or nullptr
  const float* key_scale;      // B×H×L or nullptr (norm weighting of the features)
  double scaling;
  bool renormalize, want_features, causal;
  int64_t window;  // sliding window W, 0: none
  float softcap;   // 0: none
  // features: per task FA doubles (see fused_attention.cpp); nullptr when not wanted
  double* partial;
  int64_t FA;
  GemmFn gemm;
};

// Per-thread scratch, sized by the host: S TQ×L, row_c TQ, diag 2L, scaled_row L.
struct FusedCpuScratch {
  float *S, *row_c, *diag, *scaled_row;
};

// The slots of the per-task feature sums (FA = F0 + 2 doubles, F0 = kNumFeatures(N)): [0, F0 − 1) the
// per-row feature sums, [F0 − 1] unused, [F0] the CLS rows' entropy sum, [F0 + 1] the sink mass sum.
constexpr int64_t kPartialSlots(int64_t f0) { return f0 + 2; }

using FusedTasksFn = void (*)(const FusedCpuParams&, int64_t begin, int64_t end, const FusedCpuScratch&);

// One definition per capability unit (weak: a build without a unit leaves it null).
#define ATTNKIT_DECLARE_CAPABILITY(CAP)                                                                 \
  namespace CAP {                                                                                      \
  __attribute__((weak)) void fused_attention_tasks(const FusedCpuParams&, int64_t, int64_t,           \
                                                   const FusedCpuScratch&);                           \
  }
ATTNKIT_DECLARE_CAPABILITY(DEFAULT)
ATTNKIT_DECLARE_CAPABILITY(AVX2)
ATTNKIT_DECLARE_CAPABILITY(AVX512)
#undef ATTNKIT_DECLARE_CAPABILITY

}  // namespace attnkit::cpu
