"""A layer's parts, each written once for every path (layer.py says how they fit together)."""

from strata.model.parts.context import Segment, Segments, StaticStep
from strata.model.parts.layer import Head, Layer
from strata.model.parts.spec import LayerSpec, layer_spec

__all__ = ["Head", "Layer", "LayerSpec", "Segment", "Segments", "StaticStep", "layer_spec"]
