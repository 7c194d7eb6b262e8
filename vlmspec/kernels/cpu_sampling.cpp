// Sampling in native code (vlmspec.sampling's fast path): the warper chain and the greedy pick
// (greedy_ids, at the end).
//
// sampling_warp: logits [N, V] (float32 or bfloat16) -> the float32 distribution [N, V] the target
// samples from, under vlmspec.sampling's chain: + logit_bias, / temperature, top-k, top-p, min-p,
// softmax. Greedy rows never come here (the caller takes the argmax). Per row, three passes over
// the vocabulary and none of them sorts it:
//   1. scores s = (logit + bias) / T in float32 (the reference's ops and roundings) and their max m;
//   2. e = exp(s - m), their sum Z (double), and for a ladder of thresholds t on e the count and
//      mass of the tokens with e >= t;
//   3. the candidates: the tokens above the largest threshold that provably holds every survivor
//      (top-k: at least k tokens; top-p: more mass than top_p of Z, with a margin; min-p: e >=
//      min_p). Nothing is sorted: top-k takes the k-th score by selection (nth_element), top-p its
//      cut by a quickselect on rank that carries the tail mass (expected linear time).
// A token below the threshold ranks below every candidate (e is monotone in s), so a candidate's
// tail mass is the mass left outside the candidates plus the candidates ranked at or below it.
//
// The rejection sampler is in cpu_rejection.cpp.
//
// Randomness is not made here: the caller draws the uniforms from its torch.Generators.
#include <limits>

#include "cpu_common.h"

namespace vlmspec_cpu {
namespace {

// ---- exp of 8 floats <= 0, with float32's subnormal range ------------------------------------
// exp8_reduced (cpu_common.h), then 2^n applied in two halves so that results down to the
// smallest subnormal are formed (a single 2^n would need n >= -126). exp(0) is exactly 1; below
// -104 (and -inf) the result is 0, where float32 exp rounds to 0 too.
inline __m256 exp8_subnormal(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-104.0f);
  const __m256 underflow = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  __m256 n;
  const __m256 y = exp8_reduced(_mm256_max_ps(x, floor_x), &n);
  const __m256i whole = _mm256_cvtps_epi32(n);                 // in [-150, 0]
  const __m256i half = _mm256_srai_epi32(whole, 1);            // >= -75: 2^half is a normal float
  const __m256i rest = _mm256_sub_epi32(whole, half);          // >= -75 too
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 scale1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 scale2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(_mm256_mul_ps(y, scale1), scale2));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline double hsum4d(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
  return _mm_cvtsd_f64(s);
}

// The ladder of thresholds on e = exp(s - max) (the largest e is 1): pass 2 counts the tokens at or
// above each and sums their mass, and the candidates are gathered above the largest one that
// provably holds every survivor. The last holds every token of positive probability.
constexpr int kLevels = 7;
const float kThresholds[kLevels] = {0x1p-3f, 0x1p-6f, 0x1p-10f, 0x1p-15f, 0x1p-22f, 0x1p-34f,
                                    std::numeric_limits<float>::denorm_min()};
// A level serves top-p when its mass exceeds top_p of the total by this fraction of it, far more than
// the float32 rounding of either sum, so that the nucleus lies inside it whatever the rounding.
constexpr double kTopPMargin = 1e-3;

struct Ladder {
  double total = 0.0;         // Z: the sum of e over the vocabulary
  int64_t count[kLevels]{};   // tokens with e >= kThresholds[j]
  double mass[kLevels]{};     // their sum of e
};

// Pass 1: scores = float32(logits) / temperature (as the reference: .float(), then a float32
// division), written to `scores` [V]; returns their maximum. No bias yet.
template <typename T>
float scale_and_max(const T* logits, int64_t V, float temperature, float* scores) {
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 s = _mm256_div_ps(load8(logits + i), t);
    _mm256_storeu_ps(scores + i, s);
    best = _mm256_max_ps(best, s);
  }
  float m = hmax8(best);
  for (; i < V; ++i) {
    scores[i] = to_float(logits[i]) / temperature;
    m = std::max(m, scores[i]);
  }
  return m;
}

float max_of(const float* scores, int64_t V) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(scores + i));
  float m = hmax8(best);
  for (; i < V; ++i) m = std::max(m, scores[i]);
  return m;
}

// Pass 2: e = exp(s - m) into `e` [V], with the ladder's counts and masses.
Ladder exp_and_ladder(const float* scores, int64_t V, float m, float* e) {
  Ladder ladder;
  const __m256 top = _mm256_set1_ps(m);
  __m256d total_lo = _mm256_setzero_pd(), total_hi = _mm256_setzero_pd();
  __m256 mass[kLevels];
  __m256 level[kLevels];
  for (int j = 0; j < kLevels; ++j) {
    mass[j] = _mm256_setzero_ps();
    level[j] = _mm256_set1_ps(kThresholds[j]);
  }
  auto add = [&](__m256 x) __attribute__((always_inline)) {
    total_lo = _mm256_add_pd(total_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    total_hi = _mm256_add_pd(total_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    for (int j = 0; j < kLevels; ++j) {
      const __m256 above = _mm256_cmp_ps(x, level[j], _CMP_GE_OQ);
      ladder.count[j] += __builtin_popcount(_mm256_movemask_ps(above));
      mass[j] = _mm256_add_ps(mass[j], _mm256_and_ps(above, x));
    }
  };
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 x = exp8_subnormal(_mm256_sub_ps(_mm256_loadu_ps(scores + i), top));
    _mm256_storeu_ps(e + i, x);
    add(x);
  }
  if (i < V) {  // the last few: padded with -inf, whose e is 0
    alignas(32) float tail[8];
    for (int k = 0; k < 8; ++k) tail[k] = i + k < V ? scores[i + k] : -std::numeric_limits<float>::infinity();
    const __m256 x = exp8_subnormal(_mm256_sub_ps(_mm256_load_ps(tail), top));
    _mm256_store_ps(tail, x);
    for (int64_t k = 0; i + k < V; ++k) e[i + k] = tail[k];
    add(x);
  }
  ladder.total = hsum4d(total_lo) + hsum4d(total_hi);
  for (int j = 0; j < kLevels; ++j) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mass[j]);
    for (float lane : lanes) ladder.mass[j] += lane;
  }
  return ladder;
}

struct Candidate {
  float score;
  float e;
  int64_t index;
};

// Descending score, ties by ascending index: the reference's stable descending sort.
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

// Pass 3: every token with e >= threshold, in index order.
void gather(const float* scores, const float* e, int64_t V, float threshold, std::vector<Candidate>& out) {
  out.clear();
  const __m256 t = _mm256_set1_ps(threshold);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    unsigned mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), t, _CMP_GE_OQ));
    while (mask != 0) {
      const int k = __builtin_ctz(mask);
      out.push_back({scores[i + k], e[i + k], i + k});
      mask &= mask - 1;
    }
  }
  for (; i < V; ++i)
    if (e[i] >= threshold) out.push_back({scores[i], e[i], i});
}

// Top-p's cut without sorting: reorders c so that its first J candidates are the nucleus and returns
// J, where J is the first rank (descending score, ties by index) whose tail mass (its own e plus all
// ranked below it, `outside` included) is at or below `drop`; at least 1, since the most probable
// token always stays. A quickselect on rank that carries the tail mass: expected linear time.
size_t nucleus_size(std::vector<Candidate>& c, double outside, double drop) {
  size_t lo = 0, hi = c.size(), cut = c.size();
  double below = outside;  // the tail mass at rank hi: everything ranked at or after hi
  while (lo < hi) {
    // median of three by rank, moved to the end of the range, as the pivot
    const size_t mid = lo + (hi - lo) / 2, last = hi - 1;
    if (ranks_before(c[mid], c[lo])) std::swap(c[mid], c[lo]);
    if (ranks_before(c[last], c[lo])) std::swap(c[last], c[lo]);
    if (ranks_before(c[mid], c[last])) std::swap(c[mid], c[last]);  // c[last] is now the median
    const Candidate pivot = c[last];
    const auto split = std::partition(c.begin() + lo, c.begin() + last,
                                      [&](const Candidate& x) { return ranks_before(x, pivot); });
    std::swap(*split, c[last]);
    const size_t at = split - c.begin();
    double tail = below + pivot.e;
    for (size_t i = at + 1; i < hi; ++i) tail += c[i].e;
    if (tail <= drop) {  // the pivot and everything after it are dropped; the cut may lie higher
      cut = at;
      hi = at;
      below = tail;
    } else {  // the pivot and everything before it stay
      lo = at + 1;
    }
  }
  return std::max<size_t>(cut, 1);
}

struct WarpParams {
  float temperature;
  int64_t top_k;  // 0: none
  double top_p;   // 1: none
  double min_p;   // 0: none
  const int64_t* bias_ids;
  const float* bias_values;
  int64_t num_bias;
};

struct Scratch {
  std::vector<float> scores;
  std::vector<Candidate> candidates;
};

// One row: out [V] receives the distribution (it holds e = exp(s - m) in between).
template <typename T>
void warp_row(const T* logits, int64_t V, const WarpParams& p, float* out, Scratch& scratch) {
  scratch.scores.resize(V);
  float* scores = scratch.scores.data();
  float m = scale_and_max(logits, V, p.temperature, scores);
  if (p.num_bias > 0) {  // the reference's (logit + bias) / T, at the biased ids only
    for (int64_t b = 0; b < p.num_bias; ++b) {
      const int64_t id = p.bias_ids[b];
      scores[id] = (to_float(logits[id]) + p.bias_values[b]) / p.temperature;
    }
    m = max_of(scores, V);
  }
  const Ladder ladder = exp_and_ladder(scores, V, m, out);
  const bool top_k = p.top_k > 0 && p.top_k < V, top_p = p.top_p < 1.0, min_p = p.min_p > 0.0;
  if (!top_k && !top_p && !min_p) {  // every token: normalise in place
    const float inverse = static_cast<float>(1.0 / ladder.total);
    for (int64_t i = 0; i < V; ++i) out[i] *= inverse;
    return;
  }
  // The largest threshold that holds every survivor (the last level holds every token of mass).
  // top-k: at least k tokens; top-p: more than top_p of the mass, with the margin. min-p alone: every
  // token, narrowed by min-p below.
  int level = kLevels - 1;
  for (int j = 0; j < kLevels - 1 && (top_k || top_p); ++j) {
    const bool holds = top_k ? ladder.count[j] >= p.top_k : ladder.mass[j] >= (p.top_p + kTopPMargin) * ladder.total;
    if (holds) {
      level = j;
      break;
    }
  }
  float threshold = kThresholds[level];
  // min-p keeps e >= min_p (the most probable token has e = 1); without top-k the nucleus of a
  // candidate needs only the tokens ranked above it, which have a larger e, so min-p may narrow
  // the candidates too (a hair below min_p: the final test below is the exact one).
  if (min_p && !top_k) threshold = std::max(threshold, static_cast<float>(p.min_p * (1.0 - 1e-6)));
  std::vector<Candidate>& c = scratch.candidates;
  gather(scores, out, V, threshold, c);
  double kept_mass = ladder.total;  // the mass top-p's probabilities are relative to
  if (top_k) {
    if (static_cast<int64_t>(c.size()) > p.top_k) {  // the k-th largest score; every tie with it stays
      std::nth_element(c.begin(), c.begin() + (p.top_k - 1), c.end(),
                       [](const Candidate& a, const Candidate& b) { return a.score > b.score; });
      const float kth = c[p.top_k - 1].score;
      c.erase(std::remove_if(c.begin(), c.end(), [kth](const Candidate& x) { return x.score < kth; }), c.end());
    }
    kept_mass = 0.0;
    for (const Candidate& x : c) kept_mass += x.e;
  }
  if (top_p) {
    double candidates_mass = 0.0;
    for (const Candidate& x : c) candidates_mass += x.e;
    // The mass outside the candidates ranks below all of them: every candidate's tail includes it.
    const double outside = std::max(kept_mass - candidates_mass, 0.0);
    c.resize(nucleus_size(c, outside, (1.0 - p.top_p) * kept_mass));
  }
  if (min_p) c.erase(std::remove_if(c.begin(), c.end(), [&](const Candidate& x) { return x.e < p.min_p; }), c.end());
  double final_mass = 0.0;
  for (const Candidate& x : c) final_mass += x.e;
  std::memset(out, 0, sizeof(float) * V);
  for (const Candidate& x : c) out[x.index] = static_cast<float>(x.e / final_mass);
}

at::Tensor sampling_warp(const at::Tensor& logits, double temperature, int64_t top_k, double top_p, double min_p,
                         const at::Tensor& bias_ids, const at::Tensor& bias_values) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "sampling_warp: logits must be [N, V] float32 or bfloat16");
  TORCH_CHECK(temperature > 0.0 && std::isfinite(static_cast<float>(temperature)),
              "sampling_warp: temperature must be positive and finite in float32 (greedy rows take the argmax)");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0 && min_p >= 0.0 && min_p <= 1.0 && top_k >= 0,
              "sampling_warp: top_p in (0, 1], min_p in [0, 1], top_k >= 0");
  TORCH_CHECK(bias_ids.scalar_type() == at::kLong && bias_values.scalar_type() == at::kFloat &&
                  bias_ids.dim() == 1 && bias_ids.sizes() == bias_values.sizes(),
              "sampling_warp: bias_ids [n] int64 and bias_values [n] float32");
  const at::Tensor x = logits.contiguous();
  const at::Tensor ids = bias_ids.contiguous(), values = bias_values.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "sampling_warp: empty vocabulary");
  for (int64_t b = 0; b < ids.numel(); ++b)
    TORCH_CHECK(ids.data_ptr<int64_t>()[b] >= 0 && ids.data_ptr<int64_t>()[b] < V, "sampling_warp: bias id out of range");
  at::Tensor out = at::empty({N, V}, x.options().dtype(at::kFloat));
  const WarpParams p{static_cast<float>(temperature), top_k, top_p, min_p, ids.data_ptr<int64_t>(),
                     values.data_ptr<float>(), ids.numel()};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* base = x.data_ptr();
  float* result = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t first, int64_t last) {
    thread_local Scratch scratch;
    for (int64_t row = first; row < last; ++row) {
      if (bf16)
        warp_row(static_cast<const uint16_t*>(base) + row * V, V, p, result + row * V, scratch);
      else
        warp_row(static_cast<const float*>(base) + row * V, V, p, result + row * V, scratch);
    }
  });
  return out;
}

// The first NaN of a row, or -1: torch.argmax takes a NaN as the largest value.
template <typename T>
int64_t first_nan(const T* row, int64_t V) {
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = load8(row + j);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0) break;
  }
  for (; j < V; ++j)
    if (std::isnan(to_float(row[j]))) return j;
  return -1;
}

template <typename T>
void greedy_rows(const T* logits, int64_t N, int64_t V, int64_t* out) {
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * V;
      const int64_t nan = first_nan(row, V);
      out[r] = nan >= 0 ? nan : largest_logit<T>(row, nullptr, 0, V).index;
    }
  });
}

}  // namespace

// greedy_ids: logits [..., V] (float32 or bfloat16) -> [...] int64, each row's torch.argmax (the
// first largest logit; a row holding a NaN, its first NaN), rows split over the threads. ATen's
// argmax reduces a 49,156-id row one element at a time (about 42 us a row on the 2-core EPYC).
at::Tensor greedy_ids(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() >= 1 && logits.size(-1) > 0,
              "greedy_ids takes CPU logits [..., V] with V > 0");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "greedy_ids takes float32 or bfloat16 logits");
  const int64_t V = logits.size(-1);
  const at::Tensor rows = logits.contiguous();
  const int64_t N = rows.numel() / V;
  at::Tensor out = at::empty({N}, logits.options().dtype(at::kLong));
  if (rows.scalar_type() == at::kFloat) {
    greedy_rows(rows.data_ptr<float>(), N, V, out.data_ptr<int64_t>());
  } else {
    greedy_rows(reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>()), N, V, out.data_ptr<int64_t>());
  }
  return out.view(logits.sizes().slice(0, logits.dim() - 1));
}

}  // namespace vlmspec_cpu

TORCH_LIBRARY_FRAGMENT(vlmspec, m) {
  m.def(
      "sampling_warp(Tensor logits, float temperature, int top_k, float top_p, float min_p, Tensor bias_ids, "
      "Tensor bias_values) -> Tensor");
  m.def("greedy_ids(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) {
  m.impl("sampling_warp", vlmspec_cpu::sampling_warp);
  m.impl("greedy_ids", vlmspec_cpu::greedy_ids);
}
