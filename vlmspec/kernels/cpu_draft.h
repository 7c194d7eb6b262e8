// What the DSpark drafting round's two files share (cpu_draft.cpp: phases 1-3 and the operator;
// cpu_draft_head.cpp: phases 4-5, the sequential head, the draws and the confidence head): the
// drafter's shape, its weights by name, the round's inputs and scratch buffers.
#pragma once

#include "cpu_layers.h"

namespace vlmspec_cpu {
namespace dspark {

enum HeadKind : int64_t { kNoHead = 0, kVanilla = 1, kGated = 2, kRnn = 3 };
enum ConfidenceKind : int64_t { kNoConfidence = 0, kHiddenOnly = 1, kWithMarkov = 2 };

// The drafter's shape, passed as a list of ints in this order (native.py: SHAPE_FIELDS).
struct Shape {
  int64_t layers, heads, kv_heads, head_dim, block, head_kind, rank, vocab, intermediate, hidden, confidence;
};

// ---- values in the model's dtype T (float, or uint16_t holding bfloat16) -------------------
template <typename T>
inline float rounded(float v) {  // v rounded to T, as a tensor op's result in T is
  return round_one(static_cast<const T*>(nullptr), v);
}
template <typename T>
inline T stored(float v) {
  return from_float(static_cast<const T*>(nullptr), v);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

using Linear = PackedLinearWeights;  // cpu_layers.h: the target step's linears too

struct Layer {
  at::Tensor input_norm, q_norm, k_norm, mlp_norm;
  Linear qkv, o, gate_up, down;
};

// Every weight of the round, looked up once per call by name (native.py builds the dict).
struct Weights {
  at::Tensor embedding, mask, context_norm, norm, token_ids, head_embed, confidence_weight;
  Linear context_proj, context_kv, lm_head, head_out, head_gate, head_joint, confidence;
  std::vector<Layer> layers;
};

// What one round reads and writes besides the weights.
struct Round {
  const Shape& s;
  float eps, scale;
  double temperature;
  int64_t span, context;            // new context tokens, tokens already in the buffers
  int64_t anchor;                   // the block's first token (a target id)
  const void* features;             // [span, F padded] in T
  const float *cos, *sin;           // [span + G, hd]: the span's positions, then the block's
  std::vector<at::Tensor> keys, values;  // per layer [1, Hkv, capacity, hd]
  const double* uniforms;           // [G] when drawing
  int64_t* tokens;                  // [G] out: target ids
  float* probs;                     // [G, N] out when drawing
  float* confidences;               // [G] out when there is a confidence head
};

template <typename T>
struct Scratch {  // buffers of one call, allocated before the parallel region
  at::Tensor ctx, ctx_normed, ctx_kv, x, normed, qkv, q, attended, projected, gate_up, product, hidden, base;
  at::Tensor head_in, head_code, head_mid, state, bias, logits, conf_in, conf_out;
  std::vector<Best> best;  // [team size] each member's share of a greedy draw
};

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// The block's G queries (float32 [G, hd]) of one head over `visible` keys and values of its KV head
// (cpu_draft_attention.cpp): softmax(q . k * scale) weighted values in float32, into out [G, hd].
// scratch: at least G * (visible + 8) + 8 * hd floats.
template <typename T>
void attend_head(const float* queries, int64_t G, const T* keys, const T* values, int64_t visible, int64_t hd,
                 float scale, float* scratch, float* out);

// Phases 4-5 (cpu_draft_head.cpp), instantiated there for float and uint16_t (bfloat16).
template <typename T>
void run_head(const Weights& w, const Round& r, Scratch<T>& b, const Team& team);

}  // namespace dspark
}  // namespace vlmspec_cpu
