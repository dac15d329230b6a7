// Host API of the CUDA kernels: argument checks (each error names the argument), allocation, dispatch on
// kernel, dtype and head dim to the generated per-configuration kernels, and the CUDA registrations of
// the attnkit ops (schemas in csrc/ops.cpp; semantics in attnkit/reference.py).
//
// A .cpp file on purpose, like FlashAttention's flash_api.cpp: everything that touches ATen is compiled by
// the C++ compiler, and the .cu files hold kernels and plain-data launchers only, so nvcc never parses
// ATen and a change of the checks recompiles nothing heavy. Error messages go through ATTNKIT_CHECK
// (csrc/check.h).
//
// Only c10/cuda headers are used (not ATen/cuda/CUDAContext.h), so this file also compiles against a
// CPU build of torch for the CI compile check (tools/check_cuda.sh).
//
// Argument values on the device (lengths, mode, region, token classes) are range-checked by a small
// kernel whose report the host reads once (a sync). A thread-local record of the tensors already checked
// (identity + version counter) skips the check when a forward passes the same tensors to every layer, so
// that is one sync per forward, not per layer. While the current stream captures a CUDA graph nothing is
// read on the host (no sync, no host-to-device copy): lengths must already be on the GPU, and values the
// host could not check turn into NaN output and NaN features in the kernel instead of wrong numbers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <optional>
#include <tuple>

#include "../attention_args.h"
#include "../check.h"
#include "fused_attention_params.h"
#include "fused_attention_traits.h"

namespace attnkit {
namespace cuda {
namespace {

constexpr const char* kOp = "attnkit.fused_attention (CUDA): ";
constexpr const char* kJsOp = "attnkit.js_distances (CUDA): ";

// q/k/v as the kernel reads them: unit stride on the head dim, every other stride and the base address
// 16-byte aligned (vector loads). Transposed views from transformers (B×L×H×D memory seen as B×H×L×D)
// already qualify; anything else is copied into a fresh allocation. Not .contiguous(): it returns a
// contiguous tensor unchanged even when its address is misaligned (a view at an odd element offset such
// as buf[1:].view(B, H, L, D)), and the 16-byte loads would then fault.
at::Tensor kernel_operand(const at::Tensor& t) {
  const int64_t vec = 16 / int64_t(t.element_size());
  const bool ok = t.stride(3) == 1 && t.stride(0) % vec == 0 && t.stride(1) % vec == 0 &&
                  t.stride(2) % vec == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// An optional int32/fp32 side input: checked for device, dtype and shape; returned contiguous
// (kept alive by the caller until the launch is queued).
std::optional<at::Tensor> side_input(const std::optional<at::Tensor>& t, const char* name, at::ScalarType dtype,
                                     at::IntArrayRef shape, const at::Device& device) {
  if (!t.has_value()) return std::nullopt;
  const at::Tensor& x = *t;
  ATTNKIT_CHECK(x.scalar_type() == dtype, kOp, name, " must be ", dtype, ", got ", x.scalar_type());
  ATTNKIT_CHECK(x.sizes() == shape, kOp, name, " must have shape ", shape, ", got ", x.sizes());
  ATTNKIT_CHECK(x.device() == device, kOp, name, " must be on ", device, " like q, got ", x.device());
  return x.contiguous();
}

template <typename T>
const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// A tensor as it was when its values were checked: identity (a weak reference keeps the address from
// being reused), data pointer and version counter (bumped by in-place writes; inference tensors have
// none, and are only written in place inside inference mode).
struct Seen {
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  WeakImpl impl{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  const void* data = nullptr;
  int64_t version = -1;

  static int64_t version_of(const at::Tensor& t) { return t.is_inference() ? -1 : int64_t(t._version()); }
  void set(const std::optional<at::Tensor>& t) {
    if (t.has_value()) {
      impl = WeakImpl(t->getIntrusivePtr());
      data = t->data_ptr();
      version = version_of(*t);
    } else {
      *this = Seen{};
    }
  }
  bool same(const std::optional<at::Tensor>& t) const {
    if (!t.has_value()) return data == nullptr && impl.expired();
    return !impl.expired() && impl._unsafe_get_target() == t->unsafeGetTensorImpl() && data == t->data_ptr() &&
           version == version_of(*t);
  }
};

// Arguments whose values passed the check, on this thread: each kind remembered on its own, so a forward
// with a new batch re-checks lengths and token classes once (not per layer), while the per-layer mode and
// region tensors of an intervention are checked once for the whole run.
enum CheckedKind { kLengths, kTokenClass, kMode, kRegion, kKvHead };

struct CheckedEntry {
  int kind = -1;
  Seen tensor, lengths;  // lengths: which positions of the token classes were checked
  int64_t extent = -1;   // L (lengths, token classes) or H (codes)
};

constexpr int kCheckedSlots = 64;
thread_local std::array<CheckedEntry, kCheckedSlots> checked_slots;
thread_local int checked_next = 0;

bool checked_before(int kind, const at::Tensor& t, const std::optional<at::Tensor>& lengths, int64_t extent) {
  for (const auto& e : checked_slots) {
    if (e.kind == kind && e.extent == extent && e.tensor.same(t) && e.lengths.same(lengths)) return true;
  }
  return false;
}

void remember_checked(int kind, const at::Tensor& t, const std::optional<at::Tensor>& lengths, int64_t extent) {
  CheckedEntry& e = checked_slots[checked_next];
  checked_next = (checked_next + 1) % kCheckedSlots;
  e.kind = kind;
  e.tensor.set(t);
  e.lengths.set(lengths);
  e.extent = extent;
}

// Range checks of lengths (unless checked on the host already), mode, region and token classes that live
// on the device and were not checked before: one kernel, one read of its report. Each error names the
// argument, the position and the value.
void check_device_arguments(const at::Tensor& len, bool check_lengths, const std::optional<at::Tensor>& tc,
                            const std::optional<at::Tensor>& md, const std::optional<at::Tensor>& rg,
                            const std::optional<at::Tensor>& kv, int64_t B, int64_t H, int64_t L, int64_t Hkv,
                            cudaStream_t stream) {
  const bool need_len = check_lengths && !checked_before(kLengths, len, std::nullopt, L);
  const bool need_tc = tc.has_value() && !checked_before(kTokenClass, *tc, len, L);
  const bool need_md = md.has_value() && !checked_before(kMode, *md, std::nullopt, H);
  const bool need_rg = rg.has_value() && !checked_before(kRegion, *rg, std::nullopt, H);
  // kv_head's extent records Hkv too: the same tensor is checked again against another number of KV heads
  const bool need_kv = kv.has_value() && !checked_before(kKvHead, *kv, std::nullopt, H * 65536 + Hkv);
  if (!(need_len || need_tc || need_md || need_rg || need_kv)) return;
  at::Tensor report = at::empty({int64_t(sizeof(ArgReport) / sizeof(long long))}, len.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(report.data_ptr(), 0xff, sizeof(ArgReport), stream));
  ArgCheckParams p{};
  p.lengths = len.data_ptr<int64_t>();
  p.mode = need_md ? md->data_ptr<int32_t>() : nullptr;
  p.region = need_rg ? rg->data_ptr<int32_t>() : nullptr;
  p.token_class = need_tc ? tc->data_ptr<int32_t>() : nullptr;
  p.kv_head = need_kv ? kv->data_ptr<int32_t>() : nullptr;
  p.check_lengths = need_len;
  p.B = int(B), p.H = int(H), p.L = int(L), p.Hkv = int(Hkv);
  p.report = reinterpret_cast<ArgReport*>(report.data_ptr());
  run_check_arguments(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ArgReport r{};
  C10_CUDA_CHECK(cudaMemcpyAsync(&r, report.data_ptr(), sizeof(ArgReport), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  ATTNKIT_CHECK(r.len_index < 0, kOp, "lengths must lie in [1, L] = [1, ", L, "], got lengths[", r.len_index, "] = ",
              r.len_value);
  ATTNKIT_CHECK(r.mode_index < 0, kOp, "mode codes must be 0, 1 or 2, got ", r.mode_value, " at head ", r.mode_index);
  ATTNKIT_CHECK(r.region_index < 0, kOp, "region codes must be 0, 1 or 2, got ", r.region_value, " at head ",
              r.region_index);
  ATTNKIT_CHECK(r.class_index < 0, kOp, "token_class codes must be 0..4, got ", r.class_value, " at [",
              r.class_index / L, ", ", r.class_index % L, "]");
  ATTNKIT_CHECK(r.kv_index < 0, kOp, "kv_head must lie in [0, Hkv) = [0, ", Hkv, "), got ", r.kv_value, " at head ",
                r.kv_index);
  if (need_len) remember_checked(kLengths, len, std::nullopt, L);
  if (need_tc) remember_checked(kTokenClass, *tc, len, L);
  if (need_md) remember_checked(kMode, *md, std::nullopt, H);
  if (need_rg) remember_checked(kRegion, *rg, std::nullopt, H);
  if (need_kv) remember_checked(kKvHead, *kv, std::nullopt, H * 65536 + Hkv);
}

// Lengths that arrive on the CPU: checked here, then copied (not while a graph is captured).
void check_host_lengths(const at::Tensor& lengths, int64_t L) {
  const at::Tensor l = lengths.to(at::kLong).contiguous();
  const int64_t* p = l.data_ptr<int64_t>();
  for (int64_t b = 0; b < l.numel(); ++b)
    ATTNKIT_CHECK(p[b] >= 1 && p[b] <= L, kOp, "lengths must lie in [1, L] = [1, ", L, "], got lengths[", b, "] = ",
                p[b]);
}

int compute_capability_major(int device) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

// The kernel that runs a call: ATTNKIT_CUDA_KERNEL=v1|v2|triton (read at every call, so benchmarks can switch).
// Default v1, the kernel that has passed every CUDA test and the sanitizer on a GPU. v2, the single-pass
// tensor-core kernel, passed every numerical CUDA test on an H100 and is faster with features, but the
// sanitizer has not yet run on its present code and the host-side message tests were not all green on that
// machine: it becomes the default once the GPU check is green for it (docs/cuda.md). v2 covers fp16/bf16
// with at most kMaxWindowsV2 windows; other calls (fp32, more windows) run on v1. `triton` is the Triton kernel,
// which attnkit.ops.attention calls for fp16/bf16 (attnkit::fused_attention_triton); a call that reaches this
// op with it (fp32, or the op called directly) runs on v1.
enum class KernelChoice { kV1, kV2 };

KernelChoice requested_kernel() {
  const char* env = std::getenv("ATTNKIT_CUDA_KERNEL");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "v1") == 0 || std::strcmp(env, "triton") == 0)
    return KernelChoice::kV1;
  if (std::strcmp(env, "v2") == 0) return KernelChoice::kV2;
  ATTNKIT_CHECK(false, kOp, "ATTNKIT_CUDA_KERNEL must be 'v1', 'v2' or 'triton', got '", env, "'");
  return KernelChoice::kV1;
}

// Shared memory of one launch above the default 48 KB needs the device's opt-in limit; refuse clearly
// when the GPU has less. ATTNKIT_CUDA_SMEM_LIMIT (bytes) lowers the limit, to test this on large GPUs.
void check_shared_memory(int need, int device, int head_dim, bool features, const char* dtype_name,
                         const char* kernel) {
  if (need <= 48 * 1024) return;
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (const char* env = std::getenv("ATTNKIT_CUDA_SMEM_LIMIT")) optin = std::min(optin, std::atoi(env));
  if (need <= optin) return;
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  ATTNKIT_CHECK(false, kOp, "the ", dtype_name, " kernel ", kernel, " for head dim ", head_dim,
              features ? " with features" : "", " needs ", need, " bytes of shared memory per block, but ",
              prop.name, " (cuda:", device, ") allows at most ", optin,
              " (opt-in limit); use float16 or bfloat16, fewer windows, or a smaller head dim");
}

template <typename T, int kHeadDim>
void launch(const FusedParams& params, cudaStream_t stream, int device, const char* dtype_name, bool use_v2) {
  const bool features = params.features != nullptr;
  if constexpr (!std::is_same_v<T, float>) {
    if (use_v2) {
      check_shared_memory(fused_attention_v2_smem_bytes<T, kHeadDim>(features, params.num_windows), device,
                          kHeadDim, features, dtype_name, "v2");
      run_fused_attention_v2<T, kHeadDim>(params, stream);
      return;
    }
  }
  check_shared_memory(FusedTraits<T, kHeadDim>::smem_bytes(features ? params.num_features : 0), device, kHeadDim,
                      features, dtype_name, "v1");
  run_fused_attention_v1<T, kHeadDim>(params, stream);
}

template <typename T>
void dispatch_head_dim(int head_dim, const FusedParams& params, cudaStream_t stream, int device,
                       const char* dtype_name, bool use_v2) {
  switch (head_dim) {
    case 32:
      launch<T, 32>(params, stream, device, dtype_name, use_v2);
      break;
    case 64:
      launch<T, 64>(params, stream, device, dtype_name, use_v2);
      break;
    case 128:
      launch<T, 128>(params, stream, device, dtype_name, use_v2);
      break;
    default:
      ATTNKIT_CHECK(false, kOp, "head dim ", head_dim, " is not supported (32, 64 or 128)");
  }
}

std::tuple<at::Tensor, at::Tensor> fused_attention_cuda(const FusedAttentionArgs& a) {
  ATTNKIT_CHECK(a.q.is_cuda(), kOp, "q must be a CUDA tensor, got ", a.q.device());
  ATTNKIT_CHECK(a.q.dim() == 4, kOp, "q must be B×H×L×D, got shape ", a.q.sizes());
  ATTNKIT_CHECK(a.k.dim() == 4 && a.k.size(0) == a.q.size(0) && a.k.size(2) == a.q.size(2) && a.k.size(3) == a.q.size(3) &&
                    a.k.size(1) >= 1,
                kOp, "k must have q's shape ", a.q.sizes(), " (or B×Hkv×L×D), got ", a.k.sizes());
  ATTNKIT_CHECK(a.v.sizes() == a.k.sizes(), kOp, "v must have k's shape ", a.k.sizes(), ", got ", a.v.sizes());
  ATTNKIT_CHECK(!a.key_lengths.has_value() && !a.key_class.has_value() && !a.bias.has_value(), kOp,
                "the CUDA kernels take neither cross-attention (key_lengths, key_class) nor a bias: "
                "attnkit.ops.attention runs those on the reference (docs/cuda.md)");
  const int64_t Hkv = a.k.size(1);
  ATTNKIT_CHECK(a.kv_head.has_value() || (Hkv <= a.q.size(1) && a.q.size(1) % Hkv == 0), kOp, "k and v have ", Hkv,
                " heads and q ", a.q.size(1), ": give kv_head (the KV head of each query head) unless ", Hkv,
                " divides ", a.q.size(1));
  ATTNKIT_CHECK(!a.sliding_window.has_value() || *a.sliding_window >= 1, kOp,
                "sliding_window must be an integer >= 1, got ", a.sliding_window.value_or(0));
  // no CUDA kernel has been tested with a bidirectional window: attnkit.ops.attention runs it on the reference
  ATTNKIT_CHECK(!a.symmetric_window, kOp, "the CUDA kernels do not take symmetric_window (a bidirectional sliding "
                "window); attnkit.ops.attention runs such calls on the reference");
  // nor with the alignment features (docs/features.md, "Alignment"): attnkit.ops.attention runs those on the reference
  ATTNKIT_CHECK(!(a.alignment && a.want_features), kOp, "the CUDA kernels do not measure the alignment features "
                "(alignment); attnkit.ops.attention runs such calls on the reference");
  ATTNKIT_CHECK(!a.softcap.has_value() || (std::isfinite(*a.softcap) && *a.softcap > 0), kOp,
                "softcap must be a finite number > 0, got ", a.softcap.value_or(0.0));
  const at::Device device = a.q.device();
  ATTNKIT_CHECK(a.k.device() == device, kOp, "k must be on ", device, " like q, got ", a.k.device());
  ATTNKIT_CHECK(a.v.device() == device, kOp, "v must be on ", device, " like q, got ", a.v.device());
  const auto dtype = a.q.scalar_type();
  ATTNKIT_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, kOp,
              "q must be float32, float16 or bfloat16, got ", dtype);
  ATTNKIT_CHECK(a.k.scalar_type() == dtype, kOp, "k must have q's dtype ", dtype, ", got ", a.k.scalar_type());
  ATTNKIT_CHECK(a.v.scalar_type() == dtype, kOp, "v must have q's dtype ", dtype, ", got ", a.v.scalar_type());
  const int64_t B = a.q.size(0), H = a.q.size(1), L = a.q.size(2), D = a.q.size(3);
  ATTNKIT_CHECK(D == 32 || D == 64 || D == 128, kOp, "head dim (q.size(3)) must be 32, 64 or 128, got ", D);
  ATTNKIT_CHECK(L <= (int64_t(1) << 20), kOp, "sequence length ", L, " is too long");
  ATTNKIT_CHECK(B <= 65535 && H <= 65535, kOp, "batch (", B, ") and heads (", H, ") must be at most 65535");
  ATTNKIT_CHECK(a.lengths.dim() == 1 && a.lengths.size(0) == B, kOp, "lengths must have shape [", B, "], got ",
              a.lengths.sizes());
  ATTNKIT_CHECK(!at::isFloatingType(a.lengths.scalar_type()) && a.lengths.scalar_type() != at::kBool, kOp,
              "lengths must be an integer tensor, got ", a.lengths.scalar_type());
  ATTNKIT_CHECK(a.num_windows >= 1, kOp, "num_windows must be >= 1, got ", a.num_windows);
  ATTNKIT_CHECK(std::isfinite(a.scaling), kOp, "scaling must be a finite number, got ", a.scaling);
  ATTNKIT_CHECK(!a.want_features || a.num_windows <= kMaxNumWindows, kOp, "num_windows must be at most ",
              kMaxNumWindows, " on CUDA, got ", a.num_windows);
  ATTNKIT_CHECK(!a.want_features || (L - 1) * a.num_windows < (int64_t(1) << 31), kOp,
              "num_windows × L is too large for the window arithmetic");

  c10::cuda::CUDAGuard guard(device);
  if (dtype != at::kFloat) {
    ATTNKIT_CHECK(compute_capability_major(device.index()) >= 8, kOp,
                "float16/bfloat16 need a GPU of compute capability 8.0 or newer (tensor-core path)");
  }
  const int64_t F = kNumFeatures(int(a.num_windows)) + (a.sink.has_value() ? 1 : 0);  // `sink` last
  at::Tensor out = at::empty({B, L, H, D}, a.q.options());
  at::Tensor features = a.want_features ? at::zeros({B, H, F}, a.q.options().dtype(at::kFloat))
                                      : at::empty({B, H, 0}, a.q.options().dtype(at::kFloat));
  if (B == 0 || H == 0 || L == 0) return {out, features};

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const bool capturing = is_capturing(stream);
  const at::Tensor qk = kernel_operand(a.q), kk = kernel_operand(a.k), vk = kernel_operand(a.v);
  // lengths may arrive on the CPU (a small host tensor): checked there and copied, which a CUDA graph
  // cannot capture. The kernel reads them on the device.
  const bool host_lengths = a.lengths.is_cpu();
  if (host_lengths) {
    ATTNKIT_CHECK(!capturing, kOp, "lengths are on the CPU while a CUDA graph is being captured; pass them on ",
                device, " (a host-to-device copy cannot be captured)");
    check_host_lengths(a.lengths, L);
  } else {
    ATTNKIT_CHECK(a.lengths.device() == device, kOp, "lengths must be on ", device, " like q (or on the CPU), got ",
                a.lengths.device());
  }
  const at::Tensor len = a.lengths.to(device, at::kLong).contiguous();
  const auto tc = side_input(a.token_class, "token_class", at::kInt, {B, L}, device);
  const auto sid = side_input(a.sentence_id, "sentence_id", at::kInt, {B, L}, device);
  const auto md = side_input(a.mode, "mode", at::kInt, {H}, device);
  const auto rg = side_input(a.region, "region", at::kInt, {H}, device);
  const auto gt = side_input(a.gates, "gates", at::kFloat, {H}, device);
  const auto sk = side_input(a.sink, "sink", at::kFloat, {H}, device);
  // the KV head of each query head: given, or even groups h / (H / Hkv) (none when Hkv == H)
  std::optional<at::Tensor> kv = side_input(a.kv_head, "kv_head", at::kInt, {H}, device);
  if (!kv.has_value() && Hkv != H) {
    ATTNKIT_CHECK(!capturing, kOp, "k and v have ", Hkv, " heads while a CUDA graph is being captured: pass kv_head");
    at::Tensor groups = at::empty({H}, at::TensorOptions().dtype(at::kInt));
    for (int64_t i = 0; i < H; ++i) groups.data_ptr<int32_t>()[i] = static_cast<int32_t>(i / (H / Hkv));
    kv = groups.to(device);
  }
  // the key scale only changes features: without them it is not read
  const auto ks = a.want_features ? side_input(a.key_scale, "key_scale", at::kFloat, {B, H, L}, device)
                                : std::optional<at::Tensor>();
  if (!capturing) {
    check_device_arguments(len, !host_lengths, a.want_features ? tc : std::optional<at::Tensor>(), md, rg, kv, B, H, L,
                           Hkv, stream);
  }

  FusedParams p{};
  p.q = qk.data_ptr();
  p.k = kk.data_ptr();
  p.v = vk.data_ptr();
  p.q_stride_b = qk.stride(0), p.q_stride_h = qk.stride(1), p.q_stride_l = qk.stride(2);
  p.k_stride_b = kk.stride(0), p.k_stride_h = kk.stride(1), p.k_stride_l = kk.stride(2);
  p.v_stride_b = vk.stride(0), p.v_stride_h = vk.stride(1), p.v_stride_l = vk.stride(2);
  p.out = out.data_ptr();
  p.lengths = len.data_ptr<int64_t>();
  p.token_class = ptr_or_null<int32_t>(tc);
  p.sentence_id = ptr_or_null<int32_t>(sid);
  p.mode = ptr_or_null<int32_t>(md);
  p.region = ptr_or_null<int32_t>(rg);
  p.gates = ptr_or_null<float>(gt);
  p.key_scale = ptr_or_null<float>(ks);
  p.features = a.want_features ? features.data_ptr<float>() : nullptr;
  p.B = int(B), p.H = int(H), p.L = int(L);
  p.num_windows = int(a.num_windows);
  p.num_features = a.want_features ? int(F) : 0;
  p.scaling = float(a.scaling);
  p.renormalize = a.renormalize;
  p.kv_head = ptr_or_null<int32_t>(kv);
  p.Hkv = int(Hkv);
  p.sink = ptr_or_null<float>(sk);
  p.causal = a.causal;
  p.window = int(std::min<int64_t>(a.sliding_window.value_or(0), L));  // a window of L or more limits nothing
  p.softcap = a.softcap.has_value() ? float(*a.softcap) : 0.f;

  // The decoder arguments run on v1 (docs/cuda.md); v2, asked for by name, refuses them by name.
  std::string decoder;
  for (const auto& [given, name] : {std::pair{a.kv_head.has_value() || Hkv != H, "kv_head"}, {a.causal, "causal"},
                                    {a.sliding_window.has_value(), "sliding_window"}, {a.softcap.has_value(), "softcap"},
                                    {a.sink.has_value(), "sink"}}) {
    if (given) decoder += (decoder.empty() ? "" : ", ") + std::string(name);
  }
  const KernelChoice choice = requested_kernel();
  ATTNKIT_CHECK(decoder.empty() || choice != KernelChoice::kV2 || dtype == at::kFloat, kOp,
                "the v2 kernel (ATTNKIT_CUDA_KERNEL=v2) does not take ", decoder, ": use v1 (unset ATTNKIT_CUDA_KERNEL)");
  const bool use_v2 = choice == KernelChoice::kV2 && dtype != at::kFloat && decoder.empty() &&
                      (!a.want_features || a.num_windows <= kMaxWindowsV2);
  switch (dtype) {
    case at::kFloat:
      dispatch_head_dim<float>(int(D), p, stream, device.index(), "float32", false);
      break;
    case at::kHalf:
      dispatch_head_dim<__half>(int(D), p, stream, device.index(), "float16", use_v2);
      break;
    default:
      dispatch_head_dim<__nv_bfloat16>(int(D), p, stream, device.index(), "bfloat16", use_v2);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (a.want_features) {
    run_finalize_features(p, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {out, features};
}

// The op's kernel, boxed: its arguments come off the dispatcher's stack into one FusedAttentionArgs
// (csrc/attention_args.h), and its outputs go back on it.
void fused_attention_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto [out, features] = fused_attention_cuda(pop_fused_attention_args(op, stack));
  torch::jit::push(*stack, std::move(out), std::move(features));
}

at::Tensor js_distances_cuda(const at::Tensor& attn, const at::Tensor& lengths) {
  ATTNKIT_CHECK(attn.is_cuda(), kJsOp, "attn must be a CUDA tensor, got ", attn.device());
  ATTNKIT_CHECK(attn.dim() == 4 && attn.size(2) == attn.size(3), kJsOp, "attn must be B×M×L×L, got shape ",
              attn.sizes());
  ATTNKIT_CHECK(attn.scalar_type() == at::kFloat, kJsOp, "attn must be float32, got ", attn.scalar_type());
  const int64_t B = attn.size(0), M = attn.size(1), L = attn.size(2);
  ATTNKIT_CHECK(lengths.dim() == 1 && lengths.size(0) == B, kJsOp, "lengths must have shape [", B, "], got ",
              lengths.sizes());
  ATTNKIT_CHECK(!at::isFloatingType(lengths.scalar_type()) && lengths.scalar_type() != at::kBool, kJsOp,
              "lengths must be an integer tensor, got ", lengths.scalar_type());
  ATTNKIT_CHECK(B <= 65535, kJsOp, "batch (", B, ") must be at most 65535");
  c10::cuda::CUDAGuard guard(attn.device());
  at::Tensor out = at::zeros({M, M}, attn.options().dtype(at::kDouble));
  if (B == 0 || M == 0 || L == 0) return out;
  const at::Tensor a = attn.contiguous();
  const at::Tensor len = lengths.to(attn.device(), at::kLong).contiguous();
  JsParams p{};
  p.attn = a.data_ptr<float>();
  p.lengths = len.data_ptr<int64_t>();
  p.out = out.data_ptr<double>();
  p.B = int(B), p.M = int(M), p.L = int(L);
  run_js_distances(p, c10::cuda::getCurrentCUDAStream(attn.device().index()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

constexpr const char* kWordOp = "attnkit.word_attention (CUDA): ";

std::tuple<at::Tensor, at::Tensor, at::Tensor> word_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                   const at::Tensor& lengths_in,
                                                                   const at::Tensor& word_id_in, int64_t num_words,
                                                                   double scaling) {
  ATTNKIT_CHECK(q_in.dim() == 4, kWordOp, "q must be 4-D (B, H, L, D), got shape ", q_in.sizes());
  ATTNKIT_CHECK(k_in.sizes() == q_in.sizes(), kWordOp, "k must have q's shape ", q_in.sizes(), ", got ", k_in.sizes());
  const auto dt = q_in.scalar_type();
  ATTNKIT_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, kWordOp,
              "q must be float32, bfloat16 or float16, got ", dt);
  ATTNKIT_CHECK(k_in.scalar_type() == dt, kWordOp, "k must have q's dtype ", dt, ", got ", k_in.scalar_type());
  const auto device = q_in.device();
  ATTNKIT_CHECK(device.is_cuda() && k_in.device() == device && lengths_in.device() == device &&
                  word_id_in.device() == device,
              kWordOp, "q, k, lengths and word_id must be on the same CUDA device");
  const int64_t B = q_in.size(0), H = q_in.size(1), L = q_in.size(2), D = q_in.size(3);
  ATTNKIT_CHECK(num_words >= 0, kWordOp, "num_words must be >= 0, got ", num_words);
  ATTNKIT_CHECK(lengths_in.scalar_type() == at::kLong && lengths_in.dim() == 1 && lengths_in.size(0) == B, kWordOp,
              "lengths must be int64 of shape [B] = [", B, "], got ", lengths_in.scalar_type(), " of shape ",
              lengths_in.sizes());
  ATTNKIT_CHECK(word_id_in.scalar_type() == at::kInt && word_id_in.dim() == 2 && word_id_in.size(0) == B &&
                  word_id_in.size(1) == L,
              kWordOp, "word_id must be int32 of shape [B, L], got ", word_id_in.scalar_type(), " of shape ",
              word_id_in.sizes());
  const int64_t W = num_words;
  const int64_t shared = word_attention_shared_bytes(D, L, W);
  ATTNKIT_CHECK(shared <= kWordAttentionMaxShared, kWordOp, "D + L + 2·num_words = ", D + L + 2 * W,
              " floats exceed the kernel's 48 KiB of shared memory per row");
  c10::cuda::CUDAGuard guard(device);
  const auto q = q_in.contiguous();
  const auto k = k_in.contiguous();
  const auto lengths = lengths_in.contiguous();
  const auto word_id = word_id_in.contiguous();
  auto words = at::zeros({B, H, W, W}, q.options().dtype(at::kFloat));
  auto row_word = at::full({B, H, L}, -1, q.options().dtype(at::kLong));
  auto row_weight = at::zeros({B, H, L}, q.options().dtype(at::kFloat));
  if (B == 0 || H == 0 || L == 0) return {words, row_word, row_weight};
  ATTNKIT_CHECK(H <= 65535 && B <= 65535, kWordOp, "at most 65535 heads and samples per call, got H = ", H, ", B = ", B);
  WordAttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.lengths = lengths.data_ptr<int64_t>();
  p.word_id = word_id.data_ptr<int32_t>();
  p.words = words.data_ptr<float>();
  p.row_word = row_word.data_ptr<int64_t>();
  p.row_weight = row_weight.data_ptr<float>();
  p.B = int(B), p.H = int(H), p.L = int(L), p.D = int(D), p.W = int(W);
  p.scaling = float(scaling);
  p.dtype = dt == at::kFloat ? WordAttentionParams::kFloat32
            : dt == at::kHalf ? WordAttentionParams::kFloat16 : WordAttentionParams::kBFloat16;
  run_word_attention(p, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {words, row_word, row_weight};
}

}  // namespace
}  // namespace cuda
}  // namespace attnkit

TORCH_LIBRARY_IMPL(attnkit, CUDA, m) {
  m.impl("fused_attention", torch::CppFunction::makeFromBoxedFunction<&attnkit::cuda::fused_attention_boxed>());
  m.impl("js_distances", TORCH_FN(attnkit::cuda::js_distances_cuda));
  m.impl("word_attention", TORCH_FN(attnkit::cuda::word_attention_cuda));
}
