// GGUF's blocks decoded in AVX-512 registers, as cpu_gguf_blocks.h's portable decoders decode
// them into memory, and their dot products with quantized rows (vpdpbusd). Included by
// cpu_gguf_linear.cpp where the CPU has AVX512-VNNI.

#pragma once

#include <immintrin.h>

#include "cpu_gguf_blocks.h"

namespace loom_cpu::gguf::avx512 {

// A K-quant super-block in registers: codes of weights 64c .. 64c + 63 in codes[c] (their
// natural order), the integer scale and offset of each 16-weight part (lane j: part j), d and
// dm as in KGroup.
struct KRegs {
  __m512i codes[4];
  __m512i sc;
  __m512i mins;
  float d, dm;
};

// The lanes' 16-weight parts for the c-th 64 codes (4 lanes each); and lanes 2i and 2i + 1
// taking lane `first` + i (a 32-weight scale for both of its 16-weight parts).
inline __m512i spread16(int c) {
  const int b = 4 * c;
  return _mm512_set_epi32(b + 3, b + 3, b + 3, b + 3, b + 2, b + 2, b + 2, b + 2, b + 1, b + 1,
                          b + 1, b + 1, b, b, b, b);
}
inline __m512i pairs_of(int first) {
  const int b = first;
  return _mm512_set_epi32(b + 7, b + 7, b + 6, b + 6, b + 5, b + 5, b + 4, b + 4, b + 3, b + 3,
                          b + 2, b + 2, b + 1, b + 1, b, b);
}

// 32 bytes in both halves of a vector, shifted right by `low` bits in the lower half and by
// `high` in the upper (16-bit shifts: the masks after them keep each byte's own bits).
inline __m512i halves_shifted(const uint8_t* p, int low, int high) {
  const __m512i both =
      _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(low)),
                                           _mm256_set1_epi16(static_cast<int16_t>(high)), 1);
  return _mm512_srlv_epi16(both, shift);
}

// Q4_K's and Q5_K's 128 bytes of nibbles as codes in natural order: a 32-byte chunk holds
// weights 64c + i (low nibbles) and 64c + 32 + i (high).
inline void k4_nibble_codes(const uint8_t* qs, __m512i* codes) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(qs + 64 * h);
    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    codes[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
    codes[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
  }
}

// Q4_K's and Q5_K's eight 6-bit scales, then eight mins, as 16 bytes (llama.cpp's trick on
// 32-bit words: each mask keeps its byte's own bits).
inline __m128i k4_scale_bytes(const uint8_t* s) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  const uint32_t high_mins = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t high_scales = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  // Built in registers: a vector loaded from four 32-bit stores just made would stall.
  return _mm_set_epi32(static_cast<int>(high_mins), static_cast<int>(u[1] & low6),
                       static_cast<int>(high_scales), static_cast<int>(u[0] & low6));
}

inline void k4_scales(const uint8_t* s, KRegs& k) {
  const __m512i both = _mm512_cvtepu8_epi32(k4_scale_bytes(s));  // 8 scales, then 8 mins
  k.sc = _mm512_permutexvar_epi32(pairs_of(0), both);
  k.mins = _mm512_permutexvar_epi32(pairs_of(8), both);
}

// Q3_K's sixteen 6-bit scales as bytes, before the offset of 32.
inline __m128i k3_scale_bytes(const uint8_t* s) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  constexpr uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
  const uint32_t top = u[2];
  return _mm_set_epi32(static_cast<int>(((u[1] >> 4) & low4) | (((top >> 6) & low2) << 4)),
                       static_cast<int>(((u[0] >> 4) & low4) | (((top >> 4) & low2) << 4)),
                       static_cast<int>((u[1] & low4) | (((top >> 2) & low2) << 4)),
                       static_cast<int>((u[0] & low4) | ((top & low2) << 4)));
}

template <int64_t TYPE>
inline void decode(const uint8_t* block, KRegs& k) {
  const __m512i one = _mm512_set1_epi8(1), three = _mm512_set1_epi8(3);
  if constexpr (TYPE == Q2_K) {  // scales[16], qs[64], d, dmin
    const uint8_t* qs = block + 16;
    for (int c = 0; c < 4; ++c) {
      const int s = 4 * (c % 2);
      k.codes[c] = _mm512_and_si512(halves_shifted(qs + 32 * (c / 2), s, s + 2), three);
    }
    const __m512i raw =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    k.sc = _mm512_and_si512(raw, _mm512_set1_epi32(0x0F));
    k.mins = _mm512_srli_epi32(raw, 4);
    k.d = half_at(block + 80), k.dm = -half_at(block + 82);
  } else if constexpr (TYPE == Q3_K) {  // hmask[32], qs[64], scales[12], d
    const uint8_t *hmask = block, *qs = block + 32;
    for (int c = 0; c < 4; ++c) {
      const int s = 4 * (c % 2);
      const __m512i low = _mm512_and_si512(halves_shifted(qs + 32 * (c / 2), s, s + 2), three);
      const __m512i high = _mm512_and_si512(halves_shifted(hmask, 2 * c, 2 * c + 1), one);
      k.codes[c] = _mm512_or_si512(low, _mm512_slli_epi16(high, 2));
    }
    const __m512i sc =
        _mm512_sub_epi32(_mm512_cvtepu8_epi32(k3_scale_bytes(block + 96)), _mm512_set1_epi32(32));
    k.sc = sc;
    k.mins = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sc, 2));
    k.d = k.dm = half_at(block + 108);
  } else if constexpr (TYPE == Q4_K) {  // d, dmin, scales[12], qs[128]
    k4_nibble_codes(block + 16, k.codes);
    k4_scales(block + 4, k);
    k.d = half_at(block), k.dm = -half_at(block + 2);
  } else if constexpr (TYPE == Q5_K) {  // d, dmin, scales[12], qh[32], qs[128]
    k4_nibble_codes(block + 48, k.codes);
    for (int c = 0; c < 4; ++c) {
      const __m512i high = _mm512_and_si512(halves_shifted(block + 16, 2 * c, 2 * c + 1), one);
      k.codes[c] = _mm512_or_si512(k.codes[c], _mm512_slli_epi16(high, 4));
    }
    k4_scales(block + 4, k);
    k.d = half_at(block), k.dm = -half_at(block + 2);
  } else if constexpr (TYPE == Q6_K) {  // ql[128], qh[64], scales[16] (int8), d
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const int half = c / 2, upper = c % 2;
      const __m512i ql = _mm512_loadu_si512(block + 64 * half);
      const __m512i low =
          upper ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4) : _mm512_and_si512(ql, m4);
      const __m512i high = _mm512_and_si512(
          halves_shifted(block + 128 + 32 * half, 4 * upper, 4 * upper + 2), three);
      k.codes[c] = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
    }
    const __m512i sc =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    k.sc = sc;
    k.mins = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), sc), 5);
    k.d = k.dm = half_at(block + 208);
  } else {
    static_assert(TYPE == IQ4_XS);  // d, scales_h (16 bits), scales_l[4], qs[128]
    const __m512i table =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_CODES)));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    // Each 16 bytes of qs are 32 weights, low nibbles first: lanes [p, p, q, q] of two 16-byte
    // pieces, shifted by 0 and 4.
    const __m512i order = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                           0x0004000400040004, 0x0004000400040004, 0, 0);
    for (int c = 0; c < 4; ++c) {
      const __m512i pieces = _mm512_permutexvar_epi64(
          order, _mm512_castsi256_si512(
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 8 + 32 * c))));
      const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi16(pieces, shift), m4);
      k.codes[c] = _mm512_shuffle_epi8(table, nibbles);
    }
    // Each 32 weights' scale, (low | high << 4) - 32: the low nibbles of scales_l's bytes,
    // and 2 bits of scales_h each, spread over 8 lanes.
    uint16_t high_bits;
    uint32_t low_bytes;
    std::memcpy(&high_bits, block + 2, sizeof high_bits);
    std::memcpy(&low_bytes, block + 4, sizeof low_bytes);
    const __m512i lane = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i low =
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(low_bytes)),
                                           _mm512_slli_epi32(lane, 2)),  // nibble i at bit 4i
                         _mm512_set1_epi32(0x0F));
    const __m512i high = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(high_bits), _mm512_slli_epi32(lane, 1)),
        _mm512_set1_epi32(3));
    const __m512i sc =
        _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
    k.sc = _mm512_permutexvar_epi32(pairs_of(0), sc);
    k.mins = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), k.sc), 7);
    k.d = k.dm = half_at(block);
  }
}

// Whether a type's offsets are scaled by d itself (dm == d): its two integer sums then add
// before the one conversion to float.
constexpr bool same_scale(int64_t type) {
  return type != Q2_K && type != Q4_K && type != Q5_K;
}

// R rows of x (from row m0) against one output's row of super-blocks.
template <int64_t TYPE, int R>
[[gnu::always_inline]] inline void k_dot(const uint8_t* row, int64_t groups, int64_t block_bytes,
                                         const int8_t* codes, const float* scales,
                                         const int32_t* sums, int64_t m0, int64_t kp,
                                         float* result) {
  const int64_t per_row = kp / GROUP;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead(row + g * block_bytes, block_bytes);
    KRegs k;
    decode<TYPE>(row + g * block_bytes, k);
    __m512i scale[4];  // each lane's part's scale, for the c-th 64 codes
    for (int c = 0; c < 4; ++c) scale[c] = _mm512_permutexvar_epi32(spread16(c), k.sc);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, at = m * per_row + g;
      const int8_t* x = codes + m * kp + g * GROUP;
      __m512i dot = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i part =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), k.codes[c], _mm512_loadu_si512(x + 64 * c));
        dot = _mm512_add_epi32(dot, _mm512_mullo_epi32(part, scale[c]));
      }
      const __m512i offset = _mm512_mullo_epi32(k.mins, _mm512_loadu_si512(sums + at * 16));
      const float dx = scales[at];
      if constexpr (same_scale(TYPE)) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot, offset)),
                                 _mm512_set1_ps(k.d * dx), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(k.d * dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(offset), _mm512_set1_ps(k.dm * dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) result[r] = _mm512_reduce_add_ps(acc[r]);
}

// ---- legacy blocks, eight at a time --------------------------------------------------

// Two 16-byte pieces of nibbles (blocks p and q) as [lo p | hi p | lo q | hi q].
inline __m512i nibble_pair(const uint8_t* p, const uint8_t* q) {
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 1);
  const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                         0x0004000400040004, 0x0004000400040004, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(0x0F));
}

// Q5's fifth bits of a block (32 bits, weight i at bit i) as 0x10 in each weight's byte.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof bits);
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
}

// The codes of blocks `first` and `first` + 1 (the second one's zero where `two` is false).
template <int64_t TYPE>
inline __m512i pair_codes(const uint8_t* first, bool two) {
  constexpr int64_t bytes = type_info(TYPE).block_bytes;
  const uint8_t* second = two ? first + bytes : first;
  __m512i codes;
  if constexpr (TYPE == Q8_0) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 2));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + 2));
    codes = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                             _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    constexpr int64_t at = TYPE == Q4_0 || TYPE == IQ4_NL ? 2
                           : TYPE == Q4_1                 ? 4
                           : TYPE == Q5_0                 ? 6
                                                          : 8;
    codes = nibble_pair(first + at, second + at);
    if constexpr (TYPE == IQ4_NL) {
      const __m512i table =
          _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_CODES)));
      codes = _mm512_shuffle_epi8(table, codes);
    } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
      constexpr int64_t qh = TYPE == Q5_0 ? 2 : 4;
      codes =
          _mm512_or_si512(codes, _mm512_inserti64x4(_mm512_castsi256_si512(fifth_bits(first + qh)),
                                                    fifth_bits(second + qh), 1));
    }
  }
  return two ? codes : _mm512_maskz_mov_epi8(0xFFFFFFFFull, codes);
}

// v with its 16-bit word i set to h (vpinsrw takes its index as an immediate).
inline __m128i insert16(__m128i v, uint16_t h, int64_t i) {
  switch (i) {
    case 0: return _mm_insert_epi16(v, h, 0);
    case 1: return _mm_insert_epi16(v, h, 1);
    case 2: return _mm_insert_epi16(v, h, 2);
    case 3: return _mm_insert_epi16(v, h, 3);
    case 4: return _mm_insert_epi16(v, h, 4);
    case 5: return _mm_insert_epi16(v, h, 5);
    case 6: return _mm_insert_epi16(v, h, 6);
    default: return _mm_insert_epi16(v, h, 7);
  }
}

// The a and b of `count` (1 to 8) blocks from `first`, 0 past them: their float16 scales (and
// Q4_1's and Q5_1's minimums) converted eight at a time.
template <int64_t TYPE>
inline void legacy_scales(const uint8_t* first, int64_t count, __m256& a, __m256& b) {
  constexpr int64_t bytes = type_info(TYPE).block_bytes;
  constexpr bool has_min = TYPE == Q4_1 || TYPE == Q5_1;
  // Inserted into a vector one at a time: a vector loaded from eight 16-bit stores just made
  // would stall. A whole group's eight, the common case, without the loop's branches.
  __m128i d = _mm_setzero_si128(), m = _mm_setzero_si128();
  const auto half = [&](int64_t i, int64_t at) {
    uint16_t h;
    std::memcpy(&h, first + i * bytes + at, 2);
    return h;
  };
  if (count == BLOCKS) {
    d = _mm_setr_epi16(half(0, 0), half(1, 0), half(2, 0), half(3, 0), half(4, 0), half(5, 0),
                       half(6, 0), half(7, 0));
    if constexpr (has_min) {
      m = _mm_setr_epi16(half(0, 2), half(1, 2), half(2, 2), half(3, 2), half(4, 2), half(5, 2),
                         half(6, 2), half(7, 2));
    }
  } else {
    for (int64_t i = 0; i < count; ++i) {
      d = insert16(d, half(i, 0), i);
      if constexpr (has_min) m = insert16(m, half(i, 2), i);
    }
  }
  a = _mm256_cvtph_ps(d);
  if constexpr (has_min) {
    b = _mm256_cvtph_ps(m);
  } else {
    b = _mm256_mul_ps(a, _mm256_set1_ps(TYPE == Q4_0 ? -8.0f : TYPE == Q5_0 ? -16.0f : -128.0f));
  }
}

// R rows of x against one output's row of legacy blocks (`blocks` of them): x's codes, each
// block's scale and scale times its codes' sum, [M, Kp / 32] each.
template <int64_t TYPE, int R>
[[gnu::always_inline]] inline void l_dot(const uint8_t* row, int64_t blocks, int64_t block_bytes,
                                         const int8_t* codes, const float* scales,
                                         const float* scaled_sums, int64_t m0, int64_t kp,
                                         float* result) {
  // Sixty-four codes are two blocks, eight lanes each: each lane's block, for the p-th pair.
  const __m512i spread[4] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                             _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
                             _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),
                             _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6)};
  const int64_t per_row = kp / LEGACY;
  __m512 acc[R];
  __m256 offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), offsets[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < blocks; g += BLOCKS) {
    const int64_t count = std::min<int64_t>(BLOCKS, blocks - g), pairs = (count + 1) / 2;
    const uint8_t* first = row + g * block_bytes;
    __m256 a, b;
    legacy_scales<TYPE>(first, count, a, b);
    __m512i w[4];
    for (int64_t p = 0; p < pairs; ++p)
      w[p] = pair_codes<TYPE>(first + 2 * p * block_bytes, 2 * p + 1 < count);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, at = m * per_row + g;
      const __m512 ad = _mm512_castps256_ps512(_mm256_mul_ps(a, _mm256_loadu_ps(scales + at)));
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512i dot =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p],
                                _mm512_loadu_si512(codes + m * kp + (g + 2 * p) * LEGACY));
        acc[r] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread[p], ad), acc[r]);
      }
      offsets[r] = _mm256_fmadd_ps(b, _mm256_loadu_ps(scaled_sums + at), offsets[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 four =
        _mm_add_ps(_mm256_castps256_ps128(offsets[r]), _mm256_extractf128_ps(offsets[r], 1));
    alignas(16) float rest[4];
    _mm_store_ps(rest, four);
    result[r] = _mm512_reduce_add_ps(acc[r]) + ((rest[0] + rest[2]) + (rest[1] + rest[3]));
  }
}

}  // namespace loom_cpu::gguf::avx512
