"""Where one expert's bytes live, per layer, sized from that layer's real formats.

Every buffer that holds experts (the host arena, VRAM cache slots, staging buffers) stores an
expert as one packed record, so moving an expert is one contiguous copy:

    record = | gate [F, rowb(qg, D)] | up [F, rowb(qu, D)] | down [D, rowb(qd, F)] |

A mixed pack gives each layer its own record size: buffers are sized from the layer that will be
written into them, never from an assumed uniform format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.config import ModelConfig
from strata.gguf import ModelFile
from strata.quant import row_nbytes

_ALIGN = 256  # record start alignment: keeps every part of a record 16-byte aligned for kernels


@dataclass(frozen=True)
class ExpertLayout:
    """The packed record of one layer's experts."""

    layer: int
    qtypes: tuple[int, int, int]  # gate, up, down
    d_model: int
    d_expert: int  # 0: a layer without experts (a dense first layer): records of 0 bytes
    # the experts' biases and activation (weights.ExpertBias: gpt-oss), float32 on the host;
    # every path that computes from records adds them (compute.run_records); None: plain SwiGLU
    bias: object | None = field(default=None, compare=False)

    @property
    def empty(self) -> bool:
        return self.d_expert == 0

    @property
    def part_nbytes(self) -> tuple[int, int, int]:
        g, u, d = self.qtypes
        D, F = self.d_model, self.d_expert
        return F * row_nbytes(g, D), F * row_nbytes(u, D), D * row_nbytes(d, F)

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's data."""
        return sum(self.part_nbytes)

    @property
    def stride(self) -> int:
        """Bytes between records (nbytes rounded up to the alignment)."""
        return (self.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN

    def views(self, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up, down raw views of records: uint8 [..., stride] -> [..., rows, row_nbytes]."""
        g, u, d = self.part_nbytes
        lead = record.shape[:-1]
        D, F = self.d_model, self.d_expert
        return (record[..., :g].reshape(*lead, F, g // F),
                record[..., g:g + u].reshape(*lead, F, u // F),
                record[..., g + u:g + u + d].reshape(*lead, D, d // D))


def expert_layouts(mf: ModelFile, cfg: ModelConfig) -> list[ExpertLayout]:
    """One layout a layer; a dense first layer's is empty (no experts: 0 slots, 0 bytes, the
    formats of the first routed layer's so that per-format checks read as for that one)."""
    from strata.model.weights import expert_bias

    out = []
    for i in range(cfg.n_dense_lead, cfg.n_layers):
        q = tuple(mf.tensors[f"blk.{i}.ffn_{w}_exps.weight"].qtype for w in ("gate", "up", "down"))
        bias = expert_bias(mf, cfg, i, torch.device("cpu"))
        out.append(ExpertLayout(i, q, cfg.d_model, cfg.d_expert, bias))
    return [ExpertLayout(i, out[0].qtypes, cfg.d_model, 0)
            for i in range(cfg.n_dense_lead)] + out


def first_routed(layouts: list[ExpertLayout]) -> ExpertLayout:
    """The first layer's layout that holds experts."""
    return next(lay for lay in layouts if not lay.empty)
