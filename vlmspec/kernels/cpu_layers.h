// The named weight layout of vlmspec's native layers: a packed linear with its bias and output size,
// and the target decoder's per-layer weights, built once when a PackedDecoder packs (cpu_step.cpp
// registers DecoderWeights as the torch class vlmspec.DecoderWeights; packed.py fills it by name).
// The DSpark drafting round (cpu_draft.cpp) reads its linears through the same PackedLinearWeights;
// its layers run another sequence (q/k norms, a bidirectional block over an injected context, the
// PyTorch drafter's roundings), so they keep their own.
#pragma once

#include <torch/custom_class.h>

#include "cpu_common.h"

namespace vlmspec_cpu {

// One linear over a weight pack_weight made (cpu_linear.cpp's layout), its optional bias and its
// output size (a packed weight is padded, so its shape does not say).
struct PackedLinearWeights {
  at::Tensor packed;
  std::optional<at::Tensor> bias;
  int64_t out = 0;

  int64_t in() const { return packed.size(1) * packed.size(3); }  // padded input width
  // y [rows, out] = x [rows, in()] @ W.T + b, both in the weight's dtype (raw pointers: the team calls it).
  void operator()(const void* x, int64_t rows, void* y) const {
    packed_linear_into(packed, out, bias ? &*bias : nullptr, x, rows, y);
  }
};

// A packed linear looked up by name in `tensors` (its bias under name + "_bias", if any), checked:
// a packed `dtype` weight of `out` outputs whose bias packed_linear_into can read. `what` names the
// caller in errors.
inline PackedLinearWeights named_linear(const c10::Dict<std::string, at::Tensor>& tensors, const std::string& name,
                                        const std::string& bias_name, int64_t out, at::ScalarType dtype,
                                        const char* what) {
  const auto found = tensors.find(name);
  TORCH_CHECK(found != tensors.end(), what, ": the weights lack '", name, "'");
  const auto bias = tensors.find(bias_name);
  PackedLinearWeights linear{found->value(), std::nullopt, out};
  if (bias != tensors.end()) linear.bias = bias->value();
  TORCH_CHECK(linear.packed.dim() == 4 && linear.packed.scalar_type() == dtype &&
                  linear.packed.size(0) * linear.packed.size(2) >= out,
              what, ": '", name, "' is not a packed ", dtype, " weight of ", out, " outputs (pack it with pack_weight)");
  TORCH_CHECK(!linear.bias || (packed_linear_bias_ready(linear.packed, *linear.bias) && linear.bias->numel() == out),
              what, ": '", bias_name, "' must be ", out, " contiguous values in the weight's dtype or float32");
  return linear;
}

// One target decoder layer: RMSNorm, q/k/v (fused), RoPE + KV write, attention, output projection,
// residual; RMSNorm, gate/up (fused), SiLU(gate) * up, down projection, residual.
struct DecoderLayerWeights {
  at::Tensor input_norm, post_norm;  // [d] each
  PackedLinearWeights qkv, out, gate_up, down;
};

// Every layer of a target decoder, and what its layers share. Built empty, then one add_layer per
// layer, by name: input_norm, qkv, qkv_bias, out, out_bias, post_norm, gate_up, gate_up_bias, down,
// down_bias (biases optional), with the output sizes of qkv, out, gate_up and down.
struct DecoderWeights : torch::CustomClassHolder {
  int64_t heads, head_dim;
  double eps, scaling;
  std::vector<DecoderLayerWeights> layers;

  DecoderWeights(int64_t heads_, int64_t head_dim_, double eps_, double scaling_)
      : heads(heads_), head_dim(head_dim_), eps(eps_), scaling(scaling_) {}

  void add_layer(const c10::Dict<std::string, at::Tensor>& tensors,
                 const c10::Dict<std::string, int64_t>& out_features);
  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  at::ScalarType dtype() const { return layers.at(0).input_norm.scalar_type(); }
};

}  // namespace vlmspec_cpu
