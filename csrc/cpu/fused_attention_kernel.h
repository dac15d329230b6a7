// The CPU kernel of attnkit::fused_attention, split in two (docs/cuda.md has the CUDA side; the semantics are
// attnkit/reference.py):
//   * csrc/cpu/fused_attention.cpp (built once): checks the arguments, prepares plain arrays (this struct),
//     runs the tasks with at::parallel_for and sums the features;
//   * csrc/cpu/fused_attention_rows.h: the tasks' vectorised code (scores, online softmax, features, output),
//     built once per instruction set, as ATen builds its kernels (CPU_CAPABILITY): the translation units
//     csrc/cpu/capability/fused_attention_{default,avx2,avx512}.cpp (tools/generate_kernels.py) each define
//     attnkit::cpu::<CAPABILITY>::fused_attention_tasks; setup.py compiles each with its own flags, and the
//     host picks one at run time (the CPU capability torch reports, or $ATTNKIT_CPU_CAPABILITY).
// This header is all the two halves share: no ATen types, so the capability units include little beyond
// ATen's vector classes.
#pragma once

#include <cstdint>

namespace attnkit::cpu {

// Column-major C(m×n) = alpha · op(A) · op(B) + beta · C (BLAS conventions; beta = 0: C is not read);
// defined by the host (sgemm or ATen).
using GemmFn = void (*)(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                        int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

struct FusedCpuParams {
  int64_t B, H, L, D, N;  // N: distance windows
  int64_t BQ, BK, n_qblk;  // query rows per task, keys per block, query blocks per (sample, head)
  // query heads per task: GH consecutive heads that share one KV head (GH divides H; at most kMaxGroupedHeads), whose
  // scores and outputs each key block gives in one product of their stacked query rows
  int64_t GH;
  int64_t Lq, off;        // query rows; query row i is key position off + i (off = L − Lq: a KV-cache step)
  int64_t WL;             // the per-sample stride of win_of: max(L, Lq)
  // cross-attention (queries and keys from two sequences, off = 0): the keys of sample b are t < nk[b] (nullptr:
  // not cross-attention, the keys are t < n[b]); query_class: the queries' token classes, B×Lq (nullptr: none), whose
  // CLS rows cls_entropy averages (else token_class at the row's position)
  bool cross;
  const int64_t* nk;
  const int32_t* query_class;
  // fp32 operands: q B×H×Lq×D, k and v B×Hkv×L×D (unit stride along D)
  const float *q, *k, *v;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
  float* out;  // fp32 B×Lq×H×D
  float* lse;  // fp32 B×H×Lq natural-log log-sum-exp of each row (nullptr: not wanted)
  // fp32 per task: the max logit of its valid rows (NaN where a row's softmax is undefined: the host recomputes
  // those heads), written by every task except a zeroed head's (nullptr: not wanted)
  float* max_logit;
  // per head: mode, region, gate, KV head, sink logit (sink nullptr: none)
  const int32_t *mode, *region, *kv_head;
  const float *gate, *sink;
  // per sample: valid length; special keys (class != OTHER) of sample b at positions
  // special_pos[special_at[b] .. special_at[b + 1]) (increasing) with their classes in special_cls;
  // sentence ids as dense ranks (floats, B×L; nullptr: not needed); one_sentence[b]: every id of sample b
  // is the same (then intra is the row's whole mass)
  const int64_t* n;
  const int32_t* special_pos;
  const float* special_cls;  // class codes as floats
  const int64_t* special_at;
  const float* sidf;
  const uint8_t* one_sentence;
  // sid_runs[b]: the sentences of sample b are contiguous runs of keys, key t's being [sent_lo[b·L + t],
  // sent_hi[b·L + t]) (keys < n): the intra-sentence mass is then a range sum, not a compare per key
  const uint8_t* sid_runs;
  const int32_t *sent_lo, *sent_hi;
  const int32_t* token_class;  // B×L or nullptr
  const float* other_mask;     // B×L: 1 where the token class is OTHER, 0 for a special key; nullptr with token_class
  // distance windows of sample b: win_of[b·WL + d] = min(N − 1, ⌊d·N/n⌋) for d in [0, n) (cross-attention:
  // [0, WL), n its keys), and window j holds the distances [win_lo[b·(N+1) + j], win_lo[b·(N+1) + j + 1])
  const int32_t* win_of;
  const int64_t* win_lo;
  // an image's patch grid (docs/features.md, "Image heads"), B×L each: key t's row and column (0 off the grid)
  // and grid_mask 1 where t is a patch and t < n, else 0; nullptr when no grid is given
  const float *grid_row, *grid_col, *grid_mask;
  // alignment features (docs/features.md, "Alignment"): each valid row's aligned key position p (self-attention: its
  // own position s; cross-attention: i·(nk − 1)/(n − 1), 0 when n = 1), Σ w·|t − p| and the mass on the keys within
  // 1 of ⌊p + 1/2⌋
  bool align;
  // an additive bias (T5's position_bias, docs/seq2seq.md §3): fp32 (1 or B)×H×Lq×L, contiguous, added to the scores
  // q·k·scaling before the soft-cap as the reference adds it; sample b's at bias + b·bias_bs (0: one bias for every
  // sample); nullptr: none
  const float* bias;
  int64_t bias_bs;
  const float* key_scale;  // B×H×L or nullptr (norm weighting of the features)
  const float* log_key_scale;  // ln g (0 where g = 0), B×H×L, with key_scale
  double scaling;
  bool renormalize, want_features, causal;
  int64_t window;  // sliding window W, 0: none
  bool symmetric_window;  // the window also limits the keys after s (t − s < W): bidirectional
  float softcap;   // 0: none
  // features: per task FA doubles (see fused_attention.cpp); nullptr when not wanted
  double* partial;
  int64_t FA;
  GemmFn gemm;
  // the tile's two products computed in place (small_qk, small_pv in vec_util.h) instead of by `gemm`: a BLAS
  // call costs about a microsecond before any arithmetic, more than a tile of a sentence (36 × 36 keys, D = 8)
  bool small_products;
};

// Tiles of fewer than this many multiply-adds per product (BQ · BK · D) use the products in place by default: below
// it a BLAS call's fixed cost outweighs its faster arithmetic; at the limit itself (64 rows × 128 keys at D = 64) BLAS
// is as fast or faster (docs/cuda.md, "Small tiles", has the runs).
// $ATTNKIT_CPU_SMALL_PRODUCTS overrides it (0: always BLAS).
constexpr int64_t kSmallProducts = int64_t(1) << 19;

// The per-row online state of the tasks (floats): see fused_attention_rows.h.
// An image's ring masses (docs/features.md "Image heads", attnkit.features.RING_BOUNDS 0, 1, 2, 4, 8 patches): the
// squared bounds between them, and the row's sums below each bound and over every patch key
constexpr int64_t kRingSlots = 5;
constexpr float kRingSquared[kRingSlots - 1] = {1.f, 4.f, 16.f, 64.f};
constexpr int64_t kRowStateFixed = 19 + kRingSlots;  // the row state's slots before the windows
constexpr int64_t kRowStateSlots(int64_t num_windows) { return kRowStateFixed + num_windows; }

// The most query heads one task takes (FusedCpuParams::GH), and the most query rows of its stacked heads (GH · BQ):
// beyond them the stacked score tiles outgrow the L2 cache.
constexpr int64_t kMaxGroupedHeads = 8;
constexpr int64_t kGroupedRows = 768;

// Per-thread scratch, fixed in size (independent of L), for the GH heads of a task: S GH×BQ×BK scores, acc GH×BQ×D
// output accumulators, pc BK feature weights, state GH×BQ × kRowStateSlots(N), diag GH×(BQ + BK) per-offset window
// sums (zero between tasks), kt D×BK the key block transposed (small_products only, else nullptr), qc GH×BQ×D the
// stacked query rows (GH > 1 without small_products, else nullptr).
struct FusedCpuScratch {
  float *S, *acc, *pc, *state, *diag, *kt, *qc;
};

// The slots of the per-task feature sums (FA = F0 + 5 + kRingSlots doubles, F0 = kNumFeatures(N)): [0, F0 − 1) the
// per-row feature sums, [F0 − 1] unused, [F0] the CLS rows' entropy sum, [F0 + 1] the sink mass sum, [F0 + 2] the
// patch rows' attention distance sum, [F0 + 3, F0 + 3 + kRingSlots) their ring masses' sums, then the alignment
// sums: kAlignSlot(F0) the offset, kAlignSlot(F0) + 1 the near mass.
constexpr int64_t kAlignSlot(int64_t f0) { return f0 + 3 + kRingSlots; }
constexpr int64_t kPartialSlots(int64_t f0) { return kAlignSlot(f0) + 2; }

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
