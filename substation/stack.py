"""Encoders applied in turn, as a BERT encoder applies its layers: with CUDA graphs, the whole stack's forward and
backward replay from one pair of graphs (`substation.graphed`), so that the host launches two graphs per training
step instead of two per layer, and no layer's output or gradient is copied out between layers."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from substation.encoder import PARAMETERS, Encoder
from substation.errors import InputError
from substation.graphed import StepGraphs
from substation.mixed_precision import autocast_off

Tensor = torch.Tensor


def stack_forward(encoders: Sequence[Encoder], graphs: StepGraphs, x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Y of `encoders` applied in turn to x [B, L, I] with one key-padding mask [B, L] (1 keeps): replayed from the
    stack's graphs in `graphs` where every Encoder has `cuda_graphs` (and the graphs can run: `StepGraphs.forward`),
    otherwise each Encoder's step launched in turn."""
    first = encoders[0]
    x, mask = first.check_input(x, attention_mask)  # cast to the step's dtype: autocast's for float32 parameters
    for index, encoder in enumerate(encoders):
        if encoder.dtype != first.dtype or encoder.Wqkv.device != first.Wqkv.device:
            raise InputError(f"layer {index} holds {encoder.dtype} parameters on {encoder.Wqkv.device}, layer 0 "
                             f"{first.dtype} on {first.Wqkv.device}: a stack's Encoders share one dtype and device")
        if encoder.length_multiple != first.length_multiple:
            raise InputError(f"layer {index} pads sequences to multiples of {encoder.length_multiple}, layer 0 to "
                             f"{first.length_multiple}: a stack's Encoders share one length_multiple")
    length = x.shape[1]
    x, mask = first.padded(x, mask)  # once for the stack: every layer runs the padded shape
    with autocast_off(x.device.type):
        y = None
        if all(encoder.cuda_graphs for encoder in encoders) and not torch.compiler.is_compiling():
            y = graphs.forward(encoders, PARAMETERS, x, mask)
        if y is None:
            y = x
            for encoder in encoders:  # x is in the step's dtype: each Encoder casts its parameters to it
                y = encoder.eager_forward(y, mask)
    return y if y.shape[1] == length else y[:, :length]


class EncoderStack(nn.Module):
    """Encoders applied in turn, `forward(x, attention_mask=None)` as an Encoder's; with every Encoder's
    `cuda_graphs=True`, each step of the stack replays from one pair of CUDA graphs (per shape: the `max_shapes` used
    last are kept). The Encoders are `self.layers`, and their state_dict keys `layers.<i>.<HF name>`."""

    def __init__(self, encoders: Iterable[Encoder], max_shapes: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(encoders)
        if not len(self.layers) or not all(isinstance(layer, Encoder) for layer in self.layers):
            raise TypeError("EncoderStack takes one or more Encoders")
        self._graphs = StepGraphs(max_shapes)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return stack_forward(list(self.layers), self._graphs, x, attention_mask)
