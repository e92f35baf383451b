"""Multi-head latent attention's decode token (model/parts/mla.py, the absorbed form) over the
cached latent rows: flash decoding in two launches on CUDA (graph-safe: the length on the
device, shapes fixed by the storage), the same math in torch ops elsewhere.

    o_lat = latent_attention(q_lat, q_pe, cache, length, scale[, read])      # [B, H, L]
    score_hj = (q_lat_h . c_j + q_pe_h . k_pe_j) * scale,  o_lat_h = softmax_j(score_h) . c

over the rows [c ; k_pe] of each of the B tokens' sequence (one sequence: cache rows 0 .. n-1;
with `read`, a pool's rows read[b, j] through each sequence's block table, as paged_attention).

Kernels (decode_kernels.py): `_latent_split_kernel`, grid (B, cdiv(H, BLOCK_H), S): a CTA takes
BLOCK_H heads of one token and a split of its rows; each block of BLOCK_N rows is loaded once for
all of the CTA's heads, which are the rows of tl.dot's tile (every head reads the same rows:
MLA's keys are shared, as MQA's), products exact float32 or, with --kernels fused, TF32; online
softmax in float32 (_softmax_step). The split size is derived on the device from the row's
length (_split_chunk), so only filled rows are read and splits past the length exit at once.
`_paged_reduce_kernel`, grid (B, H), combines each head's live splits (_combine_splits), as for
paged_attention.

Legend: B tokens (one per sequence), H heads, L kv_lora, R rope dims, Tk rows a token may read,
C the storage's rows, S row splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.gpu.decode_ops import (
    _cdiv,
    _check,
    _f32,
    _kernels,
    _pow2,
    _reduce_splits,
    _use_kernels,
    scratch,
)
from strata.kernels.tuning import ATTN_MIN_CHUNK, MLA_TARGET_CTAS, MLA_TILES

LATENT_DTYPES = {torch.float32: "float32", torch.float16: "float16",
                 torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LatentLaunch:
    """The split kernel's tile: heads a CTA (block_h, tl.dot's rows), rows a step (block_n),
    pipeline stages, warps; tf32: the products on TF32 tensor cores (--kernels fused)."""

    tf32: bool
    block_h: int
    block_n: int
    stages: int
    warps: int


def latent_launch(fused: bool) -> LatentLaunch:
    """The tile of the exact (fused=False) or the TF32 kernel (tuning.MLA_TILES)."""
    return LatentLaunch(fused, *MLA_TILES[fused])


def latent_splits(rows: int, programs: int) -> int:
    """S for `programs` CTAs a split (tokens x head blocks) over `rows` rows at most: fixed by the
    storage (one captured graph serves every length), ~MLA_TARGET_CTAS CTAs at full length."""
    return max(1, min(_cdiv(rows, ATTN_MIN_CHUNK), MLA_TARGET_CTAS // programs))


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                     length: torch.Tensor, scale: float, read: torch.Tensor | None = None,
                     fused: bool = False, n_splits: int | None = None,
                     tile: LatentLaunch | None = None) -> torch.Tensor:
    """The absorbed attention of one new token of each of B sequences over its cached rows
    [c ; k_pe]: token b is at position length[b] - 1 and sees its positions j < length[b],
    whose rows are cache rows j (read None: one sequence, B = 1) or read[b, j].

    q_lat [B, H, L], q_pe [B, H, R] f32 (the rotated rope queries; last dims contiguous);
    cache [C, L + R] f32 / f16 / bf16 (read as f32; last dim contiguous); length int32/int64 [B] on
    the device, 1 <= length[b] <= Tk (Tk = C, or read's int64 [B, Tk]) -> o_lat [B, H, L] f32,
    before v_b. On CUDA (or under the interpreter) the two kernels (module doc): rows at and
    past a length are never read; fused (--kernels fused) puts the products on TF32 tensor
    cores, otherwise they are exact float32. Elsewhere torch ops over all Tk rows, masked past
    each length. Both graph safe. n_splits, tile: tests and benchmarks."""
    _check(q_lat.dim() == 3 and q_pe.dim() == 3 and q_pe.shape[:2] == q_lat.shape[:2]
           and cache.dim() == 2, "q_lat [B, H, L], q_pe [B, H, R], cache [C, L + R]")
    b, h, lat = q_lat.shape
    rope = q_pe.shape[2]
    _f32(q_lat, "q_lat")
    _f32(q_pe, "q_pe")
    _f32(cache, "cache", (cache.shape[0], lat + rope), LATENT_DTYPES)
    _check(length.dtype in (torch.int32, torch.int64) and length.shape == (b,)
           and length.device == q_lat.device, f"length must be int32/int64 [{b}] on "
           f"{q_lat.device}")
    if read is None:
        _check(b == 1, f"without read one sequence's token (B = 1), got B = {b}")
    else:
        _check(read.dtype == torch.int64 and read.dim() == 2 and read.shape[0] == b
               and read.stride(1) == 1 and read.device == q_lat.device,
               f"read must be int64 [{b}, Tk] with contiguous rows, on q_lat's device")
    for name, t in (("q_pe", q_pe), ("cache", cache)):
        _check(t.device == q_lat.device, f"{name} must be on q_lat's device")
    if not _use_kernels(q_lat):
        return _latent_torch(q_lat, q_pe, cache, length, scale, read)
    return _latent_launch(q_lat, q_pe, cache, length, scale, read,
                          tile or latent_launch(fused), n_splits)


def _latent_torch(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  length: torch.Tensor, scale: float, read: torch.Tensor | None) -> torch.Tensor:
    """latent_attention in torch ops over every row a token may read, masked past its length
    (the reference's absorbed form: MLAttention._latent). -> [B, H, L]"""
    lat = q_lat.shape[2]
    rows = cache[None] if read is None else cache[read]  # [B, Tk, L + R]
    valid = (torch.arange(rows.shape[1], device=cache.device)[None]
             < length.long()[:, None])  # [B, Tk]
    # (rows past a length hold whatever the storage held: zeroed, so that their zero weights
    # cannot meet a NaN there)
    rows = rows.float().masked_fill(~valid[..., None], 0.0)
    c, k_pe = rows[..., :lat], rows[..., lat:]
    scores = (torch.einsum("bhl,bkl->bhk", q_lat, c)
              + torch.einsum("bhr,bkr->bhk", q_pe, k_pe)) * scale  # [B, H, Tk]
    p = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhk,bkl->bhl", p, c)


def _latent_launch(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   length: torch.Tensor, scale: float, read: torch.Tensor | None,
                   tile: LatentLaunch, n_splits: int | None) -> torch.Tensor:
    """latent_attention's two launches."""
    b, h, lat = q_lat.shape
    rope = q_pe.shape[2]
    _check(_pow2(tile.block_h) == tile.block_h >= 16 and _pow2(tile.block_n) == tile.block_n
           >= 16, f"latent tile {tile}: powers of two, tl.dot's 16 rows and keys at least")
    out = torch.empty((b, h * lat), dtype=torch.float32, device=q_lat.device)
    if b == 0:
        return out.view(b, h, lat)
    hb = _cdiv(h, tile.block_h)
    tk = cache.shape[0] if read is None else read.shape[1]
    s = n_splits or latent_splits(tk, b * hb)
    block_l = _pow2(lat)
    part_o = scratch((s, b, h, lat), torch.float32, q_lat.device)
    part_ml = scratch((s, b, h, 2), torch.float32, q_lat.device)
    length = length.contiguous()
    _kernels()._latent_split_kernel[(b, hb, s)](
        q_lat, q_pe, cache, length if read is None else read, length, part_o, part_ml, scale,
        b, h, s, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), 0 if read is None else read.stride(0), L=lat, R=rope,
        MIN_CHUNK=ATTN_MIN_CHUNK, BLOCK_H=tile.block_h, BLOCK_N=tile.block_n, BLOCK_L=block_l,
        BLOCK_R=max(16, _pow2(rope)), STAGES=tile.stages, PAGED=read is not None,
        TF32=tile.tf32, num_warps=tile.warps)
    _reduce_splits(_kernels()._paged_reduce_kernel, (b, h), part_o, part_ml, length, out, b, h,
                   s, None, q_lat, tile.block_n, block_l, 0)
    return out.view(b, h, lat)
