// What the CPU attention kernels share (cpu_attention.cpp, cpu_prefill_attention.cpp): their
// input checks; a sliding window's first key; dot products and maxima over float rows,
// prefetches, sums of sixteen vectors' lanes; the softmax of rows of scores and the weighing
// of value rows.

#pragma once

#include <immintrin.h>

#include "cpu_ops.h"

namespace loom_cpu {

// Where the CPU has bfloat16 dot products (AVX512-BF16; the library is compiled for the CPU it
// runs on), a bfloat16 cache's scores are summed from them: products of bfloat16 values are
// exact in float, and neither query nor key is widened first.
#ifdef __AVX512BF16__
template <typename T>
constexpr bool BF16_DOTS = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool BF16_DOTS = false;
#endif

// The first key that a query at position pos sees: its last `window` keys where window > 0.
inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : int64_t{0};
}

// q with dense heads, checked against the caches [S, KVH, D] it attends over (errors name op).
inline at::Tensor checked_query(const char* op, const at::Tensor& q_in, const at::Tensor& k_cache,
                                const at::Tensor& v_cache) {
  check_dtype(op, q_in);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              op, ": caches ", k_cache.scalar_type(), " for q ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
              op, ": q ", q.sizes(), ", caches ", k_cache.sizes());
  return q;
}

// A sink logit per query head, in float32 (undefined where there are none).
inline at::Tensor checked_sinks(const char* op, const std::optional<at::Tensor>& sinks,
                                int64_t heads) {
  if (!sinks.has_value()) return at::Tensor();
  at::Tensor out = sinks->to(at::kFloat).contiguous();
  TORCH_CHECK(out.numel() == heads, op, ": ", out.numel(), " sinks for ", heads, " heads");
  return out;
}

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

// Lane j of the result is the sum of key j's partial sums, for sixteen keys whose partials
// come in pairs: vector m holds key 2m's eight in lanes 0-7 and key 2m + 1's in lanes 8-15.
// Halves are paired across vectors, so no sum waits on a lone shuffle chain.
inline v16 lane_sums_of_pairs(const v16* pairs) {
  v16 quads[4], octets[2];
  for (int m = 0; m < 4; ++m) {  // lanes i and i + 4 of each half: four vectors' four
    const v16 a = pairs[2 * m], b = pairs[2 * m + 1];
    quads[m] =
        __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
        __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int m = 0; m < 2; ++m) {  // then i and i + 2: eight vectors' two
    const v16 a = quads[2 * m], b = quads[2 * m + 1];
    octets[m] =
        __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
        __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  const v16 a = octets[0], b = octets[1];  // then the two: sixteen vectors' one
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Lane j of the result is horizontal_sum(parts[j]), for sixteen vectors at once: lanes i and
// i + 8 of two vectors make a pair's, then as lane_sums_of_pairs.
inline v16 lane_sums(const v16* parts) {
  v16 pairs[8];
  for (int m = 0; m < 8; ++m) {
    const v16 a = parts[2 * m], b = parts[2 * m + 1];
    pairs[m] =
        __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  return lane_sums_of_pairs(pairs);
}

// a * b + c in one rounding where the CPU fuses them (the weighing of the value rows).
[[gnu::always_inline]] inline v16 fma16(v16 a, v16 b, v16 c) {
#ifdef __AVX512F__
  return reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                               reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#else
  return a * b + c;
#endif
}

// The softmax of each of a group's rows of scores, in place: scaled, capped, less their
// maximum, exponentiated; the sums (sinks included) go to `sums`. Two passes over a row, each
// sixteen scores at a time: the scaling with the maximum, then the exponentials (fast_exp's
// values) with their sum. A row's last few scores make one more vector, its other lanes -inf
// (whose exponentials are 0).
inline void softmax_rows(float* scores, int64_t group, int64_t keys, float scale, float softcap,
                         const float* sinks, float* sums) {
  const float none = -std::numeric_limits<float>::infinity();
  const int64_t whole = keys / 16 * 16, tail = keys - whole;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * keys;
    const float sink = sinks ? sinks[g] : none;
    if (softcap > 0) {
      for (int64_t j = 0; j < keys; ++j) s[j] = std::tanh(s[j] * scale / softcap) * softcap;
    }
    const float factor = softcap > 0 ? 1.0f : scale;  // capped scores are scaled already
    v16 part = v16{} + sink, last = v16{} + none;
    for (int64_t j = 0; j < whole; j += 16) {
      v16 x;
      std::memcpy(&x, s + j, sizeof x);
      x *= factor;
      std::memcpy(s + j, &x, sizeof x);
      part = part > x ? part : x;
    }
    for (int64_t u = 0; u < tail; ++u) last[u] = s[whole + u] *= factor;
    part = part > last ? part : last;
    float top = sink;
    for (int u = 0; u < 16; ++u) top = top > part[u] ? top : part[u];
    v16 acc = {};
    for (int64_t j = 0; j < whole; j += 16) {
      v16 x;
      std::memcpy(&x, s + j, sizeof x);
      const v16 e = fast_exp16(x - top);
      std::memcpy(s + j, &e, sizeof e);
      acc += e;
    }
    if (tail > 0) {
      const v16 e = fast_exp16(last - top);
      for (int64_t u = 0; u < tail; ++u) s[whole + u] = e[u];
      acc += e;
    }
    sums[g] = horizontal_sum(acc) + (sinks ? fast_exp(sink - top) : 0.0f);
  }
}

// HEADS query heads' weighted sums of the value rows of keys [j0, j1), added to `acc` (in
// load32's lane order) and held in registers meanwhile: each value row is loaded once for all.
// Out of line: inlined into the prompt kernel's item, GCC kept the sums in memory instead.
template <typename T, int64_t DIM, int64_t HEADS>
[[gnu::noinline]] void weigh_values(const float* probs, int64_t keys, int64_t j0, int64_t j1,
                                   const T* v_cache, int64_t slot_stride, const int64_t* slots,
                                   float* acc) {
  constexpr int64_t C = DIM / 16;
  // The sums in and out a vector at a time (acc need not be aligned to a vector's size): one
  // memcpy of them all was a library call, a tenth of the time of a chunk of keys.
  v16 sum[HEADS][C];
  for (int64_t h = 0; h < HEADS; ++h) {
    for (int64_t c = 0; c < C; ++c) std::memcpy(&sum[h][c], acc + (h * C + c) * 16, sizeof(v16));
  }
  for (int64_t j = j0; j < j1; ++j) {
    const T* v = v_cache + slots[j] * slot_stride;
    v16 row[C];
    for (int64_t c = 0; c < C; c += 2) load32(v + c * 16, row[c], row[c + 1]);
    for (int64_t h = 0; h < HEADS; ++h) {
      const v16 p = v16{} + probs[h * keys + j];
      for (int64_t c = 0; c < C; ++c) sum[h][c] = fma16(p, row[c], sum[h][c]);
    }
  }
  for (int64_t h = 0; h < HEADS; ++h) {
    for (int64_t c = 0; c < C; ++c) std::memcpy(acc + (h * C + c) * 16, &sum[h][c], sizeof(v16));
  }
}

// Query rows weighed in one pass over the value rows: 4, or 2 past 64 dims, so that their
// sums fill sixteen registers.
template <int64_t DIM>
constexpr int64_t VALUE_ROWS = DIM <= 64 ? 4 : 2;

// weigh_values for n query rows, n from 1 to VALUE_ROWS<DIM>.
template <typename T, int64_t DIM>
void weigh_value_rows(int64_t n, const float* probs, int64_t keys, int64_t j0, int64_t j1,
                      const T* v_cache, int64_t slot_stride, const int64_t* slots, float* acc) {
  if constexpr (VALUE_ROWS<DIM> == 4) {
    if (n == 4) {
      return weigh_values<T, DIM, 4>(probs, keys, j0, j1, v_cache, slot_stride, slots, acc);
    }
    if (n == 3) {
      return weigh_values<T, DIM, 3>(probs, keys, j0, j1, v_cache, slot_stride, slots, acc);
    }
  }
  if (n == 2) return weigh_values<T, DIM, 2>(probs, keys, j0, j1, v_cache, slot_stride, slots, acc);
  weigh_values<T, DIM, 1>(probs, keys, j0, j1, v_cache, slot_stride, slots, acc);
}

}  // namespace loom_cpu
