"""Benchmarks: the machine's ceilings, and the engine's speed measured against them."""
