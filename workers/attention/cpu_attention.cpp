// Decode attention on the CPU: each decode row's query heads over its context, read from the
// paged K/V cache where it lies (no gather), in float32 (a bfloat16 cache's scores from
// bfloat16 dot products where the CPU has them).

#include "cpu_attention_lanes.h"

namespace loom_cpu {

// ---- Decode attention over the paged cache -------------------------------------------------

// Rows are fetched a few keys ahead: their slots are known, the hardware cannot guess them.
// A key's value row is fetched with its key row, so that twice the reads are in flight while
// the scores are summed, and the weighing of the values finds them in the cache. AHEAD keys
// for one KV head's rows; half as many for a key's whole record (every KV head's rows, about
// as many bytes in flight at 2 to 4 KV heads).
constexpr int64_t AHEAD = 16;
constexpr int64_t AHEAD_RECORDS = 8;
// An item of work is a whole row (its keys' records read once, in order, for every KV head)
// where there are this many rows a thread; else a row's KV head, so that one row or a few
// still spread over every thread.
constexpr int64_t WHOLE_ROWS_PER_THREAD = 4;

template <typename T>
inline void prefetch_key(const T* k_cache, const T* v_cache, int64_t slot, int64_t dim) {
  prefetch_row(k_cache + slot, dim);
  prefetch_row(v_cache + slot, dim);
}

// The thread's next item, whose keys' K and V records are fetched while this item is
// computed, half of them during its scores and half during its values: memory stays busy
// from one item to the next (the softmax and the values run from the cache). None: keys 0.
template <typename T>
struct Upcoming {
  const T* k_cache = nullptr;
  const T* v_cache = nullptr;
  const int64_t* slots = nullptr;  // its keys' slots, from its first key on
  int64_t keys = 0, slot_stride = 0, record = 0, fetched = 0;

  // Its records up to key `upto` (of `keys`), fetched.
  void fetch_upto(int64_t upto) {
    for (; fetched < std::min(upto, keys); ++fetched) {
      const int64_t at = slots[fetched] * slot_stride;
      prefetch_row(k_cache + at, record);
      prefetch_row(v_cache + at, record);
    }
  }
};

// Keys are taken sixteen at a time: a vector of their scores at once, their value rows from
// the L1 cache for the heads after the first few.
constexpr int64_t CHUNK = 16;

// Keys j0 .. j0 + n of a chunk, each one's partial scores (sixteen lanes a query head) into
// parts [heads, CHUNK], from the float query rows qf [heads, DIM]; keys past n give zeros.
// Each key's K and V records are fetched LEAD keys ahead, and the next item's meanwhile.
template <typename T, int64_t DIM, int64_t LEAD>
[[gnu::always_inline]] inline void score_keys(const float* qf, const T* k_cache, const T* v_cache,
                                              int64_t slot_stride, const int64_t* slots,
                                              int64_t j0, int64_t n, int64_t keys,
                                              int64_t kv_heads, int64_t group, int64_t record,
                                              v16* parts, Upcoming<T>& upcoming) {
  constexpr int64_t C = DIM / 16;
  const int64_t heads = kv_heads * group;
  for (int64_t t = 0; t < CHUNK; ++t) {
    const int64_t j = j0 + t;
    if (t >= n) {  // past the last key: lanes summed and dropped
      for (int64_t h = 0; h < heads; ++h) parts[h * CHUNK + t] = v16{};
      continue;
    }
    if (j + LEAD < keys) prefetch_key(k_cache, v_cache, slots[j + LEAD] * slot_stride, record);
    upcoming.fetch_upto((j + 1) * upcoming.keys / (2 * keys));
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T* k = k_cache + slots[j] * slot_stride + g * DIM;
      v16 row[C];
      for (int64_t c = 0; c < C; c += 2) load32(k + c * 16, row[c], row[c + 1]);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const v16* qv = reinterpret_cast<const v16*>(qf + h * DIM);
        v16 part = qv[0] * row[0];
        for (int64_t c = 1; c < C; ++c) part += qv[c] * row[c];
        parts[h * CHUNK + t] = part;
      }
    }
  }
}

// A bfloat16 query row's sixteen dims at a time, each sixteen twice (in both halves of a
// vector): qq[i] holds dims 16i .. 16i + 15, for score_pairs. (Called where the CPU has
// bfloat16 dot products alone, as score_pairs.)
template <int64_t DIM>
[[gnu::always_inline]] inline void twice_sixteen(const c10::BFloat16* q, v16* qq) {
#ifdef __AVX512BF16__
  for (int64_t c = 0; c < DIM / 32; ++c) {
    const __m512i row = _mm512_loadu_si512(q + c * 32);
    qq[2 * c] = reinterpret_cast<v16>(_mm512_shuffle_i64x2(row, row, 0x44));
    qq[2 * c + 1] = reinterpret_cast<v16>(_mm512_shuffle_i64x2(row, row, 0xEE));
  }
#endif
}

// As score_keys, with bfloat16 dot products, two keys a vector: a pair's sixteen dims side by
// side (the first key's in lanes 0-7, the second's in 8-15) against the query's twice
// (twice_sixteen), so that a pair's partial scores come in one vector and their lane sums
// start a step in (lane_sums_of_pairs). parts [heads, CHUNK / 2].
template <typename T, int64_t DIM, int64_t LEAD>
[[gnu::always_inline]] inline void score_pairs(const v16* qq, const T* k_cache,
                                               const T* v_cache, int64_t slot_stride,
                                               const int64_t* slots, int64_t j0, int64_t n,
                                               int64_t keys, int64_t kv_heads, int64_t group,
                                               int64_t record, v16* parts,
                                               Upcoming<T>& upcoming) {
#ifdef __AVX512BF16__
  constexpr int64_t C = DIM / 16;
  const int64_t heads = kv_heads * group;
  for (int64_t t = 0; t < CHUNK; t += 2) {
    const int64_t j = j0 + t;
    if (t >= n) {  // past the last key: lanes summed and dropped
      for (int64_t h = 0; h < heads; ++h) parts[h * CHUNK / 2 + t / 2] = v16{};
      continue;
    }
    for (int64_t u = j; u < std::min(j + 2, j0 + n); ++u) {
      if (u + LEAD < keys) prefetch_key(k_cache, v_cache, slots[u + LEAD] * slot_stride, record);
      upcoming.fetch_upto((u + 1) * upcoming.keys / (2 * keys));
    }
    const bool second = t + 1 < n;
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T* a = k_cache + slots[j] * slot_stride + g * DIM;
      const T* b = second ? k_cache + slots[j + 1] * slot_stride + g * DIM : nullptr;
      __m512i side[C];  // side[i]: dims 16i .. 16i + 15 of the first key, then the second's
      for (int64_t c = 0; c < C / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(a + c * 32);
        const __m512i y = second ? _mm512_loadu_si512(b + c * 32) : _mm512_setzero_si512();
        side[2 * c] = _mm512_shuffle_i64x2(x, y, 0x44);
        side[2 * c + 1] = _mm512_shuffle_i64x2(x, y, 0xEE);
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        __m512 part = _mm512_setzero_ps();
        for (int64_t i = 0; i < C; ++i) {
          part = _mm512_dpbf16_ps(part, reinterpret_cast<__m512bh>(qq[h * C + i]),
                                  reinterpret_cast<__m512bh>(side[i]));
        }
        parts[h * CHUNK / 2 + t / 2] = reinterpret_cast<v16>(part);
      }
    }
  }
#endif
}

// One decode row's `kv_heads` KV heads from the first at k_cache and v_cache (all of them, or
// one), each with its `group` query heads, over the row's context in the cache, for a head
// size known when compiled (a multiple of 32). Sixteen keys' scores are summed at once; the
// value rows are weighed in registers, a few query heads at a time. Keys are fetched LEAD
// ahead.
template <typename T, int64_t DIM, int64_t LEAD>
void attend_heads(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                  int64_t slot_stride, const int64_t* slots, int64_t begin, int64_t end,
                  int64_t kv_heads, int64_t group, float scale, float softcap,
                  const float* sinks, T* out, int64_t out_head_stride, std::vector<v16>& buf,
                  Upcoming<T>& upcoming) {
  static_assert(DIM % 32 == 0);
  constexpr int64_t C = DIM / 16;
  const int64_t keys = end - begin, heads = kv_heads * group;
  slots += begin;
  buf.resize(heads * CHUNK + (heads * DIM * 2 + heads * keys + heads) / 16 + 1);
  v16* parts = buf.data();                                      // [heads, CHUNK keys]
  float* qf = reinterpret_cast<float*>(parts + heads * CHUNK);  // [heads, DIM]
  float* acc = qf + heads * DIM;                                // [heads, DIM]
  float* scores = acc + heads * DIM;                            // [heads, keys]
  float* sums = scores + heads * keys;                          // [heads]
  const int64_t record = kv_heads * DIM;
  for (int64_t j = 0; j < std::min(LEAD, keys); ++j) {
    prefetch_key(k_cache, v_cache, slots[j] * slot_stride, record);
  }
  // With bfloat16 dot products, qq [heads, DIM / 16]: each sixteen dims of a query head twice,
  // as a pair of keys' are laid side by side (score_pairs); else each head's row in float.
  v16* qq = reinterpret_cast<v16*>(qf);
  for (int64_t h = 0; h < heads; ++h) {
    if constexpr (BF16_DOTS<T>) {
      twice_sixteen<DIM>(q + h * q_head_stride, qq + h * C);
    } else {
      v16* row = reinterpret_cast<v16*>(qf + h * DIM);
      for (int64_t c = 0; c < C; c += 2) load32(q + h * q_head_stride + c * 16, row[c], row[c + 1]);
    }
  }
  for (int64_t j0 = 0; j0 < keys; j0 += CHUNK) {
    const int64_t n = std::min(CHUNK, keys - j0);
    if constexpr (BF16_DOTS<T>) {
      score_pairs<T, DIM, LEAD>(qq, k_cache, v_cache, slot_stride, slots, j0, n, keys, kv_heads,
                                group, record, parts, upcoming);
    } else {
      score_keys<T, DIM, LEAD>(qf, k_cache, v_cache, slot_stride, slots, j0, n, keys, kv_heads,
                               group, record, parts, upcoming);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const v16 s =
          BF16_DOTS<T> ? lane_sums_of_pairs(parts + h * CHUNK / 2) : lane_sums(parts + h * CHUNK);
      if (n == CHUNK) {
        std::memcpy(scores + h * keys + j0, &s, sizeof s);
      } else {
        for (int64_t t = 0; t < n; ++t) scores[h * keys + j0 + t] = s[t];
      }
    }
  }
  softmax_rows(scores, heads, keys, scale, softcap, sinks, sums);
  std::fill(acc, acc + heads * DIM, 0.0f);
  for (int64_t j0 = 0; j0 < keys; j0 += CHUNK) {
    const int64_t j1 = std::min(j0 + CHUNK, keys);
    upcoming.fetch_upto(j1 == keys ? upcoming.keys
                                   : upcoming.keys / 2 + j1 * upcoming.keys / (2 * keys));
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T* values = v_cache + g * DIM;
      for (int64_t i = 0; i < group; i += VALUE_ROWS<DIM>) {
        const int64_t h = g * group + i;
        weigh_value_rows<T, DIM>(std::min(VALUE_ROWS<DIM>, group - i), scores + h * keys, keys,
                                 j0, j1, values, slot_stride, slots, acc + h * DIM);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const v16 inv = v16{} + 1.0f / sums[h];
    const v16* a = reinterpret_cast<const v16*>(acc + h * DIM);
    for (int64_t c = 0; c < C; c += 2) {
      store32(out + h * out_head_stride + c * 16, a[c] * inv, a[c + 1] * inv);
    }
  }
}

// One decode row and KV head: its group of query heads over the row's context in the cache,
// for any head size.
template <typename T>
void attend_group(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                  int64_t slot_stride, const int64_t* slots, int64_t begin, int64_t end,
                  int64_t group, int64_t dim, float scale, float softcap, const float* sinks,
                  T* out, int64_t out_head_stride, std::vector<v16>& buf) {
  const int64_t keys = end - begin;
  buf.resize((group * dim * 2 + dim + group * keys + group) / 16 + 1);
  float* qf = reinterpret_cast<float*>(buf.data());  // [group, dim]
  float* acc = qf + group * dim;    // [group, dim]
  float* row = acc + group * dim;   // [dim]: one key or value in float
  float* scores = row + dim;        // [group, keys]
  float* sums = scores + group * keys;  // [group]
  for (int64_t g = 0; g < group; ++g) to_float(q + g * q_head_stride, qf + g * dim, dim);
  for (int64_t j = 0; j < std::min(AHEAD, keys); ++j) {
    prefetch_key(k_cache, v_cache, slots[begin + j] * slot_stride, dim);
  }
  // Key by key: each key row converted once for the whole group.
  for (int64_t j = 0; j < keys; ++j) {
    if (j + AHEAD < keys) {
      prefetch_key(k_cache, v_cache, slots[begin + j + AHEAD] * slot_stride, dim);
    }
    to_float(k_cache + slots[begin + j] * slot_stride, row, dim);
    for (int64_t g = 0; g < group; ++g) scores[g * keys + j] = dot(qf + g * dim, row, dim);
  }
  softmax_rows(scores, group, keys, scale, softcap, sinks, sums);
  std::fill(acc, acc + group * dim, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * keys;
    float* a = acc + g * dim;
    for (int64_t j = 0; j < keys; ++j) {
      const T* v = v_cache + slots[begin + j] * slot_stride;
      for (int64_t d = 0; d < dim; ++d) a[d] += p[j] * f32(v[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / sums[g];
    for (int64_t d = 0; d < dim; ++d) {
      out[g * out_head_stride + d] = to<T>(acc[g * dim + d] * inv);
    }
  }
}

// Each decode row's attention, q [B, H, D], over its context: slots [B, L] (the first
// lens[b] are row b's, in order), or [1, L] shared by every row (a prompt's tokens, each over
// the keys up to its own), in caches [S, KVH, D]. window > 0 keeps each row's last
// `window` keys; softcap > 0 caps scores as Gemma 2; sinks [H] (gpt-oss) join each softmax's
// sum and attend to nothing. Computed in float32: [B, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& lens, double scale, int64_t window, double softcap,
                            const std::optional<at::Tensor>& sinks) {
  return decode_attention_rows(q, k_cache, v_cache, slots, lens, scale, window, softcap, sinks,
                               true);
}

at::Tensor decode_attention_rows(const at::Tensor& q_in, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& slots_in,
                                 const at::Tensor& lens_in, double scale, int64_t window,
                                 double softcap, const std::optional<at::Tensor>& sinks_in,
                                 bool check_slots) {
  const at::Tensor q = checked_query("decode_attention", q_in, k_cache, v_cache);
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 2 && (slots.size(0) == rows || slots.size(0) == 1) &&
                  lens.numel() == rows,
              "decode_attention: slots ", slots.sizes(), ", lens ", lens.sizes(), " for ", rows,
              " rows");
  const int64_t width = slots.size(1), num_slots = k_cache.size(0);
  const int64_t row_stride = slots.size(0) == 1 ? 0 : width;  // 0: one list for every row
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t checked = 0;  // of a shared list, the slots checked so far
  for (int64_t b = 0; b < rows && check_slots; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width, "decode_attention: row ", b, " has ", lp[b],
                " keys of ", width);
    for (int64_t j = row_stride == 0 ? checked : 0; j < lp[b]; ++j) {
      TORCH_CHECK(sp[b * row_stride + j] >= 0 && sp[b * row_stride + j] < num_slots,
                  "decode_attention: slot ", sp[b * row_stride + j], " outside ", num_slots);
    }
    checked = std::max(checked, lp[b]);
  }
  const at::Tensor sinks = checked_sinks("decode_attention", sinks_in, heads);
  const float* sinkp = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, heads, dim}, q.options());
  const auto run = [&](auto type) {
    using T = decltype(type);
    const T *qp = q.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    // With rows enough for every thread, an item is a whole row: its keys' K and V records
    // are read once, contiguously, for every KV head. Otherwise an item is a row's KV head.
    const bool whole_rows =
        (dim == 64 || dim == 128) && rows >= WHOLE_ROWS_PER_THREAD * at::get_num_threads();
    const int64_t per_row = whole_rows ? 1 : kv_heads, item_kv_heads = whole_rows ? kv_heads : 1;
    const int64_t stride = kv_heads * dim;
    // Rows taken first, last, second, second to last...: each thread's run of items has
    // as many keys as another's where the rows' contexts grow (a prompt's tokens).
    const auto row_of = [&](int64_t item) {
      const int64_t nth = item / per_row;
      return nth % 2 == 0 ? nth / 2 : rows - 1 - nth / 2;
    };
    at::parallel_for(0, rows * per_row, 1, [&](int64_t b0, int64_t e0) {
      std::vector<v16> buf;  // each thread's scratch
      for (int64_t item = b0; item < e0; ++item) {
        const int64_t h = item % per_row, b = row_of(item), len = lp[b];
        const int64_t begin = first_key(len - 1, window);  // the row's query is at len - 1
        Upcoming<T> upcoming;
        if (item + 1 < e0) {
          const int64_t nb = row_of(item + 1), nh = (item + 1) % per_row;
          const int64_t nbegin = first_key(lp[nb] - 1, window);
          upcoming = Upcoming<T>{kc + nh * dim, vc + nh * dim, sp + nb * row_stride + nbegin,
                                 lp[nb] - nbegin, stride, item_kv_heads * dim, 0};
        }
        const T* row_q = qp + b * q.stride(0) + h * group * q.stride(1);
        const T *keys = kc + h * dim, *values = vc + h * dim;
        const float* head_sinks = sinkp ? sinkp + h * group : nullptr;
        T* row_out = op + (b * heads + h * group) * dim;
        const auto cap = static_cast<float>(softcap), s = static_cast<float>(scale);
        const int64_t* row_slots = sp + b * row_stride;
        const auto attend = [&](auto dim_tag, auto ahead_tag) {
          attend_heads<T, decltype(dim_tag)::value, decltype(ahead_tag)::value>(
              row_q, q.stride(1), keys, values, stride, row_slots, begin, len, item_kv_heads,
              group, s, cap, head_sinks, row_out, dim, buf, upcoming);
        };
        using Dim64 = std::integral_constant<int64_t, 64>;
        using Dim128 = std::integral_constant<int64_t, 128>;
        using Near = std::integral_constant<int64_t, AHEAD_RECORDS>;
        using Far = std::integral_constant<int64_t, AHEAD>;
        if (dim == 64) {
          whole_rows ? attend(Dim64{}, Near{}) : attend(Dim64{}, Far{});
        } else if (dim == 128) {
          whole_rows ? attend(Dim128{}, Near{}) : attend(Dim128{}, Far{});
        } else {
          attend_group<T>(row_q, q.stride(1), keys, values, stride, row_slots, begin, len,
                          group, dim, s, cap, head_sinks, row_out, dim, buf);
        }
      }
    });
  };
  // check_dtype let float32 and bfloat16 through.
  q.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return out;
}

}  // namespace loom_cpu
