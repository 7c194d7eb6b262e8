// y = x @ W.T + b for a few rows of x: the matrix-vector products of a decode or verify step
// on an x86 CPU with AVX2 and FMA (see vlmspec/kernels/cpu_kernels.py for why and when).
//
// W is [N, K], row-major, float32 or bfloat16, as the model stores it: no repacking, so the
// kernel reads each weight once per call, straight from the model's own tensor. Each output
// is a dot product of a row of x with a row of W, summed in float32. The N rows of W are
// split across ATen's intra-op threads. Timings quoted are whole-model passes (weights far
// larger than the caches) on the 2-core AMD EPYC with AVX2. The packed layout (AVX-512) is
// cpu_packed.cpp's.

#include "cpu_common.h"

namespace vlmspec_cpu {
namespace {

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

}  // namespace avx512

#pragma GCC pop_options

}  // namespace

// VLMSPEC_CPU_ISA holds a CPU to an older form of the kernels (how the tests cover every form here):
// "avx2" keeps an AVX-512 CPU on the AVX2 kernels, "avx512_bf16" an AMX CPU off the tiles.
bool isa_held_to(const char* form) {
  const char* isa = std::getenv("VLMSPEC_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, form) == 0;
}
bool avx2_forced() { return isa_held_to("avx2"); }
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

}  // namespace vlmspec_cpu
