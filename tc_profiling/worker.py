"""The GPU side of the contraction profiler: one process, one GPU, one output file. GPU only."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from substation.graph import layer_graph
from substation.profiling import gpu_name, versions
from substation.records import Candidate, ProfileRow, RecordWriter, candidate_key
from substation.sizes import Size
from substation.tc_profiling.mapping import GemmMapping
from substation.tc_profiling.epilogues import broadcast
from substation.tc_profiling.profiler import CallGroup, EpilogueGroup, candidate, mapping_candidate, rows_for
from substation.timing import Timer, Timing

log = logging.getLogger(__name__)
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CHECK_RTOL = 1e-2  # an fp16/bf16 result of an fp32-accumulated GEMM vs the fp32 einsum of the same inputs


class ContractionProfiler:
    """Times the implementations of contractions in one dtype on one GPU and turns them into rows."""

    def __init__(self, size: Size, device: int, algorithms: int, runs: int) -> None:
        from substation.tc_profiling.gemm import Handle, LegacyCublas

        self.size, self.graph, self.algorithms = size, layer_graph(), algorithms
        self.dtype = TORCH_DTYPES[size.dtype]
        self.gpu, self.versions = gpu_name(device), versions()
        self.timer, self.handle, self.legacy = Timer(runs=runs), Handle(), LegacyCublas()
        self.generator = torch.Generator(device="cuda").manual_seed(device)

    def row(self, cand: Candidate, timing: Timing | None, error: str = "") -> ProfileRow:
        if timing is None:
            return ProfileRow.make(cand, self.size, self.gpu, self.versions, 0, None, None, "failed", error)
        return ProfileRow.make(cand, self.size, self.gpu, self.versions, timing.runs, timing.median_us, timing.min_us)

    def baseline(self, cand: Candidate, layouts: tuple[tuple[str, str], ...]) -> ProfileRow:
        """PyTorch's einsum on the canonical layouts."""
        from substation.tc_profiling.gemm import einsum_runner, operands

        mapping = GemmMapping(cand.op, layouts, None)
        tensors = operands(mapping, self.size.extents, self.dtype, self.generator)
        return self.row(cand, self.timer(einsum_runner(mapping, tensors)))

    def implementations(self, group: CallGroup, matmul) -> tuple[list[tuple[str, dict, Callable]], str]:
        """(impl, options, factory of the call on pointers a, b, c) for legacy cuBLAS and each
        heuristic cuBLASLt algorithm; and why cuBLASLt offered none, if it did not."""
        from nvmath.bindings.cublasLt import cuBLASLtError

        call, base = group.call, group.call.options()
        impls: list[tuple[str, dict, Callable]] = [
            ("cublas", base, lambda a, b, c: self.legacy.prepare(call, self.dtype, a, b, c))]
        try:
            found = matmul.algorithms(self.algorithms)
        except cuBLASLtError as error:
            return impls, f"cublasLtMatmulAlgoGetHeuristic: {error}"
        for rank, algo in enumerate(found):
            impls.append(("cublaslt", base | {"algo": rank} | algo.options(),
                          lambda a, b, c, algo=algo: lambda: matmul(a, b, c, algo)))
        return impls, "" if found else "cublasLtMatmulAlgoGetHeuristic found no algorithm"

    def time_group(self, group: CallGroup, done: Callable[[str], bool]) -> list[ProfileRow]:
        """Rows for every mapping of the group and every implementation not yet in the profile.

        Each implementation's result is checked against an fp32 einsum before it is timed."""
        from substation.tc_profiling.gemm import LtMatmul

        matmul = LtMatmul(self.handle, group.call, self.dtype)
        try:
            return self._time_group(group, matmul, done)
        finally:
            matmul.close()

    def _time_group(self, group: CallGroup, matmul, done: Callable[[str], bool]) -> list[ProfileRow]:
        from substation.tc_profiling.gemm import operands

        impls, failure = self.implementations(group, matmul)
        rows_of = lambda impl, options, timing=None, error="": rows_for(  # noqa: E731
            self.graph, group.mappings, impl, options, lambda c: self.row(c, timing, error))
        rows = rows_of("cublaslt", group.call.options(), error=failure) if failure else []
        impls = [(impl, options, factory) for impl, options, factory in impls
                 if not all(done(candidate_key(mapping_candidate(self.graph, m, impl, options), self.size, self.gpu))
                            for m in group.mappings)]
        if not impls:
            return rows
        mapping = group.mappings[0]  # every mapping of the group makes this same call on the same bytes
        tensors = operands(mapping, self.size.extents, self.dtype, self.generator)
        (a, la), (b, lb), (c, lc) = mapping.layouts
        want = torch.einsum(f"{la},{lb}->{lc}", tensors[a].float(), tensors[b].float())
        pointers = (tensors[mapping.a_operand].data_ptr(), tensors[mapping.b_operand].data_ptr(), tensors[c].data_ptr())
        for impl, options, factory in impls:
            try:
                work = factory(*pointers)
                tensors[c].fill_(float("nan"))
                work()
                error = ((tensors[c].float() - want).norm() / want.norm()).item()
                if not error <= CHECK_RTOL:
                    raise RuntimeError(f"result differs from the einsum: relative error {error:.2e}")
                rows += rows_of(impl, options, self.timer(work))
            except Exception as failed:  # a failed call is a row of its own; the run goes on
                log.warning("%s %s: %s", impl, group.call, failed)
                rows += rows_of(impl, options, error=f"{type(failed).__name__}: {failed}")
        return rows

    def time_epilogue(self, group: EpilogueGroup, done: Callable[[str], bool]) -> list[ProfileRow]:
        """Rows for every layout assignment of a bias-epilogue call and each heuristic cuBLASLt algorithm not yet
        in the profile, each checked against the fp32 einsum plus the bias first."""
        from nvmath.bindings.cublasLt import cuBLASLtError

        from substation.tc_profiling.gemm import LtMatmul, operands

        matmul = LtMatmul(self.handle, group.call, self.dtype, "bias", group.bias_batch_stride)
        rows_of = lambda extra, timing=None, error="": [  # noqa: E731
            self.row(e.candidate(extra, self.graph), timing, error) for e in group.epilogues]
        try:
            try:
                found = matmul.algorithms(self.algorithms)
            except cuBLASLtError as error:
                return rows_of({}, error=f"cublasLtMatmulAlgoGetHeuristic: {error}")
            if not found:
                return rows_of({}, error="cublasLtMatmulAlgoGetHeuristic found no algorithm")
            todo = [(rank, algo) for rank, algo in enumerate(found)
                    if not all(done(candidate_key(e.candidate({"algo": rank} | algo.options(), self.graph), self.size,
                                                  self.gpu)) for e in group.epilogues)]
            if not todo:
                return []
            first = group.epilogues[0]  # every assignment of the group makes this same call on the same bytes
            mapping, split = first.mapping, first.split
            tensors = operands(mapping, self.size.extents, self.dtype, self.generator)
            bias = torch.randn([self.size.extents[d] for d in first.bias_layout], generator=self.generator,
                               device="cuda").to(self.dtype)
            matmul.set_epilogue_pointer(bias.data_ptr())
            (a, la), (b, lb), (c, lc) = mapping.layouts
            want = (torch.einsum(f"{la},{lb}->{lc}", tensors[a].float(), tensors[b].float())
                    + broadcast(bias.float(), first.bias_layout, lc))
            pointers = (tensors[mapping.a_operand].data_ptr(), tensors[mapping.b_operand].data_ptr(),
                        tensors[c].data_ptr())
            rows = []
            for rank, algo in todo:
                extra = {"algo": rank} | algo.options()
                try:
                    tensors[c].fill_(float("nan"))
                    matmul(*pointers, algo)
                    error = ((tensors[c].float() - want).norm() / want.norm()).item()
                    if not error <= CHECK_RTOL:
                        raise RuntimeError(f"result differs from the einsum plus {split.bias}: relative error "
                                           f"{error:.2e}")
                    rows += rows_of(extra, self.timer(lambda algo=algo: matmul(*pointers, algo)))
                except Exception as failed:  # a failed call is a row of its own; the run goes on
                    log.warning("%s %s: %s", first.candidate(extra).impl, group.call, failed)
                    rows += rows_of(extra, error=f"{type(failed).__name__}: {failed}")
            return rows
        finally:
            matmul.close()

    def close(self) -> None:
        self.handle.close()
        self.legacy.close()


def profile(groups: Sequence[CallGroup], baselines: Sequence, size: Size, dtypes: Sequence[str], algorithms: int,
            runs: int, epilogues: Sequence[EpilogueGroup], path: Path, device: int, position: int) -> None:
    """Time every call group, epilogue group (and the torch baselines) in every dtype; append the new rows to
    `path`."""
    torch.cuda.set_device(device)
    with RecordWriter(path) as writer:
        for dtype in dtypes:
            profiler = ContractionProfiler(size.with_dtype(dtype), device, algorithms, runs)
            for op, layouts in baselines:
                cand = candidate(profiler.graph, op, "torch", layouts, {})
                if candidate_key(cand, profiler.size, profiler.gpu) not in writer:
                    writer.write(profiler.baseline(cand, layouts))
            for group in tqdm(groups, desc=f"contractions {dtype} gpu{device}", position=position, disable=None):
                for row in profiler.time_group(group, writer.has):
                    if row.key not in writer:
                        writer.write(row)
            for group in tqdm(epilogues, desc=f"bias epilogues {dtype} gpu{device}", position=position, disable=None):
                for row in profiler.time_epilogue(group, writer.has):
                    if row.key not in writer:
                        writer.write(row)
            profiler.close()
