"""Legacy cuBLAS (impl `cublas`): `cublasGemmStridedBatchedEx` with CUBLAS_GEMM_DEFAULT (on the H100 every
legacy algorithm id gives the same kernel, so only the default is timed). nvmath is an optional (GPU)
dependency, needed only to bind.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from substation.errors import DeviceError
from substation.graph import Operator
from substation.protocol import Choice
from substation.tc_profiling.cublaslt import COMPUTE_32F, CUDA_TYPES
from substation.tc_profiling.gemm import GemmImplementation, GemmRun
from substation.tc_profiling.mapping import GemmCall

try:
    from nvmath.bindings import cublas
except ImportError:  # a CPU-only install
    cublas = None

CUBLAS_GEMM_DEFAULT = -1


class LegacyCublas:
    """A cuBLAS handle; its stream is set only when a call comes on another stream than the last one."""

    def __init__(self) -> None:
        if cublas is None:
            raise DeviceError("cuBLAS needs nvmath-python: pip install -e '.[gpu]'")
        self.ptr = cublas.create()
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.zeros(1, dtype=np.float32)
        self._scalars = (self.alpha.ctypes.data, self.beta.ctypes.data)
        self._stream: int | None = None

    def __call__(self, call: GemmCall, dtype: torch.dtype, a: int, b: int, c: int, stream: int | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        """C = op(A)·op(B) on device pointers a, b, c, on `stream` (default: PyTorch's current stream); A and B in
        `dtype`, C in `out_dtype` (default `dtype`)."""
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        if stream != self._stream:
            cublas.set_stream(self.ptr, stream)
            self._stream = stream
        alpha, beta = self._scalars
        cuda_type = CUDA_TYPES[dtype]
        cublas.gemm_strided_batched_ex(
            self.ptr, int(call.transa), int(call.transb), call.m, call.n, call.k, alpha,
            a, cuda_type, call.lda, call.stride_a, b, cuda_type, call.ldb, call.stride_b,
            beta, c, CUDA_TYPES[out_dtype or dtype], call.ldc, call.stride_c, call.batch, COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT)

    def prepare(self, call: GemmCall, dtype: torch.dtype, a: int, b: int, c: int):
        """The call on fixed device pointers, as a closure (the profiler's timed work)."""
        return lambda: self(call, dtype, a, b, c)

    def close(self) -> None:
        cublas.destroy(self.ptr)


@functools.cache
def device_cublas(device: int) -> LegacyCublas:
    """One legacy cuBLAS handle per device, shared by every bound call of the process."""
    with torch.cuda.device(device):
        return LegacyCublas()


class Cublas(GemmImplementation):
    """Legacy cuBLAS's default algorithm."""

    impl = "cublas"

    def prepare(self, ops: Sequence[Operator], choice: Choice, call: GemmCall, dtype: torch.dtype,
                device: torch.device, out_dtype: torch.dtype) -> GemmRun:
        legacy = device_cublas(device.index)
        return lambda a, b, c, stream: legacy(call, dtype, a, b, c, stream, out_dtype)
