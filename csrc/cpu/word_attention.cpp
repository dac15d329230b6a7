// CPU kernel of attnkit::word_attention: Clark et al.'s word-level attention (schema: csrc/ops.cpp,
// semantics and reference: attnkit/words.py).
//
// Per sample b with n valid tokens, head h and query row s < n: A[s, t] = softmax_t<n(scaling · q_s · k_t),
// to[s, w] = Σ_{t < n, word_id[t] = w} A[s, t]. Outputs:
//   words[b, h, i, j] = mean over the pieces p < n of word i of to[p, j]   (0 for a word with no piece)
//   row_word[b, h, s] = the word w ≠ word_id[s] with the largest to[s, w] (lowest w on ties), -1 when none
//   row_weight[b, h, s] = to[s, row_word]                                   (0 when none)
// A task is one (sample, head): it owns its W×W slice of `words`, so rows accumulate without atomics.
// Within it, row tiles of kRows queries take one BLAS product S = Q_tile · K[:n]ᵀ into a tile buffer; the
// softmax and the scatter into words happen row by row. Nothing of size L×L exists beyond one tile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../check.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attnkit::cpu {
namespace {

constexpr int64_t kRows = 64;  // query rows per BLAS tile

std::tuple<at::Tensor, at::Tensor, at::Tensor> word_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                  const at::Tensor& lengths_in,
                                                                  const at::Tensor& word_id_in, int64_t num_words,
                                                                  double scaling) {
  ATTNKIT_CHECK(q_in.dim() == 4, "word_attention: q must be 4-D (B, H, L, D), got shape ", q_in.sizes());
  ATTNKIT_CHECK(k_in.sizes() == q_in.sizes(), "word_attention: k must have q's shape ", q_in.sizes(), ", got ",
              k_in.sizes());
  const auto dt = q_in.scalar_type();
  ATTNKIT_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "word_attention: q must be float32, bfloat16 or float16, got ", dt);
  ATTNKIT_CHECK(k_in.scalar_type() == dt, "word_attention: k must have q's dtype ", dt, ", got ", k_in.scalar_type());
  ATTNKIT_CHECK(q_in.device().is_cpu() && k_in.device().is_cpu() && lengths_in.device().is_cpu() &&
                  word_id_in.device().is_cpu(),
              "word_attention: q, k, lengths and word_id must be on the CPU for this kernel");
  const int64_t B = q_in.size(0), H = q_in.size(1), L = q_in.size(2);
  const int64_t W = num_words;
  ATTNKIT_CHECK(W >= 0, "word_attention: num_words must be >= 0, got ", W);
  ATTNKIT_CHECK(lengths_in.scalar_type() == at::kLong && lengths_in.dim() == 1 && lengths_in.size(0) == B,
              "word_attention: lengths must be int64 of shape [B] = [", B, "], got ", lengths_in.scalar_type(),
              " of shape ", lengths_in.sizes());
  ATTNKIT_CHECK(word_id_in.scalar_type() == at::kInt && word_id_in.dim() == 2 && word_id_in.size(0) == B &&
                  word_id_in.size(1) == L,
              "word_attention: word_id must be int32 of shape [B, L] = [", B, ", ", L, "], got ",
              word_id_in.scalar_type(), " of shape ", word_id_in.sizes());

  const auto lengths = lengths_in.contiguous();
  const auto word_id = word_id_in.contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int32_t* wid = word_id.data_ptr<int32_t>();
  // pieces per word and sample (valid tokens only); also validates the inputs before any work starts
  std::vector<int32_t> count(B * W, 0);
  for (int64_t b = 0; b < B; ++b) {
    ATTNKIT_CHECK(len[b] >= 1 && len[b] <= L, "word_attention: lengths must lie in [1, L] = [1, ", L,
                "], got lengths[", b, "] = ", len[b]);
    for (int64_t t = 0; t < len[b]; ++t) {
      const int32_t w = wid[b * L + t];
      ATTNKIT_CHECK(w >= -1 && w < W, "word_attention: word_id must lie in [-1, num_words) = [-1, ", W, "), got ",
                  "word_id[", b, ", ", t, "] = ", w);
      if (w >= 0) ++count[b * W + w];
    }
  }

  const auto qf = q_in.to(at::kFloat).contiguous();
  const auto kf = k_in.to(at::kFloat).contiguous();
  auto words = at::zeros({B, H, W, W}, q_in.options().dtype(at::kFloat));
  auto row_word = at::full({B, H, L}, -1, q_in.options().dtype(at::kLong));
  auto row_weight = at::zeros({B, H, L}, q_in.options().dtype(at::kFloat));
  float* words_p = words.data_ptr<float>();
  int64_t* rw_p = row_word.data_ptr<int64_t>();
  float* rwt_p = row_weight.data_ptr<float>();
  const float scale = static_cast<float>(scaling);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> to(std::max<int64_t>(W, 1));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const int64_t n = len[b];
      const int32_t* w_b = wid + b * L;
      const int32_t* cnt = count.data() + b * W;
      float* words_bh = words_p + task * W * W;
      const auto keys = kf[b][h].narrow(0, 0, n);
      for (int64_t s0 = 0; s0 < n; s0 += kRows) {
        const int64_t rows = std::min(kRows, n - s0);
        const auto S = at::mm(qf[b][h].narrow(0, s0, rows), keys.t()).contiguous();  // rows × n
        const float* sp = S.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t s = s0 + r;
          const float* x = sp + r * n;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) m = std::max(m, scale * x[t]);
          std::fill(to.begin(), to.end(), 0.f);
          double Z = 0.0;
          for (int64_t t = 0; t < n; ++t) {
            const float e = std::exp(scale * x[t] - m);
            Z += e;
            if (w_b[t] >= 0) to[w_b[t]] += e;
          }
          const float inv = static_cast<float>(1.0 / Z);
          const int32_t own = w_b[s];
          int64_t best = -1;
          float best_v = 0.f;
          for (int64_t w = 0; w < W; ++w) {
            to[w] *= inv;
            if (w != own && cnt[w] > 0 && (best < 0 || to[w] > best_v)) {
              best = w;
              best_v = to[w];
            }
          }
          rw_p[task * L + s] = best;
          rwt_p[task * L + s] = best < 0 ? 0.f : best_v;
          if (own >= 0) {
            float* dst = words_bh + own * W;
            const float f = 1.f / static_cast<float>(cnt[own]);
            for (int64_t w = 0; w < W; ++w) dst[w] += f * to[w];
          }
        }
      }
    }
  });
  return {words, row_word, row_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) { m.impl("word_attention", &word_attention_cpu); }

}  // namespace attnkit::cpu
