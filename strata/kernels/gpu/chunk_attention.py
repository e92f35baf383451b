"""A prompt chunk's causal attention over its cache, with the cache's length read on the device.

    o = chunk_attention(q, k_cache, v_cache, length, hd ** -0.5)       # [T, H*hd] float32

The T new tokens sit at positions length-T .. length-1 and query t sees keys j <= length - T + t
(decode_ops.decode_attention's contract, for a chunk's many rows). On CUDA over a float16 or
bfloat16 cache (`flash_reads`): flash attention's varlen form (torch's
_flash_attention_forward) over the cache's whole storage as stored, the keys it uses given by
`seqused_k` = length on the device, its causal mask aligned to the last key (flash-attn's bottom
right): no row count read on the host, no copy of the rows, the kv heads read as they are (GQA),
so one captured CUDA graph serves a chunk at every start position (strata.engine.chunk_graph).
q is rounded to the cache's type (the kernel takes one type), the sums are float32.

Elsewhere (the CPU, tests) the same in torch: q, k and v rounded alike, then the reference
attention over the storage with the mask built on the device (decode_ops._attention_torch).

Legend: T new tokens, H heads, Hkv kv heads, hd head dim, C cache capacity (rows).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("strata.kernels")

HALF = (torch.float16, torch.bfloat16)
_REFUSED: list[str] = []  # why torch's flash kernel refused a call (then never tried again)


def flash_reads(k_cache: torch.Tensor) -> bool:
    """chunk_attention runs flash attention over this cache: CUDA, float16 or bfloat16 rows of
    a head dim flash takes (a multiple of 8, at most 256), a GPU and torch build with flash."""
    hd = k_cache.shape[-1]
    return (k_cache.is_cuda and k_cache.dtype in HALF and hd % 8 == 0 and hd <= 256
            and not _REFUSED and _flash_available(k_cache.device))


@functools.cache
def _flash_available(device: torch.device) -> bool:
    major, _ = torch.cuda.get_device_capability(device)  # (flash-attn 2: sm80 and later)
    return major >= 8 and torch.backends.cuda.is_flash_attention_available()


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    length: torch.Tensor, scale: float, window: int = 0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, hd] float32 (last dim contiguous); k_cache, v_cache [C, Hkv, hd] of one type,
    contiguous (flash: float16 / bfloat16); length int32/int64 [1] on q's device with
    T <= length <= C -> [T, H*hd] float32. Rows >= length are never read (flash) or are masked
    and zeroed first (torch). gpt-oss: window > 0, each query sees its last `window` keys
    (flash's left window); sinks f32 [H], a logit per head in each softmax's denominator: flash
    gives each row's log-sum-exp L of its scores, and a sink s scales the row's output by
    e^L / (e^L + e^s) = sigmoid(L - s), exactly the softmax with the sink."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [T, H, hd] and the caches [C, Hkv, hd] alike, got "
                         f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}")
    t, h, hd = q.shape
    cap, hkv = k_cache.shape[:2]
    if k_cache.shape[2] != hd or hkv == 0 or h % hkv or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"caches [C, Hkv, {hd}] of one type with H = {h} a multiple of Hkv, "
                         f"got {list(k_cache.shape)} {k_cache.dtype} / {v_cache.dtype}")
    if length.numel() != 1 or length.device != q.device:
        raise ValueError(f"length must be one integer on {q.device}")
    if t == 0:
        return torch.zeros(0, h * hd, dtype=torch.float32, device=q.device)
    if flash_reads(k_cache):
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("flash reads contiguous caches")
        dev = q.device
        # cumulative rows of the one sequence: [0, T] queries, [0, C] keys of which `length`
        # are used (device tensors made by kernels: no host copy)
        cu_q = torch.arange(0, 2 * t, t, dtype=torch.int32, device=dev)
        cu_k = torch.arange(0, 2 * cap, cap, dtype=torch.int32, device=dev)
        used = length.reshape(1).to(torch.int32)
        left = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
        try:
            out, lse = torch.ops.aten._flash_attention_forward(
                q.to(k_cache.dtype), k_cache, v_cache, cu_q, cu_k, t, cap, 0.0, True, False,
                scale=scale, seqused_k=used, **left)[:2]  # [T, H, hd], [H, T] (or [1, H, >= T])
        except RuntimeError as e:
            if torch.cuda.is_current_stream_capturing():
                raise  # (a capture fails whole: its chunk runs eagerly, and lands below)
            # a torch build whose flash kernel refuses this form: said once, then the callers
            # take their other path (flash_reads is False from here on); this call the torch form
            _REFUSED.append(str(e).splitlines()[0][:200])
            log.warning("flash attention over the KV cache refused (%s): prompt chunks attend "
                        "over bf16 copies of their rows", _REFUSED[0])
        else:
            out = out.float()
            if sinks is not None:
                lse = lse.reshape(h, -1)[:, :t]  # [H, T]
                out = out * torch.sigmoid(lse - sinks.float()[:, None]).T[:, :, None]
            return out.reshape(t, h * hd)
    from strata.kernels.gpu.decode_ops import _attention_torch

    rounded = q.to(k_cache.dtype).float() if k_cache.dtype in HALF else q
    return _attention_torch(rounded, k_cache, v_cache, length, scale, window, sinks)
