"""The contraction profiler's tasks and the runner that times them on one GPU, in an isolated worker process
(`substation.isolation`).

A task is one piece of work in one dtype (`Job`): a call group (one strided-batched GEMM call and every layout
assignment it executes, timed with legacy cuBLAS and cuBLASLt's top heuristic algorithms), an epilogue group
(the same with cuBLASLt's bias epilogue) or a baseline (PyTorch's einsum on the canonical layouts). The plan
(`profiler.py`) builds the tasks from these records; nothing here imports it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
import torch

from substation.graph import layer_graph
from substation.isolation import Channel, describe
from substation.profiling import gpu_name, versions
from substation.records import Candidate, ProfileRow
from substation.sizes import TORCH_DTYPES, Size
from substation.tc_profiling.cublas import LegacyCublas
from substation.tc_profiling.cublaslt import Algorithm, Handle, LtMatmul
from substation.tc_profiling.epilogues import BiasEpilogue, broadcast
from substation.tc_profiling.gemm import contraction_candidate, einsum_runner, mapping_candidate, operands
from substation.tc_profiling.mapping import GemmCall, GemmMapping
from substation.timing import Timer, Timing

log = logging.getLogger(__name__)
CHECK_RTOL = 1e-2  # an fp16/bf16 result of an fp32-accumulated GEMM vs the fp32 einsum of the same inputs

# An implementation of a call: (impl, options, factory of the call on pointers a, b, c).
Implementation = tuple[str, dict[str, object], Callable[[int, int, int], Callable[[], None]]]


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
class Baseline:
    """PyTorch's einsum of one contraction on its canonical layouts: the contraction's `torch` row."""

    op: str
    layouts: tuple[tuple[str, str], ...]  # (tensor, layout) of A, B and the result


@dataclass(frozen=True)
class Job:
    """One task's payload: a piece of work in one dtype."""

    work: CallGroup | EpilogueGroup | Baseline
    dtype: str


class ContractionRunner:
    """Times jobs on one GPU (`isolation.Runner`): made once per worker process, with its handles and timer."""

    def __init__(self, device: int, size: Size, algorithms: int, runs: int) -> None:
        torch.cuda.set_device(device)
        self.size, self.graph, self.algorithms = size, layer_graph(), algorithms
        self.gpu, self.versions = gpu_name(device), versions()
        self.timer, self.handle, self.legacy = Timer(runs=runs), Handle(), LegacyCublas()
        self.generator = torch.Generator(device="cuda").manual_seed(device)

    def __call__(self, job: Job, channel: Channel) -> None:
        size = self.size.with_dtype(job.dtype)
        if isinstance(job.work, Baseline):
            channel.write([self.baseline(job.work, size)])
        elif isinstance(job.work, CallGroup):
            self.time_group(job.work, size, channel)
        else:
            self.time_epilogue(job.work, size, channel)

    def row(self, cand: Candidate, size: Size, timing: Timing | None, error: str = "") -> ProfileRow:
        if timing is None:
            return ProfileRow.make(cand, size, self.gpu, self.versions, 0, None, None, "failed", error, dropout=None)
        return ProfileRow.make(cand, size, self.gpu, self.versions, timing.runs, timing.median_us, timing.min_us,
                               dropout=None)

    def baseline(self, baseline: Baseline, size: Size) -> ProfileRow:
        """PyTorch's einsum on the canonical layouts."""
        mapping = GemmMapping(baseline.op, baseline.layouts, None)
        tensors = operands(mapping, size.extents, TORCH_DTYPES[size.dtype], self.generator)
        cand = contraction_candidate(self.graph.operator(baseline.op), "torch", baseline.layouts, {})
        return self.row(cand, size, self.timer(einsum_runner(mapping, tensors)))

    def heuristic(self, matmul: LtMatmul) -> tuple[list[Algorithm], str]:
        """cuBLASLt's top heuristic algorithms for the call; and why it offered none, if it did not."""
        from nvmath.bindings.cublasLt import cuBLASLtError

        try:
            found = matmul.algorithms(self.algorithms)
        except cuBLASLtError as error:
            return [], f"cublasLtMatmulAlgoGetHeuristic: {error}"
        return found, "" if found else "cublasLtMatmulAlgoGetHeuristic found no algorithm"

    def implementations(self, call: GemmCall, matmul: LtMatmul, dtype: torch.dtype) -> tuple[list[Implementation], str]:
        """Legacy cuBLAS and each heuristic cuBLASLt algorithm; and why cuBLASLt offered none, if it did not."""
        base = call.options()
        found, failure = self.heuristic(matmul)
        impls: list[Implementation] = [("cublas", base, lambda a, b, c: self.legacy.prepare(call, dtype, a, b, c))]
        impls += [("cublaslt", base | {"algo": rank} | algo.options(),
                   lambda a, b, c, algo=algo: lambda: matmul(a, b, c, algo)) for rank, algo in enumerate(found)]
        return impls, failure

    def group_candidates(self, group: CallGroup, impl: str, options: dict[str, object]) -> list[Candidate]:
        """One candidate per mapping of a call: they all share the call's timing."""
        return [mapping_candidate(self.graph.operator(m.op), m, impl, options) for m in group.mappings]

    def epilogue_candidates(self, group: EpilogueGroup, extra: dict[str, object]) -> list[Candidate]:
        """One candidate per layout assignment of a bias-epilogue call: they all share the call's timing."""
        return [e.candidate(extra, self.graph) for e in group.epilogues]

    def checked_timing(self, work: Callable[[], object], out: torch.Tensor, want: torch.Tensor,
                       what: str) -> tuple[Timing | None, str]:
        """Run `work` once into a NaN-filled `out`, check it against the fp32 `want`, then time it; or why it failed."""
        try:
            out.fill_(float("nan"))
            work()
            error = ((out.float() - want).norm() / want.norm()).item()
            if not error <= CHECK_RTOL:
                raise RuntimeError(f"result differs from {what}: relative error {error:.2e}")
            return self.timer(work), ""
        except Exception as failed:  # a failed call is a row of its own; the group goes on
            return None, describe(failed)

    def time_group(self, group: CallGroup, size: Size, channel: Channel) -> None:
        """Rows for every mapping of the group and every implementation not yet in the profile, each checked
        against an fp32 einsum before it is timed."""
        dtype = TORCH_DTYPES[size.dtype]
        lt_base = self.group_candidates(group, "cublaslt", group.call.options())
        channel.start((c, size) for c in lt_base)  # what fails if cuBLASLt's planning takes the worker down
        matmul = LtMatmul(self.handle, group.call, dtype)
        try:
            impls, failure = self.implementations(group.call, matmul, dtype)
            if failure:
                channel.write(self.row(c, size, None, failure) for c in lt_base)
            todo = [(impl, options, factory) for impl, options, factory in impls
                    if not all(channel.recorded(c, size) for c in self.group_candidates(group, impl, options))]
            if todo:
                self._time_implementations(group, size, todo, channel)
        finally:
            matmul.close()

    def _time_implementations(self, group: CallGroup, size: Size, todo: list[Implementation],
                              channel: Channel) -> None:
        mapping = group.mappings[0]  # every mapping of the group makes this same call on the same bytes
        tensors = operands(mapping, size.extents, TORCH_DTYPES[size.dtype], self.generator)
        (a, la), (b, lb), (c, lc) = mapping.layouts
        want = torch.einsum(f"{la},{lb}->{lc}", tensors[a].float(), tensors[b].float())
        pointers = (tensors[mapping.a_operand].data_ptr(), tensors[mapping.b_operand].data_ptr(), tensors[c].data_ptr())
        for impl, options, factory in todo:
            cands = self.group_candidates(group, impl, options)
            channel.start((cand, size) for cand in cands)
            timing, error = self.checked_timing(factory(*pointers), tensors[c], want, "the einsum")
            channel.write(self.row(cand, size, timing, error) for cand in cands)

    def time_epilogue(self, group: EpilogueGroup, size: Size, channel: Channel) -> None:
        """Rows for every layout assignment of a bias-epilogue call and each heuristic cuBLASLt algorithm not yet
        in the profile, each checked against the fp32 einsum plus the bias first."""
        base = self.epilogue_candidates(group, {})
        channel.start((c, size) for c in base)  # what fails if cuBLASLt's planning takes the worker down
        matmul = LtMatmul(self.handle, group.call, TORCH_DTYPES[size.dtype], "bias", group.bias_batch_stride)
        try:
            found, failure = self.heuristic(matmul)
            if failure:
                channel.write(self.row(c, size, None, failure) for c in base)
            todo = [({"algo": rank} | algo.options(), algo) for rank, algo in enumerate(found)]
            todo = [(extra, algo) for extra, algo in todo
                    if not all(channel.recorded(c, size) for c in self.epilogue_candidates(group, extra))]
            if todo:
                self._time_epilogue_algorithms(group, size, matmul, todo, channel)
        finally:
            matmul.close()

    def _time_epilogue_algorithms(self, group: EpilogueGroup, size: Size, matmul: LtMatmul,
                                  todo: list[tuple[dict[str, object], Algorithm]], channel: Channel) -> None:
        dtype = TORCH_DTYPES[size.dtype]
        first = group.epilogues[0]  # every assignment of the group makes this same call on the same bytes
        mapping = first.mapping
        tensors = operands(mapping, size.extents, dtype, self.generator)
        bias = torch.randn([size.extents[d] for d in first.bias_layout], generator=self.generator,
                           device="cuda").to(dtype)
        matmul.set_epilogue_pointer(bias.data_ptr())
        (a, la), (b, lb), (c, lc) = mapping.layouts
        want = (torch.einsum(f"{la},{lb}->{lc}", tensors[a].float(), tensors[b].float())
                + broadcast(bias.float(), first.bias_layout, lc))
        pointers = (tensors[mapping.a_operand].data_ptr(), tensors[mapping.b_operand].data_ptr(), tensors[c].data_ptr())
        for extra, algo in todo:
            cands = self.epilogue_candidates(group, extra)
            channel.start((cand, size) for cand in cands)
            timing, error = self.checked_timing(lambda algo=algo: matmul(*pointers, algo), tensors[c], want,
                                                f"the einsum plus {first.split.bias}")
            channel.write(self.row(cand, size, timing, error) for cand in cands)
