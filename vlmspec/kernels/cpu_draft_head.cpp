// Phases 4-5 of the DSpark drafting round (see cpu_draft.cpp): the sequential head position after
// position, the draws, and the confidence head.

#include "cpu_draft.h"

namespace vlmspec_cpu {
namespace dspark {
namespace {

// The draw of one sampled position (temperature > 0; a greedy one takes largest_logit): the
// inverse-CDF draw of softmax(logits / T) with the float64 uniform u (vlmspec.sampling.
// sample_from_uniforms: the first index whose float64 cumulative mass reaches (1 - u) * total).
// probs receives the float32 distribution.
int64_t draw(const float* logits, int64_t N, double temperature, double uniform, float* probs) {
  const float t = static_cast<float>(temperature);
  float top = -INFINITY;
  for (int64_t i = 0; i < N; ++i) {
    probs[i] = logits[i] / t;
    top = std::max(top, probs[i]);
  }
  __m256 sums = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= N; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(probs + i), _mm256_set1_ps(top)));
    _mm256_storeu_ps(probs + i, e);
    sums = _mm256_add_ps(sums, e);
  }
  float total = horizontal_sum(sums);
  for (; i < N; ++i) {
    probs[i] = std::exp(probs[i] - top);
    total += probs[i];
  }
  for (i = 0; i < N; ++i) probs[i] /= total;
  double mass = 0.0;
  for (i = 0; i < N; ++i) mass += static_cast<double>(probs[i]);
  const double target = (1.0 - uniform) * mass;
  double cumulative = 0.0;
  for (i = 0; i < N; ++i) {
    cumulative += static_cast<double>(probs[i]);
    if (cumulative >= target) return i;
  }
  return N - 1;
}

}  // namespace

// Phase 3: the sequential head and the draws, then the confidence head.
template <typename T>
void run_head(const Weights& w, const Round& r, Scratch<T>& b, const Team& team) {
  const Shape& s = r.s;
  const int64_t G = s.block, d = s.hidden, N = s.vocab, rank = s.rank;
  const int64_t* token_ids = w.token_ids.data_ptr<int64_t>();
  T* code = ptr<T>(b.head_code);   // [padded rank] z_k, the input of W2
  T* in = ptr<T>(b.head_in);       // [padded] the gate's / joint's input
  T* mid = ptr<T>(b.head_mid);     // [3 rank] their output
  T* state = ptr<T>(b.state);      // [rank] the RNN state
  float* logits = ptr<float>(b.logits);
  int64_t previous = r.anchor;  // a target id
  for (int64_t k = 0; k < G; ++k) {
    const T* hidden = ptr<T>(b.hidden) + k * d;
    const T* embedded = s.head_kind == kNoHead ? nullptr : ptr<T>(w.head_embed) + previous * rank;
    if (s.head_kind == kGated || s.head_kind == kRnn) {
      if (team.member == 0) {
        if (s.head_kind == kGated) {  // [h_k ; W1 x]
          std::memcpy(in, hidden, d * sizeof(T));
          std::memcpy(in + d, embedded, rank * sizeof(T));
        } else {  // [s ; W1 x ; h_k]
          std::memcpy(in, state, rank * sizeof(T));
          std::memcpy(in + rank, embedded, rank * sizeof(T));
          std::memcpy(in + 2 * rank, hidden, d * sizeof(T));
        }
      }
#pragma omp barrier
      (s.head_kind == kGated ? w.head_gate : w.head_joint)(in, 1, mid);
#pragma omp barrier
    }
    if (team.member == 0 && s.head_kind != kNoHead) {
      for (int64_t j = 0; j < rank; ++j) {
        const float e = to_float(embedded[j]);
        if (s.head_kind == kVanilla) {
          code[j] = embedded[j];
        } else if (s.head_kind == kGated) {  // sigmoid(gate) * W1 x
          code[j] = stored<T>(rounded<T>(sigmoid(to_float(mid[j]))) * e);
        } else {  // keep = sigmoid(g); z = tanh(o); s = keep * s + (1 - keep) * tanh(c)
          const float keep = rounded<T>(sigmoid(to_float(mid[j])));
          const float candidate = rounded<T>(std::tanh(to_float(mid[rank + j])));
          code[j] = stored<T>(std::tanh(to_float(mid[2 * rank + j])));
          const float kept = rounded<T>(keep * to_float(state[j]));
          const float added = rounded<T>(rounded<T>(1.0f - keep) * candidate);
          state[j] = stored<T>(kept + added);
        }
      }
    }
    if (s.head_kind != kNoHead) {
#pragma omp barrier
      w.head_out(code, 1, b.bias.data_ptr());
#pragma omp barrier
    }
    const T* base = ptr<T>(b.base) + k * N;
    const T* bias = s.head_kind == kNoHead ? nullptr : ptr<T>(b.bias);
    if (r.temperature == 0.0) {  // greedy: every member the argmax of its share, member 0 the first largest of those
      const int64_t share = (N / team.size + 7) / 8 * 8;
      const int64_t first = std::min(N, team.member * share);
      const int64_t last = team.member == team.size - 1 ? N : std::min(N, first + share);
      b.best[team.member] = largest_logit(base, bias, first, last);
#pragma omp barrier
    }
    if (team.member == 0) {
      int64_t column = 0;
      if (r.temperature == 0.0) {
        Best best = b.best[0];
        for (int64_t m = 1; m < team.size; ++m)  // shares in index order: a tie keeps the earlier one
          if (b.best[m].index < N && b.best[m].value > best.value) best = b.best[m];
        column = best.index;
      } else {
        for (int64_t j = 0; j < N; ++j)
          logits[j] = bias == nullptr ? to_float(base[j]) : to_float(base[j]) + to_float(bias[j]);
        column = draw(logits, N, r.temperature, r.uniforms[k], r.probs == nullptr ? nullptr : r.probs + k * N);
      }
      if (r.confidences != nullptr) {  // this position's confidence input: [h_k ; W1[x_{k-1}]]
        T* row = ptr<T>(b.conf_in) + k * b.conf_in.size(1);
        std::memcpy(row, hidden, d * sizeof(T));
        if (s.confidence == kWithMarkov) std::memcpy(row + d, embedded, rank * sizeof(T));
      }
      previous = token_ids[column];
      r.tokens[k] = previous;
    }
#pragma omp barrier
    previous = r.tokens[k];  // every member follows the drawn token
  }
  if (r.confidences == nullptr) return;
  w.confidence(b.conf_in.data_ptr(), G, b.conf_out.data_ptr());
#pragma omp barrier
  if (team.member == 0)
    for (int64_t k = 0; k < G; ++k) r.confidences[k] = sigmoid(to_float(ptr<T>(b.conf_out)[k]));
}

template void run_head<float>(const Weights&, const Round&, Scratch<float>&, const Team&);
template void run_head<uint16_t>(const Weights&, const Round&, Scratch<uint16_t>&, const Team&);

}  // namespace dspark
}  // namespace vlmspec_cpu
