// loomllm's CPU kernels for a decoder layer's small ops: RMSNorm with its residual add, the
// rotary embedding with the K/V cache write, SiLU times up, and decode attention that reads
// the paged cache in place. Built at a worker's start by cpu_native.py (torch's C++ extension
// loader), registered as torch.ops.loom_cpu.*. Norms, rotary and SiLU round where transformers'
// eager ops round, so a model's tokens stay those of its torch path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Values are carried in float between roundings. Rounding to bfloat16 is written out (to
// nearest even, NaN kept NaN) rather than left to c10::BFloat16's constructor, whose NaN
// branch stops the compiler from vectorizing the loops around it.
template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

[[gnu::always_inline]] inline uint32_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t even = bits + 0x7fffu + ((bits >> 16) & 1u);
  return x != x ? 0x7fc00000u : even & 0xffff0000u;
}

// x rounded to T, as a float.
template <typename T>
inline float rounded(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t bits = bf16_bits(x);
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  } else {
    return x;
  }
}

// x rounded to T.
template <typename T>
inline T to(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return c10::BFloat16(static_cast<uint16_t>(bf16_bits(x) >> 16), c10::BFloat16::from_bits());
  } else {
    return x;
  }
}

void check_dtype(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
              " takes float32 or bfloat16, got ", t.scalar_type());
}

template <typename T>
inline void to_float(const T* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32(x[i]);
}

// expf written to vectorize: 2^n times a polynomial on the remainder, within 2 ulp of expf
// over [-87, 88.7]; 0 below (expf's denormals), infinity above (as expf).
[[gnu::always_inline]] inline float fast_exp(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.72283935546875f);
  // Rounded to the nearest integer by adding and taking away 1.5 * 2^23 (nearbyint is a call).
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&p, &bits, sizeof bits);
  return x < -87.0f ? 0.0f : x > 88.72283935546875f ? std::numeric_limits<float>::infinity() : p;
}

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

// silu(gate) * up of gate_up [..., 2I] (gate first): F.silu rounds, then the product rounds.
// In passes over a float row, which the compiler vectorizes (one loop of all three it did not).
template <typename T>
void silu_row(const T* gate, const T* up, T* out, int64_t n, float* scratch) {
  to_float(gate, scratch, n);
  for (int64_t i = 0; i < n; ++i) {
    scratch[i] = rounded<T>(scratch[i] / (1.0f + fast_exp(-scratch[i])));
  }
  for (int64_t i = 0; i < n; ++i) out[i] = to<T>(scratch[i] * f32(up[i]));
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
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / width), [&](int64_t b, int64_t e) {
      std::vector<float> scratch(width);
      for (int64_t r = b; r < e; ++r) {
        silu_row<T>(in + r * 2 * width, in + r * 2 * width + width, op + r * width, width,
                    scratch.data());
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

// ---- Decode attention over the paged cache -------------------------------------------------

// The sum of 16 partial sums as a tree, which the compiler turns into vector shuffles.
inline float tree_sum(float* part) {
  for (int u = 0; u < 8; ++u) part[u] += part[u + 8];
  for (int u = 0; u < 4; ++u) part[u] += part[u + 4];
  return (part[0] + part[2]) + (part[1] + part[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  // A horizontal sum the compiler does not find on its own: a tree of vector adds.
  if (n % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    }
    return _mm512_reduce_add_ps(sum);
  }
#endif
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int u = 0; u < 16; ++u) part[u] += a[i + u] * b[i + u];
  }
  float sum = tree_sum(part);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline float sum_of(const float* a, int64_t n) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int u = 0; u < 16; ++u) part[u] += a[i + u];
  }
  float sum = tree_sum(part);
  for (; i < n; ++i) sum += a[i];
  return sum;
}

inline float max_of(const float* a, int64_t n, float start) {
  float part[16];
  std::fill(part, part + 16, start);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int u = 0; u < 16; ++u) part[u] = part[u] > a[i + u] ? part[u] : a[i + u];
  }
  float top = start;
  for (int u = 0; u < 16; ++u) top = top > part[u] ? top : part[u];
  for (; i < n; ++i) top = top > a[i] ? top : a[i];
  return top;
}

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  for (int64_t i = 0; i < dim * static_cast<int64_t>(sizeof(T)); i += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i);
  }
}

// One decode row and KV head: its group of query heads over the row's context in the cache.
// DIM > 0 is the head size known when compiled (the loops over it unrolled), 0 any other.
template <typename T, int64_t DIM>
void attend_group(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                  int64_t slot_stride, const int64_t* slots, int64_t begin, int64_t end,
                  int64_t group, int64_t head_dim, float scale, float softcap, const float* sinks,
                  T* out, int64_t out_head_stride, std::vector<float>& buf) {
  const int64_t keys = end - begin, dim = DIM > 0 ? DIM : head_dim;
  buf.resize(group * dim * 2 + dim + group * keys);
  float* qf = buf.data();           // [group, dim]
  float* acc = qf + group * dim;    // [group, dim]
  float* row = acc + group * dim;   // [dim]: one key or value in float
  float* scores = row + dim;        // [group, keys]
  for (int64_t g = 0; g < group; ++g) to_float(q + g * q_head_stride, qf + g * dim, dim);
  // Rows are fetched a few keys ahead: their slots are known, the hardware cannot guess them.
  constexpr int64_t ahead = 8;
  // Key by key: each key row converted once for the whole group.
  for (int64_t j = 0; j < keys; ++j) {
    if (j + ahead < keys) prefetch_row(k_cache + slots[begin + j + ahead] * slot_stride, dim);
    to_float(k_cache + slots[begin + j] * slot_stride, row, dim);
    for (int64_t g = 0; g < group; ++g) scores[g * keys + j] = dot(qf + g * dim, row, dim);
  }
  std::fill(acc, acc + group * dim, 0.0f);
  std::vector<float> sums(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * keys;
    for (int64_t j = 0; j < keys; ++j) s[j] *= scale;
    if (softcap > 0) {
      for (int64_t j = 0; j < keys; ++j) s[j] = std::tanh(s[j] / softcap) * softcap;
    }
    const float sink = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
    const float top = max_of(s, keys, sink);
    for (int64_t j = 0; j < keys; ++j) s[j] = fast_exp(s[j] - top);
    sums[g] = sum_of(s, keys) + (sinks ? fast_exp(sink - top) : 0.0f);
  }
  // One query head at a time, its sums in registers where DIM is known: each value row is
  // read once from memory and again, from the L1 cache, for the group's other heads.
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * keys;
    float* a = acc + g * dim;
    float sum[DIM > 0 ? DIM : 1] = {};
    for (int64_t j = 0; j < keys; ++j) {
      if (g == 0 && j + ahead < keys) {
        prefetch_row(v_cache + slots[begin + j + ahead] * slot_stride, dim);
      }
      const T* v = v_cache + slots[begin + j] * slot_stride;
      if constexpr (DIM > 0) {
        for (int64_t d = 0; d < DIM; ++d) sum[d] += p[j] * f32(v[d]);
      } else {
        for (int64_t d = 0; d < dim; ++d) a[d] += p[j] * f32(v[d]);
      }
    }
    if constexpr (DIM > 0) std::copy(sum, sum + DIM, a);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / sums[g];
    for (int64_t d = 0; d < dim; ++d) {
      out[g * out_head_stride + d] = to<T>(acc[g * dim + d] * inv);
    }
  }
}

// Each decode row's attention, q [B, H, D], over its context: slots [B, L] (the first
// lens[b] are row b's, in order), in caches [S, KVH, D]. window > 0 keeps each row's last
// `window` keys; softcap > 0 caps scores as Gemma 2; sinks [H] (gpt-oss) join each softmax's
// sum and attend to nothing. Computed in float32: [B, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots_in,
                            const at::Tensor& lens_in, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks_in) {
  check_dtype("decode_attention", q_in);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "decode_attention: caches ", k_cache.scalar_type(), " for q ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
              "decode_attention: q ", q.sizes(), ", caches ", k_cache.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == rows && lens.numel() == rows,
              "decode_attention: slots ", slots.sizes(), ", lens ", lens.sizes(), " for ", rows,
              " rows");
  const int64_t width = slots.size(1), num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width, "decode_attention: row ", b, " has ", lp[b],
                " keys of ", width);
    for (int64_t j = 0; j < lp[b]; ++j) {
      TORCH_CHECK(sp[b * width + j] >= 0 && sp[b * width + j] < num_slots,
                  "decode_attention: slot ", sp[b * width + j], " outside ", num_slots);
    }
  }
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks.numel() == heads, "decode_attention: ", sinks.numel(), " sinks for ", heads,
                " heads");
  }
  const float* sinkp = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, heads, dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows * kv_heads, 1, [&](int64_t b0, int64_t e0) {
      std::vector<float> buf;
      for (int64_t item = b0; item < e0; ++item) {
        const int64_t b = item / kv_heads, h = item % kv_heads, len = lp[b];
        const int64_t begin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        const auto attend = dim == 64 ? attend_group<T, 64>
                            : dim == 128 ? attend_group<T, 128> : attend_group<T, 0>;
        attend(qp + b * q.stride(0) + h * group * q.stride(1), q.stride(1),
                        kc + h * dim, vc + h * dim, kv_heads * dim, sp + b * width, begin, len,
                        group, dim, static_cast<float>(scale), static_cast<float>(softcap),
                        sinkp ? sinkp + h * group : nullptr, op + (b * heads + h * group) * dim,
                        dim, buf);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(loom_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rotary_into_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, "
      "float scale, int window, float softcap, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_into_cache", &rotary_into_cache);
  m.impl("decode_attention", &decode_attention);
}
