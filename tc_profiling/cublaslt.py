"""cuBLASLt through nvmath-python's bindings: one strided-batched GEMM, described once, run many times.

The descriptors (operation, the three matrix layouts, epilogue) are built once per call shape, so a
run costs one `cublasLtMatmul` and no re-planning. An algorithm is recorded by its configuration
attributes (id, tile, stages, split-K, ...), from which `algorithm_from_options` rebuilds the same
opaque `cublasLtMatmulAlgo_t`: the call the Encoder makes is the call that was timed.
GPU only: nvmath is imported here, not by the CPU core.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from nvmath.bindings import cublasLt as lt

from substation.tc_profiling.mapping import GemmCall

CUDA_R_32F = 0
CUDA_TYPES = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation for fp16 and bf16 inputs
EPILOGUES = {
    "none": lt.Epilogue.DEFAULT,
    "bias": lt.Epilogue.BIAS,  # D = A·B + bias (bias along D's rows, broadcast over columns)
    "gelu_bias": lt.Epilogue.GELU_BIAS,  # cuBLASLt's GELU is the tanh approximation (see tests)
    "bgradb": lt.Epilogue.BGRADB,  # D = A·B and bias gradient = sum of B over its k dimension
}
# The algorithm configuration attributes that, with the algorithm id, pin down one algorithm.
ALGO_CONFIG = {
    "algo_id": lt.MatmulAlgoConfigAttribute.ID,
    "tile": lt.MatmulAlgoConfigAttribute.TILE_ID,
    "stages": lt.MatmulAlgoConfigAttribute.STAGES_ID,
    "splitk": lt.MatmulAlgoConfigAttribute.SPLITK_NUM,
    "reduction": lt.MatmulAlgoConfigAttribute.REDUCTION_SCHEME,
    "swizzle": lt.MatmulAlgoConfigAttribute.CTA_SWIZZLING,
    "custom": lt.MatmulAlgoConfigAttribute.CUSTOM_OPTION,
    "inner_shape": lt.MatmulAlgoConfigAttribute.INNER_SHAPE_ID,
    "cluster_shape": lt.MatmulAlgoConfigAttribute.CLUSTER_SHAPE_ID,
}
ALGO_CONFIG_DTYPE = {"inner_shape": np.uint16, "cluster_shape": np.uint16, "algo_id": np.int32}
WORKSPACE_BYTES = 32 << 20


def _set(setter, obj: int, attr, value, dtype) -> None:
    buf = np.array([value], dtype=dtype)
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


class Handle:
    """A cuBLASLt handle with its workspace on the current device."""

    def __init__(self) -> None:
        self.ptr = lt.create()
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    def close(self) -> None:
        lt.destroy(self.ptr)


@dataclass
class Algorithm:
    """An opaque cublasLtMatmulAlgo_t (64 bytes) and the workspace it needs."""

    data: np.ndarray  # uint64[8]
    workspace: int

    def __post_init__(self) -> None:
        self.ptr = self.data.ctypes.data  # the opaque struct's address, for cuBLASLt calls

    def options(self) -> dict[str, int]:
        values = {}
        for name, attr in ALGO_CONFIG.items():
            buf = np.zeros(1, dtype=ALGO_CONFIG_DTYPE.get(name, np.uint32))
            written = np.zeros(1, dtype=np.uint64)
            lt.matmul_algo_config_get_attribute(self.ptr, attr, buf.ctypes.data, buf.itemsize, written.ctypes.data)
            values[name] = int(buf[0])
        return values


class LtMatmul:
    """One cuBLASLt matmul for a GemmCall, in `dtype` with fp32 accumulation and an optional epilogue."""

    def __init__(self, handle: Handle, call: GemmCall, dtype: torch.dtype, epilogue: str = "none",
                 bias_batch_stride: int = 0) -> None:
        """`bias_batch_stride`: elements between the bias vectors of consecutive batches (0: one for all)."""
        self.handle, self.call, self.dtype, self.epilogue = handle, call, dtype, epilogue
        cuda_type = CUDA_TYPES[dtype]
        self.desc = lt.matmul_desc_create(COMPUTE_32F, CUDA_R_32F)
        attr = lt.MatmulDescAttribute
        _set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSA, int(call.transa), np.int32)
        _set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSB, int(call.transb), np.int32)
        _set(lt.matmul_desc_set_attribute, self.desc, attr.EPILOGUE, int(EPILOGUES[epilogue]), np.uint32)
        if bias_batch_stride:
            _set(lt.matmul_desc_set_attribute, self.desc, attr.BIAS_BATCH_STRIDE, bias_batch_stride, np.int64)
        a_shape = (call.k, call.m) if call.transa else (call.m, call.k)
        b_shape = (call.n, call.k) if call.transb else (call.k, call.n)
        self.a = self._layout(cuda_type, a_shape, call.lda, call.stride_a)
        self.b = self._layout(cuda_type, b_shape, call.ldb, call.stride_b)
        self.c = self._layout(cuda_type, (call.m, call.n), call.ldc, call.stride_c)
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.zeros(1, dtype=np.float32)
        # Raw addresses, resolved once: a call then passes plain ints (numpy's .ctypes costs µs per access).
        self._scalars = (self.alpha.ctypes.data, self.beta.ctypes.data)
        self._workspace = handle.workspace.data_ptr()

    def _layout(self, cuda_type: int, shape: tuple[int, int], ld: int, batch_stride: int) -> int:
        layout = lt.matrix_layout_create(cuda_type, shape[0], shape[1], ld)
        attr = lt.MatrixLayoutAttribute
        _set(lt.matrix_layout_set_attribute, layout, attr.BATCH_COUNT, self.call.batch, np.int32)
        _set(lt.matrix_layout_set_attribute, layout, attr.STRIDED_BATCH_OFFSET, batch_stride, np.int64)
        return layout

    def set_epilogue_pointer(self, ptr: int) -> None:
        """The bias (forward) or bias-gradient (backward) vector of the epilogue."""
        _set(lt.matmul_desc_set_attribute, self.desc, lt.MatmulDescAttribute.BIAS_POINTER, ptr, np.uint64)

    def algorithms(self, count: int) -> list[Algorithm]:
        """cuBLASLt's heuristic candidates for this problem, best first (at most `count`)."""
        pref = lt.matmul_preference_create()
        try:
            _set(lt.matmul_preference_set_attribute, pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                 WORKSPACE_BYTES, np.uint64)
            results = lt.MatmulHeuristicResult(count)
            found = np.zeros(1, dtype=np.int32)
            lt.matmul_algo_get_heuristic(self.handle.ptr, self.desc, self.a, self.b, self.c, self.c, pref, count,
                                         results.ptr, found.ctypes.data)
        finally:
            lt.matmul_preference_destroy(pref)
        raw = np.frombuffer(results, dtype=np.uint8).reshape(count, -1)
        return [Algorithm(raw[i, :64].view(np.uint64).copy(), int(results[i].workspace_size))
                for i in range(int(found[0]))]

    def algorithm_from_options(self, options: dict[str, int]) -> Algorithm:
        """Rebuild a profiled algorithm from its recorded configuration attributes."""
        cuda_type = CUDA_TYPES[self.dtype]
        algo = Algorithm(np.zeros(8, dtype=np.uint64), 0)
        lt.matmul_algo_init(self.handle.ptr, COMPUTE_32F, CUDA_R_32F, cuda_type, cuda_type, cuda_type, cuda_type,
                            options["algo_id"], algo.ptr)
        for name, attr in ALGO_CONFIG.items():
            if name != "algo_id":
                _set(lt.matmul_algo_config_set_attribute, algo.ptr, attr, options[name],
                     ALGO_CONFIG_DTYPE.get(name, np.uint32))
        return algo

    def check(self, algorithm: Algorithm) -> int:
        """The workspace bytes `algorithm` needs for this problem; raises cuBLASLt's error where it cannot run it."""
        result = lt.MatmulHeuristicResult(1)
        lt.matmul_algo_check(self.handle.ptr, self.desc, self.a, self.b, self.c, self.c, algorithm.ptr, result.ptr)
        return int(result[0].workspace_size)

    def __call__(self, a: int, b: int, c: int, algorithm: Algorithm) -> None:
        """C = op(A)·op(B) on PyTorch's current stream; a, b, c are device pointers."""
        alpha, beta = self._scalars
        lt.matmul(self.handle.ptr, self.desc, alpha, a, self.a, b, self.b, beta, c, self.c, c, self.c, algorithm.ptr,
                  self._workspace, WORKSPACE_BYTES, torch.cuda.current_stream().cuda_stream)

    def close(self) -> None:
        for layout in (self.a, self.b, self.c):
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(self.desc)
