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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <string>
#include <vector>

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

// ---- AVX-512: 16 float32 or 32 bfloat16 weights per load ------------------------------
// The same two shapes (one stream per thread for one row, register tiles for several) on
// 512-bit registers, compiled for AVX-512 here and chosen at run time only on CPUs that have
// it. bfloat16 weights times bfloat16 activations use AVX512-BF16's dot product
// (vdpbf16ps): 32 products per instruction, each exact in float32 and summed in float32, so
// an activation that is already bfloat16 (a bfloat16 model's) loses nothing. That takes the
// verify forward from compute-bound back towards the memory bound (benchmarks/target_step.py).

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace avx512 {

// Lane type per weight dtype: a float32 lane holds 1 weight, a bfloat16 pair lane 2.
template <typename W>
struct Lanes;
template <>
struct Lanes<float> {
  static constexpr int64_t kPerVector = 16;
  static __m512 load(const float* p, int64_t left) {
    return left >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), p);
  }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};
template <>
struct Lanes<uint16_t> {
  static constexpr int64_t kPerVector = 32;
  static __m512 load(const uint16_t* p, int64_t left) {
    const __m512i v = left >= 32 ? _mm512_loadu_si512(p)
                                 : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << left) - 1), p);
    return _mm512_castsi512_ps(v);
  }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(w), (__m512bh)_mm512_castps_si512(x));
  }
};

// One row of x (x and w share the element type T): U accumulators over one stream of w.
template <typename T>
inline float row_dot(const T* x, const T* w, int64_t K) {
  using L = Lanes<T>;
  constexpr int U = 4;
  constexpr int64_t V = L::kPerVector;
  __m512 acc[U];
  for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + V * U <= K; k += V * U)
    for (int u = 0; u < U; ++u) acc[u] = L::fma(acc[u], L::load(w + k + V * u, V), L::load(x + k + V * u, V));
  for (; k < K; k += V) acc[0] = L::fma(acc[0], L::load(w + k, K - k), L::load(x + k, K - k));
  for (int u = 1; u < U; ++u) acc[0] = _mm512_add_ps(acc[0], acc[u]);
  return _mm512_reduce_add_ps(acc[0]);
}

template <typename T>
void matvec(const T* x, const T* w, int64_t N, int64_t K, float* out) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) out[n] = row_dot(x, w + n * K, K);
  });
}

// NR rows of w against MR rows of x: NR x MR accumulators, NR weight vectors and one x
// vector in the 32 registers. Full vectors first, then one masked tail, so the hot loop has
// no branch and keeps every accumulator in a register.
template <int NR, int MR, typename T>
inline void dot_tile(const T* x, const T* w, int64_t K, float* out, int64_t ldo) {
  using L = Lanes<T>;
  constexpr int64_t V = L::kPerVector;
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t k, int64_t left) __attribute__((always_inline)) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = L::load(w + r * K + k, left);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = L::load(x + m * K + k, left);
      for (int r = 0; r < NR; ++r) acc[r][m] = L::fma(acc[r][m], wv[r], xv);
    }
  };
  int64_t k = 0;
  for (; k + V <= K; k += V) step(k, V);
  if (k < K) step(k, K - k);
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) out[m * ldo + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// All M rows of x against NR rows of w: 8 rows of x at a time (a whole verify of 8 tokens
// in one pass over the weights), then the rest.
template <int NR, typename T>
inline void row_block(const T* x, int64_t M, const T* w, int64_t N, int64_t K, float* out) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) dot_tile<NR, 8>(x + m * K, w, K, out + m * N, N);
  switch (M - m) {
    case 7: dot_tile<NR, 7>(x + m * K, w, K, out + m * N, N); break;
    case 6: dot_tile<NR, 6>(x + m * K, w, K, out + m * N, N); break;
    case 5: dot_tile<NR, 5>(x + m * K, w, K, out + m * N, N); break;
    case 4: dot_tile<NR, 4>(x + m * K, w, K, out + m * N, N); break;
    case 3: dot_tile<NR, 3>(x + m * K, w, K, out + m * N, N); break;
    case 2: dot_tile<NR, 2>(x + m * K, w, K, out + m * N, N); break;
    case 1: dot_tile<NR, 1>(x + m * K, w, K, out + m * N, N); break;
    default: break;
  }
}

// 3 rows of w x 8 rows of x: 24 accumulators + 3 weight vectors + 1 x vector = 28 of 32 registers.
template <typename T>
void matmul(const T* x, int64_t M, const T* w, int64_t N, int64_t K, float* out) {
  constexpr int NR = 3;
  const int64_t blocks = N / NR;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) row_block<NR>(x, M, w + b * NR * K, N, K, out + b * NR);
  });
  for (int64_t n = blocks * NR; n < N; ++n) row_block<1>(x, M, w + n * K, N, K, out + n);
}

template <typename T>
void linear(const T* x, int64_t M, const T* w, int64_t N, int64_t K, float* out) {
  if (M == 1) matvec(x, w, N, K, out);
  else matmul(x, M, w, N, K, out);
}

// ---- packed weights: 16 outputs per vector, no reductions ------------------------------
// In the [N, K] layout each output is a dot product that ends in a horizontal sum, and the
// 8-row tile above reads the big LM head at half the memory bandwidth. Packed, a block of 16
// outputs stores its weights k-major: one 64-byte vector per k (float32) or per pair of k
// (bfloat16, the pair vdpbf16ps multiplies), so a step loads one weight vector, broadcasts
// one activation (pair) per row of x, and adds into 16 outputs at once.
//   float32:  packed[b][k][i]         = W[16 b + i, k]            [N/16, K, 16]
//   bfloat16: packed[b][k2][i][j]     = W[16 b + i, 2 k2 + j]     [N/16, K/2, 16, 2]
// (N padded to 16 and K to 2 with zeros.)

constexpr int64_t kBlock = 16;

template <typename T>
struct Packed;
template <>
struct Packed<float> {
  static constexpr int64_t kPerStep = 1;  // k values a step consumes
  static __m512 weights(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 activation(const float* x, int64_t step) { return _mm512_set1_ps(x[step]); }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};
template <>
struct Packed<uint16_t> {
  static constexpr int64_t kPerStep = 2;
  static __m512 weights(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static __m512 activation(const uint16_t* x, int64_t step) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * step, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(w), (__m512bh)_mm512_castps_si512(x));
  }
};

// NB blocks of 16 outputs against MR rows of x (rows ldx apart); steps = K / kPerStep.
template <int NB, int MR, typename T>
inline void packed_tile(const T* x, int64_t ldx, const T* w, int64_t steps, float* out, int64_t ldo, int64_t left) {
  using P = Packed<T>;
  constexpr int64_t V = kBlock * P::kPerStep;  // elements of one weight vector
  __m512 acc[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int m = 0; m < MR; ++m) acc[b][m] = _mm512_setzero_ps();
  for (int64_t step = 0; step < steps; ++step) {
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = P::weights(w + (b * steps + step) * V);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = P::activation(x + m * ldx, step);
      for (int b = 0; b < NB; ++b) acc[b][m] = P::fma(acc[b][m], wv[b], xv);
    }
  }
  for (int b = 0; b < NB; ++b) {  // left: outputs of these blocks that exist (the last block may be padding)
    const int64_t valid = std::min<int64_t>(kBlock, left - b * kBlock);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(out + m * ldo + b * kBlock, mask, acc[b][m]);
  }
}

template <int NB, typename T>
inline void packed_rows(const T* x, int64_t M, int64_t ldx, const T* w, int64_t steps, float* out, int64_t N,
                        int64_t left) {
  for (int64_t m = 0; m < M; m += 8) {
    const T* xm = x + m * ldx;
    float* om = out + m * N;
    switch (std::min<int64_t>(8, M - m)) {
      case 8: packed_tile<NB, 8>(xm, ldx, w, steps, om, N, left); break;
      case 7: packed_tile<NB, 7>(xm, ldx, w, steps, om, N, left); break;
      case 6: packed_tile<NB, 6>(xm, ldx, w, steps, om, N, left); break;
      case 5: packed_tile<NB, 5>(xm, ldx, w, steps, om, N, left); break;
      case 4: packed_tile<NB, 4>(xm, ldx, w, steps, om, N, left); break;
      case 3: packed_tile<NB, 3>(xm, ldx, w, steps, om, N, left); break;
      case 2: packed_tile<NB, 2>(xm, ldx, w, steps, om, N, left); break;
      default: packed_tile<NB, 1>(xm, ldx, w, steps, om, N, left); break;
    }
  }
}

// x [M, K] (K padded to kPerStep) times packed weights of N outputs: out [M, N] float32.
// Three blocks a task (24 accumulators for 8 rows; four blocks for one row, to hide the FMA latency).
template <typename T>
void packed_linear(const T* x, int64_t M, int64_t K, const T* w, int64_t N, float* out) {
  const int64_t steps = K / Packed<T>::kPerStep, blocks = (N + kBlock - 1) / kBlock;
  const int64_t block_elems = steps * kBlock * Packed<T>::kPerStep;
  const int64_t group = M == 1 ? 4 : 3, groups = (blocks + group - 1) / group;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * group, count = std::min(group, blocks - first);
      for (int64_t done = 0; done < count;) {  // a full group, else the leftover blocks one by one
        const int64_t n0 = (first + done) * kBlock;
        const T* wg = w + (first + done) * block_elems;
        if (count - done == 4) packed_rows<4>(x, M, K, wg, steps, out + n0, N, N - n0), done += 4;
        else if (count - done == 3) packed_rows<3>(x, M, K, wg, steps, out + n0, N, N - n0), done += 3;
        else packed_rows<1>(x, M, K, wg, steps, out + n0, N, N - n0), done += 1;
      }
    }
  });
}

}  // namespace avx512

#pragma GCC pop_options

// VLMSPEC_CPU_ISA=avx2 keeps an AVX-512 CPU on the AVX2 kernels (how the tests cover both here).
bool avx2_forced() {
  const char* isa = std::getenv("VLMSPEC_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, "avx2") == 0;
}
bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has && !avx2_forced();
}
bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has && cpu_has_avx512();
}

// The float32 sums [M, N] plus the bias, in x's dtype: bfloat16 rounded once here (as
// ATen's float -> bfloat16 conversion rounds), without two more ATen calls per linear.
at::Tensor finish(const at::Tensor& sums, const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  const float* sp = sums.data_ptr<float>();
  const int64_t M = sums.size(0), N = sums.size(1);
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    bp = b.data_ptr<float>();
  }
  if (dtype == at::kFloat) {
    if (bp != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) const_cast<float*>(sp)[m * N + n] += bp[n];
    return sums;
  }
  TORCH_CHECK(dtype == at::kBFloat16, "skinny_linear: float32 or bfloat16 activations, got ", dtype);
  at::Tensor out = at::empty({M, N}, sums.options().dtype(at::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) op[m * N + n] = at::BFloat16(sp[m * N + n] + (bp != nullptr ? bp[n] : 0.0f));
  return out;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "skinny_linear: float32 or bfloat16 weights, got ", weight.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "skinny_linear: float32 or bfloat16 activations, got ", x.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor sums = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* out = sums.data_ptr<float>();
  if (weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && cpu_has_avx512_bf16()) {
    const at::Tensor xc = x.contiguous();
    avx512::linear(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M,
                   reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N, K, out);
    return finish(sums, bias, x.scalar_type());
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  if (weight.scalar_type() == at::kFloat && cpu_has_avx512()) {
    avx512::linear(xf.data_ptr<float>(), M, w.data_ptr<float>(), N, K, out);
  } else if (weight.scalar_type() == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    if (M == 1) matvec(xf.data_ptr<float>(), wp, N, K, out);
    else matmul(xf.data_ptr<float>(), M, wp, N, K, out);
  } else {
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    if (M == 1) matvec(permute_for_bfloat16(xf).data_ptr<float>(), wp, N, K, out);
    else matmul(xf.data_ptr<float>(), M, wp, N, K, out);
  }
  return finish(sums, bias, x.scalar_type());
}

// The ISA the linears run on here: "avx512_bf16", "avx512" or "avx2" (VLMSPEC_CPU_ISA=avx2 included).
std::string kernel_isa() { return cpu_has_avx512_bf16() ? "avx512_bf16" : cpu_has_avx512() ? "avx512" : "avx2"; }

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_weight: weight [N, K] expected, got ", weight.sizes());
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || weight.scalar_type() == at::kFloat, "pack_weight: float32 or bfloat16, got ",
              weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1), per_step = bf16 ? 2 : 1;
  const int64_t blocks = (N + avx512::kBlock - 1) / avx512::kBlock, steps = (K + per_step - 1) / per_step;
  // [blocks, 16, steps, per_step] padded, then k-steps outermost within a block.
  at::Tensor padded = at::zeros({blocks * avx512::kBlock, steps * per_step}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({blocks, avx512::kBlock, steps, per_step}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == avx512::kBlock && x.dim() == 2,
              "packed_linear: x [M, K] and a weight from pack_weight expected");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "packed_linear: x must have the packed weight's dtype, got ",
              x.scalar_type(), " and ", packed.scalar_type());
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 ? cpu_has_avx512_bf16() : cpu_has_avx512(), "packed_linear: needs ",
              bf16 ? "AVX512-BF16" : "AVX-512", " (check kernel_isa() before packing)");
  const int64_t M = x.size(0), per_step = packed.size(3), K = packed.size(1) * per_step;
  TORCH_CHECK(x.size(1) <= K && x.size(1) > K - per_step && out_features <= packed.size(0) * avx512::kBlock,
              "packed_linear: x has ", x.size(1), " inputs, the packed weight ", K);
  at::Tensor xc = x.contiguous();
  if (x.size(1) != K) xc = at::constant_pad_nd(xc, {0, K - x.size(1)});  // an odd K: pad the last pair
  at::Tensor sums = at::empty({M, out_features}, x.options().dtype(at::kFloat));
  if (bf16) {
    avx512::packed_linear(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K,
                          reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), out_features,
                          sums.data_ptr<float>());
  } else {
    avx512::packed_linear(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), out_features, sums.data_ptr<float>());
  }
  return finish(sums, bias, x.scalar_type());
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

// ---- attention of a few new tokens over their rows' KV buffers ------------------------
// A decode step attends one query (a verify: a few) per head over a few hundred cached keys:
// about 150k multiply-adds a layer, which SDPA's CPU kernel takes 150-300 us to set up and
// run. Here each (token, head) pair is one task: scores against its row's visible slots,
// softmax in float32, then the weighted sum of values, all on AVX2 vectors of 8.
//
// query [B, H, hd]; keys, values [R_cap, Hkv, S_cap, hd] (the runner's buffers); rows [B] the
// buffer row of each packed token; visible [B] how many slots it sees (its own slot + 1:
// committed tokens, then the new ones causally). Heads share KV heads in groups of H / Hkv.

// exp of 8 floats <= 0 (scores minus their maximum), to about 2 ulp: Cody-Waite reduction
// to r in [-ln2/2, ln2/2], Cephes' degree-6 polynomial for exp(r), times 2^n. Below -87 the
// result is flushed to 0, where float32 exp would be denormal or 0 anyway.
inline __m256 exp8(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

// The sums of 8 vectors, as one vector: lane i holds the sum of v[i]'s 8 lanes.
inline __m256 horizontal_sums(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // 0 1 2 3 | 0 1 2 3
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // 4 5 6 7 | 4 5 6 7
  const __m256 low = _mm256_permute2f128_ps(a, b, 0x20), high = _mm256_permute2f128_ps(a, b, 0x31);
  return _mm256_add_ps(low, high);
}

template <typename T>
void attend_one(const float* q, const T* keys, const T* values, int64_t visible, int64_t hd, float scaling,
                float* scores, float* out) {
  float top = -INFINITY;
  int64_t j = 0;
  for (; j + 8 <= visible; j += 8) {  // 8 keys at a time, their 8 sums reduced together
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(keys + (j + i) * hd + d), acc[i]);
    }
    const __m256 sums = _mm256_mul_ps(horizontal_sums(acc), _mm256_set1_ps(scaling));
    _mm256_storeu_ps(scores + j, sums);
  }
  for (; j < visible; ++j) {
    const T* k = keys + j * hd;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
    scores[j] = horizontal_sum(acc) * scaling;
  }
  for (j = 0; j < visible; ++j) top = std::max(top, scores[j]);
  // exp over 8 scores at a time: scalar std::exp was most of a decode step's attention.
  __m256 sums = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (j = 0; j + 8 <= visible; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
    _mm256_storeu_ps(scores + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  float total = horizontal_sum(sums);
  for (; j < visible; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  // Weighted sum of values: 4 independent sums per 8 lanes, so the FMA latency is hidden.
  for (int64_t d = 0; d < hd; d += 8) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (j = 0; j + 4 <= visible; j += 4)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(scores[j + u]), load8(values + (j + u) * hd + d), acc[u]);
    for (; j < visible; ++j) acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(scores[j]), load8(values + j * hd + d), acc[0]);
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(sum, _mm256_set1_ps(1.0f / total)));
  }
}

// A task is (a run of up to 4 consecutive tokens of one row, one KV head): the 4 x H / Hkv
// queries it serves read that KV head's keys and values, which a bfloat16 buffer has widened
// to float32 once per task rather than once per query.
constexpr int64_t kTokensPerTask = 4;

inline void widen(const float* src, int64_t n, std::vector<float>& scratch, const float*& out) { out = src; }
inline void widen(const uint16_t* src, int64_t n, std::vector<float>& scratch, const float*& out) {
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(scratch.data() + i, load8(src + i));
  out = scratch.data();
}

template <typename T>
void attend_all(const float* query, const T* keys, const T* values, const int64_t* rows, const int64_t* visible,
                int64_t B, int64_t H, int64_t Hkv, int64_t slots, int64_t hd, float scaling, float* out) {
  const int64_t group = H / Hkv, row_stride = Hkv * slots * hd;
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first token, end token) of each run
  for (int64_t b = 0; b < B;) {
    int64_t end = b + 1;
    while (end < B && end - b < kTokensPerTask && rows[end] == rows[b]) ++end;
    runs.emplace_back(b, end);
    b = end;
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, visible[b]);
  const int64_t tasks = static_cast<int64_t>(runs.size()) * Hkv;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(longest)), key_scratch, value_scratch;
    for (int64_t task = begin; task < end; ++task) {
      const auto [first, last] = runs[task / Hkv];
      const int64_t g = task % Hkv, offset = rows[first] * row_stride + g * slots * hd;
      int64_t reach = 0;
      for (int64_t b = first; b < last; ++b) reach = std::max(reach, visible[b]);
      const float *k, *v;
      widen(keys + offset, reach * hd, key_scratch, k);
      widen(values + offset, reach * hd, value_scratch, v);
      for (int64_t b = first; b < last; ++b)
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
          attend_one(query + (b * H + h) * hd, k, v, visible[b], hd, scaling, scores.data(), out + (b * H + h) * hd);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& rows, const at::Tensor& visible, double scaling) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && keys.sizes() == values.sizes(),
              "decode_attention: query [B, H, hd] and keys/values [R, Hkv, S, hd] expected, got ", query.sizes(),
              " and ", keys.sizes());
  const int64_t B = query.size(0), H = query.size(1), hd = query.size(2);
  const int64_t Hkv = keys.size(1), slots = keys.size(2);
  TORCH_CHECK(keys.size(3) == hd && hd % 8 == 0 && H % Hkv == 0,
              "decode_attention: head_dim a multiple of 8 and heads a multiple of KV heads expected");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "decode_attention: contiguous KV buffers expected");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16,
              "decode_attention: float32 or bfloat16 KV, got ", keys.scalar_type());
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor r = rows.to(at::kLong).contiguous(), v = visible.to(at::kLong).contiguous();
  const int64_t* vp = v.data_ptr<int64_t>();
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < keys.size(0) && vp[b] >= 1 && vp[b] <= slots,
                "decode_attention: row or visible slots out of range for token ", b);
  at::Tensor out = at::empty({B, H, hd}, q.options());
  const float scale = static_cast<float>(scaling);
  if (keys.scalar_type() == at::kFloat) {
    attend_all(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), rp, vp, B, H, Hkv, slots, hd,
               scale, out.data_ptr<float>());
  } else {
    attend_all(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), rp, vp, B, H, Hkv, slots, hd,
               scale, out.data_ptr<float>());
  }
  return out.to(query.scalar_type());
}

// ---- RoPE on q and k, and the KV write, in one call ---------------------------------------
// After a layer's fused q/k/v projection, the eager path slices, rolls, multiplies and adds
// per head and then scatters k and v into the KV buffers: a dozen ATen calls a layer. This
// is the same arithmetic with the same roundings (each product and the sum rounded to the
// model's dtype, as transformers' `x * cos + rotate_half(x) * sin` rounds; the file is built
// with -ffp-contract=off so float32 is not fused either), reading qkv once.
//
// qkv [B, (H + 2 Hkv) hd]; cos, signed_sin [B, hd] (the sin's first half negated, see
// packed.py); keys, values [R_cap, Hkv, S_cap, hd]; rows, slots [B]. Returns q [B, H, hd].

template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, int64_t hd, T* out) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) {
    const T direct = static_cast<T>(static_cast<float>(x[d]) * static_cast<float>(cos[d]));
    const T rolled = static_cast<T>(static_cast<float>(x[(d + half) % hd]) * static_cast<float>(sin[d]));
    out[d] = static_cast<T>(static_cast<float>(direct) + static_cast<float>(rolled));
  }
}

template <typename T>
void rope_write_rows(const T* qkv, const T* cos, const T* sin, T* keys, T* values, const int64_t* rows,
                     const int64_t* slots, int64_t B, int64_t H, int64_t Hkv, int64_t slots_cap, int64_t hd, T* q) {
  const int64_t width = (H + 2 * Hkv) * hd;
  for (int64_t b = 0; b < B; ++b) {
    const T* x = qkv + b * width;
    for (int64_t h = 0; h < H; ++h) rotate_head(x + h * hd, cos + b * hd, sin + b * hd, hd, q + (b * H + h) * hd);
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t at = ((rows[b] * Hkv + g) * slots_cap + slots[b]) * hd;
      rotate_head(x + (H + g) * hd, cos + b * hd, sin + b * hd, hd, keys + at);
      std::memcpy(values + at, x + (H + Hkv + g) * hd, hd * sizeof(T));
    }
  }
}

at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor keys,
                      at::Tensor values, const at::Tensor& rows, const at::Tensor& slots, int64_t heads) {
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous(),
              "rope_write: contiguous KV buffers [R, Hkv, S, hd] expected, got ", keys.sizes());
  const int64_t B = qkv.size(0), Hkv = keys.size(1), slots_cap = keys.size(2), hd = keys.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * Hkv) * hd && cos.sizes() == signed_sin.sizes() &&
                  cos.size(0) == B && cos.size(1) == hd,
              "rope_write: qkv [B, (H + 2 Hkv) hd] and cos/sin [B, hd] expected, got ", qkv.sizes(), " and ",
              cos.sizes());
  TORCH_CHECK(qkv.scalar_type() == keys.scalar_type() && cos.scalar_type() == keys.scalar_type(),
              "rope_write: qkv, cos/sin and the KV buffers must share a dtype");
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), sn = signed_sin.contiguous();
  const at::Tensor r = rows.to(at::kLong).contiguous(), sl = slots.to(at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(r.data_ptr<int64_t>()[b] >= 0 && r.data_ptr<int64_t>()[b] < keys.size(0) &&
                    sl.data_ptr<int64_t>()[b] >= 0 && sl.data_ptr<int64_t>()[b] < slots_cap,
                "rope_write: row or slot out of range for token ", b);
  at::Tensor q = at::empty({B, heads, hd}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rope_write_rows(x.data_ptr<float>(), c.data_ptr<float>(), sn.data_ptr<float>(), keys.data_ptr<float>(),
                    values.data_ptr<float>(), r.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, heads, Hkv, slots_cap,
                    hd, q.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rope_write: float32 or bfloat16, got ", x.scalar_type());
    rope_write_rows(x.data_ptr<at::BFloat16>(), c.data_ptr<at::BFloat16>(), sn.data_ptr<at::BFloat16>(),
                    keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(), r.data_ptr<int64_t>(),
                    sl.data_ptr<int64_t>(), B, heads, Hkv, slots_cap, hd, q.data_ptr<at::BFloat16>());
  }
  return q;
}

}  // namespace

TORCH_LIBRARY(vlmspec, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("kernel_isa() -> str", &kernel_isa);
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def(
      "rope_write(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) keys, Tensor(b!) values, Tensor rows, "
      "Tensor slots, int heads) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor rows, Tensor visible, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) {
  m.impl("skinny_linear", skinny_linear);
  m.impl("rms_norm", rms_norm);
  m.impl("decode_attention", decode_attention);
  m.impl("rope_write", rope_write);
  m.impl("pack_weight", pack_weight);
  m.impl("packed_linear", packed_linear_op);
}
