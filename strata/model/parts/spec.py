"""Which parts a layer is built from, per layer index of an architecture (ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from strata.config import ModelConfig


@dataclass(frozen=True)
class LayerSpec:
    mixer: str = "gqa"  # layer.MIXERS: full grouped-query attention (gated, delta: hybrids)
    ffn: str = "routed"  # layer.FFNS: routed experts (a shared expert where the layer has one)


def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
    """The parts of layer `index`. Every architecture today: full GQA attention, routed experts
    (with a shared expert where the layer's weights have one). An architecture with dense first
    layers (deepseek2's leading_dense_block_count) gives ffn="dense" below that index, and
    ModelWeights.load reads their ffn_gate / ffn_up / ffn_down; one with sliding-window layers
    names their mixer per index here. Hybrid models (cfg.full_attn_interval): Gated DeltaNet
    layers ("delta"), gated full attention every interval-th ("gated")."""
    if cfg.arch == "gpt-oss":  # sinks on every layer, the window per index (arch.gpt_oss)
        return LayerSpec(mixer="sinks", ffn="routed_bias")
    if cfg.full_attn_interval:
        return LayerSpec(mixer="delta" if cfg.is_linear(index) else "gated")
    mixer = "mla" if cfg.kv_lora else "gqa"  # deepseek2: multi-head latent attention
    if index < cfg.n_dense_lead:  # glm4moe, deepseek2: leading_dense_block_count
        return LayerSpec(mixer, ffn="dense")
    return LayerSpec(mixer)
