// Decode attention on the CPU: each decode row's query heads over its context, read from the
// paged K/V cache where it lies (no gather), in float32.

#include "cpu_ops.h"

namespace loom_cpu {

// ---- Decode attention over the paged cache -------------------------------------------------

inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 x, y;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    acc += x * y;
  }
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
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
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& lens, double scale, int64_t window, double softcap,
                            const std::optional<at::Tensor>& sinks) {
  return decode_attention_rows(q, k_cache, v_cache, slots, lens, scale, window, softcap, sinks,
                               true);
}

at::Tensor decode_attention_rows(const at::Tensor& q_in, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& slots_in,
                                 const at::Tensor& lens_in, double scale, int64_t window,
                                 double softcap, const std::optional<at::Tensor>& sinks_in,
                                 bool check_slots) {
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
  for (int64_t b = 0; b < rows && check_slots; ++b) {
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

}  // namespace loom_cpu
