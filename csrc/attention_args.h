// The arguments of attnkit::fused_attention and attnkit::fused_attention_lse in one struct, filled in one place
// (pop_fused_attention_args) from the schema's arguments (csrc/ops.cpp, the one list; attnkit/reference.py's
// AttentionParams is its Python side), as FlashAttention fills Flash_fwd_params once in set_params_fprop. The
// kernels of the op (csrc/cpu/fused_attention.cpp, the CUDA host API csrc/cuda/cuda_api.cpp) are boxed: they take
// the dispatcher's stack and read their arguments from here, so no kernel writes the argument list again.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace attnkit {

struct FusedAttentionArgs {
  at::Tensor q, k, v, lengths;
  std::optional<at::Tensor> token_class, sentence_id;
  double scaling = 0.0;
  int64_t num_windows = 0;
  std::optional<at::Tensor> mode, region;
  bool renormalize = false;
  std::optional<at::Tensor> gates;
  bool want_features = false;
  std::optional<at::Tensor> key_scale, kv_head;  // the decoder arguments from here on (defaults: none)
  bool causal = false;
  std::optional<int64_t> sliding_window;
  std::optional<double> softcap;
  std::optional<at::Tensor> sink;
  // cross-attention (attnkit::fused_attention only; defaults: none): the keys' lengths and token classes; the bias
  std::optional<at::Tensor> key_lengths, key_class, bias;
  bool symmetric_window = false;  // the window also limits the keys after each row: |s − t| < W (bidirectional)
  std::optional<at::Tensor> grid;  // int32 B×L×2: each token's (row, col) on an image's patch grid, −1 off it
  bool want_max_logit = false;  // attnkit::fused_attention_lse only
  bool alignment = false;  // with want_features: the alignment features align_offset, align_near last
};

// Pops a boxed call's arguments off the stack, each by its name in the op's schema (an argument the schema does not
// have keeps the struct's default).
inline FusedAttentionArgs pop_fused_attention_args(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  auto slot = [&](const char* name) -> const c10::IValue* {
    const std::optional<int> i = schema.argumentIndexWithName(name);
    return i.has_value() ? &(*stack)[first + static_cast<size_t>(*i)] : nullptr;
  };
  auto read = [&](const char* name, auto& field) {
    using T = std::decay_t<decltype(field)>;
    if (const c10::IValue* value = slot(name)) field = value->to<T>();
  };
  FusedAttentionArgs a;
  read("q", a.q), read("k", a.k), read("v", a.v), read("lengths", a.lengths);
  read("token_class", a.token_class), read("sentence_id", a.sentence_id);
  read("scaling", a.scaling), read("num_windows", a.num_windows);
  read("mode", a.mode), read("region", a.region), read("renormalize", a.renormalize), read("gates", a.gates);
  read("want_features", a.want_features), read("key_scale", a.key_scale), read("kv_head", a.kv_head);
  read("causal", a.causal), read("sliding_window", a.sliding_window), read("softcap", a.softcap);
  read("sink", a.sink), read("symmetric_window", a.symmetric_window), read("want_max_logit", a.want_max_logit);
  read("key_lengths", a.key_lengths), read("key_class", a.key_class), read("bias", a.bias);
  read("grid", a.grid), read("alignment", a.alignment);
  torch::jit::drop(*stack, n);
  return a;
}

}  // namespace attnkit
