"""Token sampling: temperature, top-k, top-p, min-p; greedy at temperature 0.

The rows of a step are sampled together (`sample_rows`): on the logits' device, each row's
argmax, or its top-k candidates after temperature and softmax; then one copy to the host, which
is the step's one wait for the GPU. Top-p, min-p and the draw run on the host over those k
candidates, not over the vocabulary (only top_k=0 sorts and copies whole rows). Each row draws
from its own generator, so a seed gives the same tokens whatever else is in the batch.

Legend: B rows, V vocab, k candidates a row (the largest top_k among the rows; V with top_k=0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from strata.errors import StrataError
from strata.runtime.waits import to_device, to_host


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


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from logits [V] (float32); see sample_rows."""
    return sample_rows(logits.view(1, -1), [p], [gen])[0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                gens: Sequence[torch.Generator | None]) -> list[int]:
    """One token id from each row of logits [B, V] (float32), row i with params[i] and gens[i].
    What comes back from the device comes in one bounded wait (to_host): with the decode step
    queued without host syncs, this is where the host waits for the GPU's work on a step."""
    V = logits.shape[-1]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    groups = [g for g in ([i for i in hot if 0 < params[i].top_k < V],  # [len, top_k]
                          [i for i in hot if not 0 < params[i].top_k < V]) if g]  # [len, V]
    parts = [torch.argmax(_rows(logits, greedy), dim=-1)] if greedy else []  # [len(greedy)]
    for rows in groups:
        parts += _candidates(_rows(logits, rows), [params[i] for i in rows])  # vals, ids
    # one copy (float64 holds the float32 probabilities and the ids exactly), then apart again
    host = to_host(torch.cat([t.double().flatten() for t in parts]), "the sampled tokens")
    pieces = iter(np.split(host.numpy(), np.cumsum([t.numel() for t in parts])[:-1]))
    out = [0] * len(params)
    for i, token in zip(greedy, next(pieces) if greedy else [], strict=True):
        out[i] = int(token)
    for rows in groups:
        vals = next(pieces).astype(np.float32).reshape(len(rows), -1)
        ids = next(pieces).astype(np.int64).reshape(len(rows), -1)
        if vals.shape[1] < V:
            vals, ids = _by_rank(vals, ids)
        tokens = _draw(vals, ids, [params[i] for i in rows], [gens[i] for i in rows])
        for i, token in zip(rows, tokens, strict=True):
            out[i] = token
    return out


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from at temperature > 0, over the whole vocabulary: [V]
    float32 on the host, zero outside what temperature, top-k, top-p and min-p keep, summing to
    1 (a verify window's rejection sampling, strata.engine.spec, needs it whole)."""
    V = logits.shape[-1]
    vals, ids = _candidates(logits.view(1, -1), [p])
    host = to_host(torch.cat([vals.double(), ids.double()], 1), "the sampling probabilities")
    vals, ids = host[:, : vals.shape[1]].float().numpy(), host[:, vals.shape[1]:].long().numpy()
    if vals.shape[1] < V:
        vals, ids = _by_rank(vals, ids)
    kept = np.where(_kept(vals, [p]), vals, np.float32(0))[0]
    out = np.zeros(V, np.float32)
    out[ids[0]] = kept / kept.sum()
    return torch.from_numpy(out)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Some rows of logits [B, V]. (Stacked views: an index list would be copied to the device,
    and a plain host-to-device copy waits for the GPU.)"""
    if len(rows) == logits.shape[0]:
        return logits
    return torch.stack([logits[i] for i in rows])


def _candidates(logits: torch.Tensor, params: list[SamplingParams]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's tempered probabilities, the k largest in descending order, and their ids:
    ([B, k], [B, k]) on the logits' device; k the largest top_k of the rows (V where one is 0:
    then every row whole, sorted stably, so that equal ones come lower id first)."""
    V = logits.shape[-1]
    x, inv = logits.float(), {1 / p.temperature for p in params}
    if len(inv) > 1:  # (a product, as with one temperature: a row's bits do not depend on B)
        x = x * to_device(torch.tensor([[1 / p.temperature] for p in params]), logits.device)
    elif inv != {1.0}:
        x = x * inv.pop()
    probs = torch.softmax(x, dim=-1)  # [B, V]
    k = max(p.top_k if 0 < p.top_k < V else V for p in params)
    if k < V:
        return torch.topk(probs, k, dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True)


def _by_rank(vals: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's candidates [B, k] in descending order, equal ones lower id first (torch.topk
    promises no order among ties, and its kernel may differ with the number of rows)."""
    order = np.lexsort((ids, -vals), axis=-1)
    return np.take_along_axis(vals, order, -1), np.take_along_axis(ids, order, -1)


def _kept(vals: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Which of each row's probabilities vals [B, k] (descending) top-k, top-p and min-p keep:
    bool [B, k], the first of a row always."""
    k = vals.shape[1]
    keep = np.arange(k) < np.array([[p.top_k or k] for p in params])
    top_p = np.array([[p.top_p] for p in params], np.float32)
    if (top_p < 1).any():  # the mass of the tokens ranked above each (summed in float64)
        before = np.cumsum(vals, axis=1, dtype=np.float64).astype(np.float32) - vals
        keep &= (before < top_p) | (top_p == 1)
    min_p = np.array([[p.min_p] for p in params], np.float32)
    if min_p.any():
        keep &= vals >= min_p * vals[:, :1]
    keep[:, 0] = True
    return keep


def _draw(vals: np.ndarray, ids: np.ndarray, params: list[SamplingParams],
          gens: list[torch.Generator | None]) -> list[int]:
    """One of each row's candidates (probabilities vals [B, k], descending, and their ids), in
    proportion to its probability among those kept: argmax(p_i / q_i) with q_i ~ Exp(1), the
    exponential race of torch.multinomial's single draw, over the ranks up to the row's last
    kept one, drawn from the row's generator. (So the first token of a seed is the one a
    multinomial over the whole sorted row draws.)"""
    if not np.isfinite(vals).all():
        raise RuntimeError("sampling: the logits hold inf or NaN")
    keep = _kept(vals, params)
    ranked = np.where(keep, vals, np.float32(0))
    ends = vals.shape[1] - np.argmax(keep[:, ::-1], axis=1)  # [B] past each row's last kept
    out = []
    for row, n, gen in zip(range(len(vals)), ends.tolist(), gens, strict=True):
        q = torch.empty(n).exponential_(generator=gen).numpy()
        out.append(int(ids[row, np.argmax(ranked[row, :n] / q)]))
    return out
