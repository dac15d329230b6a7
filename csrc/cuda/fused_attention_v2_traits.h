// Tile shapes, CuTe layouts and shared-memory map of the single-pass tensor-core kernel "v2"
// (fused_attention_v2_kernel.cuh), per (element type, head dim). Kernel-free, so the host API can size
// shared memory without including the kernel.
//
// Layout of one thread block (kNWarps warps, kBlockM query rows of one (sample, head)):
//   Q tile      kBlockM × D   loaded once with cp.async, then held in registers as MMA A fragments
//   K, V tiles  kBlockN × D   kStages = 2 buffers each, filled with cp.async one tile ahead
//   key meta    per stage: kBlockN token classes, sentence ids and key scales (4 bytes each)
//   row scratch kBlockM × kRowScratch floats: per-row results for the block's feature reduction
//   buckets     kBlockM × (5 + N) × 4 floats: every row's bucket sums (class, self, windows), one copy per
//               thread of the row's quad, so no two threads ever write the same word
// The Q region is reused to stage the output tile for coalesced stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "fused_attention_params.h"

namespace attnkit {
namespace cuda {
namespace v2 {

template <typename T>
struct ElementOf;
template <>
struct ElementOf<__half> {
  using type = cutlass::half_t;
  using MmaOp = cute::SM80_16x8x16_F32F16F16F32_TN;
};
template <>
struct ElementOf<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
  using MmaOp = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};

template <typename T_, int kHeadDim_>
struct Traits {
  using T = T_;
  using Element = typename ElementOf<T>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128, "head dims 32, 64, 128");
  static constexpr int kNWarps = 4;
  static constexpr int kThreads = 32 * kNWarps;
  static constexpr int kBlockM = 16 * kNWarps;  // each warp owns 16 consecutive rows
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 2;
  static_assert(kBlockN % 16 == 0, "key tiles are whole k16 steps of the P·V product");

  // One m16n8k16 tensor-core instruction per atom; warps tile M, so every row lives in one warp.
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<typename ElementOf<T>::MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  // Swizzled smem tiles (bank-conflict-free ldmatrix): 8-row atoms of 32 or 64 columns.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzle, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V read as Vᵀ (D × kBlockN) for the B operand of P·V
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global loads: 16 bytes per thread per copy, kBlockKSmem columns per row group.
  static constexpr int kGmemElemsPerLoad = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static_assert(kThreads % kGmemThreadsPerRow == 0, "whole rows per copy pass");
  using GmemLayoutAtom = cute::Layout<cute::Shape<cute::Int<kThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                                      cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerLoad>>>{}));
  using GmemTiledCopyO = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemLayoutAtom{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerLoad>>>{}));

  // Shared memory map (bytes). Every region starts on a 128-byte boundary.
  static constexpr int align(int x) { return (x + 127) / 128 * 128; }
  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kOffK = align(kQBytes);
  static constexpr int kOffV = kOffK + kStages * kKVTileBytes;
  static constexpr int kOffMeta = kOffV + kStages * kKVTileBytes;
  static constexpr int kMetaStageWords = 3 * kBlockN;  // class, sentence id, key scale
  static constexpr int kRowScratch = 12;                // floats per row (see the kernel's kRow* slots)
  static constexpr int kOffRows = align(kOffMeta + kStages * kMetaStageWords * 4);
  static constexpr int kOffBuckets = align(kOffRows + kBlockM * kRowScratch * 4);
  static constexpr int kQuad = 4;  // threads that share a row in the accumulator layout
  static constexpr int smem_bytes(bool features, int num_windows) {
    return kOffBuckets + (features ? kBlockM * kNumBucketSlots(num_windows) * kQuad * 4 : 0);
  }

  static_assert(cute::size(SmemLayoutQ{}) == kBlockM * kHeadDim, "Q tile layout");
  static_assert(cute::size(SmemLayoutKV{}) == kBlockN * kHeadDim, "K/V tile layout");
  static_assert(cute::size(SmemLayoutVt{}) == kBlockN * kHeadDim, "Vᵀ view covers the V tile");
  static_assert(kQBytes % 128 == 0 && kKVTileBytes % 128 == 0, "tiles keep 128-byte alignment");
  static_assert(kBlockM * kHeadDim % (kThreads * kGmemElemsPerLoad) == 0, "Q copies in whole passes");
  static_assert(kBlockN * kHeadDim % (kThreads * kGmemElemsPerLoad) == 0, "K/V copies in whole passes");
  static_assert(kBlockN <= kThreads, "one thread per key loads the key metadata");
  static_assert(smem_bytes(true, kMaxWindowsV2) <= 227 * 1024, "fits the largest opt-in shared memory");
};

}  // namespace v2
}  // namespace cuda
}  // namespace attnkit
