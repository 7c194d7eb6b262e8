// y = x @ W.T + b for a few rows of x: the matrix-vector products of a decode or verify step
// on an x86 CPU with AVX2 and FMA (see vlmspec/targets/cpu_kernels.py for why and when).
//
// W is [N, K], row-major, float32 or bfloat16, as the model stores it: no repacking, so the
// kernel reads each weight once per call, straight from the model's own tensor. Each output
// is a dot product of a row of x with a row of W, summed in float32. The N rows of W are
// split across ATen's intra-op threads. Timings quoted are whole-model passes (weights far
// larger than the caches) on the 2-core AMD EPYC with AVX2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

inline float to_float(float v) { return v; }

inline float to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- one row of x: a pure stream over W ---------------------------------------------
// A thread reads its rows of W one after the other, a single sequential stream that the
// hardware prefetcher follows, with U independent accumulators to cover the FMA latency.
// (8 rows at a time, 8 streams, read 15-25% slower on the AVX2 EPYC.)

constexpr int kUnroll = 4;

inline float row_dot(const float* x, const float* w, int64_t K) {
  __m256 acc[kUnroll];
  for (int u = 0; u < kUnroll; ++u) acc[u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * kUnroll <= K; k += 8 * kUnroll)
    for (int u = 0; u < kUnroll; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * u), _mm256_loadu_ps(x + k + 8 * u), acc[u]);
  for (; k + 8 <= K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), acc[0]);
  for (int u = 1; u < kUnroll; ++u) acc[0] = _mm256_add_ps(acc[0], acc[u]);
  float sum = horizontal_sum(acc[0]);
  for (; k < K; ++k) sum += w[k] * x[k];
  return sum;
}

// bfloat16: 16 weights per 32-byte load. Shifting each 32-bit lane left by 16 gives the
// even-indexed weights as float32, masking off its low half the odd-indexed ones, so x
// comes permuted to match (see permute_for_bfloat16): per 16-block, 8 evens then 8 odds.
inline float row_dot(const float* x_permuted, const uint16_t* w, int64_t K) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[kUnroll];
  for (int u = 0; u < kUnroll; ++u) acc[u] = _mm256_setzero_ps();
  auto step = [&](int64_t k, __m256& a) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(x_permuted + k), a);
    a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high_half)), _mm256_loadu_ps(x_permuted + k + 8), a);
  };
  int64_t k = 0;
  for (; k + 16 * kUnroll <= K; k += 16 * kUnroll)
    for (int u = 0; u < kUnroll; ++u) step(k + 16 * u, acc[u]);
  for (; k + 16 <= K; k += 16) step(k, acc[0]);
  for (int u = 1; u < kUnroll; ++u) acc[0] = _mm256_add_ps(acc[0], acc[u]);
  float sum = horizontal_sum(acc[0]);
  for (; k < K; ++k) sum += to_float(w[k]) * x_permuted[k];  // the tail is not permuted
  return sum;
}

// x [M, K] -> the same values, each full 16-block reordered as its 8 even then 8 odd elements.
at::Tensor permute_for_bfloat16(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 16;
  at::Tensor out = x.clone();
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < 8; ++j) {
        dst[m * K + b * 16 + j] = src[m * K + b * 16 + 2 * j];
        dst[m * K + b * 16 + 8 + j] = src[m * K + b * 16 + 2 * j + 1];
      }
  return out;
}

template <typename W>
void matvec(const float* x, const W* w, int64_t N, int64_t K, float* out) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) out[n] = row_dot(x, w + n * K, K);
  });
}

// ---- several rows of x: tiles that reuse each load --------------------------------
// Verifying a few drafts is compute-bound: a tile of NR rows of W against MR rows of x
// holds NR x MR accumulators, NR weights and one x vector in the 16 AVX registers. 4 x 2
// (13 registers) measured fastest for 4-12 rows; 4 x 3 spills and ran at half its speed.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bfloat16 is the top half of a float32: widen 8 of them to 32 bits and shift into place.
inline __m256 load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// out[m * ldo + r] = x[m, :] . w[r, :] for r < NR and m < MR; x rows and w rows are K long.
template <int NR, int MR, typename W>
inline void dot_tile(const float* x, const W* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t whole = K - K % 8;
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load8(w + r * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  // Reduce before the tail: a tail loop that reads the accumulators makes GCC keep them in memory.
  float sums[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) sums[r][m] = horizontal_sum(acc[r][m]);
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      for (int64_t j = whole; j < K; ++j) sums[r][m] += to_float(w[r * K + j]) * x[m * K + j];
      out[m * ldo + r] = sums[r][m];
    }
}

// All M rows of x against NR rows of w, MR rows of x at a time.
template <int NR, int MR, typename W>
inline void row_block(const float* x, int64_t M, const W* w, int64_t N, int64_t K, float* out) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) dot_tile<NR, MR>(x + m * K, w, K, out + m * N, N);
  for (; m < M; ++m) dot_tile<NR, 1>(x + m * K, w, K, out + m * N, N);
}

template <typename W>
void matmul(const float* x, int64_t M, const W* w, int64_t N, int64_t K, float* out) {
  constexpr int NR = 4, MR = 2;
  const int64_t blocks = N / NR;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) row_block<NR, MR>(x, M, w + b * NR * K, N, K, out + b * NR);
  });
  for (int64_t n = blocks * NR; n < N; ++n) row_block<1, 1>(x, M, w + n * K, N, K, out + n);
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "skinny_linear: float32 or bfloat16 weights, got ", weight.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, xf.options());
  if (weight.scalar_type() == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    if (M == 1) matvec(xf.data_ptr<float>(), wp, N, K, out.data_ptr<float>());
    else matmul(xf.data_ptr<float>(), M, wp, N, K, out.data_ptr<float>());
  } else {
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    if (M == 1) matvec(permute_for_bfloat16(xf).data_ptr<float>(), wp, N, K, out.data_ptr<float>());
    else matmul(xf.data_ptr<float>(), M, wp, N, K, out.data_ptr<float>());
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

// ---- RMSNorm in one call ------------------------------------------------------------
// transformers' Qwen-VL RMSNorm is eight tensor ops, each a few microseconds of dispatch on
// a vector of a few hundred floats: 60 per step of the reference target. This is the same
// arithmetic in the same order of roundings: x in float32, mean of squares, x * 1/sqrt(var
// + eps), rounded to x's dtype, then times the weight, rounded again.

template <typename T>
void rms_norm_rows(const T* x, const T* weight, int64_t rows, int64_t d, float eps, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * d;
    float sum = 0.0f;
    for (int64_t j = 0; j < d; ++j) sum += static_cast<float>(row[j]) * static_cast<float>(row[j]);
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
    for (int64_t j = 0; j < d; ++j) {
      const T normed = static_cast<T>(static_cast<float>(row[j]) * inverse);
      out[r * d + j] = static_cast<T>(static_cast<float>(weight[j]) * static_cast<float>(normed));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x [..., d] and weight [d] of one dtype expected, got ", x.sizes(), " ", x.scalar_type(),
              " and ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t d = xc.size(-1), rows = d ? xc.numel() / d : 0;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), rows, d, static_cast<float>(eps), out.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16, got ", x.scalar_type());
    rms_norm_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), rows, d, static_cast<float>(eps),
                  out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(vlmspec, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) {
  m.impl("skinny_linear", skinny_linear);
  m.impl("rms_norm", rms_norm);
}
