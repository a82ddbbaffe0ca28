// The registration of loomllm's CPU ops as torch.ops.loom_cpu.

#include <torch/library.h>

#include "cpu_ops.h"

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
}

TORCH_LIBRARY_IMPL(loom_cpu, CPU, m) {
  m.impl("rms_norm", &loom_cpu::rms_norm);
  m.impl("add_rms_norm", &loom_cpu::add_rms_norm);
  m.impl("silu_mul", &loom_cpu::silu_mul);
  m.impl("rotary_into_cache", &loom_cpu::rotary_into_cache);
  m.impl("decode_attention", &loom_cpu::decode_attention);
}
