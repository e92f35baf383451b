"""Sampling over a row's top-k candidates against the whole-vocabulary reference: softmax, a
stable sort of the row, the top-k / top-p / min-p masks, torch.multinomial over all V. The first
token of a seed is the reference's (its exponential race draws V values, the candidates' n the
same first n); rows sampled together are each as alone; equal probabilities rank by id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.engine.sampling import SamplingParams, probabilities, sample, sample_rows


def _reference(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept probabilities of the whole row, sorted (zero where dropped), and their ids: [V]."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    probs, ids = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k:
        keep[p.top_k:] = False
    if p.top_p < 1:
        keep &= torch.cumsum(probs, 0) - probs < p.top_p
    if p.min_p:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    return torch.where(keep, probs, 0), ids


def _reference_sample(logits: torch.Tensor, p: SamplingParams, seed: int) -> int:
    kept, ids = _reference(logits, p)
    return int(ids[torch.multinomial(kept, 1, generator=torch.Generator().manual_seed(seed))])


# temperatures whose reciprocal is exact, so the tempered logits are the reference's bits
PARAMS = [
    SamplingParams(1.0),  # the defaults: top_k 40, top_p 0.95
    SamplingParams(0.5, top_k=0, top_p=0.9),  # no top-k: the whole row sorted
    SamplingParams(2.0, top_k=7, top_p=1.0, min_p=0.05),
    SamplingParams(1.0, top_k=1000, top_p=0.5),  # top_k past a small vocabulary
    SamplingParams(0.25, top_k=3, top_p=0.2),  # top-p keeps the first only
]


@pytest.mark.parametrize("V", [7, 341, 151936])  # tiny, odd, the Qwen3 vocabulary
@pytest.mark.parametrize("p", PARAMS)
def test_first_token_of_a_seed_is_the_references(V, p):
    for seed in range(12):
        logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * (1 + seed % 4)
        got = sample(logits, p, torch.Generator().manual_seed(seed))
        assert got == _reference_sample(logits, p, seed), (V, p, seed)


@pytest.mark.parametrize("p", PARAMS)
def test_probabilities_are_the_references(p):
    logits = torch.randn(341, generator=torch.Generator().manual_seed(3)) * 2
    kept, ids = _reference(logits, p)
    want = torch.zeros(341).scatter_(0, ids, kept / kept.sum())
    got = probabilities(logits, p)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[want == 0].sum() == 0


def test_rows_together_are_each_alone():
    """Greedy, top-k, no top-k and mixed temperatures in one batch, over several steps (each
    row's generator advanced by its own draws only)."""
    V = 151936
    params = [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.7, top_k=0, top_p=0.8),
              SamplingParams(1.3, top_k=5), SamplingParams(1.0, min_p=0.1)]
    together = [torch.Generator().manual_seed(i) for i in range(len(params))]
    alone = [torch.Generator().manual_seed(i) for i in range(len(params))]
    for step in range(4):
        logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(step)) * 3
        got = sample_rows(logits, params, together)
        assert got == [sample(row, p, g) for row, p, g in zip(logits, params, alone, strict=True)]
        assert got[1] == int(logits[1].argmax())


def test_equal_probabilities_rank_by_id():
    """Ties inside the top-k come lower id first whatever order torch.topk gave them, as the
    reference's stable sort ranks them."""
    V, p = 100, SamplingParams(1.0, top_k=6, top_p=1.0)
    logits = torch.full((V,), -4.0)
    logits[[93, 5, 61, 17, 40]] = 3.0  # five equal leaders, ids out of order
    logits[70] = 2.0
    drawn = set()
    for seed in range(40):
        got = sample(logits, p, torch.Generator().manual_seed(seed))
        assert got == _reference_sample(logits, p, seed)
        drawn.add(got)
    assert drawn <= {93, 5, 61, 17, 40, 70} and len(drawn) > 3


def test_nan_logits_raise():
    logits = torch.randn(50)
    logits[3] = float("nan")
    with pytest.raises(RuntimeError, match="inf or NaN"):
        sample(logits, SamplingParams(1.0), torch.Generator().manual_seed(0))


def test_one_sample_draws_only_its_candidates():
    """A row's draw takes as many exponentials as ranks up to its last kept candidate, not V:
    the generator moves on by those alone."""
    V, p = 151936, SamplingParams(1.0, top_k=10, top_p=1.0)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(5)
    sample(logits, p, gen)
    after = torch.Generator().manual_seed(5)
    torch.empty(10).exponential_(generator=after)
    assert np.array_equal(gen.get_state().numpy(), after.get_state().numpy())
