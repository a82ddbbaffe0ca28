"""The allowed values of the options an engine hands its workers, stated once: the engine
validates with them, the workers' loader and runner check what reaches them, the CLI offers them.
"""

from __future__ import annotations

RUNNERS = ("generate", "pooling")
# "auto": on the CPU bfloat16 where it computes natively, else float32; on CUDA the
# checkpoint's 16-bit dtype, else bfloat16.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# A float32 model's linear weights stored in 16 bits; None: as the model is.
WEIGHT_DTYPES = ("bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# torch: the reference, and the CPU's backend; triton: attention/triton_kernels.py (CUDA);
# "auto": triton on CUDA, torch elsewhere.
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# "dummy": random weights from the config, on the device (vLLM's, for benchmarks).
LOAD_FORMATS = ("auto", "dummy")
# "auto": loomllm's own Llama-family model where it runs the checkpoint, else transformers'
# modeling code; "loom": its own or an error; "transformers": transformers' (vLLM's option).
MODEL_IMPLS = ("auto", "loom", "transformers")
# Weight-only quantization on the CPU (vLLM's option name). None (not listed): a GGUF file
# runs as it is stored, on the CPU; "none": dequantized; "int8" / "int4": a float checkpoint
# quantized on load.
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
# The kernels that may run a layer quantized on load. a8: the weights' blocks against
# activations quantized to int8 (llama.cpp's arithmetic), on the C++ ops.
CPU_KERNEL_KINDS = ("dense", "int8", "int4", "a8")
# "auto" lets the measurement pick among those a layer's weights allow.
CPU_LINEAR_KERNELS = ("auto", *CPU_KERNEL_KINDS)
