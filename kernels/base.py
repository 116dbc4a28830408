"""What every fused-operator kernel module shares: rendering, feasibility, compilation, binding, launching.

A kernel module defines a frozen parameter dataclass (a subclass of `KernelParams`): everything that
changes the generated code. From it come the rendered source, the kernel's name, its readable label
(a `substation.records.Candidate`), its cache key and its feasibility on a device (`DeviceSpec`, the
H100's where none is given). Sizes and strides are compile-time constants; dropout probability, seed and
offset are launch arguments.

`bind(cubin, device)` prepares the launches once (`BoundKernel`): a call then only passes the tensors'
addresses, the operator's scalars and the stream. `launch(cubin, tensors, args)` is the checked way for
callers holding torch tensors (tests, the profiler): it checks them, binds and calls.
"""
from __future__ import annotations

import abc
import functools
import hashlib
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import jinja2
import torch

from substation.device import H100, DeviceSpec
from substation.dropout import PHILOX_ROUNDS, threshold
from substation.errors import SubstationError
from substation.graph import Operator, layer_graph
from substation.jit import Cubin, compile_cubin
from substation.launch import PackedLaunch, kernel_function
from substation.layouts import Configuration
from substation.protocol import COMPILED_DTYPES, Choice, Implementation
from substation.records import Candidate
from substation.reference import OpArgs
from substation.sizes import Size

TEMPLATES = Path(__file__).parent / "templates"
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
# The arguments of a kernel with dropout, after its tensors: keep scale 1/(1-p), the 16-bit Philox threshold
# (min(round(p·2**16), 2**16), passed as a uint64; 0 turns dropout off), and the address of (seed, offset) in
# device memory (see substation/dropout.py).
DROPOUT_SIGNATURE = ("float32", "uint64", "pointer")
SIZE_FIELDS = ("B", "L", "H", "P", "I", "U")  # a parameter class's compile-time sizes, named as in `Size`
# A device architecture's arch-specific target: its cubins run only there, and only they may use its features beyond the
# portable ISA (sm_90a: wgmma). `bind` accepts such a cubin on its device.
ARCH_SPECIFIC = {"sm_90": "sm_90a"}


class InfeasibleVariantError(SubstationError, ValueError):
    """A parameter point breaks a feasibility rule (named in the message); it is never compiled."""


def runnable_variant(params: "KernelParams", spec: DeviceSpec, others: Callable[[], Sequence["KernelParams"]],
                     op: str, error: Callable[[str], Exception]) -> "KernelParams":
    """`params`, or where it cannot run on `spec` (a configuration made on a larger GPU) the first of `others()`
    that can, with a warning; `error(message)` is raised where none can."""
    try:
        params.check(spec)
        return params
    except InfeasibleVariantError as err:
        found = others()
        if not found:
            raise error(f"variant {params.label} cannot run on {spec.name} ({err}), nor can any other variant in "
                        f"these layouts") from None
        warnings.warn(f"{op}: {err}; running {found[0].label} instead", stacklevel=7)
        return found[0]


# chunk_sum.cuh.j2's block, which adds partial sums in a fixed order (bias_grad's `_sum`, the attention's `_dbsum`):
# SUM_TX outputs by SUM_TY groups of chunks.
SUM_TX, SUM_TY = 32, 8


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             trim_blocks=False, keep_trailing_newline=True)
    env.globals["PHILOX_ROUNDS"] = PHILOX_ROUNDS  # the reference's constant, so kernels cannot drift from it
    return env


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

    def check(self, spec: DeviceSpec = H100) -> None:
        """Raise InfeasibleVariantError naming the first rule this point breaks on the device `spec` describes
        (subclasses extend it)."""
        if self.dtype not in ITEMSIZE:
            raise InfeasibleVariantError(f"{self.op}: dtype {self.dtype!r} has no kernel; expected one of {list(ITEMSIZE)}")
        operator = layer_graph().operator(self.op)
        names = tuple(name for name, _ in self.layouts)
        if names != operator.inputs + operator.outputs:
            raise InfeasibleVariantError(f"{self.op}: layouts are given for {names}, expected {operator.inputs + operator.outputs}")

    # The launch-shape rules every kernel shares; each module calls them where they belong in its check().
    def check_vector(self) -> None:
        if self.vec not in (1, 2, 4, 8) or self.vec * ITEMSIZE[self.dtype] > 16:
            raise InfeasibleVariantError(f"{self.op}: vec={self.vec} must be 1, 2, 4 or 8 and move at most 16 bytes")

    def check_threads(self) -> None:
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise InfeasibleVariantError(f"{self.op}: threads={self.threads} must be a multiple of 32 in [32, 1024]")

    def check_shared_memory(self, spec: DeviceSpec) -> None:
        limit = spec.max_shared_bytes_per_block
        if self.shared_bytes > limit:
            raise InfeasibleVariantError(f"{self.op}: {self.shared_bytes} bytes of shared memory exceed {limit}, the most a "
                                  f"block may use on {spec.name}")

    def options(self) -> dict[str, object]:
        """The knobs of this point, as profile-row options."""
        skip = {"op", "dtype", "layouts"} | set(self.size_fields())
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def size_fields(self) -> tuple[str, ...]:
        return ()

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Every input, then every output: the order of a BoundKernel's pointers."""
        return tuple(name for name, _ in self.layouts)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming the first tensor that is missing, misshapen, of another dtype, strided, misaligned
        for its vector accesses (`check_alignment`), off the GPU or on another GPU than the first tensor."""
        want_dtype = getattr(torch, self.dtype)
        for name, layout in self.layouts:
            if name not in tensors:
                raise ValueError(f"{self.op}: tensor {name!r} is missing; expected {[n for n, _ in self.layouts]}")
            t, shape = tensors[name], self.tensor_shape(layout)
            if tuple(t.shape) != shape or t.dtype != want_dtype or not t.is_contiguous():
                raise ValueError(f"{self.op}: {name=}, {t.shape=}, {t.dtype=}, contiguous={t.is_contiguous()}, "
                                 f"expected a contiguous {self.dtype} tensor of shape {shape} (layout {layout!r})")
        self.check_alignment(tensors)
        first = self.layouts[0][0]
        for name, _ in self.layouts:
            device = tensors[name].device
            if not tensors[name].is_cuda:
                raise ValueError(f"{self.op}: {name=} is on {device}; the kernel needs CUDA tensors")
            if device != tensors[first].device:
                raise ValueError(f"{self.op}: {name=} is on {device}, {first} on {tensors[first].device}; the kernel "
                                 f"needs them on one GPU")

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

    def workspace_shape(self) -> tuple[int, ...] | None:
        """The float32 partial sums a kernel with a second, summing kernel passes between the two; None here."""
        return None

    def check_workspace(self, workspace: torch.Tensor, device: torch.device) -> None:
        shape = self.workspace_shape()
        if shape is None:
            raise ValueError(f"{self.op}: takes no workspace (it has no partial sums), but one was given")
        if (tuple(workspace.shape) != shape or workspace.dtype != torch.float32 or not workspace.is_contiguous()
                or workspace.device != device):
            raise ValueError(f"{self.op}: {workspace.shape=}, {workspace.dtype=}, {workspace.device=}, expected a "
                             f"contiguous float32 tensor of shape {shape} on {device}")

    def launch(self, cubin: Cubin, tensors: Mapping[str, torch.Tensor], args: OpArgs,
               workspace: torch.Tensor | None = None) -> None:
        """Run on torch tensors (each contiguous in its layout, on one GPU) on PyTorch's current stream, after
        checking them. `workspace`: the partial sums (`workspace_shape()`), else allocated. Binds on every call:
        callers that launch repeatedly bind once."""
        self.check_tensors(tensors)
        device = tensors[self.layouts[0][0]].device
        if workspace is not None:
            self.check_workspace(workspace, device)
        bound = self.bind(cubin, device.index)
        bound([tensors[name].data_ptr() for name in bound.names], args, torch.cuda.current_stream(device).cuda_stream,
              workspace)

    def bind(self, cubin: Cubin, device: int) -> BoundKernel:
        """This point's launches on CUDA device `device` (an index), prepared once: checked against the device's
        spec, the cubin's kernels loaded, grids, blocks, shared memory and argument signatures fixed."""
        spec = DeviceSpec.of(device)
        if cubin.arch not in (spec.arch, ARCH_SPECIFIC.get(spec.arch)):
            raise ValueError(f"{self.op}: the cubin {cubin.path} is compiled for {cubin.arch}, but device {device} "
                             f"({spec.name}) is {spec.arch}: compile(DeviceSpec.of({device}))")
        self.check(spec)
        return self._bind(cubin, device)

    @abc.abstractmethod
    def _bind(self, cubin: Cubin, device: int) -> BoundKernel:
        """`bind` after its checks: the module's launches (`packed`) in a BoundKernel."""

    def packed(self, cubin: Cubin, device: int, name: str, grid: int, threads: int, shared_bytes: int,
               signature: Sequence[str], dependent: bool = False, cooperative: bool = False) -> PackedLaunch:
        """The launch of kernel `name` of the cubin on `device`, with 1-D grid and block; `dependent`: a
        programmatic dependent launch (substation/launch.py), as a Reduction's is; `cooperative`: a cooperative
        launch, as an in-kernel Reduction's main kernel is."""
        function = kernel_function(cubin.path, name, device, shared_bytes)
        return PackedLaunch(function, name, device, grid, threads, shared_bytes, signature, dependent=dependent,
                            cooperative=cooperative)

    def scalars(self, args: OpArgs) -> tuple[float | int, ...]:
        """The kernel's arguments after its tensors' addresses, from the operator's arguments (none here)."""
        return ()

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

    def render(self, spec: DeviceSpec = H100) -> str:
        self.check(spec)
        return environment().get_template(self.template).render(NAME=self.name, dtype=self.dtype,
                                                                **self.render_context())

    def compile_arch(self, spec: DeviceSpec) -> str:
        """The architecture nvcc compiles this point for on `spec`'s GPU: its own (points using arch-specific
        instructions say otherwise)."""
        return spec.arch

    def compile(self, spec: DeviceSpec = H100) -> Cubin:
        """The cubin for `spec`'s architecture (the H100's where none is given: on a GPU, pass
        `DeviceSpec.of(index)`), from the cache or nvcc."""
        return compile_cubin(self.render(spec), f"{self.label} [{self.dtype}]", self.compile_arch(spec))


class ScaledDropoutLaunch:
    """One launch taking every tensor's address, the scale 1/sqrt(P) and the attention dropout: softmax and the
    fused attention forward."""

    def scalars(self, args: OpArgs) -> tuple[float | int, ...]:
        return (args.scale, *dropout_arguments(args, args.attention_dropout))

    def _bind(self, cubin: Cubin, device: int) -> BoundKernel:
        signature = ("pointer",) * len(self.layouts) + ("float32",) + DROPOUT_SIGNATURE
        main = self.packed(cubin, device, self.name, self.grid, self.threads, self.shared_bytes, signature)
        return BoundKernel(self.tensor_names, main, self.scalars)


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
            raise InfeasibleVariantError(f"{self.op}: tile={self.tile!r} must be one of the row dims {list(free)}")
        if ext[self.tile] % self.rows:
            raise InfeasibleVariantError(f"{self.op}: rows={self.rows} must divide the extent {ext[self.tile]} of tile "
                                  f"dim {self.tile!r}")
        self.check_vector()
        for name, layout, *_ in self.tiled_tensors:
            n = self.rows if self.sweep(layout) == "tile" else ext[self.reduced]
            if n % self.vec_of(layout):
                raise InfeasibleVariantError(f"{self.op}: vec={self.vec} must divide {n}, the swept extent of "
                                      f"{name}:{layout}")

    @property
    def pitch(self) -> int:
        """Shared-memory row length: one 4-byte word of padding, so column sweeps hit distinct banks."""
        return self.extents[self.reduced] + 4 // ITEMSIZE[self.dtype]


def passes(params: KernelParams, spec: DeviceSpec = H100) -> bool:
    """Whether the point breaks none of its feasibility rules on `spec`."""
    try:
        params.check(spec)
    except InfeasibleVariantError:
        return False
    return True


def feasible(points: Iterable[KernelParams], spec: DeviceSpec = H100) -> list[KernelParams]:
    """The points feasible on `spec`, in order."""
    return [params for params in points if passes(params, spec)]


def widest_vector(make: Callable[[int], KernelParams], spec: DeviceSpec = H100) -> KernelParams | None:
    """The point feasible on `spec` with the widest vector access (8, 4, 2, then 1 element), or None."""
    return next((params for params in map(make, (8, 4, 2, 1)) if passes(params, spec)), None)


@functools.cache
def _keep(p: float) -> tuple[float, int]:
    """Dropout's keep scale 1/(1-p) and 16-bit Philox threshold (a process sees a handful of distinct p). A p so
    small that the threshold rounds to 0 (p <= 2**-17) keeps every element, as the reference's mask does."""
    return (1.0 / (1.0 - p) if p < 1 else 0.0, threshold(p) if p > 0 else 0)


def dropout_arguments(args: OpArgs, p: float) -> tuple[float, int, int]:
    """A kernel's DROPOUT_SIGNATURE arguments for dropout probability p."""
    return (*_keep(p), args.rng_pointer(p))


@dataclass(frozen=True)
class Reduction:
    """How an operator whose main kernel leaves float32 partial sums per block in a workspace adds them into its
    last `outputs` outputs (the gradients summed over rows). `launch`: a second kernel, a dependent launch (it
    starts while the main kernel's last wave runs and waits for it in the kernel: the main kernel calls
    launch_dependents() and the second begins with wait_for_prerequisites()). None: the main kernel adds them
    itself behind a grid-wide barrier (a cooperative launch), taking those outputs after the workspace."""

    launch: PackedLaunch | None
    outputs: int
    workspace_shape: tuple[int, ...]
    device: torch.device

    def __post_init__(self) -> None:
        if self.launch is not None and not self.launch.dependent:
            raise ValueError(f"{self.launch.name}: a Reduction's launch must be dependent (packed with dependent=True): "
                             f"its kernel waits for the main one in-kernel, and the main one lets it start early")


class BoundKernel:
    """A kernel point bound to its cubin on one device; `bound(pointers, args, stream)` launches it.

    `names`: the tensors whose addresses `pointers` holds, in order: every input, then every output, as in
    the parameters' layouts. The main kernel takes them (all but the reduction's outputs) and then its
    `scalars(args)`; an operator with a `Reduction` also passes the workspace's address between the two (and,
    where the main kernel adds up the partials itself, the reduction's outputs after it).
    """

    def __init__(self, names: tuple[str, ...], main: PackedLaunch, scalars: Callable[[OpArgs], tuple],
                 reduction: Reduction | None = None) -> None:
        self.names, self.main, self.scalars, self.reduction = names, main, scalars, reduction
        self._split = len(names) - reduction.outputs if reduction else len(names)
        # The scalars of the last args seen: OpArgs is frozen and a pass hands the same one to all its steps, so
        # they are worked out once per pass (holding the args keeps its id from being reused by another).
        self._last_args: OpArgs | None = None
        self._last_scalars: tuple[float | int, ...] = ()

    @property
    def launches(self) -> tuple[PackedLaunch, ...]:
        """Every launch of a call, in order."""
        return (self.main,) + ((self.reduction.launch,) if self.reduction and self.reduction.launch else ())

    def __call__(self, pointers: Sequence[int], args: OpArgs, stream: int,
                 workspace: torch.Tensor | None = None) -> None:
        """Launch on CUDA stream `stream` (a handle: `torch.cuda.current_stream().cuda_stream`), which must be
        PyTorch's current stream on the device: the workspace of a Reduction comes from PyTorch's caching
        allocator (unless `workspace` is given, checked by the caller), which hands a block to the current
        stream. Allocating it per call, rather than once at bind time, keeps two streams or two CUDA graphs
        launching the same bound kernel from sharing one workspace; under capture it comes from the graph's
        pool."""
        if args is not self._last_args:
            self._last_scalars, self._last_args = self.scalars(args), args
        reduction = self.reduction
        if reduction is None:
            self.main(stream, *pointers, *self._last_scalars)
            return
        if workspace is None:
            workspace = torch.empty(reduction.workspace_shape, dtype=torch.float32, device=reduction.device)
        partials, split = workspace.data_ptr(), self._split
        if reduction.launch is None:
            self.main(stream, *pointers[:split], partials, *pointers[split:], *self._last_scalars)
            return
        self.main(stream, *pointers[:split], partials, *self._last_scalars)
        reduction.launch(stream, partials, *pointers[split:])


class KernelImplementation(Implementation):
    """An implementation whose choice is one point of a kernel family (`KernelParams`): nvcc builds it, a
    configuration's choice is checked by building it, and a device runs it or, where it cannot run there (a
    configuration made on a larger GPU), the cover's first variant that can."""

    @abc.abstractmethod
    def chosen_point(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size
                     ) -> KernelParams:
        """The point `choice` names at `size` (its dtype) in the configuration's layouts, checked against the H100's
        rules: InfeasibleVariantError names a broken rule, TypeError an unknown knob."""

    @abc.abstractmethod
    def cover_variants(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str], spec: DeviceSpec
                       ) -> list[KernelParams]:
        """The variants of the cover in `layouts` at `size` (its dtype) that fit `spec`'s GPU."""

    def params(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> KernelParams:
        """`chosen_point`, its errors as the configuration's."""
        try:
            return self.chosen_point(ops, choice, config, size)
        except (InfeasibleVariantError, TypeError) as err:
            raise self.error(ops, f"variant {choice.label or dict(choice.options)} does not fit this size and "
                                  f"dtype: {err}") from None

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        self.params(ops, choice, config, size)

    def builds(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size,
               spec: DeviceSpec = H100) -> list[KernelParams]:
        return [self.params(ops, choice, config, size)]

    def runnable(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size,
                 dtype: torch.dtype, device: torch.device) -> tuple[KernelParams, DeviceSpec]:
        """The point to run in `dtype` on `device` (see the class), and the device's spec."""
        sized, spec = size.with_dtype(COMPILED_DTYPES[dtype]), DeviceSpec.of(device.index)
        params = runnable_variant(self.params(ops, choice, config, sized), spec,
                                  lambda: self.cover_variants(ops, sized, self.cover_layouts(ops, config), spec),
                                  ops[0].name, lambda message: self.error(ops, message))
        return params, spec
