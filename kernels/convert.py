"""Dtype conversion of many tensors in one launch: the weight cast of a graphed step under autocast (a layer's
float32 parameters into their float16 / bfloat16 copies), and in a graphed backward the gradients its kernels write
in the step's dtype (biases, LayerNorm's) moved into the float32 (or same-dtype) gradient buffer.

Why a kernel of our own: the cast is pure data movement, paid once per layer and step, and PyTorch's multi-tensor
copy is not vectorized across a dtype change (`_foreach_copy_` moves a BERT-large layer's 75.6 MB at 1.92 TB/s on
the H100, this kernel at 2.22: `scripts/time_convert.py`, `layouts/h100-convert.txt`). Every access here is 16
bytes where the addresses allow, and each thread loads all its vectors before it stores. Rounding is torch's: to
nearest even, overflow to inf, NaN kept, so that GradScaler sees what it would see. (The weight gradients' way
back need no conversion: their GEMMs write float32, `substation.graphed.GradientBuffers`.)
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from substation.device import DeviceSpec
from substation.jit import Cubin, compile_cubin
from substation.launch import PackedLaunch, kernel_function
from substation.sizes import DTYPE_NAMES

from .base import environment

THREADS = 256
STEPS = 4  # 16-byte vectors per thread
PER_BLOCK = 8 * THREADS * STEPS  # elements a block converts
TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
CONVERSIONS = {  # (source, target) -> the expression converting `x`
    ("float32", "float16"): "__float2half_rn(x)",
    ("float32", "bfloat16"): "__float2bfloat16_rn(x)",
    ("float16", "float32"): "__half2float(x)",
    ("bfloat16", "float32"): "__bfloat162float(x)",
    ("float16", "float16"): "x",
    ("bfloat16", "bfloat16"): "x",
}


@dataclass(frozen=True)
class Conversion:
    """The kernel converting `count` tensors from `source` to `target` (dtype names) in one launch."""

    source: str
    target: str
    count: int

    def __post_init__(self) -> None:
        if (self.source, self.target) not in CONVERSIONS:
            raise ValueError(f"no conversion from {self.source} to {self.target}; expected one of {list(CONVERSIONS)}")
        if self.count < 1:
            raise ValueError(f"count={self.count}: a conversion takes one tensor or more")

    @functools.cached_property
    def name(self) -> str:
        return f"convert_{self.source}_{self.target}_{self.count}"

    def render(self) -> str:
        return environment().get_template("convert.cu.j2").render(
            NAME=self.name, source=self.source, target=self.target, count=self.count, threads=THREADS, steps=STEPS,
            source_type=TYPES[self.source], target_type=TYPES[self.target],
            conversion=CONVERSIONS[self.source, self.target])

    def compile(self, spec: DeviceSpec) -> Cubin:
        return compile_cubin(self.render(), self.name, spec.arch)


def blocks(numels: Sequence[int]) -> list[int]:
    """Each tensor's first block, then the grid: a block converts PER_BLOCK elements of one tensor."""
    firsts = [0]
    for n in numels:
        firsts.append(firsts[-1] + -(-n // PER_BLOCK))
    return firsts


class Converter:
    """Converts tensors of fixed sizes, dtypes and device in one launch, prepared once: a call passes the addresses.
    Sources and targets must be contiguous and pairwise of one size; an empty tensor converts nothing."""

    def __init__(self, numels: Sequence[int], source: torch.dtype, target: torch.dtype, device: torch.device) -> None:
        self.numels, self.source, self.target = tuple(numels), source, target
        index = device.index if device.index is not None else torch.cuda.current_device()
        conversion = Conversion(DTYPE_NAMES[source], DTYPE_NAMES[target], len(self.numels))
        self.firsts = blocks(self.numels)
        function = kernel_function(conversion.compile(DeviceSpec.of(index)).path, conversion.name, index)
        self.launch = PackedLaunch(function, conversion.name, index, max(1, self.firsts[-1]), THREADS, 0,
                                   ("pointer", "pointer", "int64", "int64") * len(self.numels))
        self.device = torch.device("cuda", index)

    def __call__(self, targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        """targets[i] = sources[i] converted, on the current stream."""
        if [t.numel() for t in targets] != list(self.numels) or [s.numel() for s in sources] != list(self.numels):
            raise ValueError(f"{self.launch.name}: tensors of {[t.numel() for t in targets]} and "
                             f"{[s.numel() for s in sources]} elements, prepared for {list(self.numels)}")
        for t, s in zip(targets, sources):
            if (t.dtype, s.dtype) != (self.target, self.source) or t.device != self.device or s.device != self.device:
                raise ValueError(f"{self.launch.name}: {s.dtype} on {s.device} -> {t.dtype} on {t.device}, prepared "
                                 f"for {self.source} -> {self.target} on {self.device}")
            if not (t.is_contiguous() and s.is_contiguous()):
                raise ValueError(f"{self.launch.name}: the tensors must be contiguous")
        values = []
        for t, s, n, first in zip(targets, sources, self.numels, self.firsts):
            values += [s.data_ptr(), t.data_ptr(), n, first]
        self.launch(torch.cuda.current_stream(self.device).cuda_stream, *values)

