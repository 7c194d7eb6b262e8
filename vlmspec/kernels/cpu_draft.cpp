// The DSpark drafting round of one request in one call (vlmspec/drafters/dspark/native.py).
//
// Through PyTorch a round is about 150 operator calls (28 linears, norms, RoPE tables, cats,
// SDPA, then the sequential head's loop of small ops per position): on the 2-core AVX-512 EPYC
// the interpreter and the dispatcher cost more than reading the drafter's weights (issue #43).
// Here the same arithmetic runs as one call, in one parallel region (the team of cpu_common.h:
// every thread makes the same kernel calls, each its share, with a barrier between calls):
//
//   1. the newly committed span: H_ctx = RMSNorm(W_c features), then every layer's k (k_norm,
//      RoPE at the span's positions) and v, written into the request's context buffers after its
//      `context_length` committed tokens (the draft context cache);
//   2. the block [anchor, MASK x (G - 1)] through every layer: q/k/v, q/k norms, RoPE, the block's
//      own k/v written after the context (scratch slots, never counted as context: the next round
//      overwrites them), attention of every block position over the whole context and the whole
//      block (bidirectional), output projection, SwiGLU, residuals; the final norm;
//   3. the LM head over the draft vocabulary for the G positions;
//   4. the sequential head, position after position: the bias code z_k of the previous token
//      (vanilla Markov: W1[x_{k-1}]; gated: sigmoid(W_g [h_k; W1 x]) * W1 x; RNN: the GRU-style
//      state), B_k = W2 z_k, logits U_k + B_k in float32, then the argmax (greedy) or the
//      inverse-CDF draw from softmax(logits / T) with a float64 uniform drawn beforehand;
//   5. the confidence head over [h_k ; W1[x_{k-1}]] (or h_k alone), sigmoid.
// Phase 2's attention is in cpu_draft_attention.cpp, phases 4 and 5 in cpu_draft_head.cpp; what the
// files share in cpu_draft.h.
//
// Every linear is vlmspec's packed AVX-512 linear (cpu_packed.cpp) over the weights the Python
// drafter's FastLinears would read, so those outputs are the Python path's bit for bit; norms,
// RoPE, attention, SiLU and the softmax take the PyTorch modules' roundings (each op's result
// rounded to the model's dtype) but not their exact float32 summation order or their exp/cos,
// so outputs agree with the PyTorch drafter within a few float32 ulps before the dtype's
// rounding (tests/drafters/test_dspark_native.py states the tolerances).
//
// The drafter's context lives in its own buffers [1, Hkv, capacity, hd] (DraftContextCache),
// separate from the target's KV layout; the attention here is its own (a few hundred keys).
#include "cpu_draft.h"

namespace vlmspec_cpu {
namespace dspark {
namespace {

// RMSNorm of one row (backbone.RMSNorm): x * 1/sqrt(mean(x^2) + eps) in float32, rounded to T,
// times the weight, rounded again.
template <typename T>
void rms_row(const T* x, const T* weight, int64_t d, float eps, T* out) {
  float sum = 0.0f;
  for (int64_t j = 0; j < d; ++j) sum += to_float(x[j]) * to_float(x[j]);
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = stored<T>(to_float(weight[j]) * rounded<T>(to_float(x[j]) * inverse));
}

// RoPE of one head (rotate-half convention): each product rounded to T, then their sum.
// cos/sin hold the tables' values already rounded to T.
template <typename T>
void rope_row(const T* x, const float* cos, const float* sin, int64_t hd, T* out) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) {
    const float rotated = d < half ? -to_float(x[d + half]) : to_float(x[d - half]);
    out[d] = stored<T>(rounded<T>(to_float(x[d]) * cos[d]) + rounded<T>(rotated * sin[d]));
  }
}

// The norm and the rotation of one head of a fused projection, written to `out`.
template <typename T>
void norm_rope_head(const T* x, const T* norm, const float* cos, const float* sin, int64_t hd, float eps, T* out) {
  T normed[512];
  rms_row(x, norm, hd, eps, normed);
  rope_row(normed, cos, sin, hd, out);
}

const at::Tensor& need(const c10::Dict<std::string, at::Tensor>& all, const std::string& name) {
  const auto found = all.find(name);
  TORCH_CHECK(found != all.end(), "dspark_round: the weights lack '", name, "' (build them with native.py)");
  return found->value();
}

Linear linear(const c10::Dict<std::string, at::Tensor>& all, const std::string& name, int64_t out,
              at::ScalarType dtype) {
  return named_linear(all, name, name + ".bias", out, dtype, "dspark_round");
}

Weights collect(const c10::Dict<std::string, at::Tensor>& all, const Shape& s, at::ScalarType dtype) {
  Weights w;
  w.embedding = need(all, "embedding");
  w.mask = need(all, "mask");
  w.context_norm = need(all, "context_norm");
  w.norm = need(all, "norm");
  w.token_ids = need(all, "token_ids");
  const int64_t kv = 2 * s.kv_heads * s.head_dim;
  w.context_proj = linear(all, "context_proj", s.hidden, dtype);
  w.context_kv = linear(all, "context_kv", s.layers * kv, dtype);
  w.lm_head = linear(all, "lm_head", s.vocab, dtype);
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    w.layers.push_back(Layer{need(all, p + "input_norm"), need(all, p + "q_norm"), need(all, p + "k_norm"),
                             need(all, p + "mlp_norm"),
                             linear(all, p + "qkv", (s.heads + 2 * s.kv_heads) * s.head_dim, dtype),
                             linear(all, p + "o", s.hidden, dtype), linear(all, p + "gate_up", 2 * s.intermediate, dtype),
                             linear(all, p + "down", s.hidden, dtype)});
  }
  if (s.head_kind != kNoHead) {
    w.head_embed = need(all, "head.embed");
    w.head_out = linear(all, "head.out", s.vocab, dtype);
  }
  if (s.head_kind == kGated) w.head_gate = linear(all, "head.gate", s.rank, dtype);
  if (s.head_kind == kRnn) w.head_joint = linear(all, "head.joint", 3 * s.rank, dtype);
  if (s.confidence != kNoConfidence) w.confidence = linear(all, "confidence", 1, dtype);
  // Every packed input width is the natural one (native.py packs only such drafters): rows are written
  // at their natural stride and read at the packed one.
  const Layer& first = w.layers.at(0);
  const int64_t markov = s.confidence == kWithMarkov ? s.rank : 0;
  TORCH_CHECK(w.context_kv.in() == s.hidden && first.qkv.in() == s.hidden && first.gate_up.in() == s.hidden &&
                  first.o.in() == s.heads * s.head_dim && first.down.in() == s.intermediate &&
                  w.lm_head.in() == s.hidden && (s.head_kind == kNoHead || w.head_out.in() == s.rank) &&
                  (s.head_kind != kGated || w.head_gate.in() == s.hidden + s.rank) &&
                  (s.head_kind != kRnn || w.head_joint.in() == s.hidden + 2 * s.rank) &&
                  (s.confidence == kNoConfidence || w.confidence.in() == s.hidden + markov),
              "dspark_round: a packed weight's input width differs from the drafter's (an odd width in bfloat16?)");
  // The embedding is the target's own table: in T, or float32 when a float32 target drafts in bfloat16.
  TORCH_CHECK(w.embedding.is_contiguous() && w.embedding.dim() == 2 && w.embedding.size(1) == s.hidden &&
                  (w.embedding.scalar_type() == dtype || w.embedding.scalar_type() == at::kFloat),
              "dspark_round: the embedding must be a contiguous [vocab, ", s.hidden, "] table in ", dtype,
              " or float32");
  std::vector<at::Tensor> plain = {w.mask, w.context_norm, w.norm};
  for (const Layer& layer : w.layers)
    for (const at::Tensor& t : {layer.input_norm, layer.q_norm, layer.k_norm, layer.mlp_norm}) plain.push_back(t);
  if (s.head_kind != kNoHead) plain.push_back(w.head_embed);
  for (const at::Tensor& t : plain)
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dtype, "dspark_round: every weight must be contiguous ",
                dtype);
  TORCH_CHECK(w.token_ids.scalar_type() == at::kLong && w.token_ids.numel() == s.vocab,
              "dspark_round: token_ids must be the ", s.vocab, " int64 target ids of the draft vocabulary");
  return w;
}

// cos/sin tables [P, hd] of 1-D positions, as backbone.rotary computes them (float32 angles,
// inv_freq = 1 / theta^(2i / hd)), rounded to T as the tables are cast to the model's dtype.
template <typename T>
void rotary_tables(const int64_t* positions, int64_t P, int64_t hd, double theta, float* cos, float* sin) {
  const int64_t half = hd / 2;
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(hd));
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < hd; ++i) {
      const float angle = static_cast<float>(positions[p]) * inv_freq[i % half];
      cos[p * hd + i] = rounded<T>(std::cos(angle));
      sin[p * hd + i] = rounded<T>(std::sin(angle));
    }
}

// out = a + b rounded to T, split over the team.
template <typename T>
void add_rows(const T* a, const T* b, int64_t n, T* out) {
  split_tasks(0, n, 512, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) out[j] = stored<T>(to_float(a[j]) + to_float(b[j]));
  });
}

template <typename T>
void rms_rows(const T* x, const at::Tensor& weight, int64_t rows, int64_t d, float eps, T* out) {
  split_tasks(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) rms_row(x + r * d, ptr<T>(weight), d, eps, out + r * d);
  });
}

// Phase 1: the span's context keys and values, written after the committed ones.
template <typename T>
void absorb_span(const Weights& w, const Round& r, Scratch<T>& b) {
  const Shape& s = r.s;
  const int64_t hd = s.head_dim, d = s.hidden, per_layer = 2 * s.kv_heads * hd;
  w.context_proj(r.features, r.span, b.ctx.data_ptr());
#pragma omp barrier
  rms_rows(ptr<T>(b.ctx), w.context_norm, r.span, d, r.eps, ptr<T>(b.ctx_normed));
#pragma omp barrier
  w.context_kv(b.ctx_normed.data_ptr(), r.span, b.ctx_kv.data_ptr());
#pragma omp barrier
  // Tasks (token, layer, kv head): k_norm + RoPE into the key slot, v copied beside it.
  split_tasks(0, r.span * s.layers * s.kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t t = task / (s.layers * s.kv_heads), layer = task / s.kv_heads % s.layers, g = task % s.kv_heads;
      const T* row = ptr<T>(b.ctx_kv) + t * s.layers * per_layer + layer * per_layer;
      const at::Tensor& keys = r.keys[layer];
      const int64_t at = (g * keys.size(2) + r.context + t) * hd;
      norm_rope_head(row + g * hd, ptr<T>(w.layers[layer].k_norm), r.cos + t * hd, r.sin + t * hd, hd, r.eps,
                     ptr<T>(keys) + at);
      std::memcpy(ptr<T>(r.values[layer]) + at, row + (s.kv_heads + g) * hd, hd * sizeof(T));
    }
  });
#pragma omp barrier
}

// Phase 2: the block through every layer, the final norm and the LM head: b.hidden [G, d], b.base [G, N].
template <typename T>
void run_block(const Weights& w, const Round& r, Scratch<T>& b, const Team& team) {
  const Shape& s = r.s;
  const int64_t G = s.block, d = s.hidden, hd = s.head_dim, H = s.heads, Hkv = s.kv_heads;
  const int64_t width = (H + 2 * Hkv) * hd, first_slot = r.context + r.span, visible = first_slot + G;
  const float* cos = r.cos + r.span * hd;
  const float* sin = r.sin + r.span * hd;
  T* x = ptr<T>(b.x);
  if (team.member == 0) {  // [anchor embedding, MASK x (G - 1)]
    if (sizeof(T) < sizeof(float) && w.embedding.scalar_type() == at::kFloat) {  // a float32 table, T bfloat16
      const float* row = ptr<float>(w.embedding) + r.anchor * d;  // rounded to T as tensor.to(T) rounds
      for (int64_t i = 0; i < d; ++i) x[i] = stored<T>(row[i]);
    } else {
      std::memcpy(x, ptr<T>(w.embedding) + r.anchor * d, d * sizeof(T));
    }
    for (int64_t g = 1; g < G; ++g) std::memcpy(x + g * d, ptr<T>(w.mask), d * sizeof(T));
  }
#pragma omp barrier
  for (int64_t index = 0; index < s.layers; ++index) {
    const Layer& layer = w.layers[index];
    const at::Tensor& keys = r.keys[index];
    const at::Tensor& values = r.values[index];
    const int64_t capacity = keys.size(2);
    rms_rows(x, layer.input_norm, G, d, r.eps, ptr<T>(b.normed));
#pragma omp barrier
    layer.qkv(b.normed.data_ptr(), G, b.qkv.data_ptr());
#pragma omp barrier
    // Tasks (position, head): q heads normed and rotated into q; k heads into their key slot, v beside.
    split_tasks(0, G * (H + Hkv), 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t g = task / (H + Hkv), h = task % (H + Hkv);
        const T* row = ptr<T>(b.qkv) + g * width;
        if (h < H) {
          norm_rope_head(row + h * hd, ptr<T>(layer.q_norm), cos + g * hd, sin + g * hd, hd, r.eps,
                         ptr<T>(b.q) + (g * H + h) * hd);
          continue;
        }
        const int64_t kv = h - H, at = (kv * capacity + first_slot + g) * hd;
        norm_rope_head(row + h * hd, ptr<T>(layer.k_norm), cos + g * hd, sin + g * hd, hd, r.eps, ptr<T>(keys) + at);
        std::memcpy(ptr<T>(values) + at, row + (H + Hkv + kv) * hd, hd * sizeof(T));
      }
    });
#pragma omp barrier
    // Tasks (head): every block position over the context and the block, the keys read once per head.
    split_tasks(0, H, 1, [&](int64_t first, int64_t last) {
      thread_local std::vector<float> scratch, queries, out;
      scratch.resize(static_cast<size_t>(G * (visible + 8) + 8 * hd));
      queries.resize(static_cast<size_t>(G * hd));
      out.resize(static_cast<size_t>(G * hd));
      for (int64_t h = first; h < last; ++h) {
        const int64_t kv = h / (H / Hkv);
        for (int64_t g = 0; g < G; ++g) {
          const T* q = ptr<T>(b.q) + (g * H + h) * hd;
          for (int64_t j = 0; j < hd; ++j) queries[g * hd + j] = to_float(q[j]);
        }
        attend_head(queries.data(), G, ptr<T>(keys) + kv * capacity * hd, ptr<T>(values) + kv * capacity * hd,
                    visible, hd, r.scale, scratch.data(), out.data());
        for (int64_t g = 0; g < G; ++g) {
          T* o = ptr<T>(b.attended) + g * H * hd + h * hd;
          for (int64_t j = 0; j < hd; ++j) o[j] = stored<T>(out[g * hd + j]);
        }
      }
    });
#pragma omp barrier
    layer.o(b.attended.data_ptr(), G, b.projected.data_ptr());
#pragma omp barrier
    add_rows(x, ptr<T>(b.projected), G * d, x);
#pragma omp barrier
    rms_rows(x, layer.mlp_norm, G, d, r.eps, ptr<T>(b.normed));
#pragma omp barrier
    layer.gate_up(b.normed.data_ptr(), G, b.gate_up.data_ptr());
#pragma omp barrier
    silu_mul_rows(ptr<T>(b.gate_up), G, s.intermediate, ptr<T>(b.product));  // cpu_common.h's, as the target's
#pragma omp barrier
    layer.down(b.product.data_ptr(), G, b.projected.data_ptr());
#pragma omp barrier
    add_rows(x, ptr<T>(b.projected), G * d, x);
#pragma omp barrier
  }
  rms_rows(x, w.norm, G, d, r.eps, ptr<T>(b.hidden));
#pragma omp barrier
  w.lm_head(b.hidden.data_ptr(), G, b.base.data_ptr());
#pragma omp barrier
}

template <typename T>
Scratch<T> scratch(const Weights& w, const Shape& s, int64_t span, const at::TensorOptions& options) {
  const int64_t G = s.block, d = s.hidden, hd = s.head_dim;
  Scratch<T> b;
  // Every buffer is written before it is read (the RNN state, which starts at zero, excepted).
  const auto make = [&](std::initializer_list<int64_t> sizes) { return at::empty(sizes, options); };
  b.ctx = make({std::max<int64_t>(span, 1), d});
  b.ctx_normed = make({std::max<int64_t>(span, 1), w.context_kv.in()});
  b.ctx_kv = make({std::max<int64_t>(span, 1), w.context_kv.out});
  b.x = make({G, d});
  b.normed = make({G, w.layers[0].qkv.in()});
  b.qkv = make({G, w.layers[0].qkv.out});
  b.q = make({G, s.heads, hd});
  b.attended = make({G, w.layers[0].o.in()});
  b.projected = make({G, d});
  b.gate_up = make({G, 2 * s.intermediate});
  b.product = make({G, w.layers[0].down.in()});
  b.hidden = make({G, w.lm_head.in()});
  b.base = make({G, s.vocab});
  const int64_t rank = s.rank;
  b.head_code = make({s.head_kind == kNoHead ? 1 : w.head_out.in()});
  b.head_in = make({s.head_kind == kGated ? w.head_gate.in() : s.head_kind == kRnn ? w.head_joint.in() : 1});
  b.head_mid = make({3 * rank});
  b.state = at::zeros({rank}, options);
  b.bias = make({s.vocab});
  b.logits = at::empty({s.vocab}, options.dtype(at::kFloat));
  b.conf_in = make({G, s.confidence == kNoConfidence ? 1 : w.confidence.in()});
  b.conf_out = make({G, 1});
  b.best.assign(static_cast<size_t>(at::get_num_threads()), Best{-INFINITY, 0});
  return b;
}

template <typename T>
void run_round(const Weights& w, Round& r, const at::TensorOptions& options) {
  Scratch<T> b = scratch<T>(w, r.s, r.span, options);
  std::atomic<int64_t> counters[4] = {0, 0, 0, 0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads(), counters};
    current_team = &team;
    team_dynamic_calls = 0;
    if (r.span > 0) absorb_span(w, r, b);
    run_block(w, r, b, team);
    run_head(w, r, b, team);
    current_team = nullptr;
  }
}

}  // namespace
}  // namespace dspark

using namespace dspark;

// One drafting round of one request (see the top of this file). Returns the drafted target ids
// [G] int64, the float32 distributions they were drawn from [G, N] (empty when greedy) and the
// confidences [G] float32 (empty without a confidence head).
std::vector<at::Tensor> dspark_round(const c10::Dict<std::string, at::Tensor>& weights, at::IntArrayRef shape,
                                     double eps, double theta, int64_t anchor,
                                     int64_t anchor_position, const at::Tensor& features,
                                     const at::Tensor& positions, at::TensorList keys, at::TensorList values,
                                     int64_t context_length, double temperature, const at::Tensor& uniforms) {
  TORCH_CHECK(shape.size() == sizeof(Shape) / sizeof(int64_t), "dspark_round: shape needs ",
              sizeof(Shape) / sizeof(int64_t), " ints (native.py: SHAPE_FIELDS), got ", shape.size());
  Shape s;
  std::memcpy(&s, shape.data(), sizeof s);
  const at::ScalarType dtype = need(weights, "norm").scalar_type();
  TORCH_CHECK(dtype == at::kFloat ? cpu_has_avx512() : (dtype == at::kBFloat16 && cpu_has_avx512_bf16()),
              "dspark_round: needs AVX-512 (float32) or AVX512-BF16 (bfloat16), got ", dtype);
  TORCH_CHECK(s.head_dim % 8 == 0 && s.head_dim <= 512 && s.heads % s.kv_heads == 0,
              "dspark_round: head_dim a multiple of 8 (at most 512) and heads a multiple of KV heads expected");
  const Weights w = collect(weights, s, dtype);
  const int64_t span = features.size(0), G = s.block;
  TORCH_CHECK(features.dim() == 2 && features.scalar_type() == dtype && features.is_contiguous() &&
                  (span == 0 || features.size(1) == w.context_proj.in()),
              "dspark_round: features [n, ", w.context_proj.in(), "] contiguous ", dtype, " expected, got ",
              features.sizes(), " ", features.scalar_type());
  TORCH_CHECK(positions.numel() == span && positions.scalar_type() == at::kLong,
              "dspark_round: one int64 position per span token expected");
  TORCH_CHECK(anchor >= 0 && anchor < w.embedding.size(0), "dspark_round: anchor id ", anchor,
              " is outside the drafter's embedding table of ", w.embedding.size(0), " rows");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == s.layers && static_cast<int64_t>(values.size()) == s.layers,
              "dspark_round: one key and one value buffer per layer expected");
  for (int64_t i = 0; i < s.layers; ++i)
    TORCH_CHECK(keys[i].dim() == 4 && keys[i].size(0) == 1 && keys[i].size(1) == s.kv_heads &&
                    keys[i].size(3) == s.head_dim && keys[i].sizes() == values[i].sizes() && keys[i].is_contiguous() &&
                    values[i].is_contiguous() && keys[i].scalar_type() == dtype && values[i].scalar_type() == dtype &&
                    keys[i].size(2) >= context_length + span + G,
                "dspark_round: layer ", i, "'s buffers must be contiguous [1, ", s.kv_heads, ", >= ",
                context_length + span + G, ", ", s.head_dim, "] ", dtype);
  const bool drawing = temperature > 0.0;
  TORCH_CHECK(!drawing || (uniforms.numel() == G && uniforms.scalar_type() == at::kDouble),
              "dspark_round: G float64 uniforms expected when drawing");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  // The positions' RoPE tables: the span's, then the block's (anchor_position + 0 .. G - 1).
  std::vector<int64_t> all_positions(span + G);
  const at::Tensor span_positions = positions.contiguous();
  for (int64_t t = 0; t < span; ++t) all_positions[t] = span_positions.data_ptr<int64_t>()[t];
  for (int64_t g = 0; g < G; ++g) all_positions[span + g] = anchor_position + g;
  std::vector<float> cos((span + G) * s.head_dim), sin((span + G) * s.head_dim);
  if (dtype == at::kFloat)
    rotary_tables<float>(all_positions.data(), span + G, s.head_dim, theta, cos.data(), sin.data());
  else
    rotary_tables<uint16_t>(all_positions.data(), span + G, s.head_dim, theta, cos.data(), sin.data());
  const at::Tensor tokens = at::empty({G}, at::kLong);
  const at::Tensor probs = at::empty({drawing ? G : 0, s.vocab}, at::kFloat);
  const at::Tensor confidences = at::empty({s.confidence == kNoConfidence ? 0 : G}, at::kFloat);
  const at::Tensor u = drawing ? uniforms.contiguous() : uniforms;
  Round r{s,
          static_cast<float>(eps),
          1.0f / std::sqrt(static_cast<float>(s.head_dim)),
          temperature,
          span,
          context_length,
          anchor,
          features.data_ptr(),
          cos.data(),
          sin.data(),
          keys.vec(),
          values.vec(),
          drawing ? u.data_ptr<double>() : nullptr,
          tokens.data_ptr<int64_t>(),
          drawing ? probs.data_ptr<float>() : nullptr,
          s.confidence == kNoConfidence ? nullptr : confidences.data_ptr<float>()};
  if (dtype == at::kFloat)
    run_round<float>(w, r, features.options().dtype(dtype));
  else
    run_round<uint16_t>(w, r, features.options().dtype(dtype));
  return {tokens, probs, confidences};
}

}  // namespace vlmspec_cpu

TORCH_LIBRARY_FRAGMENT(vlmspec, m) {
  m.def(
      "dspark_round(Dict(str, Tensor) weights, int[] shape, float eps, float theta, int anchor, "
      "int anchor_position, Tensor features, Tensor positions, Tensor(a!)[] keys, Tensor(b!)[] values, "
      "int context_length, float temperature, Tensor uniforms) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) { m.impl("dspark_round", vlmspec_cpu::dspark_round); }
