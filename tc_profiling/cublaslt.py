"""cuBLASLt through nvmath-python's bindings (impl `cublaslt`): one strided-batched GEMM, described once,
run many times.

The descriptors (operation, the three matrix layouts, epilogue) are built once per call shape, so a
run costs one `cublasLtMatmul` and no re-planning. An algorithm is recorded by its configuration
attributes (id, tile, stages, split-K, ...), from which `algorithm_from_options` rebuilds the same
opaque `cublasLtMatmulAlgo_t`: the call the Encoder makes is the call that was timed.
nvmath is an optional (GPU) dependency: without it this module imports, lists its covers and checks
configurations; binding needs it.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from substation.errors import DeviceError
from substation.graph import Operator
from substation.protocol import Choice
from substation.tc_profiling.gemm import GemmImplementation, GemmRun
from substation.tc_profiling.mapping import GemmCall

try:
    from nvmath.bindings import cublasLt as lt
except ImportError:  # a CPU-only install
    lt = None

CUDA_R_32F = 0
CUDA_TYPES = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation for fp16 and bf16 inputs
EPILOGUES = {
    "none": "DEFAULT",
    "bias": "BIAS",  # D = A·B + bias (bias along D's rows, broadcast over columns)
    "gelu_bias": "GELU_BIAS",  # cuBLASLt's GELU is the tanh approximation (tests/tc_profiling/test_gemm_gpu.py)
    "bgrad_a": "BGRADA",  # D = A·B, and the bias pointer receives A's sums over k (one per row of D)
    "bgrad_b": "BGRADB",  # D = A·B, and the bias pointer receives B's sums over k (one per column of D)
}
# The algorithm configuration attributes that, with the algorithm id, pin down one algorithm.
ALGO_CONFIG = {
    "algo_id": "ID",
    "tile": "TILE_ID",
    "stages": "STAGES_ID",
    "splitk": "SPLITK_NUM",
    "reduction": "REDUCTION_SCHEME",
    "swizzle": "CTA_SWIZZLING",
    "custom": "CUSTOM_OPTION",
    "inner_shape": "INNER_SHAPE_ID",
    "cluster_shape": "CLUSTER_SHAPE_ID",
}
ALGO_CONFIG_DTYPE = {"inner_shape": np.uint16, "cluster_shape": np.uint16, "algo_id": np.int32}
WORKSPACE_BYTES = 32 << 20


def bindings():
    """nvmath's cuBLASLt module; DeviceError where the GPU extras are not installed."""
    if lt is None:
        raise DeviceError("cuBLASLt needs nvmath-python: pip install -e '.[gpu]'")
    return lt


def _config_attribute(name: str):
    return getattr(bindings().MatmulAlgoConfigAttribute, ALGO_CONFIG[name])


def _set(setter, obj: int, attr, value, dtype) -> None:
    buf = np.array([value], dtype=dtype)
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


class Handle:
    """A cuBLASLt handle with its workspace on the current device."""

    def __init__(self) -> None:
        self.ptr = bindings().create()
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
        for name in ALGO_CONFIG:
            attr = _config_attribute(name)
            buf = np.zeros(1, dtype=ALGO_CONFIG_DTYPE.get(name, np.uint32))
            written = np.zeros(1, dtype=np.uint64)
            lt.matmul_algo_config_get_attribute(self.ptr, attr, buf.ctypes.data, buf.itemsize, written.ctypes.data)
            values[name] = int(buf[0])
        return values


class LtMatmul:
    """One cuBLASLt matmul for a GemmCall, A and B in `dtype`, C in `out_dtype` (default `dtype`), with fp32
    accumulation and an optional epilogue; D = A·B + β·C, by default β = 0 and D written over C."""

    def __init__(self, handle: Handle, call: GemmCall, dtype: torch.dtype, epilogue: str = "none",
                 bias_batch_stride: int = 0, out_dtype: torch.dtype | None = None, beta: float = 0.0) -> None:
        """`bias_batch_stride`: elements between the bias vectors of consecutive batches (0: one for all)."""
        lt = bindings()
        self.handle, self.call, self.dtype, self.epilogue = handle, call, dtype, epilogue
        self.out_dtype = out_dtype or dtype
        cuda_type = CUDA_TYPES[dtype]
        self.desc = lt.matmul_desc_create(COMPUTE_32F, CUDA_R_32F)
        attr = lt.MatmulDescAttribute
        _set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSA, int(call.transa), np.int32)
        _set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSB, int(call.transb), np.int32)
        epilogue_id = int(getattr(lt.Epilogue, EPILOGUES[epilogue]))
        _set(lt.matmul_desc_set_attribute, self.desc, attr.EPILOGUE, epilogue_id, np.uint32)
        if bias_batch_stride:
            _set(lt.matmul_desc_set_attribute, self.desc, attr.BIAS_BATCH_STRIDE, bias_batch_stride, np.int64)
        a_shape = (call.k, call.m) if call.transa else (call.m, call.k)
        b_shape = (call.n, call.k) if call.transb else (call.k, call.n)
        self.a = self._layout(cuda_type, a_shape, call.lda, call.stride_a)
        self.b = self._layout(cuda_type, b_shape, call.ldb, call.stride_b)
        self.c = self._layout(CUDA_TYPES[self.out_dtype], (call.m, call.n), call.ldc, call.stride_c)
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.full(1, beta, dtype=np.float32)
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

    def algorithms(self, count: int, max_workspace: int = WORKSPACE_BYTES) -> list[Algorithm]:
        """cuBLASLt's heuristic candidates for this problem that need at most `max_workspace` bytes, best first (at
        most `count`)."""
        pref = lt.matmul_preference_create()
        try:
            _set(lt.matmul_preference_set_attribute, pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                 max_workspace, np.uint64)
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
        cuda_type, out_type = CUDA_TYPES[self.dtype], CUDA_TYPES[self.out_dtype]
        algo = Algorithm(np.zeros(8, dtype=np.uint64), 0)
        lt.matmul_algo_init(self.handle.ptr, COMPUTE_32F, CUDA_R_32F, cuda_type, cuda_type, out_type, out_type,
                            options["algo_id"], algo.ptr)
        for name in ALGO_CONFIG:
            if name != "algo_id":
                _set(lt.matmul_algo_config_set_attribute, algo.ptr, _config_attribute(name), options[name],
                     ALGO_CONFIG_DTYPE.get(name, np.uint32))
        return algo

    def check(self, algorithm: Algorithm) -> int:
        """The workspace bytes `algorithm` needs for this problem; raises cuBLASLt's error where it cannot run it."""
        result = lt.MatmulHeuristicResult(1)
        lt.matmul_algo_check(self.handle.ptr, self.desc, self.a, self.b, self.c, self.c, algorithm.ptr, result.ptr)
        return int(result[0].workspace_size)

    def __call__(self, a: int, b: int, c: int, algorithm: Algorithm, stream: int | None = None,
                 source: int | None = None) -> None:
        """C = op(A)·op(B) + β·C on device pointers a, b, c, on `stream` (default: PyTorch's current stream);
        `source`: the addend where it is not C itself (same layout as C)."""
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        alpha, beta = self._scalars
        addend = c if source is None else source
        lt.matmul(self.handle.ptr, self.desc, alpha, a, self.a, b, self.b, beta, addend, self.c, c, self.c,
                  algorithm.ptr, self._workspace, WORKSPACE_BYTES, stream)

    def close(self) -> None:
        for layout in (self.a, self.b, self.c):
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(self.desc)


@functools.cache
def device_handle(device: int) -> Handle:
    """One cuBLASLt handle and workspace per device, shared by every bound call of the process."""
    with torch.cuda.device(device):
        return Handle()


def is_rank(value: object) -> bool:
    """Whether a row's option names a heuristic rank that `ranked_algorithm` takes: an integer from 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def ranked_algorithm(matmul: LtMatmul, rank: int) -> Algorithm:
    """cuBLASLt's heuristic algorithm of this rank for the call (0: its first choice), or its last offer where it
    offers fewer: what a row that records a rank, not an algorithm, runs at any size."""
    found = matmul.algorithms(rank + 1)
    if not found:
        raise DeviceError(f"cuBLASLt offers no algorithm for {matmul.call} (epilogue {matmul.epilogue})")
    return found[min(rank, len(found) - 1)]


def bound_algorithm(ops: Sequence[Operator], choice: Choice, matmul: LtMatmul, error) -> Algorithm:
    """The recorded cuBLASLt algorithm, rebuilt and checked; else cuBLASLt's first choice, with a warning unless C is
    of another dtype than A and B (a float32 gradient under autocast: a call the profile never timed)."""
    algorithm = None
    if "algo_id" in choice.options:
        algorithm = matmul.algorithm_from_options(dict(choice.options))  # type: ignore[arg-type]
        try:
            if matmul.check(algorithm) > WORKSPACE_BYTES:
                raise RuntimeError(f"it needs more than {WORKSPACE_BYTES} bytes of workspace")
        except Exception as err:  # e.g. an fp16 profile's algorithm run in bf16
            if matmul.out_dtype == matmul.dtype:
                warnings.warn(f"{ops[0].name}: the recorded cuBLASLt algorithm cannot run here ({err}); using "
                              "cuBLASLt's first heuristic choice instead", stacklevel=6)
            algorithm = None
    if algorithm is None:
        found = matmul.algorithms(1)
        if not found:
            raise error(f"finds no cuBLASLt algorithm for {matmul.call}")
        algorithm = found[0]
    return algorithm


class CublasLt(GemmImplementation):
    """cuBLASLt with the algorithm the profile recorded (rebuilt from its configuration attributes)."""

    impl = "cublaslt"

    def prepare(self, ops: Sequence[Operator], choice: Choice, call: GemmCall, dtype: torch.dtype,
                device: torch.device, out_dtype: torch.dtype) -> GemmRun:
        matmul = LtMatmul(device_handle(device.index), call, dtype, out_dtype=out_dtype)
        algorithm = bound_algorithm(ops, choice, matmul, lambda message: self.error(ops, message))
        return lambda a, b, c, stream: matmul(a, b, c, algorithm, stream)
