"""Strata: Mixture-of-Experts GGUF models larger than the GPU, on one machine."""

__version__ = "0.1.0"
