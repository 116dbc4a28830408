"""The kernel profiler: every variant of every fused-operator kernel, compiled in parallel and timed on the GPU.

Plan (CPU): for each fused operator with a kernel, the layout combinations of `kernels.space` times
each module's knob settings (`variants`). Compile (CPU, all cores). Run (GPU, an isolated worker process per
GPU, `substation.isolation`): each variant's outputs are first checked against the torch reference on the
same inputs, then timed (`substation.timing`); PyTorch's own op sequence on the canonical layouts is timed as
the `torch` row of every fused operator, whether a kernel implements it yet or not. PyTorch's
scaled-dot-product attention (flash, memory-efficient, cuDNN; `kernels/sdpa.py`) is timed as a forward and a
backward row covering the whole attention subgraph, for each backend the GPU offers; so are our fused attention
kernels (impl `attention`, `kernels/attention.py`: `profiled_points`, each forward and backward point a task, checked
against the float64 reference with the same dropout masks), and the GEMMs with our epilogues (impl
`cutlass_epilogue`, `kernels/gemm_epilogue.py`: `profiled_groups`, one kernel on one call a task whose rows are
every layout assignment the call executes), and qkv_proj's backward from the attention's separate gradients (impl
`cublaslt_sliced`, `kernels/qkv_backward.py`: `profiled_groups`, one layout assignment a task) or its data gradient
with the residual's added in one call (impl `cublaslt_residual`, `kernels/residual_dgrad.py`). A candidate that fails
its check, raises, crashes or hangs its worker is a failed row; the rest go on.
Dropout is on (p = 0.1, as in BERT training, unless `run` is given another): kernels regenerate Substation's
Philox masks, the torch and SDPA rows use PyTorch's dropout; every row records the probability.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from substation.device import DeviceSpec
from substation.errors import LayoutError
from substation.graph import LayerGraph, Operator, layer_graph
from substation.isolation import DEFAULT_TIMEOUT_S, Channel, Task, describe, run_isolated
from substation.kernels import attention as fused_attention
from substation.kernels import gemm_epilogue, gpu_check, qkv_backward, residual_dgrad, sdpa
from substation.kernels.base import KernelParams
from substation.implementations import registry
from substation.kernels.registry import FusedKernels
from substation.kernels.space import profiled_layout_space
from substation.profiling import check_profile_dir, gpu_name, versions
from substation.records import DEFAULT_DROPOUT, Candidate, ProfileRow, candidate_key
from substation.sizes import Size
from substation.timing import Timer, Timing

log = logging.getLogger(__name__)
CSV_NAME = "kernels.csv"
CHECK_TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2}  # max-relative error; the tests hold kernels far tighter


@dataclass(frozen=True)
class KernelPlan:
    points: tuple[KernelParams, ...]
    coverage: dict[str, tuple[int, int]]  # op -> (layout combinations profiled, combinations in the space)
    attention: tuple[sdpa.SdpaAttention, ...] = ()  # SDPA candidates (each a forward and a backward row)
    attention_kernels: tuple[KernelParams, ...] = ()  # our fused attention's forward and backward points
    gemm_epilogues: tuple[gemm_epilogue.EpilogueGroup, ...] = ()  # GEMMs with our epilogues, per kernel and call
    sliced: tuple[qkv_backward.SlicedGroup, ...] = ()  # qkv_proj's backward on dQ, dK, dV, per layout assignment
    residual: tuple[residual_dgrad.ResidualGroup, ...] = ()  # qkv_proj_dgrad + residual_bwd, per assignment and rank


def plan(size: Size, dtypes: Sequence[str], ops: Sequence[str] | None = None, max_combos: int = 64,
         attention: bool = True, dropout: float = DEFAULT_DROPOUT) -> KernelPlan:
    """Kernel variants of the fused operators (all, or `ops`); SDPA candidates (the backends installed that run at
    `dropout`) and our fused attention's points too where `attention` and `ops` (if given) names an operator of the
    attention subgraph; the GEMMs with our epilogues and qkv_proj's backward covers where `ops` (if given) names an
    operator they cover."""
    graph = layer_graph()
    implementations = registry(graph)
    backends = [found.backend for found in implementations.of_type(sdpa.Sdpa) if sdpa.runs_at(found.backend, dropout)]
    covered = set(sdpa.FORWARD_COVERS + sdpa.BACKWARD_COVERS)
    timed = attention and (not ops or bool(covered & set(ops)))
    attentions = [att for dtype in dtypes for att in sdpa.candidates(size.with_dtype(dtype), backends)] if timed else []
    fused = [params for dtype in dtypes for params in fused_attention.profiled_points(size.with_dtype(dtype), dtype)
             ] if timed and fused_attention.IMPL in implementations.names else []
    fused_ops = {name for cover in implementations.covers(gemm_epilogue.IMPL) for name in cover}
    epilogues = [group for dtype in dtypes for group in gemm_epilogue.profiled_groups(size.with_dtype(dtype))
                 ] if fused_ops and (not ops or fused_ops & set(ops)) else []
    named = lambda module: module.IMPL in implementations.names and (not ops or set(module.COVER) & set(ops))  # noqa: E731
    sliced = [group for dtype in dtypes for group in qkv_backward.profiled_groups(size.with_dtype(dtype))
              ] if named(qkv_backward) else []
    residual = [group for dtype in dtypes for group in residual_dgrad.profiled_groups(size.with_dtype(dtype))
                ] if named(residual_dgrad) else []
    points, coverage = [], {}
    for (name,) in implementations.covers(FusedKernels.impl):
        op = graph.operator(name)
        if ops and name not in ops:
            continue
        kernels = implementations.find(FusedKernels.impl, (name,))
        space = profiled_layout_space(op, size, max_combos)
        coverage[name] = (len(space.combos), space.total)
        for dtype in dtypes:
            for layouts in space.combos:
                points += kernels.variants(op, size.with_dtype(dtype), layouts)
    return KernelPlan(tuple(points), coverage, tuple(attentions), tuple(fused), tuple(epilogues), tuple(sliced),
                      tuple(residual))


def compile_all(points: Sequence[KernelParams], spec: DeviceSpec) -> list:
    """Compile every point for `spec`'s architecture with nvcc on all cores (nvcc runs in subprocesses, so
    threads suffice)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        return list(tqdm(pool.map(lambda p: p.compile(spec), points), total=len(points), desc="compile",
                         disable=None))


@dataclass(frozen=True)
class TorchBaseline:
    """PyTorch's op sequence of one fused operator on its canonical layouts: the operator's `torch` row."""

    op: str
    dtype: str


def torch_candidate(op: Operator, graph: LayerGraph) -> Candidate:
    layouts = {t: graph.tensors[t].dims for t in op.inputs + op.outputs}
    return Candidate.make(op.name, op.pass_, "torch", {t: layouts[t] for t in op.inputs},
                          {t: layouts[t] for t in op.outputs})


def tasks(work: KernelPlan, size: Size, dtypes: Sequence[str]) -> list[Task]:
    """The isolated tasks, each with the rows it writes: PyTorch's op sequence of every fused operator (with a
    kernel or not: the optimizer's fallback) in each dtype, the SDPA candidates, our fused attention's points, then
    the kernel variants."""
    graph = layer_graph()
    baselines = [Task(TorchBaseline(op.name, dtype), ((torch_candidate(op, graph), size.with_dtype(dtype)),))
                 for dtype in dtypes for op in graph.operators if not op.is_contraction]
    attention = [Task(att, ((att.forward_candidate(), att.size), (att.backward_candidate(), att.size)))
                 for att in work.attention]
    kernels = [Task(p, ((p.candidate, size.with_dtype(p.dtype)),)) for p in work.attention_kernels + work.points]
    epilogues = [Task(g, tuple((c, size.with_dtype(g.dtype)) for c in g.candidates)) for g in work.gemm_epilogues]
    calls = [Task(g, ((g.candidate, size.with_dtype(g.dtype)),)) for g in work.sliced + work.residual]
    return baselines + attention + kernels + epilogues + calls


def run(work: KernelPlan, size: Size, dtypes: Sequence[str], out_dir: Path, gpus: Sequence[int], force: bool,
        runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S, dropout: float = DEFAULT_DROPOUT) -> Path:
    """Profile into out_dir/kernels.csv on the given GPUs (an isolated worker process each), every candidate
    with dropout probability `dropout`; returns the path. `timeout`: seconds one candidate (checked and timed)
    may take before its worker is killed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CSV_NAME
    names = {g: gpu_name(g) for g in gpus}
    # The workers only load cubins; a resumed run compiles only what it has yet to time.
    recorded = check_profile_dir(path, size, names[gpus[0]], dropout, force)
    missing = lambda p, cands: any(candidate_key(c, size.with_dtype(p.dtype), names[gpus[0]]) not in recorded  # noqa: E731
                                   for c in cands)
    compile_all([p for p in work.attention_kernels + work.points if missing(p, (p.candidate,))]
                + [g for g in work.gemm_epilogues if missing(g, g.candidates)], DeviceSpec.of(gpus[0]))
    setup = functools.partial(KernelRunner, size=size, runs=runs, dropout=dropout)
    run_isolated(setup, tasks(work, size, dtypes), path, names, versions(), dropout, timeout, desc="kernels")
    return path


def check_error(error: float, dtype: str) -> None:
    if not error <= CHECK_TOLERANCE[dtype]:
        raise RuntimeError(f"outputs differ from the reference: max relative error {error:.2e}")


class KernelRunner:
    """Times kernel variants, PyTorch baselines and SDPA candidates on one GPU (`isolation.Runner`). A kernel or
    baseline that raises leaves its task: the parent records its row failed."""

    def __init__(self, device: int, size: Size, runs: int, dropout: float) -> None:
        torch.cuda.set_device(device)
        self.size, self.graph, self.dropout = size, layer_graph(), dropout
        self.gpu, self.versions, self.timer = gpu_name(device), versions(), Timer(runs=runs)
        self.attention_data: dict[str, sdpa.AttentionData] = {}  # per dtype, made once per worker

    def __call__(self, payload: Any, channel: Channel) -> None:
        if isinstance(payload, fused_attention.AttentionTiles):
            channel.write([self.attention_kernel(payload)])
        elif isinstance(payload, KernelParams):
            channel.write([self.kernel(payload)])
        elif isinstance(payload, gemm_epilogue.EpilogueGroup):
            channel.write(self.gemm_epilogue(payload))
        elif isinstance(payload, qkv_backward.SlicedGroup | residual_dgrad.ResidualGroup):
            channel.write([self.library_calls(payload)])
        elif isinstance(payload, TorchBaseline):
            channel.write([self.baseline(payload)])
        else:
            self.attention(payload, channel)

    def row(self, candidate: Candidate, size: Size, timing: Timing) -> ProfileRow:
        return ProfileRow.make(candidate, size, self.gpu, self.versions, timing.runs, timing.median_us, timing.min_us,
                               dropout=self.dropout)

    def kernel(self, params: KernelParams) -> ProfileRow:
        sized = self.size.with_dtype(params.dtype)
        work, error = gpu_check.checked_runner(params, sized, self.dropout)
        check_error(error, params.dtype)
        return self.row(params.candidate, sized, self.timer(work))

    def attention_kernel(self, params: KernelParams) -> ProfileRow:
        """A forward or backward point of our fused attention, checked against the float64 reference (the same
        dropout masks) before it is timed; a backward point reads the LSE of one forward launch."""
        sized = self.size.with_dtype(params.dtype)
        work, error = fused_attention.checked_runner(params, sized, self.dropout)
        check_error(error, params.dtype)
        return self.row(params.candidate, sized, self.timer(work))

    def gemm_epilogue(self, group: gemm_epilogue.EpilogueGroup) -> list[ProfileRow]:
        """A GEMM with our epilogue on its call, checked against the float64 reference, then timed: one row per
        layout assignment the call executes."""
        sized = self.size.with_dtype(group.dtype)
        work, error = gemm_epilogue.checked_runner(group, sized)
        check_error(error, group.dtype)
        timing = self.timer(work)
        return [self.row(candidate, sized, timing) for candidate in group.candidates]

    def library_calls(self, group: qkv_backward.SlicedGroup | residual_dgrad.ResidualGroup) -> ProfileRow:
        """A cover of qkv_proj's backward made of cuBLASLt calls (and our bias-gradient kernel), checked against the
        float64 reference of its operators, then timed."""
        sized = self.size.with_dtype(group.dtype)
        work, error = group.checked_runner(sized)
        check_error(error, group.dtype)
        return self.row(group.candidate, sized, self.timer(work))

    def baseline(self, baseline: TorchBaseline) -> ProfileRow:
        sized, op = self.size.with_dtype(baseline.dtype), self.graph.operator(baseline.op)
        work = gpu_check.torch_runner(op, sized, self.dropout)
        return self.row(torch_candidate(op, self.graph), sized, self.timer(work))

    def attention(self, att: sdpa.SdpaAttention, channel: Channel) -> None:
        """A forward and a backward row (each forward row once), each checked against the float32 reference with
        dropout off, then timed with dropout on. A backend that refuses the layouts raises: both rows fail."""
        if att.dtype not in self.attention_data:
            self.attention_data[att.dtype] = sdpa.AttentionData.make(att.size)
        att, (fwd_error, bwd_error, forward, backward) = _observed(att, self.attention_data[att.dtype], self.dropout)
        for cand, error, work in ((att.forward_candidate(), fwd_error, forward),
                                  (att.backward_candidate(), bwd_error, backward)):
            if channel.recorded(cand, att.size):
                continue
            channel.start([(cand, att.size)])
            try:
                check_error(error, att.dtype)
                row = self.row(cand, att.size, self.timer(work))
            except Exception as failed:  # a failed pass is a row of its own; the other pass goes on
                row = ProfileRow.make(cand, att.size, self.gpu, self.versions, 0, None, None, "failed",
                                      describe(failed), dropout=self.dropout)
            channel.write([row])


def _observed(att: sdpa.SdpaAttention, data: sdpa.AttentionData, dropout: float
              ) -> tuple[sdpa.SdpaAttention, tuple]:
    """The attention and its runners; where the backend writes Z or a gradient in another layout than
    `sdpa.z_layout`/`grad_layouts` say, the rows name the layout it really wrote (logged as a warning)."""
    for _ in range(5):
        try:
            return att, sdpa.runners(att, data, dropout)
        except LayoutError as err:
            if not hasattr(err, "produced"):
                raise
            log.warning("%s: %s; recording the layout written", att.label, err)
            att = dataclasses.replace(att, produced=att.produced + (err.produced,))
    return att, sdpa.runners(att, data, dropout)
