"""Triton kernels for the CUDA path, and the interpreter shim that runs them on a CPU."""
