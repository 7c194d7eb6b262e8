// The rejection sampler in native code (vlmspec.verify's fast path).
//
// rejection_sample: the accept test and the next token (recovered from the residual, or the
// bonus) of vlmspec.verify.verify_rejection over all rows in one call. Given the same target
// probabilities and uniforms it returns the reference's tokens bit for bit: the test
// u * q(x) < p(x) in double, and an inverse-CDF draw that adds the float32 values in index order
// in double, exactly as torch's float64 cumsum and searchsorted (right=False) do.
//
// Randomness is not made here: the caller draws the uniforms from its torch.Generators.
#include <algorithm>
#include <vector>

#include "cpu_common.h"

namespace vlmspec_cpu {
namespace {

constexpr int64_t kChunk = 64;  // the CDF's running sum is kept at every chunk's end

// Inverse-CDF draw over values(i) >= 0, i in [0, V), bit for bit as the reference: the float32
// values summed in index order in double (torch's float64 cumsum), target (1 - u) * total, the
// first index whose running sum reaches it (searchsorted, right=False). One pass keeps the sum at
// every chunk's end (a chunk of zeros adds nothing: x + 0.0 == x), a second replays one chunk.
template <typename Values>
int64_t draw_index(const Values& values, int64_t V, double u, std::vector<double>& chunk_end) {
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  chunk_end.resize(chunks);
  double running = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = c * kChunk, last = std::min(V, first + kChunk);
    if (values.any_positive(first, last))
      for (int64_t i = first; i < last; ++i) running += static_cast<double>(values(i));
    chunk_end[c] = running;
  }
  const double target = (1.0 - u) * running;
  const int64_t c = std::lower_bound(chunk_end.begin(), chunk_end.end(), target) - chunk_end.begin();
  if (c >= chunks) return V - 1;  // unreachable: target <= running (a product with 1 - u <= 1)
  double replay = c == 0 ? 0.0 : chunk_end[c - 1];
  const int64_t first = c * kChunk, last = std::min(V, first + kChunk);
  for (int64_t i = first; i < last; ++i) {
    replay += static_cast<double>(values(i));
    if (replay >= target) return i;
  }
  return last - 1;  // unreachable: the chunk's end reaches the target
}

inline bool any_positive(const float* x, int64_t first, int64_t last) {
  int64_t i = first;
  __m256 any = _mm256_setzero_ps();
  for (; i + 8 <= last; i += 8) any = _mm256_or_ps(any, _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_setzero_ps(), _CMP_GT_OQ));
  if (_mm256_movemask_ps(any) != 0) return true;
  for (; i < last; ++i)
    if (x[i] > 0.0f) return true;
  return false;
}

struct TargetValues {  // the target's own distribution: the bonus, or a residual without mass
  const float* p;
  float operator()(int64_t i) const { return p[i]; }
  bool any_positive(int64_t first, int64_t last) const { return vlmspec_cpu::any_positive(p, first, last); }
};

struct ResidualValues {  // max(p - q, 0) in float32, as the reference's clamp_min
  const float* p;
  const float* q;
  float operator()(int64_t i) const { return std::max(p[i] - q[i], 0.0f); }
  bool any_positive(int64_t first, int64_t last) const {
    __m256 any = _mm256_setzero_ps();
    int64_t i = first;
    for (; i + 8 <= last; i += 8)
      any = _mm256_or_ps(any, _mm256_cmp_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(q + i), _CMP_GT_OQ));
    if (_mm256_movemask_ps(any) != 0) return true;
    for (; i < last; ++i)
      if (p[i] - q[i] > 0.0f) return true;
    return false;
  }
};

struct OneHotResidualValues {  // a one-hot draft at `token`: the target with that token's mass removed
  const float* p;
  int64_t token;
  float operator()(int64_t i) const { return i == token ? std::max(p[i] - 1.0f, 0.0f) : p[i]; }
  bool any_positive(int64_t first, int64_t last) const {
    if (token < first || token >= last) return vlmspec_cpu::any_positive(p, first, last);
    return vlmspec_cpu::any_positive(p, first, token) || (*this)(token) > 0.0f ||
           vlmspec_cpu::any_positive(p, token + 1, last);
  }
};

template <typename Values>
bool has_mass(const Values& values, int64_t V) {
  for (int64_t first = 0; first < V; first += kChunk)
    if (values.any_positive(first, std::min(V, first + kChunk))) return true;
  return false;
}

std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& target_probs,
                                                    const std::optional<at::Tensor>& draft_probs,
                                                    const at::Tensor& tokens, const at::Tensor& num_tokens,
                                                    const at::Tensor& uniforms) {
  TORCH_CHECK(target_probs.dim() == 3 && target_probs.scalar_type() == at::kFloat,
              "rejection_sample: target_probs must be [B, gamma + 1, V] float32");
  const int64_t B = target_probs.size(0), G = target_probs.size(1) - 1, V = target_probs.size(2);
  TORCH_CHECK(G >= 0 && V > 0, "rejection_sample: empty target_probs");
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) == G && tokens.scalar_type() == at::kLong,
              "rejection_sample: tokens must be [B, gamma] int64");
  TORCH_CHECK(num_tokens.dim() == 1 && num_tokens.size(0) == B && num_tokens.scalar_type() == at::kLong,
              "rejection_sample: num_tokens must be [B] int64");
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == G + 1 &&
                  uniforms.scalar_type() == at::kDouble,
              "rejection_sample: uniforms must be [B, gamma + 1] float64");
  const bool drafted = draft_probs.has_value();
  at::Tensor q;
  if (drafted) {
    q = draft_probs->contiguous();
    TORCH_CHECK(q.dim() == 3 && q.size(0) == B && q.size(1) == G && q.size(2) == V && q.scalar_type() == at::kFloat,
                "rejection_sample: draft_probs must be [B, gamma, V] float32");
  }
  const at::Tensor p = target_probs.contiguous(), x = tokens.contiguous(), n = num_tokens.contiguous(),
                   u = uniforms.contiguous();
  const int64_t* count = n.data_ptr<int64_t>();
  const int64_t* drafts = x.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK(count[r] >= 0 && count[r] <= G, "rejection_sample: num_tokens outside [0, gamma]");
    for (int64_t k = 0; k < count[r]; ++k)
      TORCH_CHECK(drafts[r * G + k] >= 0 && drafts[r * G + k] < V, "rejection_sample: draft token outside [0, V)");
  }
  at::Tensor accepted = at::empty({B}, n.options()), next = at::empty({B}, n.options());
  const float* target = p.data_ptr<float>();
  const float* draft = drafted ? q.data_ptr<float>() : nullptr;
  const double* uniform = u.data_ptr<double>();
  int64_t* accepted_out = accepted.data_ptr<int64_t>();
  int64_t* next_out = next.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<double> chunk_end;
    for (int64_t r = first; r < last; ++r) {
      const double* row_u = uniform + r * (G + 1);
      const float* row_p = target + r * (G + 1) * V;
      int64_t a = 0;
      for (; a < count[r]; ++a) {  // u < p(x) / q(x), written u * q(x) < p(x) in double (the reference's promotion)
        const int64_t token = drafts[r * G + a];
        const double p_x = row_p[a * V + token];
        const double q_x = drafted ? draft[(r * G + a) * V + token] : 1.0;
        if (!(row_u[a] * q_x < p_x)) break;
      }
      accepted_out[r] = a;
      const float* at_next = row_p + a * V;
      const double u_next = row_u[G];
      if (a == count[r]) {
        next_out[r] = draw_index(TargetValues{at_next}, V, u_next, chunk_end);
      } else if (drafted) {
        const ResidualValues residual{at_next, draft + (r * G + a) * V};
        next_out[r] = has_mass(residual, V) ? draw_index(residual, V, u_next, chunk_end)
                                            : draw_index(TargetValues{at_next}, V, u_next, chunk_end);
      } else {
        const OneHotResidualValues residual{at_next, drafts[r * G + a]};
        next_out[r] = has_mass(residual, V) ? draw_index(residual, V, u_next, chunk_end)
                                            : draw_index(TargetValues{at_next}, V, u_next, chunk_end);
      }
    }
  });
  return {accepted, next};
}

}  // namespace
}  // namespace vlmspec_cpu

TORCH_LIBRARY_FRAGMENT(vlmspec, m) {
  m.def(
      "rejection_sample(Tensor target_probs, Tensor? draft_probs, Tensor tokens, Tensor num_tokens, "
      "Tensor uniforms) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) { m.impl("rejection_sample", vlmspec_cpu::rejection_sample); }
