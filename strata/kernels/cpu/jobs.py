"""What a CPU expert backend is given, the interface it implements, and the float32 reference.

Legend: T tokens in the step, D hidden size, F expert hidden size, n tokens routed to one expert,
N = Σ n rows over a call's jobs.

One call computes one layer's missed experts:  out[t] += Σ_jobs weight * expert(h[t]) for the
tokens t routed to each job, where expert(x) = down(silu(gate x) * up x).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from strata.kernels.torch_ops import expert_mlp, swiglu
from strata.quant import dequantize, row_nbytes

Raw = np.ndarray | torch.Tensor  # uint8 [rows, row_nbytes], C-contiguous, on the host


@dataclass
class ExpertJob:
    """One expert to run on the CPU, and the tokens routed to it."""

    gate: Raw  # uint8 [F, row_nbytes(qtypes[0], D)]: a view into the arena, no copy
    up: Raw  # uint8 [F, row_nbytes(qtypes[1], D)]
    down: Raw  # uint8 [D, row_nbytes(qtypes[2], F)]
    qtypes: tuple[int, int, int]  # GGML types of gate, up, down
    tokens: torch.Tensor  # int64 [n]: rows of h routed to this expert
    weights: torch.Tensor  # float32 [n]: their routing weights
    # gpt-oss: the expert's biases (float32 gate [F], up [F], down [D]) and its activation
    # ("swiglu_oai", torch_ops.glu); None: down(silu(gate x) * up x)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    act: str = "swiglu"

    @property
    def d_expert(self) -> int:
        return int(self.gate.shape[0])

    def signature(self) -> tuple[tuple[int, int, int], int, str]:
        """(qtypes, F, activation): jobs that share it can share one kernel launch."""
        return self.qtypes, self.d_expert, self.act


class CpuExperts(Protocol):
    """A CPU backend for the miss path. One instance per calling thread (not thread-safe)."""

    name: str

    def run(self, h: torch.Tensor, jobs: list[ExpertJob], out: torch.Tensor) -> None:
        """out[T, D] += Σ_j jobs[j].weights * expert_j(h[jobs[j].tokens]). h: float32 [T, D]."""
        ...

    def close(self) -> None:
        """Release native resources (thread pools, graphs). Safe to call twice."""
        ...


def as_tensor(raw: Raw) -> torch.Tensor:
    """A torch view of the raw bytes (no copy)."""
    return raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw)


def check_call(h: torch.Tensor, jobs: list[ExpertJob], out: torch.Tensor) -> None:
    """Shapes, dtypes and layouts a backend relies on; ValueError naming what is wrong.
    Runs on every call, so it is kept to a few attribute reads per job (~2 us)."""
    if h.dtype != torch.float32 or h.dim() != 2 or not h.is_cpu:
        raise ValueError(f"h must be a float32 [T, D] CPU tensor, got {h.dtype} {tuple(h.shape)}")
    if out.shape != h.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {tuple(h.shape)} tensor")
    d_model = h.shape[1]
    for i, job in enumerate(jobs):
        want = expected_shapes(job.qtypes, job.d_expert, d_model)
        if (job.gate.shape != want[0] or job.up.shape != want[1] or job.down.shape != want[2]
                or not (_host_bytes(job.gate) and _host_bytes(job.up) and _host_bytes(job.down))):
            raws = (job.gate, job.up, job.down)
            for name, raw, shape in zip(("gate", "up", "down"), raws, want, strict=True):
                if raw.shape != shape or not _host_bytes(raw):
                    raise ValueError(f"job {i}: {name} must be C-contiguous host uint8 {shape}, "
                                     f"got {raw.dtype} {tuple(raw.shape)}")
        if job.tokens.shape != job.weights.shape or job.tokens.dim() != 1:
            raise ValueError(f"job {i}: tokens and weights must be 1-D of one length")


@functools.lru_cache(maxsize=256)
def expected_shapes(qtypes: tuple[int, int, int], d_expert: int,
                    d_model: int) -> tuple[tuple[int, int], ...]:
    """(gate, up, down) raw shapes: [F, row_nbytes(D)] x 2, [D, row_nbytes(F)]."""
    f, d = d_expert, d_model
    return ((f, row_nbytes(qtypes[0], d)), (f, row_nbytes(qtypes[1], d)),
            (d, row_nbytes(qtypes[2], f)))


def _host_bytes(raw: Raw) -> bool:
    if isinstance(raw, torch.Tensor):
        return raw.dtype is torch.uint8 and raw.is_cpu and raw.is_contiguous()
    return raw.dtype == np.uint8 and raw.flags.c_contiguous


def reference_run(h: torch.Tensor, jobs: list[ExpertJob], out: torch.Tensor) -> None:
    """Ground truth: each job's weights dequantized to float32, swiglu, weighted, accumulated."""
    d_model = h.shape[1]
    for job in jobs:
        f = job.d_expert
        qg, qu, qd = job.qtypes
        w_gate = dequantize(as_tensor(job.gate), qg, d_model)  # [F, D]
        w_up = dequantize(as_tensor(job.up), qu, d_model)  # [F, D]
        w_down = dequantize(as_tensor(job.down), qd, f)  # [D, F]
        if job.bias is None:
            y = swiglu(h[job.tokens], w_gate, w_up, w_down)  # [n, D]
        else:
            y = expert_mlp(h[job.tokens], w_gate, w_up, w_down, *job.bias, job.act)
        out.index_add_(0, job.tokens, y * job.weights[:, None])
