"""PyTorch's own ops (impl `torch`): every operator of the graph as its torch reference (`substation.reference`),
einsum for a contraction, the fused operator's op sequence otherwise, in any layouts. The CPU path runs a whole
plan of these; on the GPU they stand in where a configuration chose PyTorch (the profile's `torch` rows).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from substation.graph import LayerGraph, Operator
from substation.layouts import Configuration
from substation.protocol import Choice, Env, Implementation, Infeasible, Step, StepContext
from substation.records import Candidate
from substation.reference import run_operator
from substation.sizes import Size


class ReferenceStep(Step):
    """One operator's torch reference on the environment's tensors, in the configuration's layouts."""

    def __init__(self, op: Operator, config: Configuration, graph: LayerGraph, choice: Choice | None = None) -> None:
        super().__init__([op], choice or Choice((op.name,), TorchOps.impl))
        self.config, self.graph = config, graph

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        return run_operator(self.ops[0], env, self.config, ctx.args, ctx.extents, self.graph)


class TorchOps(Implementation):
    """Every single operator of `graph`, in every layout."""

    impl = "torch"

    def __init__(self, graph: LayerGraph) -> None:
        self.graph = graph

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return tuple((op.name,) for op in graph.operators)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        op = ops[0]
        yield Candidate.make(op.name, op.pass_, self.impl, {t: layouts[t] for t in op.inputs},
                             {t: layouts[t] for t in op.outputs})

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        return ReferenceStep(ops[0], config, self.graph, choice)
