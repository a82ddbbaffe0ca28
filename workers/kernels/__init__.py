"""Kernels: Triton for the CUDA path (and its interpreter shim), quantized linears for the CPU."""
