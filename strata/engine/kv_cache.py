"""Moved to strata.runtime.kv_cache (below the model and the experts); kept for old imports."""

from strata.runtime.kv_cache import KV_TYPES, KVCache, KVPool, kv_dtype

__all__ = ["KV_TYPES", "KVCache", "KVPool", "kv_dtype"]
