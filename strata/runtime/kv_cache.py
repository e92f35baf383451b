"""Per-sequence KV cache: keys and values of every layer in one tensor (float32, or float16 /
bfloat16 with --kv-type, half the bytes), grown by doubling.

    store: [2, L, capacity, Hkv, hd]     k[layer] = store[0, layer], v[layer] = store[1, layer]
           rows 0 .. length-1 hold the sequence's keys and values so far

One storage tensor means one address identifies every layer's rows: a captured decode step
(strata.engine.decode_step) is valid for a cache as long as `store` has not moved. A KVPool hands
a finished sequence's storage to the next cache of the same shape, so the steps of one request
after another replay the same graphs.
"""

from __future__ import annotations

import weakref

import torch

from strata.errors import StrataError

# --kv-type: the cache's element type. Keys and values are computed in float32 and rounded once,
# when stored; attention reads them back as float32.
KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def kv_dtype(kv_type: str) -> torch.dtype:
    """--kv-type's element type; an unknown name is refused with the choices."""
    if kv_type not in KV_TYPES:
        raise StrataError(f"--kv-type {kv_type}: choose one of {', '.join(KV_TYPES)}")
    return KV_TYPES[kv_type]


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
                 dtype: torch.dtype = torch.float32):
        self.shape = (n_kv_heads, head_dim)
        self.dtype = dtype
        self.n_layers = n_layers
        self.device = device
        self.length = 0
        self.pool = pool
        self._release = None
        self.state = None  # a hybrid model's DeltaState (strata.runtime.delta_state), or None
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        shape = (2, self.n_layers, capacity, *self.shape)
        if self.pool is None:
            self.store = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            self.store = self.pool.take(shape, self.device, self.dtype)
            self._release = weakref.finalize(self, self.pool.give, self.store)
        self.k = list(self.store[0].unbind(0))
        self.v = list(self.store[1].unbind(0))

    @property
    def capacity(self) -> int:
        return self.store.shape[2]

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write k, v [t, Hkv, hd] at rows length.. (not yet committed, rounded to the cache's
        type); return all keys/values up to them, [length + t, Hkv, hd] in the cache's type."""
        end = self.length + k.shape[0]
        if end > self.capacity:
            self._grow(end)
        self.k[layer][self.length:end] = k
        self.v[layer][self.length:end] = v
        return self.k[layer][:end], self.v[layer][:end]

    def advance(self, n: int) -> None:
        """Commit n rows written by append() in every layer."""
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (e.g. rejected draft tokens). A recurrent
        state cannot be rewound: with one, a shorter length forgets everything."""
        if self.state is not None and length < self.length:
            self.state.reset()
            length = 0
        self.length = min(self.length, length)

    def reserve(self, need: int) -> None:
        """Make room for `need` rows now (a decode step must not move the storage)."""
        if need > self.capacity:
            self._grow(need)

    def _grow(self, need: int) -> None:
        old, release = self.store, self._release
        self._alloc(max(need, 2 * self.capacity))
        self.store[:, :, : self.length] = old[:, :, : self.length]
        if release is not None:
            release()  # the old storage back to the pool
