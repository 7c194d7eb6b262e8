// Helpers shared by vlmspec's CPU kernels (cpu_linear.cpp: the linears; cpu_kernels.cpp: norm,
// RoPE + KV write, attention, and the operator registrations; cpu_step.cpp: every decoder layer
// of a step in one call). Built with -mavx2 -mfma; the
// AVX-512 code in cpu_linear.cpp is compiled for AVX-512 and chosen at run time.
#pragma once

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
#include <string>
#include <utility>
#include <vector>

namespace vlmspec_cpu {

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


inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bfloat16 is the top half of a float32: widen 8 of them to 32 bits and shift into place.
inline __m256 load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// The linears' operators (cpu_linear.cpp), registered in cpu_kernels.cpp.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
std::string kernel_isa();
at::Tensor pack_weight(const at::Tensor& weight);
at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const std::optional<at::Tensor>& bias);

// Norm, RoPE + KV write and attention (cpu_kernels.cpp), also called by the layer loop (cpu_step.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor keys,
                      at::Tensor values, const at::Tensor& rows, const at::Tensor& slots, int64_t heads);
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& rows, const at::Tensor& visible, double scaling);

}  // namespace vlmspec_cpu
