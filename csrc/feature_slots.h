// Codes and feature slots shared by every kernel (CPU and CUDA) of attnkit::fused_attention.
//
// The per-head feature vector is defined in docs/features.md: 5 class/self buckets, N distance windows,
// then six per-row features and cls_entropy. attnkit/features.py is the one definition of the names and
// their order; tools/generate_kernels.py writes its codes and slots into csrc/generated/feature_codes.h,
// and the static_asserts below fail the build when this header and that file disagree.
#pragma once

#include "generated/feature_codes.h"

namespace attnkit {

// Token classes, intervention modes and regions (docs/features.md, docs/interventions.md).
constexpr int kClassOther = 0, kClassCls = 1, kClassSep = 2, kClassComma = 3, kClassPeriod = 4;
constexpr int kModeKeep = 0, kModeZero = 1, kModeUniform = 2;
constexpr int kRegionAll = 0, kRegionNoIntra = 1, kRegionNoInter = 2;

// Feature slots. The buckets come first; a key of class c (CLS..PERIOD) goes to slot c - 1.
constexpr int kSlotCls = 0, kSlotSep = 1, kSlotComma = 2, kSlotPeriod = 3, kSlotSelf = 4;
constexpr int kSlotFirstWindow = 5;  // win_0 .. win_{N-1}
constexpr int kNumBucketSlots(int num_windows) { return kSlotFirstWindow + num_windows; }
// Per-row features after the windows, as offsets from kNumBucketSlots(N).
constexpr int kRowPrev = 0, kRowNext = 1, kRowEntropy = 2, kRowMax = 3, kRowIntra = 4, kRowInter = 5;
constexpr int kRowClsEntropy = 6;  // the last feature: divided by the number of CLS rows, not by n
constexpr int kNumRowSlots = 7;
constexpr int kNumFeatures(int num_windows) { return kNumBucketSlots(num_windows) + kNumRowSlots; }

// The bucket of a key of token class c (c != OTHER).
constexpr int class_slot(int c) { return c - kClassCls + kSlotCls; }

namespace generated = feature_codes;
static_assert(kClassOther == generated::OTHER && kClassCls == generated::CLS && kClassSep == generated::SEP &&
                  kClassComma == generated::COMMA && kClassPeriod == generated::PERIOD,
              "token class codes differ from attnkit/features.py");
static_assert(kModeKeep == generated::KEEP && kModeZero == generated::ZERO && kModeUniform == generated::UNIFORM,
              "mode codes differ from attnkit/features.py");
static_assert(kRegionAll == generated::ALL && kRegionNoIntra == generated::NO_INTRA &&
                  kRegionNoInter == generated::NO_INTER,
              "region codes differ from attnkit/features.py");
static_assert(kSlotCls == generated::SLOT_CLS && kSlotSep == generated::SLOT_SEP &&
                  kSlotComma == generated::SLOT_COMMA && kSlotPeriod == generated::SLOT_PERIOD &&
                  kSlotSelf == generated::SLOT_SELF && kSlotFirstWindow == generated::SLOT_WIN_0,
              "bucket slots differ from attnkit/features.py");
static_assert(kRowPrev == generated::ROW_PREV && kRowNext == generated::ROW_NEXT &&
                  kRowEntropy == generated::ROW_ENTROPY && kRowMax == generated::ROW_MAX &&
                  kRowIntra == generated::ROW_INTRA && kRowInter == generated::ROW_INTER &&
                  kRowClsEntropy == generated::ROW_CLS_ENTROPY && kNumRowSlots == generated::NUM_ROW_SLOTS,
              "per-row feature slots differ from attnkit/features.py");
static_assert(class_slot(kClassCls) == kSlotCls && class_slot(kClassPeriod) == kSlotPeriod,
              "class buckets are in class order");

}  // namespace attnkit
