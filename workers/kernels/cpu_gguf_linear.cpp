// x @ w.T with w a GGUF file's quantized tensor, read from its blocks where they lie (the
// memory-mapped file), as llama.cpp computes: x quantized to int8 per 256 inputs for K-quants
// (its Q8_K) or per 32 for legacy blocks (Q8_1), exact integer dot products, then floats. Also
// the blocks dequantized, for an embedding's rows and for float paths, and a plain read of
// them, the bandwidth the one-row kernels are measured against.

#include <atomic>

#include "cpu_gguf_blocks.h"
#include "cpu_ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LOOM_GGUF_VNNI 1
#define LOOM_GGUF_FUSED 1
#include "cpu_gguf_avx512.h"
#include "cpu_gguf_panels.h"
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LOOM_GGUF_FUSED 1
#include "cpu_gguf_avx2.h"
#endif

namespace loom_cpu {
namespace {

using namespace gguf;

// x's rows quantized: codes [M, Kp] (Kp: K rounded up to GROUP, the rest 0), a scale per
// block of inputs (GROUP for K-quants, LEGACY for legacy blocks), the codes' sums per 16
// (K-quants) and each legacy block's scale times its codes' sum.
struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> sums;
  std::vector<int32_t> pairs;  // K-quants: the sums of parts 2t and 2t + 1 as two int16
  std::vector<float> scaled_sums;

  template <typename V>
  static void grow(V& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
};

// A call's activations are reused by the next one (their vectors only grow, so a step's many
// calls neither allocate nor fault pages in), unless they outgrow this many codes.
constexpr int64_t HELD_CODES = 16 << 20;

Activations& held_activations(bool k_family) {
  thread_local Activations per_family[2];
  return per_family[k_family];
}

// x rounded to the nearest integer, ties to even (|x| < 2^22), in a form loops vectorize.
inline float round_even(float x) {
  return (x + 12582912.0f) - 12582912.0f;
}

// One block of n floats into int8 codes with scale amax / 127 (llama.cpp's quantize_row_q8);
// the codes' sums per 16 into sums.
inline float quantize_block(const float* v, int64_t n, int8_t* codes, int32_t* sums) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(v[i]));
  const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t i = 0; i < n; ++i) codes[i] = static_cast<int8_t>(round_even(v[i] * inverse));
  for (int64_t j = 0; j < n / SUB; ++j) {
    int32_t s = 0;
    for (int64_t i = 0; i < SUB; ++i) s += codes[j * SUB + i];
    sums[j] = s;
  }
  return d;
}

// The M rows of k inputs that row(m, out) writes as floats, quantized for one family.
template <typename Row>
const Activations& quantize(const Row& row, int64_t rows, int64_t k, bool k_family) {
  const int64_t kp = (k + GROUP - 1) / GROUP * GROUP;
  const int64_t block = k_family ? GROUP : LEGACY, blocks = kp / block;
  Activations& a = held_activations(k_family);
  Activations::grow(a.codes, rows * kp);
  Activations::grow(a.scale, rows * blocks);
  Activations::grow(a.sums, rows * (kp / SUB));
  Activations::grow(a.scaled_sums, rows * blocks);
  if (k_family) Activations::grow(a.pairs, rows * (kp / (2 * SUB)));
  const int64_t grain = std::max<int64_t>(1, 8192 / kp);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> v(kp);
    for (int64_t m = begin; m < end; ++m) {
      row(m, v.data());
      std::fill(v.begin() + k, v.end(), 0.0f);
      int8_t* codes = a.codes.data() + m * kp;
      int32_t* sums = a.sums.data() + m * (kp / SUB);
      for (int64_t b = 0; b < blocks; ++b) {
        const float d = quantize_block(v.data() + b * block, block, codes + b * block,
                                       sums + b * (block / SUB));
        a.scale[m * blocks + b] = d;
        if (k_family) {
          for (int64_t t = 0; t < GROUP / SUB / 2; ++t) {
            const int32_t* two = sums + b * (GROUP / SUB) + 2 * t;
            a.pairs[m * (kp / (2 * SUB)) + b * (GROUP / SUB / 2) + t] = static_cast<int32_t>(
                (static_cast<uint32_t>(two[1]) << 16) | (static_cast<uint32_t>(two[0]) & 0xFFFFu));
          }
        } else {
          a.scaled_sums[m * blocks + b] =
              d * static_cast<float>(sums[b * (block / SUB)] + sums[b * (block / SUB) + 1]);
        }
      }
    }
  });
  return a;
}

// Lets the held activations go where they grew past HELD_CODES.
void release(const Activations* k_family, const Activations* legacy) {
  for (const Activations* a : {k_family, legacy}) {
    if (a != nullptr && static_cast<int64_t>(a->codes.size()) > HELD_CODES) {
      held_activations(a == k_family) = Activations{};
    }
  }
}

// One part of a linear layer's weight (q, k or v of q|k|v; gate or up of gate|up): its rows'
// blocks, their type, and llama's rotary row order to undo (heads > 0).
struct Part {
  const uint8_t* data;
  int64_t rows, row_bytes, type, heads, first_column;
};

// The file's row that holds output column n of a part: llama.cpp's converter interleaves the
// two rotary halves of each q and k head, which transformers' (and loomllm's) rotary splits.
inline int64_t stored_row(const Part& p, int64_t n) {
  if (p.heads == 0) return n;
  const int64_t dim = p.rows / p.heads, half = dim / 2, head = n / dim, i = n % dim;
  return head * dim + (i < half ? 2 * i : 2 * (i - half) + 1);
}

// The output column of a part's stored row f (the inverse of stored_row): rows read in the
// file's order stream from memory, where every other one would not.
inline int64_t output_of(const Part& p, int64_t f) {
  if (p.heads == 0) return f;
  const int64_t dim = p.rows / p.heads, half = dim / 2, head = f / dim, j = f % dim;
  return head * dim + (j % 2 == 0 ? j / 2 : half + j / 2);
}

// ---- dot products of decoded groups with quantized rows --------------------------------

// R rows of x (from row m0) against one output's decoded groups: result[r] the dot product.
template <int R>
void k_dot_portable(const KGroup* gs, int64_t groups, const Activations& a, int64_t m0, int64_t kp,
                    float* result) {
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const KGroup& kg = gs[g];
      const int8_t* x = a.codes.data() + m * kp + g * GROUP;
      const int32_t* sums = a.sums.data() + (m * (kp / GROUP) + g) * (GROUP / SUB);
      int32_t dot = 0, offset = 0;
      for (int j = 0; j < GROUP / SUB; ++j) {
        int32_t part = 0;
        for (int i = 0; i < SUB; ++i) part += kg.codes[j * SUB + i] * x[j * SUB + i];
        dot += kg.sc[j] * part;
        offset += kg.mn[j] * sums[j];
      }
      const float dx = a.scale[m * (kp / GROUP) + g];
      acc += static_cast<float>(dot) * (kg.d * dx) + static_cast<float>(offset) * (kg.dm * dx);
    }
    result[r] = acc;
  }
}

template <int R>
void l_dot_portable(const LGroup* gs, int64_t groups, const Activations& a, int64_t m0, int64_t kp,
                    float* result) {
  const int64_t blocks = kp / LEGACY;
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const LGroup& lg = gs[g];
      const int8_t* x = a.codes.data() + m * kp + g * GROUP;
      for (int b = 0; b < BLOCKS; ++b) {
        int32_t dot = 0;
        for (int i = 0; i < LEGACY; ++i) dot += lg.codes[b * LEGACY + i] * x[b * LEGACY + i];
        const int64_t at = m * blocks + g * BLOCKS + b;
        acc += static_cast<float>(dot) * (lg.a[b] * a.scale[at]) + lg.b[b] * a.scaled_sums[at];
      }
    }
    result[r] = acc;
  }
}

// ---- the layer: output columns over the threads -----------------------------------------

// The op's `kernel`: AUTO runs many rows of x on panels (where the CPU has them) and few on
// each output's blocks; ROWS runs every row on each output's blocks, so that a row's result
// does not depend on how many others it came with (batch invariance); PORTABLE runs the
// portable loop (the tests' reference for the vector paths).
enum Kernel : int64_t { AUTO = 0, ROWS_ALWAYS = 1, PORTABLE = 2 };

constexpr int ROWS = 4;  // rows of x one pass over an output's decoded groups takes

template <typename Group>
using PortableDot = void (*)(const Group*, int64_t, const Activations&, int64_t, int64_t, float*);

template <typename Group>
constexpr PortableDot<Group> portable_dot(int rows) {
  if constexpr (std::is_same_v<Group, KGroup>) {
    constexpr PortableDot<Group> dots[ROWS + 1] = {nullptr, k_dot_portable<1>, k_dot_portable<2>,
                                                   k_dot_portable<3>, k_dot_portable<4>};
    return dots[rows];
  } else {
    constexpr PortableDot<Group> dots[ROWS + 1] = {nullptr, l_dot_portable<1>, l_dot_portable<2>,
                                                   l_dot_portable<3>, l_dot_portable<4>};
    return dots[rows];
  }
}

template <int64_t TYPE, typename Group>
inline void decode_row(const uint8_t* row, int64_t k, Group* gs) {
  constexpr int64_t bytes = type_info(TYPE).block_bytes;
  if constexpr (is_k_quant(TYPE)) {
    for (int64_t g = 0; g < k / GROUP; ++g) decode_k<TYPE>(row + g * bytes, gs[g]);
  } else {
    const int64_t blocks = k / LEGACY;
    for (int64_t g = 0; g * BLOCKS < blocks; ++g) {
      const int64_t count = std::min<int64_t>(BLOCKS, blocks - g * BLOCKS);
      decode_legacy<TYPE>(row + g * BLOCKS * bytes, count, gs[g]);
    }
  }
}

template <typename T>
void store(T* out, int64_t ldo, int64_t m0, int rows, int64_t column, const float* values,
           const float* bias) {
  const float add = bias ? bias[column] : 0.0f;
  for (int r = 0; r < rows; ++r) out[(m0 + r) * ldo + column] = to<T>(values[r] + add);
}

#ifdef LOOM_GGUF_FUSED
// `rows` rows of x (from m0, at most ROWS) against one output's row of blocks, decoded in
// registers as they are read (AVX512-VNNI, else AVX2).
template <int64_t TYPE, int R>
[[gnu::always_inline]] inline void fused_dot(const uint8_t* row, int64_t k, const Activations& a,
                                             int64_t m0, int64_t kp, float* values) {
  constexpr int64_t bytes = type_info(TYPE).block_bytes;
#ifdef LOOM_GGUF_VNNI
  namespace simd = avx512;
  const int32_t* sums = a.sums.data();  // per 16, as int32
#else
  namespace simd = avx2;
  const int32_t* sums = a.pairs.data();  // per 16, as int16 pairs
#endif
  if constexpr (is_k_quant(TYPE)) {
    simd::k_dot<TYPE, R>(row, k / GROUP, bytes, a.codes.data(), a.scale.data(), sums, m0, kp,
                         values);
  } else {
    simd::l_dot<TYPE, R>(row, k / LEGACY, bytes, a.codes.data(), a.scale.data(),
                         a.scaled_sums.data(), m0, kp, values);
  }
}

template <int64_t TYPE>
[[gnu::always_inline]] inline void fused_rows(const uint8_t* row, int64_t k, const Activations& a,
                                              int64_t m0, int rows, int64_t kp, float* values) {
  switch (rows) {
    case 1: return fused_dot<TYPE, 1>(row, k, a, m0, kp, values);
    case 2: return fused_dot<TYPE, 2>(row, k, a, m0, kp, values);
    case 3: return fused_dot<TYPE, 3>(row, k, a, m0, kp, values);
    default: return fused_dot<TYPE, 4>(row, k, a, m0, kp, values);
  }
}
#endif

// Stored rows [begin, end) of part p (counted over all parts, as its columns are) for every
// row of x, each into its output's column: with AVX512-VNNI or AVX2 (FUSED) each output's
// blocks decoded in registers for every ROWS rows of x, elsewhere decoded once into memory.
template <int64_t TYPE, typename T, bool FUSED>
void part_columns(const Part& p, int64_t begin, int64_t end, const Activations& a, int64_t rows,
                  int64_t k, T* out, int64_t ldo, const float* bias) {
  const int64_t kp = (k + GROUP - 1) / GROUP * GROUP, groups = kp / GROUP;
  float values[ROWS];
  if constexpr (FUSED) {
#ifdef LOOM_GGUF_FUSED
    for (int64_t stored = begin - p.first_column; stored < end - p.first_column; ++stored) {
      const uint8_t* row = p.data + stored * p.row_bytes;
      const int64_t column = p.first_column + output_of(p, stored);
      for (int64_t m = 0; m < rows; m += ROWS) {
        const int tile = static_cast<int>(std::min<int64_t>(ROWS, rows - m));
        fused_rows<TYPE>(row, k, a, m, tile, kp, values);
        store(out, ldo, m, tile, column, values, bias);
      }
    }
    return;
#endif
  }
  using Group = std::conditional_t<is_k_quant(TYPE), KGroup, LGroup>;
  thread_local std::vector<Group> held;
  if (static_cast<int64_t>(held.size()) < groups) held.resize(groups);
  Group* gs = held.data();
  for (int64_t stored = begin - p.first_column; stored < end - p.first_column; ++stored) {
    const int64_t column = p.first_column + output_of(p, stored);
    decode_row<TYPE>(p.data + stored * p.row_bytes, k, gs);
    for (int64_t m = 0; m < rows; m += ROWS) {
      const int tile = static_cast<int>(std::min<int64_t>(ROWS, rows - m));
      portable_dot<Group>(tile)(gs, groups, a, m, kp, values);
      store(out, ldo, m, tile, column, values, bias);
    }
  }
}

#ifdef LOOM_GGUF_VNNI
// Rows of x from which a layer runs on panels rather than each output's blocks decoded for
// every ROWS rows.
constexpr int64_t PANEL_ROWS = 8;

// 16 lanes of v into columns [column, column + count) of row m, with the bias.
template <typename T>
void store_lanes(T* out, int64_t ldo, int64_t m, int64_t column, int64_t count, __m512 v,
                 const float* bias) {
  const __mmask16 mask = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + column));
  T* at = out + m * ldo + column;
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(at, mask, v);
  } else {  // bf16_bits in vector form: to the nearest, ties to even; NaN stays NaN
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
    _mm256_mask_storeu_epi16(at, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
}

template <int64_t TYPE, int R, int C>
void panel_tile(const void* const* packed, int64_t k, const panels::Rows& x, int64_t m0,
                __m512 (&acc)[R][C]) {
  if constexpr (is_k_quant(TYPE)) {
    constexpr int sub = TYPE == Q4_K || TYPE == Q5_K || TYPE == IQ4_XS ? 32 : 16;
    panels::k_tile<R, C, sub, avx512::same_scale(TYPE)>(
        reinterpret_cast<const panels::KPanel* const*>(packed), k / GROUP, x, m0, acc);
  } else {
    panels::l_tile<R, C>(reinterpret_cast<const panels::LPanel* const*>(packed), k / LEGACY, x, m0,
                         acc);
  }
}

// Every row of x against C panels (of `count` outputs from `column`), ROWS rows at a time.
template <int64_t TYPE, typename T, int C>
void panel_rows(const void* const* packed, int64_t column, int64_t count, const panels::Rows& x,
                int64_t rows, int64_t k, T* out, int64_t ldo, const float* bias) {
  const auto tile = [&](auto rows_constant, int64_t m0) {
    constexpr int R = decltype(rows_constant)::value;
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    panel_tile<TYPE, R, C>(packed, k, x, m0, acc);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        const int64_t first = column + c * panels::LANES;
        store_lanes(out, ldo, m0 + r, first, count - c * panels::LANES, acc[r][c], bias);
      }
  };
  int64_t m = 0;
  for (; m + panels::ROWS <= rows; m += panels::ROWS) tile(std::integral_constant<int, 4>{}, m);
  switch (rows - m) {
    case 3: tile(std::integral_constant<int, 3>{}, m); break;
    case 2: tile(std::integral_constant<int, 2>{}, m); break;
    case 1: tile(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// Columns [begin, end) of part p (at most PANELS panels' worth) packed, then every row.
template <int64_t TYPE, typename T>
void panel_columns(const Part& p, int64_t begin, int64_t end, const Activations& a, int64_t rows,
                   int64_t k, T* out, int64_t ldo, const float* bias) {
  using Panel = std::conditional_t<is_k_quant(TYPE), panels::KPanel, panels::LPanel>;
  const int64_t per_panel = is_k_quant(TYPE) ? k / GROUP : k / LEGACY;
  thread_local std::vector<Panel> held;
  if (static_cast<int64_t>(held.size()) < panels::PANELS * per_panel) {
    held.resize(panels::PANELS * per_panel);
  }
  const auto row_of = [&](int64_t column) {
    return p.data + stored_row(p, column - p.first_column) * p.row_bytes;
  };
  const void* packed[panels::PANELS];
  const int64_t count = end - begin;
  int used = 0;
  for (int64_t first = begin; first < end; first += panels::LANES, ++used) {
    Panel* panel = held.data() + used * per_panel;
    panels::pack<TYPE>(row_of, first, std::min<int64_t>(panels::LANES, end - first), k, panel);
    packed[used] = panel;
  }
  const int64_t kp = (k + GROUP - 1) / GROUP * GROUP;
  const panels::Rows x{a.codes.data(), a.scale.data(), a.pairs.data(), a.scaled_sums.data(), kp};
  if (used == 2) {
    panel_rows<TYPE, T, 2>(packed, begin, count, x, rows, k, out, ldo, bias);
  } else {
    panel_rows<TYPE, T, 1>(packed, begin, count, x, rows, k, out, ldo, bias);
  }
}
#endif

std::vector<Part> checked_parts(const char* op, int64_t k, at::TensorList weights,
                                at::IntArrayRef types, at::IntArrayRef heads) {
  TORCH_CHECK(!weights.empty() && weights.size() == types.size() && types.size() == heads.size(),
              op, ": ", weights.size(), " weights, ", types.size(), " types and ", heads.size(),
              " head counts");
  std::vector<Part> parts;
  int64_t first = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const TypeInfo info = type_info(types[i]);
    TORCH_CHECK(info.block_weights > 0, op, ": GGUF type ", types[i],
                " is not one loomllm's kernels read");
    TORCH_CHECK(k % info.block_weights == 0, op, ": ", k, " inputs are not whole blocks of ",
                info.block_weights, " (type ", types[i], ")");
    const int64_t row_bytes = k / info.block_weights * info.block_bytes;
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) == row_bytes &&
                    w.stride(1) == 1 && w.stride(0) == row_bytes,
                op, ": weight ", i, " ", w.sizes(), " ", w.scalar_type(),
                " is not contiguous uint8 rows of ", row_bytes, " bytes");
    TORCH_CHECK(heads[i] >= 0 && (heads[i] == 0 || w.size(0) % (2 * heads[i]) == 0), op,
                ": weight ", i, "'s ", w.size(0), " rows are not ", heads[i], " heads of pairs");
    parts.push_back({w.data_ptr<uint8_t>(), w.size(0), row_bytes, types[i], heads[i], first});
    first += w.size(0);
  }
  return parts;
}

template <typename T, typename Row>
at::Tensor run(const char* op, const Row& row, int64_t rows, int64_t k,
               const at::TensorOptions& options, at::TensorList weights, at::IntArrayRef types,
               at::IntArrayRef heads, const std::optional<at::Tensor>& bias_in, int64_t kernel) {
  TORCH_CHECK(kernel == AUTO || kernel == ROWS_ALWAYS || kernel == PORTABLE, op, ": kernel ",
              kernel, " is none of 0 (auto), 1 (rows) and 2 (portable)");
  const bool portable = kernel == PORTABLE;
  const std::vector<Part> parts = checked_parts(op, k, weights, types, heads);
  const int64_t n = parts.back().first_column + parts.back().rows;
  std::optional<at::Tensor> bias;
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->numel() == n, op, ": bias of ", bias_in->numel(), " values for ", n,
                " outputs");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  bool k_family = false, legacy = false;
  for (const Part& p : parts) (is_k_quant(p.type) ? k_family : legacy) = true;
  const Activations* ka = k_family ? &quantize(row, rows, k, true) : nullptr;
  const Activations* la = legacy ? &quantize(row, rows, k, false) : nullptr;
  at::Tensor out = at::empty({rows, n}, options);
  T* o = out.data_ptr<T>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
#ifdef LOOM_GGUF_VNNI
  if (kernel == AUTO && rows >= PANEL_ROWS) {
    // Tasks of PANELS panels of one part each: a part's last may be narrower.
    std::vector<std::pair<const Part*, int64_t>> units;
    constexpr int64_t width = panels::PANELS * panels::LANES;
    for (const Part& p : parts) {
      for (int64_t c = 0; c < p.rows; c += width) units.emplace_back(&p, p.first_column + c);
    }
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const Part& p = *units[u].first;
        const int64_t first = units[u].second;
        const int64_t last = std::min(first + width, p.first_column + p.rows);
        with_type(p.type, [&](auto type) {
          constexpr int64_t TYPE = decltype(type)::value;
          panel_columns<TYPE, T>(p, first, last, is_k_quant(TYPE) ? *ka : *la, rows, k, o, n, b);
        });
      }
    });
    release(ka, la);
    return out;
  }
#endif
  // A few columns a task: a thread's columns are then one run of the file's rows.
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (const Part& p : parts) {
      const int64_t lo = std::max(begin, p.first_column);
      const int64_t hi = std::min(end, p.first_column + p.rows);
      if (lo >= hi) continue;
      with_type(p.type, [&](auto type) {
        constexpr int64_t TYPE = decltype(type)::value;
        const Activations& a = is_k_quant(TYPE) ? *ka : *la;
#ifdef LOOM_GGUF_FUSED
        if (!portable) {
          part_columns<TYPE, T, true>(p, lo, hi, a, rows, k, o, n, b);
          return;
        }
#endif
        part_columns<TYPE, T, false>(p, lo, hi, a, rows, k, o, n, b);
      });
    }
  });
  release(ka, la);
  return out;
}

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef types,
                       at::IntArrayRef heads, const std::optional<at::Tensor>& bias,
                       int64_t kernel) {
  check_dtype("gguf_linear", x_in);
  TORCH_CHECK(x_in.dim() == 2, "gguf_linear: x ", x_in.sizes(), " is not [M, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor out;
  const auto go = [&](auto type) {
    using T = decltype(type);
    const T* xp = x.data_ptr<T>();
    const auto row = [&](int64_t m, float* v) { to_float(xp + m * k, v, k); };
    out = run<T>("gguf_linear", row, rows, k, x.options(), weights, types, heads, bias, kernel);
  };
  x.scalar_type() == at::kBFloat16 ? go(c10::BFloat16{}) : go(float{});
  return out;
}

at::Tensor silu_gguf_linear(const at::Tensor& gate_up_in, at::TensorList weights,
                            at::IntArrayRef types, at::IntArrayRef heads,
                            const std::optional<at::Tensor>& bias, int64_t kernel) {
  check_dtype("silu_gguf_linear", gate_up_in);
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0, "silu_gguf_linear: gate_up ",
              gate_up_in.sizes(), " is not [M, 2K]");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t rows = gate_up.size(0), k = gate_up.size(1) / 2;
  at::Tensor out;
  const auto go = [&](auto type) {
    using T = decltype(type);
    const T* gp = gate_up.data_ptr<T>();
    const uint16_t* table = std::is_same_v<T, c10::BFloat16> ? bf16_silu_table() : nullptr;
    // silu(gate) * up as silu_mul rounds it, then to float for the quantization.
    const auto row = [&](int64_t m, float* v) {
      std::vector<T> product(k);
      silu_row<T>(gp + m * 2 * k, gp + m * 2 * k + k, product.data(), k, v, table);
      to_float(product.data(), v, k);
    };
    out = run<T>("silu_gguf_linear", row, rows, k, gate_up.options(), weights, types, heads, bias,
                 kernel);
  };
  gate_up.scalar_type() == at::kBFloat16 ? go(c10::BFloat16{}) : go(float{});
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t k,
                           const std::optional<at::Tensor>& rows_in, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "gguf_dequantize: dtype must be float32 or bfloat16, got ", dtype);
  const std::vector<Part> parts =
      checked_parts("gguf_dequantize", k, {weight}, {type}, at::IntArrayRef({int64_t{0}}));
  const Part& p = parts[0];
  at::Tensor rows = rows_in.has_value() ? rows_in->to(at::kLong).contiguous()
                                        : at::arange(p.rows, at::TensorOptions(at::kLong));
  const int64_t* index = rows.data_ptr<int64_t>();
  const int64_t count = rows.numel();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < p.rows, "gguf_dequantize: row ", index[i],
                " is not in [0, ", p.rows, ")");
  }
  at::Tensor out = at::empty({count, k}, at::TensorOptions(dtype));
  const int64_t kp = (k + GROUP - 1) / GROUP * GROUP;
  const auto go = [&](auto out_type) {
    using T = decltype(out_type);
    T* o = out.data_ptr<T>();
    with_type(type, [&](auto type_constant) {
      constexpr int64_t TYPE = decltype(type_constant)::value;
      using Group = std::conditional_t<is_k_quant(TYPE), KGroup, LGroup>;
      at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
        std::vector<Group> gs(kp / GROUP);
        for (int64_t i = begin; i < end; ++i) {
          decode_row<TYPE>(p.data + index[i] * p.row_bytes, k, gs.data());
          T* row = o + i * k;
          for (int64_t w = 0; w < k; ++w) {
            const Group& g = gs[w / GROUP];
            const int64_t at = w % GROUP;
            if constexpr (is_k_quant(TYPE)) {
              const int64_t j = at / SUB;
              row[w] = to<T>(g.d * static_cast<float>(g.sc[j]) * g.codes[at] +
                             g.dm * static_cast<float>(g.mn[j]));
            } else {
              const int64_t b = at / LEGACY;
              row[w] = to<T>(g.a[b] * g.codes[at] + g.b[b]);
            }
          }
        }
      });
    });
  };
  dtype == at::kBFloat16 ? go(c10::BFloat16{}) : go(float{});
  return out;
}

int64_t read_bytes(at::TensorList tensors) {
  typedef uint64_t v8 __attribute__((vector_size(64)));
  std::atomic<uint64_t> total{0};
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.is_contiguous(), "read_bytes: a tensor of ", t.sizes(), " is not contiguous");
    const uint8_t* p = static_cast<const uint8_t*>(t.data_ptr());
    constexpr int64_t chunk = 4096;
    const int64_t chunks = static_cast<int64_t>(t.nbytes()) / chunk;
    // As the kernels split a weight: a run of it a thread, a task a few kilobytes.
    at::parallel_for(0, chunks, 16, [&](int64_t begin, int64_t end) {
      v8 a = {}, b = {};
      for (int64_t i = begin * chunk; i < end * chunk; i += 128) {
        v8 x, y;
        std::memcpy(&x, p + i, sizeof x);
        std::memcpy(&y, p + i + 64, sizeof y);
        a ^= x, b ^= y;
      }
      a ^= b;
      uint64_t folded = 0;
      for (int j = 0; j < 8; ++j) folded ^= a[j];
      total ^= folded;
    });
  }
  return static_cast<int64_t>(total.load());
}

}  // namespace loom_cpu
