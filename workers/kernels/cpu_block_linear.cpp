// x @ w.T with w held as blocks of 32 codes along its input (GGUF's Q4_0, Q4_1, Q4_K and
// Q8_0, or weights quantized on load) and x quantized to int8 in blocks of 32 as it comes in,
// as llama.cpp's Q8_1: each block's integer dot product is exact, then scaled in float. On
// CPUs with AVX512-VNNI the dot products are vpdpbusd; elsewhere a portable loop computes the
// same sums. silu_block_linear takes the MLP's gate|up instead of x and quantizes
// silu(gate) * up as it computes it.
//
// Layout (cpu_linear.py's BlockLinear packs it). Output columns go in blocks of 16, one per
// vector lane. packed [N / 16, K / 32, bytes], a panel for each column block's group of 32
// inputs: 8 quads of 4 inputs, each 64 bytes with lane l's 4 codes at 4 * l; 4-bit codes put
// quads 2p and 2p + 1 in one 64 bytes, as the low and high nibbles. The panels' order is the
// kernel's tiles' (panel_index), as is the scales'. scales [N / 16, K / 32, 2, 16]:
// each lane's a and b, for w = code * a + b; or [N / 16, K / 32, 1, 16], a alone, where
// b = -2^(bits - 1) * a (Q4_0, Q8_0), whose dot products then take away the offset in
// integers, as llama.cpp's. Scales are float32, or float16 where they hold exactly (GGUF's
// are float16): at one row the weights stream from memory, and fewer bytes a weight is
// faster.

#include <immintrin.h>

#include "cpu_ops.h"

namespace loom_cpu {
namespace {

constexpr int64_t BLOCK = 32;  // codes along K that share a scale and an offset
constexpr int64_t LANES = 16;  // output columns a packed vector covers
constexpr int64_t QUAD_BYTES = 64;
// A tile: rows of x, and column blocks, one pass over the weights computes. Measured on
// SmolLM2's shapes, 4 x 3 was as fast as any other tried (1 to 6 rows, 1 to 4 blocks).
constexpr int ROWS = 4;
constexpr int COLUMN_BLOCKS = 3;  // cpu_linear.py's TILE_BLOCKS, which packs for it
constexpr int64_t PREFETCH_GROUPS = 4;

// x rounded to the nearest integers, ties to even, for |x| < 2^22: adding and taking away
// 1.5 * 2^23 leaves each float's integer part (std::nearbyint is a call the loops cannot
// vectorize around).
inline v16 round_even(v16 x) { return (x + 12582912.0f) - 12582912.0f; }

typedef int8_t v16c8 __attribute__((vector_size(16)));

inline v16 abs16(v16 x) { return x < 0.0f ? -x : x; }

// x's rows as int8 blocks: the codes q, each block's scale d (x ~ q * d) and sum(q); the
// weights' offsets b multiply d * sum(q), held once computed (the kernel's loop over the
// groups then only broadcasts it).
struct QuantizedRows {
  std::vector<int8_t> codes;      // [M, K]
  std::vector<float> scale;       // [M, K / BLOCK]
  std::vector<int32_t> code_sum;  // [M, K / BLOCK]
  std::vector<float> scaled_sum;  // [M, K / BLOCK]: scale * code_sum

  float sum(int64_t i) const { return scaled_sum[i]; }

  // Room for `rows` rows of k inputs, whose values the quantization then writes. The
  // vectors only grow: a step's many calls neither allocate nor clear them, work the calling
  // thread did alone while the others waited for it.
  void hold(int64_t rows, int64_t k) {
    const auto grow = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(codes, rows * k);
    grow(scale, rows * (k / BLOCK));
    grow(code_sum, rows * (k / BLOCK));
    grow(scaled_sum, rows * (k / BLOCK));
  }
};

// Rows of this many codes and fewer stay held between calls; a larger call's are let go
// after it (a long prompt's on a big model would otherwise hold a hundred megabytes).
constexpr int64_t HELD_CODES = 16 << 20;

// The calling thread's rows, reused from call to call (a call's rows are used up within it).
inline QuantizedRows& held_rows() {
  thread_local QuantizedRows q;
  return q;
}

inline QuantizedRows& held_rows(int64_t rows, int64_t k) {
  QuantizedRows& q = held_rows();
  q.hold(rows, k);
  return q;
}

// How a weight's scales are held: in float32 or float16 (S), with each block's offset b, or
// without it (symmetric: b = -OFFSET * a).
template <int BITS_, typename S_, bool SYMMETRIC_>
struct Format {
  static constexpr int BITS = BITS_;
  using S = S_;
  static constexpr bool SYMMETRIC = SYMMETRIC_;
  static constexpr int64_t PARTS = SYMMETRIC ? 1 : 2;  // scales a block: a, or a and b
  static constexpr int32_t OFFSET = 1 << (BITS - 1);
};

// Where the kernel's inputs come from, a block of 32 at a time: x's rows [M, K] as they are,
// or silu(gate) * up of gate_up's rows [M, 2K], rounded as silu_mul rounds it (one block
// computed into `room`): the product goes to the quantization without a pass through memory.
template <typename T>
struct PlainRows {
  const T* x;
  const T* block(int64_t i, T*) const { return x + i * BLOCK; }
};

template <typename T>
struct SiluRows {
  const T* gate_up;
  int64_t k;
  const uint16_t* table;  // bf16_silu_table() for bfloat16
  const T* block(int64_t i, T* room) const {
    const int64_t groups = k / BLOCK, at = (i / groups) * 2 * k + (i % groups) * BLOCK;
    float scratch[BLOCK];
    silu_row<T>(gate_up + at, gate_up + at + k, room, BLOCK, scratch, table);
    return room;
  }
};

template <typename T, typename Rows>
const QuantizedRows& quantize_rows(const Rows& source, int64_t rows, int64_t k) {
  const int64_t blocks = rows * (k / BLOCK);
  QuantizedRows& q = held_rows(rows, k);
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    T room[BLOCK];
    for (int64_t i = begin; i < end; ++i) {
      float v[BLOCK];
      to_float(source.block(i, room), v, BLOCK);
      v16 lo, hi;  // the block in two vectors: the loops below as vector operations
      std::memcpy(&lo, v, sizeof lo);
      std::memcpy(&hi, v + LANES, sizeof hi);
      const v16 a = abs16(lo), b = abs16(hi);
      const v16 top = a < b ? b : a;
      float amax = 0.0f;
      for (int64_t j = 0; j < LANES; ++j) amax = std::max(amax, top[j]);
      // As llama.cpp's quantize_row_q8_1: the scale's inverse, then the nearest code.
      const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
      const v16 code_lo = round_even(lo * inverse), code_hi = round_even(hi * inverse);
      const v16c8 bytes_lo = __builtin_convertvector(code_lo, v16c8);
      const v16c8 bytes_hi = __builtin_convertvector(code_hi, v16c8);
      std::memcpy(q.codes.data() + i * BLOCK, &bytes_lo, sizeof bytes_lo);
      std::memcpy(q.codes.data() + i * BLOCK + LANES, &bytes_hi, sizeof bytes_hi);
      const float code_sum = horizontal_sum(code_lo + code_hi);  // exact: integers below 2^24
      q.scale[i] = d;
      q.code_sum[i] = static_cast<int32_t>(code_sum);
      q.scaled_sum[i] = d * code_sum;
    }
  });
  return q;
}

#define LOOM_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// quantize_rows with AVX-512: the same codes (vcvtps2dq rounds to the nearest, ties to even,
// as round_even), sums and scales.
template <typename T>
LOOM_VNNI inline __m512 load_floats(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {  // bfloat16: the upper half of a float's bits
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// Blocks [begin, end) of 32 inputs: their codes, scales and code sums into q.
template <typename T, typename Rows>
LOOM_VNNI void quantize_blocks_vnni(const Rows& source, int64_t begin, int64_t end,
                                    QuantizedRows& q) {
  T room[BLOCK];
  for (int64_t i = begin; i < end; ++i) {
    const T* x = source.block(i, room);
    const __m512 lo = load_floats(x), hi = load_floats(x + LANES);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 scale = _mm512_set1_ps(inverse);
    const __m512i code_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));
    const __m512i code_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes.data() + i * BLOCK),
                     _mm512_cvtepi32_epi8(code_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes.data() + i * BLOCK + LANES),
                     _mm512_cvtepi32_epi8(code_hi));
    q.scale[i] = d;
    q.code_sum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(code_lo, code_hi));
    q.scaled_sum[i] = d * static_cast<float>(q.code_sum[i]);
  }
}

// The lambda that at::parallel_for runs does not take its enclosing function's target: the
// AVX-512 code is in quantize_blocks_vnni, which it calls, so that the library still builds
// for a CPU without AVX-512 (where nothing calls it).
template <typename T, typename Rows>
LOOM_VNNI const QuantizedRows& quantize_rows_vnni(const Rows& source, int64_t rows, int64_t k) {
  const int64_t blocks = rows * (k / BLOCK);
  QuantizedRows& q = held_rows(rows, k);
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    quantize_blocks_vnni<T>(source, begin, end, q);
  });
  return q;
}

// The code of input j (of a group's 32) for lane `lane`, in one group's panel.
template <int BITS>
inline int32_t code_at(const uint8_t* panel, int64_t lane, int64_t j) {
  const int64_t quad = j / 4, byte = 4 * lane + j % 4;
  if constexpr (BITS == 8) {
    return panel[quad * QUAD_BYTES + byte];
  } else {
    const uint8_t both = panel[(quad / 2) * QUAD_BYTES + byte];
    return quad % 2 == 0 ? both & 0x0F : both >> 4;
  }
}

// Where column block nb's group g is, in panels (or in scales of a panel): blocks go in
// tiles of COLUMN_BLOCKS (the last may be narrower), and a tile's groups one after another,
// each with the tile's blocks' panels in turn. A tile then streams from one place in
// memory, and a thread's tiles from one run of it.
inline int64_t panel_index(int64_t nb, int64_t g, int64_t groups, int64_t blocks) {
  const int64_t first = nb - nb % COLUMN_BLOCKS;
  const int64_t width = std::min<int64_t>(COLUMN_BLOCKS, blocks - first);
  return first * groups + g * width + (nb - first);
}

template <typename F, typename T>
void portable(const QuantizedRows& q, const uint8_t* packed, const typename F::S* scales,
              const float* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = k / BLOCK, blocks = n / LANES, panel_bytes = BLOCK * LANES * F::BITS / 8;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t m = 0; m < rows; ++m) {
        float acc[LANES] = {};
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = panel_index(nb, g, groups, blocks);
          const uint8_t* panel = packed + at * panel_bytes;
          const typename F::S* ab = scales + at * F::PARTS * LANES;
          const int8_t* xq = q.codes.data() + m * k + g * BLOCK;
          const int64_t i = m * groups + g;
          for (int64_t lane = 0; lane < LANES; ++lane) {
            int32_t dot = 0;
            for (int64_t j = 0; j < BLOCK; ++j) dot += code_at<F::BITS>(panel, lane, j) * xq[j];
            const float ad = static_cast<float>(ab[lane]) * q.scale[i];
            if constexpr (F::SYMMETRIC) {
              acc[lane] = acc[lane] + ad * static_cast<float>(dot - F::OFFSET * q.code_sum[i]);
            } else {
              acc[lane] = acc[lane] + ad * static_cast<float>(dot) +
                          static_cast<float>(ab[LANES + lane]) * q.sum(i);
            }
          }
        }
        for (int64_t lane = 0; lane < LANES; ++lane) {
          const int64_t col = nb * LANES + lane;
          out[m * n + col] = to<T>(acc[lane] + (bias ? bias[col] : 0.0f));
        }
      }
    }
  });
}

LOOM_VNNI inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

template <typename T>
LOOM_VNNI inline void store16(T* out, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, v);
  } else {  // bf16_bits in vector form: to the nearest, ties to even; NaN stays NaN
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
}

// A lane's 16 scales, as floats.
template <typename S>
LOOM_VNNI inline __m512 load_scales(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// Rows m0 .. m0 + R of x against column blocks nb0 .. nb0 + C, over every group. Column
// block c's group g is F::BITS-bit codes at w[c] + g * stride, its scales at
// s[c] + g * s_stride.
template <typename F, int R, int C, typename T>
LOOM_VNNI void vnni_tile(const QuantizedRows& q, const uint8_t* const* w, int64_t stride,
                         const typename F::S* const* s, int64_t s_stride, const float* bias,
                         T* out, int64_t m0, int64_t nb0, int64_t k, int64_t n) {
  constexpr int BITS = F::BITS;
  const int64_t groups = k / BLOCK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    const int8_t* xq = q.codes.data() + m0 * k + g * BLOCK;
    // Fetch a few groups ahead: with few rows, the weights stream from memory once.
    for (int c = 0; c < C; ++c) {
      const uint8_t* next = w[c] + (g + PREFETCH_GROUPS) * stride;
      for (int64_t off = 0; off < BLOCK * LANES * BITS / 8; off += QUAD_BYTES) {
        _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
      }
      _mm_prefetch(reinterpret_cast<const char*>(s[c] + (g + PREFETCH_GROUPS) * s_stride),
                   _MM_HINT_T0);
    }
    if constexpr (BITS == 4) {
      for (int p = 0; p < 4; ++p) {
        __m512i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_loadu_si512(w[c] + g * stride + p * QUAD_BYTES);
          lo[c] = _mm512_and_si512(v, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x_lo = broadcast4(xq + r * k + 8 * p);
          const __m512i x_hi = broadcast4(xq + r * k + 8 * p + 4);
          for (int c = 0; c < C; ++c) {
            dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo[c], x_lo);
            dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi[c], x_hi);
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i v[C];
        for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_si512(w[c] + g * stride + j * QUAD_BYTES);
        for (int r = 0; r < R; ++r) {
          const __m512i x = broadcast4(xq + r * k + 4 * j);
          for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], v[c], x);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const typename F::S* ab = s[c] + g * s_stride;
      const __m512 a = load_scales(ab);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * groups + g;
        const __m512 ad = _mm512_mul_ps(a, _mm512_set1_ps(q.scale[i]));
        if constexpr (F::SYMMETRIC) {  // the codes' offset taken away in integers
          const __m512i offset = _mm512_set1_epi32(F::OFFSET * q.code_sum[i]);
          const __m512i signed_dot = _mm512_sub_epi32(dot[r][c], offset);
          acc[r][c] = _mm512_fmadd_ps(ad, _mm512_cvtepi32_ps(signed_dot), acc[r][c]);
        } else {
          const __m512 b = load_scales(ab + LANES);
          acc[r][c] = _mm512_fmadd_ps(ad, _mm512_cvtepi32_ps(dot[r][c]), acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(b, _mm512_set1_ps(q.sum(i)), acc[r][c]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t col = (nb0 + c) * LANES;
    const __m512 add = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store16(out + (m0 + r) * n + col, _mm512_add_ps(acc[r][c], add));
  }
}

// Rows m .. rows of x in tiles of R rows, then what is left in smaller tiles.
template <typename F, int R, int C, typename T>
LOOM_VNNI void vnni_rows(const QuantizedRows& q, const uint8_t* const* w, int64_t stride,
                         const typename F::S* const* s, int64_t s_stride, const float* bias,
                         T* out, int64_t m, int64_t rows, int64_t nb, int64_t k, int64_t n) {
  for (; m + R <= rows; m += R)
    vnni_tile<F, R, C>(q, w, stride, s, s_stride, bias, out, m, nb, k, n);
  if constexpr (R > 1) {
    if (m < rows)
      vnni_rows<F, R - 1, C>(q, w, stride, s, s_stride, bias, out, m, rows, nb, k, n);
  }
}

template <typename F, typename T>
LOOM_VNNI void vnni(const QuantizedRows& q, const uint8_t* packed, const typename F::S* scales,
                    const float* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  constexpr int C = COLUMN_BLOCKS;
  const int64_t groups = k / BLOCK, blocks = n / LANES, tiles = (blocks + C - 1) / C;
  const int64_t panel_bytes = BLOCK * LANES * F::BITS / 8, panel_scales = F::PARTS * LANES;
  // 4-bit panels are unpacked in registers at every tile of rows: unpacking each once into
  // a buffer measured slower, up to 128 rows.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t nb = C * tile, width = std::min<int64_t>(C, blocks - nb);
      const uint8_t* w[C];
      const typename F::S* s[C];
      for (int c = 0; c < width; ++c) {
        const int64_t at = panel_index(nb + c, 0, groups, blocks);
        w[c] = packed + at * panel_bytes;
        s[c] = scales + at * panel_scales;
      }
      const int64_t stride = width * panel_bytes, s_stride = width * panel_scales;
      if (width == C) {
        vnni_rows<F, ROWS, C>(q, w, stride, s, s_stride, bias, out, 0, rows, nb, k, n);
      } else {  // the last tile of columns may be narrower: one block at a time
        for (int c = 0; c < width; ++c)
          vnni_rows<F, ROWS, 1>(q, w + c, stride, s + c, s_stride, bias, out, 0, rows, nb + c, k,
                                n);
      }
    }
  });
}

bool has_vnni() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vnni");
  return supported;
}

template <typename F, typename T>
void run_format(const QuantizedRows& q, const at::Tensor& packed, const at::Tensor& scales,
                const float* bias, at::Tensor& out, int64_t rows, int64_t k, bool use_vnni) {
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const auto* s = static_cast<const typename F::S*>(scales.data_ptr());
  T* o = out.data_ptr<T>();
  const int64_t n = out.size(1);
  use_vnni ? vnni<F>(q, p, s, bias, o, rows, k, n) : portable<F>(q, p, s, bias, o, rows, k, n);
}

template <int BITS, typename T>
void run_bits(const QuantizedRows& q, const at::Tensor& packed, const at::Tensor& scales,
              const float* bias, at::Tensor& out, int64_t rows, int64_t k, bool use_vnni) {
  const bool half = scales.scalar_type() == at::kHalf, symmetric = scales.size(2) == 1;
  auto go = [&](auto format) {
    run_format<decltype(format), T>(q, packed, scales, bias, out, rows, k, use_vnni);
  };
  if (half) {
    symmetric ? go(Format<BITS, at::Half, true>{}) : go(Format<BITS, at::Half, false>{});
  } else {
    symmetric ? go(Format<BITS, float, true>{}) : go(Format<BITS, float, false>{});
  }
}

template <typename T, typename Rows>
void run(const Rows& source, int64_t rows, int64_t k, const at::Tensor& packed,
         const at::Tensor& scales, const float* bias, at::Tensor& out, int64_t bits,
         bool use_vnni) {
  const QuantizedRows& q = use_vnni ? quantize_rows_vnni<T>(source, rows, k)
                                    : quantize_rows<T>(source, rows, k);
  bits == 4 ? run_bits<4, T>(q, packed, scales, bias, out, rows, k, use_vnni)
            : run_bits<8, T>(q, packed, scales, bias, out, rows, k, use_vnni);
  if (static_cast<int64_t>(q.codes.size()) > HELD_CODES) held_rows() = QuantizedRows{};
}

}  // namespace

bool block_linear_has_vnni() { return has_vnni(); }

namespace {

// The weights' and bias's checks for inputs of k values (errors name op): [N] float32 bias
// (or none) and N.
std::tuple<std::optional<at::Tensor>, int64_t> checked_weights(
    const char* op, int64_t k, const at::Tensor& packed, const at::Tensor& scales,
    const std::optional<at::Tensor>& bias_in, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  const int64_t groups = k / BLOCK;
  TORCH_CHECK(k % BLOCK == 0 && k > 0, op, ": K = ", k, " is not a multiple of ", BLOCK);
  const int64_t panel_bytes = BLOCK * LANES * bits / 8;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(1) == groups &&
                  packed.size(2) == panel_bytes && packed.is_contiguous(),
              op, ": packed ", packed.sizes(), " ", packed.scalar_type(),
              " is not contiguous uint8 [N / 16, ", groups, ", ", panel_bytes, "]");
  const int64_t blocks = packed.size(0), n = blocks * LANES;
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  scales.is_contiguous() && scales.dim() == 4 &&
                  (scales.size(2) == 1 || scales.size(2) == 2) &&
                  scales.sizes() == at::IntArrayRef({blocks, groups, scales.size(2), LANES}),
              op, ": scales ", scales.sizes(), " ", scales.scalar_type(),
              " are not contiguous float32 or float16 [", blocks, ", ", groups,
              ", 1 or 2, 16]");
  std::optional<at::Tensor> bias;
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->numel() == n, op, ": bias of ", bias_in->numel(), " values for ", n,
                " outputs");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  return {bias, n};
}

// `rows` rows of k inputs, in x's dtype, through the weights into a new [rows, N]: the inputs
// from source_of(T{}) (PlainRows or SiluRows of x for T).
template <typename SourceOf>
at::Tensor linear_of(const char* op, const at::Tensor& x, int64_t rows, int64_t k,
                     const at::Tensor& packed, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias_in, int64_t bits, bool portable_only,
                     const SourceOf& source_of) {
  const auto [bias, n] = checked_weights(op, k, packed, scales, bias_in, bits);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const bool use_vnni = has_vnni() && !portable_only;
  const auto go = [&](auto type) {
    using T = decltype(type);
    run<T>(source_of(type), rows, k, packed, scales, b, out, bits, use_vnni);
  };
  x.scalar_type() == at::kBFloat16 ? go(c10::BFloat16{}) : go(float{});
  return out;
}

}  // namespace

at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& packed,
                        const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                        int64_t bits, bool portable_only) {
  check_dtype("block_linear", x_in);
  TORCH_CHECK(x_in.dim() == 2, "block_linear: x ", x_in.sizes(), " is not [M, K]");
  const at::Tensor x = x_in.contiguous();
  return linear_of("block_linear", x, x.size(0), x.size(1), packed, scales, bias, bits,
                   portable_only, [&](auto type) {
                     using T = decltype(type);
                     return PlainRows<T>{x.data_ptr<T>()};
                   });
}

at::Tensor silu_block_linear(const at::Tensor& gate_up_in, const at::Tensor& packed,
                             const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                             int64_t bits, bool portable_only) {
  check_dtype("silu_block_linear", gate_up_in);
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0,
              "silu_block_linear: gate_up ", gate_up_in.sizes(), " is not [M, 2K]");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t k = gate_up.size(1) / 2;
  return linear_of("silu_block_linear", gate_up, gate_up.size(0), k, packed, scales, bias, bits,
                   portable_only, [&](auto type) {
                     using T = decltype(type);
                     const bool bf16 = std::is_same_v<T, c10::BFloat16>;
                     return SiluRows<T>{gate_up.data_ptr<T>(), k,
                                        bf16 ? bf16_silu_table() : nullptr};
                   });
}

}  // namespace loom_cpu
