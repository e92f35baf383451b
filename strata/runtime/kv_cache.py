"""Per-sequence KV cache: keys and values of every layer in one tensor (float32, or float16 /
bfloat16 with --kv-type, half the bytes, or q8_0: 8-bit blocks of 32 with a float16 scale, as
llama.cpp's q8_0, 34 bytes a 32), grown by doubling.

    store: [2, L, capacity, Hkv, hd]     k[layer] = store[0, layer], v[layer] = store[1, layer]
           rows 0 .. length-1 hold the sequence's keys and values so far
    scales: [2, L, capacity, Hkv, hd/32] q8_0 only (float16): ks[layer], vs[layer]; a row's
           element d is store[..., d] * scales[..., d // 32]

One storage tensor means one address identifies every layer's rows: a captured decode step
(strata.engine.decode_step) is valid for a cache as long as `store` has not moved. A KVPool hands
a finished sequence's storage to the next cache of the same shape, so the steps of one request
after another replay the same graphs.
"""

from __future__ import annotations

import weakref

import torch

from strata.errors import StrataError


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (how far a cache that holds `a` serves `b`)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

# --kv-type: the cache's element type. Keys and values are computed in float32 and rounded once,
# when stored; attention reads them back as float32. q8_0's elements are int8 with a scale.
KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
            "q8_0": torch.int8}
Q8_BLOCK = 32  # q8_0: elements per scale


def kv_dtype(kv_type: str) -> torch.dtype:
    """--kv-type's element type; an unknown name is refused with the choices."""
    if kv_type not in KV_TYPES:
        raise StrataError(f"--kv-type {kv_type}: choose one of {', '.join(KV_TYPES)}")
    return KV_TYPES[kv_type]


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n a multiple of 32) -> (int8 [..., n], float16 scales [..., n/32]) as
    llama.cpp's q8_0: d = max|x| / 127 over each block of 32, q = round(x / d) (half away from
    zero, through 1/d in float32), d stored as float16."""
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)  # [..., n/32, 32]
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = b * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return q.to(torch.int8).reshape(x.shape), d[..., 0].to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 [..., n], float16 [..., n/32] -> float32 [..., n]"""
    b = q.float().reshape(*q.shape[:-1], q.shape[-1] // Q8_BLOCK, Q8_BLOCK) * d.float()[..., None]
    return b.reshape(q.shape)


def grown(need: int, capacity: int, limit: int | None) -> int:
    """A cache's next capacity: doubled (at least `need`), but never past the rows the memory
    plan holds; a sequence that needs more is refused (a --vram-budget is a bound, not a hint)."""
    if limit is not None and need > limit:
        raise StrataError(f"the sequence needs {need} KV cache rows, and the memory plan holds "
                          f"{limit} (--ctx, within --vram-budget): give a larger --ctx (and "
                          f"--vram-budget), or a smaller --kv-type (f16, q8_0)")
    return max(need, 2 * capacity) if limit is None else min(max(need, 2 * capacity), limit)


class KVPool:
    """Storage tensors of dropped caches, reused by new caches of the same shape."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []

    def take(self, shape: tuple[int, ...], device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A free storage of this shape and type (one pool serves one model, so one device),
        or a new one."""
        for i, t in enumerate(self.free):
            if tuple(t.shape) == shape and t.dtype == dtype:
                return self.free.pop(i)
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, store: torch.Tensor) -> None:
        self.free.append(store)


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, device: torch.device,
                 capacity: int = 256, pool: KVPool | None = None,
                 dtype: torch.dtype = torch.float32,
                 storage: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        """storage: (store, scales) to hold the rows in instead of new tensors (a view of a
        KVSlots pool: the cache never grows past it)."""
        self.shape = (n_kv_heads, head_dim)
        self.dtype = dtype
        self.quantized = dtype == torch.int8  # q8_0: int8 rows and their scales
        if self.quantized and head_dim % Q8_BLOCK:
            raise StrataError(f"--kv-type q8_0: the head dimension {head_dim} is not a multiple "
                              f"of {Q8_BLOCK}; pick f16 or bf16")
        self.n_layers = n_layers
        self.device = device
        self.length = 0
        self.pool = pool
        self._release = None
        self.limit: int | None = None  # rows the memory plan holds (model.new_cache), or none
        self.state = None  # a hybrid model's DeltaState (strata.runtime.delta_state), or None
        self.slot: int | None = None  # its slot of a KVSlots pool (`slots`), or None
        self.slots = None
        if storage is not None:
            self._over(*storage)
        else:
            self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        shape = (2, self.n_layers, capacity, *self.shape)
        sshape = (*shape[:-1], self.shape[1] // Q8_BLOCK)
        take = (self.pool.take if self.pool is not None
                else lambda s, dev, dt: torch.empty(s, dtype=dt, device=dev))
        self.store = take(shape, self.device, self.dtype)
        self.scales = take(sshape, self.device, torch.float16) if self.quantized else None
        if self.pool is not None:
            self._release = weakref.finalize(self, _give, self.pool, self.store, self.scales)
        self._views()

    def _over(self, store: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Rows held in given tensors ([2, L, capacity, Hkv, hd], q8_0's scales beside)."""
        if (scales is not None) != self.quantized:
            raise ValueError("a q8_0 cache's storage comes with its scales, no other one does")
        self.store, self.scales = store, scales
        self._views()

    def _views(self) -> None:
        self.k = list(self.store[0].unbind(0))
        self.v = list(self.store[1].unbind(0))
        self.ks = list(self.scales[0].unbind(0)) if self.quantized else None
        self.vs = list(self.scales[1].unbind(0)) if self.quantized else None

    @property
    def capacity(self) -> int:
        return self.store.shape[2]

    @property
    def nbytes(self) -> int:
        scales = self.scales.numel() * 2 if self.quantized else 0
        return self.store.numel() * self.store.element_size() + scales

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               read: bool = True) -> tuple[torch.Tensor, ...]:
        """Write k, v [t, Hkv, hd] at rows length.. (not yet committed, rounded to the cache's
        type); return all keys/values up to them, [length + t, Hkv, hd] in the cache's type
        (q8_0: dequantized to float32, unless not `read`: then nothing is returned)."""
        end = self.length + k.shape[0]
        if end > self.capacity:
            self._grow(end)
        rows = slice(self.length, end)
        if self.quantized:  # (returned as float32, dequantized)
            for rows_q, rows_d, x in ((self.k[layer], self.ks[layer], k),
                                      (self.v[layer], self.vs[layer], v)):
                rows_q[rows], rows_d[rows] = quantize_q8_0(x)
            if not read:
                return None, None
            return (dequantize_q8_0(self.k[layer][:end], self.ks[layer][:end]),
                    dequantize_q8_0(self.v[layer][:end], self.vs[layer][:end]))
        self.k[layer][rows] = k
        self.v[layer][rows] = v
        return self.k[layer][:end], self.v[layer][:end]

    def advance(self, n: int) -> None:
        """Commit n rows written by append() in every layer."""
        self.length += n
        if self.state is not None:
            self.state.moved()

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (e.g. rejected draft tokens). A recurrent
        state cannot be rewound: with one, a shorter length forgets everything."""
        if self.state is not None and length < self.length:
            self.state.reset()
            length = 0
        self.length = min(self.length, length)

    def open_window(self, tokens: int) -> None:
        """The next forward is a verify window of `tokens` tokens: a recurrent state keeps its
        value after each of them, so that rollback can return to any (DeltaState.open_window)."""
        if self.state is not None:
            self.state.open_window(self.length, tokens)

    def rollback(self, length: int) -> None:
        """Back to `length` tokens after a verify window (its rejected drafts forgotten): the
        rows after it dropped and a recurrent state as it was after token length-1, which the
        window kept; without such a window, as truncate."""
        if self.state is not None and length < self.length and self.state.restore(length):
            self.length = length
            return
        self.truncate(length)

    def reserve(self, need: int) -> None:
        """Make room for `need` rows now (a decode step must not move the storage)."""
        if need > self.capacity:
            self._grow(need)

    def _grow(self, need: int) -> None:
        old, old_scales, release = self.store, self.scales, self._release
        self._alloc(grown(need, self.capacity, self.limit))
        self.store[:, :, : self.length] = old[:, :, : self.length]
        if self.quantized:
            self.scales[:, :, : self.length] = old_scales[:, :, : self.length]
        if release is not None:
            release()  # the old storage back to the pool


def _give(pool: KVPool, store: torch.Tensor, scales: torch.Tensor | None) -> None:
    pool.give(store)
    if scales is not None:
        pool.give(scales)
