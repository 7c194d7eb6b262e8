// Attention of a few new tokens over their rows' KV pages, for decode and verify steps
// (decode_attention, paged_attention, and attention_into for the native step; registered in
// cpu_kernels.cpp; see vlmspec/kernels/cpu_kernels.py).

#include "cpu_common.h"

namespace vlmspec_cpu {

namespace {

// ---- attention of a few new tokens over their rows' KV buffers ------------------------
// A decode step attends one query (a verify: a few) per head over a few hundred cached keys:
// about 150k multiply-adds a layer, which SDPA's CPU kernel takes 150-300 us to set up and
// run. Here each (token, head) pair is one task: scores against its row's visible slots,
// softmax in float32, then the weighted sum of values. A task reads the buffers in their own
// dtype (no widened copy), its scratch is per thread and reused across calls, and it writes its
// head of the output in the query's dtype, so a call allocates nothing but its output. A task's
// arithmetic depends only on its query, its row's first visible slots and the scaling: never on
// the other tokens of the call or on the thread split (a token's result is the same in a decode
// and in a verify). Where q, K and V are bfloat16 on an AVX512-BF16 CPU, the scores are
// vdpbf16ps dot products (bfloat16 products exact, summed in float32) and the softmax and the
// weighted sum of values run on 16 lanes; elsewhere on AVX2 vectors of 8, K and V widened in
// registers.
//
// query [B, H, hd]; keys, values [N, Hkv, bs, hd] (the runner's block pool, read through each row's
// block table: KVPages in cpu_common.h; a contiguous buffer [R, Hkv, S, hd] is one block a row);
// rows [B] the row of each packed token; visible [B] how many slots it sees (its own slot + 1:
// committed tokens, then the new ones causally). Heads share KV heads in groups of H / Hkv. A
// task's sums run over the slots in the same order whatever the block size, so the pool's layout
// changes no result.

// exp8 (cpu_common.h) takes the scores minus their maximum.

// Per-thread scratch, grown to the largest call seen and kept: no heap allocation per call.
struct AttentionScratch {
  std::vector<float> scores, query, out;
};
inline AttentionScratch& attention_scratch(int64_t slots, int64_t hd) {
  thread_local AttentionScratch scratch;
  if (static_cast<int64_t>(scratch.scores.size()) < slots + 16) scratch.scores.resize(static_cast<size_t>(slots + 16));
  if (static_cast<int64_t>(scratch.query.size()) < hd) {
    scratch.query.resize(static_cast<size_t>(hd));
    scratch.out.resize(static_cast<size_t>(hd));
  }
  return scratch;
}

// One query (q in float32) over `visible` keys and values of type T (float, or uint16_t holding
// bfloat16), AVX2: out [hd] float32.
template <typename T>
void attend_one(const float* q, const T* keys, const T* values, const HeadSlots& slot, int64_t visible, int64_t hd,
                float scaling, float* scores, float* out) {
  float top = -INFINITY;
  int64_t j = 0;
  for (; j + 8 <= visible; j += 8) {  // 8 keys at a time, their 8 sums reduced together
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const T* group = keys + slot(j);  // 8 slots from a multiple of 8: one block
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(group + i * hd + d), acc[i]);
    }
    const __m256 sums = _mm256_mul_ps(horizontal_sums(acc), _mm256_set1_ps(scaling));
    _mm256_storeu_ps(scores + j, sums);
  }
  for (; j < visible; ++j) {
    const T* k = keys + slot(j);
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
    for (j = 0; j + 4 <= visible; j += 4) {
      const T* group = values + slot(j) + d;  // 4 slots from a multiple of 4: one block
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(scores[j + u]), load8(group + u * hd), acc[u]);
    }
    for (; j < visible; ++j)
      acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(scores[j]), load8(values + slot(j) + d), acc[0]);
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(sum, _mm256_set1_ps(1.0f / total)));
  }
}

// hd float32 values into Q's format (bfloat16: rounded to nearest even, as c10::BFloat16 rounds).
inline void store_head(const float* src, int64_t hd, float* dst) { std::memcpy(dst, src, hd * sizeof(float)); }
inline void store_head(const float* src, int64_t hd, uint16_t* dst) {
  for (int64_t d = 0; d < hd; d += 8) store8(dst + d, round_as(dst, _mm256_loadu_ps(src + d)));
}

// Every (token, head) task on AVX2: Q the query's element type, T the buffers'.
template <typename Q, typename T>
void attend_all(const Q* query, const T* keys, const T* values, const KVPages& pages, const int64_t* rows,
                const int64_t* visible, int64_t B, int64_t H, int64_t slots, float scaling, Q* out, int64_t grain) {
  const int64_t hd = pages.hd, group = H / pages.Hkv;
  split_tasks(0, B * H, grain, [&](int64_t begin, int64_t end) {
    AttentionScratch& scratch = attention_scratch(slots, hd);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const HeadSlots slot{&pages, rows[b], h / group};
      const Q* q = query + task * hd;
      for (int64_t d = 0; d < hd; ++d) scratch.query[d] = to_float(q[d]);
      attend_one(scratch.query.data(), keys, values, slot, visible[b], hd, scaling, scratch.scores.data(),
                 scratch.out.data());
      store_head(scratch.out.data(), hd, out + task * hd);
    }
  });
}

}  // namespace

// ---- AVX512-BF16: bfloat16 q, K and V ------------------------------------------------------
// Compiled for AVX-512 here and called only where the CPU has AVX512-BF16 (cpu_has_avx512_bf16).

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace avx512_attention {
namespace {

// exp8's arithmetic on 16 lanes (x <= 0; below -87 flushed to 0).
inline __m512 exp16(__m512 x) {
  const __m512 floor_x = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor_x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), y, _mm512_castsi512_ps(scale));
}

// The sums of 16 vectors' lanes, as one vector, in a fixed lane order (sums16 below puts it right):
// halves, quarters, pairs, then single lanes of two vectors are added side by side.
inline __m512 sums16_unordered(const __m512* a) {
  __m512 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(d[i]), y = _mm512_castps_pd(d[i + 2]);
    e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
}

// Lane i of sums16: the sum of a[i]'s lanes. The permutation is found once by running the tree on
// vectors that say their own index.
inline __m512 sums16(const __m512* a) {
  static const __m512i order = [] {
    __m512 probe[16];
    for (int i = 0; i < 16; ++i) probe[i] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(static_cast<float>(i)));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, sums16_unordered(probe));
    alignas(64) int32_t index[16];
    for (int lane = 0; lane < 16; ++lane) index[static_cast<int>(lanes[lane])] = lane;
    return _mm512_load_si512(index);
  }();
  return _mm512_permutexvar_ps(order, sums16_unordered(a));
}

// Softmax weights of one query head, C = hd / 32: scores[j] = exp(s_j - max s) for the visible
// keys (s_j the scaled q . k_j, a vdpbf16ps dot product), and their sum is returned.
template <int C>
float softmax_weights(const uint16_t* q, const uint16_t* keys, const HeadSlots& slot, int64_t visible, float scaling,
                      float* scores) {
  constexpr int64_t hd = 32 * C;
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  const __m512 scale = _mm512_set1_ps(scaling);
  // Scores, 16 keys at a time (the last block's missing keys are zeros, never stored).
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < visible; j += 16) {
    const int64_t n = std::min<int64_t>(16, visible - j);
    const uint16_t* group = keys + slot(j);  // 16 slots from a multiple of 16: one block
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_setzero_ps();
      if (i < n)
        for (int c = 0; c < C; ++c)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(group + i * hd + 32 * c), qv[c]);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    const __m512 s = _mm512_mul_ps(sums16(acc), scale);
    _mm512_mask_storeu_ps(scores + j, valid, s);
    top = _mm512_mask_max_ps(top, valid, top, s);
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < visible; j += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, visible - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + j), shift)));
    _mm512_mask_storeu_ps(scores + j, valid, e);
    sums = _mm512_add_ps(sums, e);
  }
  return _mm512_reduce_add_ps(sums);
}

// Weighted sums of values for G query heads of one KV head (their weights scores[g], sums
// total[g]), written as bfloat16 to out[g]. A 32-bit lane of V holds dims 2i and 2i + 1: shifted
// left, the even one as a float32; masked, the odd one. Each value vector is decoded once for the
// G heads, and each head's sums take the same fused multiply-adds in the same order whatever G
// is (U sets of sums over alternate keys hide the FMA latency), so grouping changes no result.
template <int C, int G>
void weighted_values(const uint16_t* values, const HeadSlots& slot, int64_t visible, const float* const* scores,
                     const float* total, uint16_t* const* out) {
  constexpr int64_t hd = 32 * C;
  constexpr int U = C <= 2 ? 2 : 1;  // (G x C x 2 x U sums: at most 24 of the 32 registers)
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 even[G][U][C], odd[G][U][C];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) even[g][u][c] = odd[g][u][c] = _mm512_setzero_ps();
  auto add_value = [&](int u, int64_t j, const uint16_t* value) __attribute__((always_inline)) {
    __m512 ev[C], od[C];
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(value + 32 * c);
      ev[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      od[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g][j]);
      for (int c = 0; c < C; ++c) {
        even[g][u][c] = _mm512_fmadd_ps(p, ev[c], even[g][u][c]);
        odd[g][u][c] = _mm512_fmadd_ps(p, od[c], odd[g][u][c]);
      }
    }
  };
  // Key j goes to sums j % U, in increasing j: a block's run starts at an even slot (bs is a multiple of
  // 16, or the row's one block starts at 0), so pairing within runs pairs the keys as one run over the row.
  for (int64_t start = 0; start < visible;) {
    const int64_t run = std::min(slot.left(start), visible - start);  // slots from `start` on in its block
    const uint16_t* base = values + slot(start);
    int64_t i = 0;
    for (; i + U <= run; i += U)
      for (int u = 0; u < U; ++u) add_value(u, start + i + u, base + (i + u) * hd);
    for (; i < run; ++i) add_value(0, start + i, base + i * hd);
    start += run;
  }
  // Normalise, round to bfloat16 (nearest even; NaN to 0x7FC0, as c10::BFloat16) and put each
  // pair back together: the even dim in a lane's low half, the odd one in its high half.
  auto rounded = [&](__m512 x) __attribute__((always_inline)) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(_mm512_add_epi32(bits, bias), nan, _mm512_set1_epi32(0x7FC00000));
  };
  for (int g = 0; g < G; ++g) {
    const __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
    for (int c = 0; c < C; ++c) {
      __m512 e = even[g][0][c], o = odd[g][0][c];
      for (int u = 1; u < U; ++u) e = _mm512_add_ps(e, even[g][u][c]), o = _mm512_add_ps(o, odd[g][u][c]);
      const __m512i re = rounded(_mm512_mul_ps(e, inverse)), ro = rounded(_mm512_mul_ps(o, inverse));
      _mm512_storeu_si512(out[g] + 32 * c, _mm512_or_si512(_mm512_and_si512(ro, high_half), _mm512_srli_epi32(re, 16)));
    }
  }
}

// A task: `count` (1 to 3) consecutive query heads of token b, all of one KV head.
template <int C>
void attend_heads(const uint16_t* query, const uint16_t* keys, const uint16_t* values, const HeadSlots& slot,
                  int64_t visible, float scaling, int64_t count, int64_t slots, uint16_t* out) {
  constexpr int64_t hd = 32 * C;
  float* scratch = attention_scratch(3 * (slots + 16), hd).scores.data();
  const float* scores[3];
  float total[3];
  uint16_t* outs[3];
  for (int64_t g = 0; g < count; ++g) {
    float* s = scratch + g * (slots + 16);
    total[g] = softmax_weights<C>(query + g * hd, keys, slot, visible, scaling, s);
    scores[g] = s;
    outs[g] = out + g * hd;
  }
  if (count == 3) weighted_values<C, 3>(values, slot, visible, scores, total, outs);
  else if (count == 2) weighted_values<C, 2>(values, slot, visible, scores, total, outs);
  else weighted_values<C, 1>(values, slot, visible, scores, total, outs);
}

// One token's heads are tasks of their own (the most even split of a one-token step over the
// threads); with more tokens, a task is up to 3 heads of one KV head, which decode V once.
template <int C>
void attend_all(const uint16_t* query, const uint16_t* keys, const uint16_t* values, const KVPages& pages,
                const int64_t* rows, const int64_t* visible, int64_t B, int64_t H, int64_t slots, float scaling,
                uint16_t* out, int64_t grain) {
  constexpr int64_t hd = 32 * C;
  const int64_t Hkv = pages.Hkv, group = H / Hkv;
  const int64_t per_task = B == 1 ? 1 : std::min<int64_t>(3, group);
  const int64_t tasks_per_kv = (group + per_task - 1) / per_task, tasks_per_token = Hkv * tasks_per_kv;
  split_tasks(0, B * tasks_per_token, grain == 1 ? 1 : B * tasks_per_token + 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_token, kv = task % tasks_per_token / tasks_per_kv;
      const int64_t first = kv * group + task % tasks_per_kv * per_task;
      const int64_t count = std::min(per_task, (kv + 1) * group - first);
      const int64_t at = (b * H + first) * hd;
      const HeadSlots slot{&pages, rows[b], kv};
      attend_heads<C>(query + at, keys, values, slot, visible[b], scaling, count, slots, out + at);
    }
  });
}

}  // namespace

// Whether this form takes the call (hd a multiple of 32 up to 128), and then runs it.
bool attend_bf16(const uint16_t* query, const uint16_t* keys, const uint16_t* values, const KVPages& pages,
                 const int64_t* rows, const int64_t* visible, int64_t B, int64_t H, int64_t slots, float scaling,
                 uint16_t* out, int64_t grain) {
  switch (pages.hd) {
    case 32: attend_all<1>(query, keys, values, pages, rows, visible, B, H, slots, scaling, out, grain); return true;
    case 64: attend_all<2>(query, keys, values, pages, rows, visible, B, H, slots, scaling, out, grain); return true;
    case 96: attend_all<3>(query, keys, values, pages, rows, visible, B, H, slots, scaling, out, grain); return true;
    case 128: attend_all<4>(query, keys, values, pages, rows, visible, B, H, slots, scaling, out, grain); return true;
    default: return false;
  }
}

}  // namespace avx512_attention

#pragma GCC pop_options

namespace {

// Below this many multiply-adds (keys read x heads x head dim, each of QK and PV) a call stays on
// one thread: a head over 256 keys of 64 dims. The reference target's one-token step (9 heads)
// already gains from two threads (13 against 17 us a layer on the 2-core EPYC).
constexpr int64_t kAttentionSerialWork = 256 * 64;

// rows / visible as int64 without a copy where they already are (the layer loop passes them so).
inline at::Tensor as_long(const at::Tensor& t) {
  return t.scalar_type() == at::kLong && t.is_contiguous() ? t : t.to(at::kLong).contiguous();
}

// Checks shared by the two entries below: query [B, H, hd], a pool [N, Hkv, bs, hd] of keys and one of
// values, rows and visible [B]. Returns the keys every token reads (for the thread split).
int64_t check_attention(const char* name, const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                        const int64_t* rp, const int64_t* vp, int64_t rows_in_tables, int64_t row_capacity) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && keys.sizes() == values.sizes(), name,
              ": query [B, H, hd] and keys/values [N, Hkv, bs, hd] expected, got ", query.sizes(), " and ",
              keys.sizes());
  const int64_t B = query.size(0), H = query.size(1), hd = query.size(2), Hkv = keys.size(1);
  TORCH_CHECK(keys.size(3) == hd && hd % 8 == 0 && H % Hkv == 0, name,
              ": head_dim a multiple of 8 and heads a multiple of KV heads expected");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), name, ": contiguous KV buffers expected");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 KV, got ", keys.scalar_type());
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), name, ": keys and values of one dtype expected");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 query, got ", query.scalar_type());
  int64_t seen = 0;  // keys the call reads, over all its tokens
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rp[b] >= 0 && rp[b] < rows_in_tables && vp[b] >= 1 && vp[b] <= row_capacity, name,
                ": row or visible slots out of range for token ", b);
    seen += vp[b];
  }
  (void)H;
  return seen;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& rows, const at::Tensor& visible, double scaling) {
  TORCH_CHECK(rows.numel() == query.size(0) && visible.numel() == query.size(0),
              "decode_attention: one row and one visible count per token");
  const at::Tensor q = query.contiguous(), r = as_long(rows), v = as_long(visible);
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* vp = v.data_ptr<int64_t>();
  TORCH_CHECK(keys.dim() == 4, "decode_attention: keys/values [R, Hkv, S, hd] expected, got ", keys.sizes());
  const int64_t seen = check_attention("decode_attention", q, keys, values, rp, vp, keys.size(0), keys.size(2));
  // The contiguous buffer is the pool in which row r owns block r: its block table is the identity.
  const at::Tensor identity = at::arange(keys.size(0), r.options());
  const KVPages pages(identity.data_ptr<int64_t>(), 1, keys);
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t B = q.size(0), H = q.size(1), hd = q.size(2);
  attention_into(q.data_ptr(), q.scalar_type() == at::kBFloat16, keys, values, pages, rp, vp, B, H, scaling,
                 attention_grain(seen, H, hd, B), out.data_ptr());
  return out;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& visible, double scaling) {
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "paged_attention: block tables [R, M] contiguous int64 expected, got ", tables.sizes(), " ",
              tables.scalar_type());
  TORCH_CHECK(rows.numel() == query.size(0) && visible.numel() == query.size(0),
              "paged_attention: one row and one visible count per token");
  TORCH_CHECK(keys.dim() == 4 && KVPages::readable(tables.size(1), keys.size(2)),
              "paged_attention: a pool of blocks [N, Hkv, bs, hd] with bs a power of two and a multiple of 16 "
              "(or one block per row) expected, got ",
              keys.sizes(), " read through tables of ", tables.size(1), " blocks");
  const at::Tensor q = query.contiguous(), r = as_long(rows), v = as_long(visible);
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* vp = v.data_ptr<int64_t>();
  const int64_t seen = check_attention("paged_attention", q, keys, values, rp, vp, tables.size(0),
                                       tables.size(1) * keys.size(2));
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)  // every block a token reads is in the pool
    for (int64_t k = 0; k < (vp[b] + keys.size(2) - 1) / keys.size(2); ++k)
      TORCH_CHECK(tp[rp[b] * tables.size(1) + k] >= 0 && tp[rp[b] * tables.size(1) + k] < keys.size(0),
                  "paged_attention: row ", rp[b], "'s block ", k, " is not in the pool of ", keys.size(0));
  const KVPages pages(tp, tables.size(1), keys);
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t B = q.size(0), H = q.size(1), hd = q.size(2);
  attention_into(q.data_ptr(), q.scalar_type() == at::kBFloat16, keys, values, pages, rp, vp, B, H, scaling,
                 attention_grain(seen, H, hd, B), out.data_ptr());
  return out;
}

int64_t attention_grain(int64_t seen, int64_t H, int64_t hd, int64_t B) {
  return seen * H * hd < kAttentionSerialWork ? B * H + 1 : 1;
}

void attention_into(const void* query, bool bf16_q, const at::Tensor& keys, const at::Tensor& values,
                    const KVPages& pages, const int64_t* rp, const int64_t* vp, int64_t B, int64_t H, double scaling,
                    int64_t grain, void* out) {
  int64_t slots = 1;  // the most slots a token sees: the scratch's size
  for (int64_t b = 0; b < B; ++b) slots = std::max(slots, vp[b]);
  const float scale = static_cast<float>(scaling);
  const bool bf16_kv = keys.scalar_type() == at::kBFloat16;
  const auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const uint16_t* q16 = static_cast<const uint16_t*>(query);
  const float* q32 = static_cast<const float*>(query);
  uint16_t* out16 = static_cast<uint16_t*>(out);
  float* out32 = static_cast<float*>(out);
  if (bf16_kv && bf16_q && cpu_has_avx512_bf16() &&
      avx512_attention::attend_bf16(q16, bits(keys), bits(values), pages, rp, vp, B, H, slots, scale, out16, grain))
    return;
  if (bf16_kv && bf16_q)
    attend_all(q16, bits(keys), bits(values), pages, rp, vp, B, H, slots, scale, out16, grain);
  else if (bf16_kv)
    attend_all(q32, bits(keys), bits(values), pages, rp, vp, B, H, slots, scale, out32, grain);
  else if (bf16_q)
    attend_all(q16, keys.data_ptr<float>(), values.data_ptr<float>(), pages, rp, vp, B, H, slots, scale, out16, grain);
  else
    attend_all(q32, keys.data_ptr<float>(), values.data_ptr<float>(), pages, rp, vp, B, H, slots, scale, out32, grain);
}

}  // namespace vlmspec_cpu
