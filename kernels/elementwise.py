"""The elementwise fused operators, for any layout of every tensor:

    qkv_bias:      QKV: bjthp, bqkv: thp -> Q: bhjp, K: bhkp, V: bhkp     (slice t = 0, 1, 2 of QKV + bqkv)
    qkv_bias_bwd:  dQ: bhjp, dK: bhkp, dV: bhkp -> dQKV: bjthp, dbqkv: thp = Σ_bj dQKV
    bias_gelu:     F: bju, b1: u -> H1: bju = GELU_erf(F + b1)
    bias_gelu_bwd: dH1: bju, F: bju, b1: u -> dF: bju = dH1·GELU_erf'(F + b1), db1: u = Σ_bj dF
    residual_bwd:  dXa: bji, dR1: bji -> dX: bji = dXa + dR1

Each operator iterates over one space of dims (`_Spec.space`; K and V's key position k runs over j's
range and is read as j). The math is float32, rounded once into the dtype; GELU is the exact erf form.

Tiling. A block owns a 2-D tile of the space, `tx` elements along dim x and `ty` along dim y
(`tile` = "xy"), with every other dim fixed, and walks `steps` consecutive coordinates of one more dim
(`loop`). Each tensor sweeps the tile in its own layout order, so its fast dim is whichever of x and y
comes later in its layout; where that dim is the tensor's innermost, it moves `vec` elements per access.
  - x-sweep tensors go straight between global memory and registers in the compute phase, in which a
    thread owns `vec` consecutive elements along x;
  - y-sweep tensors go through shared memory (the tile stored y-major, x contiguous): loaded along y
    before the compute phase, stored along y after it (one thread per x, so shared memory has no bank
    conflicts; the compute phase reads and writes it in `vec`-wide vectors).
When every tensor sweeps x, this is a plain vectorized elementwise kernel without shared memory. Q, K
and V may have three different layouts: the block body is rendered once per distinct layout and the
block picks its body by t.

Bias gradients (dbqkv, db1) are deterministic, without atomics: the compute phase leaves its float32
values in shared memory; teams of lanes sum every gradient element over the tile's b, j elements in a
fixed order (and over the steps, when the block walks b or j), and the block writes one partial sum per
gradient element into a float32 workspace [NR, NK] (NR: blocks along b and j; NK: gradient elements in
the gradient's layout order). A second kernel (`<name>_sum`, same cubin) adds each element's NR partials
in a fixed order, in double, and rounds once. Both run on PyTorch's current stream and the launcher
allocates the workspace there, so a CUDA graph captures both (the workspace then comes from its pool).
"""
from __future__ import annotations

import functools
import abc
import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from substation.device import H100, DeviceSpec
from substation.errors import GraphError
from substation.graph import layer_graph
from substation.jit import Cubin
from substation.kernels.base import (ITEMSIZE, SIZE_FIELDS, BoundKernel, InfeasibleVariantError, KernelParams, Reduction,
                                     strides, widest_vector)
from substation.sizes import Size

OPS = ("qkv_bias", "qkv_bias_bwd", "bias_gelu", "bias_gelu_bwd", "residual_bwd")
MAX_ACCUMULATORS = 32  # float32 partial sums of the bias gradient a thread keeps in registers
SUM_THREADS, SUM_COLUMNS = 256, 32  # the partial-sum kernel: 8 warps share 32 gradient elements
MAX_STEPS = 16  # `variants`: the most steps a block walks


@dataclass(frozen=True)
class _Spec:
    space: str  # the iteration dims, canonical order
    value: str  # the big output's value: a C expression over float32 locals named like the inputs
    split: tuple[str, ...] = ()  # tensors holding one slice t = 0, 1, 2 of the space each (Q, K, V)
    reduce: tuple[str, str] | None = None  # (tensor summed over b and j, its bias gradient)

    @property
    def alias(self) -> str:
        """The C name of the split tensors in the block body (the one the block's t picks)."""
        return "_".join(self.split)


SPECS = {
    "qkv_bias": _Spec("bjthp", "QKV + bqkv", split=("Q", "K", "V")),
    "qkv_bias_bwd": _Spec("bjthp", "dQ_dK_dV", split=("dQ", "dK", "dV"), reduce=("dQKV", "dbqkv")),
    "bias_gelu": _Spec("bju", "gelu_erf(F + b1)"),
    "bias_gelu_bwd": _Spec("bju", "dH1 * gelu_erf_grad(F + b1)", reduce=("dF", "db1")),
    "residual_bwd": _Spec("bji", "dXa + dR1"),
}


def _space(layout: str) -> str:
    """A layout in the space's letters: the key position k is read as j."""
    return layout.replace("k", "j")


def _linear(terms: list[tuple[str, int]]) -> str:
    """The C expression Σ coordinate·stride in long long, zero strides left out."""
    parts = [f"(long long)({c})" + (f" * {s}" if s != 1 else "") for c, s in terms if s]
    return " + ".join(parts) or "0ll"


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class ElementwiseParams(KernelParams):
    """Knobs shared by the elementwise operators (sizes come with the subclasses)."""

    tile: str = ""  # two dims: x (the compute phase's fast dim, contiguous in shared memory), then y
    tx: int = 1  # tile extent along x
    ty: int = 1  # tile extent along y
    loop: str = ""  # the dim a block walks `steps` coordinates of ('' when steps == 1)
    steps: int = 1
    vec: int = 1  # elements per vector access
    threads: int = 256

    template = "elementwise.cu.j2"
    ops: ClassVar[tuple[str, ...]] = ()

    def size_fields(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if f.name in SIZE_FIELDS)

    @property
    @abc.abstractmethod
    def extents(self) -> dict[str, int]:
        """The extent of every dim of the space."""

    @functools.cached_property
    def spec(self) -> _Spec:
        return SPECS[self.op]

    @property
    def space_layouts(self) -> dict[str, str]:
        return {name: _space(layout) for name, layout in self.layouts}

    @property
    def tile_extents(self) -> dict[str, int]:
        return {self.tile[0]: self.tx, self.tile[1]: self.ty}

    # -- the tensors ------------------------------------------------------------------------------

    def _groups(self) -> list[tuple[str, tuple[str, ...], bool]]:
        """(C name, member tensors, is output) of the tensors spanning the space; Q, K, V are one group."""
        operator, spec = layer_graph().operator(self.op), self.spec
        groups, done = [], False
        for name in operator.inputs + operator.outputs:
            if name in spec.split:
                if not done:
                    groups.append((spec.alias, spec.split, name in operator.outputs))
                done = True
            elif sorted(_space(layer_graph().tensors[name].dims)) == sorted(spec.space):
                groups.append((name, (name,), name in operator.outputs))
        return groups

    @property
    def bias(self) -> str | None:
        """The input added along some dims of the space (bqkv, b1), if any."""
        operator, space = layer_graph().operator(self.op), sorted(self.spec.space)
        return next((n for n in operator.inputs if n not in self.spec.split
                     and sorted(layer_graph().tensors[n].dims) != space), None)

    def sweep(self, layout: str) -> str:
        """'y' for a tensor that has y later than x in its layout (it goes through shared memory), else 'x'."""
        x, y = self.tile
        return "y" if self.ty > 1 and layout.index(y) > layout.index(x) else "x"

    def vec_of(self, layout: str) -> int:
        """Vector accesses need the tensor's fast dim to be its innermost dim; otherwise one element each."""
        fast = self.tile[1] if self.sweep(layout) == "y" else self.tile[0]
        return self.vec if layout[-1] == fast else 1

    def _offsets(self, layout: str) -> dict[str, str]:
        """C expressions of a tensor's offsets: `base` of the block's tile (its step), `at` of tile element
        (cx, cy), `at_e` of element (cx + e, cy). Dims the tensor lacks have stride 0."""
        x, y = self.tile
        st = strides(layout, self.extents)
        start = lambda d: f"{d}0" if d in self.tile else d  # noqa: E731
        return dict(base=_linear([(start(d), st.get(d, 0)) for d in self.spec.space]),
                    at=_linear([("cy", st.get(y, 0)), ("cx", st.get(x, 0))]),
                    at_e=_linear([("cy", st.get(y, 0)), ("cx + e", st.get(x, 0))]))

    def _tensor(self, name: str, layout: str, output: bool) -> dict[str, object]:
        return dict(name=name, output=output, sweep=self.sweep(layout), vec=self.vec_of(layout),
                    **self._offsets(layout))

    def bodies(self) -> list[dict[str, object]]:
        """One block body per distinct layout of the split tensors (one body for the other operators)."""
        layouts, spec = self.space_layouts, self.spec
        by_layout: dict[str | None, list[int]] = {}
        for t, name in enumerate(spec.split):
            by_layout.setdefault(layouts[name], []).append(t)
        bodies = []
        for split_layout, ts in (by_layout or {None: []}).items():
            tensors = [self._tensor(cname, split_layout if len(members) > 1 else layouts[cname], output)
                       for cname, members, output in self._groups()]
            through_shared = [t for t in tensors if t["sweep"] == "y"]
            for i, t in enumerate(through_shared):
                t["smem"] = self.reduce_bytes + i * self.buffer_bytes
            cond = " || ".join(f"t == {t}" for t in ts) if len(by_layout) > 1 else None
            inputs, (output,) = [t for t in tensors if not t["output"]], [t for t in tensors if t["output"]]
            bodies.append(dict(cond=cond, tensors=tensors, inputs=inputs, output=output,
                               loads=[t for t in inputs if t["sweep"] == "y"]))
        return bodies

    # -- sizes of the launch ------------------------------------------------------------------------

    @property
    def buffer_bytes(self) -> int:
        return _align16(self.tx * self.ty * ITEMSIZE[self.dtype])

    @property
    def reduce_bytes(self) -> int:
        return _align16(self.tx * self.ty * 4) if self.spec.reduce else 0

    @functools.cached_property
    def shared_bytes(self) -> int:
        through_shared = max(sum(t["sweep"] == "y" for t in body["tensors"]) for body in self.bodies())
        return self.reduce_bytes + through_shared * self.buffer_bytes

    def grid_dims(self) -> list[tuple[str, int, int]]:
        """(C variable, count, scale) of every dim a block index spans, outermost first: the first input's
        layout order, so neighbouring blocks touch neighbouring memory; dims it lacks (t) go outermost."""
        first = self.space_layouts[self._groups()[0][1][0]]
        order = [d for d in self.spec.space if d not in first] + list(first)
        ext, dims = self.extents, []
        for d in order:
            if d in self.tile:
                dims.append((f"{d}0", ext[d] // self.tile_extents[d], self.tile_extents[d]))
            elif d == self.loop:
                dims.append((f"{d}0", ext[d] // self.steps, self.steps))
            else:
                dims.append((d, ext[d], 1))
        return dims

    @functools.cached_property
    def grid(self) -> int:
        return math.prod(count for _, count, _ in self.grid_dims())

    def reduction(self) -> dict[str, object] | None:
        """How a block sums the bias gradient over its tile (see the module docstring), or None."""
        if self.spec.reduce is None:
            return None
        _, gradient = self.spec.reduce
        kept, (x, y), ext, tile = self.space_layouts[gradient], self.tile, self.extents, self.tile_extents
        kept_tile = [d for d in (x, y) if d in kept]
        reduced_tile = [d for d in (x, y) if d not in kept]
        n_kept, n_reduced = (math.prod(tile[d] for d in dims) for dims in (kept_tile, reduced_tile))

        def coordinates(var: str, dims: list[str]) -> dict[str, str]:  # x fastest
            return {x: f"{var} % {self.tx}", y: f"{var} / {self.tx}"} if len(dims) == 2 else dict.fromkeys(dims, var)

        c = coordinates("kk", kept_tile) | coordinates("r", reduced_tile)
        # Lanes of a team read consecutive x when x is summed; a column sum (x kept) is one thread's.
        lanes = min(32, 1 << (n_reduced - 1).bit_length()) if x in reduced_tile and n_reduced > 1 else 1
        teams = self.threads // lanes
        st = strides(kept, ext)
        kept_at = _linear([(f"{d}0 + {c[d]}" if d in self.tile else d, st[d]) for d in kept])
        blocks = []  # (block index, count) along each summed dim
        for d in self.spec.space:
            if d not in kept:
                if d in self.tile:
                    blocks.append((f"{d}0 / {tile[d]}", ext[d] // tile[d]))
                elif d == self.loop:
                    blocks.append((f"{d}0 / {self.steps}", ext[d] // self.steps))
                else:
                    blocks.append((d, ext[d]))
        rblock = blocks[0][0]
        for index, count in blocks[1:]:
            rblock = f"({rblock}) * {count} + {index}"
        return dict(name=gradient, lanes=lanes, teams=teams, per_team=-(-n_kept // teams), n_kept=n_kept,
                    n_reduced=n_reduced, addr=f"({c[y]}) * {self.tx} + {c[x]}", kept_at=kept_at, rblock=rblock,
                    NK=math.prod(ext[d] for d in kept), NR=math.prod(n for _, n in blocks),
                    accumulate=self.steps > 1 and self.loop not in kept)

    def workspace_shape(self) -> tuple[int, int] | None:
        """The float32 partial sums of the bias gradient: [blocks along b and j, gradient elements]; None without
        a bias gradient."""
        red = self.reduction()
        return None if red is None else (red["NR"], red["NK"])

    # -- feasibility --------------------------------------------------------------------------------

    def check(self, spec: DeviceSpec = H100) -> None:
        if self.op not in self.ops:
            raise InfeasibleVariantError(f"{type(self).__name__} implements {list(self.ops)}, not op={self.op!r}")
        super().check(spec)
        graph, ext, space = layer_graph(), self.extents, self.spec.space
        for name, layout in self.layouts:
            if sorted(layout) != sorted(graph.tensors[name].dims):
                raise InfeasibleVariantError(f"{self.op}: layout {layout!r} of {name} is not an order of its dims "
                                      f"{graph.tensors[name].dims!r}")
        for field in self.size_fields():
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise InfeasibleVariantError(f"{self.op}: {field}={getattr(self, field)!r} must be a positive integer")
        tiled = [d for d in space if d != "t"]
        if len(self.tile) != 2 or self.tile[0] == self.tile[1] or not set(self.tile) <= set(tiled):
            raise InfeasibleVariantError(f"{self.op}: tile={self.tile!r} must be two distinct dims of {tiled}")
        for d, n, field in ((self.tile[0], self.tx, "tx"), (self.tile[1], self.ty, "ty")):
            if n < 1 or ext[d] % n:
                raise InfeasibleVariantError(f"{self.op}: {field}={n} must divide the extent {ext[d]} of tile dim {d!r}")
        if (self.loop == "") != (self.steps == 1):
            raise InfeasibleVariantError(f"{self.op}: loop={self.loop!r} must be '' exactly when steps == 1 "
                                  f"(steps={self.steps})")
        if self.loop and (self.loop not in space or self.loop in self.tile or self.steps < 1
                          or ext[self.loop] % self.steps):
            raise InfeasibleVariantError(f"{self.op}: loop={self.loop!r} must be a dim of {space!r} outside the tile "
                                  f"whose extent steps={self.steps} divides")
        self._check_knobs(spec)

    def _check_knobs(self, spec: DeviceSpec) -> None:
        self.check_vector()
        if self.tx % self.vec:
            raise InfeasibleVariantError(f"{self.op}: vec={self.vec} must divide tx={self.tx}, the tile's extent along "
                                  f"x ({self.tile[0]!r}), which the compute phase sweeps in vectors")
        for body in self.bodies():
            for t in body["tensors"]:
                if t["sweep"] == "y" and self.ty % t["vec"]:
                    raise InfeasibleVariantError(f"{self.op}: vec={self.vec} must divide ty={self.ty}, the swept extent "
                                          f"of {t['name']} (innermost {self.tile[1]!r})")
        self.check_threads()
        self.check_shared_memory(spec)
        red = self.reduction()
        if red is not None and red["per_team"] > MAX_ACCUMULATORS:
            raise InfeasibleVariantError(f"{self.op}: a thread would sum {red['per_team']} gradient elements per tile, more "
                                  f"than the register budget of {MAX_ACCUMULATORS} (smaller tile or more threads)")

    # -- rendering and launching --------------------------------------------------------------------

    def render_context(self) -> dict[str, object]:
        operator, spec, layouts = layer_graph().operator(self.op), self.spec, self.space_layouts
        gradient = spec.reduce[1] if spec.reduce else None
        args = [f"const elem_t* __restrict__ {n}" for n in operator.inputs]
        args += [f"elem_t* __restrict__ {n}" for n in operator.outputs if n != gradient]
        args += ["float* __restrict__ ws"] if gradient else []
        split = None
        if spec.split:
            const = "const " if spec.split[0] in operator.inputs else ""
            split = dict(alias=spec.alias, decl=f"{const}elem_t* const {spec.alias}",
                         pick=f"t == 0 ? {spec.split[0]} : (t == 1 ? {spec.split[1]} : {spec.split[2]})")
        bias = self.bias and dict(name=self.bias, **self._offsets(layouts[self.bias]),
                                  vector=self.vec > 1 and layouts[self.bias][-1] == self.tile[0])
        params = [cname for cname, _, output in self._groups() if not output]
        params = [n for n in [*params, self.bias] if n is not None]
        params.sort(key=lambda n: operator.inputs.index(spec.split[0] if n == spec.alias else n))
        return dict(ARGS=args, TX=self.tx, TY=self.ty, VEC=self.vec, THREADS=self.threads, STEPS=self.steps,
                    LOOP=self.loop, GRID=list(reversed(self.grid_dims())), SPLIT=split, BODIES=self.bodies(),
                    BIAS=bias, PARAMS=params, VALUE=spec.value, REDUCE=self.reduction(),
                    SHARED=self.shared_bytes > 0, SUM_THREADS=SUM_THREADS, SUM_COLUMNS=SUM_COLUMNS)

    @property
    def sum_name(self) -> str:
        """The second kernel (same cubin) of an operator with a bias gradient: adds the blocks' partials."""
        return f"{self.name}_sum"

    def tensor_shape(self, layout: str) -> tuple[int, ...]:
        return tuple(self.extents[_space(d)] for d in layout)

    def check_alignment(self, tensors: dict) -> None:
        for name, _ in self.layouts:
            self.check_aligned(name, tensors[name], self.vec)

    def _bind(self, cubin: Cubin, device: int) -> BoundKernel:
        """The main kernel takes every tensor; with a bias gradient (the last output), the workspace in its place,
        and `<name>_sum` adds the workspace into the gradient."""
        names = self.tensor_names
        main = self.packed(cubin, device, self.name, self.grid, self.threads, self.shared_bytes,
                           ("pointer",) * len(names))
        shape = self.workspace_shape()
        if shape is None:
            return BoundKernel(names, main, self.scalars)
        total = self.packed(cubin, device, self.sum_name, -(-shape[1] // SUM_COLUMNS), SUM_THREADS, 0,
                            ("pointer",) * 2, dependent=True)
        return BoundKernel(names, main, self.scalars, Reduction(total, 1, shape, torch.device("cuda", device)))


@dataclass(frozen=True)
class QkvBiasParams(ElementwiseParams):
    B: int = 1
    L: int = 1
    H: int = 1
    P: int = 1

    ops: ClassVar[tuple[str, ...]] = ("qkv_bias", "qkv_bias_bwd")

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "j": self.L, "t": 3, "h": self.H, "p": self.P}


@dataclass(frozen=True)
class BiasGeluParams(ElementwiseParams):
    B: int = 1
    L: int = 1
    U: int = 1

    ops: ClassVar[tuple[str, ...]] = ("bias_gelu", "bias_gelu_bwd")

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "j": self.L, "u": self.U}


@dataclass(frozen=True)
class ResidualParams(ElementwiseParams):
    B: int = 1
    L: int = 1
    I: int = 1

    ops: ClassVar[tuple[str, ...]] = ("residual_bwd",)

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "j": self.L, "i": self.I}


PARAMS: dict[str, type[ElementwiseParams]] = {op: cls for cls in (QkvBiasParams, BiasGeluParams, ResidualParams)
                                              for op in cls.ops}


def make_params(op: str, size: Size, dtype: str, layouts: dict[str, str], **knobs: object) -> ElementwiseParams:
    """The parameter point of `op` at `size` (its size fields taken from it) with these knobs."""
    if op not in PARAMS:
        raise GraphError(f"no elementwise kernel implements {op!r}; known: {list(PARAMS)}")
    return PARAMS[op].at_size(op, size, dtype, layouts, **knobs)  # type: ignore[return-value]


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _tiles(op: str, layouts: dict[str, str]) -> list[tuple[str, str]]:
    """Tile dims worth timing: x the big output's innermost dim (t aside), y each other innermost dim of a
    big tensor; where all agree, y is the output's next dim (for an operator with a bias gradient, its
    innermost b or j, so that blocks sum over it)."""
    spec, graph_op = SPECS[op], layer_graph().operator(op)
    big = [_space(layouts[n]).replace("t", "") for n in graph_op.inputs + graph_op.outputs
           if n in spec.split or sorted(_space(layer_graph().tensors[n].dims)) == sorted(spec.space)]
    x = big[-1][-1]
    ys = [lay[-1] for lay in big if lay[-1] != x]
    if not ys:
        ys = [next(d for d in reversed(big[-1]) if d != x and (d in "bj" or not spec.reduce))]
    return [(x, y) for y in dict.fromkeys(ys)]


def variants(op: str, size: Size, dtype: str, layouts: dict[str, str], spec: DeviceSpec = H100
             ) -> list[ElementwiseParams]:
    """The knob settings the profiler tries for one layout combination, per tile of `_tiles`: 64 x 64 where
    x and y are different tensors' innermost dims, else a wide tile of up to 4096 elements (x up to 1024,
    or 256 where a bias gradient is summed); an operator with a bias gradient walks b or j until a block
    sums ~128 of their elements (up to MAX_STEPS steps), so that the partial sums stay few; another
    walks t in steps of 3 where a tensor has it innermost (its neighbours then come from L1); the widest
    vector feasible on `spec`."""
    ext = make_params(op, size, dtype, layouts).extents
    spaced = [_space(lay) for lay in layouts.values()]
    reduce = SPECS[op].reduce is not None
    found = []
    for x, y in _tiles(op, layouts):
        if any(lay[-1] == y for lay in spaced):
            tx, ty = _largest_divisor(ext[x], 64), _largest_divisor(ext[y], 64)
        else:
            tx = _largest_divisor(ext[x], 256 if reduce else 1024)
            ty = _largest_divisor(ext[y], max(1, 4096 // tx))
        loop: dict[str, object] = {}
        if reduce and {x, y} != {"b", "j"}:
            summed = math.prod(n for d, n in ((x, tx), (y, ty)) if d in "bj")
            walk = next(d for d in "bj" if d not in (x, y))
            steps = _largest_divisor(ext[walk], min(MAX_STEPS, max(1, 128 // summed)))
            loop = {"loop": walk, "steps": steps} if steps > 1 else {}
        elif not reduce and any(lay[-1] == "t" for lay in spaced):
            loop = {"loop": "t", "steps": 3}
        found.append(widest_vector(lambda vec: make_params(op, size, dtype, layouts, tile=x + y, tx=tx, ty=ty,
                                                           vec=vec, **loop), spec))
    return [p for p in found if p is not None]
