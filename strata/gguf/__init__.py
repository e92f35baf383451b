"""GGUF files: reading (split sets, memory-mapped, validated) and streamed writing."""

from strata.gguf.model_file import ModelFile, TensorRef, open_model
from strata.gguf.reader import GGUFFile, TensorInfo

__all__ = ["GGUFFile", "ModelFile", "TensorInfo", "TensorRef", "open_model"]
