"""The GEMM implementations a contraction row can name, each a prepared call on torch tensors.

`cublaslt`: cuBLASLt with one of its heuristic algorithms (tc_profiling.cublaslt). `cublas`: the
legacy `cublasGemmStridedBatchedEx` with CUBLAS_GEMM_DEFAULT (on the H100 every legacy algorithm id
gives the same kernel, so only the default is timed). `torch`: `torch.einsum` on the layouts, what
PyTorch does with them (a copy included where its matmul cannot take them). GPU only.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from nvmath.bindings import cublas

from substation.tc_profiling.cublaslt import COMPUTE_32F, CUDA_TYPES, Handle, LtMatmul
from substation.tc_profiling.mapping import GemmCall, GemmMapping

CUBLAS_GEMM_DEFAULT = -1


class LegacyCublas:
    """A cuBLAS handle bound to PyTorch's current stream."""

    def __init__(self) -> None:
        self.ptr = cublas.create()
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.zeros(1, dtype=np.float32)

    def __call__(self, call: GemmCall, dtype: torch.dtype, a: int, b: int, c: int) -> None:
        """C = op(A)·op(B) on device pointers a, b, c, on PyTorch's current stream."""
        cublas.set_stream(self.ptr, torch.cuda.current_stream().cuda_stream)
        cublas.gemm_strided_batched_ex(
            self.ptr, int(call.transa), int(call.transb), call.m, call.n, call.k, self.alpha.ctypes.data,
            a, CUDA_TYPES[dtype], call.lda, call.stride_a, b, CUDA_TYPES[dtype], call.ldb, call.stride_b,
            self.beta.ctypes.data, c, CUDA_TYPES[dtype], call.ldc, call.stride_c, call.batch, COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT)

    def prepare(self, call: GemmCall, dtype: torch.dtype, a: int, b: int, c: int) -> Callable[[], None]:
        """The call on fixed device pointers, as a closure."""
        return lambda: self(call, dtype, a, b, c)

    def close(self) -> None:
        cublas.destroy(self.ptr)


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


__all__ = ["Handle", "LegacyCublas", "LtMatmul", "einsum_runner", "operands"]
