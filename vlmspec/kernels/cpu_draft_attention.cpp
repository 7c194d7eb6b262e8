// The attention of the DSpark drafting round (cpu_draft.cpp, phase 2): the block's G queries of
// one head over the request's draft context and the block itself.

#include "cpu_draft.h"

namespace vlmspec_cpu {
namespace dspark {
namespace {

// The scores of Q queries (float32 rows `stride` apart, hd a multiple of 8) against 8 keys held
// as float32 in `keys` [8, hd]: scores[q * stride + i] = q . k_i * scale, each dot summed as
// attend_head's single-key path sums it (8 float32 partial sums over d, then across the lanes).
inline void score_eight_keys(const float* queries, int64_t Q, int64_t stride, const float* keys, int64_t hd,
                             float scale, float* scores) {
  for (int64_t q = 0; q < Q; ++q) {
    const float* query = queries + q * hd;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(query + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + i * hd + d), acc[i]);
    }
    _mm256_storeu_ps(scores + q * stride, _mm256_mul_ps(horizontal_sums(acc), _mm256_set1_ps(scale)));
  }
}

// softmax of one query's `visible` scores in place (unnormalised exp(s - max)); returns their sum.
inline float exp_scores(float* scores, int64_t visible) {
  float top = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) top = std::max(top, scores[j]);
  float total = 0.0f;
  int64_t j = 0;
  for (; j + 8 <= visible; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top)));
    _mm256_storeu_ps(scores + j, e);
    total += horizontal_sum(e);
  }
  for (; j < visible; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  return total;
}

// out[q] = sum_j p[q][j] v_j / total[q] for Q <= 4 queries and 8 lanes of the head dim at `d`:
// each value vector is loaded once for all Q queries; each query's sum runs in the same order
// (two partial sums over alternate keys) as it would alone.
template <int Q, typename T>
inline void weigh_values(const float* scores, int64_t stride, const float* totals, const T* values, int64_t visible,
                         int64_t hd, int64_t d, float* out) {
  __m256 acc[Q][2];
  for (int q = 0; q < Q; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= visible; j += 2) {
    const __m256 v[2] = {load8(values + j * hd + d), load8(values + (j + 1) * hd + d)};
    for (int q = 0; q < Q; ++q)
      for (int u = 0; u < 2; ++u)
        acc[q][u] = _mm256_fmadd_ps(_mm256_set1_ps(scores[q * stride + j + u]), v[u], acc[q][u]);
  }
  for (; j < visible; ++j) {
    const __m256 v = load8(values + j * hd + d);
    for (int q = 0; q < Q; ++q) acc[q][0] = _mm256_fmadd_ps(_mm256_set1_ps(scores[q * stride + j]), v, acc[q][0]);
  }
  for (int q = 0; q < Q; ++q)
    _mm256_storeu_ps(out + q * hd + d,
                     _mm256_mul_ps(_mm256_add_ps(acc[q][0], acc[q][1]), _mm256_set1_ps(1.0f / totals[q])));
}

}  // namespace

// G queries of one head (float32 [G, hd], hd a multiple of 8) over the same `visible` keys and
// values of its KV head: softmax(q . k * scale) weighted values, in float32, into out [G, hd].
// Every key and value is read and widened once for the whole block instead of once per query
// (the block's queries all see the same keys); each query's arithmetic is what it would be alone.
// scratch: at least G * (visible + 8) + 8 * hd floats.
template <typename T>
void attend_head(const float* queries, int64_t G, const T* keys, const T* values, int64_t visible, int64_t hd,
                 float scale, float* scratch, float* out) {
  const int64_t stride = visible + 8;
  float* scores = scratch;                 // [G, stride]
  float* widened = scratch + G * stride;   // [8, hd] eight keys in float32
  int64_t j = 0;
  for (; j + 8 <= visible; j += 8) {
    for (int i = 0; i < 8; ++i)
      for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(widened + i * hd + d, load8(keys + (j + i) * hd + d));
    score_eight_keys(queries, G, stride, widened, hd, scale, scores + j);
  }
  for (; j < visible; ++j)
    for (int64_t q = 0; q < G; ++q) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(queries + q * hd + d), load8(keys + j * hd + d), acc);
      scores[q * stride + j] = horizontal_sum(acc) * scale;
    }
  float totals[4];
  for (int64_t first = 0; first < G; first += 4) {
    const int64_t Q = std::min<int64_t>(4, G - first);
    for (int64_t q = 0; q < Q; ++q) totals[q] = exp_scores(scores + (first + q) * stride, visible);
    const float* rows = scores + first * stride;
    float* into = out + first * hd;
    for (int64_t d = 0; d < hd; d += 8) switch (Q) {
        case 4: weigh_values<4>(rows, stride, totals, values, visible, hd, d, into); break;
        case 3: weigh_values<3>(rows, stride, totals, values, visible, hd, d, into); break;
        case 2: weigh_values<2>(rows, stride, totals, values, visible, hd, d, into); break;
        default: weigh_values<1>(rows, stride, totals, values, visible, hd, d, into); break;
      }
  }
}

template void attend_head<float>(const float*, int64_t, const float*, const float*, int64_t, int64_t, float, float*,
                                 float*);
template void attend_head<uint16_t>(const float*, int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, float,
                                    float*, float*);

}  // namespace dspark
}  // namespace vlmspec_cpu
