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
  at::Tensor tables;           // [R, M] int64: each row's blocks in the KV pool
  at::Tensor rows;             // [B] int64: each packed token's row
  at::Tensor blocks, offsets;  // [B] int64: the pool block its K/V go to, and the offset in it
  at::Tensor visible;          // [B] int64: its slot + 1, a token sees its row up to its own slot
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
  split_tasks(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
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
  const at::Tensor q = rope_write(qkv, step.cos, step.signed_sin, keys, values, step.blocks, step.offsets, step.heads);
  const at::Tensor attended = paged_attention(q, keys, values, step.tables, step.rows, step.visible, step.scaling);
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

// ---- every layer in one parallel region -----------------------------------------------------
// The loop below forks and joins the threads at each parallel call (about six a layer), and
// between calls one thread runs the serial pieces (allocations, ATen's adds, the calls' checks)
// while the other waits: about a third of a bfloat16 step on the 2-core EPYC (docs/design.md
// §21.1). The team step enters one parallel region for the whole step: both threads make the same
// calls as a team (split_tasks: each its share), with a barrier between calls, into buffers
// allocated once per step. The same kernels with the same arithmetic, so the results are the
// loop's bit for bit. It takes the case where every linear is packed (AVX-512) and its input
// width is the packed width; VLMSPEC_STEP_TEAM=0 keeps the fork-join loop (for comparison).

template <typename T>
void add_blocks(const T* a, const T* b, int64_t n, T* out) {  // out = a + b, rounded as ATen's add rounds
  split_tasks(0, (n + 7) / 8, 64, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t j = block * 8;
      if (j + 8 <= n) {
        store8(out + j, round_as(out, _mm256_add_ps(load8(a + j), load8(b + j))));
      } else {
        for (int64_t k = j; k < n; ++k) out[k] = from_float(out, to_float(a[k]) + to_float(b[k]));
      }
    }
  });
}

void add_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  if (a.scalar_type() == at::kFloat)
    add_blocks(a.data_ptr<float>(), b.data_ptr<float>(), a.numel(), out.data_ptr<float>());
  else
    add_blocks(reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()), a.numel(),
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
}

void silu_mul_into(const at::Tensor& gate_up, const at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), rows, inner, out.data_ptr<float>());
  else
    silu_mul_rows(reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()), rows, inner,
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
}

// One linear of the team step: its packed weight, bias and output size.
struct TeamLinear {
  at::Tensor packed;
  std::optional<at::Tensor> bias;
  int64_t out_features;

  void operator()(const at::Tensor& x, const at::Tensor& out) const {
    packed_linear_into(packed, out_features, bias ? &*bias : nullptr, x.data_ptr(), x.size(0), out.data_ptr());
  }
};
struct TeamLayer {
  at::Tensor input_norm, post_norm;
  TeamLinear qkv, out, gate_up, down;
};

// The layers as the team step runs them, or none where it does not apply (the fork-join loop runs).
std::vector<TeamLayer> team_layers(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& weights,
                                   at::IntArrayRef out_features, at::TensorList keys, at::TensorList values,
                                   int64_t heads) {
  const char* setting = std::getenv("VLMSPEC_STEP_TEAM");
  if (setting != nullptr && std::strcmp(setting, "0") == 0) return {};
  const at::ScalarType dtype = hidden.scalar_type();
  if (keys.empty() || hidden.size(0) == 0) return {};
  if (dtype == at::kBFloat16 ? !cpu_has_avx512_bf16() : (dtype != at::kFloat || !cpu_has_avx512())) return {};
  const int64_t d = hidden.size(1), hd = keys[0].size(3);
  std::vector<TeamLayer> layers;
  for (int64_t index = 0; index < static_cast<int64_t>(keys.size()); ++index) {
    const LayerWeights layer{weights, index * kWeightsPerLayer, out_features.data() + index * kLinearsPerLayer};
    if (!keys[index].is_contiguous() || !values[index].is_contiguous() || keys[index].scalar_type() != dtype ||
        values[index].scalar_type() != dtype)
      return {};
    const int64_t inputs[kLinearsPerLayer] = {d, heads * hd, d, layer.out_features[kGateUpOut] / 2};
    const WeightSlot slots[kLinearsPerLayer] = {kQkv, kOut, kGateUp, kDown};
    TeamLinear linears[kLinearsPerLayer];
    for (int64_t j = 0; j < kLinearsPerLayer; ++j) {
      const at::Tensor w = layer.get(slots[j]);
      const std::optional<at::Tensor> bias = layer.bias(static_cast<WeightSlot>(slots[j] + 1));
      if (w.dim() != 4 || w.scalar_type() != dtype || w.size(1) * w.size(3) != inputs[j] ||
          (bias && !packed_linear_bias_ready(w, *bias)))
        return {};
      linears[j] = TeamLinear{w, bias, layer.out_features[j]};
    }
    const at::Tensor input_norm = layer.get(kInputNorm), post_norm = layer.get(kPostNorm);
    if (input_norm.scalar_type() != dtype || post_norm.scalar_type() != dtype || !input_norm.is_contiguous() ||
        !post_norm.is_contiguous())
      return {};
    layers.push_back(TeamLayer{input_norm, post_norm, linears[0], linears[1], linears[2], linears[3]});
  }
  return layers;
}

std::vector<at::Tensor> team_step(const std::vector<TeamLayer>& layers, const at::Tensor& hidden,
                                  const StepInputs& step, at::TensorList keys, at::TensorList values,
                                  at::IntArrayRef feature_layers) {
  const int64_t B = hidden.size(0), d = hidden.size(1), H = step.heads, hd = keys[0].size(3);
  const int64_t inner = layers[0].gate_up.out_features / 2;
  const at::TensorOptions options = hidden.options();
  const at::Tensor state = hidden.clone(at::MemoryFormat::Contiguous), normed = at::empty({B, d}, options);
  const at::Tensor qkv = at::empty({B, layers[0].qkv.out_features}, options), q = at::empty({B, H, hd}, options);
  const at::Tensor attended = at::empty({B, H, hd}, options), projected = at::empty({B, d}, options);
  const at::Tensor attended_rows = attended.view({B, H * hd});  // the output projection's input
  const at::Tensor gate_up = at::empty({B, 2 * inner}, options), product = at::empty({B, inner}, options);
  std::vector<at::Tensor> out(1 + feature_layers.size());
  for (size_t j = 0; j < feature_layers.size(); ++j) out[1 + j] = at::empty({B, d}, options);
  const int64_t* rows = step.rows.data_ptr<int64_t>();
  const int64_t* blocks = step.blocks.data_ptr<int64_t>();
  const int64_t* offsets = step.offsets.data_ptr<int64_t>();
  const int64_t* visible = step.visible.data_ptr<int64_t>();
  const KVPages pages(step.tables.data_ptr<int64_t>(), step.tables.size(1), keys[0]);
  const int64_t grain = attention_grain(step.visible.sum().item<int64_t>(), H, hd, B);
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  std::atomic<int64_t> counters[4] = {0, 0, 0, 0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads(), counters};
    current_team = &team;
    team_dynamic_calls = 0;
    for (size_t index = 0; index < layers.size(); ++index) {
      const TeamLayer& layer = layers[index];
      rms_norm_into(layer.input_norm, state.data_ptr(), B, d, step.eps, normed.data_ptr(), 1);
#pragma omp barrier
      layer.qkv(normed, qkv);
#pragma omp barrier
      rope_write_into(qkv.data_ptr(), step.cos.data_ptr(), step.signed_sin.data_ptr(), keys[index], values[index],
                      blocks, offsets, B, H, q.data_ptr(), 1);
#pragma omp barrier
      attention_into(q.data_ptr(), bf16, keys[index], values[index], pages, rows, visible, B, H, step.scaling, grain,
                     attended.data_ptr());
#pragma omp barrier
      layer.out(attended_rows, projected);
#pragma omp barrier
      add_into(state, projected, state);
#pragma omp barrier
      rms_norm_into(layer.post_norm, state.data_ptr(), B, d, step.eps, normed.data_ptr(), 1);
#pragma omp barrier
      layer.gate_up(normed, gate_up);
#pragma omp barrier
      silu_mul_into(gate_up, product);
#pragma omp barrier
      layer.down(product, projected);
#pragma omp barrier
      add_into(state, projected, state);
#pragma omp barrier
      for (size_t j = 0; j < feature_layers.size(); ++j)  // read-only until the next add, two barriers on
        if (feature_layers[j] == static_cast<int64_t>(index) && team.member == 0)
          std::memcpy(out[1 + j].data_ptr(), state.data_ptr(), state.nbytes());
    }
    current_team = nullptr;
  }
  out[0] = state;
  return out;
}

// Where each packed token's K/V go in the pool: block tables[rows[b], slots[b] / bs], offset slots[b] % bs
// (checked: every such block is in the pool).
std::pair<at::Tensor, at::Tensor> slot_blocks(const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& slots,
                                              const at::Tensor& pool) {
  const int64_t B = rows.numel(), bs = pool.size(2), width = tables.size(1);
  at::Tensor blocks = at::empty({B}, rows.options()), offsets = at::empty({B}, rows.options());
  const int64_t *r = rows.data_ptr<int64_t>(), *s = slots.data_ptr<int64_t>(), *t = tables.data_ptr<int64_t>();
  int64_t *bp = blocks.data_ptr<int64_t>(), *op = offsets.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(r[b] >= 0 && r[b] < tables.size(0) && s[b] >= 0 && s[b] < width * bs,
                "decoder_layers: row or slot out of its block table for token ", b);
    bp[b] = t[r[b] * width + s[b] / bs], op[b] = s[b] % bs;
    TORCH_CHECK(bp[b] >= 0 && bp[b] < pool.size(0), "decoder_layers: token ", b, "'s block is not in the pool");
  }
  return {blocks, offsets};
}

// hidden [B, d] after the embedding; tables [R, M] each row's blocks in the pools keys/values (per layer
// [N, Hkv, bs, hd]); rows, slots [B] each token's row and slot in it. Returns [hidden after the last
// layer, then the hidden states after each of feature_layers, in that order].
std::vector<at::Tensor> decoder_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& signed_sin,
                                       const c10::List<std::optional<at::Tensor>>& weights,
                                       at::IntArrayRef out_features, at::TensorList keys, at::TensorList values,
                                       const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& slots,
                                       int64_t heads, double eps, double scaling, at::IntArrayRef feature_layers) {
  check_inputs(hidden, weights, out_features, keys, values, feature_layers);
  TORCH_CHECK(tables.dim() == 2 && KVPages::readable(tables.size(1), keys[0].size(2)),
              "decoder_layers: block tables [R, M] over blocks of a power of two from 16 slots (or one block a row)");
  // Below autograd: the loop is inference only, and each inner call then skips that dispatch step.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor slot_index = slots.to(at::kLong).contiguous(), row_index = rows.to(at::kLong).contiguous();
  const at::Tensor table = tables.to(at::kLong).contiguous();
  const auto [blocks, offsets] = slot_blocks(table, row_index, slot_index, keys[0]);
  const StepInputs step{cos.contiguous(), signed_sin.contiguous(), table, row_index, blocks, offsets,
                        slot_index + 1, heads, eps, scaling};
  const bool same_dtype = step.cos.scalar_type() == hidden.scalar_type() &&
                         step.signed_sin.scalar_type() == hidden.scalar_type();  // the team reads them raw
  const std::vector<TeamLayer> team =
      same_dtype ? team_layers(hidden, weights, out_features, keys, values, heads) : std::vector<TeamLayer>{};
  if (!team.empty()) return team_step(team, hidden, step, keys, values, feature_layers);
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
      "Tensor(a!)[] keys, Tensor(b!)[] values, Tensor tables, Tensor rows, Tensor slots, int heads, float eps, "
      "float scaling, int[] feature_layers) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) {
  m.impl("silu_mul", vlmspec_cpu::silu_mul);
  m.impl("decoder_layers", vlmspec_cpu::decoder_layers);
}
