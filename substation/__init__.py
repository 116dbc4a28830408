"""Substation: a data-movement-driven layout optimizer for BERT encoder layers.

The CPU-only core (sizes, the layer graph, layouts, records, analysis, the reference Encoder) imports
without a GPU; GPU-only packages are imported where they are used.
"""
from substation.encoder import Encoder
from substation.graph import LayerGraph, layer_graph
from substation.inject import capture_shapes, inject
from substation.layouts import Configuration
from substation.shipped import shipped_configuration
from substation.sizes import PRESETS, Size, get_size
from substation.stack import EncoderStack
from substation.version import __version__

__all__ = ["Configuration", "Encoder", "EncoderStack", "LayerGraph", "PRESETS", "Size", "capture_shapes", "get_size",
           "inject", "layer_graph", "shipped_configuration", "__version__"]
