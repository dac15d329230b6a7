// CPU kernel of attnkit::js_distances: Clark et al.'s Jensen-Shannon distances between heads.
//
// D[i, j] = Σ_b Σ_{s<n_b} JS(attn[b,i,s,:], attn[b,j,s,:]), natural logs, with
// JS(p, q) = ½ Σ_t [p log p + q log q − (p + q) log((p + q)/2)]   (0 log 0 = 0).
// The per-row Σ p log p terms are computed once per head; a pair then costs one vectorised pass with
// one log per key. Tasks are (sample, block of query rows): the block's rows of all M heads stay in
// cache while every head pair (i < j) visits them; each thread sums into its own M×M fp64 buffer,
// reduced at the end. No M²×L×L intermediate exists.
#include "vec_util.h"

#include "../check.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace attnkit::cpu {
namespace {

constexpr float kTiny = std::numeric_limits<float>::min();

// Σ x log x over x[0..n) (0 log 0 = 0), accumulated in fp32 lanes, returned as double.
double sum_xlogx(const float* x, int64_t n) {
  Vec acc(0.f), tiny(kTiny);
  int64_t t = 0;
  for (; t + kW <= n; t += kW) {
    Vec p = Vec::loadu(x + t);
    acc = at::vec::fmadd(p, at::vec::maximum(p, tiny).log(), acc);
  }
  double s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; t < n; ++t) s += x[t] > 0.f ? static_cast<double>(x[t]) * std::log(static_cast<double>(x[t])) : 0.0;
  return s;
}

// Σ (p + q) log((p + q) / 2) over [0..n).
double sum_mix(const float* p, const float* q, int64_t n) {
  Vec acc(0.f), tiny(kTiny), half(0.5f);
  int64_t t = 0;
  for (; t + kW <= n; t += kW) {
    Vec s = Vec::loadu(p + t) + Vec::loadu(q + t);
    acc = at::vec::fmadd(s, at::vec::maximum(s * half, tiny).log(), acc);
  }
  double r = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; t < n; ++t) {
    const double s = static_cast<double>(p[t]) + q[t];
    r += s > 0.0 ? s * std::log(s / 2.0) : 0.0;
  }
  return r;
}

at::Tensor js_distances_cpu(const at::Tensor& attn_in, const at::Tensor& lengths_in) {
  ATTNKIT_CHECK(attn_in.device().is_cpu(), "js_distances: attn must be on the CPU for this kernel");
  ATTNKIT_CHECK(attn_in.scalar_type() == at::kFloat && attn_in.dim() == 4 && attn_in.size(2) == attn_in.size(3),
              "js_distances: attn must be float32 of shape [B, M, L, L], got ", attn_in.scalar_type(), " of shape ",
              attn_in.sizes());
  const int64_t B = attn_in.size(0), M = attn_in.size(1), L = attn_in.size(2);
  ATTNKIT_CHECK(lengths_in.device().is_cpu() && lengths_in.scalar_type() == at::kLong && lengths_in.dim() == 1 &&
                  lengths_in.size(0) == B,
              "js_distances: lengths must be int64 of shape [B] = [", B, "] on the CPU, got ",
              lengths_in.scalar_type(), " of shape ", lengths_in.sizes());
  const auto lengths = lengths_in.contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    ATTNKIT_CHECK(len[b] >= 0 && len[b] <= L, "js_distances: lengths must lie in [0, L] = [0, ", L, "], got lengths[",
                b, "] = ", len[b]);
  const at::Tensor attn = attn_in.contiguous();
  const float* ap = attn.data_ptr<float>();
  at::Tensor out = at::zeros({M, M}, attn_in.options().dtype(at::kDouble));
  if (B == 0 || M == 0 || L == 0) return out;

  // Row blocks: the block's rows of all heads (M × SB × L floats) fit in ~1 MB.
  const int64_t SB = std::max<int64_t>(1, std::min<int64_t>(16, (256 * 1024) / std::max<int64_t>(M * L, 1)));
  const int64_t n_blocks = (L + SB - 1) / SB;
  const int n_threads = at::get_num_threads();
  std::vector<double> acc(static_cast<size_t>(n_threads) * M * M, 0.0);

  at::parallel_for(0, B * n_blocks, 1, [&](int64_t begin, int64_t end) {
    double* my = acc.data() + static_cast<size_t>(at::get_thread_num()) * M * M;
    std::vector<double> hp(M);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / n_blocks, s0 = (task % n_blocks) * SB;
      const int64_t n = len[b], s1 = std::min(s0 + SB, n);
      for (int64_t s = s0; s < s1; ++s) {
        auto row = [&](int64_t i) { return ap + ((b * M + i) * L + s) * L; };
        for (int64_t i = 0; i < M; ++i) hp[i] = sum_xlogx(row(i), L);
        for (int64_t i = 0; i < M; ++i) {
          const float* p = row(i);
          for (int64_t j = i + 1; j < M; ++j) {
            const double js = 0.5 * (hp[i] + hp[j] - sum_mix(p, row(j), L));
            my[i * M + j] += std::max(js, 0.0);
          }
        }
      }
    }
  });

  double* o = out.data_ptr<double>();
  for (int th = 0; th < n_threads; ++th)
    for (int64_t i = 0; i < M * M; ++i) o[i] += acc[static_cast<size_t>(th) * M * M + i];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = i + 1; j < M; ++j) o[j * M + i] = o[i * M + j];
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) { m.impl("js_distances", &js_distances_cpu); }

}  // namespace attnkit::cpu
