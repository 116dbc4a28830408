"""The fused-kernel families as one implementation (impl `kernel`): which family implements each fused operator,
its variants for a size and layouts, and the bound launch of a configuration's chosen variant.

Every family module lists its operators in OPS, their parameter classes in PARAMS (op -> KernelParams
subclass), and offers variants(op, size, dtype, layouts) -> [KernelParams].
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType

import torch

from substation.device import H100, DeviceSpec
from substation.errors import GraphError
from substation.graph import LayerGraph, Operator, layer_graph
from substation.kernels import elementwise, layernorm, softmax
from substation.kernels.base import KernelImplementation, KernelParams
from substation.layouts import Configuration
from substation.protocol import AllocatingStep, Choice, Env, Infeasible, Step, StepContext, op_layouts
from substation.records import Candidate
from substation.sizes import Size

FAMILIES: tuple[ModuleType, ...] = (softmax, layernorm, elementwise)


def registry() -> dict[str, ModuleType]:
    """Fused operator -> the family module whose kernels implement it."""
    return {op: module for module in FAMILIES for op in module.OPS}


def kernel_module(op: str) -> ModuleType:
    known = registry()
    if op not in known:
        raise GraphError(f"no kernel implements {op!r}; kernels exist for: {', '.join(known)}")
    return known[op]


def kernel_params(op: str, size: Size, dtype: str, layouts: Mapping[str, str], options: Mapping[str, object]) -> KernelParams:
    """The parameter point a profile row or configuration names (its options are the knobs), checked.

    InfeasibleVariantError names the broken rule (a configuration made for another size breaks one); TypeError
    names an unknown knob.
    """
    operator = layer_graph().operator(op)
    ordered = {name: layouts[name] for name in operator.inputs + operator.outputs}
    params = kernel_module(op).PARAMS[op].at_size(op, size, dtype, ordered, **options)
    params.check()
    return params


class KernelStep(AllocatingStep):
    """One compiled variant of a fused operator's kernel, its launch bound to one device."""

    def __init__(self, op: Operator, choice: Choice, params: KernelParams, bound) -> None:
        super().__init__([op], choice)
        self.params, self.bound = params, bound
        # The bound launch takes every input's pointer, then every output's (the order of params.layouts).
        self.read = tuple(name for name in bound.names if name in op.inputs)
        self.written = tuple(name for name in bound.names if name in op.outputs)

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        out = self.allocate(ctx.into)
        pointers = [env[name].data_ptr() for name in self.read] + [out[name].data_ptr() for name in self.written]
        self.bound(pointers, ctx.args, ctx.stream)
        return out


class FusedKernels(KernelImplementation):
    """Substation's jinja2 CUDA kernels of the fused operators (softmax, LayerNorm, elementwise families)."""

    impl = "kernel"

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return tuple((op.name,) for op in graph.operators if op.name in registry())

    def variants(self, op: Operator, size: Size, layouts: Mapping[str, str], spec: DeviceSpec = H100
                 ) -> list[KernelParams]:
        """The variants the profiler times for `op` in `layouts` at `size` (its dtype) on `spec`'s GPU."""
        return kernel_module(op.name).variants(op.name, size, size.dtype, dict(layouts), spec)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        found = self.variants(ops[0], size, layouts)
        if not found:
            yield Infeasible(self.impl, (ops[0].name,), f"no variant of the {ops[0].name} kernel fits {dict(layouts)}")
        for params in found:
            yield params.candidate

    def chosen_point(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size
                     ) -> KernelParams:
        return kernel_params(ops[0].name, size, size.dtype, op_layouts(ops[0], config), choice.options)

    def cover_variants(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str], spec: DeviceSpec
                       ) -> list[KernelParams]:
        return self.variants(ops[0], size, layouts, spec)

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        params, spec = self.runnable(ops, choice, config, size, dtype, device)
        step = KernelStep(ops[0], choice, params, params.bind(params.compile(spec), device.index))
        step.bind_outputs(op_layouts(ops[0], config), size.extents, dtype, device)
        return step
