"""Encoders applied in turn, as a BERT encoder applies its layers: with CUDA graphs, the whole stack's forward and
backward replay from one pair of graphs (`substation.graphed`), so that the host launches two graphs per training
step instead of two per layer, and no layer's output or gradient is copied out between layers."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from substation.encoder import Encoder, stack_capture, stack_forward
from substation.graphed import StepGraphs

Tensor = torch.Tensor


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

    def capture(self, batch_size: int, lengths: Iterable[int], train: bool = True) -> list[int]:
        """The stack's graphs for these shapes, captured ahead of the loop (`substation.encoder.stack_capture`)."""
        return stack_capture(list(self.layers), self._graphs, batch_size, lengths, train)
