"""The streaming ring: prompt chunks stream every missed expert through a few VRAM buffers, the copy
of expert i+1 overlapping the compute of expert i.

    ring: uint8 [nbytes]     carved per layer into n_l = nbytes // stride_l buffers
                             (the layer's own record size: a mixed pack gets a different n_l
                             per layer, never a buffer sized for another layer's format)

Buffer b of a layer is written on the copy stream only after the compute that last read it is done
(`free[b]`), and computed on only after its copy landed (`ready[b]`). With one buffer (a budget of
one expert) copies and computes alternate; with two or more they overlap.

With `grouped` (CUDA), the buffers are split into two banks of n_l // 2 (one bank when n_l = 1;
an odd last buffer idles) and a bank's experts are computed together on tensor cores:
dequantized to bf16 and multiplied by two grouped GEMMs
(strata.kernels.gpu.moe_grouped.experts_forward_grouped, reading the bank's records through
ExpertLayout.views like cache slots). The events are per bank: the copy of bank k's next batch
waits for the compute that last read bank k, so batch j + 1 is copied while batch j is computed,
as with single buffers. Otherwise each buffer is computed alone by run_records (dequantize to
float32 + bmm): exact weights, which `--kernels exact` asks for.
"""

from __future__ import annotations

import logging

import torch

from strata.engine.waits import to_device
from strata.experts.arena import Arena
from strata.experts.compute import Group, run_records
from strata.experts.layout import ExpertLayout

log = logging.getLogger("strata.ring")


def ring_size(requested: int | None, layouts: list[ExpertLayout], default: int) -> int:
    """The ring's byte budget: at least the largest record of any layer (raised with a warning)."""
    largest = max(lay.stride for lay in layouts)
    size = default if requested is None else requested
    if size < largest:
        if requested is not None:
            log.warning("--ring-bytes %d is below the largest expert record (%d bytes, layer %d); "
                        "raised to that", requested, largest,
                        max(layouts, key=lambda lay: lay.stride).layer)
        size = largest
    return size


class Ring:
    def __init__(self, nbytes: int, device: torch.device, grouped: bool = False):
        """grouped: compute banks of streamed experts in bf16 on tensor cores (CUDA with triton
        only; the engine should ask for it with --kernels fused, not exact/off)."""
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.streamed_bytes = 0
        self.grouped = grouped and self.cuda and _grouped_available()

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def buffers(self, layout: ExpertLayout) -> torch.Tensor:
        """This layer's view of the ring: uint8 [n_l, stride_l], n_l >= 1."""
        n = self.nbytes // layout.stride
        return self.buf[: n * layout.stride].view(n, layout.stride)

    def stream(self, arena: Arena, layer: int, groups: list[Group], h: torch.Tensor,
               out: torch.Tensor, workspace_bytes: int) -> None:
        """out += Σ over the groups' experts, each copied into the ring and computed there."""
        lay = arena.layouts[layer]
        bufs = self.buffers(lay)
        n = bufs.shape[0]
        if not self.cuda:
            for i in range(0, len(groups), n):
                chunk = groups[i:i + n]
                for j, g in enumerate(chunk):
                    bufs[j].copy_(arena.record(layer, g.expert))
                run_records(lay, bufs[: len(chunk)], chunk, h, out, workspace_bytes)
                self.streamed_bytes += len(chunk) * lay.nbytes
            return
        if self.grouped:
            self._stream_banks(arena, layer, groups, h, out)
            return
        compute = torch.cuda.current_stream(self.device)
        free: list[torch.cuda.Event | None] = [None] * n
        start = torch.cuda.Event()
        start.record(compute)  # h is ready
        for i, g in enumerate(groups):
            b = i % n
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(free[b] if free[b] is not None else start)
                bufs[b].copy_(arena.record(layer, g.expert), non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            compute.wait_event(ready)
            run_records(lay, bufs[b:b + 1], [g], h, out, workspace_bytes)
            free[b] = torch.cuda.Event()
            free[b].record(compute)
            self.streamed_bytes += lay.nbytes

    def _stream_banks(self, arena: Arena, layer: int, groups: list[Group], h: torch.Tensor,
                      out: torch.Tensor) -> None:
        """The CUDA loop of `stream` with a bank of buffers per step, computed as one group."""
        from strata.kernels.gpu.moe_grouped import experts_forward_grouped

        lay = arena.layouts[layer]
        bufs = self.buffers(lay)
        n_banks = 2 if bufs.shape[0] >= 2 else 1
        m = bufs.shape[0] // n_banks  # buffers per bank
        gate, up, down = lay.views(bufs)
        compute = torch.cuda.current_stream(self.device)
        free: list[torch.cuda.Event | None] = [None] * n_banks
        start = torch.cuda.Event()
        start.record(compute)  # h is ready
        for j, i in enumerate(range(0, len(groups), m)):
            chunk = groups[i:i + m]
            k = j % n_banks
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(free[k] if free[k] is not None else start)
                for q, g in enumerate(chunk):
                    bufs[k * m + q].copy_(arena.record(layer, g.expert), non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            compute.wait_event(ready)
            tokens_host = torch.cat([g.tokens for g in chunk])
            tokens = to_device(tokens_host, self.device)
            wts = to_device(torch.cat([g.weights for g in chunk]).float(), self.device)
            slots = torch.arange(k * m, k * m + len(chunk), dtype=torch.int32,
                                 device=self.device)
            experts_forward_grouped(h, tokens, wts, [len(g.tokens) for g in chunk], slots, gate,
                                    up, down, lay.qtypes, lay.d_model, lay.d_expert, out,
                                    tokens_host=tokens_host)
            free[k] = torch.cuda.Event()
            free[k].record(compute)
            self.streamed_bytes += len(chunk) * lay.nbytes


def _grouped_available() -> bool:
    try:
        import strata.kernels.gpu.moe_grouped  # noqa: F401 (needs triton)
    except ImportError as e:
        log.info("grouped ring compute unavailable (%s): experts are dequantized to float32", e)
        return False
    return True
