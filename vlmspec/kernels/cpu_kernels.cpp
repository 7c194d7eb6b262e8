// RMSNorm and RoPE + KV write for decode and verify steps, and the registration of the kernels'
// operators (the linears are in cpu_linear.cpp and cpu_packed.cpp, the attention in
// cpu_attention.cpp; see vlmspec/kernels/cpu_kernels.py).

#include "cpu_common.h"

namespace vlmspec_cpu {
namespace {

// ---- RMSNorm in one call ------------------------------------------------------------
// transformers' Qwen-VL RMSNorm is eight tensor ops, each a few microseconds of dispatch on
// a vector of a few hundred floats: 60 per step of the reference target. This is the same
// arithmetic in the same order of roundings: x in float32, mean of squares, x * 1/sqrt(var
// + eps), rounded to x's dtype, then times the weight, rounded again.

template <typename T>
void rms_norm_rows(const T* x, const T* weight, int64_t first, int64_t last, int64_t d, float eps, T* out) {
  for (int64_t r = first; r < last; ++r) {
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
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16, got ",
              x.scalar_type());
  rms_norm_into(wc, xc.data_ptr(), rows, d, eps, out.data_ptr(), rows);  // one thread: a few rows of a few hundred
  return out;
}

void rms_norm_into(const at::Tensor& weight, const void* x, int64_t rows, int64_t d, double eps, void* out,
                   int64_t grain) {
  split_tasks(0, rows, grain, [&](int64_t first, int64_t last) {
    if (weight.scalar_type() == at::kFloat)
      rms_norm_rows(static_cast<const float*>(x), weight.data_ptr<float>(), first, last, d, static_cast<float>(eps),
                    static_cast<float*>(out));
    else
      rms_norm_rows(static_cast<const at::BFloat16*>(x), weight.data_ptr<at::BFloat16>(), first, last, d,
                    static_cast<float>(eps), static_cast<at::BFloat16*>(out));
  });
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
// packed.py); keys, values [N, Hkv, bs, hd] (the block pool; a contiguous buffer is one block a
// row); rows, slots [B]: the block of each token's slot and its offset in the block (contiguous:
// its row and slot). Returns q [B, H, hd].

// One head: out = round(round(x * cos) + round(rolled(x) * sin)), 8 lanes at a time where the half
// width allows (T is float or uint16_t holding bfloat16; round_as rounds as c10::BFloat16 does).
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, int64_t hd, T* out) {
  const int64_t half = hd / 2;
  if (half % 8 == 0) {
    for (int64_t d = 0; d < half; d += 8) {
      const __m256 low = load8(x + d), high = load8(x + d + half);
      const __m256 low_out = _mm256_add_ps(round_as(x, _mm256_mul_ps(low, load8(cos + d))),
                                           round_as(x, _mm256_mul_ps(high, load8(sin + d))));
      const __m256 high_out = _mm256_add_ps(round_as(x, _mm256_mul_ps(high, load8(cos + d + half))),
                                            round_as(x, _mm256_mul_ps(low, load8(sin + d + half))));
      store8(out + d, round_as(x, low_out));
      store8(out + d + half, round_as(x, high_out));
    }
    return;
  }
  for (int64_t d = 0; d < hd; ++d) {
    const float direct = round_one(x, to_float(x[d]) * to_float(cos[d]));
    const float rolled = round_one(x, to_float(x[(d + half) % hd]) * to_float(sin[d]));
    out[d] = from_float(x, direct + rolled);
  }
}

// Tasks [first, last) of B * (H + Hkv): task (b, h) rotates query head h of token b (h < H), or
// rotates its key head h - H into its slot and copies the value head beside it.
template <typename T>
void rope_write_heads(const T* qkv, const T* cos, const T* sin, T* keys, T* values, const int64_t* rows,
                      const int64_t* slots, int64_t first, int64_t last, int64_t H, int64_t Hkv, int64_t slots_cap,
                      int64_t hd, T* q) {
  const int64_t width = (H + 2 * Hkv) * hd;
  for (int64_t task = first; task < last; ++task) {
    const int64_t b = task / (H + Hkv), h = task % (H + Hkv);
    const T* x = qkv + b * width;
    if (h < H) {
      rotate_head(x + h * hd, cos + b * hd, sin + b * hd, hd, q + (b * H + h) * hd);
      continue;
    }
    const int64_t g = h - H, at = ((rows[b] * Hkv + g) * slots_cap + slots[b]) * hd;
    rotate_head(x + h * hd, cos + b * hd, sin + b * hd, hd, keys + at);
    std::memcpy(values + at, x + (H + Hkv + g) * hd, hd * sizeof(T));
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
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rope_write: float32 or bfloat16, got ", x.scalar_type());
  at::Tensor q = at::empty({B, heads, hd}, x.options());
  const int64_t tasks = B * (heads + Hkv);
  rope_write_into(x.data_ptr(), c.data_ptr(), sn.data_ptr(), keys, values, r.data_ptr<int64_t>(),
                  sl.data_ptr<int64_t>(), B, heads, q.data_ptr(), tasks);  // one thread: a few heads of 64
  return q;
}

void rope_write_into(const void* qkv, const void* cos, const void* signed_sin, const at::Tensor& keys,
                     const at::Tensor& values, const int64_t* rows, const int64_t* slots, int64_t B, int64_t heads,
                     void* q, int64_t grain) {
  const int64_t Hkv = keys.size(1), slots_cap = keys.size(2), hd = keys.size(3);
  split_tasks(0, B * (heads + Hkv), grain, [&](int64_t first, int64_t last) {
    if (keys.scalar_type() == at::kFloat) {
      rope_write_heads(static_cast<const float*>(qkv), static_cast<const float*>(cos),
                       static_cast<const float*>(signed_sin), keys.data_ptr<float>(), values.data_ptr<float>(), rows,
                       slots, first, last, heads, Hkv, slots_cap, hd, static_cast<float*>(q));
    } else {
      const auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
      rope_write_heads(static_cast<const uint16_t*>(qkv), static_cast<const uint16_t*>(cos),
                       static_cast<const uint16_t*>(signed_sin), bits(keys), bits(values), rows, slots, first, last,
                       heads, Hkv, slots_cap, hd, static_cast<uint16_t*>(q));
    }
  });
}

}  // namespace vlmspec_cpu

using namespace vlmspec_cpu;

TORCH_LIBRARY(vlmspec, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("kernel_isa() -> str", &kernel_isa);
  m.def("kernel_uses_amx() -> bool", &kernel_uses_amx);
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def(
      "rope_write(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) keys, Tensor(b!) values, Tensor rows, "
      "Tensor slots, int heads) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor rows, Tensor visible, float scaling) -> Tensor");
  m.def(
      "paged_attention(Tensor query, Tensor keys, Tensor values, Tensor tables, Tensor rows, Tensor visible, "
      "float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(vlmspec, CPU, m) {
  m.impl("skinny_linear", skinny_linear);
  m.impl("rms_norm", rms_norm);
  m.impl("decode_attention", decode_attention);
  m.impl("paged_attention", paged_attention);
  m.impl("rope_write", rope_write);
  m.impl("pack_weight", pack_weight);
  m.impl("packed_linear", packed_linear_op);
}
