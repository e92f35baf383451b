"""The torch CPU backend: dequantize a batch of experts (strata.quant), then batched matmuls.

Per signature (qtypes, F) the jobs are cut into batches whose float32 weights fit a budget. A
batch's gate and up bytes are joined expert by expert, [g1, u1, g2, u2, ...], so one dequantize
call and one matmul serve both. The join is a copy of the raw bytes (4-8x smaller than the
float32 it becomes); a single-job batch with gate and up of different types skips it.
Correct for every type strata.quant knows, but the dequantization makes it 10-50x slower than
ggml: it is the fallback.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as fn

from strata.kernels.cpu.jobs import ExpertJob, as_tensor, check_call
from strata.kernels.torch_ops import glu
from strata.kernels.tuning import TORCH_BATCH_BYTES
from strata.quant import dequantize


class TorchExperts:
    """CpuExperts by dequantize + matmul. `threads` sets torch's (process-wide) thread count."""

    name = "torch"

    def __init__(self, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()

    def run(self, h: torch.Tensor, jobs: list[ExpertJob], out: torch.Tensor) -> None:
        check_call(h, jobs, out)
        groups: dict[tuple, list[ExpertJob]] = defaultdict(list)
        for job in jobs:
            if job.tokens.numel():
                groups[job.signature()].append(job)
        d_model = h.shape[1]
        for (_, f, _), group in groups.items():
            per_job = 3 * f * d_model * 4
            step = max(1, TORCH_BATCH_BYTES // per_job)
            for i in range(0, len(group), step):
                self._run_batch(h, group[i:i + step], out)

    def close(self) -> None:
        pass

    def _run_batch(self, h: torch.Tensor, jobs: list[ExpertJob], out: torch.Tensor) -> None:
        k, f, d_model = len(jobs), jobs[0].d_expert, h.shape[1]
        qg, qu, qd = jobs[0].qtypes
        if qg == qu:  # one dequantize for gate and up: [k * 2F, row] -> [k, 2F, D]
            raw = torch.cat([as_tensor(r) for j in jobs for r in (j.gate, j.up)])
            w_gu = dequantize(raw, qg, d_model).view(k, 2 * f, d_model)
        else:
            w_g = _dequantize_stack([j.gate for j in jobs], qg, d_model)
            w_u = _dequantize_stack([j.up for j in jobs], qu, d_model)
            w_gu = torch.cat([w_g, w_u], dim=1)  # [k, 2F, D]
        w_down = _dequantize_stack([j.down for j in jobs], qd, f)  # [k, D, F]

        tokens = torch.cat([j.tokens for j in jobs])  # [N]
        weights = torch.cat([j.weights for j in jobs])  # [N]
        counts = [j.tokens.numel() for j in jobs]
        x = h.index_select(0, tokens)  # [N, D]
        if jobs[0].bias is not None:  # biases and their activation (gpt-oss), expert by expert
            ys = []
            for e, (j, xe) in enumerate(zip(jobs, torch.split(x, counts), strict=True)):
                bg, bu, bd = j.bias
                gu = xe @ w_gu[e].T  # [n, 2F]
                ys.append(glu(gu[:, :f] + bg, gu[:, f:] + bu, j.act) @ w_down[e].T + bd)
            y = torch.cat(ys)  # [N, D]
        elif all(c == counts[0] for c in counts):  # same n for every expert: batched matmuls
            gu = torch.bmm(x.view(k, counts[0], d_model), w_gu.transpose(1, 2))  # [k, n, 2F]
            a = fn.silu(gu[..., :f]) * gu[..., f:]  # [k, n, F]
            y = torch.bmm(a, w_down.transpose(1, 2)).view(-1, d_model)  # [N, D]
        else:
            ys = []
            for e, xe in enumerate(torch.split(x, counts)):
                gu = xe @ w_gu[e].T  # [n, 2F]
                ys.append((fn.silu(gu[:, :f]) * gu[:, f:]) @ w_down[e].T)  # [n, D]
            y = torch.cat(ys)
        out.index_add_(0, tokens, y.mul_(weights[:, None]))


def _dequantize_stack(raws: list, qtype: int, n_cols: int) -> torch.Tensor:
    """uint8 [rows, row_nbytes] x k -> float32 [k, rows, n_cols] (no join for one)."""
    if len(raws) == 1:
        return dequantize(as_tensor(raws[0]), qtype, n_cols)[None]
    return dequantize(torch.stack([as_tensor(r) for r in raws]), qtype, n_cols)
