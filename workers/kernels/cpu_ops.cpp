// loomllm's CPU kernels for a decoder layer's small ops: RMSNorm with its residual add, SiLU
// times up, and the rotary embedding with the K/V cache write. Each rounds where transformers'
// eager ops round, so a model's tokens stay those of its torch path (bit for bit in bf16).

#include "cpu_ops.h"

namespace loom_cpu {

// ---- RMSNorm -----------------------------------------------------------------------------

// One row of transformers' Llama RMSNorm: w * (x * rsqrt(mean(x^2) + eps)).to(dtype), the
// mean over float32 values, with the residual add before it (rounded to the dtype) if any.
template <typename T>
void norm_row(const T* x, const T* residual, const T* w, T* out, T* total, int64_t n,
              float eps, float* scratch) {
  for (int64_t i = 0; i < n; ++i) {
    scratch[i] = residual ? rounded<T>(f32(x[i]) + f32(residual[i])) : f32(x[i]);
  }
  if (total) {
    for (int64_t i = 0; i < n; ++i) total[i] = to<T>(scratch[i]);
  }
  // Sixteen partial sums, so that the compiler vectorizes the reduction.
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int u = 0; u < 16; ++u) part[u] += scratch[i + u] * scratch[i + u];
  }
  float sum = 0;
  for (int u = 0; u < 16; ++u) sum += part[u];
  for (; i < n; ++i) sum += scratch[i] * scratch[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = to<T>(f32(w[j]) * rounded<T>(scratch[j] * inv));
  }
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w,
               at::Tensor& out, at::Tensor* total, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* tp = total ? total->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // One thread for the few rows of a decode step: waking the pool costs more than a row.
  const int64_t grain = std::max<int64_t>(1, 16384 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      norm_row<T>(xp + r * n, rp ? rp + r * n : nullptr, wp, op + r * n, tp ? tp + r * n : nullptr,
                  n, static_cast<float>(eps), scratch.data());
    }
  });
}

void check_norm(const char* op, const at::Tensor& x, const at::Tensor& w) {
  check_dtype(op, x);
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight ", w.scalar_type(), " and input ",
              x.scalar_type(), " differ");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), op, ": weight of ", w.size(0),
              " for rows of ", x.size(-1));
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm("rms_norm", x_in, w_in);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm",
                                 [&] { norm_rows<scalar_t>(x, nullptr, w, out, nullptr, eps); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& r_in,
                                                const at::Tensor& w_in, double eps) {
  check_norm("add_rms_norm", x_in, w_in);
  TORCH_CHECK(r_in.scalar_type() == x_in.scalar_type() && r_in.sizes() == x_in.sizes(),
              "add_rms_norm: residual ", r_in.sizes(), " ", r_in.scalar_type(), " for input ",
              x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), r = r_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(x), total = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm",
                                 [&] { norm_rows<scalar_t>(x, &r, w, out, &total, eps); });
  return {out, total};
}

// ---- SiLU times up ---------------------------------------------------------------------------

// silu of every bfloat16, by its bits, built once: a lookup costs less than the exp and the
// division, and gives the same values.
const uint16_t* bf16_silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> values(1 << 16);
    for (uint32_t bits = 0; bits < values.size(); ++bits) {
      float x;
      const uint32_t word = bits << 16;
      std::memcpy(&x, &word, sizeof x);
      values[bits] = static_cast<uint16_t>(bf16_bits(silu<c10::BFloat16>(x)) >> 16);
    }
    return values;
  }();
  return table.data();
}

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  check_dtype("silu_mul", gate_up_in);
  TORCH_CHECK(gate_up_in.size(-1) % 2 == 0, "silu_mul: an odd last dimension, ",
              gate_up_in.size(-1));
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * width);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    using T = scalar_t;
    const T* in = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const uint16_t* table = std::is_same_v<T, c10::BFloat16> ? bf16_silu_table() : nullptr;
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / width), [&](int64_t b, int64_t e) {
      std::vector<float> scratch(width);
      for (int64_t r = b; r < e; ++r) {
        silu_row<T>(in + r * 2 * width, in + r * 2 * width + width, op + r * width, width,
                    scratch.data(), table);
      }
    });
  });
  return out;
}

// ---- Rotary embedding and the cache write ------------------------------------------------------

// transformers' x * cos + rotate_half(x) * sin of one head, each product and the sum rounded.
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const float turned = d < half ? -f32(x[d + half]) : f32(x[d - half]);
    out[d] = to<T>(rounded<T>(f32(x[d]) * f32(cos[d])) +
                            rounded<T>(turned * f32(sin[d])));
  }
}

// q, k, v [T, heads, D] rotated by cos, sin [T, D]; the rotated k and v written into the
// caches [slots, KVH, D] at slot_mapping [T]. Returns the rotated q [T, H, D].
at::Tensor rotary_into_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cos_in, const at::Tensor& sin_in,
                             at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots_in) {
  check_dtype("rotary_into_cache", q);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &k, &v, &cos_in, &sin_in, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "rotary_into_cache: one dtype for all, got ",
                q.scalar_type(), " and ", t->scalar_type());
  }
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2),
              "rotary_into_cache: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "rotary_into_cache: heads must be dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes().slice(1) == k.sizes().slice(1) &&
                  v_cache.sizes() == k_cache.sizes(),
              "rotary_into_cache: caches ", k_cache.sizes(), " for k ", k.sizes());
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(dim % 2 == 0, "rotary_into_cache: an odd head size, ", dim);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens &&
                  cos.size(1) == dim,
              "rotary_into_cache: cos ", cos.sizes(), " for ", tokens, " tokens of ", dim);
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == tokens, "rotary_into_cache: ", slots.numel(), " slots for ", tokens,
              " tokens");
  const int64_t num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rotary_into_cache: slot ", sp[t], " outside ",
                num_slots);
  }
  at::Tensor q_out = at::empty({tokens, heads, dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rotary_into_cache", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *snp = sin.data_ptr<T>();
    T *qo = q_out.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    const int64_t row = kv_heads * dim;
    at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / ((heads + kv_heads) * dim)),
                     [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T *c = cp + t * dim, *s = snp + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          rotate_head<T>(qp + t * q.stride(0) + h * q.stride(1), c, s, qo + (t * heads + h) * dim,
                         dim);
        }
        for (int64_t h = 0; h < kv_heads; ++h) {
          rotate_head<T>(kp + t * k.stride(0) + h * k.stride(1), c, s,
                         kc + sp[t] * row + h * dim, dim);
          std::memcpy(vc + sp[t] * row + h * dim, vp + t * v.stride(0) + h * v.stride(1),
                      dim * sizeof(T));
        }
      }
    });
  });
  return q_out;
}

}  // namespace loom_cpu
