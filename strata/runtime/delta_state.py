"""Per-sequence recurrent state of the Gated DeltaNet layers (hybrid models), beside the KV cache
of their full-attention layers (KVCache.state, made with it by MoETransformer.new_cache).

    conv  [L, K-1, C]      the last K-1 inputs of each linear layer's causal conv (zeros at first:
                           the conv's left padding), C = 2*Hk*dk + Hv*dv
    ssm   [L, Hv, dk, dv]  each layer's delta-rule state S (o = S^T q)

Float32 always: the state carries the whole prefix, rounding it would compound. Unlike keys
and values it cannot be cut back to a shorter prefix: KVCache.truncate below its length resets
both. From a KVPool (the decode step's) its storage keeps one address for the captured graphs.

A verify window (strata.engine.spec) rolls it back to its last accepted token: open_window keeps
the state after each of the window's n tokens (WindowStates: n x the state, counted by the
memory plan beside --spec), the window's forward writes them (the Gated DeltaNet layers run the
recurrent rule over a window, token by token as decode does), and KVCache.rollback(length) copies
the one after token length-1 back. Keeping every token's state costs memory; the other way, a
snapshot before the window and a re-run of the accepted tokens, would cost a second forward of
the whole model (every expert read again) for each window with a rejected draft.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from strata.config import ModelConfig


@dataclass
class WindowStates:
    """The state after each token of a verify window from position `start`."""

    start: int
    conv: torch.Tensor  # [n, L, K-1, C]
    ssm: torch.Tensor  # [n, L, Hv, dk, dv]

    @property
    def tokens(self) -> int:
        return self.conv.shape[0]


class DeltaState:
    def __init__(self, cfg: ModelConfig, device: torch.device, pool=None,  # noqa: ANN001
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None,
                 window_tokens: int = 0):
        """storage: (conv, ssm) to hold the state in (a slot of a KVSlots pool), reset.
        window_tokens: the most tokens of a verify window whose forward may replay a CUDA graph
        (ChunkGraphs.windows; 0: none): the per-token states of every window are kept in
        storage of that many tokens, taken from `pool` where there is one, so that no window
        size's graph sees them move, within this state or from one request's to the next's."""
        self._pool, self.window_tokens = pool, window_tokens
        n = cfg.n_layers - cfg.n_kv_layers
        shapes = ((n, cfg.ssm_conv - 1, cfg.conv_channels),
                  (n, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_state))
        if storage is not None:
            self.conv, self.ssm = storage
            if (tuple(self.conv.shape), tuple(self.ssm.shape)) != shapes:
                raise ValueError(f"recurrent state storage {tuple(self.conv.shape)}, "
                                 f"{tuple(self.ssm.shape)}: the model needs {shapes}")
            self.reset()
        elif pool is None:
            self.conv, self.ssm = (torch.zeros(s, device=device) for s in shapes)
        else:
            self.conv, self.ssm = self._taken(shapes, device)
            self.reset()
        self.window: WindowStates | None = None  # the last verify window's per-token states
        self.recording = False  # True during that window's forward: the layers write them
        self._spare: tuple[torch.Tensor, torch.Tensor] | None = None  # (reused storage)

    def _taken(self, shapes: tuple[tuple[int, ...], ...],
               device: torch.device) -> tuple[torch.Tensor, ...]:
        """Storage of these shapes from the pool, each given back when this state goes."""
        out = tuple(self._pool.take(s, device) for s in shapes)
        for t in out:
            weakref.finalize(self, self._pool.give, t)
        return out

    def reset(self) -> None:
        """Back to the state before any token."""
        self.conv.zero_()
        self.ssm.zero_()
        self.window = None

    def open_window(self, start: int, tokens: int) -> None:
        """The next forward is a verify window of `tokens` tokens from position `start`: keep
        the state after each of them (until stop_recording)."""
        if self._spare is None or self._spare[0].shape[0] < tokens:
            n = max(tokens, self.window_tokens)
            shapes = ((n, *self.conv.shape), (n, *self.ssm.shape))
            if self._pool is None:
                self._spare = tuple(torch.empty(s, device=self.conv.device) for s in shapes)
            else:  # (a storage this state outgrew goes back to the pool with the state)
                self._spare = self._taken(shapes, self.conv.device)
        self.window = WindowStates(start, self._spare[0][:tokens], self._spare[1][:tokens])
        self.recording = True

    def stop_recording(self) -> None:
        self.recording = False

    def moved(self) -> None:
        """Tokens past the window went in (a plain step): its states no longer apply."""
        if not self.recording:
            self.window = None

    def restore(self, length: int) -> bool:
        """The state after `length` tokens, from the last window if it covers that length
        (start < length <= start + n); False when it does not (nothing changed)."""
        w = self.window
        if w is None or not w.start < length <= w.start + w.tokens:
            return False
        self.conv.copy_(w.conv[length - w.start - 1])
        self.ssm.copy_(w.ssm[length - w.start - 1])
        return True

    @property
    def nbytes(self) -> int:
        return 4 * (self.conv.numel() + self.ssm.numel())
