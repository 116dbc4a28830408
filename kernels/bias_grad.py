"""A bias gradient as a kernel of its own: db[u] = Σ over every other letter of a gradient X, X laid out in any
order of its letters (contiguous), so that X viewed as [O, U, I] sums over O and I (`templates/bias_grad.cu.j2`).

It serves the GEMMs with our epilogues (`gemm_epilogue.py`) twice: `dgelu` leaves db1 to it (a pass over dF), and
`dgelu_bgrad` writes one float32 partial sum per tile of the summed letter, which it adds up (X = the partials,
rows `stride` apart, db in `out_dtype`). Deterministic: each sum runs in a fixed order, partial sums per chunk of
O, then those of every eighth chunk in order, then the eight in order.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from substation.device import H100, DeviceSpec
from substation.jit import Cubin, compile_cubin
from substation.launch import PackedLaunch, kernel_function

from .base import SUM_TX, SUM_TY, environment

THREADS = 256
WAVES = 4  # blocks per SM the chunking aims for, so that every SM streams
SIGNATURE = ("pointer", "pointer", "pointer")  # X, the float32 partial sums, db


@dataclass(frozen=True)
class BiasGradient:
    """The kernels summing a contiguous [O, U, I] tensor of `dtype` (a name) over O and I, planned for `sm_count`
    SMs."""

    outer: int
    bias: int
    inner: int
    dtype: str
    sm_count: int = H100.sm_count
    # Elements from one row o to the next where u is innermost (I = 1) and rows are padded, as the GEMM's partials
    # are (None: U); db's dtype (None: X's).
    stride: int | None = None
    out_dtype: str | None = None

    def __post_init__(self) -> None:
        if min(self.outer, self.bias, self.inner) < 1:
            raise ValueError(f"{self}: every extent must be positive")
        for dtype in (self.dtype, self.out_dtype or self.dtype):
            if dtype not in ("float16", "bfloat16", "float32"):
                raise ValueError(f"dtype {dtype!r}: expected float16, bfloat16 or float32")
        if self.stride is not None and (self.inner != 1 or self.stride < self.bias):
            raise ValueError(f"{self}: a row stride needs u innermost (I = 1) and at least U elements")

    @classmethod
    def of(cls, layout: str, letter: str, extents: Mapping[str, int], dtype: str, spec: DeviceSpec = H100
           ) -> BiasGradient:
        """The kernels for a tensor laid out as `layout` whose bias runs along `letter`."""
        if letter not in layout:
            raise ValueError(f"the bias letter {letter!r} is not in the layout {layout!r}")
        at = layout.index(letter)
        return cls(math.prod(extents[d] for d in layout[:at]), extents[letter],
                   math.prod(extents[d] for d in layout[at + 1:]), dtype, spec.sm_count)

    @property
    def vec(self) -> int:
        """Elements per load along the innermost extent (u where I is 1): 16 bytes where it divides."""
        along = math.gcd(self.bias, self.stride or self.bias) if self.inner == 1 else self.inner
        per_16_bytes = 16 // torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return next(v for v in (per_16_bytes, 4, 2, 1) if along % v == 0)

    @property
    def tx(self) -> int:
        """Threads along u where u is innermost: a power of two, so that they divide the block."""
        return min(32, 1 << (-(-self.bias // self.vec) - 1).bit_length())

    @property
    def blocks_per_chunk(self) -> int:
        return -(-self.bias // (self.vec * self.tx)) if self.inner == 1 else self.bias

    @property
    def chunks(self) -> int:
        """Chunks of O with a partial sum each: enough blocks for WAVES per SM, no chunk without rows."""
        rows_per_block = THREADS // self.tx if self.inner == 1 else 1
        wanted = -(-WAVES * self.sm_count // self.blocks_per_chunk)
        return max(1, min(wanted, -(-self.outer // rows_per_block)))

    @property
    def chunk_rows(self) -> int:
        return -(-self.outer // self.chunks)

    @property
    def workspace_floats(self) -> int:
        return self.chunks * self.bias if self.chunks > 1 else 0

    @functools.cached_property
    def name(self) -> str:
        padded = "" if self.stride in (None, self.bias) else f"_s{self.stride}"
        into = "" if self.out_dtype in (None, self.dtype) else f"_to_{self.out_dtype}"
        return f"bias_grad_{self.dtype}_{self.outer}x{self.bias}x{self.inner}{padded}_c{self.chunks}{into}"

    def render(self) -> str:
        return environment().get_template("bias_grad.cu.j2").render(
            NAME=self.name, dtype=self.dtype, out_dtype=self.out_dtype or self.dtype, O=self.outer, U=self.bias,
            ROW=self.stride or self.bias, I=self.inner, VEC=self.vec, TX=self.tx, THREADS=THREADS, CHUNKS=self.chunks,
            CHUNK_ROWS=self.chunk_rows)

    def compile(self, spec: DeviceSpec = H100) -> Cubin:
        return compile_cubin(self.render(), self.name, spec.arch)


class BiasGradientLaunch:
    """The kernels bound on a device with their workspace: a call sums X (contiguous, its planned shape) into db."""

    def __init__(self, kernels: BiasGradient, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.kernels = kernels
        cubin = kernels.compile(DeviceSpec.of(index)).path
        self.workspace = torch.empty(max(1, kernels.workspace_floats), dtype=torch.float32,
                                     device=torch.device("cuda", index))
        self.launches = [PackedLaunch(kernel_function(cubin, f"{kernels.name}_partial", index),
                                      f"{kernels.name}_partial", index, (kernels.blocks_per_chunk, kernels.chunks),
                                      THREADS, 0, SIGNATURE)]
        if kernels.chunks > 1:
            self.launches.append(PackedLaunch(kernel_function(cubin, f"{kernels.name}_sum", index),
                                              f"{kernels.name}_sum", index, -(-kernels.bias // SUM_TX), SUM_TX * SUM_TY,
                                              0, SIGNATURE, dependent=True))

    def __call__(self, x: int, db: int, stream: int) -> None:
        """db = the sums of X, on device addresses, on CUDA stream `stream` (a handle)."""
        for launch in self.launches:
            launch(stream, x, self.workspace.data_ptr(), db)
