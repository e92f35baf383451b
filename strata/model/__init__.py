"""Architectures (qwen3moe, qwen2moe, Mixtral-style llama) built from shared layers."""
