"""GEMMs whose epilogue is ours: CUTLASS 3 Hopper kernels (TMA loads, warp-specialized wgmma, TMA stores) from
the `nvidia-cutlass` wheel's headers, rendered from `templates/gemm_epilogue.cu.j2` and built by our nvcc JIT
as shared libraries (their host code encodes the TMA descriptors and launches on the caller's stream).

Why CUTLASS: its epilogue visitor trees fuse any elementwise function, vector broadcast and vector reduction
into the GEMM's store at no extra pass over memory, and its Hopper mainloops run at cuBLASLt's speed on
these shapes; cuBLASLt's own GELU epilogues compute the tanh approximation, not BertLayer's erf.

Epilogues (`EPILOGUES`):
- `plain`: D = acc, the yardstick against cuBLASLt (the same call must not be slower for the fusion to pay);
- `bias_gelu`: F = acc stored, D = GELU_erf(F + bias) (ffn_in + bias_gelu: H1 and F in one pass);
- `dgelu_bgrad`: D = acc · GELU'(F + bias) and each tile's sums of D along the other letter, float32 partials
  (ffn_out_dgrad + bias_gelu_bwd: dF and db1; dH1 never exists), which `bias_grad.py`'s kernel adds up into
  the bias gradient (`FusedCall.partial_sums`): deterministic, every sum in a fixed order.
- `dgelu`: D = acc · GELU'(F + bias) alone; the same cover's rows with option `bias_grad=kernel` run it and then
  `bias_grad.py`'s kernel summing dF into db1, one more pass over dF (both are profiled, the optimizer takes the
  faster);
- `bias_gelu_slope` and `slope_bgrad`, a pair (impl `cutlass_gelu_slope`, `GemmGeluSlope`): the forward stores
  GELU'(F + b1) where `bias_gelu` stores F, so the backward multiplies by it (dF = acc · slope) instead of working
  the erf out again. Only this pair's backward reads such an F, so its rows are `coupled`: the optimizer takes
  both or neither (`config_selection/problem.py`).

The call is cuBLAS's column-major one (`tc_profiling.mapping.GemmCall`): D (m × n, m unit-stride), so the bias
runs along m (one value per row of D) or n.

As an implementation (impl `cutlass_epilogue`) it covers a contraction and the operator its epilogue absorbs
(`FUSIONS`): its rows are profiled by the kernel profiler (`profiled_groups`: every layout assignment of the
cover's tensors that one call executes, grouped by call and kernel, each group timed once after a check against
the float64 reference), and the optimizer weighs them against cuBLASLt plus our elementwise kernels.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.metadata
import importlib.util
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from substation.accuracy import relative_error
from substation.device import H100, DeviceSpec
from substation.errors import ConfigurationFileError
from substation.graph import LayerGraph, Operator, layer_graph
from substation.jit import Cubin, compile_library
from substation.kernels.base import environment
from substation.kernels.bias_grad import BiasGradient, BiasGradientLaunch
from substation.layouts import Configuration, enumerate_layouts, permutation
from substation.protocol import AllocatingStep, Choice, Env, Implementation, Infeasible, Step, StepContext
from substation.records import Candidate
from substation.reference import FUSED, OpArgs, gelu_slope
from substation.sizes import DTYPE_NAMES, TORCH_DTYPES, Size
from substation.tc_profiling.gemm import check_call
from substation.tc_profiling.mapping import GemmCall, GemmMapping, letter_groups, map_contraction

TEMPLATE = "gemm_epilogue.cu.j2"
EPILOGUES = ("plain", "bias_gelu", "dgelu_bgrad", "dgelu", "bias_gelu_slope", "slope_bgrad")
# those writing a bias gradient's per-tile float32 sums (`partial_sums`)
PARTIAL_SUM_EPILOGUES = ("dgelu_bgrad", "slope_bgrad")
ELEMENTS = {torch.float16: "cutlass::half_t", torch.bfloat16: "cutlass::bfloat16_t"}
ARCH = "sm_90a"  # wgmma and TMA: Hopper's architecture-specific target
ALIGNMENT = 8  # elements: TMA needs 16-byte aligned leading dimensions and bases
RASTERS = {"heuristic": "Heuristic", "m": "AlongM", "n": "AlongN"}  # CUTLASS's RasterOrderOptions


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


@functools.cache
def cutlass_package() -> str:
    """The headers' package and version: what the kernel cache's key names in place of their directory."""
    return f"nvidia-cutlass {importlib.metadata.version('nvidia-cutlass')}"


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
    # The epilogue's subtile (m, n), each stored through shared memory by one TMA store; None: CUTLASS's choice
    # (m 128 cooperative / 64 pingpong, n 32), whose many small subtiles each wait on a barrier and a store.
    epilogue_tile: tuple[int, int] | None = None
    # The persistent scheduler's tile order: CUTLASS's swizzle (tiles of `swizzle` neighbours along the minor
    # direction visited together, for L2 reuse of A and B) and raster (which of m, n runs fastest; "heuristic":
    # along the direction with fewer tiles).
    swizzle: int = 1
    raster: str = "heuristic"

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
        if self.swizzle not in (1, 2, 4, 8) or self.raster not in RASTERS:
            raise ValueError(f"swizzle {self.swizzle}, raster {self.raster!r}: expected 1, 2, 4 or 8 and one of "
                             f"{list(RASTERS)}")
        if self.epilogue_tile is not None:
            epi_m, epi_n = self.epilogue_tile
            if epi_m != (128 if self.schedule == "cooperative" else 64) or epi_n % 16 or self.tile[1] % epi_n:
                raise ValueError(f"epilogue tile {self.epilogue_tile}: m is 128 (cooperative) or 64 (pingpong), n a "
                                 f"multiple of 16 dividing the tile's n ({self.tile[1]})")

    @property
    def writes_partials(self) -> bool:
        """Whether the epilogue writes a bias gradient's per-tile partial sums, which `partial_sums` adds up."""
        return self.epilogue in PARTIAL_SUM_EPILOGUES

    @property
    def label(self) -> str:
        epilogue_tile = "" if self.epilogue_tile is None else f" epi {'x'.join(map(str, self.epilogue_tile))}"
        order = "" if (self.swizzle, self.raster) == (1, "heuristic") else f" swizzle {self.swizzle} {self.raster}"
        return (f"{self.epilogue}[{self.transa}{self.transb},bias_{self.bias_along}] {self.schedule} "
                f"{'x'.join(map(str, self.tile))} cluster {'x'.join(map(str, self.cluster))}{epilogue_tile}{order}")

    def render(self) -> str:
        (tile_m, tile_n, tile_k), (cluster_m, cluster_n) = self.tile, self.cluster
        return environment().get_template(TEMPLATE).render(
            element=ELEMENTS[self.dtype], transa=self.transa, transb=self.transb, bias_along=self.bias_along,
            epilogue=self.epilogue, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, cluster_m=cluster_m,
            cluster_n=cluster_n, schedule=self.schedule, epilogue_tile=self.epilogue_tile, swizzle=self.swizzle,
            raster=RASTERS[self.raster])

    def compile(self, spec: DeviceSpec = H100) -> Cubin:
        """The shared library for Hopper (`spec` must be one: wgmma and TMA are sm_90a's)."""
        if spec.arch != "sm_90":
            raise CutlassError(f"{self.label}: Hopper kernels (sm_90a) cannot run on {spec.name} ({spec.arch})")
        return compile_library(self.render(), self.label, ARCH, {cutlass_include(): cutlass_package()})


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
def loaded(variant: GemmEpilogueVariant, spec: DeviceSpec = H100) -> EpilogueGemm:
    """The variant compiled for `spec` (or from the cache) and loaded, once per process."""
    return EpilogueGemm(variant, variant.compile(spec))


# -- the implementation: a contraction and the operator its epilogue absorbs ------------------------------------
IMPL = "cutlass_epilogue"


class GemmShape(NamedTuple):
    """How a row's kernel is built: the schedule, tile and cluster, the epilogue's subtile (None: CUTLASS's) and
    the persistent scheduler's raster ("heuristic": CUTLASS's). Rows name the last two only where they are given."""

    schedule: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    epilogue_tile: tuple[int, int] | None = None
    raster: str = "heuristic"


# The profiled shapes: the fastest of scripts/time_gemm_epilogue.py's sweep on the H100 at both BERT-large sizes
# (layouts/h100-gemm_epilogue.txt); 128x128 cooperative tiles and 256-row tiles never won. CUTLASS's raster heuristic
# runs along n where the tile counts are equal (B8/L512's 4096 x 4096 calls), and along m was faster there
# (layouts/h100-gemm_epilogue-orders.txt): the pingpong shape is also profiled along m.
SHAPES = (GemmShape("cooperative", (128, 256, 64), (2, 1)), GemmShape("cooperative", (128, 256, 64), (1, 2)),
          GemmShape("pingpong", (128, 128, 64), (1, 2)), GemmShape("pingpong", (128, 128, 64), (1, 2), raster="m"))


@dataclass(frozen=True)
class Fusion:
    """A contraction and the operator its epilogue does: the bias it adds and the tensor it keeps beside the
    result in the result's layout (F: written by the forward, read by the backward). `separate`: the epilogue
    that leaves the operator's bias gradient to `bias_grad.py`'s kernel (rows with option bias_grad=kernel).
    `impl` names its rows, `shapes` the kernels profiled; `slope`: the aux holds GELU'(F + bias), not F."""

    covers: tuple[str, str]
    epilogue: str
    bias: str
    aux: str
    separate: str | None = None
    impl: str = IMPL
    shapes: tuple[GemmShape, ...] = SHAPES
    slope: bool = False

    def epilogue_of(self, separate: bool) -> str:
        if separate and self.separate is None:
            raise ValueError(f"{list(self.covers)}: its epilogue computes no bias gradient to leave to a kernel")
        return self.separate if separate else self.epilogue


FUSIONS = (Fusion(("ffn_in", "bias_gelu"), "bias_gelu", "b1", "F"),
           Fusion(("ffn_out_dgrad", "bias_gelu_bwd"), "dgelu_bgrad", "b1", "F", separate="dgelu"))
# The slope pair: pingpong shapes only, the only ones the GELU epilogues' profiles ever chose (H100, H200).
SLOPE_IMPL = "cutlass_gelu_slope"
SLOPE_FUSIONS = tuple(Fusion(covers, epilogue, "b1", "F", impl=SLOPE_IMPL, shapes=SHAPES[2:], slope=True)
                      for covers, epilogue in ((("ffn_in", "bias_gelu"), "bias_gelu_slope"),
                                               (("ffn_out_dgrad", "bias_gelu_bwd"), "slope_bgrad")))
SEPARATE = {"bias_grad": "kernel"}  # the option of a row whose bias gradient is a kernel of its own


def separate_of(options: Mapping[str, object]) -> bool:
    """Whether a row runs its bias gradient as a kernel of its own (rows without the option: in the epilogue)."""
    return options.get("bias_grad") == SEPARATE["bias_grad"]


def fusion_of(covers: Sequence[str], impl: str = IMPL) -> Fusion:
    fusions = {IMPL: FUSIONS, SLOPE_IMPL: SLOPE_FUSIONS}.get(impl, ())
    found = next((f for f in fusions if f.covers == tuple(covers)), None)
    if found is None:
        raise ValueError(f"no epilogue of {impl} covers {list(covers)}; known: {[f.covers for f in fusions]}")
    return found


@dataclass(frozen=True)
class FusedCall:
    """A fusion in one layout assignment: the GEMM call whose result is stored where the fused operator's first
    output is (H1, dF), and the letter of the call the bias runs along."""

    fusion: Fusion
    layouts: tuple[tuple[str, str], ...]  # the cover's tensors in and out, as its rows name them
    mapping: GemmMapping
    bias_along: str

    @property
    def call(self) -> GemmCall:
        assert self.mapping.call is not None
        return self.mapping.call

    def variant(self, shape: GemmShape, dtype: torch.dtype, separate: bool = False) -> GemmEpilogueVariant:
        return GemmEpilogueVariant(self.fusion.epilogue_of(separate), "T" if self.call.transa else "N",
                                   "T" if self.call.transb else "N", self.bias_along, shape.tile, shape.cluster,
                                   shape.schedule, dtype, shape.epilogue_tile, raster=shape.raster)

    def bias_gradient(self, extents: Mapping[str, int], dtype: torch.dtype, spec: DeviceSpec = H100,
                      graph: LayerGraph | None = None) -> BiasGradient:
        """The kernel summing the result (dF) into the bias gradient, for rows with option bias_grad=kernel."""
        graph = graph or layer_graph()
        (letter,) = graph.tensors[self.fusion.bias].dims
        result = graph.operator(self.fusion.covers[1]).outputs[0]
        return BiasGradient.of(dict(self.layouts)[result], letter, extents, DTYPE_NAMES[dtype], spec)

    def reduction(self, shape: GemmShape, extents: Mapping[str, int], dtype: torch.dtype, separate: bool,
                  spec: DeviceSpec = H100, graph: LayerGraph | None = None) -> BiasGradient | None:
        """The kernel after the GEMM that finishes the bias gradient: over dF (`separate`), over the epilogue's
        partial sums, or none (the forward's epilogue has no bias gradient)."""
        if separate:
            return self.bias_gradient(extents, dtype, spec, graph)
        variant = self.variant(shape, dtype)
        return partial_sums(variant, self.call, spec) if variant.writes_partials else None

    def candidate(self, shape: GemmShape, graph: LayerGraph | None = None, separate: bool = False) -> Candidate:
        graph = graph or layer_graph()
        gemm, fused = (graph.operator(name) for name in self.fusion.covers)
        layouts = dict(self.layouts)
        inputs = {t: layouts[t] for t in cover_inputs(gemm, fused)}
        outputs = {t: layouts[t] for t in cover_outputs(gemm, fused)}
        options = self.call.options() | {"a": self.mapping.a_operand, "schedule": shape.schedule,
                                         "tile": "x".join(map(str, shape.tile)),
                                         "cluster": "x".join(map(str, shape.cluster))}
        if shape.epilogue_tile is not None:  # rows of CUTLASS's own epilogue tile or raster have no such option
            options["epilogue_tile"] = "x".join(map(str, shape.epilogue_tile))
        if shape.raster != "heuristic":
            options["raster"] = shape.raster
        if separate:
            self.fusion.epilogue_of(separate)
            options |= SEPARATE
        return Candidate.make(gemm.name, gemm.pass_, self.fusion.impl, inputs, outputs, options,
                              covers=self.fusion.covers)


def partial_sums(variant: GemmEpilogueVariant, call: GemmCall, spec: DeviceSpec = H100) -> BiasGradient:
    """The kernel adding up a `dgelu_bgrad` GEMM's partial sums into the bias gradient. CUTLASS writes one float32
    row per (batch, tile of the summed letter), each as long as the bias letter's extent rounded up to its tile:
    [batch · ceil(n / tile_n), round(m, tile_m)] where the bias runs along m, the other way round along n."""
    tile_m, tile_n, _ = variant.tile
    along, across, tile_along, tile_across = ((call.m, call.n, tile_m, tile_n) if variant.bias_along == "m"
                                              else (call.n, call.m, tile_n, tile_m))
    return BiasGradient(call.batch * -(-across // tile_across), along, 1, "float32", spec.sm_count,
                        stride=-(-along // tile_along) * tile_along, out_dtype=DTYPE_NAMES[variant.dtype])


def cover_inputs(gemm: Operator, fused: Operator) -> tuple[str, ...]:
    return tuple(dict.fromkeys(t for t in gemm.inputs + fused.inputs if t not in gemm.outputs))


def cover_outputs(gemm: Operator, fused: Operator) -> tuple[str, ...]:
    """What the cover stores: the fused operator's outputs, and the GEMM's result only where the forward keeps
    it for the backward (F); dH1 never exists."""
    kept = tuple(t for t in gemm.outputs if t not in fused.inputs or gemm.pass_ == "forward")
    return kept + fused.outputs


def fused_call(fusion: Fusion, layouts: Mapping[str, str], extents: Mapping[str, int],
               graph: LayerGraph | None = None) -> FusedCall | str:
    """The fused call of these layouts (of the cover's tensors), or why there is none."""
    graph = graph or layer_graph()
    gemm, fused = (graph.operator(name) for name in fusion.covers)
    result = fused.outputs[0]
    if layouts[fusion.aux] != layouts[result]:
        return (f"{fusion.aux}:{layouts[fusion.aux]} is not laid out as {result}:{layouts[result]}: the epilogue "
                f"{'writes' if gemm.pass_ == 'forward' else 'reads'} it with the result's strides")
    (a, b), (product,) = gemm.inputs, gemm.outputs
    mapping = map_contraction(gemm, {a: layouts[a], b: layouts[b], product: layouts[result]}, extents)
    if mapping.call is None:
        return mapping.reason or "no GEMM call"
    call = mapping.call
    unaligned = [name for name in ("lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c")
                 if getattr(call, name) % ALIGNMENT]
    if unaligned or call.m % ALIGNMENT or call.n % ALIGNMENT or call.k % ALIGNMENT:
        return f"TMA needs 16-byte aligned extents and strides; {call} has {unaligned or 'm, n or k'} unaligned"
    groups = letter_groups(gemm.einsum)
    rows = next(letters for letters in (groups["m"], groups["n"]) if layouts[result][-1] in letters)
    columns = groups["n"] if rows == groups["m"] else groups["m"]
    bias_letters = set(graph.tensors[fusion.bias].dims)
    if bias_letters not in (set(rows), set(columns)):
        return (f"{fusion.bias} runs over {sorted(bias_letters)}, neither the result's rows {rows!r} nor columns "
                f"{columns!r}")
    names = cover_inputs(gemm, fused) + cover_outputs(gemm, fused)
    return FusedCall(fusion, tuple((t, layouts[t]) for t in names), mapping,
                     "m" if bias_letters == set(rows) else "n")


def shape_of(options: Mapping[str, object]) -> GemmShape:
    """A row's kernel shape, from its options."""
    def numbers(key: str) -> tuple[int, ...] | None:  # "128x256x64" -> (128, 256, 64)
        return tuple(int(x) for x in str(options[key]).split("x")) if key in options else None
    return GemmShape(str(options["schedule"]), numbers("tile"), numbers("cluster"), numbers("epilogue_tile"),
                     str(options.get("raster", "heuristic")))


@dataclass(frozen=True)
class EpilogueGroup:
    """One kernel on one call and every layout assignment of the cover it executes (one timing for all; with
    `separate`, the bias-gradient kernel after it, which sees the same bytes in every assignment)."""

    variant: GemmEpilogueVariant
    calls: tuple[FusedCall, ...]
    shape: GemmShape
    size: Size  # in the group's dtype

    @property
    def dtype(self) -> str:
        return self.size.dtype

    @property
    def separate(self) -> bool:
        """Whether the kernel leaves its bias gradient to `bias_grad.py`'s kernel."""
        return self.variant.epilogue == self.calls[0].fusion.separate

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        return tuple(fc.candidate(self.shape, separate=self.separate) for fc in self.calls)

    def reduction(self, spec: DeviceSpec = H100) -> BiasGradient | None:
        """The kernel finishing the bias gradient after the GEMM (`FusedCall.reduction`)."""
        return self.calls[0].reduction(self.shape, self.size.extents, TORCH_DTYPES[self.dtype], self.separate, spec)

    def compile(self, spec: DeviceSpec = H100) -> Cubin:
        reduction = self.reduction(spec)
        if reduction is not None:
            reduction.compile(spec)
        return self.variant.compile(spec)


def profiled_groups(size: Size, graph: LayerGraph | None = None) -> list[EpilogueGroup]:
    """Every fusion in every layout assignment of its stored tensors that one call executes, times `SHAPES`, and
    where the fusion may leave its bias gradient to a kernel, both ways; grouped by kernel and call (and the
    bias-gradient kernel's shape) (`size.dtype`)."""
    graph = graph or layer_graph()
    dtype = TORCH_DTYPES[size.dtype]
    groups: dict[tuple, list[FusedCall]] = defaultdict(list)
    for fusion in FUSIONS + SLOPE_FUSIONS:
        gemm, fused = (graph.operator(name) for name in fusion.covers)
        (a, b), result = gemm.inputs, fused.outputs[0]
        for la, lb, lr in itertools.product(*(enumerate_layouts(graph.tensors[t].dims) for t in (a, b, result))):
            layouts = {t: graph.tensors[t].dims for t in cover_inputs(gemm, fused) + cover_outputs(gemm, fused)}
            layouts |= {a: la, b: lb, result: lr, fusion.aux: lr}
            found = fused_call(fusion, layouts, size.extents, graph)
            if isinstance(found, FusedCall):
                separates = (False, True) if fusion.separate else (False,)
                for shape, separate in itertools.product(fusion.shapes, separates):
                    reduction = found.reduction(shape, size.extents, dtype, separate, graph=graph)
                    groups[found.variant(shape, dtype, separate), found.call, shape, reduction].append(found)
    return [EpilogueGroup(variant, tuple(calls), shape, size) for (variant, _, shape, _), calls in groups.items()]


def _random(layout: str, extents: Mapping[str, int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn([extents[d] for d in layout], generator=generator, device="cuda").to(dtype)


def checked_runner(group: EpilogueGroup, size: Size) -> tuple[Callable[[], None], float]:
    """A closure running the group's kernel on random inputs in its first assignment's layouts, and its outputs'
    max relative error against the float64 reference of the two operators (the graph's own). A slope pair's
    forward F is checked as GELU'(F + b1); its backward reads such a slope, made from random F as the forward
    would make it, and is checked against the reference's dF = dH1 · slope with the slope as stored."""
    graph, extents, dtype = layer_graph(), size.extents, TORCH_DTYPES[size.dtype]
    fc = group.calls[0]
    fusion = fc.fusion
    gemm, fused = (graph.operator(name) for name in fusion.covers)
    layouts = dict(fc.layouts)
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = {t: _random(layouts[t], extents, dtype, generator) for t in cover_inputs(gemm, fused)}
    logical = {t: x.double().permute(permutation(layouts[t], graph.tensors[t].dims)) for t, x in inputs.items()}

    def slope_of(f: torch.Tensor) -> torch.Tensor:  # GELU'(F + b1), b1 along F's last letter (u)
        return gelu_slope(f + logical[fusion.bias])

    if fusion.slope and fusion.aux in inputs:
        slope = slope_of(logical[fusion.aux])
        inputs[fusion.aux] = slope.permute(permutation(graph.tensors[fusion.aux].dims, layouts[fusion.aux])).to(
            dtype).contiguous()
        logical[fusion.aux] = inputs[fusion.aux].double().permute(permutation(layouts[fusion.aux],
                                                                              graph.tensors[fusion.aux].dims))
    device = torch.device("cuda", torch.cuda.current_device())
    reduction = group.reduction(DeviceSpec.of(device.index))
    launch = None if reduction is None else BiasGradientLaunch(reduction, device)
    step = EpilogueGemmStep([gemm, fused], Choice(fusion.covers, fusion.impl), fc, loaded(group.variant), layouts,
                            extents, dtype, device, launch)
    ctx = StepContext(OpArgs(scale=1 / math.sqrt(size.P)), extents, torch.cuda.current_stream().cuda_stream)
    out = step(inputs, ctx)
    (a, b), (product,) = gemm.inputs, gemm.outputs
    logical[product] = torch.einsum(gemm.einsum, logical[a], logical[b])
    if fusion.slope and fusion.aux in inputs:  # dF = dH1 · slope, db1 its sums
        d_result = logical[product] * logical[fusion.aux]
        want = dict(zip(fused.outputs, (d_result, d_result.sum((0, 1)))))
    else:
        want = dict(zip(fused.outputs, FUSED[fused.name](ctx.args, *(logical[t] for t in fused.inputs))))
    # F: the product itself (the slope pair's: its GELU')
    want.update({t: slope_of(logical[t]) if fusion.slope else logical[t] for t in step.outputs if t not in want})
    error = max(relative_error(out[t].double().permute(permutation(layouts[t], graph.tensors[t].dims)), w)
                for t, w in want.items())
    return (lambda: step(inputs, ctx)), error


class EpilogueGemmStep(AllocatingStep):
    """One GEMM with our epilogue doing the cover's second operator: forward F and H1 from X1, W1, b1; backward
    dF from dG, W2, F, b1 and db1 from `reduction`, the bias-gradient kernel after it, summing either the
    epilogue's per-tile partial sums (a buffer made once) or dF itself (`separate`)."""

    def __init__(self, ops: Sequence[Operator], choice: Choice, fused: FusedCall, gemm: EpilogueGemm,
                 layouts: Mapping[str, str], extents: Mapping[str, int], dtype: torch.dtype,
                 device: torch.device, reduction: BiasGradientLaunch | None = None) -> None:
        super().__init__(ops, choice)
        self.outputs = cover_outputs(*ops)
        self.bind_outputs(layouts, extents, dtype, device)
        self.gemm, self.call = gemm, fused.call
        self.a, self.b = fused.mapping.a_operand, fused.mapping.b_operand
        self.result, self.bias, self.aux = ops[1].outputs[0], fused.fusion.bias, fused.fusion.aux
        self.bias_gradient = ops[1].outputs[1] if len(ops[1].outputs) > 1 else None
        self.workspace = torch.empty(max(1, gemm.workspace_bytes(self.call)), dtype=torch.uint8, device=device)
        self.reduction = reduction
        # the epilogue's per-tile sums, which `reduction` adds up
        self.partials = (torch.empty(reduction.kernels.outer * reduction.kernels.stride, dtype=torch.float32,
                                     device=device) if gemm.variant.writes_partials else None)

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        out = self.allocate(ctx.into)
        aux = (out if self.aux in out else env)[self.aux]
        bias_gradient = out[self.bias_gradient].data_ptr() if self.bias_gradient else 0
        result = out[self.result].data_ptr()
        partials = 0 if self.partials is None else self.partials.data_ptr()
        self.gemm(self.call, env[self.a].data_ptr(), env[self.b].data_ptr(), result, ctx.stream, aux=aux.data_ptr(),
                  bias=env[self.bias].data_ptr(), bias_gradient=partials, workspace=self.workspace.data_ptr())
        if self.reduction:
            self.reduction(partials or result, bias_gradient, ctx.stream)
        return out


class GemmEpilogue(Implementation):
    """A contraction and the elementwise operator after it as one CUTLASS GEMM with our epilogue (`FUSIONS`)."""

    impl = IMPL
    fusions = FUSIONS

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return tuple(fusion.covers for fusion in self.fusions)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        fusion = fusion_of([op.name for op in ops], self.impl)
        found = fused_call(fusion, layouts, size.extents)
        if isinstance(found, str):
            yield Infeasible(self.impl, fusion.covers, found)
            return
        for shape, separate in itertools.product(fusion.shapes, (False, True) if fusion.separate else (False,)):
            yield found.candidate(shape, separate=separate)

    def cover_layouts(self, ops: Sequence[Operator], config: Configuration) -> dict[str, str]:
        """The layouts the cover reads (its pass's) and stores; the GEMM's own result is never stored apart."""
        gemm, fused = ops
        names = cover_inputs(gemm, fused) + cover_outputs(gemm, fused)
        return {t: config.layout(t, gemm.pass_) if t in cover_inputs(gemm, fused) else config.layouts[t]
                for t in names}

    def fused(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> FusedCall:
        """The fused call of the configuration's layouts at this size, checked against the recorded one."""
        found = fused_call(fusion_of([op.name for op in ops], self.impl), self.cover_layouts(ops, config),
                           size.extents)
        if isinstance(found, str):
            raise self.error(ops, f"cannot run these layouts: {found}")
        check_call(ops[0], choice, found.call, lambda message: self.error(ops, message))
        try:
            found.variant(shape_of(choice.options), torch.float16, separate_of(choice.options))
        except (KeyError, ValueError) as err:
            raise self.error(ops, f"options {dict(choice.options)} name no kernel: {err}") from None
        return found

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        self.fused(ops, choice, config, size)

    def at_size(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> Choice:
        """This choice at `size`: the call of its layouts there, with the kernel (tile shape) it records."""
        try:
            self.check(ops, choice, config, size)
            return choice
        except ConfigurationFileError as err:
            found = fused_call(fusion_of([op.name for op in ops], self.impl), self.cover_layouts(ops, config),
                               size.extents)
            if isinstance(found, str):
                raise self.error(ops, f"has no candidate at B={size.B}, L={size.L} in these layouts ({err})") from None
            candidate = found.candidate(shape_of(choice.options), separate=separate_of(choice.options))
            return dataclasses.replace(choice, options=candidate.options_dict, label=candidate.label, predicted_us=None)

    def variant(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size
                ) -> GemmEpilogueVariant:
        """The GEMM this choice runs at `size` (in its dtype)."""
        return self.fused(ops, choice, config, size).variant(shape_of(choice.options), TORCH_DTYPES[size.dtype],
                                                             separate_of(choice.options))

    def builds(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size,
               spec: DeviceSpec = H100) -> list[GemmEpilogueVariant | BiasGradient]:
        """What nvcc builds for this choice at `size`: the GEMM, and the kernel finishing its bias gradient."""
        found = self.fused(ops, choice, config, size)
        dtype, separate, shape = TORCH_DTYPES[size.dtype], separate_of(choice.options), shape_of(choice.options)
        reduction = found.reduction(shape, size.extents, dtype, separate, spec)
        return [found.variant(shape, dtype, separate)] + ([reduction] if reduction is not None else [])

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        found, spec = self.fused(ops, choice, config, size), DeviceSpec.of(device.index)
        separate, shape = separate_of(choice.options), shape_of(choice.options)
        gemm = loaded(found.variant(shape, dtype, separate), spec)
        reduction = found.reduction(shape, size.extents, dtype, separate, spec)
        return EpilogueGemmStep(ops, choice, found, gemm, self.cover_layouts(ops, config), size.extents, dtype, device,
                                None if reduction is None else BiasGradientLaunch(reduction, device))


class GemmGeluSlope(GemmEpilogue):
    """The GELU epilogues as a pair whose forward stores GELU'(F + b1) in F's place (`SLOPE_FUSIONS`): coupled,
    since no other backward of bias_gelu reads such an F."""

    impl = SLOPE_IMPL
    fusions = SLOPE_FUSIONS
    coupled = True
