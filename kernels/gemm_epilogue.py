"""GEMMs whose epilogue is ours: CUTLASS 3 Hopper kernels (TMA loads, warp-specialized wgmma, TMA stores) from
the `nvidia-cutlass` wheel's headers, rendered from `templates/gemm_epilogue.cu.j2` and built by our nvcc JIT
as shared libraries (their host code encodes the TMA descriptors and launches on the caller's stream).

Why CUTLASS: its epilogue visitor trees fuse any elementwise function, vector broadcast and vector reduction
into the GEMM's store at no extra pass over memory, and its Hopper mainloops run at cuBLASLt's speed on
these shapes; cuBLASLt's own GELU epilogues compute the tanh approximation, not BertLayer's erf.

Epilogues (`EPILOGUES`):
- `plain`: D = acc, the yardstick against cuBLASLt (the same call must not be slower for the fusion to pay);
- `bias_gelu`: F = acc stored, D = GELU_erf(F + bias) (ffn_in + bias_gelu: H1 and F in one pass);
- `dgelu_bgrad`: D = acc · GELU'(F + bias) and the bias gradient as sums of D along the other letter
  (ffn_out_dgrad + bias_gelu_bwd: dF and db1; dH1 never exists). The sums are reduced across tiles in a
  fixed order (per-tile partial sums in a workspace, the last tile of a row adds them): deterministic.

The call is cuBLAS's column-major one (`tc_profiling.mapping.GemmCall`): D (m × n, m unit-stride), so the bias
runs along m (one value per row of D) or n.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from substation.jit import Cubin, compile_library
from substation.kernels.base import environment
from substation.tc_profiling.mapping import GemmCall

TEMPLATE = "gemm_epilogue.cu.j2"
EPILOGUES = ("plain", "bias_gelu", "dgelu_bgrad")
ELEMENTS = {torch.float16: "cutlass::half_t", torch.bfloat16: "cutlass::bfloat16_t"}
ARCH = "sm_90a"  # wgmma and TMA: Hopper's architecture-specific target
ALIGNMENT = 8  # elements: TMA needs 16-byte aligned leading dimensions and bases


class CutlassError(RuntimeError):
    """A CUTLASS GEMM refused or failed its call."""


@functools.cache
def cutlass_include() -> str:
    """The CUTLASS/CuTe headers the `nvidia-cutlass` wheel ships."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise CutlassError("the nvidia-cutlass package is not installed: its headers build the epilogue GEMMs")
    include = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    if not (include / "cutlass" / "cutlass.h").is_file():
        raise CutlassError(f"nvidia-cutlass has no headers under {include}")
    return str(include)


@dataclass(frozen=True)
class GemmEpilogueVariant:
    """One compiled kernel: an epilogue for one (transa, transb) and bias direction, with its tile, cluster and
    schedule (cooperative: two consumer warpgroups share a tile; pingpong: they alternate tiles)."""

    epilogue: str
    transa: str  # cuBLAS's: N or T
    transb: str
    bias_along: str  # m or n ('m' for plain, where there is no bias)
    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    schedule: str
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue {self.epilogue!r}: expected one of {EPILOGUES}")
        if self.transa not in "NT" or self.transb not in "NT" or self.bias_along not in ("m", "n"):
            raise ValueError(f"transa/transb must be N or T and bias_along m or n, not {self}")
        if self.schedule not in ("cooperative", "pingpong"):
            raise ValueError(f"schedule {self.schedule!r}: expected cooperative or pingpong")
        if self.dtype not in ELEMENTS:
            raise ValueError(f"dtype {self.dtype}: expected one of {list(ELEMENTS)}")
        if self.schedule == "cooperative" and self.tile[0] % 128:
            raise ValueError(f"a cooperative tile's m ({self.tile[0]}) is a multiple of 128 (two warpgroups of 64)")

    @property
    def label(self) -> str:
        return (f"{self.epilogue}[{self.transa}{self.transb},bias_{self.bias_along}] {self.schedule} "
                f"{'x'.join(map(str, self.tile))} cluster {'x'.join(map(str, self.cluster))}")

    def render(self) -> str:
        (tile_m, tile_n, tile_k), (cluster_m, cluster_n) = self.tile, self.cluster
        return environment().get_template(TEMPLATE).render(
            element=ELEMENTS[self.dtype], transa=self.transa, transb=self.transb, bias_along=self.bias_along,
            epilogue=self.epilogue, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, cluster_m=cluster_m,
            cluster_n=cluster_n, schedule=self.schedule)

    def compile(self) -> Cubin:
        return compile_library(self.render(), self.label, ARCH, (cutlass_include(),))


class EpilogueGemm:
    """A compiled variant, loaded: `workspace_bytes` and the call. Not for two threads at once (nothing is
    shared between calls, but the library's host code is CUTLASS's, which makes no promise)."""

    def __init__(self, variant: GemmEpilogueVariant, library: Cubin) -> None:
        self.variant = variant
        lib = ctypes.CDLL(str(library.path))
        self._run = lib.substation_gemm
        self._run.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
        self._run.restype = ctypes.c_int
        self._workspace = lib.substation_gemm_workspace
        self._workspace.argtypes = [ctypes.c_int] * 4
        self._workspace.restype = ctypes.c_size_t

    def workspace_bytes(self, call: GemmCall) -> int:
        return int(self._workspace(call.m, call.n, call.k, call.batch))

    def __call__(self, call: GemmCall, a: int, b: int, d: int, stream: int, aux: int = 0, bias: int = 0,
                 bias_gradient: int = 0, workspace: int = 0) -> None:
        """Run the call on device addresses (ints) on CUDA stream `stream` (a handle)."""
        status = self._run(a, b, d, aux or None, bias or None, bias_gradient or None, workspace or None, call.m,
                           call.n, call.k, call.batch, call.lda, call.ldb, call.ldc, call.stride_a, call.stride_b,
                           call.stride_c, stream or None)
        if status:
            what = {1: "cannot run this problem (alignment or extents)", 2: "failed to set up its arguments",
                    3: "failed to launch"}.get(status, f"returned {status}")
            raise CutlassError(f"{self.variant.label} {what}: {call}")


@functools.cache
def loaded(variant: GemmEpilogueVariant) -> EpilogueGemm:
    """The variant compiled (or from the cache) and loaded, once per process."""
    return EpilogueGemm(variant, variant.compile())
