// GGUF's quant blocks as llama.cpp stores them, read into one form the CPU kernels compute
// with (cpu_gguf_linear.cpp): 256 weights a group, as unsigned codes with integer scales.

#pragma once

#ifdef __F16C__
#include <immintrin.h>
#endif

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loom_cpu::gguf {

// ggml's type ids, as GGUF files name their tensors' types.
enum Type : int64_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  IQ4_NL = 20,
  IQ4_XS = 23,
  BF16 = 30,
};

constexpr int64_t GROUP = 256;  // weights a decoded group holds
constexpr int64_t SUB = 16;     // weights a K-quant's integer scale covers, at the finest
constexpr int64_t LEGACY = 32;  // weights a legacy block (Q4_0 ... Q8_0, IQ4_NL) holds

constexpr int64_t BLOCKS = GROUP / LEGACY;

// Blocks of 256 the AVX-512 K-quant dot fetches ahead of the one it decodes. With a block's
// decoding between its loads, the hardware's own prefetch alone left the weights' stream
// short of memory's bandwidth; 8 was the fastest of 4, 8 and 16 on an 8B shape. The AVX2 dot,
// slower to decode, gained nothing from it.
constexpr int64_t PREFETCH_GROUPS = 8;

// Asks for the block PREFETCH_GROUPS ahead of `block` (the next output's row, near a row's end).
[[gnu::always_inline]] inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
  const uint8_t* ahead = block + PREFETCH_GROUPS * block_bytes;
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);
}

// A K-quant's group: w_i = d * sc[j] * codes[i] + dm * mn[j] for i in 16-weight part j. A dot
// product with x quantized per group (x_i ~ dx * q_i) is then exact in integers up to two
// float multiplies: dx * (d * sum_j sc[j] * dot_j + dm * sum_j mn[j] * sum_j(q)).
struct KGroup {
  alignas(64) uint8_t codes[GROUP];
  alignas(64) int32_t sc[GROUP / SUB];
  alignas(64) int32_t mn[GROUP / SUB];
  float d, dm;
};

// Eight legacy blocks: w_i = a[b] * codes[i] + b[b] for i in block b (of 32). Blocks past the
// row's end have codes, a and b of 0.
struct LGroup {
  alignas(64) uint8_t codes[GROUP];
  alignas(32) float a[BLOCKS];
  alignas(32) float b[BLOCKS];
};

struct TypeInfo {
  int64_t block_weights;  // weights a stored block holds
  int64_t block_bytes;
  bool k_quant;  // decodes into KGroup (else LGroup)
};

// The layout of a quantized type; block_weights 0 for one the kernels do not read.
constexpr TypeInfo type_info(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18, false};
    case Q4_1: return {32, 20, false};
    case Q5_0: return {32, 22, false};
    case Q5_1: return {32, 24, false};
    case Q8_0: return {32, 34, false};
    case IQ4_NL: return {32, 18, false};
    case Q2_K: return {256, 84, true};
    case Q3_K: return {256, 110, true};
    case Q4_K: return {256, 144, true};
    case Q5_K: return {256, 176, true};
    case Q6_K: return {256, 210, true};
    case IQ4_XS: return {256, 136, true};
    default: return {0, 0, false};
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction, where c10's conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// IQ4's sixteen values, plus 128: unsigned codes.
constexpr uint8_t IQ4_CODES[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                   129, 141, 153, 166, 181, 197, 217, 241};

// ---- legacy blocks: up to BLOCKS of them into an LGroup --------------------------------

// Q4_0, Q4_1 and IQ4_NL: 16 bytes of nibbles, weight i low, weight 16 + i high.
template <bool TABLE>
inline void nibbles32(const uint8_t* qs, uint8_t* codes) {
  for (int i = 0; i < 16; ++i) {
    const uint8_t lo = qs[i] & 0x0F, hi = qs[i] >> 4;
    codes[i] = TABLE ? IQ4_CODES[lo] : lo;
    codes[16 + i] = TABLE ? IQ4_CODES[hi] : hi;
  }
}

// Q5_0 and Q5_1: the nibbles, and a fifth bit for weight i at bit i of qh.
inline void fives32(const uint8_t* qh_bytes, const uint8_t* qs, uint8_t* codes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, sizeof qh);
  for (int i = 0; i < 16; ++i) {
    codes[i] = (qs[i] & 0x0F) | (((qh >> i) & 1u) << 4);
    codes[16 + i] = (qs[i] >> 4) | (((qh >> (16 + i)) & 1u) << 4);
  }
}

template <int64_t TYPE>
inline void decode_legacy_block(const uint8_t* block, uint8_t* codes, float& a, float& b) {
  const float d = half_at(block);
  if constexpr (TYPE == Q4_0) {
    nibbles32<false>(block + 2, codes);
    a = d, b = -8.0f * d;
  } else if constexpr (TYPE == Q4_1) {
    nibbles32<false>(block + 4, codes);
    a = d, b = half_at(block + 2);
  } else if constexpr (TYPE == Q5_0) {
    fives32(block + 2, block + 6, codes);
    a = d, b = -16.0f * d;
  } else if constexpr (TYPE == Q5_1) {
    fives32(block + 4, block + 8, codes);
    a = d, b = half_at(block + 2);
  } else if constexpr (TYPE == Q8_0) {
    for (int i = 0; i < 32; ++i) codes[i] = block[2 + i] ^ 0x80;  // int8 q as q + 128
    a = d, b = -128.0f * d;
  } else {
    static_assert(TYPE == IQ4_NL);
    nibbles32<true>(block + 2, codes);
    a = d, b = -128.0f * d;
  }
}

// `count` (1 to BLOCKS) consecutive blocks into g; the rest of g zero.
template <int64_t TYPE>
inline void decode_legacy(const uint8_t* blocks, int64_t count, LGroup& g) {
  constexpr int64_t bytes = type_info(TYPE).block_bytes;
  for (int64_t k = 0; k < count; ++k) {
    decode_legacy_block<TYPE>(blocks + k * bytes, g.codes + k * LEGACY, g.a[k], g.b[k]);
  }
  for (int64_t k = count; k < BLOCKS; ++k) {
    std::memset(g.codes + k * LEGACY, 0, LEGACY);
    g.a[k] = g.b[k] = 0.0f;
  }
}

// ---- K-quants: one super-block of 256 into a KGroup ------------------------------------

// Q4_K's and Q5_K's eight 6-bit scales and mins (ggml's get_scale_min_k4).
inline void k4_scales(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int i = 0; i < 4; ++i) {
    const int32_t scale = s[i] & 63, min = s[i + 4] & 63;
    const int32_t high_scale = (s[i + 8] & 0x0F) | ((s[i] >> 6) << 4);
    const int32_t high_min = (s[i + 8] >> 4) | ((s[i + 4] >> 6) << 4);
    sc[2 * i] = sc[2 * i + 1] = scale;
    mn[2 * i] = mn[2 * i + 1] = min;
    sc[8 + 2 * i] = sc[8 + 2 * i + 1] = high_scale;
    mn[8 + 2 * i] = mn[8 + 2 * i + 1] = high_min;
  }
}

// Q4_K's and Q5_K's 128 bytes of nibbles: in 32-byte chunks c, weights 64c + i low and
// 64c + 32 + i high.
inline void k4_nibbles(const uint8_t* qs, uint8_t* codes) {
  for (int c = 0; c < 4; ++c) {
    for (int i = 0; i < 32; ++i) {
      codes[64 * c + i] = qs[32 * c + i] & 0x0F;
      codes[64 * c + 32 + i] = qs[32 * c + i] >> 4;
    }
  }
}

template <int64_t TYPE>
inline void decode_k(const uint8_t* block, KGroup& g) {
  if constexpr (TYPE == Q2_K) {  // scales[16], qs[64], d, dmin
    const uint8_t* qs = block + 16;
    for (int c = 0; c < 2; ++c)
      for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 32; ++i)
          g.codes[128 * c + 32 * s + i] = (qs[32 * c + i] >> (2 * s)) & 3;
    for (int j = 0; j < 16; ++j) g.sc[j] = block[j] & 0x0F, g.mn[j] = block[j] >> 4;
    g.d = half_at(block + 80), g.dm = -half_at(block + 82);
  } else if constexpr (TYPE == Q3_K) {  // hmask[32], qs[64], scales[12], d
    const uint8_t *hmask = block, *qs = block + 32, *s = block + 96;
    for (int c = 0; c < 2; ++c)
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 32; ++i) {
          const int w = 128 * c + 32 * k + i;
          const int high = (hmask[i] >> (w / 32)) & 1;  // set: no offset of -4
          g.codes[w] = ((qs[32 * c + i] >> (2 * k)) & 3) | (high << 2);
        }
    for (int j = 0; j < 16; ++j) {
      const int low = (s[j % 8] >> (4 * (j / 8))) & 0x0F;
      const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      g.sc[j] = (low | (high << 4)) - 32;
      g.mn[j] = -4 * g.sc[j];
    }
    g.d = g.dm = half_at(block + 108);
  } else if constexpr (TYPE == Q4_K) {  // d, dmin, scales[12], qs[128]
    k4_nibbles(block + 16, g.codes);
    k4_scales(block + 4, g.sc, g.mn);
    g.d = half_at(block), g.dm = -half_at(block + 2);
  } else if constexpr (TYPE == Q5_K) {  // d, dmin, scales[12], qh[32], qs[128]
    const uint8_t* qh = block + 16;
    k4_nibbles(block + 48, g.codes);
    for (int k = 0; k < 8; ++k)
      for (int i = 0; i < 32; ++i) g.codes[32 * k + i] |= ((qh[i] >> k) & 1) << 4;
    k4_scales(block + 4, g.sc, g.mn);
    g.d = half_at(block), g.dm = -half_at(block + 2);
  } else if constexpr (TYPE == Q6_K) {  // ql[128], qh[64], scales[16] (int8), d
    const uint8_t *ql = block, *qh = block + 128;
    const int8_t* s = reinterpret_cast<const int8_t*>(block + 192);
    for (int c = 0; c < 2; ++c) {
      for (int i = 0; i < 64; ++i) {
        g.codes[128 * c + i] = ql[64 * c + i] & 0x0F;
        g.codes[128 * c + 64 + i] = ql[64 * c + i] >> 4;
      }
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 32; ++i)
          g.codes[128 * c + 32 * k + i] |= ((qh[32 * c + i] >> (2 * k)) & 3) << 4;
    }
    for (int j = 0; j < 16; ++j) g.sc[j] = s[j], g.mn[j] = -32 * s[j];
    g.d = g.dm = half_at(block + 208);
  } else {
    static_assert(TYPE == IQ4_XS);  // d, scales_h (16 bits), scales_l[4], qs[128]
    uint16_t high;
    std::memcpy(&high, block + 2, sizeof high);
    const uint8_t *low = block + 4, *qs = block + 8;
    for (int k = 0; k < 8; ++k) {
      const int32_t scale =
          (((low[k / 2] >> (4 * (k % 2))) & 0x0F) | (((high >> (2 * k)) & 3) << 4)) - 32;
      g.sc[2 * k] = g.sc[2 * k + 1] = scale;
      g.mn[2 * k] = g.mn[2 * k + 1] = -128 * scale;
      for (int i = 0; i < 16; ++i) {
        g.codes[32 * k + i] = IQ4_CODES[qs[16 * k + i] & 0x0F];
        g.codes[32 * k + 16 + i] = IQ4_CODES[qs[16 * k + i] >> 4];
      }
    }
    g.d = g.dm = half_at(block);
  }
}

// Calls f(std::integral_constant<int64_t, TYPE>{}) for a type the kernels read.
template <typename F>
inline void with_type(int64_t type, F&& f) {
  switch (type) {
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q5_0: return f(std::integral_constant<int64_t, Q5_0>{});
    case Q5_1: return f(std::integral_constant<int64_t, Q5_1>{});
    case Q8_0: return f(std::integral_constant<int64_t, Q8_0>{});
    case IQ4_NL: return f(std::integral_constant<int64_t, IQ4_NL>{});
    case Q2_K: return f(std::integral_constant<int64_t, Q2_K>{});
    case Q3_K: return f(std::integral_constant<int64_t, Q3_K>{});
    case Q4_K: return f(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int64_t, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int64_t, Q6_K>{});
    case IQ4_XS: return f(std::integral_constant<int64_t, IQ4_XS>{});
    default: TORCH_CHECK(false, "GGUF type ", type, " is not one loomllm's kernels read");
  }
}

constexpr bool is_k_quant(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K ||
         type == IQ4_XS;
}

}  // namespace loom_cpu::gguf
