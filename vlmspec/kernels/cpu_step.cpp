// Every decoder layer of a packed decode/verify step in one call (vlmspec/targets/packed.py).
//
// PackedDecoder's Python reference makes about twelve operator calls per decoder layer, each a trip
// through the interpreter and torch's dispatcher: on the 2-core AVX-512 EPYC about a third of a
// bfloat16 step of the reference target (issue #32). This step makes the same kernel calls in the
// same order, as C++ function calls, so it computes bit for bit what the reference computes.
//
// It runs in one parallel region for the whole step (the team of cpu_common.h): every thread makes
// the same calls, each its share (a linear's blocks pulled from a shared counter), with a barrier
// between calls, into buffers allocated once per step. A fork and a join per call (a dozen a layer)
// left one thread waiting while the other ran the serial pieces (allocations, ATen's adds, the
// calls' checks): about a third of a bfloat16 step (docs/design.md §21.1). It covers the case where
// the reference makes one kernel call per step: no q/k norms, the kernel's RMSNorm, every linear
// packed (AVX-512; AVX512-BF16 for bfloat16) at its natural input width, SiLU, the fused RoPE + KV
// write and the paged attention. PackedDecoder checks that once, when it packs, and builds the
// layers' DecoderWeights (cpu_layers.h) then.

#include <atomic>

#include "cpu_layers.h"

namespace vlmspec_cpu {

// gate_up [B, 2I] (gate, then up, as chunk(2, dim=-1) splits it) -> [B, I]; the reference's SiLU(gate) * up.
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

void DecoderWeights::add_layer(const c10::Dict<std::string, at::Tensor>& tensors,
                               const c10::Dict<std::string, int64_t>& out_features) {
  const char* what = "DecoderWeights.add_layer";
  auto norm = [&](const std::string& name) {
    const auto found = tensors.find(name);
    TORCH_CHECK(found != tensors.end(), what, ": the weights lack '", name, "'");
    return found->value();
  };
  auto outputs = [&](const std::string& name) {
    const auto found = out_features.find(name);
    TORCH_CHECK(found != out_features.end(), what, ": the output sizes lack '", name, "'");
    return found->value();
  };
  const at::Tensor input_norm = norm("input_norm"), post_norm = norm("post_norm");
  const at::ScalarType dtype = input_norm.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, what, ": float32 or bfloat16 weights, got ", dtype);
  TORCH_CHECK(layers.empty() || dtype == this->dtype(), what, ": every layer in one dtype");
  DecoderLayerWeights layer{input_norm, post_norm,
                            named_linear(tensors, "qkv", "qkv_bias", outputs("qkv"), dtype, what),
                            named_linear(tensors, "out", "out_bias", outputs("out"), dtype, what),
                            named_linear(tensors, "gate_up", "gate_up_bias", outputs("gate_up"), dtype, what),
                            named_linear(tensors, "down", "down_bias", outputs("down"), dtype, what)};
  const int64_t d = input_norm.numel();
  for (const at::Tensor& weight : {input_norm, post_norm})
    TORCH_CHECK(weight.dim() == 1 && weight.numel() == d && weight.is_contiguous() && weight.scalar_type() == dtype,
                what, ": the norms' weights must be [d] contiguous, in one dtype");
  // The step writes each linear's output at its natural width and the next linear reads it at its packed one.
  TORCH_CHECK(layer.qkv.in() == d && layer.out.in() == heads * head_dim && layer.gate_up.in() == d &&
                  layer.out.out == d && layer.down.out == d && layer.gate_up.out % 2 == 0 &&
                  layer.down.in() == layer.gate_up.out / 2 && layer.qkv.out > heads * head_dim &&
                  (layer.qkv.out - heads * head_dim) % (2 * head_dim) == 0,
              what, ": a packed weight's width differs from the layer's (an odd width in bfloat16?)");
  layers.push_back(std::move(layer));
}

namespace {

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

// What every layer of one step shares besides the weights.
struct StepInputs {
  at::Tensor cos, signed_sin;  // [B, hd] in the model's dtype
  at::Tensor tables;           // [R, M] int64: each row's blocks in the KV pool
  at::Tensor rows;             // [B] int64: each packed token's row
  at::Tensor blocks, offsets;  // [B] int64: the pool block its K/V go to, and the offset in it
  at::Tensor visible;          // [B] int64: its slot + 1, a token sees its row up to its own slot
};

// The layer sequence, once for the whole step (see the top of the file).
// Team member 0 copies the hidden states after feature layer j (of m) into the plane [N, bs, m * d], each token
// beside its K/V: block blocks[b], offset offsets[b], columns j * d to (j + 1) * d.
void write_plane(const at::Tensor& plane, const at::Tensor& state, const int64_t* blocks, const int64_t* offsets,
                 int64_t j) {
  const int64_t B = state.size(0), d = state.size(1), bs = plane.size(1), width = plane.size(2);
  const size_t row_bytes = d * state.element_size();
  char* base = static_cast<char*>(plane.data_ptr());
  const char* source = static_cast<const char*>(state.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(base + ((blocks[b] * bs + offsets[b]) * width + j * d) * state.element_size(), source + b * row_bytes,
                row_bytes);
}

std::vector<at::Tensor> team_step(const DecoderWeights& weights, const at::Tensor& hidden, const StepInputs& step,
                                  at::TensorList keys, at::TensorList values, at::IntArrayRef feature_layers,
                                  const at::Tensor* plane) {
  const int64_t B = hidden.size(0), d = hidden.size(1), H = weights.heads, hd = weights.head_dim;
  const std::vector<DecoderLayerWeights>& layers = weights.layers;
  const int64_t inner = layers[0].gate_up.out / 2;
  const at::TensorOptions options = hidden.options();
  const at::Tensor state = hidden.clone(at::MemoryFormat::Contiguous), normed = at::empty({B, d}, options);
  const at::Tensor qkv = at::empty({B, layers[0].qkv.out}, options), q = at::empty({B, H, hd}, options);
  const at::Tensor attended = at::empty({B, H, hd}, options), projected = at::empty({B, d}, options);
  const at::Tensor gate_up = at::empty({B, 2 * inner}, options), product = at::empty({B, inner}, options);
  // With a plane the hooked states go beside the KV and only the last layer's come back.
  std::vector<at::Tensor> out(plane ? 1 : 1 + feature_layers.size());
  for (size_t j = 1; j < out.size(); ++j) out[j] = at::empty({B, d}, options);
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
      const DecoderLayerWeights& layer = layers[index];
      rms_norm_into(layer.input_norm, state.data_ptr(), B, d, weights.eps, normed.data_ptr(), 1);
#pragma omp barrier
      layer.qkv(normed.data_ptr(), B, qkv.data_ptr());
#pragma omp barrier
      rope_write_into(qkv.data_ptr(), step.cos.data_ptr(), step.signed_sin.data_ptr(), keys[index], values[index],
                      blocks, offsets, B, H, q.data_ptr(), 1);
#pragma omp barrier
      attention_into(q.data_ptr(), bf16, keys[index], values[index], pages, rows, visible, B, H, weights.scaling,
                     grain, attended.data_ptr());
#pragma omp barrier
      layer.out(attended.data_ptr(), B, projected.data_ptr());
#pragma omp barrier
      add_into(state, projected, state);
#pragma omp barrier
      rms_norm_into(layer.post_norm, state.data_ptr(), B, d, weights.eps, normed.data_ptr(), 1);
#pragma omp barrier
      layer.gate_up(normed.data_ptr(), B, gate_up.data_ptr());
#pragma omp barrier
      silu_mul_into(gate_up, product);
#pragma omp barrier
      layer.down(product.data_ptr(), B, projected.data_ptr());
#pragma omp barrier
      add_into(state, projected, state);
#pragma omp barrier
      for (size_t j = 0; j < feature_layers.size(); ++j)  // read-only until the next add, two barriers on
        if (feature_layers[j] == static_cast<int64_t>(index) && team.member == 0) {
          if (plane)
            write_plane(*plane, state, blocks, offsets, static_cast<int64_t>(j));
          else
            std::memcpy(out[1 + j].data_ptr(), state.data_ptr(), state.nbytes());
        }
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

void check_inputs(const DecoderWeights& weights, const at::Tensor& hidden, const at::Tensor& cos,
                  const at::Tensor& signed_sin, at::TensorList keys, at::TensorList values,
                  at::IntArrayRef feature_layers) {
  const int64_t layers = weights.num_layers();
  TORCH_CHECK(layers > 0, "decoder_layers: the DecoderWeights hold no layer");
  const at::ScalarType dtype = weights.dtype();
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == weights.layers[0].input_norm.numel() &&
                  hidden.scalar_type() == dtype && cos.scalar_type() == dtype && signed_sin.scalar_type() == dtype,
              "decoder_layers: hidden [B, d], cos and signed_sin in the weights' dtype ", dtype, " expected, got ",
              hidden.sizes(), " ", hidden.scalar_type());
  TORCH_CHECK(dtype == at::kBFloat16 ? cpu_has_avx512_bf16() : cpu_has_avx512(), "decoder_layers: the packed "
              "weights need ", dtype == at::kBFloat16 ? "AVX512-BF16" : "AVX-512", " (check kernel_isa() when packing)");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers,
              "decoder_layers: one key and one value buffer per layer expected; got ", keys.size(), " and ",
              values.size(), " for ", layers, " layers");
  for (int64_t layer = 0; layer < layers; ++layer)
    for (const at::Tensor& pool : {keys[layer], values[layer]})
      TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.scalar_type() == dtype &&
                      pool.sizes() == keys[0].sizes() && pool.size(3) == weights.head_dim,
                  "decoder_layers: layer ", layer, "'s KV pool must be contiguous [N, Hkv, bs, ", weights.head_dim,
                  "] in ", dtype);
  for (int64_t index : feature_layers)
    TORCH_CHECK(index >= 0 && index < layers, "decoder_layers: feature layer ", index, " is not one of the ",
                layers, " layers");
}

void check_plane(const at::Tensor& plane, const at::Tensor& hidden, const at::Tensor& pool, int64_t layers_hooked) {
  TORCH_CHECK(plane.dim() == 3 && plane.is_contiguous() && plane.scalar_type() == hidden.scalar_type() &&
                  plane.size(0) == pool.size(0) && plane.size(1) == pool.size(2) &&
                  plane.size(2) == layers_hooked * hidden.size(1),
              "decoder_layers: the feature plane must be contiguous [N, bs, m * d] = [", pool.size(0), ", ",
              pool.size(2), ", ", layers_hooked * hidden.size(1), "] in ", hidden.scalar_type(), ", got ",
              plane.sizes(), " ", plane.scalar_type());
}

// hidden [B, d] after the embedding; tables [R, M] each row's blocks in the pools keys/values (per layer
// [N, Hkv, bs, hd]); rows, slots [B] each token's row and slot in it. Returns [hidden after the last
// layer, then the hidden states after each of feature_layers, in that order]; with a plane [N, bs, m * d]
// those hidden states are written into it beside each token's K/V instead, and only the first comes back.
std::vector<at::Tensor> decoder_layers(const c10::intrusive_ptr<DecoderWeights>& weights, const at::Tensor& hidden,
                                       const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList keys,
                                       at::TensorList values, const at::Tensor& tables, const at::Tensor& rows,
                                       const at::Tensor& slots, at::IntArrayRef feature_layers,
                                       const std::optional<at::Tensor>& plane) {
  check_inputs(*weights, hidden, cos, signed_sin, keys, values, feature_layers);
  if (plane.has_value()) check_plane(*plane, hidden, keys[0], static_cast<int64_t>(feature_layers.size()));
  TORCH_CHECK(tables.dim() == 2 && KVPages::readable(tables.size(1), keys[0].size(2)),
              "decoder_layers: block tables [R, M] over blocks of a power of two from 16 slots (or one block a row)");
  if (hidden.size(0) == 0)  // no token: nothing to write, nothing to attend
    return std::vector<at::Tensor>(plane.has_value() ? 1 : 1 + feature_layers.size(), hidden.clone());
  // Below autograd: the step is inference only, and each inner call then skips that dispatch step.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor slot_index = slots.to(at::kLong).contiguous(), row_index = rows.to(at::kLong).contiguous();
  const at::Tensor table = tables.to(at::kLong).contiguous();
  const auto [blocks, offsets] = slot_blocks(table, row_index, slot_index, keys[0]);
  const StepInputs step{cos.contiguous(), signed_sin.contiguous(), table, row_index, blocks, offsets, slot_index + 1};
  return team_step(*weights, hidden, step, keys, values, feature_layers, plane.has_value() ? &*plane : nullptr);
}

}  // namespace
}  // namespace vlmspec_cpu

TORCH_LIBRARY_FRAGMENT(vlmspec, m) {
  m.class_<vlmspec_cpu::DecoderWeights>("DecoderWeights")
      .def(torch::init<int64_t, int64_t, double, double>())
      .def("add_layer", &vlmspec_cpu::DecoderWeights::add_layer)
      .def("num_layers", &vlmspec_cpu::DecoderWeights::num_layers);
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "decoder_layers(__torch__.torch.classes.vlmspec.DecoderWeights weights, Tensor hidden, Tensor cos, "
      "Tensor signed_sin, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor tables, Tensor rows, Tensor slots, "
      "int[] feature_layers, Tensor(c!)? plane=None) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) {
  m.impl("silu_mul", vlmspec_cpu::silu_mul);
  m.impl("decoder_layers", vlmspec_cpu::decoder_layers);
}
