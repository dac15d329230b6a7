// CPU kernel of attnkit::fused_attention (schema and semantics: csrc/ops.cpp, attnkit/reference.py): the host
// half, built once. It checks the arguments, prepares plain arrays for the tasks and runs them with
// at::parallel_for; the tasks' vectorised code (csrc/cpu/fused_attention_rows.h) is built once per instruction
// set and chosen here at run time (csrc/cpu/fused_attention_kernel.h, "CPU capability" in docs/cuda.md).
#include "fused_attention_kernel.h"

#include "../attention_args.h"
#include "../check.h"

#include "../feature_slots.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

extern "C" {
// Fortran BLAS exported by libtorch_cpu (MKL or OpenBLAS builds). Weak: when a torch build does not
// export it, we fall back to at::mm on tile views.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
// MKL's per-thread thread count, its C interface (the lowercase symbol is the Fortran one, taking a pointer);
// exported by MKL builds of libtorch_cpu, absent elsewhere.
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));  // mkl_service.h: mkl_set_num_threads_local
}

namespace attnkit::cpu {
namespace {

constexpr int kOther = kClassOther, kCls = kClassCls, kPeriod = kClassPeriod;
constexpr int kAll = kRegionAll;

// The tasks' products on MKL's sequential path while the guard lives: MKL's threaded driver, called from inside
// at::parallel_for, opens a nested OpenMP region per call, and libgomp mallocs (1,560 bytes) and frees a team for
// each one: 455,000 small allocations in a SmolLM2 forward at 8k, from both threads, whose order varied from run
// to run and with it how the glibc heap around the activations fragmented (peak RSS 1187-1380 MB).
class SequentialBlas {
 public:
  SequentialBlas() : set_(MKL_Set_Num_Threads_Local != nullptr) {
    if (set_) saved_ = MKL_Set_Num_Threads_Local(1);
  }
  ~SequentialBlas() {
    if (set_) MKL_Set_Num_Threads_Local(saved_);  // 0: back to MKL's global setting
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  bool set_;
  int saved_ = 0;
};

// Column-major C(m×n) = alpha · op(A) · op(B) + beta · C, BLAS conventions (beta = 0: C is not read).
void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (sgemm_ != nullptr) {
    int im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
    sgemm_(&ta, &tb, &im, &in, &ik, &alpha, a, &ilda, b, &ildb, &beta, c, &ildc);
    return;
  }
  // Fallback: the same product through ATen (row-major views of the column-major operands).
  auto opt = at::TensorOptions().dtype(at::kFloat);
  // column-major X (r×c, ld) == row-major Xᵀ (c×r, ld)
  auto A = at::from_blob(const_cast<float*>(a), {ta == 'N' ? k : m, ta == 'N' ? m : k}, {lda, 1}, opt);
  auto Bm = at::from_blob(const_cast<float*>(b), {tb == 'N' ? n : k, tb == 'N' ? k : n}, {ldb, 1}, opt);
  auto C = at::from_blob(c, {n, m}, {ldc, 1}, opt);
  // Cᵀ = op(B)ᵀ · op(A)ᵀ ; with row-major views: op(A)ᵀ is A if ta=='N' else Aᵀ
  auto At = ta == 'N' ? A : A.t();
  auto Bt = tb == 'N' ? Bm : Bm.t();
  if (beta == 0.f) {
    at::mm_out(C, Bt, At);
    if (alpha != 1.f) C.mul_(alpha);
  } else {
    C.addmm_(Bt, At, beta, alpha);
  }
}

// --- the CPU capability: which build of the tasks runs ----------------------------------------------------
struct CapabilityBuild {
  const char* name;  // as $ATTNKIT_CPU_CAPABILITY spells it
  FusedTasksFn fn;   // null when this build has no unit for it
  bool (*supported)();
};

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool always() { return true; }

// Best first.
const CapabilityBuild kBuilds[] = {{"avx512", AVX512::fused_attention_tasks, cpu_has_avx512},
                                   {"avx2", AVX2::fused_attention_tasks, cpu_has_avx2},
                                   {"default", DEFAULT::fused_attention_tasks, always}};

// The build torch itself would use (at::get_cpu_capability(): its CPU capability, which honours
// $ATEN_CPU_CAPABILITY), or the best one below it that this extension has.
const CapabilityBuild& torch_choice() {
  static const CapabilityBuild* chosen = [] {
    std::string want = at::get_cpu_capability();
    for (auto& ch : want) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    bool at_or_below = false;
    for (const auto& b : kBuilds) {
      at_or_below = at_or_below || want == b.name;
      if (at_or_below && b.fn != nullptr && b.supported()) return &b;
    }
    for (const auto& b : kBuilds)  // torch names a capability we do not build (e.g. VSX): the best we have
      if (b.fn != nullptr && b.supported()) return &b;
    return &kBuilds[2];
  }();
  return *chosen;
}

// $ATTNKIT_CPU_CAPABILITY (default, avx2 or avx512) forces a build; unset or empty: torch's choice.
const CapabilityBuild& current_build() {
  const char* env = std::getenv("ATTNKIT_CPU_CAPABILITY");
  if (env == nullptr || *env == '\0') return torch_choice();
  std::string want(env);
  for (auto& ch : want) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (const auto& b : kBuilds) {
    if (want != b.name) continue;
    ATTNKIT_CHECK(b.fn != nullptr, "fused_attention: ATTNKIT_CPU_CAPABILITY=", env,
                  " but this build of attnkit has no ", b.name, " kernel");
    ATTNKIT_CHECK(b.supported(), "fused_attention: ATTNKIT_CPU_CAPABILITY=", env, " but this CPU lacks ", b.name);
    return b;
  }
  ATTNKIT_CHECK(false, "fused_attention: ATTNKIT_CPU_CAPABILITY must be default, avx2 or avx512, got ", env);
  return kBuilds[2];
}

// Per-sample facts the feature code needs, computed once per call.
struct SampleInfo {
  int64_t n;
  int64_t n_cls_rows = 0;
  int64_t n_patch_rows = 0;  // the patch rows among the query rows (a grid given)
};

void check_opt(const c10::optional<at::Tensor>& t, const char* name, at::ScalarType dt,
               at::IntArrayRef shape, const char* shape_txt) {
  if (!t.has_value()) return;
  ATTNKIT_CHECK(t->device().is_cpu(), "fused_attention: ", name, " must be on the CPU like q, got ", t->device());
  ATTNKIT_CHECK(t->scalar_type() == dt && t->sizes() == shape, "fused_attention: ", name, " must be ",
              c10::toString(dt), " of shape ", shape_txt, " ", shape, ", got ", t->scalar_type(), " of shape ",
              t->sizes());
}

// Head (b, h)'s max logit by its scores (docs/features.md §9, the definition of attnkit.reference.max_logits): the
// largest q_s · k_t · scaling over the valid query rows s < n and the keys t each sees, before any soft-cap; NaN
// propagates. Builds that head's Lq × n scores: only for the heads the tasks do not measure (a head in mode zero
// or uniform computes no scores) or measured as NaN (a row whose softmax is undefined stops reading its keys).
// nk: the keys (cross-attention's key length; else n).
float head_max_logit(const at::Tensor& q, const at::Tensor& k, int64_t b, int64_t h, int64_t kvh, int64_t n,
                     int64_t nk, int64_t off, double scaling, bool causal, int64_t window, bool symmetric_window) {
  const int64_t Lq = q.size(2);
  const int64_t rows = std::max<int64_t>(0, std::min(n - off, Lq));  // the valid query rows s = off + i < n
  if (rows == 0) return -std::numeric_limits<float>::infinity();
  auto s = at::matmul(q[b][h].narrow(0, 0, rows), k[b][kvh].narrow(0, 0, nk).t()) * scaling;  // rows × nk
  auto pos_s = at::arange(off, off + rows, q.options().dtype(at::kLong)).unsqueeze(1);
  auto pos_t = at::arange(0, nk, q.options().dtype(at::kLong)).unsqueeze(0);
  auto hidden = at::zeros({rows, nk}, q.options().dtype(at::kBool));
  if (causal) hidden = hidden.logical_or(pos_t > pos_s);
  if (window > 0) hidden = hidden.logical_or(pos_s - pos_t >= window);
  if (window > 0 && symmetric_window) hidden = hidden.logical_or(pos_t - pos_s >= window);
  return s.masked_fill(hidden, -std::numeric_limits<float>::infinity()).amax().item<float>();
}

// The op's CPU kernel; want_lse: also the per-row log-sum-exp (attnkit::fused_attention_lse); want_max_logit:
// also each head's max logit per sample (B×H, docs/features.md §9), else B×0.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_attention_impl(const FusedAttentionArgs& a,
                                                                                bool want_lse) {
  ATTNKIT_CHECK(a.q.dim() == 4, "fused_attention: q must be 4-D (B, H, L, D), got shape ", a.q.sizes());
  // Lq query rows, L keys: Lq < L is a KV-cache step (the queries are the last Lq key positions: row i is key
  // position s = L − Lq + i; docs of attnkit/reference.py, "Fewer queries than keys")
  // Cross-attention (key_lengths given): the queries are another sequence, row i at position i (off = 0), lengths
  // the query lengths, key_lengths the keys'; token_class the queries' classes, key_class the keys'.
  const bool cross = a.key_lengths.has_value();
  const int64_t B = a.q.size(0), H = a.q.size(1), Lq = a.q.size(2), D = a.q.size(3);
  ATTNKIT_CHECK(a.k.dim() == 4 && a.k.sizes() == a.v.sizes() && a.k.size(0) == B && (cross || a.k.size(2) >= Lq) &&
                    a.k.size(2) >= 1 && a.k.size(3) == D && a.k.size(1) >= 1,
                "fused_attention: k and v must have q's shape ", a.q.sizes(),
                " (or B×Hkv×L×D with Hkv KV heads and L >= q's length; any L with key_lengths), got k ", a.k.sizes(),
                " and v ", a.v.sizes());
  const int64_t L = a.k.size(2), off = cross ? 0 : L - Lq;
  ATTNKIT_CHECK(!a.bias.has_value() || (a.bias->scalar_type() == at::kFloat && a.bias->dim() == 4 &&
                                         (a.bias->size(0) == 1 || a.bias->size(0) == B) && a.bias->size(1) == H &&
                                         a.bias->size(2) == Lq && a.bias->size(3) == L && a.bias->device().is_cpu()),
                "fused_attention: bias must be a float32 CPU tensor of shape [1 or ", B, ", ", H, ", ", Lq, ", ", L,
                "], got ", a.bias.has_value() ? a.bias->sizes() : at::IntArrayRef{});
  ATTNKIT_CHECK(cross || !a.key_class.has_value(),
                "fused_attention: key_class is the keys' token classes of cross-attention: give key_lengths too");
  ATTNKIT_CHECK(!cross || !a.symmetric_window, "fused_attention: cross-attention (key_lengths given) takes no "
                "symmetric_window: a window over another sequence's keys is undefined");
  ATTNKIT_CHECK(!cross || (!a.sentence_id.has_value() && !a.region.has_value() && !a.causal &&
                           !a.sliding_window.has_value()),
                "fused_attention: cross-attention (key_lengths given) takes no sentence_id, region, causal or "
                "sliding_window");
  // a grid places the tokens of one sequence on one image's patches; cross-attention's queries and keys are two
  // sequences, so the two are not taken together (docs/features.md, "Image heads")
  ATTNKIT_CHECK(!cross || !a.grid.has_value(),
                "fused_attention: grid is not taken with key_lengths (cross-attention): a grid places the tokens of "
                "one sequence on an image");
  const int64_t Hkv = a.k.size(1);
  const auto dt = a.q.scalar_type();
  ATTNKIT_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "fused_attention: q must be float32, bfloat16 or float16, got ", dt);
  ATTNKIT_CHECK(a.k.scalar_type() == dt && a.v.scalar_type() == dt, "fused_attention: k and v must have q's dtype ",
              dt, ", got k ", a.k.scalar_type(), " and v ", a.v.scalar_type());
  ATTNKIT_CHECK(a.q.device().is_cpu() && a.k.device().is_cpu() && a.v.device().is_cpu(),
              "fused_attention: q, k and v must be on the CPU for this kernel");
  ATTNKIT_CHECK(a.num_windows >= 1, "fused_attention: num_windows must be >= 1, got ", a.num_windows);
  ATTNKIT_CHECK(D >= 1, "fused_attention: head dim (q.size(3)) must be >= 1, got ", D);
  ATTNKIT_CHECK(std::isfinite(a.scaling), "fused_attention: scaling must be a finite number, got ", a.scaling);
  ATTNKIT_CHECK(a.lengths.device().is_cpu(), "fused_attention: lengths must be on the CPU like q");
  ATTNKIT_CHECK(a.lengths.scalar_type() == at::kLong && a.lengths.dim() == 1 && a.lengths.size(0) == B,
              "fused_attention: lengths must be int64 of shape [B] = [", B, "], got ", a.lengths.scalar_type(),
              " of shape ", a.lengths.sizes());
  check_opt(a.token_class, "token_class", at::kInt, {B, cross ? Lq : L}, cross ? "[B, Lq]" : "[B, L]");
  check_opt(a.key_class, "key_class", at::kInt, {B, L}, "[B, Lk]");
  check_opt(a.key_lengths, "key_lengths", at::kLong, {B}, "[B]");
  check_opt(a.sentence_id, "sentence_id", at::kInt, {B, L}, "[B, L]");
  check_opt(a.mode, "mode", at::kInt, {H}, "[H]");
  check_opt(a.region, "region", at::kInt, {H}, "[H]");
  check_opt(a.gates, "gates", at::kFloat, {H}, "[H]");
  check_opt(a.key_scale, "key_scale", at::kFloat, {B, H, L}, "[B, H, L]");
  check_opt(a.kv_head, "kv_head", at::kInt, {H}, "[H]");
  check_opt(a.sink, "sink", at::kFloat, {H}, "[H]");
  check_opt(a.grid, "grid", at::kInt, {B, L, 2}, "[B, L, 2]");
  ATTNKIT_CHECK(!a.sliding_window.has_value() || *a.sliding_window >= 1,
                "fused_attention: sliding_window must be an integer >= 1, got ", a.sliding_window.value_or(0));
  ATTNKIT_CHECK(!a.symmetric_window || a.sliding_window.has_value(),
                "fused_attention: symmetric_window needs a sliding_window");
  ATTNKIT_CHECK(!a.softcap.has_value() || (std::isfinite(*a.softcap) && *a.softcap > 0),
                "fused_attention: softcap must be a finite number > 0, got ", a.softcap.value_or(0.0));

  const auto lengths = a.lengths.contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    ATTNKIT_CHECK(len[b] >= 1 && len[b] <= (cross ? Lq : L), "fused_attention: lengths must lie in [1, ",
                  cross ? "Lq" : "L", "] = [1, ", cross ? Lq : L, "], got lengths[", b, "] = ", len[b]);
  // the keys each sample has: its length, or cross-attention's key lengths
  std::vector<int64_t> klen(len, len + B);
  if (cross) {
    const auto kl = a.key_lengths->contiguous();
    for (int64_t b = 0; b < B; ++b) {
      klen[b] = kl.data_ptr<int64_t>()[b];
      ATTNKIT_CHECK(klen[b] >= 1 && klen[b] <= L, "fused_attention: key_lengths must lie in [1, Lk] = [1, ", L,
                    "], got key_lengths[", b, "] = ", klen[b]);
    }
  }
  std::vector<int32_t> mode(H, kModeKeep), region(H, kAll), kv_head(H);
  std::vector<float> gate(H, 1.f), sink;
  if (a.mode) {
    auto t = a.mode->contiguous();
    for (int64_t h = 0; h < H; ++h) {
      mode[h] = t.data_ptr<int32_t>()[h];
      ATTNKIT_CHECK(mode[h] >= 0 && mode[h] <= 2, "fused_attention: mode codes must be 0, 1 or 2, got ", mode[h]);
    }
  }
  if (a.region) {
    auto t = a.region->contiguous();
    for (int64_t h = 0; h < H; ++h) {
      region[h] = t.data_ptr<int32_t>()[h];
      ATTNKIT_CHECK(region[h] >= 0 && region[h] <= 2, "fused_attention: region codes must be 0, 1 or 2, got ",
                  region[h]);
    }
  }
  if (a.gates) {
    auto t = a.gates->contiguous();
    for (int64_t h = 0; h < H; ++h) gate[h] = t.data_ptr<float>()[h];
  }
  if (a.kv_head) {
    auto t = a.kv_head->contiguous();
    for (int64_t h = 0; h < H; ++h) {
      kv_head[h] = t.data_ptr<int32_t>()[h];
      ATTNKIT_CHECK(kv_head[h] >= 0 && kv_head[h] < Hkv, "fused_attention: kv_head must lie in [0, Hkv) = [0, ",
                    Hkv, "), got ", kv_head[h], " at head ", h);
    }
  } else {
    ATTNKIT_CHECK(Hkv <= H && H % Hkv == 0, "fused_attention: k and v have ", Hkv, " heads and q ", H,
                  ": give kv_head (the KV head of each query head) unless ", Hkv, " divides ", H);
    for (int64_t h = 0; h < H; ++h) kv_head[h] = static_cast<int32_t>(h / (H / Hkv));
  }
  if (a.sink) {
    auto t = a.sink->contiguous();
    sink.assign(t.data_ptr<float>(), t.data_ptr<float>() + H);
  }
  const int64_t N = a.num_windows;
  const int64_t F0 = kNumFeatures(int(N));
  const bool want_grid = a.want_features && a.grid.has_value();
  const bool want_align = a.want_features && a.alignment;
  // with a sink the feature `sink` comes after them, with a grid `mean_attention_distance` and the ring masses, then
  // with alignment `align_offset` and `align_near` last
  const int64_t F = F0 + (a.sink ? 1 : 0) + (want_grid ? 1 + kRingSlots : 0) + (want_align ? 2 : 0);
  at::Tensor key_scale;
  if (a.want_features && a.key_scale) key_scale = a.key_scale->contiguous();
  at::Tensor tc, sid, qc;  // tc: the keys' token classes; qc: cross-attention's queries' (the CLS rows)
  const std::optional<at::Tensor>& key_classes = cross ? a.key_class : a.token_class;
  if (key_classes.has_value()) tc = key_classes->contiguous();
  if (cross && a.token_class) qc = a.token_class->contiguous();
  if (a.sentence_id) sid = a.sentence_id->contiguous();

  const bool need_sid =
      !cross && (a.want_features || std::any_of(region.begin(), region.end(), [](int r) { return r != kAll; }));

  // Sentence ids as dense per-sample ranks (0, 1, ... by value; zeros when none), as floats for the
  // vectorised comparisons: exact for any int32 id (a float holds every integer below 2^24).
  std::vector<float> sidf(need_sid ? B * L : 0, 0.f);
  std::vector<uint8_t> one_sentence(B, 1), sid_runs(B, 0);
  // sid_runs[b]: sample b's sentences are contiguous runs of keys (as tokenised texts have them); key t's run is
  // [sent_lo[b·L + t], sent_hi[b·L + t]) (keys < n)
  std::vector<int32_t> sent_lo(a.want_features && sid.defined() ? B * L : 0), sent_hi(sent_lo.size());
  std::vector<SampleInfo> info(B);
  std::vector<int64_t> nlen(B), special_at(B + 1, 0);
  std::vector<int32_t> special_pos;
  std::vector<float> special_cls;  // (floats: the tasks compare them in vectors)
  // 1 where a key's token class is OTHER (for the tasks' vectorised sums; keys < n only)
  const bool want_classes = a.want_features && tc.defined();
  std::vector<float> other_mask(want_classes ? B * L : 0, 0.f);
  // distance windows: win_of[b·WL + d] = min(N − 1, ⌊d·N/n⌋) (n: the sample's keys), window j holds d in
  // [win_lo[j], win_lo[j + 1]) = [⌈j·n/N⌉, ...); the last window holds every distance from its start on (a
  // cross-attention row i may lie past the keys: distances up to WL − 1 = max(L, Lq) − 1)
  const int64_t WL = std::max(L, Lq);
  std::vector<int32_t> win_of(a.want_features ? B * WL : 0);
  std::vector<int64_t> win_lo(a.want_features ? B * (N + 1) : 0);
  // an image's patch grid as floats for the tasks' vectorised distances (grid_row, grid_col, grid_mask)
  std::vector<float> grid_row(want_grid ? B * L : 0, 0.f), grid_col(grid_row.size(), 0.f),
      grid_mask(grid_row.size(), 0.f);
  at::Tensor grid;
  if (want_grid) grid = a.grid->contiguous();
  for (int64_t b = 0; b < B; ++b) {
    auto& si = info[b];
    si.n = nlen[b] = len[b];
    const int64_t n_keys = klen[b];
    if (need_sid && sid.defined()) {
      const int32_t* sp = sid.data_ptr<int32_t>() + b * L;
      std::vector<int32_t> ids(sp, sp + L);
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      one_sentence[b] = ids.size() <= 1;
      for (int64_t t = 0; t < L; ++t)
        sidf[b * L + t] = static_cast<float>(std::lower_bound(ids.begin(), ids.end(), sp[t]) - ids.begin());
      if (a.want_features && !one_sentence[b]) {
        const float* r = sidf.data() + b * L;
        std::vector<uint8_t> seen(ids.size(), 0);
        bool runs = true;
        for (int64_t t = 0, u; t < si.n && runs; t = u) {
          for (u = t; u < si.n && r[u] == r[t]; ++u) {}
          runs = !seen[static_cast<size_t>(r[t])];
          seen[static_cast<size_t>(r[t])] = 1;
          std::fill(sent_lo.begin() + b * L + t, sent_lo.begin() + b * L + u, static_cast<int32_t>(t));
          std::fill(sent_hi.begin() + b * L + t, sent_hi.begin() + b * L + u, static_cast<int32_t>(u));
        }
        sid_runs[b] = runs;
      }
    }
    if (want_classes) {
      const int32_t* cp = tc.data_ptr<int32_t>() + b * L;
      for (int64_t t = 0; t < n_keys; ++t) {
        ATTNKIT_CHECK(cp[t] >= kOther && cp[t] <= kPeriod, "fused_attention: ", cross ? "key_class" : "token_class",
                      " codes must be 0..4, got ", cp[t], " at [", b, ", ", t, "]");
        other_mask[b * L + t] = cp[t] == kOther ? 1.f : 0.f;
        if (cp[t] != kOther) {
          special_pos.push_back(static_cast<int32_t>(t));
          special_cls.push_back(static_cast<float>(cp[t]));
        }
        if (!cross && cp[t] == kCls && t >= off) si.n_cls_rows++;  // the CLS rows among the query rows
      }
    }
    if (qc.defined() && a.want_features) {  // cross-attention: the CLS rows among the valid query rows
      const int32_t* cp = qc.data_ptr<int32_t>() + b * Lq;
      for (int64_t i = 0; i < si.n; ++i) {
        ATTNKIT_CHECK(cp[i] >= kOther && cp[i] <= kPeriod, "fused_attention: token_class codes must be 0..4, got ",
                      cp[i], " at [", b, ", ", i, "]");
        if (cp[i] == kCls) si.n_cls_rows++;
      }
    }
    special_at[b + 1] = static_cast<int64_t>(special_pos.size());
    if (want_grid) {
      const int32_t* gp = grid.data_ptr<int32_t>() + b * L * 2;
      for (int64_t t = 0; t < si.n; ++t) {
        const int32_t r = gp[2 * t], c = gp[2 * t + 1];
        ATTNKIT_CHECK((r == -1 && c == -1) || (r >= 0 && c >= 0), "fused_attention: grid positions must be "
                      "(row, col) >= 0 for a patch or (-1, -1) for another token, got (", r, ", ", c, ") at [", b,
                      ", ", t, "]");
        if (r < 0) continue;
        grid_row[b * L + t] = static_cast<float>(r), grid_col[b * L + t] = static_cast<float>(c);
        grid_mask[b * L + t] = 1.f;
        if (t >= off) si.n_patch_rows++;
      }
    }
    if (a.want_features) {
      const int64_t n = n_keys;
      for (int64_t d = 0; d < (cross ? WL : n); ++d)
        win_of[b * WL + d] = static_cast<int32_t>(std::min<int64_t>(N - 1, (d * N) / n));
      for (int64_t j = 0; j <= N; ++j) win_lo[b * (N + 1) + j] = (j * n + N - 1) / N;
      if (cross) win_lo[b * (N + 1) + N] = WL;
    }
  }
  if (special_pos.empty()) special_pos.push_back(0), special_cls.push_back(0.f);  // valid pointers

  // fp32 operands; BLAS needs unit stride along D (transformers' transposed views have it).
  auto prep = [](const at::Tensor& t) {
    at::Tensor f = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
    if (f.stride(3) != 1 || f.stride(2) < f.size(3)) f = f.contiguous();
    return f;
  };
  const at::Tensor q = prep(a.q), k = prep(a.k), v = prep(a.v);
  // norm weighting: ln g once per key (0 where g = 0: its weight is 0 anyway)
  at::Tensor log_key_scale;
  if (key_scale.defined()) log_key_scale = at::where(key_scale > 0, key_scale.log(), at::zeros_like(key_scale));

  const bool out_f32 = dt == at::kFloat;
  at::Tensor out = at::empty({B, Lq, H, D}, a.q.options().dtype(dt));
  at::Tensor out32 = out_f32 ? out : at::empty({B, Lq, H, D}, a.q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({B, H, want_lse ? Lq : 0}, a.q.options().dtype(at::kFloat));

  // Blocks (as ATen's CPU flash attention): BQ query rows × BK keys, the score tile in L2 whatever L is.
  // $ATTNKIT_CPU_BLOCKS="BQxBK" overrides them (tests use small blocks to reach every path at small L).
  // full rows: 256 as ATen (more reuse of each K/V block); causal / windowed rows: 128 (less waste at the diagonal)
  // up to 4k keys, 256 from there (each K/V block is packed by BLAS once per block of rows: at 8k, packing twice as
  // often cost more than the diagonal's waste; bench/cpu_capability.py --only lengths, docs/cuda.md)
  const bool narrow = (a.causal || a.sliding_window.has_value()) && L < 4096;
  int64_t BQ = L < 768 ? 64 : narrow ? 128 : 256, BK = 512;
  if (const char* env = std::getenv("ATTNKIT_CPU_BLOCKS"); env != nullptr && *env != '\0') {
    long bq = 0, bk = 0;
    ATTNKIT_CHECK(std::sscanf(env, "%ldx%ld", &bq, &bk) == 2 && bq >= 1 && bk >= 1,
                  "fused_attention: ATTNKIT_CPU_BLOCKS must be BQxBK (two integers >= 1), got ", env);
    BQ = bq, BK = bk;
  }
  BQ = std::max<int64_t>(1, std::min(BQ, Lq));
  BK = std::max<int64_t>(1, std::min(BK, L));
  int64_t small_products = kSmallProducts;
  if (const char* env = std::getenv("ATTNKIT_CPU_SMALL_PRODUCTS"); env != nullptr && *env != '\0') {
    long n = -1;
    ATTNKIT_CHECK(std::sscanf(env, "%ld", &n) == 1 && n >= 0,
                  "fused_attention: ATTNKIT_CPU_SMALL_PRODUCTS must be an integer >= 0, got ", env);
    small_products = n;
  }

  // Query heads per task: the heads that share a KV head (grouped-query attention), while their stacked rows stay
  // within kGroupedRows, so that each K and V block is read (and packed by BLAS) once for them all; one product of
  // GH · BQ rows is faster than GH of BQ, and gives the same bits where fused_attention_rows.h stacks them.
  // $ATTNKIT_CPU_GROUP_HEADS caps them (1: one head per task).
  int64_t GH = Hkv < H && H % Hkv == 0 ? H / Hkv : 1;
  GH = std::min({GH, kMaxGroupedHeads, std::max<int64_t>(1, kGroupedRows / BQ)});
  if (const char* env = std::getenv("ATTNKIT_CPU_GROUP_HEADS"); env != nullptr && *env != '\0') {
    long cap = 0;
    ATTNKIT_CHECK(std::sscanf(env, "%ld", &cap) == 1 && cap >= 1,
                  "fused_attention: ATTNKIT_CPU_GROUP_HEADS must be an integer >= 1, got ", env);
    GH = std::min<int64_t>({H / Hkv, kMaxGroupedHeads, cap});
  }
  while (GH > 1 && H % GH != 0) --GH;
  for (int64_t h = 0; GH > 1 && h < H; ++h)  // every task's heads must read one KV head
    if (kv_head[h] != kv_head[h - h % GH]) GH = 1;

  FusedCpuParams p{};
  p.B = B, p.H = H, p.L = L, p.D = D, p.N = N, p.BQ = BQ, p.BK = BK, p.n_qblk = (Lq + BQ - 1) / BQ, p.GH = GH;
  p.Lq = Lq, p.off = off, p.WL = WL;
  p.q = q.data_ptr<float>(), p.k = k.data_ptr<float>(), p.v = v.data_ptr<float>();
  p.qs0 = q.stride(0), p.qs1 = q.stride(1), p.qs2 = q.stride(2);
  p.ks0 = k.stride(0), p.ks1 = k.stride(1), p.ks2 = k.stride(2);
  p.vs0 = v.stride(0), p.vs1 = v.stride(1), p.vs2 = v.stride(2);
  p.out = out32.data_ptr<float>();
  p.lse = want_lse ? lse.data_ptr<float>() : nullptr;
  p.mode = mode.data(), p.region = region.data(), p.kv_head = kv_head.data(), p.gate = gate.data();
  p.sink = sink.empty() ? nullptr : sink.data();
  p.n = nlen.data(), p.special_at = special_at.data();
  p.nk = cross ? klen.data() : nullptr;
  p.special_pos = special_pos.data(), p.special_cls = special_cls.data();
  p.sidf = need_sid ? sidf.data() : nullptr;
  p.one_sentence = one_sentence.data();
  p.sid_runs = sid_runs.data();
  p.sent_lo = sent_lo.empty() ? nullptr : sent_lo.data(), p.sent_hi = sent_hi.empty() ? nullptr : sent_hi.data();
  p.token_class = want_classes ? tc.data_ptr<int32_t>() : nullptr;
  p.cross = cross;
  p.query_class = qc.defined() && a.want_features ? qc.data_ptr<int32_t>() : nullptr;
  p.other_mask = p.token_class != nullptr ? other_mask.data() : nullptr;
  p.win_of = a.want_features ? win_of.data() : nullptr;
  p.win_lo = a.want_features ? win_lo.data() : nullptr;
  p.grid_row = want_grid ? grid_row.data() : nullptr;
  p.grid_col = want_grid ? grid_col.data() : nullptr;
  p.grid_mask = want_grid ? grid_mask.data() : nullptr;
  p.align = want_align;
  const at::Tensor bias = a.bias.has_value() ? a.bias->contiguous() : at::Tensor();
  p.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  p.bias_bs = bias.defined() && bias.size(0) == B && B > 1 ? H * Lq * L : 0;
  p.key_scale = key_scale.defined() ? key_scale.data_ptr<float>() : nullptr;
  p.log_key_scale = key_scale.defined() ? log_key_scale.data_ptr<float>() : nullptr;
  p.scaling = a.scaling, p.renormalize = a.renormalize, p.want_features = a.want_features, p.causal = a.causal;
  p.window = a.sliding_window.value_or(0);
  p.symmetric_window = a.symmetric_window;
  p.softcap = a.softcap.has_value() ? static_cast<float>(*a.softcap) : 0.f;
  p.FA = kPartialSlots(F0);
  p.gemm = gemm;
  p.small_products = BQ * BK * D < small_products;
  const int64_t n_tasks = B * H * p.n_qblk;  // (sample, head, query block)s: the tasks' units
  std::vector<double> partial(a.want_features ? n_tasks * p.FA : 0, 0.0);
  p.partial = a.want_features ? partial.data() : nullptr;
  std::vector<float> task_max(a.want_max_logit ? n_tasks : 0, -std::numeric_limits<float>::infinity());
  p.max_logit = a.want_max_logit ? task_max.data() : nullptr;
  const FusedTasksFn tasks = current_build().fn;
  // per-thread scratch, fixed in size: one allocation per thread and call, each part on its own cache line (the
  // vector loads and stores of a row, and BLAS's writes of S and acc, then never straddle two lines)
  const int64_t RS = kRowStateSlots(N);
  constexpr int64_t kLine = 64 / sizeof(float);
  auto line_up = [](int64_t count) { return (count + kLine - 1) / kLine * kLine; };
  // the stacked query rows of a task's heads for their one BLAS product (fused_attention_rows.h): not with the products
  // in place, nor for a head size that is not a multiple of 4, whose rows MKL reads at another stride and sums another
  // way than one head's (measured on MKL's Zen kernels)
  const bool stack_queries = GH > 1 && !p.small_products && D % 4 == 0;
  const int64_t parts[] = {GH * BQ * BK, GH * BQ * D, BK,          GH * BQ * RS, GH * (BQ + BK),
                           p.small_products ? BK * D : 0, stack_queries ? GH * BQ * D : 0};
  int64_t scratch = 0;
  for (const int64_t part : parts) scratch += line_up(part);

  at::parallel_for(0, n_tasks / GH, 1, [&](int64_t begin, int64_t end) {
    const SequentialBlas sequential;
    std::vector<float> buf(static_cast<size_t>(scratch + kLine), 0.f);
    const auto address = reinterpret_cast<std::uintptr_t>(buf.data());
    float* next = buf.data() + (line_up(int64_t(address / sizeof(float))) - int64_t(address / sizeof(float)));
    float* part_at[7];
    for (int i = 0; i < 7; ++i) part_at[i] = next, next += line_up(parts[i]);
    float *S = part_at[0], *acc = part_at[1], *pc = part_at[2], *state = part_at[3], *diag = part_at[4];
    float* kt = p.small_products ? part_at[5] : nullptr;
    float* qc = stack_queries ? part_at[6] : nullptr;
    tasks(p, begin, end, FusedCpuScratch{S, acc, pc, state, diag, kt, qc});
  });

  if (!out_f32) out.copy_(out32);
  at::Tensor feats = at::zeros({B, H, a.want_features ? F : 0}, a.q.options().dtype(at::kFloat));
  if (a.want_features) {  // per-task sums reduced in task order: the same bits whatever the threads
    float* fp = feats.data_ptr<float>();
    const int64_t FA = p.FA, n_qblk = p.n_qblk;
    for (int64_t b = 0; b < B; ++b) {
      // the mean over the valid query rows s in [off, n) (all n rows when Lq == L); none: features 0
      const double inv_n = 1.0 / static_cast<double>(std::max<int64_t>(1, std::min(info[b].n - off, Lq)));
      const double inv_cls = 1.0 / static_cast<double>(std::max<int64_t>(info[b].n_cls_rows, 1));
      const double inv_patch = 1.0 / static_cast<double>(std::max<int64_t>(info[b].n_patch_rows, 1));
      for (int64_t h = 0; h < H; ++h) {
        float* dst = fp + (b * H + h) * F;
        const double* part = partial.data() + (b * H + h) * n_qblk * FA;
        auto total = [&](int64_t slot) {
          double s = 0.0;
          for (int64_t t = 0; t < n_qblk; ++t) s += part[t * FA + slot];
          return s;
        };
        for (int64_t f = 0; f < F0 - 1; ++f) dst[f] = static_cast<float>(total(f) * inv_n);
        dst[F0 - 1] = static_cast<float>(total(F0) * inv_cls);
        if (a.sink) dst[F0] = static_cast<float>(total(F0 + 1) * inv_n);
        if (want_grid) {
          const int64_t g = F0 + (a.sink ? 1 : 0);  // mean_attention_distance, then ring_0 … ring_8
          for (int64_t j = 0; j <= kRingSlots; ++j) dst[g + j] = static_cast<float>(total(F0 + 2 + j) * inv_patch);
        }
        if (want_align)  // the offset and the near mass, means over the valid rows as the per-row features
          for (int64_t j = 0; j < 2; ++j) dst[F - 2 + j] = static_cast<float>(total(kAlignSlot(F0) + j) * inv_n);
      }
    }
  }
  at::Tensor max_logit = at::empty({B, a.want_max_logit ? H : 0}, a.q.options().dtype(at::kFloat));
  if (a.want_max_logit) {  // the maximum over each (sample, head)'s query blocks, NaN propagating
    float* mp = max_logit.data_ptr<float>();
    for (int64_t bh = 0; bh < B * H; ++bh) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < p.n_qblk; ++t) {
        const float x = task_max[bh * p.n_qblk + t];
        m = (std::isnan(m) || std::isnan(x)) ? std::numeric_limits<float>::quiet_NaN() : std::max(m, x);
      }
      const int64_t b = bh / H, h = bh % H;
      if (std::isnan(m) || mode[h] != kModeKeep)  // not measured by the tasks: from the head's scores
        m = head_max_logit(q, k, b, h, kv_head[h], nlen[b], klen[b], off, a.scaling, a.causal,
                           a.sliding_window.value_or(0), a.symmetric_window);
      mp[bh] = m;
    }
  }
  return {out, feats, lse, max_logit};
}

// The op's kernels, boxed: their arguments come off the dispatcher's stack into one FusedAttentionArgs
// (csrc/attention_args.h), and their outputs go back on it.
void fused_attention_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto [out, feats, lse, max_logit] = fused_attention_impl(pop_fused_attention_args(op, stack), false);
  torch::jit::push(*stack, std::move(out), std::move(feats));
}

void fused_attention_lse_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto [out, feats, lse, max_logit] = fused_attention_impl(pop_fused_attention_args(op, stack), true);
  torch::jit::push(*stack, std::move(out), std::move(feats), std::move(lse), std::move(max_logit));
}

}  // namespace

// The capability torch reports and the one the kernel uses now (attnkit::cpu_capability, csrc/ops.cpp).
std::string cpu_capability() { return current_build().name; }

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("fused_attention", torch::CppFunction::makeFromBoxedFunction<&fused_attention_cpu>());
  m.impl("fused_attention_lse", torch::CppFunction::makeFromBoxedFunction<&fused_attention_lse_cpu>());
}

}  // namespace attnkit::cpu
