// Many rows of x against GGUF blocks (prompts, big batches) with AVX512-VNNI: the blocks of 16
// outputs at a time are decoded once into a panel, each vector lane one output, and every row
// of x then runs over the panel in registers: a weight's decoding is shared by all the rows,
// and each of x's 4-byte groups by 16 outputs. Included by cpu_gguf_linear.cpp.

#pragma once

#include <immintrin.h>

#include <vector>

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

// Outputs [first, first + count) (count <= 16; the other lanes zero) of a part's rows into
// panels, one per group of 256 inputs (K-quants) or block of 32 (legacy): `row(n)` is the
// file's row of output n.
template <int64_t TYPE, typename RowOf>
void pack(const RowOf& row, int64_t first, int64_t count, int64_t k, void* out) {
  constexpr TypeInfo info = type_info(TYPE);
  if constexpr (info.k_quant) {
    KPanel* panels = static_cast<KPanel*>(out);
    const int64_t groups = k / GROUP;
    std::memset(panels, 0, sizeof(KPanel) * groups);
    KGroup g;
    for (int64_t lane = 0; lane < count; ++lane) {
      const uint8_t* blocks = row(first + lane);
      for (int64_t i = 0; i < groups; ++i) {
        decode_k<TYPE>(blocks + i * info.block_bytes, g);
        KPanel& p = panels[i];
        for (int64_t q = 0; q < GROUP / QUAD; ++q) {
          std::memcpy(p.codes[q][lane], g.codes + QUAD * q, QUAD);
        }
        for (int64_t j = 0; j < GROUP / SUB; ++j) {
          p.sc[j][lane] = g.sc[j];
          p.mn[j / 2][lane][j % 2] = static_cast<int16_t>(g.mn[j]);
        }
        p.d[lane] = g.d, p.dm[lane] = g.dm;
      }
    }
  } else {
    LPanel* panels = static_cast<LPanel*>(out);
    const int64_t blocks = k / LEGACY;
    std::memset(panels, 0, sizeof(LPanel) * blocks);
    LGroup g;
    for (int64_t lane = 0; lane < count; ++lane) {
      const uint8_t* row_blocks = row(first + lane);
      for (int64_t b0 = 0; b0 < blocks; b0 += BLOCKS) {
        const int64_t n = std::min<int64_t>(BLOCKS, blocks - b0);
        decode_legacy<TYPE>(row_blocks + b0 * info.block_bytes, n, g);
        for (int64_t i = 0; i < n; ++i) {
          LPanel& p = panels[b0 + i];
          for (int64_t q = 0; q < LEGACY / QUAD; ++q) {
            std::memcpy(p.codes[q][lane], g.codes + i * LEGACY + QUAD * q, QUAD);
          }
          p.a[lane] = g.a[i], p.b[lane] = g.b[i];
        }
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
