// The single-pass tensor-core fused attention kernel "v2" (docs/pipeline.md, "CUDA kernels"; semantics
// exactly attnkit/reference.py, definitions in docs/features.md and docs/interventions.md).
//
// FlashAttention-2's forward structure, written with CuTe: one block owns kBlockM query rows of one
// (sample b, head h); Q is loaded once and kept in registers as MMA A fragments; K and V tiles of kBlockN
// keys stream through two shared-memory stages with cp.async, one tile ahead; S = Q Kᵀ accumulates in
// registers (m16n8k16, fp32), the row max and sums are reduced over the four threads of a row's quad by
// warp shuffles, and P is repacked in registers as the A operand of P·V.
//
// One pass over the keys for every mode, region and feature. With the running row max m (log2 units,
// x = s·scaling·log2 e) every sum is a sum of 2^(x − m)·f terms and is rescaled by 2^(m_old − m_new) when
// the max grows, exactly like the output:
//   l   = Σ e                       softmax denominator (e = 2^(x − m); uniform mode: e = 1, m = 0)
//   lk  = Σ e·keep                  kept mass (the denominator when renormalising after a region)
//   zf  = Σ pf,  pf = e·keep·g      mass the features describe (g: the key scale, 1 without)
//   A   = Σ pf·(x − m + log2 g)     entropy term: H = (zf/Zf)·ln Zf − ln 2 · A / Zf
//   intra, prev, next               pf on same-sentence keys, on key s − 1, on key s + 1
//   buckets (class, self, windows)  run-length sums of pf over the thread's contiguous keys, flushed to
//                                   the row's own shared-memory copy when the bucket changes
//   mf  = max over kept keys of x + log2 g   (max feature = 2^(mf − m) / Zf; no rescaling needed)
// A's update when m grows by δ: A ← 2^(−δ)·(A − δ·zf). The entropy never subtracts two large numbers:
// every term x − m + log2 g is computed per key. No intervention needs a second pass: the region only
// decides which of e enters P (and lk), and uniform mode replaces the scores by 0.
//
// Output: O / Z · gate with Z = lk when renormalising a region, else l; staged through shared memory
// (the Q region) for coalesced 16-byte stores. Features of the valid rows (s < n) are reduced over the
// block in shared memory and added to the fp32 B×H×F sums; fused_attention_finalize.cu divides by n.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <climits>
#include <cstdint>

#include "fused_attention_common.cuh"
#include "fused_attention_params.h"
#include "fused_attention_v2_traits.h"

namespace attnkit {
namespace cuda {
namespace v2 {

using namespace cute;

// Per-row scratch slots (Traits::kRowScratch floats per row) for the block's feature reduction.
constexpr int kRowInvZ = 0, kRowValid = 1, kRowFirst = 2;  // then the kNumRowSlots per-row features

// ---- small CuTe helpers ------------------------------------------------------------------------------
// (rows, cols) view of an m16n8 accumulator layout ((2, 2), MMA_M, MMA_N): rows (2, MMA_M), cols (2, MMA_N).
template <typename Layout>
__device__ __forceinline__ auto rowcol_layout(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3, "m16n8 accumulator");
  auto split = logical_divide(acc, Shape<_2>{});
  return make_layout(make_layout(get<0, 1>(split), get<1>(split)), make_layout(get<0, 0>(split), get<2>(split)));
}

// The same registers seen as the A operand of an m16n8k16 product: two n8 accumulator tiles form one k16
// step, so ((2, 2), MMA_M, MMA_N) becomes ((2, 2, 2), MMA_M, MMA_N / 2).
template <typename Layout>
__device__ __forceinline__ auto acc_as_a_layout(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3, "m16n8 accumulator");
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

template <typename To, typename Engine, typename Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int kN = decltype(size(t))::value;
  cutlass::NumericArrayConverter<To, From, kN> op;
  auto frag = op(*reinterpret_cast<const cutlass::Array<From, kN>*>(t.data()));
  return make_tensor(make_rmem_ptr<To>(&frag), t.layout());
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 4-byte cp.async with zero fill (src_bytes 0 reads nothing and writes 0).
__device__ __forceinline__ void cp_async_word(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(bytes));
#endif
}

// Rows of a (rows × D) tile: copy the rows below `limit`, zero the others (padded or missing keys then
// contribute exactly 0, and no uninitialised NaN meets a zero weight).
template <typename TiledCopy, typename Src, typename Dst, typename Coord>
__device__ __forceinline__ void copy_rows(TiledCopy const& tiled_copy, Src const& src, Dst&& dst, Coord const& coord,
                                          int limit) {
#pragma unroll
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < limit) {
#pragma unroll
      for (int k = 0; k < size<2>(src); ++k) cute::copy(tiled_copy, src(_, m, k), dst(_, m, k));
    } else {
      cute::clear(dst(_, m, _));
    }
  }
}

// ---- the kernel ------------------------------------------------------------------------------------------
template <typename Tr, bool kFeatures, bool kScaled>
__device__ __forceinline__ void fused_attention_v2_body(const FusedParams& p) {
  using T = typename Tr::T;
  using Element = typename Tr::Element;
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int D = Tr::kHeadDim;
  constexpr int NT = Tr::kThreads;
  constexpr int kQuad = Tr::kQuad;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;

  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x;
  const int quad_lane = tid % kQuad;
  const int m_block = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int L = p.L;
  const int row0 = m_block * BM;

  const HeadSetup hs = head_setup(p, b, h);
  if (early_exit<T>(p, hs, b, h, D, row0, BM, tid, NT)) return;
  const int n = hs.n;
  const int region = hs.region;
  const bool use_scores = hs.mode == kModeKeep;
  const bool renorm_kept = p.renormalize && region != kRegionAll;
  const int N = p.num_windows;
  const int FB = kNumBucketSlots(N);
  const int n_tiles = (n + BN - 1) / BN;

  // ---- global and shared tensors ----
  const Element* qg = reinterpret_cast<const Element*>(p.q) + int64_t(b) * p.q_stride_b + int64_t(h) * p.q_stride_h;
  const Element* kg = reinterpret_cast<const Element*>(p.k) + int64_t(b) * p.k_stride_b + int64_t(hs.kv) * p.k_stride_h;
  const Element* vg = reinterpret_cast<const Element*>(p.v) + int64_t(b) * p.v_stride_b + int64_t(hs.kv) * p.v_stride_h;
  Tensor mQ = make_tensor(make_gmem_ptr(qg), make_shape(L, Int<D>{}), make_stride(p.q_stride_l, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(kg), make_shape(n, Int<D>{}), make_stride(p.k_stride_l, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(vg), make_shape(n, Int<D>{}), make_stride(p.v_stride_l, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<BM>, Int<D>>{}, make_coord(m_block, 0));  // (BM, D)
  Tensor gK = local_tile(mK, Shape<Int<BN>, Int<D>>{}, make_coord(_, 0));        // (BN, D, tiles)
  Tensor gV = local_tile(mV, Shape<Int<BN>, Int<D>>{}, make_coord(_, 0));

  Element* q_smem = reinterpret_cast<Element*>(smem);
  Element* k_smem = reinterpret_cast<Element*>(smem + Tr::kOffK);
  Element* v_smem = reinterpret_cast<Element*>(smem + Tr::kOffV);
  int* meta_smem = reinterpret_cast<int*>(smem + Tr::kOffMeta);
  float* row_smem = reinterpret_cast<float*>(smem + Tr::kOffRows);
  float* bucket_smem = reinterpret_cast<float*>(smem + Tr::kOffBuckets);
  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename Tr::SmemLayoutQ{});
  constexpr int kTileElems = BN * D;

  typename Tr::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);  // (CPY, CPY_N, CPY_K, tiles)
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor cQ = make_identity_tensor(Shape<Int<BM>, Int<D>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<BN>, Int<D>>{});
  Tensor tQcQ = gmem_thr.partition_S(cQ);
  Tensor tKVcKV = gmem_thr.partition_S(cKV);

  typename Tr::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K)
  Tensor sK0 = make_tensor(make_smem_ptr(k_smem), typename Tr::SmemLayoutKV{});
  Tensor tSrK = thr_mma.partition_fragment_B(sK0);  // (MMA, MMA_N, MMA_K)
  Tensor sVt0NoSwizzle = make_tensor(make_smem_ptr(v_smem), typename Tr::SmemLayoutVtNoSwizzle{});
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt0NoSwizzle);  // (MMA, MMA_K, MMA_N)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<D>>{});

  auto smem_copy_q = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tid);
  auto smem_copy_k = make_tiled_copy_B(typename Tr::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tid);
  auto smem_copy_v = make_tiled_copy_B(typename Tr::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tid);

  // Where each accumulator element of this thread sits in the (BM × BN) score tile.
  Tensor cS = make_identity_tensor(Shape<Int<BM>, Int<BN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), rowcol_layout(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;  // rows of this thread (2 per m16 tile)
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;  // key columns of this thread per tile
  static_assert(kRows == 2 * BM / (16 * Tr::kNWarps), "two rows per thread per m16 tile");
  static_assert(kCols == 2 * BN / 8, "two adjacent keys per n8 tile");
  CUTE_STATIC_ASSERT_V(size<1>(tSrQ) == size<1>(acc_o));  // MMA_M

  // ---- this thread's rows ----
  const int32_t* sid_b = p.sentence_id != nullptr ? p.sentence_id + int64_t(b) * L : nullptr;
  const int32_t* cls_b = p.token_class != nullptr ? p.token_class + int64_t(b) * L : nullptr;
  const float* g_bh = kScaled ? p.key_scale + (int64_t(b) * p.H + h) * L : nullptr;
  int row_local[kRows], row_s[kRows], row_sid[kRows];
  bool row_valid[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    row_local[i] = get<0>(tScS_rc(i, 0));
    row_s[i] = row0 + row_local[i];
    row_sid[i] = (sid_b != nullptr && row_s[i] < L) ? sid_b[row_s[i]] : 0;
    row_valid[i] = row_s[i] < n;
  }

  // ---- loads: Q and the first key tile, then one tile ahead ----
  auto load_tile = [&](int tile, int stage) {
    const int key0 = tile * BN;
    if (use_scores) {
      Tensor sK = make_tensor(make_smem_ptr(k_smem + stage * kTileElems), typename Tr::SmemLayoutKV{});
      Tensor tKsK = gmem_thr.partition_D(sK);
      copy_rows(gmem_copy, tKgK(_, _, _, tile), tKsK, tKVcKV, n - key0);
    }
    Tensor sV = make_tensor(make_smem_ptr(v_smem + stage * kTileElems), typename Tr::SmemLayoutKV{});
    Tensor tVsV = gmem_thr.partition_D(sV);
    copy_rows(gmem_copy, tVgV(_, _, _, tile), tVsV, tKVcKV, n - key0);
    if (tid < BN) {
      int* meta = meta_smem + stage * Tr::kMetaStageWords;
      const int t = key0 + tid;
      const bool in = t < n;
      const int ts = in ? t : 0;
      if (kFeatures && cls_b != nullptr) cp_async_word(meta + tid, cls_b + ts, in);
      if (sid_b != nullptr) cp_async_word(meta + BN + tid, sid_b + ts, in);
      if (kScaled) cp_async_word(meta + 2 * BN + tid, g_bh + ts, in);
    }
  };

  copy_rows(gmem_copy, tQgQ, tQsQ, tQcQ, L - row0);
  load_tile(0, 0);
  cute::cp_async_fence();

  // ---- per-row running state ----
  float m_run[kRows], l_run[kRows], lk_run[kRows];
  float zf[kRows], ent_a[kRows], intra[kRows], prev[kRows], next[kRows], mf[kRows], run_acc[kRows];
  int run_bucket[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    m_run[i] = use_scores ? -INFINITY : 0.f;
    l_run[i] = lk_run[i] = zf[i] = ent_a[i] = intra[i] = prev[i] = next[i] = run_acc[i] = 0.f;
    mf[i] = -INFINITY;
    run_bucket[i] = -1;
  }
  bool bad_class = false;
  clear(acc_o);
  const float scale_log2 = p.scaling * kLog2e;
  const cutlass::FastDivmod div_n(n);
  const cutlass::FastDivmod div_N(N);
  // the smallest and largest key column this thread holds in a tile (for the window cuts below)
  int col_min = BN, col_max = -1;
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    col_min = min(col_min, int(get<1>(tScS_rc(0, j))));
    col_max = max(col_max, int(get<1>(tScS_rc(0, j))));
  }
  // the row's own copy of its bucket sums: [row][bucket][quad lane]
  auto bucket_ref = [&](int i, int bucket) -> float& {
    return bucket_smem[(row_local[i] * FB + bucket) * kQuad + quad_lane];
  };
  if constexpr (kFeatures) {
    for (int idx = tid; idx < BM * FB * kQuad; idx += NT) bucket_smem[idx] = 0.f;
  }

  for (int tile = 0; tile < n_tiles; ++tile) {  // sass-budget: tile loop
    const int stage = tile & 1;
    const int key0 = tile * BN;
    if (tile + 1 < n_tiles) load_tile(tile + 1, stage ^ 1);
    cute::cp_async_fence();
    cute::cp_async_wait<1>();  // this tile (and Q) have landed; the next one is in flight
    if (kFeatures && cls_b != nullptr && tid < BN) {
      // a class code the host could not check (graph capture): the head's features are NaN, and the key counts
      // as OTHER so that no bucket index leaves its range. Checked once per key by the thread whose cp.async
      // loaded it (its own copy has landed), not per score.
      int* kc_word = meta_smem + stage * Tr::kMetaStageWords + tid;
      if (static_cast<unsigned>(*kc_word) > static_cast<unsigned>(kClassPeriod)) {
        bad_class |= key0 + tid < n;
        *kc_word = kClassOther;
      }
    }
    __syncthreads();
    if (tile == 0) {  // sass-budget: rare
      Tensor tSsQ = smem_thr_q.partition_S(sQ);
      Tensor tSrQ_view = smem_thr_q.retile_D(tSrQ);
      cute::copy(smem_copy_q, tSsQ, tSrQ_view);
    }

    // S = Q Kᵀ (fp32 accumulators); uniform mode needs no scores
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});
    clear(acc_s);
    if (use_scores) {
      Tensor sK = make_tensor(make_smem_ptr(k_smem + stage * kTileElems), typename Tr::SmemLayoutKV{});
      Tensor tSsK = smem_thr_k.partition_S(sK);
      Tensor tSrK_view = smem_thr_k.retile_D(tSrK);
      cute::copy(smem_copy_k, tSsK(_, _, _0{}), tSrK_view(_, _, _0{}));
#pragma unroll
      for (int k = 0; k < size<2>(tSrQ); ++k) {
        if (k + 1 < size<2>(tSrQ)) cute::copy(smem_copy_k, tSsK(_, _, k + 1), tSrK_view(_, _, k + 1));
        cute::gemm(tiled_mma, tSrQ(_, _, k), tSrK(_, _, k), acc_s);
      }
    }
    Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));  // (kRows, kCols)
    Tensor o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));

    // scale to log2 units (uniform mode: S was cleared and stays 0), mask keys beyond n in the tail tile only
    // (a block-uniform branch), new row max, rescale everything kept so far
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
#pragma unroll
      for (int j = 0; j < kCols; ++j) s_rc(i, j) *= scale_log2;
    }
    if (key0 + BN > n) {  // sass-budget: rare
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        if (key0 + get<1>(tScS_rc(0, j)) >= n) {
#pragma unroll
          for (int i = 0; i < kRows; ++i) s_rc(i, j) = -INFINITY;
        }
      }
    }
    float m_use[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kCols; ++j) tile_max = fmaxf(tile_max, s_rc(i, j));
      if (use_scores) {
        const float m_new = fmaxf(m_run[i], quad_max(tile_max));
        if (m_new > m_run[i]) {  // sass-budget: rare
          const bool first = m_run[i] == -INFINITY;
          const float sc = first ? 0.f : exp2f(m_run[i] - m_new);
          if (!first) {
            ent_a[i] = sc * (ent_a[i] - (m_new - m_run[i]) * zf[i]);
            l_run[i] *= sc;
            lk_run[i] *= sc;
            zf[i] *= sc;
            intra[i] *= sc;
            prev[i] *= sc;
            next[i] *= sc;
            run_acc[i] *= sc;
#pragma unroll
            for (int c = 0; c < size<1>(o_rc); ++c) o_rc(i, c) *= sc;
            if constexpr (kFeatures) {
              for (int bk = 0; bk < FB; ++bk) bucket_ref(i, bk) *= sc;
            }
          }
          m_run[i] = m_new;
        }
      }
      // exponent base: the running max, or 0 while every score so far is -inf (those keys weigh 0; a row
      // whose scores are all -inf ends with l = 0 and is undefined)
      m_use[i] = m_run[i] == -INFINITY ? 0.f : m_run[i];
    }

    const int* meta = meta_smem + stage * Tr::kMetaStageWords;
    const bool diag = key0 <= row0 + BM && key0 + BN >= row0 - 1;  // keys s - 1 .. s + 1 may be here
    // the largest kept x (+ log2 g) per row, for `max` under a region or a key scale: a block-uniform branch, so
    // the extraction path (region all, no key scale) issues none of it
    if (kFeatures && (kScaled || region != kRegionAll)) {  // sass-budget: rare
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int col = get<1>(tScS_rc(0, j));
        const int ks = sid_b != nullptr ? meta[BN + col] : 0;
        const float lg = kScaled ? __log2f(__int_as_float(meta[2 * BN + col])) : 0.f;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          if (region_keeps(region, ks == row_sid[i])) mf[i] = fmaxf(mf[i], s_rc(i, j) + lg);
        }
      }
    }
    // Window cuts (the review's §2, without a division per score): when each of this thread's rows sees its
    // tile keys on one side only and they span at most two windows w_lo, w_lo + 1, the window of distance d is
    // w_lo + (d >= cut) with cut = ceil((w_lo + 1)·n / N), the first distance of window w_lo + 1. Two
    // divisions per row and tile instead of one per score; a warp-uniform vote picks this path, else the
    // division below (the diagonal's tiles, and windows narrower than a tile).
    int win_lo[kRows], win_cut[kRows], d_base[kRows], d_sign[kRows];
    bool cuts = false;
    if constexpr (kFeatures) {
      bool ok = true;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int s = row_s[i];
        const bool right = key0 + col_min > s;
        ok = ok && (right || key0 + col_max < s);
        d_sign[i] = right ? 1 : -1;
        d_base[i] = right ? key0 - s : s - key0;  // d = d_base + d_sign · col
        const int d_min = right ? key0 + col_min - s : s - key0 - col_max;
        const int d_max = right ? key0 + col_max - s : s - key0 - col_min;
        const int w_lo = min(div_n.div(max(d_min, 0) * N), N - 1);
        const int w_hi = min(div_n.div(max(d_max, 0) * N), N - 1);
        ok = ok && w_hi - w_lo <= 1;
        win_lo[i] = kSlotFirstWindow + w_lo;
        win_cut[i] = w_lo >= N - 1 ? INT_MAX : div_N.div((w_lo + 1) * n + N - 1);
      }
      cuts = __all_sync(0xffffffffu, ok);
    }
    // weights, features, run-length buckets; column-outer so a key's metadata is read once. Rows past n
    // accumulate too (no per-score branch): the block's reduction drops them (kRowValid).
    auto weights = [&](auto region_all, auto by_cuts) {
      constexpr bool kAll = decltype(region_all)::value;
      constexpr bool kCuts = decltype(by_cuts)::value;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int col = get<1>(tScS_rc(0, j));
        [[maybe_unused]] const int t = key0 + col;
        [[maybe_unused]] const int kc = kFeatures && cls_b != nullptr ? meta[col] : kClassOther;
        const int ks = sid_b != nullptr ? meta[BN + col] : 0;
        [[maybe_unused]] float g = 1.f, lg = 0.f;
        if constexpr (kScaled) {
          g = __int_as_float(meta[2 * BN + col]);
          lg = __log2f(g);
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          const float x = s_rc(i, j) - m_use[i];  // ≤ 0; -inf for masked keys
          const float e = exp2f(x);
          const bool same = ks == row_sid[i];
          const float po = kAll || region_keeps(region, same) ? e : 0.f;
          l_run[i] += e;
          if constexpr (!kAll) lk_run[i] += po;  // sass-budget: rare line
          s_rc(i, j) = po;  // P, unnormalised
          if constexpr (kFeatures) {
            const float pf = kScaled ? po * g : po;
            zf[i] += pf;
            // 0·(−inf) would be NaN at a key whose score is −inf: clamp
            ent_a[i] = fmaf(pf, fmaxf(kScaled ? x + lg : x, -1e30f), ent_a[i]);
            if (same) intra[i] += pf;
            const int s = row_s[i];
            int bucket;
            if (kc != kClassOther) {  // sass-budget: rare
              bucket = class_slot(kc);
            } else if (kCuts) {
              bucket = win_lo[i] + (d_base[i] + d_sign[i] * col >= win_cut[i]);
            } else if (diag && t == s) {
              bucket = kSlotSelf;
            } else {
              const int w = div_n.div((t > s ? t - s : s - t) * N);  // sass-budget: rare line
              bucket = kSlotFirstWindow + (w < N - 1 ? w : N - 1);  // keys beyond n (weight 0) stay in range
            }
            if (bucket == run_bucket[i]) {
              run_acc[i] += pf;
            } else {  // sass-budget: rare
              if (run_bucket[i] >= 0) bucket_ref(i, run_bucket[i]) += run_acc[i];
              run_bucket[i] = bucket;
              run_acc[i] = pf;
            }
          }
        }
      }
    };
    if (region == kRegionAll) {
      if (cuts) {
        weights(std::true_type{}, std::true_type{});
      } else {  // sass-budget: rare
        weights(std::true_type{}, std::false_type{});
      }
    } else if (cuts) {  // sass-budget: rare
      weights(std::false_type{}, std::true_type{});
    } else {
      weights(std::false_type{}, std::false_type{});
    }
    // prev and next: only tiles that hold a key s ± 1 of some row (a block-uniform branch)
    if (kFeatures && diag) {  // sass-budget: rare
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int t = key0 + get<1>(tScS_rc(0, j));
        const float g = kScaled ? __int_as_float(meta[2 * BN + get<1>(tScS_rc(0, j))]) : 1.f;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          if (t == row_s[i] - 1) prev[i] += s_rc(i, j) * g;
          if (t == row_s[i] + 1) next[i] += s_rc(i, j) * g;
        }
      }
    }

    // O += P V
    Tensor r_p = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(r_p.data(), acc_as_a_layout(r_p.layout()));
    Tensor sVt = make_tensor(make_smem_ptr(v_smem + stage * kTileElems), typename Tr::SmemLayoutVt{});
    Tensor tOsVt = smem_thr_v.partition_S(sVt);
    Tensor tOrVt_view = smem_thr_v.retile_D(tOrVt);
    cute::copy(smem_copy_v, tOsVt(_, _, _0{}), tOrVt_view(_, _, _0{}));
#pragma unroll
    for (int k = 0; k < size<2>(tOrP); ++k) {
      if (k + 1 < size<2>(tOrP)) cute::copy(smem_copy_v, tOsVt(_, _, k + 1), tOrVt_view(_, _, k + 1));
      cute::gemm(tiled_mma, tOrP(_, _, k), tOrVt(_, _, k), acc_o);
    }
    __syncthreads();  // this stage is read by everyone before the next iteration refills it
  }
  cute::cp_async_wait<0>();

  // ---- finish the rows ----
  Tensor o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
  float* rows = row_smem;
  bool undefined_row = false;  // a valid row whose softmax is undefined poisons the head's features
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    if constexpr (kFeatures) {
      if (row_valid[i] && run_bucket[i] >= 0) bucket_ref(i, run_bucket[i]) += run_acc[i];
    }
    const float l = quad_sum(l_run[i]);
    const float lk = region == kRegionAll ? l : quad_sum(lk_run[i]);  // lk_run is kept only under a region
    const float z_out = renorm_kept ? lk : l;
    // a NaN denominator (undefined row) stays NaN; nothing kept leaves the row 0
    const float inv_out = z_out > 0.f ? 1.f / z_out : (z_out == z_out ? 0.f : z_out);
#pragma unroll
    for (int c = 0; c < size<1>(o_rc); ++c) o_rc(i, c) *= inv_out * hs.gate;
    if constexpr (kFeatures) {
      const float z = quad_sum(zf[i]);
      const float a = quad_sum(ent_a[i]);
      const float in = quad_sum(intra[i]);
      const float pv = quad_sum(prev[i]);
      const float nx = quad_sum(next[i]);
      const float mx = quad_max(mf[i]);
      const float zfeat = kScaled ? z : z_out;  // the features' own normaliser (key scale) or the output's
      const bool undefined = use_scores && (!(l > 0.f && l < INFINITY) || a != a);
      undefined_row |= undefined && row_valid[i];
      const float inv = undefined ? NAN : (zfeat > 0.f ? 1.f / zfeat : 0.f);
      const float entropy = zfeat > 0.f ? (z * inv) * __logf(zfeat) - kLn2 * a * inv : 0.f;
      const float peak = kScaled || region != kRegionAll ? mx : m_run[i];
      const float max_w = peak > -INFINITY ? exp2f(peak - m_run[i]) * inv : 0.f;
      const int s = row_s[i];
      const bool is_cls = cls_b != nullptr && s < L && cls_b[s] == kClassCls;
      if (quad_lane == 0) {
        float* r = rows + row_local[i] * Tr::kRowScratch;
        r[kRowInvZ] = undefined ? NAN : inv;
        r[kRowValid] = row_valid[i] ? 1.f : 0.f;
        r[kRowFirst + kRowPrev] = pv * inv;
        r[kRowFirst + kRowNext] = nx * inv;
        r[kRowFirst + kRowEntropy] = undefined ? NAN : entropy;
        r[kRowFirst + kRowMax] = undefined ? NAN : max_w;
        r[kRowFirst + kRowIntra] = in * inv;
        r[kRowFirst + kRowInter] = (z - in) * inv;
        r[kRowFirst + kRowClsEntropy] = is_cls ? (undefined ? NAN : entropy) : 0.f;
      }
    }
  }

  // ---- output: registers → shared (the Q region) → 16-byte global stores ----
  {
    Tensor r_o = convert_fragment<Element>(acc_o);
    Tensor sO = make_tensor(make_smem_ptr(q_smem), typename Tr::SmemLayoutQ{});
    auto smem_copy_o = make_tiled_copy_C(typename Tr::SmemCopyAtomO{}, tiled_mma);
    auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
    Tensor taccOrO = smem_thr_o.retile_S(r_o);
    Tensor taccOsO = smem_thr_o.partition_D(sO);
    cute::copy(smem_copy_o, taccOrO, taccOsO);
    __syncthreads();
    Element* out = reinterpret_cast<Element*>(p.out) + (int64_t(b) * L * p.H + h) * D;
    Tensor mO = make_tensor(make_gmem_ptr(out), make_shape(L, Int<D>{}), make_stride(int64_t(p.H) * D, _1{}));
    Tensor gO = local_tile(mO, Shape<Int<BM>, Int<D>>{}, make_coord(m_block, 0));
    typename Tr::GmemTiledCopyO gmem_copy_o;
    auto gmem_thr_o = gmem_copy_o.get_thread_slice(tid);
    Tensor tOsO = gmem_thr_o.partition_S(sO);
    Tensor tOgO = gmem_thr_o.partition_D(gO);
    Tensor tOrO = make_tensor<Element>(shape(tOgO));
    cute::copy(gmem_copy_o, tOsO, tOrO);
    Tensor tOcO = gmem_thr_o.partition_D(cQ);
#pragma unroll
    for (int m = 0; m < size<1>(tOgO); ++m) {
      if (row0 + get<0>(tOcO(0, m, 0)) < L) {
#pragma unroll
        for (int k = 0; k < size<2>(tOgO); ++k) cute::copy(gmem_copy_o, tOrO(_, m, k), tOgO(_, m, k));
      }
    }
  }

  // ---- features: reduce the block's valid rows into the per-(sample, head) sums ----
  if constexpr (kFeatures) {
    // (the __syncthreads above also ordered the row scratch and bucket writes)
    const bool poison = __syncthreads_or(bad_class || undefined_row) != 0;
    float* gfeat = p.features + (int64_t(b) * p.H + h) * p.num_features;
    const int rows_base = kNumBucketSlots(N);
    for (int f = tid; f < p.num_features; f += NT) {
      float acc = 0.f;
      for (int r = 0; r < BM; ++r) {
        const float* rr = rows + r * Tr::kRowScratch;
        if (rr[kRowValid] == 0.f) continue;
        if (f < rows_base) {
          const float4 q4 = *reinterpret_cast<const float4*>(bucket_smem + (r * FB + f) * kQuad);
          acc += (q4.x + q4.y + q4.z + q4.w) * rr[kRowInvZ];
        } else {
          acc += rr[kRowFirst + (f - rows_base)];
        }
      }
      if (poison) acc = NAN;
      if (acc != 0.f) atomicAdd(&gfeat[f], acc);  // NaN != 0 is true: NaN is added
    }
  }
}

template <typename Tr, bool kFeatures, bool kScaled>
__global__ void __launch_bounds__(Tr::kThreads) fused_attention_v2_kernel(const FusedParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  fused_attention_v2_body<Tr, kFeatures, kScaled>(p);
#else
  __trap();  // the host only launches v2 on compute capability 8.0 or newer
#endif
}

template <typename T, int kHeadDim>
void launch_fused_attention_v2(const FusedParams& params, cudaStream_t stream) {
  using Tr = Traits<T, kHeadDim>;
  const dim3 grid((params.L + Tr::kBlockM - 1) / Tr::kBlockM, params.H, params.B);
  const bool features = params.features != nullptr;
  const bool scaled = features && params.key_scale != nullptr;
  const int smem = Tr::smem_bytes(features, params.num_windows);
  auto kernel = !features ? fused_attention_v2_kernel<Tr, false, false>
                          : (scaled ? fused_attention_v2_kernel<Tr, true, true> : fused_attention_v2_kernel<Tr, true, false>);
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return;  // the caller checks cudaGetLastError
  }
  kernel<<<grid, Tr::kThreads, smem, stream>>>(params);
}

}  // namespace v2
}  // namespace cuda
}  // namespace attnkit
