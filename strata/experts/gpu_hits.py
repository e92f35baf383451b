"""The GPU hit path on the fused Triton MoE kernels (strata.kernels.gpu): one launch pair per layer
computes every (token, expert) pair whose expert has a cache slot, reading the slot table on the
device. Layers whose types have no fused kernel keep the dequantize -> matmul path. Experts with
biases (gpt-oss: ExpertLayout.bias) are covered too: their biases are copied to the device once
here (per covered layer, rows by expert id) and every call passes them with the activation."""

from __future__ import annotations

import logging

import torch

from strata.experts.layout import ExpertLayout

log = logging.getLogger("strata.kernels")


def fused_kernels_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401

        import strata.kernels.gpu  # noqa: F401
    except ImportError as e:
        log.info("fused GPU kernels unavailable (%s): experts are dequantized, then multiplied", e)
        return False
    return True


class FusedHits:
    def __init__(self, layouts: list[ExpertLayout], device: torch.device,
                 max_t: int = 1 << 30, scratch_bytes: int | None = None, x8: bool = False):
        """max_t: the most tokens a call may have for the fused kernels (0: never);
        scratch_bytes: the prompt path's bf16 weight scratch (the memory plan's); x8: decode
        calls round activations to 8 bits for a Q4_K, IQ2_XS or IQ3_XXS gate/up and a Q4_K,
        Q6_K, IQ2_XS or IQ3_XXS down (moe_forward x8; --kernels fused)."""
        self.max_t, self.scratch_bytes, self.x8 = max_t, scratch_bytes, x8
        self.on = max_t > 0 and fused_kernels_available(device)
        self.covered = [False] * len(layouts)
        # layer -> its experts' (gate, up, down) biases on the device, float32 [E, F], [E, F],
        # [E, D], and their activation (covered layers with biases only)
        self.biases: dict[int, tuple[tuple[torch.Tensor, ...], str]] = {}
        if self.on:
            from strata.kernels.gpu import has_fused

            self.covered = [all(has_fused(q) for q in lay.qtypes) for lay in layouts]
            for lay, c in zip(layouts, self.covered, strict=True):
                b = lay.bias
                if c and b is not None:  # (copied before any call: a CUDA graph may hold it)
                    self.biases[lay.layer] = (tuple(
                        t.to(device, torch.float32).contiguous() for t in (b.gate, b.up, b.down)),
                        b.act)
            missing = [lay.layer for lay, c in zip(layouts, self.covered, strict=True) if not c]
            if missing:
                log.info("fused MoE kernels cover %d of %d layers; layers %s dequantize first",
                         len(layouts) - len(missing), len(layouts), missing[:8])

    def covers(self, layer: int, tokens: int) -> bool:
        return self.covered[layer] and tokens <= self.max_t

    def run(self, layout: ExpertLayout, slots: torch.Tensor, table: torch.Tensor,
            h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            out: torch.Tensor | None, miss: tuple[torch.Tensor, ...] | None = None,
            sum_pairs: bool = True, host_from: int | None = None,
            step: bool = False) -> torch.Tensor:
        """out += every resident pair's weighted expert output (out None: a new tensor).
        slots: uint8 [n, stride]. miss: views of rows holding each non-resident pair's record;
        sum_pairs=False: a decode call may return each pair's row unsummed; host_from: a
        token's missed pairs from there on are left to the host; step: a decode step's call (the
        per-pair kernels for a batch's tokens: moe_forward)."""
        from strata.kernels.gpu import moe_forward

        bias, act = None, "swiglu"
        if layout.bias is not None:
            if layout.layer not in self.biases:
                raise RuntimeError(f"layer {layout.layer}: its experts' biases are not on the "
                                   "device (a layer the fused kernels do not cover)")
            bias, act = self.biases[layout.layer]
        gate, up, down = layout.views(slots)
        return moe_forward(h, ids, weights.float(), table, gate, up, down, layout.qtypes,
                           layout.d_model, layout.d_expert, out=out,
                           scratch_bytes=self.scratch_bytes, miss=miss, sum_pairs=sum_pairs,
                           host_from=host_from, x8=self.x8, bias=bias, act=act, step=step)
