// Shared by loomllm's CPU kernels (cpu_native.py's SOURCES): the roundings and vector-friendly
// helpers they compute with, and the ops each defines.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace loom_cpu {

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

inline void check_dtype(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
              " takes float32 or bfloat16, got ", t.scalar_type());
}

template <typename T>
inline void to_float(const T* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32(x[i]);
}

// exp(clamped) as 2^n times a polynomial on the remainder: the polynomial, and n (a float
// holding an integer). V is a float or a vector of them, whose lanes get the same values.
template <typename V>
[[gnu::always_inline]] inline V exp_parts(V clamped, V& n) {
  // Rounded to the nearest integer by adding and taking away 1.5 * 2^23 (nearbyint is a call).
  n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const V r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// expf written to vectorize: 2^n times a polynomial on the remainder, within 2 ulp of expf
// over [-87, 88.7]; 0 below (expf's denormals), infinity above (as expf).
[[gnu::always_inline]] inline float fast_exp(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.72283935546875f);
  float n;
  float p = exp_parts(clamped, n);
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&p, &bits, sizeof bits);
  return x < -87.0f ? 0.0f : x > 88.72283935546875f ? std::numeric_limits<float>::infinity() : p;
}

// Sixteen floats as one vector (two or four registers where the CPU's are narrower), for
// the horizontal sum the compiler leaves scalar when written over an array.
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

typedef int32_t v16i __attribute__((vector_size(64)));

// fast_exp of sixteen lanes at once, the same operations in the same order: the same values.
[[gnu::always_inline]] inline v16 fast_exp16(v16 x) {
  const v16 low = v16{} - 87.0f, high = v16{} + 88.72283935546875f;
  const v16 clamped = x < low ? low : (x > high ? high : x);
  v16 n;
  const v16 p = exp_parts(clamped, n);
  const v16i bits = reinterpret_cast<v16i>(p) + __builtin_convertvector(n, v16i) * (1 << 23);
  const v16 inf = v16{} + std::numeric_limits<float>::infinity();
  return x < low ? v16{} : (x > high ? inf : reinterpret_cast<v16>(bits));
}

// Thirty-two values from memory as two vectors of floats, in the lane order each type loads
// fastest: float32 as it lies; bfloat16 (a float's upper half) as its 32-bit words' lower and
// upper halves, the even and the odd elements, by a shift and a mask without widening.
template <typename T>
[[gnu::always_inline]] inline void load32(const T* x, v16& first, v16& second) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&first, x, sizeof first);
    std::memcpy(&second, x + 16, sizeof second);
  } else {
    typedef uint32_t v16u32 __attribute__((vector_size(64)));
    v16u32 words;
    std::memcpy(&words, x, sizeof words);
    first = reinterpret_cast<v16>(words << 16);
    second = reinterpret_cast<v16>(words & 0xffff0000u);
  }
}

// The inverse of load32: two vectors, in its lane order, rounded to T and stored as the
// thirty-two values they hold (bf16_bits in vector form).
template <typename T>
[[gnu::always_inline]] inline void store32(T* x, v16 first, v16 second) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(x, &first, sizeof first);
    std::memcpy(x + 16, &second, sizeof second);
  } else {
    typedef uint32_t v16u32 __attribute__((vector_size(64)));
    const auto round = [](v16 v) {
      const v16u32 bits = reinterpret_cast<v16u32>(v);
      const v16u32 even = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
      const v16u32 nan = reinterpret_cast<v16u32>(v != v);
      return (nan & 0x7fc00000u) | (~nan & even);
    };
    const v16u32 words = (round(first) >> 16) | round(second);
    std::memcpy(x, &words, sizeof words);
  }
}

inline float horizontal_sum(v16 v) {
  const v8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) +
                __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

inline float sum_of(const float* a, int64_t n) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 x;
    std::memcpy(&x, a + i, sizeof x);
    acc += x;
  }
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) sum += a[i];
  return sum;
}

// silu(x) as F.silu computes it, x / (1 + exp(-x)) in float, rounded to T.
template <typename T>
[[gnu::always_inline]] inline float silu(float x) {
  return rounded<T>(x / (1.0f + fast_exp(-x)));
}

// silu of every bfloat16, by its bits (cpu_ops.cpp): a lookup costs less than the exp and the
// division, and gives the same values.
const uint16_t* bf16_silu_table();

// silu(gate) * up of gate_up [..., 2I] (gate first): F.silu rounds, then the product rounds.
// In passes over a float row, which the compiler vectorizes (one loop of all three it did not).
// table: bf16_silu_table() for bfloat16 (fetched once by the caller), else unused.
template <typename T>
inline void silu_row(const T* gate, const T* up, T* out, int64_t n, float* scratch,
                     const uint16_t* table) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t word = static_cast<uint32_t>(table[gate[i].x]) << 16;
      std::memcpy(scratch + i, &word, sizeof word);
    }
    for (int64_t i = 0; i < n; ++i) out[i] = to<T>(scratch[i] * f32(up[i]));
  } else {
    to_float(gate, scratch, n);
    for (int64_t i = 0; i < n; ++i) scratch[i] = silu<T>(scratch[i]);
    for (int64_t i = 0; i < n; ++i) out[i] = to<T>(scratch[i] * f32(up[i]));
  }
}

// cpu_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor rotary_into_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& slot_mapping);

// cpu_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& lens, double scale, int64_t window, double softcap,
                            const std::optional<at::Tensor>& sinks);
// decode_attention's body. check_slots false: the caller has checked these slots and lengths
// against caches of this many slots (a stack's later layers, after its first).
at::Tensor decode_attention_rows(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& slots,
                                 const at::Tensor& lens, double scale, int64_t window,
                                 double softcap, const std::optional<at::Tensor>& sinks,
                                 bool check_slots);

// cpu_prefill_attention.cpp
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& slots,
                             const at::Tensor& lens, const at::Tensor& q_starts,
                             const at::Tensor& q_lens, double scale, int64_t window,
                             double softcap, const std::optional<at::Tensor>& sinks);

// cpu_sample.cpp
at::Tensor greedy_ids(const at::Tensor& logits);
std::tuple<at::Tensor, at::Tensor> random_sample(const at::Tensor& logits,
                                                 const at::Tensor& temperatures,
                                                 const at::Tensor& uniforms);

// cpu_block_linear.cpp
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias, int64_t bits, bool portable_only);
// block_linear(silu_mul(gate_up), ...), the same values, for gate_up [M, 2K] (gate first):
// the product is quantized as it is computed, never written out.
at::Tensor silu_block_linear(const at::Tensor& gate_up, const at::Tensor& packed,
                             const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                             int64_t bits, bool portable_only);
bool block_linear_has_vnni();

// cpu_gguf_linear.cpp: x @ w.T for w as GGUF blocks, stacked from parts (rows [N_i, bytes] of
// ggml type types[i]; heads[i] > 0 undoes llama.cpp's rotary row order of q and k). kernel:
// 0 the fastest for the rows, 1 one kernel at every number of rows (batch-invariant), 2 the
// portable loop.
at::Tensor gguf_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                       at::IntArrayRef heads, const std::optional<at::Tensor>& bias,
                       int64_t kernel);
// gguf_linear(silu_mul(gate_up), ...), the same values, for gate_up [M, 2K] (gate first).
at::Tensor silu_gguf_linear(const at::Tensor& gate_up, at::TensorList weights,
                            at::IntArrayRef types, at::IntArrayRef heads,
                            const std::optional<at::Tensor>& bias, int64_t kernel);
// The rows (all, or those `rows` names) of a [N, bytes] tensor of blocks as [rows, k] floats.
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t k,
                           const std::optional<at::Tensor>& rows, at::ScalarType dtype);
// Every byte of the tensors read once, on the threads as the kernels read a weight (an XOR of
// them, so that the reads happen): the bandwidth the one-row kernels are held to.
int64_t read_bytes(at::TensorList tensors);

}  // namespace loom_cpu
