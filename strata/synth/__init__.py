"""Synthetic GGUF models for tests and benchmarks: real layouts, random weights."""
