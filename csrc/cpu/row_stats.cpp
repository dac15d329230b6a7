// CPU kernel of attnkit::row_stats: per query row, the attention weight on a given key and the arg-max key
// (schema: csrc/ops.cpp; semantics and the reference: attnkit/words.py, docs/analysis.md "Per-row statistics").
//
// Per sample b with n valid tokens, query head h (KV head g = kv_head[h]) and row s < n, the keys row s sees are
// t < n, and t <= s when causal, and s - t < W with a sliding window W. Over them
//   x_t = scaling · q_s · k_t, softcapped to c · tanh(x_t / c) with softcap c,
//   A[s, t] = exp(x_t) / (Σ_u exp(x_u) + exp(sink[h]))   (the sink term only with a learned sink).
// Outputs (B×H×L each; padding rows s >= n: 0, -1, 0):
//   target_mass[b, h, s] = A[s, target[b, s]] (0 when target[b, s] is -1 or a key the row does not see)
//   argmax_key[b, h, s] = the key t of the largest A[s, t] (lowest t on ties)
//   argmax_weight[b, h, s] = A[s, argmax_key]
// A task is one (sample, query head). Row tiles of kRows queries take one BLAS product with the keys the tile
// sees (causal: only keys up to its last row; fully masked tiles are never computed); softmax, target and arg-max
// are read row by row from that tile. Nothing of size L×L exists beyond one kRows × L tile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../check.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace attnkit::cpu {
namespace {

constexpr int64_t kRows = 64;  // query rows per BLAS tile

std::tuple<at::Tensor, at::Tensor, at::Tensor> row_stats_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                             const at::Tensor& lengths_in,
                                                             const at::Tensor& target_in, double scaling,
                                                             const std::optional<at::Tensor>& kv_head_in,
                                                             bool causal, std::optional<int64_t> sliding_window,
                                                             std::optional<double> softcap,
                                                             const std::optional<at::Tensor>& sink_in) {
  ATTNKIT_CHECK(q_in.dim() == 4 && k_in.dim() == 4, "row_stats: q and k must be 4-D (B, H, L, D), got shapes ",
                q_in.sizes(), " and ", k_in.sizes());
  const int64_t B = q_in.size(0), H = q_in.size(1), L = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1);
  ATTNKIT_CHECK(k_in.size(0) == B && k_in.size(2) == L && k_in.size(3) == D,
                "row_stats: k must be B×Hkv×L×D with q's B, L and D, got q ", q_in.sizes(), " and k ", k_in.sizes());
  const auto dt = q_in.scalar_type();
  ATTNKIT_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                "row_stats: q must be float32, bfloat16 or float16, got ", dt);
  ATTNKIT_CHECK(k_in.scalar_type() == dt, "row_stats: k must have q's dtype ", dt, ", got ", k_in.scalar_type());
  ATTNKIT_CHECK(q_in.device().is_cpu() && k_in.device().is_cpu() && lengths_in.device().is_cpu() &&
                    target_in.device().is_cpu(),
                "row_stats: q, k, lengths and target must be on the CPU for this kernel");
  ATTNKIT_CHECK(lengths_in.scalar_type() == at::kLong && lengths_in.dim() == 1 && lengths_in.size(0) == B,
                "row_stats: lengths must be int64 of shape [B] = [", B, "], got ", lengths_in.scalar_type(),
                " of shape ", lengths_in.sizes());
  ATTNKIT_CHECK(target_in.scalar_type() == at::kLong && target_in.dim() == 2 && target_in.size(0) == B &&
                    target_in.size(1) == L,
                "row_stats: target must be int64 of shape [B, L] = [", B, ", ", L, "], got ",
                target_in.scalar_type(), " of shape ", target_in.sizes());
  std::vector<int64_t> group(H);
  if (kv_head_in.has_value()) {
    const auto& kvh = *kv_head_in;
    ATTNKIT_CHECK(kvh.scalar_type() == at::kInt && kvh.dim() == 1 && kvh.size(0) == H && kvh.device().is_cpu(),
                  "row_stats: kv_head must be int32 of shape [H] = [", H, "] on the CPU, got ", kvh.scalar_type(),
                  " of shape ", kvh.sizes());
    const auto c = kvh.contiguous();
    for (int64_t h = 0; h < H; ++h) {
      group[h] = c.data_ptr<int32_t>()[h];
      ATTNKIT_CHECK(group[h] >= 0 && group[h] < Hkv, "row_stats: kv_head must lie in [0, Hkv) = [0, ", Hkv,
                    "), got kv_head[", h, "] = ", group[h]);
    }
  } else {
    ATTNKIT_CHECK((Hkv > 0 && H % Hkv == 0) || H == 0,
                  "row_stats: without kv_head the KV heads must divide the query heads evenly, got H = ", H,
                  " and Hkv = ", Hkv);
    for (int64_t h = 0; h < H; ++h) group[h] = h / (H / Hkv);
  }
  const int64_t window = sliding_window.has_value() ? *sliding_window : 0;
  ATTNKIT_CHECK(!sliding_window.has_value() || window >= 1, "row_stats: sliding_window must be >= 1, got ", window);
  const double cap = softcap.has_value() ? *softcap : 0.0;
  ATTNKIT_CHECK(!softcap.has_value() || cap > 0, "row_stats: softcap must be > 0, got ", cap);
  at::Tensor sink;
  if (sink_in.has_value()) {
    ATTNKIT_CHECK(sink_in->dim() == 1 && sink_in->size(0) == H && sink_in->device().is_cpu(),
                  "row_stats: sink must be a CPU tensor of shape [H] = [", H, "], got shape ", sink_in->sizes());
    sink = sink_in->to(at::kFloat).contiguous();
  }
  const auto lengths = lengths_in.contiguous();
  const auto target = target_in.contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* tgt = target.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    ATTNKIT_CHECK(len[b] >= 1 && len[b] <= L, "row_stats: lengths must lie in [1, L] = [1, ", L,
                  "], got lengths[", b, "] = ", len[b]);
  }
  for (int64_t i = 0; i < B * L; ++i) {
    ATTNKIT_CHECK(tgt[i] >= -1 && tgt[i] < L, "row_stats: target must lie in [-1, L) = [-1, ", L, "), got ",
                  "target[", i / L, ", ", i % L, "] = ", tgt[i]);
  }

  const auto qf = q_in.to(at::kFloat).contiguous();
  const auto kf = k_in.to(at::kFloat).contiguous();
  auto mass = at::zeros({B, H, L}, q_in.options().dtype(at::kFloat));
  auto key = at::full({B, H, L}, -1, q_in.options().dtype(at::kLong));
  auto weight = at::zeros({B, H, L}, q_in.options().dtype(at::kFloat));
  float* mass_p = mass.data_ptr<float>();
  int64_t* key_p = key.data_ptr<int64_t>();
  float* weight_p = weight.data_ptr<float>();
  const float* sink_p = sink.defined() ? sink.data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(scaling);
  const float fcap = static_cast<float>(cap);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(L);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const int64_t n = len[b];
      const auto queries = qf[b][h];
      const auto keys = kf[b][group[h]];
      for (int64_t s0 = 0; s0 < n; s0 += kRows) {
        const int64_t rows = std::min(kRows, n - s0);
        // the keys this tile sees: [first, last) — causal rows see none after the tile's last row, windowed rows
        // none before its first row's window
        const int64_t last = causal ? std::min(n, s0 + rows) : n;
        const int64_t first = window > 0 ? std::max<int64_t>(0, s0 - window + 1) : 0;
        const int64_t width = last - first;
        const auto S = at::mm(queries.narrow(0, s0, rows), keys.narrow(0, first, width).t()).contiguous();
        const float* sp = S.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t s = s0 + r;
          const int64_t hi = causal ? s + 1 : n;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, s - window + 1) : 0;
          float m = sink_p != nullptr ? sink_p[h] : -std::numeric_limits<float>::infinity();
          int64_t best = -1;
          float best_x = -std::numeric_limits<float>::infinity();
          for (int64_t t = lo; t < hi; ++t) {
            float v = scale * sp[r * width + (t - first)];
            if (fcap > 0) v = fcap * std::tanh(v / fcap);
            x[t] = v;
            if (best < 0 || v > best_x) {
              best = t;
              best_x = v;
            }
          }
          m = std::max(m, best_x);
          double Z = sink_p != nullptr ? std::exp(static_cast<double>(sink_p[h] - m)) : 0.0;
          for (int64_t t = lo; t < hi; ++t) Z += std::exp(static_cast<double>(x[t] - m));
          const int64_t out = task * L + s;
          const int64_t want = tgt[b * L + s];
          if (want >= lo && want < hi) mass_p[out] = static_cast<float>(std::exp(static_cast<double>(x[want] - m)) / Z);
          key_p[out] = best;
          weight_p[out] = best < 0 ? 0.f : static_cast<float>(std::exp(static_cast<double>(best_x - m)) / Z);
        }
      }
    }
  });
  return {mass, key, weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) { m.impl("row_stats", &row_stats_cpu); }

}  // namespace attnkit::cpu
