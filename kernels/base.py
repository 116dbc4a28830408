"""What every fused-operator kernel module shares: rendering, feasibility, compilation, launching.

A kernel module defines a frozen parameter dataclass (a subclass of `KernelParams`): everything that
changes the generated code. From it come the rendered source, the kernel's name, its readable label
(a `substation.records.Candidate`), its cache key and its feasibility. Sizes and strides are
compile-time constants; dropout probability, seed and offset are launch arguments.
"""
from __future__ import annotations

import abc
import functools
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import jinja2

from substation.errors import SubstationError
from substation.graph import layer_graph
from substation.records import Candidate
from substation.sizes import Size

TEMPLATES = Path(__file__).parent / "templates"
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
MAX_SHARED_BYTES = 227 * 1024  # per block on sm_90, with the opt-in attribute
SIZE_FIELDS = ("B", "L", "H", "P", "I", "U")  # a parameter class's compile-time sizes, named as in `Size`


class InfeasibleError(SubstationError, ValueError):
    """A parameter point breaks a feasibility rule (named in the message); it is never compiled."""


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              trim_blocks=False, keep_trailing_newline=True)


def strides(layout: str, extents: Mapping[str, int]) -> dict[str, int]:
    """Row-major element strides of every letter of a layout."""
    return {d: math.prod(extents[e] for e in layout[i + 1:]) for i, d in enumerate(layout)}


@dataclass(frozen=True)
class KernelParams(abc.ABC):
    """Base of every kernel's parameters. Subclasses add their knobs and implement the hooks below."""

    op: str
    dtype: str
    layouts: tuple[tuple[str, str], ...]  # (tensor, layout) for every input, then every output

    template = ""  # the jinja2 template file

    @classmethod
    def at_size(cls, op: str, size: Size, dtype: str, layouts: Mapping[str, str], **knobs: object) -> KernelParams:
        """The point of `op` at `size` (the class's size fields taken from it) with these knobs."""
        sizes = {f.name: getattr(size, f.name) for f in fields(cls) if f.name in SIZE_FIELDS}
        return cls(op=op, dtype=dtype, layouts=tuple(layouts.items()), **sizes, **knobs)

    def check(self) -> None:
        """Raise InfeasibleError naming the first rule this point breaks (subclasses extend it)."""
        if self.dtype not in ITEMSIZE:
            raise InfeasibleError(f"{self.op}: dtype {self.dtype!r} has no kernel; expected one of {list(ITEMSIZE)}")
        operator = layer_graph().operator(self.op)
        names = tuple(name for name, _ in self.layouts)
        if names != operator.inputs + operator.outputs:
            raise InfeasibleError(f"{self.op}: layouts are given for {names}, expected {operator.inputs + operator.outputs}")

    # The launch-shape rules every kernel shares; each module calls them where they belong in its check().
    def check_vector(self) -> None:
        if self.vec not in (1, 2, 4, 8) or self.vec * ITEMSIZE[self.dtype] > 16:
            raise InfeasibleError(f"{self.op}: vec={self.vec} must be 1, 2, 4 or 8 and move at most 16 bytes")

    def check_threads(self) -> None:
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise InfeasibleError(f"{self.op}: threads={self.threads} must be a multiple of 32 in [32, 1024]")

    def check_shared_memory(self) -> None:
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise InfeasibleError(f"{self.op}: {self.shared_bytes} bytes of shared memory exceed {MAX_SHARED_BYTES}")

    def options(self) -> dict[str, object]:
        """The knobs of this point, as profile-row options."""
        skip = {"op", "dtype", "layouts"} | set(self.size_fields())
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def size_fields(self) -> tuple[str, ...]:
        return ()

    def check_tensors(self, tensors: Mapping) -> None:
        """ValueError naming the first tensor that is missing, misshapen, of another dtype, strided, misaligned
        for its vector accesses (`check_alignment`) or off the GPU."""
        import torch

        want_dtype = getattr(torch, self.dtype)
        for name, layout in self.layouts:
            if name not in tensors:
                raise ValueError(f"{self.op}: tensor {name!r} is missing; expected {[n for n, _ in self.layouts]}")
            t, shape = tensors[name], self.tensor_shape(layout)
            if tuple(t.shape) != shape or t.dtype != want_dtype or not t.is_contiguous():
                raise ValueError(f"{self.op}: {name=}, {t.shape=}, {t.dtype=}, contiguous={t.is_contiguous()}, "
                                 f"expected a contiguous {self.dtype} tensor of shape {shape} (layout {layout!r})")
        self.check_alignment(tensors)
        for name, _ in self.layouts:
            if not tensors[name].is_cuda:
                raise ValueError(f"{self.op}: {name=} is on {tensors[name].device}; the kernel needs CUDA tensors")

    def tensor_shape(self, layout: str) -> tuple[int, ...]:
        """The shape of a tensor stored in `layout` at this point's sizes."""
        return tuple(self.extents[d] for d in layout)

    def check_alignment(self, tensors: Mapping) -> None:
        """ValueError where a tensor's address does not suit the kernel's vector accesses (modules say which,
        through `check_aligned`)."""

    def check_aligned(self, name: str, tensor, vec: int) -> None:
        align = vec * ITEMSIZE[self.dtype]
        if tensor.data_ptr() % align:
            raise ValueError(f"{self.op}: {name=} starts at {tensor.data_ptr():#x}, which vec={self.vec} "
                             f"accesses need aligned to {align} bytes")

    def launch(self, cubin, tensors: Mapping, args, workspace=None) -> None:
        """Run on torch tensors (each contiguous in its layout, on one GPU) on PyTorch's current stream, after
        checking them. `workspace`: a backward's float32 partial sums (`workspace_shape()`), else allocated."""
        self.check_tensors(tensors)
        self.enqueue(cubin, tensors, args, workspace)

    @abc.abstractmethod
    def enqueue(self, cubin, tensors: Mapping, args, workspace=None) -> None:
        """`launch` without the checks: for callers whose tensors are right by construction (the runtime)."""

    @abc.abstractmethod
    def render_context(self) -> dict[str, object]:
        """The template's variables (besides NAME and dtype)."""

    @functools.cached_property
    def candidate(self) -> Candidate:
        operator = layer_graph().operator(self.op)
        layouts = dict(self.layouts)
        return Candidate.make(self.op, operator.pass_, "kernel", {n: layouts[n] for n in operator.inputs},
                              {n: layouts[n] for n in operator.outputs}, self.options())

    @functools.cached_property
    def label(self) -> str:
        return self.candidate.label

    @functools.cached_property
    def name(self) -> str:
        """A C identifier unique to this parameter point (the label's hash keeps it short)."""
        sizes = {f: getattr(self, f) for f in self.size_fields()}
        digest = hashlib.sha256(f"{self.label} {self.dtype} {sizes}".encode()).hexdigest()[:12]
        return f"{self.op}_{self.dtype}_{digest}"

    def render(self) -> str:
        self.check()
        return environment().get_template(self.template).render(NAME=self.name, dtype=self.dtype,
                                                                **self.render_context())

    def compile(self, arch: str = "sm_90"):
        from substation.jit import compile_cubin

        return compile_cubin(self.render(), f"{self.label} [{self.dtype}]", arch)


class RowTile:
    """Layout rules of kernels whose block owns `rows` rows along the free dim `tile` and the whole
    `reduced` dim (softmax over k, LayerNorm over i), moving them through shared memory."""

    reduced = ""  # the reduced dim letter, set by each kernel class

    def sweep(self, layout: str) -> str:
        """Along which dim a tensor's tile is swept: its innermost dim if that is the tile dim, else the
        reduced dim (coalesced when that is innermost, strided otherwise)."""
        return "tile" if layout[-1] == self.tile else "reduced"

    def vec_of(self, layout: str) -> int:
        """Vector accesses need the swept dim to be contiguous (innermost); otherwise one element each."""
        return self.vec if layout[-1] in (self.tile, self.reduced) else 1

    def check_row_tile(self, free: str) -> None:
        """The tiling rules both row-tiled kernels share: the tile dim is one of the row dims `free`, `rows`
        divides its extent, and the vector width divides the extent each tiled tensor is swept along."""
        ext = self.extents
        if self.tile not in free:
            raise InfeasibleError(f"{self.op}: tile={self.tile!r} must be one of the row dims {list(free)}")
        if ext[self.tile] % self.rows:
            raise InfeasibleError(f"{self.op}: rows={self.rows} must divide the extent {ext[self.tile]} of tile "
                                  f"dim {self.tile!r}")
        self.check_vector()
        for name, layout, *_ in self.tiled_tensors:
            n = self.rows if self.sweep(layout) == "tile" else ext[self.reduced]
            if n % self.vec_of(layout):
                raise InfeasibleError(f"{self.op}: vec={self.vec} must divide {n}, the swept extent of "
                                      f"{name}:{layout}")

    @property
    def pitch(self) -> int:
        """Shared-memory row length: one 4-byte word of padding, so column sweeps hit distinct banks."""
        return self.extents[self.reduced] + 4 // ITEMSIZE[self.dtype]


def widest_vector(make: Callable[[int], KernelParams]) -> KernelParams | None:
    """The feasible point with the widest vector access (8, 4, 2, then 1 element), or None."""
    for vec in (8, 4, 2, 1):
        params = make(vec)
        try:
            params.check()
        except InfeasibleError:
            continue
        return params
    return None
