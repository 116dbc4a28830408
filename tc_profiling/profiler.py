"""The contraction profiler: every feasible GEMM mapping of every contraction, timed on the GPU.

Plan (CPU): enumerate every layout assignment of every contraction, keep those one strided-batched
call can execute, and group them by call: layouts that differ only inside a flattened group make
the same call, which is timed once and recorded for each of them. Run (GPU, an isolated worker process
per GPU, `substation.isolation`; the tasks and their runner are `worker.py`): for each call, cuBLASLt's
top heuristic algorithms and legacy cuBLAS; PyTorch's einsum on the canonical layouts as the baseline;
cuBLASLt's bias epilogue where it covers a contraction and the operator that adds its bias (`epilogues.py`).
A call that crashes or hangs its worker is a failed row. Rows go through `substation.records`, one at a time.
"""
from __future__ import annotations

import collections
import functools
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from substation.graph import LayerGraph, Operator, layer_graph
from substation.isolation import DEFAULT_TIMEOUT_S, Task, run_isolated
from substation.profiling import check_profile_dir, gpu_name, versions
from substation.sizes import Size
from substation.tc_profiling.epilogues import BiasEpilogue, enumerate_epilogues
from substation.tc_profiling.mapping import GemmCall, GemmMapping, enumerate_mappings
from substation.implementations import registry
from substation.tc_profiling.cublaslt import CublasLt
from substation.tc_profiling.gemm import contraction_candidate
from substation.tc_profiling.worker import Baseline, CallGroup, ContractionRunner, EpilogueGroup, Job

CSV_NAME = "contractions.csv"


@dataclass(frozen=True)
class ContractionPlan:
    groups: tuple[CallGroup, ...]
    baselines: tuple[Baseline, ...]  # PyTorch's einsum of each contraction, the torch rows
    feasible: dict[str, int]
    infeasible: dict[str, int]
    epilogues: tuple[EpilogueGroup, ...] = ()


def contractions(graph: LayerGraph) -> list[Operator]:
    """The operators the registry's GEMM implementation runs (every contraction of the graph)."""
    return [graph.operator(name) for (name,) in registry(graph).covers(CublasLt.impl)]


def plan(size: Size, graph: LayerGraph | None = None) -> ContractionPlan:
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
    baselines = tuple(Baseline(op.name, tuple((t, dims[t]) for t in (*op.inputs, *op.outputs)))
                      for op in contractions(graph))
    by_epilogue: dict[tuple[GemmCall, int], list[BiasEpilogue]] = collections.defaultdict(list)
    for _, _, epilogue in enumerate_epilogues(size.extents, graph):
        if not isinstance(epilogue, str):
            by_epilogue[epilogue.call, epilogue.bias_batch_stride].append(epilogue)
    epilogues = tuple(EpilogueGroup(call, stride, tuple(es)) for (call, stride), es in by_epilogue.items())
    return ContractionPlan(groups, baselines, dict(feasible), dict(infeasible), epilogues)


def tasks(plan_: ContractionPlan, size: Size, dtypes: Sequence[str]) -> list[Task]:
    """The plan's work as isolated tasks: per dtype, the baselines, then the call groups, then the epilogue groups.
    A baseline's row is known beforehand; a group's rows are known once its worker has asked cuBLASLt."""
    graph, found = layer_graph(), []
    for dtype in dtypes:
        sized = size.with_dtype(dtype)
        found += [Task(Job(b, dtype), ((contraction_candidate(graph.operator(b.op), "torch", b.layouts, {}), sized),))
                  for b in plan_.baselines]
        found += [Task(Job(group, dtype)) for group in (*plan_.groups, *plan_.epilogues)]
    return found


def run(plan_: ContractionPlan, size: Size, dtypes: Sequence[str], out_dir: Path, gpus: Sequence[int], force: bool,
        algorithms: int = 4, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> Path:
    """Profile into out_dir/contractions.csv on the given GPUs (an isolated worker process each); returns the
    path. `timeout`: seconds one GEMM call (checked and timed) may take before its worker is killed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CSV_NAME
    names = {g: gpu_name(g) for g in gpus}
    check_profile_dir(path, size, names[gpus[0]], None, force)
    setup = functools.partial(ContractionRunner, size=size, algorithms=algorithms, runs=runs)
    run_isolated(setup, tasks(plan_, size, dtypes), path, names, versions(), None, timeout, desc="contractions")
    return path


def reuse_rows(default_dir: Path, out_dir: Path) -> Path | None:
    """The GEMM rows of a size's default profile copied into its profile at another dropout (they have no dropout:
    the contraction profiler's rows are the same at any), where that one has none yet; the copy, or None."""
    if any((out_dir / name).exists() for name in (CSV_NAME, CSV_NAME + ".gz")):
        return None
    found = next((default_dir / name for name in (CSV_NAME, CSV_NAME + ".gz") if (default_dir / name).is_file()), None)
    if found is None:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = out_dir / found.name
    shutil.copyfile(found, copy)
    return copy

