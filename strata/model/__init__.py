"""Architectures (qwen3moe, qwen2moe, Mixtral-style llama, qwen35moe, qwen3next) built from
shared layers."""
