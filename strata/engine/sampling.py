"""Token sampling: temperature, top-k, top-p, min-p; greedy at temperature 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import StrataError
from strata.runtime.waits import to_host


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 turns it off)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.max_tokens >= 0, "max_tokens", "must be >= 0"),
        ]
        for ok, field, why in checks:
            if not ok:
                raise StrataError(f"{field}={getattr(self, field)}: {why}")


def _kept(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tempered probabilities sorted descending, zero where top-k, top-p and min-p drop
    them (the top token always kept), and their token ids: ([V], [V])."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    probs, ids = torch.sort(probs, descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k:
        keep[p.top_k:] = False
    if p.top_p < 1:
        before = torch.cumsum(probs, 0) - probs  # mass of the tokens ranked above each
        keep &= before < p.top_p
    if p.min_p:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    return torch.where(keep, probs, 0), ids


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from logits [V] (float32). What comes back from the device comes through a
    bounded wait (to_host): with the decode step and prompt chunks queued without host syncs,
    this is where the host waits for the GPU's work on a token."""
    if p.temperature == 0:
        return int(to_host(torch.argmax(logits).view(1), "the next token (argmax)")[0])
    probs, ids = _kept(logits, p)
    host = to_host(probs, "the sampling probabilities")
    choice = int(torch.multinomial(host, 1, generator=gen)[0])
    return int(to_host(ids[choice:choice + 1], "the sampled token id")[0])


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from at temperature > 0, over the whole vocabulary: [V]
    float32 on the host, zero outside what temperature, top-k, top-p and min-p keep, summing to
    1 (a verify window's rejection sampling, strata.engine.spec, needs it whole)."""
    probs, ids = _kept(logits, p)
    out = torch.zeros_like(probs).scatter_(0, ids, probs / probs.sum())
    return to_host(out, "the sampling probabilities")
