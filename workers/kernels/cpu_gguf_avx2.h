// GGUF's blocks decoded in AVX2 registers and their dot products with quantized rows, for CPUs
// without AVX512-VNNI: vpmaddubsw pairs codes with x's int8 codes, and vpmaddwd scales the
// pairs' sums by each 16-weight part's integer scale. Included by cpu_gguf_linear.cpp.

#pragma once

#include <immintrin.h>

#include "cpu_gguf_blocks.h"

namespace loom_cpu::gguf::avx2 {

// vpmaddubsw's sums of two products saturate past 32767: codes up to 6 bits (63 * 127 * 2)
// stay below it. Types of 8-bit codes (Q8_0, IQ4_NL, IQ4_XS) are held as signed values
// instead, their signs moved onto x (vpsignb), so that |code| <= 128: then their offsets
// (b, or the mins) are zero.
constexpr bool is_signed(int64_t type) {
  return type == Q8_0 || type == IQ4_NL || type == IQ4_XS;
}

// IQ4's sixteen values as signed bytes (IQ4_CODES less 128).
alignas(16) constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// A K-quant super-block: codes of weights 32c .. 32c + 31 in codes[c], each 16-weight part's
// integer scale and offset (as int16), d and dm as in KGroup.
struct KRegs {
  __m256i codes[8];
  alignas(32) int16_t sc[16];
  alignas(32) int16_t mins[16];
  float d, dm;
};

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 32 bytes shifted right by `bits` (16-bit shifts: the mask after keeps each byte's own).
inline __m256i shifted(const uint8_t* p, int bits, int mask) {
  return _mm256_and_si256(_mm256_srli_epi16(load32(p), bits), _mm256_set1_epi8(mask));
}

// Q4_K's and Q5_K's scales and mins (k4_scale_bytes), each for both of its 16-weight parts.
inline void k4_scales(const uint8_t* s, KRegs& k) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t mins = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = mins;
  u[0] &= low6;
  uint8_t bytes[16];
  std::memcpy(bytes, u, 16);
  for (int j = 0; j < 16; ++j) k.sc[j] = bytes[j / 2], k.mins[j] = bytes[8 + j / 2];
}

template <int64_t TYPE>
inline void decode(const uint8_t* block, KRegs& k) {
  if constexpr (TYPE == Q2_K) {  // scales[16], qs[64], d, dmin
    for (int c = 0; c < 8; ++c) k.codes[c] = shifted(block + 16 + 32 * (c / 4), 2 * (c % 4), 3);
    for (int j = 0; j < 16; ++j) k.sc[j] = block[j] & 0x0F, k.mins[j] = block[j] >> 4;
    k.d = half_at(block + 80), k.dm = -half_at(block + 82);
  } else if constexpr (TYPE == Q3_K) {  // hmask[32], qs[64], scales[12], d
    for (int c = 0; c < 8; ++c) {
      const __m256i low = shifted(block + 32 + 32 * (c / 4), 2 * (c % 4), 3);
      const __m256i high = shifted(block, c, 1);  // set: no offset of -4
      k.codes[c] = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
    }
    const uint8_t* s = block + 96;
    for (int j = 0; j < 16; ++j) {
      const int low = (s[j % 8] >> (4 * (j / 8))) & 0x0F;
      const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      k.sc[j] = static_cast<int16_t>((low | (high << 4)) - 32);
      k.mins[j] = static_cast<int16_t>(-4 * k.sc[j]);
    }
    k.d = k.dm = half_at(block + 108);
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {  // d, dmin, scales[12], (qh[32]), qs[128]
    constexpr int64_t qs = TYPE == Q4_K ? 16 : 48;
    for (int c = 0; c < 4; ++c) {
      k.codes[2 * c] = shifted(block + qs + 32 * c, 0, 0x0F);
      k.codes[2 * c + 1] = shifted(block + qs + 32 * c, 4, 0x0F);
    }
    if constexpr (TYPE == Q5_K) {
      for (int c = 0; c < 8; ++c) {
        k.codes[c] = _mm256_or_si256(k.codes[c], _mm256_slli_epi16(shifted(block + 16, c, 1), 4));
      }
    }
    k4_scales(block + 4, k);
    k.d = half_at(block), k.dm = -half_at(block + 2);
  } else if constexpr (TYPE == Q6_K) {  // ql[128], qh[64], scales[16] (int8), d
    for (int c = 0; c < 8; ++c) {
      const int half = c / 4, t = c % 4;
      const __m256i low = shifted(block + 64 * half + 32 * (t % 2), 4 * (t / 2), 0x0F);
      const __m256i high = shifted(block + 128 + 32 * half, 2 * t, 3);
      k.codes[c] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    const int8_t* s = reinterpret_cast<const int8_t*>(block + 192);
    for (int j = 0; j < 16; ++j) k.sc[j] = s[j], k.mins[j] = static_cast<int16_t>(-32 * s[j]);
    k.d = k.dm = half_at(block + 208);
  } else {
    static_assert(TYPE == IQ4_XS);  // d, scales_h (16 bits), scales_l[4], qs[128]: signed
    const __m256i table =
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
    for (int c = 0; c < 8; ++c) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 8 + 16 * c));
      const __m128i m4 = _mm_set1_epi8(0x0F);
      const __m256i nibbles =
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
      k.codes[c] = _mm256_shuffle_epi8(table, nibbles);
    }
    uint16_t high;
    std::memcpy(&high, block + 2, sizeof high);
    for (int i = 0; i < 8; ++i) {
      const int scale =
          (((block[4 + i / 2] >> (4 * (i % 2))) & 0x0F) | (((high >> (2 * i)) & 3) << 4)) - 32;
      k.sc[2 * i] = k.sc[2 * i + 1] = static_cast<int16_t>(scale);
      k.mins[2 * i] = k.mins[2 * i + 1] = 0;
    }
    k.d = k.dm = half_at(block);
  }
}

// The sums of adjacent pairs of products of 32 codes with x's 32 int8 codes, as 16 int16.
template <bool SIGNED>
inline __m256i pair_sums(__m256i codes, __m256i x) {
  if constexpr (SIGNED) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(x, codes));
  } else {
    return _mm256_maddubs_epi16(codes, x);
  }
}

inline float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  alignas(16) float f[4];
  _mm_store_ps(f, four);
  return (f[0] + f[2]) + (f[1] + f[3]);
}

// R rows of x (from row m0) against one output's row of super-blocks; `pairs` holds each
// row's sums per 16 inputs as int16 ([M, Kp / 32] words of two).
template <int64_t TYPE, int R>
[[gnu::always_inline]] inline void k_dot(const uint8_t* row, int64_t groups, int64_t block_bytes,
                                         const int8_t* codes, const float* scales,
                                         const int32_t* pairs, int64_t m0, int64_t kp,
                                         float* result) {
  constexpr bool same_scale = TYPE != Q2_K && TYPE != Q4_K && TYPE != Q5_K;
  const int64_t per_row = kp / GROUP;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    KRegs k;
    decode<TYPE>(row + g * block_bytes, k);
    __m256i scale[8];  // the two parts' scales of the c-th 32 codes, one per 16-bit lane
    for (int c = 0; c < 8; ++c) {
      scale[c] = _mm256_set_m128i(_mm_set1_epi16(k.sc[2 * c + 1]), _mm_set1_epi16(k.sc[2 * c]));
    }
    const __m256i mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(k.mins));
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, at = m * per_row + g;
      const int8_t* x = codes + m * kp + g * GROUP;
      __m256i dot = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i xc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c));
        const __m256i sums = pair_sums<is_signed(TYPE)>(k.codes[c], xc);
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(sums, scale[c]));
      }
      const __m256i parts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + at * 8));
      const __m256i offset = _mm256_madd_epi16(mins, parts);
      const float dx = scales[at];
      if constexpr (same_scale) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dot, offset)),
                                 _mm256_set1_ps(k.d * dx), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(k.d * dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset), _mm256_set1_ps(k.dm * dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// ---- legacy blocks ------------------------------------------------------------------------

// A block's 32 codes: [16 low nibbles | 16 high ones] for 4-bit types, Q5's fifth bits
// added, Q8_0's and IQ4_NL's as signed values.
template <int64_t TYPE>
inline __m256i block_codes(const uint8_t* block) {
  if constexpr (TYPE == Q8_0) {
    return load32(block + 2);
  } else {
    constexpr int64_t at = TYPE == Q4_0 || TYPE == IQ4_NL ? 2
                           : TYPE == Q4_1                 ? 4
                           : TYPE == Q5_0                 ? 6
                                                          : 8;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + at));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    if constexpr (TYPE == IQ4_NL) {
      const __m256i table =
          _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
      codes = _mm256_shuffle_epi8(table, codes);
    } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
      uint32_t bits;
      std::memcpy(&bits, block + (TYPE == Q5_0 ? 2 : 4), sizeof bits);
      // Byte i takes qh's byte i / 8, then keeps bit i % 8 of it.
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int32_t>(bits)),
          _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      codes = _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return codes;
  }
}

// The a and b of `count` (1 to 8) blocks from `first`, 0 past them (b 0 for signed types).
template <int64_t TYPE>
inline void legacy_scales(const uint8_t* first, int64_t count, __m256& a, __m256& b) {
  constexpr int64_t bytes = type_info(TYPE).block_bytes;
  constexpr bool has_min = TYPE == Q4_1 || TYPE == Q5_1;
  alignas(16) uint16_t d[BLOCKS] = {}, m[BLOCKS] = {};
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(&d[i], first + i * bytes, 2);
    if constexpr (has_min) std::memcpy(&m[i], first + i * bytes + 2, 2);
  }
  a = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d)));
  if constexpr (has_min) {
    b = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(m)));
  } else if constexpr (is_signed(TYPE)) {
    b = _mm256_setzero_ps();
  } else {
    b = _mm256_mul_ps(a, _mm256_set1_ps(TYPE == Q4_0 ? -8.0f : -16.0f));
  }
}

// R rows of x against one output's row of legacy blocks (`blocks` of them).
template <int64_t TYPE, int R>
[[gnu::always_inline]] inline void l_dot(const uint8_t* row, int64_t blocks, int64_t block_bytes,
                                         const int8_t* codes, const float* scales,
                                         const float* scaled_sums, int64_t m0, int64_t kp,
                                         float* result) {
  const int64_t per_row = kp / LEGACY;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R], offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = offsets[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < blocks; g += BLOCKS) {
    const int64_t count = std::min<int64_t>(BLOCKS, blocks - g);
    const uint8_t* first = row + g * block_bytes;
    __m256 a, b;
    legacy_scales<TYPE>(first, count, a, b);
    __m256i w[BLOCKS];
    for (int64_t i = 0; i < count; ++i) w[i] = block_codes<TYPE>(first + i * block_bytes);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, at = m * per_row + g;
      const __m256 ad = _mm256_mul_ps(a, _mm256_loadu_ps(scales + at));
      for (int64_t i = 0; i < count; ++i) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + m * kp + (g + i) * LEGACY));
        const __m256i dot = _mm256_madd_epi16(pair_sums<is_signed(TYPE)>(w[i], x), ones);
        const __m256 scale = _mm256_permutevar8x32_ps(ad, _mm256_set1_epi32(static_cast<int>(i)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
      }
      offsets[r] = _mm256_fmadd_ps(b, _mm256_loadu_ps(scaled_sums + at), offsets[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]) + sum8(offsets[r]);
}

}  // namespace loom_cpu::gguf::avx2
