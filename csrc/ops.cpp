// Operator schemas for the `attnkit` namespace. Kernels live in csrc/cpu and csrc/cuda and register
// themselves with TORCH_LIBRARY_IMPL; fake (meta) kernels and autograd are registered from Python
// (attnkit/ops.py). Keeping the schemas here, in one place, is what makes every backend agree: the kernels of
// fused_attention and fused_attention_lse are boxed and read these arguments by name into one FusedAttentionArgs
// (csrc/attention_args.h), and Python reads them into attnkit.reference.AttentionParams (fields in this order).
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace attnkit::cpu {
std::string cpu_capability();  // csrc/cpu/fused_attention.cpp
}

TORCH_LIBRARY(attnkit, m) {
  // Attention + interventions + per-(sample, head) features in one pass (docs/features.md,
  // docs/interventions.md; the executable definition is attnkit/reference.py).
  //   q, k, v: B×H×L×D (fp32/fp16/bf16, same dtype); lengths: int64[B], 1 <= n <= L;
  //   token_class, sentence_id: int32[B, L] or None; mode, region: int32[H] or None; gates: fp32[H] or None;
  //   key_scale: fp32[B, H, L] or None — the features describe the weights scaled per key and
  //   renormalised per row (norm weighting); the output is unchanged.
  // Decoder arguments (docs/features.md, section 8), appended with defaults so older calls keep working:
  //   k, v may be B×Hkv×L×D; kv_head: int32[H] (the KV head of each query head) or None (Hkv == H, or even
  //   groups h / (H / Hkv)); causal: row s sees keys t <= s; sliding_window: also s − t < W; softcap: scores
  //   c·tanh(score / c); sink: fp32[H], a logit per head in each row's softmax denominator (mass, no value).
  // Cross-attention (attnkit/reference.py, "Cross-attention"), appended likewise: key_lengths int64[B] (given:
  //   q is B×H×Lq×D over another sequence than k and v, B×Hkv×Lk×D, any Lq and Lk; lengths are then the query
  //   lengths, token_class int32[B, Lq] the queries' classes), key_class int32[B, Lk] or None; bias: fp32
  //   [1 or B, H, Lq, Lk], added to the scores (T5's position_bias). The CPU kernel takes key_lengths and key_class
  //   (cpu_cross_attention); no kernel takes bias (attnkit/ops.py runs it on the reference), nor the CUDA kernels
  //   cross-attention.
  // symmetric_window, appended after them (with sliding_window): also t − s < W, the bidirectional window |s − t| < W
  //   of ModernBERT's local layers (CPU kernel only: CUDA refuses it, attnkit/ops.py sends it to the reference
  //   there; refused with key_lengths: a window over another sequence is undefined). fused_attention_lse takes it
  //   after sink (it takes no cross-attention arguments), before want_max_logit.
  // Vision models (docs/features.md, "Image heads"), appended after symmetric_window: grid: int32[B, L, 2], each token's
  //   (row, col) on the image's patch grid, (−1, −1) for a token that is no patch ([CLS], registers); read only with
  //   want_features (the CPU kernel; CUDA calls with it run on the reference, attnkit/ops.py). A grid places the
  //   tokens of one sequence on one image, so it is refused together with key_lengths (cross-attention).
  // alignment, appended after grid (docs/features.md, "Alignment"): with want_features, two more features last,
  //   `align_offset` and `align_near`: how far each row's mass lies from the row's aligned key position (its own
  //   position; cross-attention: i·(nk − 1)/(nq − 1)). The CPU kernel measures them; CUDA refuses them (attnkit/ops.py
  //   runs such calls on the reference).
  // Returns out: B×L×H×D (q's dtype) and features: fp32 B×H×F (F = kNumFeatures(num_windows),
  // csrc/feature_slots.h, plus one — `sink` — when sink is given, then `mean_attention_distance` and the ring masses
  // when grid is given, then `align_offset` and `align_near` with alignment), or B×H×0 when want_features is false.
  m.def(
      "fused_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, Tensor? token_class, "
      "Tensor? sentence_id, float scaling, int num_windows, Tensor? mode, Tensor? region, "
      "bool renormalize, Tensor? gates, bool want_features, Tensor? key_scale=None, Tensor? kv_head=None, "
      "bool causal=False, int? sliding_window=None, float? softcap=None, Tensor? sink=None, "
      "Tensor? key_lengths=None, Tensor? key_class=None, Tensor? bias=None, bool symmetric_window=False, "
      "Tensor? grid=None, bool alignment=False) -> (Tensor, Tensor)");
  // The same op, also returning lse: fp32 B×H×L, per row the natural-log log-sum-exp of the scores it sees
  // (scaling·q·k, soft-capped when asked; the sink logit included), i.e. log of the denominator the output is
  // divided by (with renormalize: over the kept keys and the sink), as ATen's
  // _scaled_dot_product_flash_attention_for_cpu returns it: out = gate · Σ_t exp(score_t − lse) v_t over the kept
  // keys. NaN where the row's softmax is undefined; +inf where every weight is 0 (mode zero, a row that sees no
  // key), so that exp(score − lse) = 0; uniform heads: log of the number of keys kept (scores taken as 0).
  // With want_max_logit, max_logit: fp32 B×H, each head's max logit per sample (docs/features.md §9, as
  // attnkit.reference.max_logits: the largest scaling·q·k over the valid rows s < n and the keys each sees, before any
  // soft-cap; the sink is no key; NaN propagates), measured by the kernel while it runs (no second q·kᵀ pass); else
  // B×0. CPU only (csrc/cpu/fused_attention.cpp); the training path's backward reads lse, attnkit.track and
  // extraction's max logit read max_logit (issue 36). grid and alignment (as fused_attention's) come after
  // want_max_logit, so that callers passing want_max_logit by position keep working.
  m.def(
      "fused_attention_lse(Tensor q, Tensor k, Tensor v, Tensor lengths, Tensor? token_class, "
      "Tensor? sentence_id, float scaling, int num_windows, Tensor? mode, Tensor? region, "
      "bool renormalize, Tensor? gates, bool want_features, Tensor? key_scale=None, Tensor? kv_head=None, "
      "bool causal=False, int? sliding_window=None, float? softcap=None, Tensor? sink=None, "
      "bool symmetric_window=False, bool want_max_logit=False, Tensor? grid=None, bool alignment=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // True: the CPU kernel takes fewer queries than keys (q B×H×Lq×D, k/v B×Hkv×L×D, Lq <= L: a KV-cache step, the
  // queries are the last Lq key positions; attnkit/reference.py, "Fewer queries than keys"). attnkit/ops.py then
  // sends such calls on CPU to fused_attention instead of the reference.
  m.def("cpu_fewer_queries() -> bool", []() { return true; });
  // True: the CPU kernel takes cross-attention (key_lengths, key_class); attnkit/ops.py then sends such calls on CPU
  // to fused_attention instead of the reference.
  m.def("cpu_cross_attention() -> bool", []() { return true; });
  // True: the CPU kernel measures every feature of an image's patch grid (grid: mean_attention_distance and the ring
  // masses, docs/features.md "Image heads"); a build before the rings measured the distance alone, and attnkit/ops.py
  // sends calls with a grid to the reference there.
  m.def("cpu_grid_rings() -> bool", []() { return true; });
  // True: the CPU kernel measures the alignment features (alignment: align_offset, align_near); attnkit/ops.py sends
  // calls with alignment and features to the reference on a build without it.
  m.def("cpu_alignment() -> bool", []() { return true; });
  // True: the CPU kernel adds an additive bias (bias: T5's position_bias) to its scores; attnkit/ops.py sends calls
  // with a bias to the reference on a build without it.
  m.def("cpu_bias() -> bool", []() { return true; });
  // Which build of the CPU kernel runs (csrc/cpu/fused_attention_kernel.h): "default", "avx2" or "avx512".
  m.def("cpu_capability() -> str", &attnkit::cpu::cpu_capability);
  // Clark et al.'s Jensen-Shannon distances between every pair of M heads of one batch:
  //   attn: fp32 B×M×L×L attention rows (padded keys 0); lengths: int64[B].
  // Returns fp64 M×M: Σ_b Σ_{s<n_b} JS(attn[b,i,s,:], attn[b,j,s,:]), natural logs.
  m.def("js_distances(Tensor attn, Tensor lengths) -> Tensor");
  // Clark et al.'s word-level attention (docs/probes.md; csrc/cpu/word_attention.cpp): word_id int32[B, L]
  // (-1: no word). Returns fp32 B×H×W×W word-to-word attention, int64 B×H×L and fp32 B×H×L per-row arg-max.
  m.def("word_attention(Tensor q, Tensor k, Tensor lengths, Tensor word_id, int num_words, float scaling) "
        "-> (Tensor, Tensor, Tensor)");
  // Per-row statistics of attention (docs/analysis.md "Per-row statistics"; csrc/cpu/row_stats.cpp): k, B×Hkv×L×D,
  // with kv_head int32[H], causal, sliding_window, softcap and sink as fused_attention takes them; target
  // int64[B, L] (-1: none). Returns fp32 B×H×L mass on the target key, int64 B×H×L arg-max key (-1: padding row)
  // and fp32 B×H×L its weight.
  m.def("row_stats(Tensor q, Tensor k, Tensor lengths, Tensor target, float scaling, Tensor? kv_head=None, "
        "bool causal=False, int? sliding_window=None, float? softcap=None, Tensor? sink=None) "
        "-> (Tensor, Tensor, Tensor)");
}

// A Python module with no functions: importing attnkit._C loads this library and runs the
// registrations above.
static struct PyModuleDef attnkit_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&attnkit_module); }
