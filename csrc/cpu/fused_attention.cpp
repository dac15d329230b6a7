// CPU kernel of attnkit::fused_attention (schema and semantics: csrc/ops.cpp, attnkit/reference.py).
//
// Work is split into tasks (sample b, head h, tile of TQ query rows), run with at::parallel_for.
// A task computes S = Q_tile · K[:n]ᵀ (n = the sample's valid keys) into a per-thread TQ×n buffer
// with BLAS, then, row by row and in one vectorised pass, the softmax numerators e = exp(s − max),
// the intervention (uniform mode replaces e by 1, the region zeroes the dropped keys) and the sums
// the features need. Every feature is linear in the row's weights except the entropy, which follows
// in closed form from the same sums, so the row is never normalised: the row's factor c
// (1/Z, or 1/Σkept with renormalize) multiplies the features and, after the second BLAS product
// O_tile = E · V[:n], the output rows (together with the head's gate). Nothing of size L×L exists
// beyond the per-thread tile.
#include "vec_util.h"

#include "../check.h"

#include "../feature_slots.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

extern "C" {
// Fortran BLAS exported by libtorch_cpu (MKL or OpenBLAS builds). Weak: when a torch build does not
// export it, we fall back to at::mm on tile views.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
}

namespace attnkit::cpu {
namespace {

constexpr int kOther = kClassOther, kCls = kClassCls, kPeriod = kClassPeriod;
constexpr int kZero = kModeZero, kUniform = kModeUniform;
constexpr int kAll = kRegionAll, kNoIntra = kRegionNoIntra, kNoInter = kRegionNoInter;

// Column-major C(m×n) = alpha · op(A) · op(B), BLAS conventions.
void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float* c, int64_t ldc) {
  if (sgemm_ != nullptr) {
    int im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
    float beta = 0.f;
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
  at::mm_out(C, Bt, At);
  if (alpha != 1.f) C.mul_(alpha);
}

struct RowStats {
  float Z, Zk, S2, I, Mx;
  // The row's softmax is undefined (a NaN or +inf score, or every score -inf): numerics policy in
  // attnkit/reference.py — the row's output and its (sample, head)'s features become NaN.
  bool undefined;
};

// One pass over a row of n scores (in place → numerators e, dropped keys 0). REGION: kAll, kNoIntra,
// kNoInter. sidf: sentence ids as floats (needed when FEAT or REGION != kAll); they are dense
// per-sample ranks (see SampleInfo), so comparing them as floats is exact.
template <bool FEAT, int REGION>
RowStats row_pass(float* x, int64_t n, bool uniform, const float* sidf, float sid_s) {
  const float m = uniform ? 0.f : range_max(x, n);
  // A +inf score or all −inf show in m (so may a NaN: at::vec::maximum propagates it, std::max in the
  // scalar tail does not); NaN scores are also flagged lane by lane below. A −inf score among finite
  // ones is fine: its weight is 0, as in torch.softmax.
  if (!uniform && !std::isfinite(m)) {
    RowStats r{};
    r.undefined = true;
    return r;
  }
  Vec mv(m), one(1.f), zero(0.f), sv(sid_s);
  Vec Zv(0.f), Zkv(0.f), S2v(0.f), Iv(0.f), Mxv(0.f), NaNv(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const Vec xv = Vec::loadu(x + i);
    if (!uniform) NaNv = NaNv | xv.isnan();  // all-ones lanes where a score is NaN
    Vec y = uniform ? zero : xv - mv;
    Vec e = uniform ? one : y.exp_u20();
    Zv = Zv + e;
    if constexpr (FEAT || REGION != kAll) {
      Vec same = Vec::loadu(sidf + i).eq(sv);
      if constexpr (REGION == kNoIntra) e = e * (one - same);
      if constexpr (REGION == kNoInter) e = e * same;
      if constexpr (REGION != kAll) Zkv = Zkv + e;
      if constexpr (FEAT) {
        // Σ e·y over the row; a −inf score (weight 0) must add 0, not 0·(−inf) = NaN
        S2v = at::vec::fmadd(e, at::vec::maximum(y, Vec(-1e30f)), S2v);
        Iv = at::vec::fmadd(e, same, Iv);
        Mxv = at::vec::maximum(Mxv, e);
      }
    }
    e.store(x + i);
  }
  auto sum = [](Vec& v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); };
  RowStats r{sum(Zv), 0.f, 0.f, 0.f, 0.f, NaNv.zero_mask() != (1 << kW) - 1};
  if constexpr (REGION != kAll) r.Zk = sum(Zkv);
  if constexpr (FEAT) {
    r.S2 = sum(S2v);
    r.I = sum(Iv);
    r.Mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, Mxv);
  }
  for (; i < n; ++i) {
    float y = uniform ? 0.f : x[i] - m;
    if (!uniform && std::isnan(x[i])) r.undefined = true;
    float e = uniform ? 1.f : std::exp(y);
    r.Z += e;
    if constexpr (FEAT || REGION != kAll) {
      float same = sidf[i] == sid_s ? 1.f : 0.f;
      if constexpr (REGION == kNoIntra) e *= 1.f - same;
      if constexpr (REGION == kNoInter) e *= same;
      if constexpr (REGION != kAll) r.Zk += e;
      if constexpr (FEAT) {
        r.S2 += e * std::max(y, -1e30f);
        r.I += e * same;
        r.Mx = std::max(r.Mx, e);
      }
    }
    x[i] = e;
  }
  if constexpr (REGION == kAll) r.Zk = r.Z;
  return r;
}

using RowFn = RowStats (*)(float*, int64_t, bool, const float*, float);

RowFn pick_row_fn(bool feat, int region) {
  static const RowFn table[2][3] = {
      {row_pass<false, kAll>, row_pass<false, kNoIntra>, row_pass<false, kNoInter>},
      {row_pass<true, kAll>, row_pass<true, kNoIntra>, row_pass<true, kNoInter>}};
  return table[feat ? 1 : 0][region];
}

// Per-sample facts the feature code needs, computed once per call.
struct SampleInfo {
  int64_t n;
  std::vector<std::pair<int32_t, int32_t>> special;  // (key position, class) for class != OTHER
  // Sentence ids as dense per-sample ranks (0, 1, ... by value; zeros when none), length L, as floats
  // for the vectorised comparisons: exact for any int32 id (a float holds every integer below 2^24).
  std::vector<float> sidf;
  int64_t n_cls_rows = 0;
};

void check_opt(const c10::optional<at::Tensor>& t, const char* name, at::ScalarType dt,
               at::IntArrayRef shape, const char* shape_txt) {
  if (!t.has_value()) return;
  ATTNKIT_CHECK(t->device().is_cpu(), "fused_attention: ", name, " must be on the CPU like q, got ", t->device());
  ATTNKIT_CHECK(t->scalar_type() == dt && t->sizes() == shape, "fused_attention: ", name, " must be ",
              c10::toString(dt), " of shape ", shape_txt, " ", shape, ", got ", t->scalar_type(), " of shape ",
              t->sizes());
}

std::tuple<at::Tensor, at::Tensor> fused_attention_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& lengths_in,
    const c10::optional<at::Tensor>& token_class_in, const c10::optional<at::Tensor>& sentence_id_in,
    double scaling, int64_t num_windows, const c10::optional<at::Tensor>& mode_in,
    const c10::optional<at::Tensor>& region_in, bool renormalize, const c10::optional<at::Tensor>& gates_in,
    bool want_features, const c10::optional<at::Tensor>& key_scale_in) {
  ATTNKIT_CHECK(q_in.dim() == 4, "fused_attention: q must be 4-D (B, H, L, D), got shape ", q_in.sizes());
  ATTNKIT_CHECK(k_in.sizes() == q_in.sizes() && v_in.sizes() == q_in.sizes(),
              "fused_attention: k and v must have q's shape ", q_in.sizes(), ", got k ", k_in.sizes(), " and v ",
              v_in.sizes());
  const auto dt = q_in.scalar_type();
  ATTNKIT_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "fused_attention: q must be float32, bfloat16 or float16, got ", dt);
  ATTNKIT_CHECK(k_in.scalar_type() == dt && v_in.scalar_type() == dt, "fused_attention: k and v must have q's dtype ",
              dt, ", got k ", k_in.scalar_type(), " and v ", v_in.scalar_type());
  ATTNKIT_CHECK(q_in.device().is_cpu() && k_in.device().is_cpu() && v_in.device().is_cpu(),
              "fused_attention: q, k and v must be on the CPU for this kernel");
  const int64_t B = q_in.size(0), H = q_in.size(1), L = q_in.size(2), D = q_in.size(3);
  ATTNKIT_CHECK(num_windows >= 1, "fused_attention: num_windows must be >= 1, got ", num_windows);
  ATTNKIT_CHECK(D >= 1, "fused_attention: head dim (q.size(3)) must be >= 1, got ", D);
  ATTNKIT_CHECK(std::isfinite(scaling), "fused_attention: scaling must be a finite number, got ", scaling);
  ATTNKIT_CHECK(lengths_in.device().is_cpu(), "fused_attention: lengths must be on the CPU like q");
  ATTNKIT_CHECK(lengths_in.scalar_type() == at::kLong && lengths_in.dim() == 1 && lengths_in.size(0) == B,
              "fused_attention: lengths must be int64 of shape [B] = [", B, "], got ", lengths_in.scalar_type(),
              " of shape ", lengths_in.sizes());
  check_opt(token_class_in, "token_class", at::kInt, {B, L}, "[B, L]");
  check_opt(sentence_id_in, "sentence_id", at::kInt, {B, L}, "[B, L]");
  check_opt(mode_in, "mode", at::kInt, {H}, "[H]");
  check_opt(region_in, "region", at::kInt, {H}, "[H]");
  check_opt(gates_in, "gates", at::kFloat, {H}, "[H]");
  check_opt(key_scale_in, "key_scale", at::kFloat, {B, H, L}, "[B, H, L]");

  const auto lengths = lengths_in.contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    ATTNKIT_CHECK(len[b] >= 1 && len[b] <= L, "fused_attention: lengths must lie in [1, L] = [1, ", L,
                "], got lengths[", b, "] = ", len[b]);
  std::vector<int32_t> mode(H, kModeKeep), region(H, kAll);
  std::vector<float> gate(H, 1.f);
  if (mode_in) {
    auto t = mode_in->contiguous();
    for (int64_t h = 0; h < H; ++h) {
      mode[h] = t.data_ptr<int32_t>()[h];
      ATTNKIT_CHECK(mode[h] >= 0 && mode[h] <= 2, "fused_attention: mode codes must be 0, 1 or 2, got ", mode[h]);
    }
  }
  if (region_in) {
    auto t = region_in->contiguous();
    for (int64_t h = 0; h < H; ++h) {
      region[h] = t.data_ptr<int32_t>()[h];
      ATTNKIT_CHECK(region[h] >= 0 && region[h] <= 2, "fused_attention: region codes must be 0, 1 or 2, got ",
                  region[h]);
    }
  }
  if (gates_in) {
    auto t = gates_in->contiguous();
    for (int64_t h = 0; h < H; ++h) gate[h] = t.data_ptr<float>()[h];
  }
  const int64_t N = num_windows;
  const int64_t F = kNumFeatures(int(N));
  const int64_t R = kNumBucketSlots(int(N));  // first per-row feature slot
  at::Tensor key_scale;
  if (want_features && key_scale_in) key_scale = key_scale_in->contiguous();
  const float* gp = key_scale.defined() ? key_scale.data_ptr<float>() : nullptr;
  at::Tensor tc, sid;
  if (token_class_in) tc = token_class_in->contiguous();
  if (sentence_id_in) sid = sentence_id_in->contiguous();
  const bool need_sid = want_features || std::any_of(region.begin(), region.end(), [](int r) { return r != kAll; });

  std::vector<SampleInfo> info(B);
  for (int64_t b = 0; b < B; ++b) {
    auto& si = info[b];
    si.n = len[b];
    if (need_sid) {
      si.sidf.assign(L, 0.f);
      if (sid.defined()) {
        const int32_t* sp = sid.data_ptr<int32_t>() + b * L;
        std::vector<int32_t> ids(sp, sp + L);
        std::sort(ids.begin(), ids.end());
        ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
        for (int64_t t = 0; t < L; ++t)
          si.sidf[t] = static_cast<float>(std::lower_bound(ids.begin(), ids.end(), sp[t]) - ids.begin());
      }
    }
    if (want_features) {
      if (tc.defined()) {
        const int32_t* cp = tc.data_ptr<int32_t>() + b * L;
        for (int64_t t = 0; t < si.n; ++t) {
          ATTNKIT_CHECK(cp[t] >= kOther && cp[t] <= kPeriod, "fused_attention: token_class codes must be 0..4, got ",
                      cp[t], " at [", b, ", ", t, "]");
          if (cp[t] != kOther) si.special.emplace_back(static_cast<int32_t>(t), cp[t]);
          if (cp[t] == kCls) si.n_cls_rows++;
        }
      }
    }
  }

  // fp32 operands; BLAS needs unit stride along D (transformers' transposed views have it).
  auto prep = [](const at::Tensor& t) {
    at::Tensor f = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
    if (f.stride(3) != 1 || f.stride(2) < f.size(3)) f = f.contiguous();
    return f;
  };
  const at::Tensor q = prep(q_in), k = prep(k_in), v = prep(v_in);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);

  const bool out_f32 = dt == at::kFloat;
  at::Tensor out = at::empty({B, L, H, D}, q_in.options().dtype(dt));
  at::Tensor out32 = out_f32 ? out : at::empty({B, L, H, D}, q_in.options().dtype(at::kFloat));
  float* op = out32.data_ptr<float>();
  const int64_t os_row = H * D;  // stride between query rows of one (b, h) in B×L×H×D

  // Row tile: keep TQ × L fp32 scores within ~256 KB (L2), at least 16 rows.
  const int64_t TQ = std::max<int64_t>(16, std::min<int64_t>({128, L, (64 * 1024) / std::max<int64_t>(L, 1)}));
  const int64_t n_tiles = (L + TQ - 1) / TQ;
  const int64_t n_tasks = B * H * n_tiles;
  const int64_t FA = F + 1;  // per task: F−1 row-feature sums, [F−1] unused, [F] CLS-row entropy sum
  std::vector<double> partial(want_features ? n_tasks * FA : 0, 0.0);

  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(static_cast<size_t>(TQ * L));
    std::vector<float> row_c(TQ);
    std::vector<float> diag(want_features ? 2 * L : 0, 0.f);
    std::vector<float> scaled_row(gp != nullptr ? L : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task % n_tiles, bh = task / n_tiles, h = bh % H, b = bh / H;
      const int64_t r0 = tile * TQ, tq = std::min(TQ, L - r0);
      const SampleInfo& si = info[b];
      const int64_t n = si.n;
      float* o = op + b * L * os_row + r0 * os_row + h * D;
      if (mode[h] == kZero) {  // weights all 0: output 0, features 0
        for (int64_t r = 0; r < tq; ++r) std::fill(o + r * os_row, o + r * os_row + D, 0.f);
        continue;
      }
      const bool uniform = mode[h] == kUniform;
      const float* qt = qp + b * qs0 + h * qs1 + r0 * qs2;
      const float* kt = kp + b * ks0 + h * ks1;
      const float* vt = vp + b * vs0 + h * vs1;
      // S (row-major tq×n, ld n) == column-major Sᵀ (n×tq) = K (n×D) · Q_tileᵀ
      if (!uniform) {
        // BLAS skips the product when alpha is 0; scaling by 0 afterwards keeps NaN/inf scores NaN.
        const float alpha = scaling != 0.0 ? static_cast<float>(scaling) : 1.f;
        gemm('T', 'N', n, tq, D, alpha, kt, ks2, qt, qs2, S.data(), n);
        if (scaling == 0.0) scale_inplace(S.data(), tq * n, 0.f);
      }
      const RowFn fn = pick_row_fn(want_features, region[h]);
      const float* sidf = si.sidf.empty() ? nullptr : si.sidf.data();
      double* acc = want_features ? partial.data() + task * FA : nullptr;
      bool task_undefined = false;
      for (int64_t r = 0; r < tq; ++r) {
        const int64_t s = r0 + r;
        float* e = S.data() + r * n;
        const bool feat_row = want_features && s < n;
        RowStats st;
        if (feat_row) {
          st = fn(e, n, uniform, sidf, sidf[s]);
        } else {
          st = pick_row_fn(false, region[h])(e, n, uniform, sidf, sidf ? sidf[s] : 0.f);
        }
        const float c = st.undefined ? std::numeric_limits<float>::quiet_NaN()
                        : renormalize ? (st.Zk > 0.f ? 1.f / st.Zk : 0.f)
                                      : 1.f / st.Z;
        row_c[r] = c * gate[h];  // an undefined row: NaN output
        if (!feat_row) continue;
        if (st.undefined) {  // NaN features for the whole (sample, head): see fill below
          task_undefined = true;
          continue;
        }
        // --- features of row s: weights w = fc · fe[t] ---
        // fe are the numerators e (dropped keys 0) with their normaliser c; with a key scale g (norm
        // weighting) they are e·g with c = 1 / Σ e·g, and the row's sums are recomputed for them.
        const float* fe = e;
        float fc = c, fZk = st.Zk, fS2 = st.S2, fI = st.I, fMx = st.Mx;
        if (gp != nullptr) {
          const float* g = gp + (b * H + h) * L;
          double zg = 0.0, s2 = 0.0, in = 0.0;
          float mx = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            const float x = e[t] * g[t];
            scaled_row[t] = x;
            zg += x;
            if (x > 0.f) s2 += static_cast<double>(x) * std::log(x);  // Σ x·ln x: the entropy term
            if (sidf != nullptr && sidf[t] == sidf[s]) in += x;
            mx = std::max(mx, x);
          }
          fe = scaled_row.data();
          fZk = static_cast<float>(zg);
          fc = zg > 0.0 ? static_cast<float>(1.0 / zg) : 0.f;
          fS2 = static_cast<float>(s2);
          fI = sidf != nullptr ? static_cast<float>(in) : fZk;
          fMx = mx;
        }
        // Distance windows: accumulate the weighted row into diag[t − s + n − 1]; the windows are sums
        // of diag over |offset| ranges, folded once per tile. Special keys move from their window to
        // their class bucket below.
        axpy(fc, fe, diag.data() + (n - 1 - s), n);
        double* a = acc;
        bool self_special = false;
        for (const auto& [t, cl] : si.special) {
          const double wt = static_cast<double>(fc) * fe[t];
          a[class_slot(cl)] += wt;
          if (t != s) {
            const int64_t d = t > s ? t - s : s - t;
            a[kSlotFirstWindow + (d * N) / n] -= wt;
          } else {
            self_special = true;
          }
        }
        if (!self_special) a[kSlotSelf] += static_cast<double>(fc) * fe[s];
        const float T = fc * fZk;
        const float H_ent = fc > 0.f ? std::max(0.f, -fc * fS2 - fc * std::log(fc) * fZk) : 0.f;
        const float intra = fc * fI;
        a[R + kRowPrev] += s > 0 ? fc * fe[s - 1] : 0.f;
        a[R + kRowNext] += s + 1 < n ? fc * fe[s + 1] : 0.f;
        a[R + kRowEntropy] += H_ent;
        a[R + kRowMax] += fc * fMx;
        a[R + kRowIntra] += intra;
        a[R + kRowInter] += std::max(0.f, T - intra);
        if (tc.defined() && tc.data_ptr<int32_t>()[b * L + s] == kCls) a[F] += H_ent;
      }
      if (want_features && r0 < n) {  // fold the diagonal sums into the distance windows
        double* a = acc;
        for (int64_t d = 1; d < n; ++d)
          a[kSlotFirstWindow + (d * N) / n] += static_cast<double>(diag[n - 1 + d]) + diag[n - 1 - d];
        std::fill(diag.begin(), diag.begin() + (2 * n - 1), 0.f);
      }
      if (task_undefined) std::fill(acc, acc + FA, std::numeric_limits<double>::quiet_NaN());
      // O_tile (row-major tq×D, ld H·D) == column-major Oᵀ (D×tq) = Vᵀ (D×n) · Eᵀ (n×tq)
      // (written into out, or into its fp32 twin for bf16/fp16 outputs)
      gemm('N', 'N', D, tq, n, 1.f, vt, vs2, S.data(), n, o, os_row);
      for (int64_t r = 0; r < tq; ++r) scale_inplace(o + r * os_row, D, row_c[r]);
    }
  });

  if (!out_f32) out.copy_(out32);
  at::Tensor feats = at::zeros({B, H, want_features ? F : 0}, q_in.options().dtype(at::kFloat));
  if (want_features) {
    float* fp = feats.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const double inv_n = 1.0 / static_cast<double>(info[b].n);
      const double inv_cls = 1.0 / static_cast<double>(std::max<int64_t>(info[b].n_cls_rows, 1));
      for (int64_t h = 0; h < H; ++h) {
        float* dst = fp + (b * H + h) * F;
        for (int64_t f = 0; f < F - 1; ++f) {
          double s = 0.0;
          for (int64_t t = 0; t < n_tiles; ++t) s += partial[((b * H + h) * n_tiles + t) * FA + f];
          dst[f] = static_cast<float>(s * inv_n);
        }
        double s = 0.0;
        for (int64_t t = 0; t < n_tiles; ++t) s += partial[((b * H + h) * n_tiles + t) * FA + F];
        dst[F - 1] = static_cast<float>(s * inv_cls);
      }
    }
  }
  return {out, feats};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) { m.impl("fused_attention", &fused_attention_cpu); }

}  // namespace attnkit::cpu
