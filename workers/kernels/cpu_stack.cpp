// A step's whole decoder stack in one call on the CPU (loomllm's Llama family), so that no
// Python runs between its ops; and the registration of every op as torch.ops.loom_cpu.

#include <torch/library.h>

#include "cpu_ops.h"

namespace loom_cpu {
namespace {

// Which kernel a linear layer runs this step (the Python side picks it for the step's rows):
// its tensors are (weight, -) for DENSE, (packed, scales and zeros) for INT4, (codes, scales)
// for INT8, (packed blocks, their scales) for A8, (-, -) for GGUF, whose parts are in the
// gguf lists; then its bias, if any.
enum LinearMode : int64_t { DENSE = 0, INT4 = 1, INT8 = 2, A8 = 3, GGUF = 4 };
constexpr int64_t INT4_GROUP = 32;
constexpr int64_t TENSORS_PER_LINEAR = 3;
// A layer: its two norms' weights, q's and k's norms' (Qwen3; else none), then q|k|v, o,
// gate|up and down.
constexpr int64_t NORMS = 4;
constexpr int64_t TENSORS_PER_LAYER = NORMS + 4 * TENSORS_PER_LINEAR;

at::Tensor need(const c10::List<std::optional<at::Tensor>>& weights, int64_t i) {
  const std::optional<at::Tensor> t = weights.get(i);
  TORCH_CHECK(t.has_value(), "decode_layers: weight ", i, " is missing");
  return *t;
}

// A GGUF layer's parts: its blocks' tensors, their types and rotary heads (cpu_gguf_linear.cpp).
struct GgufParts {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> types, heads;
  int64_t kernel = 0;  // gguf_linear's
};

// With `gated`, x is the MLP's gate|up and the layer takes silu(gate) * up: the a8 and GGUF
// kernels quantize the product as they compute it, the others take silu_mul's.
at::Tensor linear(const at::Tensor& x, int64_t mode,
                  const c10::List<std::optional<at::Tensor>>& weights, int64_t first,
                  const GgufParts* gguf, bool gated = false) {
  if (mode == GGUF) {
    TORCH_CHECK(gguf != nullptr, "decode_layers: a GGUF layer without parts");
    const std::optional<at::Tensor> bias = weights.get(first + 2);
    return gated ? silu_gguf_linear(x, gguf->weights, gguf->types, gguf->heads, bias, gguf->kernel)
                 : gguf_linear(x, gguf->weights, gguf->types, gguf->heads, bias, gguf->kernel);
  }
  const at::Tensor a = need(weights, first);
  const std::optional<at::Tensor> bias = weights.get(first + 2);
  const auto input = [&] { return gated ? silu_mul(x) : x; };
  at::Tensor out;
  switch (mode) {
    case DENSE:
      return at::linear(input(), a, bias);
    case INT4:
      out = at::_weight_int4pack_mm_for_cpu(input(), a, INT4_GROUP, need(weights, first + 1));
      break;
    case INT8:
      out = at::_weight_int8pack_mm(input(), a, need(weights, first + 1));
      break;
    case A8: {  // a group of 32 inputs packs into 64 bytes per bit of its codes
      const int64_t bits = a.size(-1) / 64;
      const at::Tensor scales = need(weights, first + 1);
      return gated ? silu_block_linear(x, a, scales, bias, bits, false)
                   : block_linear(x, a, scales, bias, bits, false);
    }
    default:
      TORCH_CHECK(false, "decode_layers: linear mode ", mode, " is none of 0, 1, 2, 3, 4");
  }
  return bias.has_value() ? out.add_(*bias) : out;
}

}  // namespace

// hidden [T, size]: the step's embeddings. Without prompts, token i is decode row i; with
// them (prefill_slots and the rest, as prefill_attention takes them), the decode rows are the
// tokens decode_rows names. Each layer as loomllm's DecoderLayer computes it, with the ops of
// cpu_ops.cpp and the attention kernels: (the last layer's MLP output, the residual stream
// before it), whose add the final norm does.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const c10::List<std::optional<at::Tensor>>& weights,
    at::IntArrayRef modes, at::TensorList k_caches, at::TensorList v_caches, double eps,
    int64_t heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& decode_slots,
    const at::Tensor& decode_lens, double scale, int64_t window,
    const std::optional<at::Tensor>& decode_rows, const std::optional<at::Tensor>& prefill_slots,
    const std::optional<at::Tensor>& prefill_lens,
    const std::optional<at::Tensor>& prefill_q_starts,
    const std::optional<at::Tensor>& prefill_q_lens, at::TensorList gguf_weights,
    at::IntArrayRef gguf_types, at::IntArrayRef gguf_heads, at::IntArrayRef gguf_counts,
    int64_t gguf_kernel) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(hidden_in.dim() == 2, "decode_layers: hidden ", hidden_in.sizes(), " is not [T, size]");
  TORCH_CHECK(v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(weights.size()) == layers * TENSORS_PER_LAYER &&
                  static_cast<int64_t>(modes.size()) == layers * 4,
              "decode_layers: ", layers, " layers' caches, ", weights.size(), " weights and ",
              modes.size(), " modes");
  // Each GGUF layer's parts, in the order of the modes: gguf_counts[j] parts for the j-th.
  std::vector<GgufParts> parts(modes.size());
  TORCH_CHECK(gguf_types.size() == gguf_weights.size() && gguf_heads.size() == gguf_weights.size(),
              "decode_layers: ", gguf_weights.size(), " GGUF parts, ", gguf_types.size(),
              " types and ", gguf_heads.size(), " head counts");
  size_t next_part = 0, next_count = 0;
  for (size_t i = 0; i < modes.size(); ++i) {
    if (modes[i] != GGUF) continue;
    TORCH_CHECK(next_count < gguf_counts.size(), "decode_layers: too few gguf_counts");
    const int64_t count = gguf_counts[next_count++];
    parts[i].kernel = gguf_kernel;
    TORCH_CHECK(count > 0 && next_part + count <= gguf_weights.size(),
                "decode_layers: too few GGUF parts");
    for (int64_t j = 0; j < count; ++j, ++next_part) {
      parts[i].weights.push_back(gguf_weights[next_part]);
      parts[i].types.push_back(gguf_types[next_part]);
      parts[i].heads.push_back(gguf_heads[next_part]);
    }
  }
  const bool prompts = prefill_slots.has_value();
  TORCH_CHECK(!prompts || (decode_rows.has_value() && prefill_lens.has_value() &&
                           prefill_q_starts.has_value() && prefill_q_lens.has_value()),
              "decode_layers: prefill_slots without decode_rows, prefill_lens, prefill_q_starts "
              "and prefill_q_lens");
  const at::Tensor rows = prompts ? decode_rows->to(at::kLong) : at::Tensor();
  const int64_t tokens = hidden_in.size(0), q_size = heads * head_dim;
  const int64_t kv_size = kv_heads * head_dim;
  at::Tensor hidden = hidden_in.contiguous(), residual;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t w = l * TENSORS_PER_LAYER;
    const int64_t* mode = modes.data() + l * 4;
    const GgufParts* part = parts.data() + l * 4;
    at::Tensor x;
    if (l == 0) {
      residual = hidden;
      x = rms_norm(hidden, need(weights, w), eps);
    } else {
      std::tie(x, residual) = add_rms_norm(hidden, residual, need(weights, w), eps);
    }
    const at::Tensor qkv = linear(x, mode[0], weights, w + NORMS, part);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
    if (weights.get(w + 2).has_value()) {  // Qwen3: an RMSNorm over each head of q and k
      q = rms_norm(q, need(weights, w + 2), eps);
      k = rms_norm(k, need(weights, w + 3), eps);
    }
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
    const at::Tensor rotated = rotary_into_cache(q, k, v, cos, sin, k_caches[l], v_caches[l], slots);
    // Every layer reads the same slots: checked at the first, against caches of one size.
    TORCH_CHECK(k_caches[l].size(0) == k_caches[0].size(0), "decode_layers: layer ", l,
                "'s cache has ", k_caches[l].size(0), " slots, the first's ", k_caches[0].size(0));
    at::Tensor attended;
    if (!prompts) {
      attended = decode_attention_rows(rotated, k_caches[l], v_caches[l], decode_slots,
                                       decode_lens, scale, window, 0.0, std::nullopt, l == 0);
    } else {
      attended = prefill_attention(rotated, k_caches[l], v_caches[l], *prefill_slots,
                                   *prefill_lens, *prefill_q_starts, *prefill_q_lens, scale,
                                   window, 0.0, std::nullopt);
      if (rows.numel() > 0) {
        attended.index_copy_(
            0, rows,
            decode_attention_rows(rotated.index_select(0, rows), k_caches[l], v_caches[l],
                                  decode_slots, decode_lens, scale, window, 0.0, std::nullopt,
                                  l == 0));
      }
    }
    const at::Tensor o = linear(attended.view({tokens, q_size}), mode[1], weights,
                                w + NORMS + TENSORS_PER_LINEAR, part + 1);
    std::tie(x, residual) = add_rms_norm(o, residual, need(weights, w + 1), eps);
    const at::Tensor gate_up =
        linear(x, mode[2], weights, w + NORMS + 2 * TENSORS_PER_LINEAR, part + 2);
    hidden = linear(gate_up, mode[3], weights, w + NORMS + 3 * TENSORS_PER_LINEAR, part + 3, true);
  }
  return {hidden, residual};
}

}  // namespace loom_cpu

TORCH_LIBRARY(loom_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rotary_into_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, "
      "float scale, int window, float softcap, Tensor? sinks) -> Tensor");
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, "
      "Tensor q_starts, Tensor q_lens, float scale, int window, float softcap, Tensor? sinks) "
      "-> Tensor");
  m.def(
      "decode_layers(Tensor hidden, Tensor?[] weights, int[] modes, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, float eps, int heads, int kv_heads, int head_dim, Tensor cos, "
      "Tensor sin, Tensor slots, Tensor decode_slots, Tensor decode_lens, float scale, "
      "int window, Tensor? decode_rows=None, Tensor? prefill_slots=None, "
      "Tensor? prefill_lens=None, Tensor? prefill_q_starts=None, Tensor? prefill_q_lens=None, "
      "Tensor[] gguf_weights, int[] gguf_types, int[] gguf_heads, int[] gguf_counts, "
      "int gguf_kernel=0) -> (Tensor, Tensor)");
  m.def("greedy_ids(Tensor logits) -> Tensor");
  m.def("random_sample(Tensor logits, Tensor temperatures, Tensor uniforms) -> (Tensor, Tensor)");
  m.def(
      "block_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int bits, "
      "bool portable_only) -> Tensor");
  m.def(
      "silu_block_linear(Tensor gate_up, Tensor packed, Tensor scales, Tensor? bias, int bits, "
      "bool portable_only) -> Tensor");
  m.def("block_linear_has_vnni() -> bool", &loom_cpu::block_linear_has_vnni);
  m.def(
      "gguf_linear(Tensor x, Tensor[] weights, int[] types, int[] heads, Tensor? bias, "
      "int kernel) -> Tensor");
  m.def(
      "silu_gguf_linear(Tensor gate_up, Tensor[] weights, int[] types, int[] heads, Tensor? bias, "
      "int kernel) -> Tensor");
  m.def(
      "gguf_dequantize(Tensor weight, int type, int k, Tensor? rows, ScalarType dtype) -> Tensor");
  m.def("read_bytes(Tensor[] tensors) -> int", &loom_cpu::read_bytes);
}

TORCH_LIBRARY_IMPL(loom_cpu, CPU, m) {
  m.impl("rms_norm", &loom_cpu::rms_norm);
  m.impl("add_rms_norm", &loom_cpu::add_rms_norm);
  m.impl("silu_mul", &loom_cpu::silu_mul);
  m.impl("rotary_into_cache", &loom_cpu::rotary_into_cache);
  m.impl("decode_attention", &loom_cpu::decode_attention);
  m.impl("prefill_attention", &loom_cpu::prefill_attention);
  m.impl("decode_layers", &loom_cpu::decode_layers);
  m.impl("greedy_ids", &loom_cpu::greedy_ids);
  m.impl("random_sample", &loom_cpu::random_sample);
  m.impl("block_linear", &loom_cpu::block_linear);
  m.impl("silu_block_linear", &loom_cpu::silu_block_linear);
  m.impl("gguf_linear", &loom_cpu::gguf_linear);
  m.impl("silu_gguf_linear", &loom_cpu::silu_gguf_linear);
  m.impl("gguf_dequantize", &loom_cpu::gguf_dequantize);
}

