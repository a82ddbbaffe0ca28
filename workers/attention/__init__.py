"""Paged attention: the step's metadata, the torch backend, and the Triton kernels."""
