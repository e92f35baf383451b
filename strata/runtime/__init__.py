"""Device primitives below the model and the experts: the KV cache (`kv_cache`) and the bounded
waits on the GPU (`waits`). They import nothing of Strata's but `errors`."""
