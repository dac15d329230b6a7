// Clark et al.'s Jensen-Shannon distances between every pair of heads (attnkit::js_distances):
//   out[i, j] = Σ_b Σ_{s < n_b} JS(attn[b, i, s, :], attn[b, j, s, :]),  natural logs, 0·log 0 = 0,
//   JS(p, q) = ½ KL(p ‖ m) + ½ KL(q ‖ m),  m = (p + q) / 2
//            = Σ_t [ ½ (p_t log p_t + q_t log q_t) − m_t log m_t ]   (every term ≥ 0 by convexity).
// Keys are summed over t < n_b (the attention rows have 0 on padded keys).
//
// A block takes one sample b, a chunk of kRows query rows, and a tile pair (I, J), I <= J, of kTile
// heads each. For every row and key chunk it stages p and p·log p of the 2·kTile heads in shared memory
// (one log per staged value); each of the 256 threads then owns a 2×2 block of head pairs, so every pair
// element costs one log and two shared loads per log. Partial sums go to registers (fp32 per key chunk,
// fp64 across chunks) and then atomically into the fp64 M×M upper triangle; a second kernel mirrors it.
// No M²×L×L (or even M×M×L) intermediate exists.
#include <cuda_runtime.h>

#include "fused_attention_params.h"

namespace attnkit {
namespace cuda {
namespace {

constexpr int kTile = 32;       // heads per tile
constexpr int kKeys = 64;       // keys per staged chunk
constexpr int kLd = kKeys + 1;  // padded row stride: distinct banks for the 16 rows a warp reads
constexpr int kRows = 16;       // query rows per block
constexpr int kThreads = 256;   // 16 × 16 threads, each 2 × 2 pairs

__device__ __forceinline__ float xlogx(float x) { return x > 0.f ? x * __logf(x) : 0.f; }

__global__ void __launch_bounds__(kThreads) js_distances_kernel(const JsParams p) {
  __shared__ float sp[2][kTile][kLd];   // p of tile I (0) and tile J (1)
  __shared__ float spl[2][kTile][kLd];  // p log p
  const int tiles = (p.M + kTile - 1) / kTile;
  // decode the tile pair I <= J from blockIdx.x
  int pair = blockIdx.x, I = 0;
  while (pair >= tiles - I) {
    pair -= tiles - I;
    ++I;
  }
  const int J = I + pair;
  const int b = blockIdx.z;
  const int L = p.L;
  int n = int(p.lengths[b]);
  n = n < 0 ? 0 : (n > L ? L : n);
  const int s0 = blockIdx.y * kRows;
  const int s1 = s0 + kRows < n ? s0 + kRows : n;
  if (s0 >= s1) return;  // block-uniform

  const int tid = threadIdx.x;
  const int a = tid / 16;  // pairs (a, c), (a, c + 16), (a + 16, c), (a + 16, c + 16) within the tiles
  const int c = tid % 16;
  double acc[2][2] = {{0.0, 0.0}, {0.0, 0.0}};

  for (int s = s0; s < s1; ++s) {
    for (int t0 = 0; t0 < n; t0 += kKeys) {
      __syncthreads();  // the previous chunk is no longer read
      for (int idx = tid; idx < 2 * kTile * kKeys; idx += kThreads) {
        const int which = idx / (kTile * kKeys);
        const int rem = idx % (kTile * kKeys);
        const int hh = rem / kKeys;
        const int tt = rem % kKeys;
        const int head = (which == 0 ? I : J) * kTile + hh;
        const int t = t0 + tt;
        float x = 0.f;
        if (head < p.M && t < n) x = p.attn[((int64_t(b) * p.M + head) * L + s) * L + t];
        sp[which][hh][tt] = x;
        spl[which][hh][tt] = xlogx(x);
      }
      __syncthreads();
      float part[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll 4
      for (int tt = 0; tt < kKeys; ++tt) {
        const float p0 = sp[0][a][tt], p1 = sp[0][a + 16][tt];
        const float pl0 = spl[0][a][tt], pl1 = spl[0][a + 16][tt];
        const float q0 = sp[1][c][tt], q1 = sp[1][c + 16][tt];
        const float ql0 = spl[1][c][tt], ql1 = spl[1][c + 16][tt];
        part[0][0] += 0.5f * (pl0 + ql0) - xlogx(0.5f * (p0 + q0));
        part[0][1] += 0.5f * (pl0 + ql1) - xlogx(0.5f * (p0 + q1));
        part[1][0] += 0.5f * (pl1 + ql0) - xlogx(0.5f * (p1 + q0));
        part[1][1] += 0.5f * (pl1 + ql1) - xlogx(0.5f * (p1 + q1));
      }
#pragma unroll
      for (int x = 0; x < 2; ++x)
#pragma unroll
        for (int y = 0; y < 2; ++y) acc[x][y] += double(part[x][y]);
    }
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
#pragma unroll
    for (int y = 0; y < 2; ++y) {
      const int i = I * kTile + a + 16 * x;
      const int j = J * kTile + c + 16 * y;
      if (i < j && j < p.M) atomicAdd(&p.out[int64_t(i) * p.M + j], acc[x][y]);
    }
  }
}

// out[j, i] = out[i, j] for i < j (the diagonal stays 0: JS(p, p) = 0).
__global__ void mirror_kernel(double* out, int M) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(M) * M) return;
  const int i = int(idx / M), j = int(idx % M);
  if (i > j) out[idx] = out[int64_t(j) * M + i];
}

}  // namespace

void run_js_distances(const JsParams& params, cudaStream_t stream) {
  if (params.M == 0 || params.B == 0 || params.L == 0) return;
  const int tiles = (params.M + kTile - 1) / kTile;
  const dim3 grid(tiles * (tiles + 1) / 2, (params.L + kRows - 1) / kRows, params.B);
  js_distances_kernel<<<grid, kThreads, 0, stream>>>(params);
  const int64_t total = int64_t(params.M) * params.M;
  mirror_kernel<<<int((total + 255) / 256), 256, 0, stream>>>(params.out, params.M);
}

}  // namespace cuda
}  // namespace attnkit
