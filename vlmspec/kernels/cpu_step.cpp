// Every decoder layer of a packed decode/verify step in one call (vlmspec/targets/packed.py).
//
// PackedDecoder's Python loop makes about twelve operator calls per decoder layer, each a trip
// through the interpreter and torch's dispatcher: on the 2-core AVX-512 EPYC about a third of a
// bfloat16 step of the reference target (issue #32). This loop makes the same calls to the same
// kernels in the same order, as C++ function calls, so it computes bit for bit what the Python
// loop computes; the residual adds stay ATen's for the same reason, and SiLU(gate) * up is
// silu_mul (below), which the Python loop calls too. It covers the case the Python loop runs with
// one kernel call per step: no q/k norms, the kernel's RMSNorm, every linear on vlmspec's kernel,
// SiLU, the fused RoPE + KV write and decode_attention. PackedDecoder checks that once, when it packs.

#include "cpu_common.h"

namespace vlmspec_cpu {
namespace {

// One layer's tensors in the flat weight list, in this order (PackedDecoder flattens them so):
// a 4-D linear weight was packed by pack_weight (the "packed" backend), a 2-D one is read as
// stored (the "kernel" backend); biases are optional.
enum WeightSlot : int64_t {
  kInputNorm, kQkv, kQkvBias, kOut, kOutBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kWeightsPerLayer
};
// Output features of the four linears (a packed weight is padded, so its shape does not say).
enum LinearSlot : int64_t { kQkvOut, kOutOut, kGateUpOut, kDownOut, kLinearsPerLayer };

// What every layer of one step shares.
struct StepInputs {
  at::Tensor cos, signed_sin;  // [B, hd] in the model's dtype
  at::Tensor rows, slots;      // [B] int64: each packed token's buffer row and slot
  at::Tensor visible;          // [B] int64: slots + 1, a token sees its row up to its own slot
  int64_t heads;
  double eps, scaling;
};

// One layer's view into the flat lists.
struct LayerWeights {
  const c10::List<std::optional<at::Tensor>>& all;
  int64_t first;  // index of this layer's kInputNorm
  const int64_t* out_features;

  at::Tensor get(WeightSlot slot) const { return all.get(first + slot).value(); }
  std::optional<at::Tensor> bias(WeightSlot slot) const { return all.get(first + slot); }
};

// x @ W.T + b on the backend PackedLinear chose for W (same kernel, same arguments as its __call__).
at::Tensor linear(const at::Tensor& x, const LayerWeights& layer, WeightSlot weight, LinearSlot out) {
  const at::Tensor w = layer.get(weight);
  const std::optional<at::Tensor> bias = layer.bias(static_cast<WeightSlot>(weight + 1));  // right after its weight
  return w.dim() == 4 ? packed_linear_op(x, w, layer.out_features[out], bias) : skinny_linear(x, w, bias);
}

// ---- SiLU(gate) * up in one call --------------------------------------------------------
// ATen's silu and mul are two dispatches and two passes over [B, I] (about 12 us a layer for one
// token in bfloat16, 24 for eight). Here each value is silu(g) = g * sigmoid(g) in float32, with
// sigmoid from exp8(-|g|) (exact to a few ulp of float32: the rounding to bfloat16 hides that),
// rounded to the model's dtype, times u, rounded again: the roundings of act(gate) * up.

template <typename T>
inline void silu_mul_8(const T* gate, const T* up, T* out) {
  const __m256 g = load8(gate);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));  // exp(-|g|)
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 positive = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
  const __m256 activated = round_as(gate, _mm256_mul_ps(g, sigmoid));
  store8(out, round_as(gate, _mm256_mul_ps(activated, load8(up))));
}

// Blocks of 8 values, split between the threads (a verify's 8 rows of 4,608 values is too little
// for whole rows a thread: the threads' wake-up would cost more than it saves).
template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t inner, T* out) {
  const int64_t blocks = (inner + 7) / 8;
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t r = index / blocks, j = (index % blocks) * 8;
      const T* gate = gate_up + r * 2 * inner + j;
      const T* up = gate + inner;
      T* row_out = out + r * inner + j;
      if (j + 8 <= inner) {
        silu_mul_8(gate, up, row_out);
      } else {  // the tail through the same 8 lanes, so every value takes the same arithmetic
        T g[8] = {}, u[8] = {}, o[8];
        std::copy(gate, gate + (inner - j), g);
        std::copy(up, up + (inner - j), u);
        silu_mul_8(g, u, o);
        std::copy(o, o + (inner - j), row_out);
      }
    }
  });
}

}  // namespace

// gate_up [B, 2I] (gate, then up, as chunk(2, dim=-1) splits it) -> [B, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [B, 2I] expected, got ",
              gate_up.sizes());
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inner}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_mul_rows(x.data_ptr<float>(), rows, inner, out.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16, got ", x.scalar_type());
    silu_mul_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, inner,
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
  return out;
}

namespace {

// Attention block: norm, q/k/v, RoPE + KV write, attention, output projection, residual.
at::Tensor attention_block(const at::Tensor& hidden, const LayerWeights& layer, at::Tensor keys, at::Tensor values,
                           const StepInputs& step) {
  const at::Tensor x = rms_norm(hidden, layer.get(kInputNorm), step.eps);
  const at::Tensor qkv = linear(x, layer, kQkv, kQkvOut);  // [B, (H + 2 Hkv) hd]
  const at::Tensor q = rope_write(qkv, step.cos, step.signed_sin, keys, values, step.rows, step.slots, step.heads);
  const at::Tensor attended = decode_attention(q, keys, values, step.rows, step.visible, step.scaling);
  return at::add(hidden, linear(attended.reshape({hidden.size(0), -1}), layer, kOut, kOutOut));
}

// MLP block: norm, gate/up, silu_mul, down projection, residual.
at::Tensor mlp_block(const at::Tensor& hidden, const LayerWeights& layer, const StepInputs& step) {
  const at::Tensor gate_up = linear(rms_norm(hidden, layer.get(kPostNorm), step.eps), layer, kGateUp, kGateUpOut);
  return at::add(hidden, linear(silu_mul(gate_up), layer, kDown, kDownOut));
}

void check_inputs(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& weights,
                  at::IntArrayRef out_features, at::TensorList keys, at::TensorList values,
                  at::IntArrayRef feature_layers) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(hidden.dim() == 2, "decoder_layers: hidden [B, d] expected, got ", hidden.sizes());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(out_features.size()) == layers * kLinearsPerLayer,
              "decoder_layers: per layer ", kWeightsPerLayer, " weights, ", kLinearsPerLayer,
              " output sizes and one key and value buffer expected (build them with PackedDecoder); got ",
              weights.size(), " weights, ", out_features.size(), " sizes, ", keys.size(), " and ", values.size(),
              " buffers");
  for (int64_t layer = 0; layer < layers; ++layer)
    for (WeightSlot slot : {kInputNorm, kQkv, kOut, kPostNorm, kGateUp, kDown})
      TORCH_CHECK(weights.get(layer * kWeightsPerLayer + slot).has_value(), "decoder_layers: layer ", layer,
                  " lacks its weight ", static_cast<int64_t>(slot));
  for (int64_t index : feature_layers)
    TORCH_CHECK(index >= 0 && index < layers, "decoder_layers: feature layer ", index, " is not one of the ",
                layers, " layers");
}

// hidden [B, d] after the embedding; returns [hidden after the last layer, then the hidden
// states after each of feature_layers, in that order].
std::vector<at::Tensor> decoder_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& signed_sin,
                                       const c10::List<std::optional<at::Tensor>>& weights,
                                       at::IntArrayRef out_features, at::TensorList keys, at::TensorList values,
                                       const at::Tensor& rows, const at::Tensor& slots, int64_t heads, double eps,
                                       double scaling, at::IntArrayRef feature_layers) {
  check_inputs(hidden, weights, out_features, keys, values, feature_layers);
  // Below autograd: the loop is inference only, and each inner call then skips that dispatch step.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor slot_index = slots.to(at::kLong).contiguous();
  const StepInputs step{cos.contiguous(), signed_sin.contiguous(), rows.to(at::kLong).contiguous(), slot_index,
                        slot_index + 1, heads, eps, scaling};
  std::vector<at::Tensor> out(1 + feature_layers.size());
  at::Tensor state = hidden.contiguous();
  for (int64_t index = 0; index < static_cast<int64_t>(keys.size()); ++index) {
    const LayerWeights layer{weights, index * kWeightsPerLayer, out_features.data() + index * kLinearsPerLayer};
    state = mlp_block(attention_block(state, layer, keys[index], values[index], step), layer, step);
    for (size_t j = 0; j < feature_layers.size(); ++j)
      if (feature_layers[j] == index) out[1 + j] = state;  // each layer's state is a new tensor: never overwritten
  }
  out[0] = state;
  return out;
}

}  // namespace
}  // namespace vlmspec_cpu

TORCH_LIBRARY_FRAGMENT(vlmspec, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "decoder_layers(Tensor hidden, Tensor cos, Tensor signed_sin, Tensor?[] weights, int[] out_features, "
      "Tensor(a!)[] keys, Tensor(b!)[] values, Tensor rows, Tensor slots, int heads, float eps, float scaling, "
      "int[] feature_layers) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) {
  m.impl("silu_mul", vlmspec_cpu::silu_mul);
  m.impl("decoder_layers", vlmspec_cpu::decoder_layers);
}
