"""The kernel profiler: every variant of every fused-operator kernel, compiled in parallel and timed on the GPU.

Plan (CPU): for each fused operator with a kernel, the layout combinations of `kernels.space` times
each module's knob settings (`variants`). Compile (CPU, all cores). Run (GPU): each variant's outputs
are first checked against the torch reference on the same inputs, then timed (`substation.timing`);
PyTorch's own op sequence on the canonical layouts is timed as the `torch` row of every fused
operator, whether a kernel implements it yet or not.
Dropout is on (p = 0.1, as in BERT training): kernels regenerate Substation's Philox masks, the torch
rows use PyTorch's dropout.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from substation.graph import LayerGraph, Operator, layer_graph
from substation.kernels.base import KernelParams
from substation.kernels.registry import registry
from substation.kernels.space import layout_space
from substation.profiling import check_profile_dir, gpu_name, run_on_gpus
from substation.records import Candidate, ProfileRow, RecordWriter, candidate_key
from substation.sizes import Size

log = logging.getLogger(__name__)
CSV_NAME = "kernels.csv"
DROPOUT = 0.1
CHECK_TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2}  # max-relative error; the tests hold kernels far tighter


@dataclass(frozen=True)
class KernelPlan:
    points: tuple[KernelParams, ...]
    coverage: dict[str, tuple[int, int]]  # op -> (layout combinations profiled, combinations in the space)


def plan(size: Size, dtypes: Sequence[str], ops: Sequence[str] | None = None, max_combos: int = 64) -> KernelPlan:
    graph, modules = layer_graph(), registry()
    points, coverage = [], {}
    for op in graph.operators:
        if op.name not in modules or (ops and op.name not in ops):
            continue
        space = layout_space(op, size, max_combos)
        coverage[op.name] = (len(space.combos), space.total)
        for dtype in dtypes:
            for layouts in space.combos:
                points += modules[op.name].variants(op.name, size, dtype, layouts)
    return KernelPlan(tuple(points), coverage)


def compile_all(points: Sequence[KernelParams]) -> list:
    """Compile every point with nvcc on all cores (nvcc runs in subprocesses, so threads suffice)."""
    from tqdm import tqdm

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        return list(tqdm(pool.map(lambda p: p.compile(), points), total=len(points), desc="compile", disable=None))


def run(work: KernelPlan, size: Size, dtypes: Sequence[str], out_dir: Path, gpus: Sequence[int], force: bool,
        runs: int = 25) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CSV_NAME
    check_profile_dir(path, size, gpu_name(gpus[0]), force)
    compile_all(work.points)  # fills the disk cache: the GPU processes only load cubins
    shards = [(work.points[i::len(gpus)], dtypes if i == 0 else (), size, runs) for i in range(len(gpus))]
    run_on_gpus(profile, shards, path, gpus)
    return path


def torch_candidate(op: Operator, graph: LayerGraph) -> Candidate:
    layouts = {t: graph.tensors[t].dims for t in op.inputs + op.outputs}
    return Candidate.make(op.name, op.pass_, "torch", {t: layouts[t] for t in op.inputs},
                          {t: layouts[t] for t in op.outputs})


def profile(points: Sequence[KernelParams], baseline_dtypes: Sequence[str], size: Size, runs: int, path: Path,
            device: int, position: int) -> None:
    """Time every point (and, for `baseline_dtypes`, PyTorch's op sequences); append rows to `path`."""
    import torch
    from tqdm import tqdm

    from substation.kernels import gpu_check
    from substation.profiling import versions
    from substation.timing import Timer

    torch.cuda.set_device(device)
    graph, gpu, vers, timer = layer_graph(), gpu_name(device), versions(), Timer(runs=runs)
    with RecordWriter(path) as writer:
        for dtype in baseline_dtypes:  # every fused operator, with a kernel or not: the optimizer's fallback
            sized = size.with_dtype(dtype)
            for op in (o for o in graph.operators if not o.is_contraction):
                cand = torch_candidate(op, graph)
                if candidate_key(cand, sized, gpu) not in writer:
                    timing = timer(gpu_check.torch_runner(op, sized, DROPOUT))
                    writer.write(ProfileRow.make(cand, sized, gpu, vers, timing.runs, timing.median_us, timing.min_us))
        for params in tqdm(points, desc=f"kernels gpu{device}", position=position, disable=None):
            sized = size.with_dtype(params.dtype)
            if candidate_key(params.candidate, sized, gpu) in writer:
                continue
            try:
                work, error = gpu_check.checked_runner(params, sized, DROPOUT)
                if not error <= CHECK_TOLERANCE[params.dtype]:
                    raise RuntimeError(f"outputs differ from the reference: max relative error {error:.2e}")
                timing = timer(work)
                row = ProfileRow.make(params.candidate, sized, gpu, vers, timing.runs, timing.median_us, timing.min_us)
            except Exception as failed:  # a failed variant is a row of its own; the run goes on
                log.warning("%s: %s", params.label, failed)
                row = ProfileRow.make(params.candidate, sized, gpu, vers, 0, None, None, "failed",
                                      f"{type(failed).__name__}: {failed}")
            writer.write(row)
