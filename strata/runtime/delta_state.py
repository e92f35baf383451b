"""Per-sequence recurrent state of the Gated DeltaNet layers (hybrid models), beside the KV cache
of their full-attention layers (KVCache.state, made with it by MoETransformer.new_cache).

    conv  [L, K-1, C]      the last K-1 inputs of each linear layer's causal conv (zeros at first:
                           the conv's left padding), C = 2*Hk*dk + Hv*dv
    ssm   [L, Hv, dk, dv]  each layer's delta-rule state S (o = S^T q)

Float32 always: the state carries the whole prefix, rounding it would compound. Unlike keys
and values it cannot be cut back to a shorter prefix: KVCache.truncate below its length resets
both. From a KVPool (the decode step's) its storage keeps one address for the captured graphs.
"""

from __future__ import annotations

import weakref

import torch

from strata.config import ModelConfig


class DeltaState:
    def __init__(self, cfg: ModelConfig, device: torch.device, pool=None):  # noqa: ANN001
        n = cfg.n_layers - cfg.n_kv_layers
        channels = (2 * cfg.ssm_groups + cfg.ssm_heads) * cfg.ssm_state
        shapes = ((n, cfg.ssm_conv - 1, channels),
                  (n, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_state))
        if pool is None:
            self.conv, self.ssm = (torch.zeros(s, device=device) for s in shapes)
        else:
            self.conv, self.ssm = (pool.take(s, device) for s in shapes)
            for t in (self.conv, self.ssm):
                weakref.finalize(self, pool.give, t)
            self.reset()

    def reset(self) -> None:
        """Back to the state before any token."""
        self.conv.zero_()
        self.ssm.zero_()

    @property
    def nbytes(self) -> int:
        return 4 * (self.conv.numel() + self.ssm.numel())
