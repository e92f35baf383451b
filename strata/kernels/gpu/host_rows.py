"""Rows of a table kept in page-locked host memory, gathered by the device: the token embedding
on CUDA (tuning.EMBED_ON_HOST), read over PCIe one row a token, so its VRAM goes to the expert
cache.

    raw = host_rows(table, ids)  # uint8 [*ids.shape, row_nbytes] on ids' device

The table is a CPU tensor in pinned memory (torch's pin_memory: mapped for the device, at the
same address, where CUDA addresses are unified), so a kernel reads it directly: no host sync,
the ids stay on the device, and a CUDA graph (the decode step, the prompt and window graphs)
captures the read with the rest of the pass, as it captures the expert arena's
(moe.gather_misses)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HOST_ROWS_BLOCK = 1024  # bytes a program (a row of the embedding is 0.3-8 KB)


@triton.jit
def _host_rows_kernel(table, ids, out, row_bytes, stride_t, BLOCK: tl.constexpr):
    # out[r, c] = table[ids[r], c] for the bytes c of this program's block of the row
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < row_bytes
    i = tl.load(ids + r).to(tl.int64)
    v = tl.load(table + i * stride_t + c, mask=m, other=0)
    tl.store(out + r.to(tl.int64) * row_bytes + c, v, mask=m)


def host_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table uint8 [N, row_nbytes] in pinned host memory (rows contiguous), ids int [...] on
    the device, each < N -> uint8 [..., row_nbytes] on ids' device."""
    if table.dim() != 2 or table.dtype != torch.uint8 or table.stride(1) != 1:
        raise ValueError(f"host_rows: a uint8 [N, bytes] table of contiguous rows, got "
                         f"{table.dtype} {tuple(table.shape)}")
    flat = ids.reshape(-1).contiguous()
    n, row = flat.numel(), table.shape[1]
    out = torch.empty(n, row, dtype=torch.uint8, device=ids.device)
    if n:
        _host_rows_kernel[(n, triton.cdiv(row, HOST_ROWS_BLOCK))](
            table, flat, out, row, table.stride(0), BLOCK=HOST_ROWS_BLOCK)
    return out.view(*ids.shape, row)
