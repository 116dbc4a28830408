"""The kernel profiler: every variant of every fused-operator kernel, compiled in parallel and timed on the GPU.

Plan (CPU): for each fused operator with a kernel, the layout combinations of `kernels.space` times
each module's knob settings (`variants`). Compile (CPU, all cores). Run (GPU): each variant's outputs
are first checked against the torch reference on the same inputs, then timed (`substation.timing`);
PyTorch's own op sequence on the canonical layouts is timed as the `torch` row of every fused
operator, whether a kernel implements it yet or not. PyTorch's scaled-dot-product attention (flash,
memory-efficient, cuDNN; `kernels/sdpa.py`) is timed as a forward and a backward row covering the whole
attention subgraph, for each backend the GPU offers (by the first GPU's process).
Dropout is on (p = 0.1, as in BERT training): kernels regenerate Substation's Philox masks, the torch
and SDPA rows use PyTorch's dropout.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from substation.errors import LayoutError
from substation.graph import LayerGraph, Operator, layer_graph
from substation.kernels import sdpa
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
    attention: tuple[sdpa.SdpaAttention, ...] = ()  # SDPA candidates (each a forward and a backward row)


def plan(size: Size, dtypes: Sequence[str], ops: Sequence[str] | None = None, max_combos: int = 64,
         attention: bool = True) -> KernelPlan:
    """Kernel variants of the fused operators (all, or `ops`); SDPA candidates too where `attention` and `ops`
    (if given) names an operator SDPA covers."""
    graph, modules = layer_graph(), registry()
    points, coverage = [], {}
    covered = set(sdpa.FORWARD_COVERS + sdpa.BACKWARD_COVERS)
    attentions = [att for dtype in dtypes for att in sdpa.candidates(size.with_dtype(dtype))] if attention and (
        not ops or covered & set(ops)) else []
    for op in graph.operators:
        if op.name not in modules or (ops and op.name not in ops):
            continue
        space = layout_space(op, size, max_combos)
        coverage[op.name] = (len(space.combos), space.total)
        for dtype in dtypes:
            for layouts in space.combos:
                points += modules[op.name].variants(op.name, size, dtype, layouts)
    return KernelPlan(tuple(points), coverage, tuple(attentions))


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
    shards = [(work.points[i::len(gpus)], dtypes if i == 0 else (), size, runs, work.attention if i == 0 else ())
              for i in range(len(gpus))]
    run_on_gpus(profile, shards, path, gpus)
    return path


def torch_candidate(op: Operator, graph: LayerGraph) -> Candidate:
    layouts = {t: graph.tensors[t].dims for t in op.inputs + op.outputs}
    return Candidate.make(op.name, op.pass_, "torch", {t: layouts[t] for t in op.inputs},
                          {t: layouts[t] for t in op.outputs})


def profile(points: Sequence[KernelParams], baseline_dtypes: Sequence[str], size: Size, runs: int,
            attention: Sequence[sdpa.SdpaAttention], path: Path, device: int, position: int) -> None:
    """Time every point (and, for `baseline_dtypes`, PyTorch's op sequences; the SDPA candidates); append rows
    to `path`."""
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
        profile_attention(attention, gpu, vers, timer, writer, position)
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


def profile_attention(attention: Sequence[sdpa.SdpaAttention], gpu: str, vers: dict[str, str], timer,
                      writer: RecordWriter, position: int = 0) -> None:
    """A forward and a backward row per SDPA candidate (each forward row once), each checked against the float32
    reference with dropout off, then timed with dropout on; a backend or layout that fails is a failed row."""
    from tqdm import tqdm

    data: dict[str, sdpa.AttentionData] = {}
    for att in tqdm(attention, desc="sdpa", position=position, disable=None):
        cands = {"forward": att.forward_candidate(), "backward": att.backward_candidate()}
        todo = {p: c for p, c in cands.items() if candidate_key(c, att.size, gpu) not in writer}
        if not todo:
            continue
        rows = {}
        try:
            if att.dtype not in data:
                data[att.dtype] = sdpa.AttentionData.make(att.size)
            att, (fwd_error, bwd_error, forward, backward) = _observed(att, data[att.dtype])
            cands = {"forward": att.forward_candidate(), "backward": att.backward_candidate()}
            todo = {p: c for p, c in cands.items() if candidate_key(c, att.size, gpu) not in writer}
            for pass_, error, work in (("forward", fwd_error, forward), ("backward", bwd_error, backward)):
                if pass_ not in todo:
                    continue
                try:
                    if not error <= CHECK_TOLERANCE[att.dtype]:
                        raise RuntimeError(f"outputs differ from the reference: max relative error {error:.2e}")
                    timing = timer(work)
                    rows[pass_] = ProfileRow.make(todo[pass_], att.size, gpu, vers, timing.runs, timing.median_us,
                                                  timing.min_us)
                except Exception as failed:  # noqa: BLE001 - a failed row of its own; the run goes on
                    rows[pass_] = _failed(todo[pass_], att.size, gpu, vers, failed)
        except Exception as failed:  # noqa: BLE001 - the backend refused: both rows fail
            rows = {p: _failed(c, att.size, gpu, vers, failed) for p, c in todo.items()}
        for row in rows.values():
            writer.write(row)


def _observed(att: sdpa.SdpaAttention, data: sdpa.AttentionData) -> tuple[sdpa.SdpaAttention, tuple]:
    """The attention and its runners; where the backend writes Z or a gradient in another layout than
    `sdpa.z_layout`/`grad_layouts` say, the rows name the layout it really wrote (logged as a warning)."""
    for _ in range(5):
        try:
            return att, sdpa.runners(att, data, DROPOUT)
        except LayoutError as err:
            if not hasattr(err, "produced"):
                raise
            log.warning("%s: %s; recording the layout written", att.label, err)
            att = dataclasses.replace(att, produced=att.produced + (err.produced,))
    return att, sdpa.runners(att, data, DROPOUT)


def _failed(candidate: Candidate, size: Size, gpu: str, vers: dict[str, str], failed: Exception) -> ProfileRow:
    log.warning("%s: %s", candidate.label, failed)
    text = " ".join(f"{type(failed).__name__}: {failed}".split())[:500]
    return ProfileRow.make(candidate, size, gpu, vers, 0, None, None, "failed", text)
