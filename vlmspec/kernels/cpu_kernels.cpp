// RMSNorm, RoPE + KV write and attention for decode and verify steps, and the registration of
// every vlmspec CPU operator (the linears are in cpu_linear.cpp; see vlmspec/kernels/cpu_kernels.py).

#include "cpu_common.h"

namespace vlmspec_cpu {
namespace {

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

}  // namespace

// Outside the anonymous namespace (as are the two below): cpu_step.cpp calls them directly.
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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace vlmspec_cpu

using namespace vlmspec_cpu;

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
