// Causal attention of prompt tokens on the CPU: each prompt's queries over its context in the
// paged cache, a tile of query positions at a time. Every block of sixteen keys (and, with
// bfloat16 dot products, of sixteen value rows) is read from the cache and laid out once a
// call, for all the query rows that use it.

#include <atomic>
#include <memory>

#include "cpu_attention_lanes.h"

namespace loom_cpu {
namespace {

constexpr int64_t KEYS = 16;       // a block of keys: one vector of each query row's scores
constexpr int64_t POSITIONS = 16;  // query positions an item of work takes, each with its group
constexpr int SCORE_ROWS = 8;      // query rows whose scores one pass over a key block sums

// A block of keys laid out for scoring: with bfloat16 dot products, [DIM / 2][16] words, each
// key's dims 2p and 2p + 1 in lane p of word row p; else [DIM][16] floats. Keys past the
// context are zeros.
template <typename T, int64_t DIM>
void lay_out_keys(const T* k_cache, int64_t slot_stride, const int64_t* slots, int64_t n,
                  void* block) {
  if constexpr (BF16_DOTS<T>) {
    auto* words = static_cast<uint32_t*>(block);
    for (int64_t t = 0; t < KEYS; ++t) {
      uint32_t row[DIM / 2] = {};
      if (t < n) std::memcpy(row, k_cache + slots[t] * slot_stride, sizeof row);
      for (int64_t p = 0; p < DIM / 2; ++p) words[p * KEYS + t] = row[p];
    }
  } else {
    auto* floats = static_cast<float*>(block);
    for (int64_t t = 0; t < KEYS; ++t) {
      const T* key = t < n ? k_cache + slots[t] * slot_stride : nullptr;
      for (int64_t d = 0; d < DIM; ++d) floats[d * KEYS + t] = key ? f32(key[d]) : 0.0f;
    }
  }
}

// R query rows' scores against a laid-out block of keys, into scores[r] (sixteen each). q[r]:
// row r in T (bfloat16 dot products) or in float.
template <typename T, int64_t DIM, int R>
void score_block(const void* block, const void* const* q, float* const* scores) {
  if constexpr (BF16_DOTS<T>) {
#ifdef __AVX512BF16__
    const auto* words = static_cast<const uint32_t*>(block);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < DIM / 2; ++p) {
      const __m512i keys = _mm512_loadu_si512(words + p * KEYS);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, static_cast<const c10::BFloat16*>(q[r]) + 2 * p, sizeof pair);
        acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)),
                                  reinterpret_cast<__m512bh>(keys));
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores[r], acc[r]);
#endif
  } else {
    const auto* floats = static_cast<const float*>(block);
    v16 acc[R] = {};
    for (int64_t d = 0; d < DIM; ++d) {
      v16 keys;
      std::memcpy(&keys, floats + d * KEYS, sizeof keys);
      for (int r = 0; r < R; ++r) {
        acc[r] = fma16(v16{} + static_cast<const float*>(q[r])[d], keys, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) std::memcpy(scores[r], &acc[r], sizeof acc[r]);
  }
}

template <typename T, int64_t DIM>
void score_rows(int rows, const void* block, const void* const* q, float* const* scores) {
  switch (rows) {
    case 8: return score_block<T, DIM, 8>(block, q, scores);
    case 7: return score_block<T, DIM, 7>(block, q, scores);
    case 6: return score_block<T, DIM, 6>(block, q, scores);
    case 5: return score_block<T, DIM, 5>(block, q, scores);
    case 4: return score_block<T, DIM, 4>(block, q, scores);
    case 3: return score_block<T, DIM, 3>(block, q, scores);
    case 2: return score_block<T, DIM, 2>(block, q, scores);
    default: return score_block<T, DIM, 1>(block, q, scores);
  }
}
static_assert(SCORE_ROWS == 8, "score_rows dispatches up to eight rows");

// With bfloat16 dot products, the values are weighed by them too, with the probabilities
// rounded to bfloat16 (as torch's CPU flash attention does for bfloat16 inputs): a block of
// sixteen value rows laid out as eight pairs of keys, [8][DIM] words, each word a dim of the
// pair's two rows (the first in its lower half), the dims of each sixteen words in load32's
// lane order, so that the sums come out as weigh_values leaves them. Keys past the context
// are zeros.
template <int64_t DIM>
void lay_out_values(const c10::BFloat16* v_cache, int64_t slot_stride, const int64_t* slots,
                    int64_t n, uint32_t* block) {
  for (int64_t i = 0; i < KEYS / 2; ++i) {
    uint16_t pair[2][DIM] = {};
    for (int64_t t = 0; t < 2; ++t) {
      if (2 * i + t < n) std::memcpy(pair[t], v_cache + slots[2 * i + t] * slot_stride, DIM * 2);
    }
    for (int64_t c = 0; c < DIM / 16; ++c) {
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t d = 32 * (c / 2) + 2 * l + c % 2;  // load32's lane l of vector c
        block[(i * DIM / 16 + c) * 16 + l] = pair[0][d] | static_cast<uint32_t>(pair[1][d]) << 16;
      }
    }
  }
}

#ifdef __AVX512BF16__
// R rows' weighted sums of the laid-out value pairs [i0, i1), added to acc [R, DIM]; probs:
// the rows' probabilities in bfloat16, `width` apart, a pair of keys a 32-bit word.
template <int64_t DIM, int R>
void weigh_value_pairs(const uint16_t* probs, int64_t width, int64_t i0, int64_t i1,
                       const uint32_t* pairs, float* acc) {
  constexpr int64_t C = DIM / 16;
  __m512 sum[R][C];
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) sum[r][c] = _mm512_loadu_ps(acc + (r * C + c) * 16);
  }
  for (int64_t i = i0; i < i1; ++i) {
    __m512i values[C];
    for (int64_t c = 0; c < C; ++c) values[c] = _mm512_loadu_si512(pairs + (i * C + c) * 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, probs + r * width + 2 * i, sizeof pair);
      const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int64_t c = 0; c < C; ++c) {
        sum[r][c] = _mm512_dpbf16_ps(sum[r][c], p, reinterpret_cast<__m512bh>(values[c]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + (r * C + c) * 16, sum[r][c]);
  }
}

// weigh_value_pairs for n rows, n from 1 to VALUE_ROWS<DIM>.
template <int64_t DIM>
void weigh_pair_rows(int64_t n, const uint16_t* probs, int64_t width, int64_t i0, int64_t i1,
                     const uint32_t* pairs, float* acc) {
  if constexpr (VALUE_ROWS<DIM> == 4) {
    if (n == 4) return weigh_value_pairs<DIM, 4>(probs, width, i0, i1, pairs, acc);
    if (n == 3) return weigh_value_pairs<DIM, 3>(probs, width, i0, i1, pairs, acc);
  }
  n == 2 ? weigh_value_pairs<DIM, 2>(probs, width, i0, i1, pairs, acc)
         : weigh_value_pairs<DIM, 1>(probs, width, i0, i1, pairs, acc);
}

// A row's probabilities rounded to bfloat16 (to nearest even), 32 at a time.
inline void round_probabilities(const float* probs, int64_t n, uint16_t* out) {
  for (int64_t j = 0; j < n; j += 32) {
    const __m512bh bf = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(probs + j + 16),
                                            _mm512_loadu_ps(probs + j));
    _mm512_storeu_si512(out + j, reinterpret_cast<__m512i>(bf));
  }
}
#endif

// An item of work: a prompt's KV head, over query positions [first, first + count) of the
// prompt's queries; its cost, the scores it computes.
struct Item {
  int64_t prompt, kv_head, first, count, cost;
};

// What every item reads: the prompts, the caches, the options, the laid-out keys.
template <typename T>
struct Prompts {
  const T *q, *k_cache, *v_cache;
  T* out;
  int64_t q_row_stride, q_head_stride, slot_stride, heads, kv_heads, group;
  const int64_t *slots, *lens, *q_starts, *q_lens;
  int64_t prompts, slots_width;
  float scale, softcap;
  int64_t window;
  const float* sinks;
  // Each prompt's keys for each KV head, in blocks (lay_out_keys' layout) from its first
  // query's first key down to a multiple of sixteen, first_keys[p], to its last key: prompt
  // p's head g's first block at key_blocks + (block_starts[p] * kv_heads + g * blocks of p)
  // * BLOCK_VECTORS.
  const v16* key_blocks = nullptr;
  const int64_t *first_keys = nullptr, *block_starts = nullptr;
  // With bfloat16 dot products, the value rows likewise (lay_out_values' layout).
  const v16* value_blocks = nullptr;
};

// A laid-out key block's size in vectors: DIM / 2 words of two bfloat16, or DIM floats, for
// each of its sixteen keys.
template <typename T, int64_t DIM>
constexpr int64_t BLOCK_VECTORS = (BF16_DOTS<T> ? DIM / 2 : DIM) * KEYS * 4 / sizeof(v16);

// Scratch a thread reuses from item to item.
struct Scratch {
  std::vector<float> scores, acc, sums, qf;
  std::vector<uint16_t> probs;  // a pass's rows' probabilities in bfloat16 (bf16 dot products)
  std::vector<const void*> q_rows;  // each query row: in T (bf16 dot products) or in float
};

// One item: its rows are its positions' query heads, position-major. Scores for every key
// any row sees, then each row's softmax over its own keys (the others' probabilities zero),
// then the value rows weighed a few query rows at a time: by bfloat16 dot products over the
// laid-out value pairs where the scores came from them, else as decode attention does.
template <typename T, int64_t DIM>
void attend_item(const Prompts<T>& a, const Item& item, Scratch& s) {
  const int64_t p = item.prompt, g = item.kv_head, group = a.group;
  const int64_t rows = item.count * group, len = a.lens[p];
  const int64_t first_pos = len - a.q_lens[p] + item.first;  // the first query's position
  const int64_t last_end = first_pos + item.count;           // keys [.., last_end) seen at all
  // The first key any row sees, down to its block's first, as the keys are laid out.
  const int64_t kb = first_key(first_pos, a.window) / KEYS * KEYS;
  const int64_t width = (last_end - kb + KEYS - 1) / KEYS * KEYS;
  s.scores.resize(rows * width + 16);  // round_probabilities reads 32 at a time
  s.acc.assign(rows * DIM, 0.0f);
  s.sums.resize(rows);
  const int64_t blocks = a.block_starts[p + 1] - a.block_starts[p];
  const int64_t first_block =
      a.block_starts[p] * a.kv_heads + g * blocks + (kb - a.first_keys[p]) / KEYS;
  const v16* key_blocks = a.key_blocks + first_block * BLOCK_VECTORS<T, DIM>;
  s.q_rows.resize(rows);
  if constexpr (!BF16_DOTS<T>) s.qf.resize(rows * DIM);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = a.q_starts[p] + item.first + r / group;
    const T* row = a.q + token * a.q_row_stride + (g * group + r % group) * a.q_head_stride;
    if constexpr (BF16_DOTS<T>) {
      s.q_rows[r] = row;
    } else {
      to_float(row, s.qf.data() + r * DIM, DIM);
      s.q_rows[r] = s.qf.data() + r * DIM;
    }
  }
  // Scores, key block by key block: rows whose positions come before a block skip it.
  for (int64_t j0 = 0; j0 < last_end - kb; j0 += KEYS) {
    const v16* block = key_blocks + j0 / KEYS * BLOCK_VECTORS<T, DIM>;
    // Row r's position is first_pos + r / group: it sees the block if kb + j0 <= that.
    const int64_t from = std::max<int64_t>(0, (kb + j0 - first_pos) * group);
    for (int64_t r0 = from; r0 < rows; r0 += SCORE_ROWS) {
      const int n = static_cast<int>(std::min<int64_t>(SCORE_ROWS, rows - r0));
      float* out[SCORE_ROWS];
      for (int r = 0; r < n; ++r) out[r] = s.scores.data() + (r0 + r) * width + j0;
      score_rows<T, DIM>(n, block, s.q_rows.data() + r0, out);
    }
  }
  // Each row's softmax over its own keys [b, e); zeros elsewhere, so that weighing a tile of
  // rows over the keys any of them sees adds nothing for the others.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / group;
    const int64_t b = first_key(pos, a.window) - kb, e = pos + 1 - kb;
    float* row = s.scores.data() + r * width;
    const float* sink = a.sinks ? a.sinks + g * group + r % group : nullptr;
    softmax_rows(row + b, 1, e - b, a.scale, a.softcap, sink, s.sums.data() + r);
    std::fill(row, row + b, 0.0f);
    std::fill(row + e, row + width, 0.0f);
  }
  const T* values = a.v_cache + g * DIM;
  const int64_t* slots = a.slots + p * a.slots_width + kb;
  if constexpr (BF16_DOTS<T>) s.probs.resize(VALUE_ROWS<DIM> * width + 16);
  for (int64_t r0 = 0; r0 < rows; r0 += VALUE_ROWS<DIM>) {
    const int64_t n = std::min(VALUE_ROWS<DIM>, rows - r0);
    const int64_t j0 = first_key(first_pos + r0 / group, a.window) - kb;
    const int64_t j1 = first_pos + (r0 + n - 1) / group + 1 - kb;
    float* acc = s.acc.data() + r0 * DIM;
    if constexpr (BF16_DOTS<T>) {
#ifdef __AVX512BF16__
      for (int64_t r = 0; r < n; ++r) {
        round_probabilities(s.scores.data() + (r0 + r) * width, width, s.probs.data() + r * width);
      }
      const auto* pairs = reinterpret_cast<const uint32_t*>(a.value_blocks +
                                                            first_block * BLOCK_VECTORS<T, DIM>);
      weigh_pair_rows<DIM>(n, s.probs.data(), width, j0 / 2, (j1 + 1) / 2, pairs, acc);
#endif
    } else {
      weigh_value_rows<T, DIM>(n, s.scores.data() + r0 * width, width, j0, j1, values,
                               a.slot_stride, slots, acc);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = a.q_starts[p] + item.first + r / group;
    T* out = a.out + (token * a.heads + g * group + r % group) * DIM;
    const v16 inv = v16{} + 1.0f / s.sums[r];
    const v16* acc = reinterpret_cast<const v16*>(s.acc.data() + r * DIM);
    for (int64_t c = 0; c < DIM / 16; c += 2) store32(out + c * 16, acc[c] * inv, acc[c + 1] * inv);
  }
}

// Every prompt's keys laid out, a block for each KV head, then every item, the costliest
// first, taken by the threads as each finishes its last: items' costs differ (later positions
// see more keys), so a fixed split would leave a thread idle.
template <typename T, int64_t DIM>
void attend_items(Prompts<T> a, std::vector<Item>& items) {
  std::vector<int64_t> firsts(a.prompts), starts(a.prompts + 1, 0);
  for (int64_t p = 0; p < a.prompts; ++p) {
    firsts[p] = first_key(a.lens[p] - a.q_lens[p], a.window) / KEYS * KEYS;
    starts[p + 1] = starts[p] + (a.lens[p] - firsts[p] + KEYS - 1) / KEYS;
  }
  const int64_t all_blocks = starts[a.prompts] * a.kv_heads;
  // Not zeroed first: lay_out_keys writes every vector of a block.
  const std::unique_ptr<v16[]> key_blocks(new v16[all_blocks * BLOCK_VECTORS<T, DIM>]);
  const std::unique_ptr<v16[]> value_blocks(
      BF16_DOTS<T> ? new v16[all_blocks * BLOCK_VECTORS<T, DIM>] : nullptr);
  at::parallel_for(0, all_blocks, 16, [&](int64_t begin, int64_t end) {
    int64_t p = std::upper_bound(starts.begin(), starts.end(), begin / a.kv_heads) -
                starts.begin() - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (i >= starts[p + 1] * a.kv_heads) ++p;
      const int64_t blocks = starts[p + 1] - starts[p], at = i - starts[p] * a.kv_heads;
      const int64_t g = at / blocks, j0 = firsts[p] + at % blocks * KEYS;
      const int64_t* slots = a.slots + p * a.slots_width + j0;
      const int64_t n = std::min(KEYS, a.lens[p] - j0);
      lay_out_keys<T, DIM>(a.k_cache + g * DIM, a.slot_stride, slots, n,
                           key_blocks.get() + i * BLOCK_VECTORS<T, DIM>);
      if constexpr (BF16_DOTS<T>) {
        lay_out_values<DIM>(a.v_cache + g * DIM, a.slot_stride, slots, n,
                            reinterpret_cast<uint32_t*>(value_blocks.get() +
                                                        i * BLOCK_VECTORS<T, DIM>));
      }
    }
  });
  a.key_blocks = key_blocks.get();
  a.value_blocks = value_blocks.get();
  a.first_keys = firsts.data();
  a.block_starts = starts.data();
  std::sort(items.begin(), items.end(),
            [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next++; i < total; i = next++) attend_item<T, DIM>(a, items[i], scratch);
  });
}

}  // namespace

// Prompt p's q_lens[p] queries are q's rows q_starts[p] onward, the last of its lens[p]
// context tokens, whose slots are slots[p, :lens[p]]; query i attends to the context up to its
// own position (its last `window` keys where window > 0). q [T, H, D]; caches [S, KVH, D];
// softcap and sinks as decode_attention's. Returns [T, H, D]: rows in no prompt are zeros.
at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& slots_in,
                             const at::Tensor& lens_in, const at::Tensor& q_starts_in,
                             const at::Tensor& q_lens_in, double scale, int64_t window,
                             double softcap, const std::optional<at::Tensor>& sinks_in) {
  const at::Tensor q = checked_query("prefill_attention", q_in, k_cache, v_cache);
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), num_slots = k_cache.size(0);
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const at::Tensor q_starts = q_starts_in.to(at::kLong).contiguous();
  const at::Tensor q_lens = q_lens_in.to(at::kLong).contiguous();
  const int64_t prompts = lens.numel();
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == prompts && q_starts.numel() == prompts &&
                  q_lens.numel() == prompts,
              "prefill_attention: slots ", slots.sizes(), ", lens ", lens.sizes(), ", q_starts ",
              q_starts.sizes(), ", q_lens ", q_lens.sizes(), " are not of one prompt count");
  const int64_t width = slots.size(1);
  const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  const int64_t *qs = q_starts.data_ptr<int64_t>(), *ql = q_lens.data_ptr<int64_t>();
  for (int64_t p = 0; p < prompts; ++p) {
    TORCH_CHECK(ql[p] >= 1 && ql[p] <= lp[p] && lp[p] <= width, "prefill_attention: prompt ", p,
                " has ", ql[p], " queries of ", lp[p], " context tokens, ", width, " slots");
    TORCH_CHECK(qs[p] >= 0 && qs[p] + ql[p] <= tokens, "prefill_attention: prompt ", p,
                "'s queries ", qs[p], " to ", qs[p] + ql[p], " are outside q's ", tokens);
    for (int64_t j = 0; j < lp[p]; ++j) {
      TORCH_CHECK(sp[p * width + j] >= 0 && sp[p * width + j] < num_slots,
                  "prefill_attention: slot ", sp[p * width + j], " outside ", num_slots);
    }
  }
  const at::Tensor sinks = checked_sinks("prefill_attention", sinks_in, heads);
  at::Tensor out = at::zeros({tokens, heads, dim}, q.options());
  if (dim != 64 && dim != 128) {  // head sizes not compiled in: each prompt as decode rows
    for (int64_t p = 0; p < prompts; ++p) {
      const at::Tensor positions = at::arange(lp[p] - ql[p] + 1, lp[p] + 1, lens.options());
      out.narrow(0, qs[p], ql[p])
          .copy_(decode_attention_rows(q.narrow(0, qs[p], ql[p]), k_cache, v_cache,
                                       slots.narrow(0, p, 1).narrow(1, 0, lp[p]), positions,
                                       scale, window, softcap, sinks_in, false));
    }
    return out;
  }
  const int64_t group = heads / kv_heads;
  std::vector<Item> items;
  for (int64_t p = 0; p < prompts; ++p) {
    for (int64_t first = 0; first < ql[p]; first += POSITIONS) {
      const int64_t count = std::min(POSITIONS, ql[p] - first);
      const int64_t end = lp[p] - ql[p] + first + count;
      const int64_t begin = first_key(end - count, window);
      for (int64_t g = 0; g < kv_heads; ++g) items.push_back({p, g, first, count, end - begin});
    }
  }
  const auto run = [&](auto type) {
    using T = decltype(type);
    const Prompts<T> a{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                       out.data_ptr<T>(), q.stride(0), q.stride(1), kv_heads * dim, heads,
                       kv_heads, group, sp, lp, qs, ql, prompts, width,
                       static_cast<float>(scale), static_cast<float>(softcap), window,
                       sinks.defined() ? sinks.data_ptr<float>() : nullptr};
    dim == 64 ? attend_items<T, 64>(a, items) : attend_items<T, 128>(a, items);
  };
  q.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return out;
}

}  // namespace loom_cpu
