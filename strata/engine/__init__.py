"""The engine: KV cache, sampling and the generation loop over the model."""
