"""The contraction profiler: every feasible GEMM mapping of every contraction, timed on the GPU.

Plan (CPU): enumerate every layout assignment of every contraction, keep those one strided-batched
call can execute, and group them by call: layouts that differ only inside a flattened group make
the same call, which is timed once and recorded for each of them. Run (GPU, one process per GPU):
for each call, cuBLASLt's top heuristic algorithms and legacy cuBLAS; PyTorch's einsum on the
canonical layouts as the baseline; cuBLASLt's bias epilogue where it covers a contraction and the
operator that adds its bias (`epilogues.py`). Rows go through `substation.records`, one at a time.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from substation.graph import LayerGraph, Operator, layer_graph
from substation.profiling import check_profile_dir, gpu_name, run_on_gpus
from substation.records import Candidate, ProfileRow
from substation.sizes import Size
from substation.tc_profiling.epilogues import BiasEpilogue, enumerate_epilogues
from substation.tc_profiling.mapping import GemmCall, GemmMapping, enumerate_mappings

CSV_NAME = "contractions.csv"


@dataclass(frozen=True)
class CallGroup:
    """One distinct GEMM call and every (operator, layouts) it executes."""

    call: GemmCall
    mappings: tuple[GemmMapping, ...]


@dataclass(frozen=True)
class EpilogueGroup:
    """One distinct GEMM call with a bias epilogue (and bias batch stride) and every layout assignment it covers."""

    call: GemmCall
    bias_batch_stride: int
    epilogues: tuple[BiasEpilogue, ...]


@dataclass(frozen=True)
class Plan:
    groups: tuple[CallGroup, ...]
    baselines: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # (op, canonical layouts) for torch rows
    feasible: dict[str, int]
    infeasible: dict[str, int]
    epilogues: tuple[EpilogueGroup, ...] = ()


def contractions(graph: LayerGraph) -> list[Operator]:
    return [op for op in graph.operators if op.is_contraction]


def plan(size: Size, graph: LayerGraph | None = None) -> Plan:
    """Group every feasible mapping of every contraction by the call that executes it."""
    graph = graph or layer_graph()
    dims = {name: spec.dims for name, spec in graph.tensors.items()}
    by_call: dict[GemmCall, list[GemmMapping]] = collections.defaultdict(list)
    feasible, infeasible = collections.Counter(), collections.Counter()
    for op in contractions(graph):
        for mapping in enumerate_mappings(op, size.extents, dims):
            if mapping.call is None:
                infeasible[op.name] += 1
            else:
                feasible[op.name] += 1
                by_call[mapping.call].append(mapping)
    groups = tuple(CallGroup(call, tuple(ms)) for call, ms in by_call.items())
    baselines = tuple((op.name, tuple((t, dims[t]) for t in (*op.inputs, *op.outputs))) for op in contractions(graph))
    by_epilogue: dict[tuple[GemmCall, int], list[BiasEpilogue]] = collections.defaultdict(list)
    for _, _, epilogue in enumerate_epilogues(size.extents, graph):
        if not isinstance(epilogue, str):
            by_epilogue[epilogue.call, epilogue.bias_batch_stride].append(epilogue)
    epilogues = tuple(EpilogueGroup(call, stride, tuple(es)) for (call, stride), es in by_epilogue.items())
    return Plan(groups, baselines, dict(feasible), dict(infeasible), epilogues)


def candidate(graph: LayerGraph, op: str, impl: str, layouts: Sequence[tuple[str, str]],
              options: dict[str, object]) -> Candidate:
    operator = graph.operator(op)
    return Candidate.make(op, operator.pass_, impl, inputs=dict(layouts[:2]), outputs=dict(layouts[2:]),
                          options=options)


def run(plan_: Plan, size: Size, dtypes: Sequence[str], out_dir: Path, gpus: Sequence[int], force: bool,
        algorithms: int = 4, runs: int = 25) -> Path:
    """Profile into out_dir/contractions.csv on the given GPUs (one process each); returns the path."""
    from substation.tc_profiling import worker

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CSV_NAME
    check_profile_dir(path, size, gpu_name(gpus[0]), force)
    shards = [(plan_.groups[i::len(gpus)], plan_.baselines if i == 0 else (), size, dtypes, algorithms, runs,
               plan_.epilogues[i::len(gpus)]) for i in range(len(gpus))]
    run_on_gpus(worker.profile, shards, path, gpus)
    return path


def mapping_candidate(graph: LayerGraph, mapping: GemmMapping, impl: str, options: dict[str, object]) -> Candidate:
    """The candidate of one layout assignment; options name the graph tensor that is cuBLAS's A."""
    return candidate(graph, mapping.op, impl, mapping.layouts, options | {"a": mapping.a_operand})


def rows_for(graph: LayerGraph, mappings: Sequence[GemmMapping], impl: str, options: dict[str, object],
             make: Callable[[Candidate], ProfileRow]) -> list[ProfileRow]:
    """One row per mapping of a call, all with the call's timing."""
    return [make(mapping_candidate(graph, m, impl, options)) for m in mappings]
