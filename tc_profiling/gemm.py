"""What every GEMM implementation of a contraction shares (legacy cuBLAS, cuBLASLt): the cover (one
contraction), the candidate (the one strided-batched call its layouts map to, `mapping.py`), the check that
a configuration's recorded call is the call of its layouts at this size, and the bound step; plus the
profiler's random operands and PyTorch's einsum baseline.
"""
from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from substation.graph import LayerGraph, Operator
from substation.layouts import Configuration
from substation.protocol import AllocatingStep, Choice, Env, Implementation, Infeasible, StepContext, Step, op_layouts
from substation.records import Candidate
from substation.sizes import Size
from substation.tc_profiling.mapping import GemmCall, GemmMapping, map_contraction

GemmRun = Callable[[int, int, int, int], None]  # (a, b, c pointers, stream) -> None


def contraction_candidate(op: Operator, impl: str, layouts: Sequence[tuple[str, str]],
                          options: Mapping[str, object]) -> Candidate:
    """The row of a contraction: A and B in, the result out (`layouts` in that order)."""
    return Candidate.make(op.name, op.pass_, impl, inputs=dict(layouts[:2]), outputs=dict(layouts[2:]),
                          options=options)


def mapping_candidate(op: Operator, mapping: GemmMapping, impl: str, options: Mapping[str, object]) -> Candidate:
    """The row of one layout assignment's call; the options also name the graph tensor that is cuBLAS's A."""
    return contraction_candidate(op, impl, mapping.layouts, {**options, "a": mapping.a_operand})


class GemmStep(AllocatingStep):
    """One strided-batched GEMM on the environment's operands: a library call prepared at bind time. It also writes
    a float32 C where the context's `into` asks for one (a parameter gradient under autocast, straight from the
    float32 accumulators instead of a 16-bit result and a cast); that call is prepared on first use."""

    def __init__(self, op: Operator, choice: Choice, prepare: Callable[[torch.dtype], GemmRun], a: str, b: str,
                 dtype: torch.dtype) -> None:
        super().__init__([op], choice)
        self.prepare, self.a, self.b, self.c = prepare, a, b, op.outputs[0]
        self.runs = {dtype: prepare(dtype)}  # C's dtype -> the call writing it

    def writes_into(self, tensor: str, dtype: torch.dtype) -> bool:
        return tensor == self.c and dtype in (self.dtype, torch.float32)

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        out = self.allocate(ctx.into)
        c = out[self.c]
        run = self.runs.get(c.dtype)
        if run is None:
            run = self.runs[c.dtype] = self.prepare(c.dtype)
        run(env[self.a].data_ptr(), env[self.b].data_ptr(), c.data_ptr(), ctx.stream)
        return out


def check_call(op: Operator, choice: Choice, call: GemmCall, error: Callable[[str], Exception]) -> None:
    """The GEMM arguments a row recorded must be those of these layouts at this size."""
    recorded = {k: choice.options[k] for k in call.options() if k in choice.options}
    expected = {k: call.options()[k] for k in recorded}
    if recorded != expected:
        wrong = sorted(k for k in recorded if recorded[k] != expected[k])
        raise error(f"records the GEMM call ({', '.join(f'{k}={recorded[k]}' for k in wrong)}), which is not the "
                    f"call of its layouts at this size ({', '.join(f'{k}={expected[k]}' for k in wrong)}): the "
                    "configuration was made for another size")


class GemmImplementation(Implementation):
    """One contraction as one strided-batched GEMM call of some library."""

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return tuple((op.name,) for op in graph.operators if op.is_contraction)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        mapping = map_contraction(ops[0], layouts, size.extents)
        if mapping.call is None:
            yield Infeasible(self.impl, (ops[0].name,), mapping.reason or "no GEMM call")
            return
        yield mapping_candidate(ops[0], mapping, self.impl, mapping.call.options())

    def mapping(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> GemmMapping:
        """The call of the configuration's layouts at this size, checked against the recorded one."""
        mapping = map_contraction(ops[0], op_layouts(ops[0], config), size.extents)
        if mapping.call is None:
            raise self.error(ops, f"cannot run layouts {dict(mapping.layouts)}: {mapping.reason}")
        check_call(ops[0], choice, mapping.call, lambda message: self.error(ops, message))
        return mapping

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        self.mapping(ops, choice, config, size)

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        mapping = self.mapping(ops, choice, config, size)
        def prepare(out_dtype: torch.dtype) -> GemmRun:
            return self.prepare(ops, choice, mapping.call, dtype, device, out_dtype)

        step = GemmStep(ops[0], choice, prepare, mapping.a_operand, mapping.b_operand, dtype)
        step.bind_outputs(op_layouts(ops[0], config), size.extents, dtype, device)
        return step

    @abc.abstractmethod
    def prepare(self, ops: Sequence[Operator], choice: Choice, call: GemmCall, dtype: torch.dtype,
                device: torch.device, out_dtype: torch.dtype) -> GemmRun:
        """The library call on pointers, A and B in `dtype` and C in `out_dtype`, everything else resolved."""


def operands(mapping: GemmMapping, extents: dict[str, int], dtype: torch.dtype,
             generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random inputs (never zeros) and an output buffer, each shaped as its layout."""
    tensors = {}
    for i, (name, layout) in enumerate(mapping.layouts):
        shape = [extents[d] for d in layout]
        tensors[name] = (torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32).to(dtype)
                         if i < 2 else torch.empty(shape, device="cuda", dtype=dtype))
    return tensors


def einsum_runner(mapping: GemmMapping, tensors: dict[str, torch.Tensor]) -> Callable[[], None]:
    """PyTorch on these layouts: its einsum, made contiguous (one copy) only where it returns a view."""
    (a, la), (b, lb), (_, lc) = mapping.layouts
    spec = f"{la},{lb}->{lc}"
    return lambda: torch.einsum(spec, tensors[a], tensors[b]).contiguous()
