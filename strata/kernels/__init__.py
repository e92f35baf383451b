"""Compute kernels: CPU (quantized matmul on host weights) and GPU, each beside its reference."""
