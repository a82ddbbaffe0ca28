// Many rows of x against GGUF blocks (prompts, big batches) with AVX512-VNNI: the blocks of 16
// outputs at a time are decoded once into a panel, each vector lane one output, and every row
// of x then runs over the panel in registers: a weight's decoding is shared by all the rows,
// and each of x's 4-byte groups by 16 outputs. Included by cpu_gguf_linear.cpp.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu_gguf_avx512.h"
#include "cpu_gguf_blocks.h"

namespace loom_cpu::gguf::panels {

constexpr int64_t LANES = 16;  // outputs a panel holds, one per vector lane
constexpr int64_t QUAD = 4;    // inputs a lane's 32-bit word holds
constexpr int ROWS = 4;        // rows of x a tile computes
constexpr int PANELS = 2;      // panels a tile computes

// A K-quant's super-block for 16 outputs: codes [64 quads][16 lanes][4], each lane's integer
// scale per 16 inputs, its offsets as int16 pairs (parts 2t and 2t + 1 in one 32-bit lane, for
// vpdpwssd against the rows' sums of those parts), d and dm.
struct KPanel {
  alignas(64) uint8_t codes[GROUP / QUAD][LANES][QUAD];
  alignas(64) int32_t sc[GROUP / SUB][LANES];
  alignas(64) int16_t mn[GROUP / SUB / 2][LANES][2];
  alignas(64) float d[LANES];
  alignas(64) float dm[LANES];
};

// A legacy block for 16 outputs: codes [8 quads][16 lanes][4], each lane's a and b.
struct LPanel {
  alignas(64) uint8_t codes[LEGACY / QUAD][LANES][QUAD];
  alignas(64) float a[LANES];
  alignas(64) float b[LANES];
};

// Sixteen vectors of sixteen 32-bit words, transposed in place: 4x4 blocks within each
// 128-bit lane by unpacks, then the lanes by shuffles (a butterfly of permutes across whole
// vectors took six times as long).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// What pack decodes each output's row into first, a row at a time (reading the file's rows
// one after another streams them; 16 rows a block apart at once did not).
struct Staging {
  std::vector<uint8_t> codes;   // [16 lanes][Kp]
  std::vector<int32_t> sc, mn;  // K-quants: [16][groups][16]; mn as int16 pairs in [..][8]
  std::vector<float> d, dm;     // K-quants: [16][groups]; legacy: a and b, [16][blocks]

  void hold(int64_t kp, int64_t scales) {
    codes.resize(LANES * kp);
    sc.resize(LANES * scales * 16), mn.resize(LANES * scales * 16);
    d.resize(LANES * scales), dm.resize(LANES * scales);
  }
};

inline Staging& staging() {
  thread_local Staging held;
  return held;
}

// Outputs [first, first + count) (count <= 16; the other lanes zero) of a part's rows into
// panels, one per group of 256 inputs (K-quants) or block of 32 (legacy): `row(n)` is the
// file's row of output n. Each output's blocks are decoded in registers, and 16 outputs'
// words transposed into the lanes.
template <int64_t TYPE, typename RowOf>
void pack(const RowOf& row, int64_t first, int64_t count, int64_t k, void* out) {
  constexpr TypeInfo info = type_info(TYPE);
  const int64_t kp = (k + GROUP - 1) / GROUP * GROUP;
  Staging& st = staging();
  if constexpr (info.k_quant) {
    const int64_t groups = k / GROUP;
    st.hold(kp, groups);
    for (int64_t lane = 0; lane < LANES; ++lane) {
      uint8_t* codes = st.codes.data() + lane * kp;
      if (lane >= count) {
        std::memset(codes, 0, kp);
        std::fill_n(st.sc.data() + lane * groups * 16, groups * 16, 0);
        std::fill_n(st.mn.data() + lane * groups * 16, groups * 16, 0);
        std::fill_n(st.d.data() + lane * groups, groups, 0.0f);
        std::fill_n(st.dm.data() + lane * groups, groups, 0.0f);
        continue;
      }
      const uint8_t* blocks = row(first + lane);
      for (int64_t g = 0; g < groups; ++g) {
        avx512::KRegs regs;
        avx512::decode<TYPE>(blocks + g * info.block_bytes, regs);
        for (int c = 0; c < 4; ++c) _mm512_storeu_si512(codes + g * GROUP + 64 * c, regs.codes[c]);
        const int64_t at = lane * groups + g;
        _mm512_storeu_si512(st.sc.data() + at * 16, regs.sc);
        // The offsets as int16 pairs: parts 2t and 2t + 1 in 32-bit word t.
        _mm512_storeu_si512(st.mn.data() + at * 16,
                            _mm512_castsi256_si512(_mm512_cvtepi32_epi16(regs.mins)));
        st.d[at] = regs.d, st.dm[at] = regs.dm;
      }
    }
    KPanel* panels = static_cast<KPanel*>(out);
    for (int64_t g = 0; g < groups; ++g) {
      KPanel& p = panels[g];
      __m512i r[LANES];
      for (int c = 0; c < 4; ++c) {
        for (int64_t lane = 0; lane < LANES; ++lane) {
          r[lane] = _mm512_loadu_si512(st.codes.data() + lane * kp + g * GROUP + 64 * c);
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(p.codes[16 * c + i], r[i]);
      }
      for (int64_t lane = 0; lane < LANES; ++lane) {
        r[lane] = _mm512_loadu_si512(st.sc.data() + (lane * groups + g) * 16);
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(p.sc[j], r[j]);
      for (int64_t lane = 0; lane < LANES; ++lane) {
        r[lane] = _mm512_loadu_si512(st.mn.data() + (lane * groups + g) * 16);
        p.d[lane] = st.d[lane * groups + g], p.dm[lane] = st.dm[lane * groups + g];
      }
      transpose16(r);
      for (int t = 0; t < 8; ++t) _mm512_store_si512(p.mn[t], r[t]);
    }
  } else {
    const int64_t blocks = k / LEGACY;
    st.hold(kp, blocks);
    for (int64_t lane = 0; lane < LANES; ++lane) {
      uint8_t* codes = st.codes.data() + lane * kp;
      float *a = st.d.data() + lane * blocks, *b = st.dm.data() + lane * blocks;
      if (lane >= count) {
        std::memset(codes, 0, kp);
        std::fill_n(a, blocks, 0.0f), std::fill_n(b, blocks, 0.0f);
        continue;
      }
      const uint8_t* row_blocks = row(first + lane);
      for (int64_t g = 0; g < blocks; g += BLOCKS) {
        const int64_t in_group = std::min<int64_t>(BLOCKS, blocks - g);
        __m256 la, lb;
        avx512::legacy_scales<TYPE>(row_blocks + g * info.block_bytes, in_group, la, lb);
        alignas(32) float ga[BLOCKS], gb[BLOCKS];
        _mm256_store_ps(ga, la), _mm256_store_ps(gb, lb);
        std::copy_n(ga, in_group, a + g), std::copy_n(gb, in_group, b + g);
        for (int64_t pair = 0; 2 * pair < in_group; ++pair) {
          const __m512i w = avx512::pair_codes<TYPE>(row_blocks + (g + 2 * pair) * info.block_bytes,
                                                     2 * pair + 1 < in_group);
          _mm512_storeu_si512(codes + (g + 2 * pair) * LEGACY, w);
        }
      }
    }
    LPanel* panels = static_cast<LPanel*>(out);
    for (int64_t pair = 0; 2 * pair < blocks; ++pair) {
      __m512i r[LANES];
      for (int64_t lane = 0; lane < LANES; ++lane) {
        r[lane] = _mm512_loadu_si512(st.codes.data() + lane * kp + 2 * pair * LEGACY);
      }
      transpose16(r);  // word i: quad i of the pair's first block, then of its second
      const bool two = 2 * pair + 1 < blocks;
      for (int q = 0; q < 8; ++q) {
        _mm512_store_si512(panels[2 * pair].codes[q], r[q]);
        if (two) _mm512_store_si512(panels[2 * pair + 1].codes[q], r[8 + q]);
      }
    }
    for (int64_t i = 0; i < blocks; ++i) {
      for (int64_t lane = 0; lane < LANES; ++lane) {
        panels[i].a[lane] = st.d[lane * blocks + i], panels[i].b[lane] = st.dm[lane * blocks + i];
      }
    }
  }
}

inline __m512i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// The quantized rows as the panels' tiles read them: codes [M, Kp], each row's scale per
// group (K-quants) or block (legacy), its codes' sums per 16 as int16 pairs (K-quants) or
// each block's scale times its sum (legacy).
struct Rows {
  const int8_t* codes;
  const float* scale;
  const int32_t* pairs;  // [M, Kp / 32]: the sums of parts 2t and 2t + 1 as two int16
  const float* scaled_sums;
  int64_t kp;
};

// R rows (from m0) against C K-quant panels over every group: each lane's dot product into
// acc[r][c]. SUB_K: inputs a scale covers (16, or 32 for Q4_K, Q5_K and IQ4_XS).
template <int R, int C, int SUB_K, bool SAME_SCALE>
inline void k_tile(const KPanel* const* panels, int64_t groups, const Rows& x, int64_t m0,
                   __m512 (&acc)[R][C]) {
  const int64_t per_row = x.kp / GROUP;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i total[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_si512();
    for (int64_t j = 0; j < GROUP / SUB_K; ++j) {
      __m512i dot[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
      for (int64_t q = j * (SUB_K / QUAD); q < (j + 1) * (SUB_K / QUAD); ++q) {
        __m512i w[C];
        for (int c = 0; c < C; ++c) w[c] = _mm512_load_si512(panels[c][g].codes[q]);
        for (int r = 0; r < R; ++r) {
          const __m512i xq = broadcast4(x.codes + (m0 + r) * x.kp + g * GROUP + QUAD * q);
          for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], w[c], xq);
        }
      }
      for (int c = 0; c < C; ++c) {
        // A scale covering 32 inputs is the same for both of its 16-input parts.
        const __m512i s = _mm512_load_si512(panels[c][g].sc[j * (SUB_K / SUB)]);
        for (int r = 0; r < R; ++r)
          total[r][c] = _mm512_add_epi32(total[r][c], _mm512_mullo_epi32(dot[r][c], s));
      }
    }
    if constexpr (!SAME_SCALE) {  // d's share now; the offsets, scaled by dm, next
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(x.scale[(m0 + r) * per_row + g]);
        for (int c = 0; c < C; ++c) {
          const __m512 d = _mm512_mul_ps(_mm512_load_ps(panels[c][g].d), dx);
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r][c]), d, acc[r][c]);
          total[r][c] = _mm512_setzero_si512();
        }
      }
    }
    // The offsets: each part's integer offset times the row's sum of that part.
    for (int64_t t = 0; t < GROUP / SUB / 2; ++t) {
      __m512i mn[C];
      for (int c = 0; c < C; ++c) mn[c] = _mm512_load_si512(panels[c][g].mn[t]);
      for (int r = 0; r < R; ++r) {
        const __m512i sums = _mm512_set1_epi32(x.pairs[((m0 + r) * per_row + g) * 8 + t]);
        for (int c = 0; c < C; ++c) total[r][c] = _mm512_dpwssd_epi32(total[r][c], mn[c], sums);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.scale[(m0 + r) * per_row + g]);
      for (int c = 0; c < C; ++c) {
        const __m512 scale =
            _mm512_mul_ps(_mm512_load_ps(SAME_SCALE ? panels[c][g].d : panels[c][g].dm), dx);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r][c]), scale, acc[r][c]);
      }
    }
  }
}

// R rows against C legacy panels over every block.
template <int R, int C>
inline void l_tile(const LPanel* const* panels, int64_t blocks, const Rows& x, int64_t m0,
                   __m512 (&acc)[R][C]) {
  const int64_t per_row = x.kp / LEGACY;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int64_t q = 0; q < LEGACY / QUAD; ++q) {
      __m512i w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_load_si512(panels[c][b].codes[q]);
      for (int r = 0; r < R; ++r) {
        const __m512i xq = broadcast4(x.codes + (m0 + r) * x.kp + b * LEGACY + QUAD * q);
        for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], w[c], xq);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * per_row + b;
      const __m512 dx = _mm512_set1_ps(x.scale[at]), sdx = _mm512_set1_ps(x.scaled_sums[at]);
      for (int c = 0; c < C; ++c) {
        const __m512 a = _mm512_mul_ps(_mm512_load_ps(panels[c][b].a), dx);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), a, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_load_ps(panels[c][b].b), sdx, acc[r][c]);
      }
    }
  }
}

}  // namespace loom_cpu::gguf::panels
