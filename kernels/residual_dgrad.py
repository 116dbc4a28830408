"""qkv_proj's data gradient with the residual's gradient added by cuBLASLt (impl `cublaslt_residual`): one call
dX = dQKV·Wqkv + dR1 (β = 1, dR1 read as C) covering qkv_proj_dgrad and residual_bwd, so that dXa never exists.

residual_bwd is a pass of its own over three [B, L, I] tensors (13.6 µs at B8/L512, 30.6 at B96/L128 on the H100)
right after the GEMM that writes one of them; reading dR1 in the GEMM's epilogue costs one tensor's read instead.
C and D share one cuBLASLt layout, so dR1 must be laid out as dX. The option `algo` names cuBLASLt's heuristic
algorithm by rank (0: its first choice; the profiler times ranks 0 to 3), so a row runs at any size. dX is rounded
once, where the two-pass path rounds dXa and then dX.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from substation.graph import LayerGraph, Operator, layer_graph
from substation.kernels.gpu_check import checked_step
from substation.layouts import Configuration
from substation.protocol import AllocatingStep, Choice, Env, Implementation, Infeasible, Step, StepContext
from substation.records import Candidate
from substation.sizes import TORCH_DTYPES, Size
from substation.tc_profiling.cublaslt import LtMatmul, device_handle, is_rank, ranked_algorithm
from substation.tc_profiling.mapping import GemmMapping, map_contraction

IMPL = "cublaslt_residual"
COVER = ("qkv_proj_dgrad", "residual_bwd")
RANKS = (0, 1, 2, 3)  # cuBLASLt heuristic ranks the profiler times


def residual_mapping(layouts: Mapping[str, str], extents: Mapping[str, int],
                     graph: LayerGraph | None = None) -> GemmMapping | str:
    """The call writing dX (laid out as dR1) from dQKV and Wqkv in these layouts, or why there is none."""
    graph = graph or layer_graph()
    if layouts["dR1"] != layouts["dX"]:
        return f"dR1:{layouts['dR1']} is not laid out as dX:{layouts['dX']} (one cuBLASLt layout for C and D)"
    dgrad = graph.operator(COVER[0])
    (a, b), (result,) = dgrad.inputs, dgrad.outputs
    mapping = map_contraction(dgrad, {a: layouts[a], b: layouts[b], result: layouts["dX"]}, extents)
    return mapping if mapping.call is not None else (mapping.reason or "no GEMM call")


def candidate(layouts: Mapping[str, str], rank: int, graph: LayerGraph | None = None) -> Candidate:
    """The row: dQKV, Wqkv and dR1 in, dX out, at heuristic rank `rank`."""
    dgrad = (graph or layer_graph()).operator(COVER[0])
    inputs = {t: layouts[t] for t in (*dgrad.inputs, "dR1")}
    return Candidate.make(COVER[0], dgrad.pass_, IMPL, inputs, {"dX": layouts["dX"]}, {"algo": rank}, covers=COVER)


class ResidualDgrad(Implementation):
    """qkv_proj_dgrad and residual_bwd as one cuBLASLt call (module docstring)."""

    impl = IMPL

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return (COVER,)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        found = residual_mapping(layouts, size.extents)
        if isinstance(found, str):
            yield Infeasible(self.impl, COVER, found)
        else:
            yield from (candidate(layouts, rank) for rank in RANKS)

    def cover_layouts(self, ops: Sequence[Operator], config: Configuration) -> dict[str, str]:
        return {t: config.layout(t, "backward") for t in (*ops[0].inputs, "dR1")} | {"dX": config.layouts["dX"]}

    def mapping(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> GemmMapping:
        found = residual_mapping(self.cover_layouts(ops, config), size.extents)
        if isinstance(found, str):
            raise self.error(ops, f"cannot run these layouts: {found}")
        if not is_rank(choice.options.get("algo")):
            raise self.error(ops, f"options {dict(choice.options)}: expected algo, a cuBLASLt heuristic rank (an "
                                  "integer from 0)")
        return found

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        self.mapping(ops, choice, config, size)

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        mapping = self.mapping(ops, choice, config, size)
        return ResidualStep(ops, choice, mapping, self.cover_layouts(ops, config), size.extents, dtype, device)


class ResidualStep(AllocatingStep):
    """The bound call: dX = dQKV·Wqkv + dR1."""

    def __init__(self, ops: Sequence[Operator], choice: Choice, mapping: GemmMapping, layouts: Mapping[str, str],
                 extents: Mapping[str, int], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(ops, choice)
        self.outputs = ("dX",)
        self.bind_outputs(layouts, extents, dtype, device)
        self.a, self.b = mapping.a_operand, mapping.b_operand
        self.matmul = LtMatmul(device_handle(device.index), mapping.call, dtype, beta=1.0)
        self.algorithm = ranked_algorithm(self.matmul, int(choice.options["algo"]))

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        out = self.allocate(ctx.into)
        self.matmul(env[self.a].data_ptr(), env[self.b].data_ptr(), out["dX"].data_ptr(), self.algorithm, ctx.stream,
                    source=env["dR1"].data_ptr())
        return out


def assignments(size: Size, graph: LayerGraph | None = None) -> list[dict[str, str]]:
    """The layout assignments the profiler times: dX and dR1 as PyTorch's [B, L, I] (dX is the user's), every
    order of dQKV's and Wqkv's letters one call executes with it."""
    graph = graph or layer_graph()
    dgrad = graph.operator(COVER[0])
    (a, b) = dgrad.inputs
    orders = lambda t: ("".join(p) for p in itertools.permutations(graph.tensors[t].dims))  # noqa: E731
    found = []
    for la, lb in itertools.product(list(orders(a)), list(orders(b))):
        layouts = {a: la, b: lb, "dR1": "bji", "dX": "bji"}
        if not isinstance(residual_mapping(layouts, size.extents, graph), str):
            found.append(layouts)
    return found


@dataclass(frozen=True)
class ResidualGroup:
    """One profiled layout assignment at one heuristic rank in one dtype: a task of the kernel profiler."""

    layouts: tuple[tuple[str, str], ...]
    rank: int
    dtype: str

    @property
    def candidate(self) -> Candidate:
        return candidate(dict(self.layouts), self.rank)

    def checked_runner(self, size: Size) -> tuple[Callable[[], None], float]:
        """A closure running the call on random inputs in these layouts, and its max relative error against the
        float64 reference of both operators."""
        graph, layouts = layer_graph(), dict(self.layouts)
        mapping = residual_mapping(layouts, size.extents, graph)
        assert not isinstance(mapping, str), mapping
        step = ResidualStep([graph.operator(name) for name in COVER], Choice(COVER, IMPL, {"algo": self.rank}),
                            mapping, layouts, size.extents, TORCH_DTYPES[size.dtype],
                            torch.device("cuda", torch.cuda.current_device()))
        return checked_step(step, layouts, size)


def profiled_groups(size: Size) -> list[ResidualGroup]:
    return [ResidualGroup(tuple(sorted(layouts.items())), rank, size.dtype)
            for layouts in assignments(size) for rank in RANKS]
