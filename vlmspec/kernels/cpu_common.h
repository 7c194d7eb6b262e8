// Helpers shared by vlmspec's CPU kernels: cpu_linear.cpp (linears over weights as stored),
// cpu_packed.cpp (linears over packed weights, AVX-512), cpu_kernels.cpp (norm, RoPE + KV write,
// the operator registrations), cpu_attention.cpp (attention over the KV pages), cpu_step.cpp
// (every decoder layer of a step in one call; its weight layout is cpu_layers.h), cpu_sampling.cpp
// (the sampler) and cpu_draft.cpp / cpu_draft_head.cpp (the DSpark drafting round). Built with
// -mavx2 -mfma; the AVX-512 code is compiled for AVX-512 in its own sections and chosen at run time.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
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

// ---- how a kernel splits its tasks over the threads ----------------------------------------
// A kernel called on its own forks the threads and joins them (at::parallel_for). Inside the
// native step (cpu_step.cpp: every layer of a step in one parallel region), the threads are
// already running as a team: each takes its own share of the same call, and the step puts a
// barrier between calls. A task's arithmetic never depends on which thread runs it or how the
// range was split, so both ways compute the same values bit for bit.
struct Team {
  int64_t member, size;
  std::atomic<int64_t>* counters;  // [4] zeroed: split_dynamic's shared task counters, reused in turn
};
inline thread_local const Team* current_team = nullptr;
inline thread_local int64_t team_dynamic_calls = 0;  // split_dynamic calls this member has made in the team

// fn(begin, end) over [begin, end): at::parallel_for's split (and its rule that a range of at most
// `grain` tasks runs on one thread), or, in a team, this member's contiguous share.
template <typename F>
void split_tasks(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const Team* team = current_team;
  if (team == nullptr) {
    at::parallel_for(begin, end, grain, fn);
    return;
  }
  const int64_t count = end - begin;
  if (count <= 0) return;
  if (count <= grain || team->size == 1) {  // one thread's work: the first member does it
    if (team->member == 0) fn(begin, end);
    return;
  }
  const int64_t share = (count + team->size - 1) / team->size;
  const int64_t first = begin + team->member * share, last = std::min(end, first + share);
  if (first < last) fn(first, last);
}

// Chunks of `chunk` tasks pulled from a shared counter, so that the thread that reads memory
// faster takes more of them instead of waiting at the end of the call (the threads' shares of a
// linear's weights arrive at different speeds: measured 4-9% off the LM head's call alone). The AMX
// tile path uses it; the AVX-512 packed path reads contiguous shares instead (split_tasks), which
// measured faster end to end because each thread then reads one sequential stream (cpu_packed.cpp). Called
// on its own, it opens a parallel region for the call (one thread's worth, at most `grain` tasks,
// runs inline). In a team, every member must make the same split_dynamic calls in the same order,
// with at least one barrier between two calls: the counter of call k is reset by the first member
// during call k - 2.
template <typename F>
void pull_chunks(std::atomic<int64_t>& next, int64_t begin, int64_t end, int64_t chunk, const F& fn) {
  for (int64_t first = begin + chunk * next.fetch_add(1, std::memory_order_relaxed); first < end;
       first = begin + chunk * next.fetch_add(1, std::memory_order_relaxed))
    fn(first, std::min(end, first + chunk));
}

template <typename F>
void split_dynamic(int64_t begin, int64_t end, int64_t grain, int64_t chunk, const F& fn) {
  const Team* team = current_team;
  if (team != nullptr) {
    const int64_t call = team_dynamic_calls++;
    if (team->member == 0) team->counters[(call + 2) % 4].store(0, std::memory_order_relaxed);
    pull_chunks(team->counters[call % 4], begin, end, chunk, fn);
    return;
  }
  if (end - begin <= grain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    if (begin < end) fn(begin, end);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(at::get_num_threads())
  pull_chunks(next, begin, end, chunk, fn);
}

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

// The sums of 8 vectors, as one vector: lane i holds the sum of v[i]'s 8 lanes.
inline __m256 horizontal_sums(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // 0 1 2 3 | 0 1 2 3
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // 4 5 6 7 | 4 5 6 7
  const __m256 low = _mm256_permute2f128_ps(a, b, 0x20), high = _mm256_permute2f128_ps(a, b, 0x31);
  return _mm256_add_ps(low, high);
}

// exp(r) for x = n ln2 + r (Cody-Waite reduction to r in [-ln2/2, ln2/2], Cephes' degree-6
// polynomial, about 1 ulp), with n returned: the part every exp here shares (exp8 below, and
// cpu_sampling.cpp's exp8_subnormal, which applies 2^n so that subnormal results are formed).
inline __m256 exp8_reduced(__m256 x, __m256* n_out) {
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
  *n_out = n;
  return _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
}

// exp of 8 floats <= 0 (attention's scores minus their maximum; SiLU's -|x|), to about 2 ulp:
// exp8_reduced times 2^n. Below -87 the result is flushed to 0, where float32 exp would be
// denormal or 0 anyway. (cpu_attention.cpp's exp16 is this arithmetic on 16 lanes, for AVX-512.)
inline __m256 exp8(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  __m256 n;
  const __m256 y = exp8_reduced(_mm256_max_ps(x, floor_x), &n);
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

// x rounded to bfloat16 and widened back: round to nearest even, NaN to the quiet NaN 0x7FC0, exactly as
// c10::BFloat16's constructor and ATen's vectorised conversions round (no flush of subnormals, unlike
// vcvtneps2bf16). For float32 there is nothing to round.
inline __m256 round_as(const float*, __m256 x) { return x; }
inline __m256 round_as(const uint16_t*, __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, bias), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), is_nan);
}

// One value: rounded as round_as rounds (float32: unchanged), and stored in T's format.
inline float round_one(const float*, float v) { return v; }
inline float round_one(const uint16_t*, float v) { return static_cast<float>(c10::BFloat16(v)); }
inline float from_float(const float*, float v) { return v; }
inline uint16_t from_float(const uint16_t*, float v) { return c10::BFloat16(v).x; }

// Store 8 values already rounded by round_as (bfloat16: their top halves).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(v), 16);  // < 2^16: packus does not saturate
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// ---- SiLU(gate) * up (the target step and the drafting round) --------------------------------------------------------
// ATen's silu and mul are two dispatches and two passes over [B, I] (about 12 us a layer for one
// token in bfloat16, 24 for eight). Here each value is silu(g) = g * sigmoid(g) in float32, with
// sigmoid from exp8(-|g|) (exact to a few ulp of float32: the rounding to bfloat16 hides that),
// rounded to the model's dtype, times u, rounded again: the roundings of act(gate) * up.

template <typename T>
inline void silu_mul_8(const T* gate, const T* up, T* out) {
  const __m256 g = load8(gate);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));  // exp(-|g|)
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 positive = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
  const __m256 activated = round_as(gate, _mm256_mul_ps(g, sigmoid));
  store8(out, round_as(gate, _mm256_mul_ps(activated, load8(up))));
}

// Blocks of 8 values, split between the threads (a verify's 8 rows of 4,608 values is too little
// for whole rows a thread: the threads' wake-up would cost more than it saves).
template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t inner, T* out) {
  const int64_t blocks = (inner + 7) / 8;
  split_tasks(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t r = index / blocks, j = (index % blocks) * 8;
      const T* gate = gate_up + r * 2 * inner + j;
      const T* up = gate + inner;
      T* row_out = out + r * inner + j;
      if (j + 8 <= inner) {
        silu_mul_8(gate, up, row_out);
      } else {  // the tail through the same 8 lanes, so every value takes the same arithmetic
        T g[8] = {}, u[8] = {}, o[8];
        std::copy(gate, gate + (inner - j), g);
        std::copy(up, up + (inner - j), u);
        silu_mul_8(g, u, o);
        std::copy(o, o + (inner - j), row_out);
      }
    }
  });
}

// The linears' operators (cpu_linear.cpp, cpu_packed.cpp), registered in cpu_kernels.cpp.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
std::string kernel_isa();
at::Tensor pack_weight(const at::Tensor& weight);
at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const std::optional<at::Tensor>& bias);

// The packed linear on raw pointers (x [M, K] with K the packed weight's padded K, out [M, N], both
// in the weight's dtype), for the native step; the bias, if any, as packed_linear_bias_ready accepts.
void packed_linear_into(const at::Tensor& packed, int64_t out_features, const at::Tensor* bias, const void* x,
                        int64_t M, void* out);
bool packed_linear_bias_ready(const at::Tensor& packed, const at::Tensor& bias);  // contiguous, its dtype or float32
bool cpu_has_avx512();

// Whether AVX512-BF16 kernels may run here (cpu_linear.cpp; false under VLMSPEC_CPU_ISA=avx2).
bool cpu_has_avx512_bf16();
// Whether the bfloat16 packed linears run on AMX tiles here (cpu_packed.cpp: an AMX-BF16 CPU, Linux's
// permission granted, built with a compiler that knows AMX; false under VLMSPEC_CPU_ISA=avx512_bf16).
bool kernel_uses_amx();
// Whether VLMSPEC_CPU_ISA holds this process to `form` ("avx2", "avx512_bf16"; cpu_linear.cpp).
bool isa_held_to(const char* form);

// ---- the block-paged KV pool (vlmspec/targets/pool.py) -----------------------------------------
// A layer's keys (and values) are a pool of blocks [N, Hkv, bs, hd]. Row r's slot j lives in block
// tables[r * width + j / bs] at offset j % bs. A contiguous buffer [R, Hkv, S, hd] is the pool in which
// row r owns the one block r of S slots (decode_attention's form). The attention reads keys in groups of
// up to 16 slots that start at a multiple of 16, so a pool of several blocks per row needs bs a power of
// two and a multiple of 16: a group never straddles two blocks.
struct KVPages {
  const int64_t* tables;  // [R, width] int64: each row's blocks, in order
  int64_t width;          // blocks per table row
  int64_t Hkv, bs, hd;    // the pool's KV heads, block size and head dim
  int shift;              // log2(bs), or 63 where every row has one block (j >> 63 == 0 for a slot j >= 0)
  int64_t mask;           // bs - 1, or all ones with one block

  KVPages(const int64_t* tables_, int64_t width_, const at::Tensor& pool) : tables(tables_), width(width_) {
    Hkv = pool.size(1), bs = pool.size(2), hd = pool.size(3);
    if (width == 1) {
      shift = 63, mask = -1;
    } else {
      shift = 0;
      while ((int64_t{1} << shift) < bs) ++shift;
      mask = bs - 1;
    }
  }
  // Whether a pool of these blocks can be read through such tables (see above).
  static bool readable(int64_t width, int64_t bs) { return width == 1 || (bs >= 16 && bs % 16 == 0 && (bs & (bs - 1)) == 0); }
  // Element offset of row `row`'s slot j for KV head g in the pool (keys and values alike).
  int64_t at(int64_t row, int64_t g, int64_t j) const {
    return ((tables[row * width + (j >> shift)] * Hkv + g) * bs + (j & mask)) * hd;
  }
};

// One (row, KV head)'s slots: the offset of slot j, and of a group of slots that share a block.
struct HeadSlots {
  const KVPages* pages;
  int64_t row, g;
  int64_t operator()(int64_t j) const { return pages->at(row, g, j); }
  // Slots from j to the end of j's block (one block a row: to the end of the row's buffer).
  int64_t left(int64_t j) const { return pages->bs - (j & pages->mask); }
};

// Norm, RoPE + KV write (cpu_kernels.cpp) and attention (cpu_attention.cpp), also called by the native step
// (cpu_step.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor keys,
                      at::Tensor values, const at::Tensor& rows, const at::Tensor& slots, int64_t heads);
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& rows, const at::Tensor& visible, double scaling);
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& visible, double scaling);

// The same three on raw pointers into tensors the caller checked and allocated (the native step's
// team calls them; `grain`: tasks at or below which one thread does the call, see split_tasks).
void rms_norm_into(const at::Tensor& weight, const void* x, int64_t rows, int64_t d, double eps, void* out,
                   int64_t grain);
void rope_write_into(const void* qkv, const void* cos, const void* signed_sin, const at::Tensor& keys,
                     const at::Tensor& values, const int64_t* rows, const int64_t* slots, int64_t B, int64_t heads,
                     void* q, int64_t grain);
int64_t attention_grain(int64_t seen, int64_t H, int64_t hd, int64_t B);  // decode_attention's (seen: keys read)
void attention_into(const void* query, bool bf16_q, const at::Tensor& keys, const at::Tensor& values,
                    const KVPages& pages, const int64_t* rows, const int64_t* visible, int64_t B, int64_t H,
                    double scaling, int64_t grain, void* out);

// A greedy pick's share: the largest logit over a range of the vocabulary and where (the first such index).
struct Best {
  float value;
  int64_t index;
};

// The first index of the largest base[j] (+ bias[j], summed in float32) over [first, last), and
// that value, 8 lanes at a time (each lane keeps its first largest; the lanes' tie goes to the
// lowest index): torch.argmax's pick over finite logits. The drafting round's greedy draws and
// greedy_ids (cpu_sampling.cpp) take it.
template <typename T>
Best largest_logit(const T* base, const T* bias, int64_t first, int64_t last) {
  const auto logit8 = [&](int64_t j) {
    return bias == nullptr ? load8(base + j) : _mm256_add_ps(load8(base + j), load8(bias + j));
  };
  Best best{-INFINITY, first};
  int64_t j = first;
  if (j + 8 <= last) {
    __m256 top = logit8(j);
    __m256i where = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)),  // each lane's index
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i index = where;
    for (j += 8; j + 8 <= last; j += 8) {
      where = _mm256_add_epi32(where, _mm256_set1_epi32(8));
      const __m256 v = logit8(j);
      const __m256 larger = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
      top = _mm256_blendv_ps(top, v, larger);
      index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(index), _mm256_castsi256_ps(where), larger));
    }
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), index);
    best = {values[0], indices[0]};
    for (int i = 1; i < 8; ++i)
      if (values[i] > best.value || (values[i] == best.value && indices[i] < best.index))
        best = {values[i], indices[i]};
  }
  for (; j < last; ++j) {
    const float v = bias == nullptr ? to_float(base[j]) : to_float(base[j]) + to_float(bias[j]);
    if (v > best.value || j == first) best = {v, j};
  }
  return best;
}

}  // namespace vlmspec_cpu
