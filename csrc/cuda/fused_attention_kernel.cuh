// The fused attention + interventions + features kernel "v1" (docs/features.md, docs/interventions.md;
// semantics exactly attnkit/reference.py). Two passes over the keys; the single-pass tensor-core kernel
// is fused_attention_v2_kernel.cuh.
//
// One thread block owns kBlockM = 64 query rows of one (sample b, head h): grid (ceil(L/64), H, B).
// Only the key tiles that cover the keys its rows see are visited: t < n = lengths[b], and for decoders
// (docs/features.md, section 8) t <= s (causal) and t > s − W (sliding window), so a causal block skips
// the tiles above the diagonal. Query head h reads KV head kv_head[h] (grouped-query attention); scores
// may be soft-capped; a sink logit joins each row's max and denominator (its mass is a feature).
//
//   pass 1  for each key tile: S = Q Kᵀ · scaling (tensor cores for fp16/bf16) into shared memory;
//           each row keeps an online max m, sum l = Σ exp(s − m) and, when renormalising after a
//           region intervention, the kept sum l_kept (or, for mode uniform, the kept key count);
//           with a key scale g (norm weighting) also the weighted kept sum Σ exp(s − m)·keep·g.
//   pass 2  for each key tile: recompute S, form the final weights
//               keep:    w = keep(t) · exp(s − m) / Z,   Z = l (or l_kept when renormalising)
//               uniform: w = keep(t) / c,                c = n (or the kept count when renormalising)
//           write them (in T) to shared memory, accumulate O += P V (tensor cores), and accumulate the
//           per-row features of the final weights in registers; window buckets are run-length
//           accumulated per thread (a thread walks contiguous keys, so the window changes rarely) and
//           flushed to a per-block shared accumulator.
//   end     O · gate is written to out[b, s, h, :]; the per-row features of valid rows (s < n) are
//           reduced over the block and atomically added to the fp32 B×H×F sums; a second small kernel
//           divides by n (cls_entropy by the number of CLS rows).
// No L×L tensor is written to global memory. Mode zero writes zeros and returns (its features are 0).
//
// Thread layout: 128 threads = 4 warps; warp w owns rows [16w, 16w + 16) of the tile for the tensor-core
// products (S band and O band), and thread tid handles row r = tid / 2, key half tid % 2 of every key
// tile for the elementwise work, so every row is handled inside the warp that computed its S band and
// only __syncwarp is needed between the products and the elementwise work. K, V and key metadata are
// loaded by the whole block (bracketed by __syncthreads).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "fused_attention_common.cuh"
#include "fused_attention_params.h"
#include "fused_attention_traits.h"

namespace attnkit {
namespace cuda {

// Window of distance d >= 1 among N windows over n tokens: min(floor(d·N / n), N − 1), exact integer
// result from a float estimate corrected by one step (d·N < 2^31 by the host's limits).
__device__ __forceinline__ int window_of(int d, int N, int n, float n_over_inv) {
  int w = __float2int_rz(float(d) * n_over_inv);
  const int dn = d * N;
  if (w * n > dn) {
    --w;
  } else if ((w + 1) * n <= dn) {
    ++w;
  }
  return w < N - 1 ? w : N - 1;
}

// Copies rows [row0, row0 + rows) of a B×H×L×D operand (unit stride on D) into a shared tile with row
// stride kLdQ; rows at or beyond `limit` are zero-filled (so padded or missing keys add exactly 0).
template <typename Traits, int kRows>
__device__ __forceinline__ void load_tile(typename Traits::T* __restrict__ dst, const typename Traits::T* __restrict__ src,
                                          int64_t stride_l, int row0, int limit, int tid) {
  using T = typename Traits::T;
  constexpr int kChunks = Traits::kHeadDim / Traits::kVec;
  for (int idx = tid; idx < kRows * kChunks; idx += Traits::kThreads) {
    const int r = idx / kChunks;
    const int c = (idx % kChunks) * Traits::kVec;
    const int row = row0 + r;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (row < limit) {
      val = *reinterpret_cast<const uint4*>(src + int64_t(row) * stride_l + c);
    }
    *reinterpret_cast<uint4*>(dst + r * Traits::kLdQ + c) = val;
  }
}

template <typename Traits, bool kFeatures>
__device__ __forceinline__ void fused_attention_body(const FusedParams& p) {
  using T = typename Traits::T;
  constexpr int BM = Traits::kBlockM;
  constexpr int BN = Traits::kBlockN;
  constexpr int D = Traits::kHeadDim;
  constexpr int LDQ = Traits::kLdQ;
  constexpr int LDS = Traits::kLdS;
  constexpr int LDP = Traits::kLdP;
  constexpr int KPT = Traits::kKeysPerThread;
  constexpr int NT = Traits::kThreads;
  namespace wmma = nvcuda::wmma;

  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = reinterpret_cast<T*>(smem + Traits::kOffK);
  T* Vs = reinterpret_cast<T*>(smem + Traits::kOffV);
  float* Ss = reinterpret_cast<float*>(smem + Traits::kOffS);
  T* Ps = reinterpret_cast<T*>(smem + (Traits::kUseMma ? Traits::kOffP : Traits::kOffS));
  int* key_sid = reinterpret_cast<int*>(smem + Traits::kOffMeta);
  int* key_cls = key_sid + BN;
  float* key_g = reinterpret_cast<float*>(key_cls + BN);  // key scales (norm weighting), 1 without
  float* feat_s = reinterpret_cast<float*>(smem + Traits::kOffFeat);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int r = tid >> 1;     // row of the tile this thread works on
  const int half = tid & 1;   // which half of each key tile
  const int j0 = half * KPT;  // first key (within the tile) of this thread
  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const int row0 = blockIdx.x * BM;
  const int L = p.L;
  const int H = p.H;
  const HeadSetup hs = head_setup(p, b, h);
  const int n = hs.n, mode = hs.mode, region = hs.region, kvh = hs.kv;
  const float gate = hs.gate;
  T* out = reinterpret_cast<T*>(p.out);
  // out is contiguous B×L×H×D
  const int64_t out_row_stride = int64_t(H) * D;
  T* out_base = out + (int64_t(b) * L * H + h) * D;
  if (early_exit<T>(p, hs, b, h, D, row0, BM, tid, NT)) return;

  const T* qb = reinterpret_cast<const T*>(p.q) + int64_t(b) * p.q_stride_b + int64_t(h) * p.q_stride_h;
  const T* kb = reinterpret_cast<const T*>(p.k) + int64_t(b) * p.k_stride_b + int64_t(kvh) * p.k_stride_h;
  const T* vb = reinterpret_cast<const T*>(p.v) + int64_t(b) * p.v_stride_b + int64_t(kvh) * p.v_stride_h;
  const int32_t* sid_b = p.sentence_id != nullptr ? p.sentence_id + int64_t(b) * L : nullptr;
  const int32_t* cls_b = p.token_class != nullptr ? p.token_class + int64_t(b) * L : nullptr;
  const float* g_bh = p.key_scale != nullptr ? p.key_scale + (int64_t(b) * H + h) * L : nullptr;

  const int s = row0 + r;  // this thread's query row
  const int row_sid = (sid_b != nullptr && s < L) ? sid_b[s] : 0;
  const int row_cls = (cls_b != nullptr && s < L) ? cls_b[s] : kClassOther;
  const bool feat_row = kFeatures && s < n;
  // the keys row s sees: [lo_of(s), hi_of(s)), both non-decreasing in s
  auto hi_of = [&](int row) { return p.causal ? min(n, row + 1) : n; };
  auto lo_of = [&](int row) { return min(p.window > 0 ? max(0, row - p.window + 1) : 0, hi_of(row)); };
  const int key_lo = lo_of(s), key_hi = hi_of(s);
  auto sees = [&](int t) { return t >= key_lo && t < key_hi; };
  const float sink = p.sink != nullptr ? p.sink[h] : -INFINITY;
  const int N = p.num_windows;
  const float win_scale = float(N) / float(n);

  if constexpr (kFeatures) {
    for (int i = tid; i < p.num_features; i += NT) feat_s[i] = 0.f;
  }
  load_tile<Traits, BM>(Qs, qb, p.q_stride_l, row0, L, tid);

  const bool use_scores = mode == kModeKeep;
  const bool need_kept = p.renormalize && region != kRegionAll;
  const bool scaled = kFeatures && g_bh != nullptr;  // features weigh key t by g_t: w' = w·g / Σ w·g
  // the key tiles the block's rows see
  const int kt_begin = lo_of(row0) / BN;
  const int kt_end = (hi_of(min(row0 + BM, L) - 1) + BN - 1) / BN;

  // Logit soft-capping (Gemma 2), off when p.softcap is 0.
  auto cap = [&](float x) { return p.softcap > 0.f ? p.softcap * tanhf(x / p.softcap) : x; };
  // Scores of this warp's 16 rows against the current key tile, scaled, into Ss (row-major, LDS).
  auto compute_scores = [&]() {
    if constexpr (Traits::kUseMma) {
      for (int j = 0; j < BN / 16; ++j) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bt;  // Kᵀ: column-major view of K
          wmma::load_matrix_sync(a, Qs + warp * 16 * LDQ + k * 16, LDQ);
          wmma::load_matrix_sync(bt, Ks + j * 16 * LDQ + k * 16, LDQ);
          wmma::mma_sync(acc, a, bt, acc);
        }
#pragma unroll
        for (int i = 0; i < acc.num_elements; ++i) acc.x[i] = cap(acc.x[i] * p.scaling);
        wmma::store_matrix_sync(Ss + warp * 16 * LDS + j * 16, acc, LDS, wmma::mem_row_major);
      }
    } else {
      // fp32: each thread computes exactly the scores it will read (row r, keys j0 .. j0 + KPT).
      const float4* qrow = reinterpret_cast<const float4*>(Qs + r * LDQ);
      for (int j = 0; j < KPT; ++j) {
        const float4* krow = reinterpret_cast<const float4*>(Ks + (j0 + j) * LDQ);
        float acc = 0.f;
#pragma unroll
        for (int d4 = 0; d4 < D / 4; ++d4) {
          const float4 a = qrow[d4];
          const float4 c = krow[d4];
          acc = fmaf(a.x, c.x, acc);
          acc = fmaf(a.y, c.y, acc);
          acc = fmaf(a.z, c.z, acc);
          acc = fmaf(a.w, c.w, acc);
        }
        Ss[r * LDS + j0 + j] = cap(acc * p.scaling);
      }
    }
  };

  auto load_key_meta = [&](int key0) {
    for (int j = tid; j < BN; j += NT) {
      const int t = key0 + j;
      key_sid[j] = (sid_b != nullptr && t < L) ? sid_b[t] : 0;
      key_cls[j] = (cls_b != nullptr && t < L) ? cls_b[t] : kClassOther;
      key_g[j] = (g_bh != nullptr && t < L) ? g_bh[t] : 1.f;
    }
  };

  // ---- pass 1: row max, row sum, kept sum / kept count, weighted kept sum ------------------------
  float m_run = -INFINITY, l_run = 0.f, lk_run = 0.f, lg_run = 0.f;
  int ck_run = 0;
  bool nan_score = false;  // fmaxf skips NaN: NaN scores are tracked apart (numerics policy)
  if (use_scores || need_kept || scaled) {
    for (int kt = kt_begin; kt < kt_end; ++kt) {
      const int key0 = kt * BN;
      __syncthreads();  // the previous tile's K and metadata are no longer read
      if (use_scores) load_tile<Traits, BN>(Ks, kb, p.k_stride_l, key0, n, tid);
      load_key_meta(key0);
      __syncthreads();
      if (use_scores) {
        compute_scores();
        __syncwarp();
        float mloc = -INFINITY;
        for (int j = 0; j < KPT; ++j) {
          if (sees(key0 + j0 + j)) {
            const float sc = Ss[r * LDS + j0 + j];
            mloc = fmaxf(mloc, sc);
            nan_score |= isnan(sc);
          }
        }
        if (mloc > -INFINITY) {
          const float m_new = fmaxf(m_run, mloc);
          const float scale = __expf(m_run - m_new);  // m_run = -inf gives 0
          l_run *= scale;
          lk_run *= scale;
          lg_run *= scale;
          m_run = m_new;
          for (int j = 0; j < KPT; ++j) {
            if (sees(key0 + j0 + j)) {
              const float e = __expf(Ss[r * LDS + j0 + j] - m_run);
              l_run += e;
              const bool keep = region_keeps(region, key_sid[j0 + j] == row_sid);
              if (need_kept && keep) lk_run += e;
              if (scaled && keep) lg_run += e * key_g[j0 + j];
            }
          }
        }
      } else {
        for (int j = 0; j < KPT; ++j) {
          if (sees(key0 + j0 + j) && region_keeps(region, key_sid[j0 + j] == row_sid)) {
            ++ck_run;
            if (scaled) lg_run += key_g[j0 + j];
          }
        }
      }
    }
    // combine the two halves of each row (partner lane = lane ^ 1, in the same warp)
    const float m_o = __shfl_xor_sync(0xffffffffu, m_run, 1);
    const float l_o = __shfl_xor_sync(0xffffffffu, l_run, 1);
    const float lk_o = __shfl_xor_sync(0xffffffffu, lk_run, 1);
    const float lg_o = __shfl_xor_sync(0xffffffffu, lg_run, 1);
    const int ck_o = __shfl_xor_sync(0xffffffffu, ck_run, 1);
    nan_score |= __shfl_xor_sync(0xffffffffu, int(nan_score), 1) != 0;
    const float m_new = fmaxf(m_run, m_o);
    // (uniform mode: m stays -inf on both halves and the sums are counts, combined unscaled)
    const float s1 = m_run == -INFINITY ? (use_scores ? 0.f : 1.f) : __expf(m_run - m_new);
    const float s2 = m_o == -INFINITY ? (use_scores ? 0.f : 1.f) : __expf(m_o - m_new);
    l_run = l_run * s1 + l_o * s2;
    lk_run = lk_run * s1 + lk_o * s2;
    lg_run = lg_run * s1 + lg_o * s2;
    ck_run += ck_o;
    m_run = m_new;
  }
  // The sink joins the max and the denominators (kept by every region; no value, key scale 0). Uniform heads
  // give it nothing.
  float e_sink = 0.f;
  if (use_scores && p.sink != nullptr) {
    const float m_new = fmaxf(m_run, sink);
    const float scale = m_run == -INFINITY ? 0.f : __expf(m_run - m_new);
    l_run *= scale;
    lk_run *= scale;
    lg_run *= scale;
    m_run = m_new;
    e_sink = __expf(sink - m_run);
    l_run += e_sink;
    lk_run += e_sink;
  }

  // Numerics policy (attnkit/reference.py): a row whose softmax is undefined (a NaN or +inf score, or
  // every score −inf) has NaN weights on all its valid keys, hence a NaN output row, and makes all
  // features of its (sample, head) NaN.
  const bool undefined_row = use_scores && (nan_score || !isfinite(m_run) || isnan(sink));
  // Row constants of the final weights: w = exp(s − m) · inv_z (keep) or inv_z (uniform), and log w.
  float inv_z, log_z;
  if (use_scores) {
    const float z = need_kept ? lk_run : l_run;
    inv_z = z > 0.f ? 1.f / z : 0.f;  // nothing left: the row stays 0
    log_z = z > 0.f ? __logf(z) : 0.f;
  } else {
    const int c = need_kept ? ck_run : key_hi - key_lo;
    inv_z = c > 0 ? 1.f / float(c) : 0.f;
    log_z = c > 0 ? __logf(float(c)) : 0.f;  // log w = −log c
  }
  // Feature weights with a key scale: w'_t = exp(s_t − m)·keep_t·g_t / Σ (keep: the normaliser is lg_run)
  // or keep_t·g_t / Σ keep_u·g_u (uniform).
  const float inv_zg = lg_run > 0.f ? 1.f / lg_run : 0.f;
  const float log_zg = lg_run > 0.f ? __logf(lg_run) : 0.f;

  // ---- pass 2: weights, features, output ----------------------------------------------------------
  constexpr int kOFrags = Traits::kUseMma ? D / 16 : 1;
  constexpr int kOScalar = Traits::kUseMma ? 1 : D / 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o_frag[kOFrags];
  float o_acc[kOScalar];
  if constexpr (Traits::kUseMma) {
#pragma unroll
    for (int c = 0; c < kOFrags; ++c) wmma::fill_fragment(o_frag[c], 0.f);
  } else {
#pragma unroll
    for (int i = 0; i < kOScalar; ++i) o_acc[i] = 0.f;
  }

  // per-row feature partials of this thread's keys
  float f_cls = 0.f, f_sep = 0.f, f_comma = 0.f, f_period = 0.f, f_self = 0.f;
  float f_prev = 0.f, f_next = 0.f, f_ent = 0.f, f_max = 0.f, f_intra = 0.f, f_inter = 0.f;
  // the sink's mass (counted once per row: by the thread of the row's first half; 0 under norm weighting)
  const float f_sink = (half == 0 && !scaled) ? (undefined_row ? NAN : e_sink * inv_z) : 0.f;
  int win_cur = -1;
  float win_acc = 0.f;
  bool bad_class = false;  // a token class code outside 0..4 met on a valid key (see the host checks)

  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int key0 = kt * BN;
    __syncthreads();  // previous K, V and metadata are no longer read
    if (use_scores) load_tile<Traits, BN>(Ks, kb, p.k_stride_l, key0, n, tid);
    load_tile<Traits, BN>(Vs, vb, p.v_stride_l, key0, n, tid);
    load_key_meta(key0);
    __syncthreads();
    if (use_scores) {
      compute_scores();
      __syncwarp();
    }
    for (int j = 0; j < KPT; ++j) {
      const int jj = j0 + j;
      const int t = key0 + jj;
      float w = 0.f;
      float fw = 0.f;
      if (sees(t)) {
        const bool same = key_sid[jj] == row_sid;
        const bool keep = region_keeps(region, same);
        float logw;
        if (undefined_row) {
          w = NAN;
          logw = NAN;
        } else if (use_scores) {
          const float e = Ss[r * LDS + jj] - m_run;
          w = keep ? __expf(e) * inv_z : 0.f;
          logw = e - log_z;
        } else {
          w = keep ? inv_z : 0.f;
          logw = -log_z;
        }
        if (scaled) {  // the features describe w' (norm weighting); the output keeps w
          const float gk = key_g[jj];
          const float base = undefined_row ? NAN : (use_scores ? __expf(Ss[r * LDS + jj] - m_run) : 1.f);
          const float wf = keep ? base * gk * inv_zg : 0.f;
          logw = (use_scores ? Ss[r * LDS + jj] - m_run : 0.f) + __logf(gk) - log_zg;
          fw = wf;
        } else {
          fw = w;
        }
        if (kFeatures && feat_row && fw > 0.f) {
          const float w = fw;  // the weight every feature below describes
          const int kc = key_cls[jj];
          if (kc == kClassCls) {
            f_cls += w;
          } else if (kc == kClassSep) {
            f_sep += w;
          } else if (kc == kClassComma) {
            f_comma += w;
          } else if (kc == kClassPeriod) {
            f_period += w;
          } else if (kc != kClassOther) {
            bad_class = true;
          } else if (t == s) {
            f_self += w;
          } else {
            const int wi = window_of(t > s ? t - s : s - t, N, n, win_scale);
            if (wi != win_cur) {
              if (win_cur >= 0) atomicAdd(&feat_s[kSlotFirstWindow + win_cur], win_acc);
              win_cur = wi;
              win_acc = w;
            } else {
              win_acc += w;
            }
          }
          if (t == s - 1) f_prev += w;
          if (t == s + 1) f_next += w;
          f_ent -= w * logw;
          f_max = fmaxf(f_max, w);
          if (same) {
            f_intra += w;
          } else {
            f_inter += w;
          }
        }
      }
      Ps[r * LDP + jj] = from_float<T>(w);  // fp32 path: in place over the score just read
    }
    __syncwarp();
    // O += P V for this warp's rows
    if constexpr (Traits::kUseMma) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, Ps + warp * 16 * LDP + kk * 16, LDP);
#pragma unroll
        for (int c = 0; c < kOFrags; ++c) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
          wmma::load_matrix_sync(vf, Vs + kk * 16 * LDQ + c * 16, LDQ);
          wmma::mma_sync(o_frag[c], a, vf, o_frag[c]);
        }
      }
    } else {
      // thread owns columns 2i + half of row r
      const float* prow = reinterpret_cast<const float*>(Ps) + r * LDP;
      for (int jj = 0; jj < BN; ++jj) {
        const float pw = prow[jj];
        const float* vrow = reinterpret_cast<const float*>(Vs) + jj * LDQ;
#pragma unroll
        for (int i = 0; i < kOScalar; ++i) o_acc[i] = fmaf(pw, vrow[2 * i + half], o_acc[i]);
      }
    }
  }

  // ---- output: O · gate → out[b, s, h, :] -----------------------------------------------------------
  if constexpr (Traits::kUseMma) {
    constexpr int kCols = Traits::kStageCols;  // staged through this warp's band of Ss
    float* band = Ss + warp * 16 * LDS;
#pragma unroll
    for (int c0 = 0; c0 < D; c0 += kCols) {
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kCols / 16; ++c) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float>& f = o_frag[c0 / 16 + c];
#pragma unroll
        for (int i = 0; i < f.num_elements; ++i) f.x[i] *= gate;
        wmma::store_matrix_sync(band + c * 16, f, LDS, wmma::mem_row_major);
      }
      __syncwarp();
      for (int e = lane; e < 16 * kCols; e += 32) {
        const int rr = e / kCols;
        const int cc = e % kCols;
        const int srow = row0 + warp * 16 + rr;
        if (srow < L) out_base[int64_t(srow) * out_row_stride + c0 + cc] = from_float<T>(band[rr * LDS + cc]);
      }
    }
  } else {
    if (s < L) {
#pragma unroll
      for (int i = 0; i < kOScalar; ++i) out_base[int64_t(s) * out_row_stride + 2 * i + half] = from_float<T>(o_acc[i] * gate);
    }
  }

  // ---- features: reduce rows into the per-(sample, head) sums ---------------------------------------
  if constexpr (kFeatures) {
    if (win_cur >= 0) atomicAdd(&feat_s[kSlotFirstWindow + win_cur], win_acc);
    // this thread's row partials and the feature slot each one goes to (csrc/feature_slots.h)
    // (the sink's slot is only read when there is a sink: without one, f_sink is 0 and goes to cls_entropy)
    constexpr int kNumRow = 13, kMaxIdx = 8, kEntIdx = 7, kClsEntIdx = 11;
    float v[kNumRow] = {f_cls, f_sep, f_comma, f_period, f_self, f_prev, f_next, f_ent, f_max, f_intra, f_inter, 0.f,
                        f_sink};
    const int rows0 = kNumBucketSlots(N);
    const int slot[kNumRow] = {kSlotCls, kSlotSep, kSlotComma, kSlotPeriod, kSlotSelf, rows0 + kRowPrev,
                               rows0 + kRowNext, rows0 + kRowEntropy, rows0 + kRowMax, rows0 + kRowIntra,
                               rows0 + kRowInter, rows0 + kRowClsEntropy,
                               p.sink != nullptr ? kNumFeatures(N) : rows0 + kRowClsEntropy};
#pragma unroll
    for (int i = 0; i < kNumRow; ++i) {
      if (i == kClsEntIdx) continue;
      const float o = __shfl_xor_sync(0xffffffffu, v[i], 1);
      v[i] = i == kMaxIdx ? fmaxf(v[i], o) : v[i] + o;  // the row max combines by max, the rest by sum
    }
    v[kClsEntIdx] = row_cls == kClassCls ? v[kEntIdx] : 0.f;  // cls_entropy: entropy of CLS rows
    const bool contributes = feat_row && half == 0;
#pragma unroll
    for (int i = 0; i < kNumRow; ++i) {
      float x = contributes ? v[i] : 0.f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
      v[i] = x;
    }
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < kNumRow; ++i) atomicAdd(&feat_s[slot[i]], v[i]);
    }
    // an undefined row or a bad class code in the block: every feature of (b, h) becomes NaN
    const bool poison = __syncthreads_or(feat_row && (undefined_row || bad_class)) != 0;
    float* gfeat = p.features + (int64_t(b) * H + h) * p.num_features;
    for (int i = tid; i < p.num_features; i += NT) {
      const float x = poison ? NAN : feat_s[i];
      if (x != 0.f) atomicAdd(&gfeat[i], x);
    }
  }
}

template <typename Traits, bool kFeatures>
__global__ void __launch_bounds__(Traits::kThreads) fused_attention_kernel(const FusedParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // fp16/bf16 WMMA needs sm_80 here (bf16 fragments); the host refuses those dtypes on older GPUs, so
  // builds that include older architectures (TORCH_CUDA_ARCH_LIST) still compile.
  if constexpr (Traits::kUseMma) {
    __trap();
  } else {
    fused_attention_body<Traits, kFeatures>(p);
  }
#else
  fused_attention_body<Traits, kFeatures>(p);
#endif
}

template <typename T, int kHeadDim>
void launch_fused_attention(const FusedParams& params, cudaStream_t stream) {
  using Traits = FusedTraits<T, kHeadDim>;
  const dim3 grid((params.L + Traits::kBlockM - 1) / Traits::kBlockM, params.H, params.B);
  const bool features = params.features != nullptr;
  const int smem = Traits::smem_bytes(features ? params.num_features : 0);
  auto kernel = features ? fused_attention_kernel<Traits, true> : fused_attention_kernel<Traits, false>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return;  // the caller checks cudaGetLastError
  }
  kernel<<<grid, Traits::kThreads, smem, stream>>>(params);
}

}  // namespace cuda
}  // namespace attnkit
