// Greedy sampling on the CPU in two passes over each row of logits: the first largest logit's
// id, and its log-softmax, where torch's path copies the rows to float32 and makes four more.

#include "cpu_ops.h"

namespace loom_cpu {
namespace {

// The first id of the largest value in a float row (ties: the smallest id, as torch.argmax),
// through 16 lanes that each keep their own first best, merged at the end.
int64_t first_argmax(const float* x, int64_t n) {
  float best[16];
  int64_t where[16];
  std::fill(best, best + 16, -std::numeric_limits<float>::infinity());
  std::fill(where, where + 16, -1);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int u = 0; u < 16; ++u) {
      const bool better = x[i + u] > best[u];
      best[u] = better ? x[i + u] : best[u];
      where[u] = better ? i + u : where[u];
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
    top = x[0];
  }
  for (; i < n; ++i) {
    if (x[i] > top) {
      top = x[i];
      id = i;
    }
  }
  return id;
}

}  // namespace

// logits [B, V]: each row's greedy id [B] int64, and its logprob [B] float32 (the row's
// log_softmax there: minus the log of the sum of exp(logit - the largest)).
std::tuple<at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits_in) {
  check_dtype("greedy_sample", logits_in);
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "greedy_sample: logits ",
              logits_in.sizes(), " are not [B, V]");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({rows}, logits.options().dtype(at::kFloat));
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "greedy_sample", [&] {
    const scalar_t* in = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(vocab);
      for (int64_t r = begin; r < end; ++r) {
        to_float(in + r * vocab, row.data(), vocab);
        const int64_t id = first_argmax(row.data(), vocab);
        const float top = row[id];
        for (int64_t i = 0; i < vocab; ++i) row[i] = fast_exp(row[i] - top);
        const float sum = sum_of(row.data(), vocab);
        ip[r] = id;
        lp[r] = -std::log(sum);
        if (std::isnan(sum)) {  // a NaN logit is torch.argmax's pick, and the logprob NaN
          const scalar_t* x = in + r * vocab;
          for (int64_t j = 0; j < vocab; ++j) {
            if (std::isnan(f32(x[j]))) {
              ip[r] = j;
              break;
            }
          }
        }
      }
    });
  });
  return {ids, logprobs};
}

}  // namespace loom_cpu
