// Sampling on the CPU in a few passes over each row of logits, where torch's path copies the
// rows to float32 and makes many more: greedy (the first largest logit's id, in one pass over
// the row as it lies), and a draw at a temperature (with the id's log-softmax).

#include "cpu_ops.h"

namespace loom_cpu {
namespace {

// The sum of exp(x - top) over a float row, added as sum_of adds: sixteen lanes, then across.
float exp_sum(const float* x, int64_t n, float top) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 v;
    std::memcpy(&v, x + i, sizeof v);
    acc += fast_exp16(v - top);
  }
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) sum += fast_exp(x[i] - top);
  return sum;
}

// The first id of the largest value in a row as it lies, in one pass (ties: the smallest
// id; a NaN, where there is one, is the pick: torch.argmax's ids). Sixteen lanes keep their
// own first best, merged at the end; bfloat16 widens sixteen at a time, in order.
template <typename T>
int64_t first_argmax_of(const T* x, int64_t n) {
  v16 best = v16{} - std::numeric_limits<float>::infinity();
  v16i where = v16i{} - 1, at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16i unordered = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, at += 16) {
    float widened[16];
    to_float(x + i, widened, 16);
    v16 v;
    std::memcpy(&v, widened, sizeof v);
    const v16i better = v > best;
    unordered |= v != v;
    best = better ? v : best;
    where = better ? at : where;
  }
  bool nan = false;
  for (int u = 0; u < 16; ++u) nan = nan || unordered[u] != 0;
  for (int64_t j = i; j < n && !nan; ++j) nan = f32(x[j]) != f32(x[j]);
  if (nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (f32(x[j]) != f32(x[j])) return j;
    }
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t id = -1;
  for (int u = 0; u < 16; ++u) {
    if (where[u] >= 0 && (best[u] > top || (best[u] == top && where[u] < id))) {
      top = best[u];
      id = where[u];
    }
  }
  if (id < 0) {  // nothing above -inf so far: id 0 unless the tail has more, as torch.argmax
    id = 0;
    top = f32(x[0]);
  }
  for (; i < n; ++i) {
    if (f32(x[i]) > top) {
      top = f32(x[i]);
      id = i;
    }
  }
  return id;
}

// Each row of logits' id and its logprob (the raw logits' log-softmax there: minus the log
// of the sum of exp(logit - the largest)). The greedy id, or where temperatures[r] > 0 (with
// `temperatures`), a draw from softmax(logits / temperature): the first id whose weight,
// summed in float64 in order, reaches 1 - uniforms[r] of the row's total.
std::tuple<at::Tensor, at::Tensor> sample_rows(const char* op, const at::Tensor& logits_in,
                                               const std::optional<at::Tensor>& temperatures_in,
                                               const std::optional<at::Tensor>& uniforms_in) {
  check_dtype(op, logits_in);
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, op, ": logits ", logits_in.sizes(),
              " are not [B, V]");
  TORCH_CHECK(logits_in.size(1) <= std::numeric_limits<int32_t>::max(), op, ": a vocabulary of ",
              logits_in.size(1), " ids is beyond 32-bit positions");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const float* temperatures = nullptr;
  const double* uniforms = nullptr;
  at::Tensor held_temperatures, held_uniforms;
  if (temperatures_in.has_value()) {
    TORCH_CHECK(temperatures_in->numel() == rows && uniforms_in->numel() == rows, op, ": ",
                temperatures_in->numel(), " temperatures and ", uniforms_in->numel(),
                " uniforms for ", rows, " rows");
    held_temperatures = temperatures_in->to(at::kFloat).contiguous();
    held_uniforms = uniforms_in->to(at::kDouble).contiguous();
    temperatures = held_temperatures.data_ptr<float>();
    uniforms = held_uniforms.data_ptr<double>();
  }
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({rows}, logits.options().dtype(at::kFloat));
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "sample_rows", [&] {
    const scalar_t* in = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(vocab), weight;  // weight: filled for a row that draws
      for (int64_t r = begin; r < end; ++r) {
        to_float(in + r * vocab, row.data(), vocab);
        const int64_t best = first_argmax_of(row.data(), vocab);
        const float top = row[best];
        const float raw_sum = exp_sum(row.data(), vocab, top);
        int64_t id = best;
        // A NaN logit (first_argmax_of's pick, as torch.argmax's) makes the sum and the
        // logprob NaN: nothing is drawn then.
        if (!std::isnan(raw_sum) && temperatures && temperatures[r] > 0.0f) {
          const float inverse = 1.0f / temperatures[r];
          weight.resize(vocab);
          for (int64_t i = 0; i < vocab; ++i) weight[i] = fast_exp((row[i] - top) * inverse);
          double total = 0.0;
          for (int64_t i = 0; i < vocab; ++i) total += weight[i];
          // (1 - u) <= 1, so reach <= total: the scan, adding in the same order, reaches it,
          // at a weight above 0 (reach > 0, as the largest logit's weight is 1).
          const double reach = (1.0 - uniforms[r]) * total;
          double sum = 0.0;
          for (int64_t i = 0; i < vocab; ++i) {
            sum += weight[i];
            if (sum >= reach) {
              id = i;
              break;
            }
          }
        }
        ip[r] = id;
        lp[r] = (row[id] - top) - std::log(raw_sum);
      }
    });
  });
  return {ids, logprobs};
}

}  // namespace

// logits [B, V]: each row's greedy id [B] int64 (ties: the smallest, and a NaN the pick, as
// torch.argmax). No logprob: a row that asks for one takes torch's path (sampler.py).
at::Tensor greedy_ids(const at::Tensor& logits_in) {
  check_dtype("greedy_ids", logits_in);
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0,
              "greedy_ids: logits ", logits_in.sizes(), " are not [B, V]");
  TORCH_CHECK(logits_in.size(1) <= std::numeric_limits<int32_t>::max(), "greedy_ids: a ",
              "vocabulary of ", logits_in.size(1), " ids is beyond 32-bit positions");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ip = ids.data_ptr<int64_t>();
  const auto run = [&](auto type) {
    using T = decltype(type);
    const T* in = logits.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) ip[r] = first_argmax_of(in + r * vocab, vocab);
    });
  };
  logits.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return ids;
}

// logits [B, V]; temperatures [B] float32, 0 for a greedy row; uniforms [B] float64 in
// [0, 1). Each row's id [B] int64 drawn from softmax(logits / temperature) (a weight of 0 is
// never drawn), or its greedy id (greedy_ids'); with its logprob [B] float32.
std::tuple<at::Tensor, at::Tensor> random_sample(const at::Tensor& logits,
                                                 const at::Tensor& temperatures,
                                                 const at::Tensor& uniforms) {
  return sample_rows("random_sample", logits, temperatures, uniforms);
}

}  // namespace loom_cpu
