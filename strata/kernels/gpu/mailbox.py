"""A decode step's mailbox to the CPU pool, inside a CUDA graph: the GPU posts a layer's routing
and activations to page-locked host memory, the host computes some of the layer's missed experts
while the GPU gathers the others over PCIe, and the GPU picks the host's sum up, all without
leaving the graph (strata.experts.cpu_share drives the host side).

    box: host tensors, page-locked and mapped for the device (cudaHostRegister):
      req [L] int32, done [L] int32     step numbers: posted by the GPU, answered by the host
      ids [L, K] int32, slots [L, K] int32, wts [L, K] f32, h [L, D] f32   what the GPU posts
      rows [L, D] f32                   the host's sum for the layer
      err [1] int32                     layer + 1 of a wait that ran out (0: none)

post: every thread stores its part, fences at system scope, the CTA meets at a barrier, then the
step number goes to req[l] with release semantics: the host that sees it sees the rest. take:
polls done[l] with acquire loads until it holds this step's number, at most LIMIT polls (each a
read over PCIe, ~1-2 us), then adds rows[l] to the output; a wait that runs out writes err and
adds nothing (the host reports it: strata.experts.cpu_share). Under Triton's interpreter the
loads and stores are plain (one process's memory, kernels run one at a time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.gpu.bits import ASM
from strata.kernels.tuning import TAKE_LIMIT


@triton.jit
def _load_acquire(ptr):
    if ASM:
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l",
                                      [ptr.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.load(ptr, volatile=True)
    return v


@triton.jit
def _store_release(ptr, value):
    if ASM:
        tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.b32 $0, 0;",
                                  "=r,l,r", [ptr.to(tl.int64), value.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, value)


@triton.jit
def _fence_sys(x):
    # orders this thread's earlier writes before its later ones for every observer
    if ASM:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, 0;", "=r,r", [x],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["layer"])  # layer 1 would become a Python int otherwise
def _post_kernel(seq, req, b_ids, b_slots, b_wts, b_h, ids, wts, h, slot_of, layer, D,
                 K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.load(seq)
    k = tl.arange(0, KB)
    km = k < K
    e = tl.load(ids + k, mask=km, other=0)
    row = layer.to(tl.int64) * K
    tl.store(b_ids + row + k, e.to(tl.int32), mask=km)
    tl.store(b_slots + row + k, tl.load(slot_of + e, mask=km, other=0), mask=km)
    tl.store(b_wts + row + k, tl.load(wts + k, mask=km, other=0.0), mask=km)
    d = tl.arange(0, BLOCK)
    dm = d < D
    tl.store(b_h + layer.to(tl.int64) * D + d, tl.load(h + d, mask=dm, other=0.0), mask=dm)
    _fence_sys(s)
    tl.debug_barrier()
    _store_release(req + layer, s)


@triton.jit(do_not_specialize=["layer", "LIMIT"])
def _take_kernel(seq, done, b_rows, err, out, layer, D, LIMIT, BLOCK: tl.constexpr):
    s = tl.load(seq)
    got = _load_acquire(done + layer)
    n = 0
    while (got != s) & (n < LIMIT):
        got = _load_acquire(done + layer)
        n += 1
    d = tl.arange(0, BLOCK)
    dm = d < D
    if got == s:
        v = tl.load(b_rows + layer.to(tl.int64) * D + d, mask=dm, other=0.0, volatile=True)
        tl.store(out + d, tl.load(out + d, mask=dm, other=0.0) + v, mask=dm)
    else:
        _store_release(err, layer + 1)


def post(box: dict[str, torch.Tensor], seq: torch.Tensor, layer: int, ids: torch.Tensor,
         wts: torch.Tensor, h: torch.Tensor, slot_of: torch.Tensor) -> None:
    """Post one token's routing (ids [1, K], wts [1, K] f32), its expert input h [1, D] f32 and
    the slots its experts have (slot_of[ids], int32) for `layer`, stamped with the step number
    in seq (int32 [1] on the device)."""
    k, d = ids.shape[1], h.shape[1]
    _post_kernel[(1,)](seq, box["req"], box["ids"], box["slots"], box["wts"], box["h"],
                       ids.reshape(-1), wts.reshape(-1), h.reshape(-1), slot_of, layer, d,
                       K=k, KB=triton.next_power_of_2(k), BLOCK=triton.next_power_of_2(d),
                       num_warps=4)


def take(box: dict[str, torch.Tensor], seq: torch.Tensor, layer: int, out: torch.Tensor,
         limit: int | None = None) -> None:
    """out [D] f32 (a contiguous row on the device) += the host's sum for `layer` once the host
    has answered this step (done[layer] == seq), or nothing and err = layer + 1 after `limit`
    polls (TAKE_LIMIT when None)."""
    d = out.numel()
    limit = TAKE_LIMIT if limit is None else limit
    if out.stride(-1) != 1:
        raise ValueError("take: out must be a contiguous row")
    _take_kernel[(1,)](seq, box["done"], box["rows"], box["err"], out, layer, d, limit,
                       BLOCK=triton.next_power_of_2(d), num_warps=4)
