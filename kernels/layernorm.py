"""ln1 / ln2 (bias + dropout + residual + LayerNorm over i) and ln1_bwd / ln2_bwd, for any layouts.

Rows are the (b, j) pairs; i is reduced. A block owns `rows` consecutive rows (along `tile`, b or j) and
the whole i extent: it moves them through shared memory in each tensor's own layout order (coalesced
wherever a tensor's innermost dim is i or `tile`), and the dropout mask is regenerated from Philox (see
substation/dropout.py), with the forward's logical element index n = (b·L + j)·I + i, so the backward
needs no stored mask. Everything is computed in float32 and rounded once into the graph's dtype.

    forward:  x: bji, bias: i, res: bji, gamma: i, beta: i -> Y, N: bji, Rs: bj   (any layouts)
              r = dropout(x + bias) + res; mean = Σ_i r / I; Rs = rsqrt(Σ_i (r − mean)² / I + eps)
              N = (r − mean)·Rs; Y = N·gamma + beta
    backward: dout (= dX1f + dR2 for ln1_bwd), N, Rs, gamma -> dR, dB: bji; dgamma, dbeta, dbias: i
              dn = dout·gamma; dR = Rs·(dn − mean_i(dn) − N·mean_i(dn·N)); dB = dropout(dR)
              dgamma = Σ_bj dout·N, dbeta = Σ_bj dout, dbias = Σ_bj dB

A forward warp owns a row and keeps its float32 values of r in registers (the two-pass variance reads them
twice). Rs is stored in the graph's dtype, as the reference's Rs tensor is (one
dtype for the whole graph); the backward reads it back from there.

The backward's column sums are deterministic (no float atomics): per row tile, a first pass has one warp
per row compute the row's two means; a second pass has one thread per column i write the outputs and add
the tile's rows to its float32 column sums in a fixed order. A block handles `row_tiles` tiles (strided
by the grid) before it writes its partial sums to a workspace [grid, 3, I]; a second kernel
(`<name>_colsum`, in the same cubin) adds the partials of all blocks in a fixed order, in double, and
rounds them into the output dtype. Both run on PyTorch's current stream, so a CUDA graph can capture
them (the workspace then comes from the graph's memory pool). With the knob `colsum="grid"` (a grid of at most
one block per SM) the kernel is a cooperative launch that adds the partials itself, in the same order, behind a
grid-wide barrier: one kernel per operator instead of two.

Staging (the knob `staging`): "shared" moves every row tile through shared memory as above, for any layouts.
"registers" serves layouts where every row-tiled tensor has i innermost (each row then lies contiguous in
every tensor, whatever the order of b and j): a *team* of `team` warps shares each row (thread t of the team
owns i = vec·(32·team·g + t) + e) and loads `inflight` rows at once, straight from global memory into
registers in 16-byte vectors, all loads issued before any is used; it writes its outputs straight back.
Bias, gamma and beta are read as vectors through the read-only cache (the same columns for every row of a
thread). A team of several warps adds its row sums across warps through shared memory behind a barrier of its
own (a named barrier), in warp order. The backward is one pass per row: each thread adds its columns' terms to
float32 column sums, in registers where they fit (3·vec·groups <= MAX_SUM_REGISTERS: a team wide enough that
a thread owns few columns), else in its team's sums [3][I] in shared memory; at the end the block adds its
teams' sums in team order (deterministic) into its partial sums. Wide teams cost a barrier per batch of rows
but leave few registers per thread (more warps per SM, finer waves) and keep the column sums out of shared
memory; `inflight` rows per batch keep more bytes in flight per thread. With `stages` > 1 a block's batches flow
through a cp.async pipeline: each thread copies its own 16-byte vectors of the batch `stages` − 1 ahead into shared
memory while it computes the current one, and reads them back once its copies have landed (cp.async.wait_group:
its own copies, so no barrier), so the loads of the next rows overlap the arithmetic, the team's barriers and the
stores of this one. Shared staging costs two shared-memory
round trips per element (2-byte accesses) and, in the backward, a second pass over the tile.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch

from substation.device import H100, DeviceSpec
from substation.graph import DROPOUT_SITES, layer_graph
from substation.jit import Cubin
from substation.kernels.base import (DROPOUT_SIGNATURE, ITEMSIZE, BoundKernel, InfeasibleVariantError, KernelParams,
                                     Reduction, RowTile, dropout_arguments, feasible, strides, widest_vector)
from substation.reference import OpArgs
from substation.sizes import Size

OPS = ("ln1", "ln2", "ln2_bwd", "ln1_bwd")
FREE = "bj"  # the row dims; i is reduced
# Each operator's tensors, inputs then outputs, by their role in the template.
ROLES = {
    "ln1": ("x", "bias", "res", "gamma", "beta", "out", "norm", "rs"),
    "ln2": ("x", "bias", "res", "gamma", "beta", "out", "norm", "rs"),
    "ln2_bwd": ("dout", "norm", "rs", "gamma", "dr", "dbiased", "dgamma", "dbeta", "dbias"),
    "ln1_bwd": ("dout", "dres", "norm", "rs", "gamma", "dr", "dbiased", "dgamma", "dbeta", "dbias"),
}
# Which shared-memory tile each row-tiled tensor uses: an output overwrites an input its thread has read.
SLOTS = {"x": 0, "res": 1, "norm": 0, "out": 1}
SLOTS_BWD = {"ln2_bwd": {"dout": 0, "norm": 1, "dr": 0, "dbiased": 1},
             "ln1_bwd": {"dout": 0, "dres": 1, "norm": 2, "dr": 0, "dbiased": 1}}
MAX_ROW_VALUES = 128  # float32 values of its rows a forward lane keeps in registers: I <= 4096 (one row, one warp)
MAX_SUM_REGISTERS = 48  # float32 column sums a register-staged backward thread keeps in registers, else shared memory
MAX_TEAMS = 15  # named barriers 1..15 (0 is __syncthreads): one per team of several warps
MAX_COLUMN_SUMS = 96  # float32 column sums a backward thread keeps in registers: 3·⌈I/threads⌉ (shared staging)
STAGINGS = ("shared", "registers")  # how rows reach a warp's registers: through shared memory, or straight
COLSUMS = ("kernel", "grid")  # the backward's column sums of the partials: a second kernel, or the kernel itself
COLSUM_THREADS = 256  # the partial-sum kernel: 8 warps share 32 columns
COLUMN_SUMS = ("dgamma", "dbeta", "dbias")  # the backward's outputs summed over rows, its last three
BLOCKS_PER_SM = 2  # the backward variant with several row tiles per block aims at this many blocks per SM


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class LayerNormParams(RowTile, KernelParams):
    B: int = 1
    L: int = 1
    I: int = 1
    tile: str = "j"
    rows: int = 8
    vec: int = 1
    threads: int = 256
    row_tiles: int = 1  # row tiles a block handles (strided by the grid): fewer blocks, fewer partial sums
    staging: str = "shared"  # STAGINGS
    team: int = 1  # register staging: warps sharing a row
    inflight: int = 1  # register staging: rows a team loads at once
    stages: int = 1  # register staging: batches of rows in flight through a cp.async pipeline (1: none)
    colsum: str = "kernel"  # backward: COLSUMS

    template = "layernorm.cu.j2"
    reduced = "i"

    def size_fields(self) -> tuple[str, ...]:
        return ("B", "L", "I")

    @functools.cached_property
    def backward(self) -> bool:
        return self.op.endswith("_bwd")

    @property
    def registers(self) -> bool:
        return self.staging == "registers"

    def options(self) -> dict[str, object]:
        """The knobs; `staging`, `team`, `inflight`, `stages` and `colsum` only where they are not "shared", 1 and
        "kernel", so that the labels and profile keys of the variants profiled before these knobs existed stay what
        they were."""
        knobs = super().options()
        if not self.registers:
            del knobs["staging"]
        if self.colsum == "kernel":
            del knobs["colsum"]
        for knob in ("team", "inflight", "stages"):
            if knobs[knob] == 1:
                del knobs[knob]
        return knobs

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "j": self.L, "i": self.I}

    @functools.cached_property
    def roles(self) -> dict[str, str]:
        """Template role -> tensor name (e.g. 'x' -> 'O' for ln1)."""
        return dict(zip(ROLES[self.op], (name for name, _ in self.layouts)))

    @property
    def slots(self) -> dict[str, int]:
        return SLOTS_BWD[self.op] if self.backward else SLOTS

    @property
    def tiled_tensors(self) -> list[tuple[str, str, bool, int, str]]:
        """(name, layout, is_output, shared tile, role) of the bji tensors, the row-tiled ones."""
        roles, layouts = self.roles, dict(self.layouts)
        outputs = set(layer_graph().operator(self.op).outputs)
        return [(roles[role], layouts[roles[role]], roles[role] in outputs, slot, role)
                for role, slot in self.slots.items()]

    @property
    def lane_width(self) -> int:
        """A lane owns i = w·(32·team·g + t) + e (e < w) for g < groups: 4 through shared memory (half a Philox call of
        8 elements, shared with the neighbouring lane), the vector width (whole vectors of every tiled tensor) in
        registers."""
        return self.vec if self.registers else 4

    @property
    def groups(self) -> int:
        return -(-self.I // (32 * self.team * self.lane_width))

    @property
    def teams(self) -> int:
        return self.threads // 32 // self.team

    @property
    def sums_in_registers(self) -> bool:
        """Register-staged backward: a thread's 3·vec·groups column sums fit its registers."""
        return 3 * self.lane_width * self.groups <= MAX_SUM_REGISTERS

    @property
    def parameter_roles(self) -> tuple[str, ...]:
        """The i-vectors a register-staged thread reads as vectors."""
        return ("gamma",) if self.backward else ("bias", "gamma", "beta")

    @property
    def input_roles(self) -> tuple[str, ...]:
        """The roles of the row-tiled inputs, which a register-staged thread loads (the template's ROLES_IN), in the
        order of their slots in a pipeline stage."""
        return tuple(role for _, _, is_output, _, role in self.tiled_tensors if not is_output)

    @property
    def batches(self) -> int:
        """Register staging: the batches of `inflight` rows a team handles per row tile."""
        return -(-self.rows // (self.teams * self.inflight))

    @property
    def tiles_bytes(self) -> int:
        return len(set(self.slots.values())) * self.rows * self.pitch * ITEMSIZE[self.dtype]

    @property
    def exchanged(self) -> int:
        """Register staging: the row sums a team adds across its warps at once (per row: the forward's mean or
        variance, the backward's two means)."""
        return self.inflight * (2 if self.backward else 1)

    @property
    def exchange_offset(self) -> int:
        """Register staging: the backward's teams' column sums [teams][3][I] (float32), then the teams' exchange
        slots for row sums across warps (two of `exchanged`·team floats each)."""
        return _align16(self.teams * 3 * self.I * 4) if self.backward else 0

    @property
    def stats_offset(self) -> int:
        """Backward: per row (Rs, mean_i dn, mean_i dn·N) as float32, after the tiles."""
        return _align16(self.tiles_bytes)

    @property
    def keep_offset(self) -> int:
        """Backward: per row, one byte per lane group of 4 elements holding their 4 keep bits (32·groups bytes),
        after the stats."""
        return self.stats_offset + _align16(3 * self.rows * 4)

    @property
    def stage_offset(self) -> int:
        """Register staging with a pipeline: its stages after the exchange slots, per thread `stages` ×
        `inflight` × inputs × groups vectors of 16 bytes."""
        exchange = self.teams * 2 * self.exchanged * self.team * 4 if self.team > 1 else 0
        return _align16(self.exchange_offset + exchange)

    @property
    def grid_colsum(self) -> bool:
        return self.colsum == "grid"

    @functools.cached_property
    def shared_bytes(self) -> int:
        """The staging's; with `colsum="grid"` at least the warps' double sums of 32 columns, which reuse it."""
        if self.registers:
            staged = len(self.input_roles) * self.groups * self.threads * 16 if self.stages > 1 else 0
            staging = self.stage_offset + self.stages * self.inflight * staged
        elif not self.backward:
            staging = self.tiles_bytes
        else:
            staging = self.keep_offset + self.rows * 32 * self.groups
        return max(staging, self.threads * 8) if self.grid_colsum else staging

    def check(self, spec: DeviceSpec = H100) -> None:
        super().check(spec)
        graph = layer_graph()
        for name, layout in self.layouts:
            if sorted(layout) != sorted(graph.tensors[name].dims):
                raise InfeasibleVariantError(f"{self.op}: layout {layout!r} of {name} is not an order of its dims "
                                      f"{graph.tensors[name].dims!r}")
        for d, n in (("B", self.B), ("L", self.L), ("I", self.I)):
            if not isinstance(n, int) or n < 1:
                raise InfeasibleVariantError(f"{self.op}: {d}={n!r} must be a positive integer")
        self.check_row_tile(FREE)
        self.check_threads()
        if self.staging not in STAGINGS:
            raise InfeasibleVariantError(f"{self.op}: staging={self.staging!r} must be one of {list(STAGINGS)}")
        if self.registers:
            self.check_register_staging()
        elif (self.team, self.inflight, self.stages) != (1, 1, 1):
            raise InfeasibleVariantError(f"{self.op}: team={self.team}, inflight={self.inflight}, stages={self.stages} "
                                  f"need staging='registers' (shared staging has one warp per row, one row at a time)")
        if self.colsum not in COLSUMS:
            raise InfeasibleVariantError(f"{self.op}: colsum={self.colsum!r} must be one of {list(COLSUMS)}")
        if self.grid_colsum and not self.backward:
            raise InfeasibleVariantError(f"{self.op}: colsum='grid' is for a backward's column sums; the forward has "
                                         f"none")
        if self.grid_colsum and self.grid > spec.sm_count:
            raise InfeasibleVariantError(f"{self.op}: colsum='grid' is a cooperative launch, every block resident at "
                                         f"once: its {self.grid} blocks must be at most one per SM ({spec.sm_count} "
                                         f"on {spec.name}); take more row_tiles")
        if not 1 <= self.row_tiles <= self.ntiles:
            raise InfeasibleVariantError(f"{self.op}: row_tiles={self.row_tiles} must lie in [1, {self.ntiles}], the number "
                                  f"of row tiles of {self.rows} rows")
        values = self.lane_width * self.groups * self.inflight  # the shared staging's backward keeps none
        if (self.registers or not self.backward) and values > MAX_ROW_VALUES:
            raise InfeasibleVariantError(f"{self.op}: I={self.I} needs {values} float32 values of its rows per lane "
                                  f"in registers (team={self.team}, inflight={self.inflight}), more than the register "
                                  f"budget of {MAX_ROW_VALUES} (I <= {32 * MAX_ROW_VALUES} with one warp and one row)")
        sums = 3 * -(-self.I // self.threads)
        if self.backward and not self.registers and sums > MAX_COLUMN_SUMS:
            raise InfeasibleVariantError(f"{self.op}: threads={self.threads} leaves {sums} float32 column sums "
                                  f"(3·⌈I/threads⌉) per thread in registers, more than the register budget of "
                                  f"{MAX_COLUMN_SUMS}")
        self.check_shared_memory(spec)

    def check_register_staging(self) -> None:
        """A warp reads and writes whole rows as vectors: i innermost in every row-tiled tensor, and vec 4 or 8, so
        that a lane's vector is half a Philox call of 8 elements (shared with the neighbouring lane) or a whole one."""
        for name, layout, *_ in self.tiled_tensors:
            if layout[-1] != "i":
                raise InfeasibleVariantError(f"{self.op}: staging='registers' needs i innermost in every row-tiled "
                                      f"tensor, but {name} is {layout!r}")
        if self.vec % 4:
            raise InfeasibleVariantError(f"{self.op}: staging='registers' needs vec=4 or 8 (half or all of a Philox "
                                  f"call of 8 elements per vector), not vec={self.vec}")
        if self.team < 1 or (self.threads // 32) % self.team:
            raise InfeasibleVariantError(f"{self.op}: team={self.team} must divide the block's {self.threads // 32} "
                                  f"warps")
        if self.team > 1 and self.teams > MAX_TEAMS:
            raise InfeasibleVariantError(f"{self.op}: {self.teams} teams of {self.team} warps exceed the {MAX_TEAMS} "
                                  f"named barriers a block has")
        if not 1 <= self.inflight <= self.rows:
            raise InfeasibleVariantError(f"{self.op}: inflight={self.inflight} must lie in [1, rows={self.rows}]")
        if not isinstance(self.stages, int) or self.stages < 1:
            raise InfeasibleVariantError(f"{self.op}: stages={self.stages!r} must be a positive integer")
        if self.stages > 1 and self.vec * ITEMSIZE[self.dtype] != 16:
            raise InfeasibleVariantError(f"{self.op}: stages={self.stages} copies rows in 16-byte pieces "
                                  f"(cp.async.cg), so it needs vec={16 // ITEMSIZE[self.dtype]} in {self.dtype}, "
                                  f"not vec={self.vec}")

    def render_context(self) -> dict[str, object]:
        ext = self.extents
        other = next(d for d in FREE if d != self.tile)
        tensors = []
        for name, layout, is_output, slot, role in self.tiled_tensors:
            st = strides(layout, ext)
            base = f"(long long){other} * {st[other]} + (long long){self.tile}0 * {st[self.tile]}"
            tensors.append(dict(name=name, role=role, base=base, stride_tile=st[self.tile], stride_red=st["i"],
                                sweep=self.sweep(layout), vec=self.vec_of(layout), output=is_output, slot=slot))
        roles = self.roles
        rs = strides(dict(self.layouts)[roles["rs"]], ext)
        site = DROPOUT_SITES[layer_graph().operator(self.op).dropout_site]
        return dict(BACKWARD=self.backward, REGISTERS=self.registers, W=self.lane_width, GROUPS=self.groups,
                    TEAM=self.team, INFLIGHT=self.inflight, REG_SUMS=self.sums_in_registers, STAGES=self.stages,
                    BATCHES=self.batches, STAGE_OFFSET=self.stage_offset, ROLES_IN=list(self.input_roles),
                    EXCHANGE_OFFSET=self.exchange_offset, EXCHANGED=self.exchanged, OP=self.op, T=roles,
                    TENSORS=tensors, ROWS=self.rows, RED=self.I,
                    SEQ=self.L, PITCH=self.pitch, THREADS=self.threads, TILE=self.tile,
                    CHUNKS=ext[self.tile] // self.rows, OTHERS=[(other, ext[other])], SITE=site,
                    RS_STRIDE_B=rs["b"], RS_STRIDE_J=rs["j"], STATS_OFFSET=self.stats_offset,
                    KEEP_OFFSET=self.keep_offset, KEEP_PITCH=32 * self.groups, GRID=self.grid, NTILES=self.ntiles,
                    COLSUM_THREADS=COLSUM_THREADS, GRID_COLSUM=self.grid_colsum, COLSUM_BLOCKS=self.colsum_grid)

    @property
    def ntiles(self) -> int:
        return self.B * self.L // self.rows

    @functools.cached_property
    def grid(self) -> int:
        return -(-self.ntiles // self.row_tiles)

    @property
    def colsum_name(self) -> str:
        """The backward's second kernel (same cubin): adds the blocks' partial column sums."""
        return f"{self.name}_colsum"

    @property
    def colsum_grid(self) -> int:
        return (3 * self.I + 31) // 32

    def workspace_shape(self) -> tuple[int, int, int] | None:
        """The backward's float32 partial column sums: per block, dgamma, dbeta, dbias (the forward has none)."""
        return (self.grid, 3, self.I) if self.backward else None

    def check_alignment(self, tensors: dict) -> None:
        for name, layout, *_ in self.tiled_tensors:
            self.check_aligned(name, tensors[name], self.vec_of(layout))
        if self.registers:
            for role in self.parameter_roles:
                self.check_aligned(self.roles[role], tensors[self.roles[role]], self.vec)

    def scalars(self, args: OpArgs) -> tuple[float | int, ...]:
        """The forward's eps, then the hidden dropout (args.hidden_dropout, args.rng)."""
        dropout = dropout_arguments(args, args.hidden_dropout)
        return dropout if self.backward else (args.layer_norm_eps, *dropout)

    def _bind(self, cubin: Cubin, device: int) -> BoundKernel:
        """The forward is one kernel. The backward's main kernel takes every tensor but the column sums, then
        the workspace; `<name>_colsum` adds the workspace into the column sums, or, with `colsum="grid"`, the main
        kernel (a cooperative launch) takes the column sums after the workspace and adds it up itself."""
        names = self.tensor_names
        if self.backward:  # every tensor but the column sums, the workspace (then the column sums: grid)
            pointers = len(names) - len(COLUMN_SUMS) + 1 + (len(COLUMN_SUMS) if self.grid_colsum else 0)
            signature = ("pointer",) * pointers + DROPOUT_SIGNATURE
        else:  # every tensor, then eps
            signature = ("pointer",) * len(names) + ("float32",) + DROPOUT_SIGNATURE
        main = self.packed(cubin, device, self.name, self.grid, self.threads, self.shared_bytes, signature,
                           cooperative=self.grid_colsum)
        if not self.backward:
            return BoundKernel(names, main, self.scalars)
        colsum = None if self.grid_colsum else self.packed(cubin, device, self.colsum_name, self.colsum_grid,
                                                           COLSUM_THREADS, 0, ("pointer",) * (1 + len(COLUMN_SUMS)),
                                                           dependent=True)
        return BoundKernel(names, main, self.scalars, Reduction(colsum, len(COLUMN_SUMS), self.workspace_shape(),
                                                                torch.device("cuda", device)))


PARAMS = {op: LayerNormParams for op in OPS}


def variants(op: str, size: Size, dtype: str, layouts: dict[str, str], spec: DeviceSpec = H100
             ) -> list[LayerNormParams]:
    """The knob settings the profiler tries for one layout combination: a tile dim that is some tensor's
    innermost dim (else j); 4 or 8 rows with 256 threads, or 2, 4 or 8 rows with one warp per row (more,
    smaller blocks); the widest vector feasible on `spec`; the backward also with 8 rows and enough row tiles
    per block for about BLOCKS_PER_SM blocks per SM of `spec` (fewer partial sums to write and add); where
    every row-tiled tensor has i innermost, register staging (`register_knobs`); and one row per warp-sized
    block, which fits any extent. A backward variant of at most one block per SM also comes with colsum="grid"
    (one cooperative kernel instead of a main kernel and a column-sum kernel)."""
    tiles = sorted({lay[-1] for lay in layouts.values() if len(lay) == 3 and lay[-1] in FREE}) or ["j"]
    knobs = [Knobs(4, 1, 256), Knobs(8, 1, 256), Knobs(2, 1, 64), Knobs(4, 1, 128)]
    target_blocks = BLOCKS_PER_SM * spec.sm_count
    if op.endswith("_bwd") and size.B * size.L // 8 > target_blocks:
        knobs.append(Knobs(8, -(-size.B * size.L // 8 // target_blocks), 256))
    knobs += register_knobs(op, size, spec)
    # Last, one row per one-warp block: 1 divides every extent, so that odd batches and lengths (a configuration
    # run at a shape it was not tuned for) keep a kernel; the backward's blocks take several rows each, so that
    # their partial column sums stay few.
    knobs.append(Knobs(1, max(1, -(-size.B * size.L // target_blocks)) if op.endswith("_bwd") else 1, 32))
    found = []
    for tile, k in itertools.product(tiles, knobs):
        found.append(widest_vector(lambda vec: LayerNormParams(op=op, dtype=dtype, layouts=tuple(layouts.items()),
                                                               B=size.B, L=size.L, I=size.I, tile=tile, rows=k.rows,
                                                               vec=vec, row_tiles=k.row_tiles, threads=k.threads,
                                                               staging=k.staging, team=k.team, inflight=k.inflight,
                                                               stages=k.stages),
                                   spec))
    found = [p for p in found if p is not None]
    if op.endswith("_bwd"):  # before the one-warp variant, which stays last
        found[-1:-1] = feasible((replace(p, colsum="grid") for p in found if p.grid <= spec.sm_count), spec)
    return found


@dataclass(frozen=True)
class Knobs:
    """One variant's knobs besides the tile dim and the vector width."""

    rows: int
    row_tiles: int
    threads: int
    staging: str = "shared"
    team: int = 1
    inflight: int = 1
    stages: int = 1


def register_knobs(op: str, size: Size, spec: DeviceSpec) -> list[Knobs]:
    """Register staging's knobs. One warp per row (team 1): the forward with 4 or 8 rows a block, one tile each,
    or 8 rows and enough tiles for BLOCKS_PER_SM blocks per SM; the backward (its column sums in shared memory
    at I = 1024) with 16, 8 or 4 rows a block and enough tiles for 1, 2 or 4 blocks per SM. Wide teams: `full`
    warps a row (one 8-element vector of each tensor per thread: 4 at I = 1024), or half as many. Pruned by the
    H100 sweep of 2026-11-24 (layouts/h100-layernorm.txt's notes): the forward's full teams with 2 rows in
    flight, in blocks of one or two teams and one tile each, or of two teams and enough tiles for BLOCKS_PER_SM
    blocks per SM, and half teams with 2 rows in blocks of two teams (1 row in flight ran 10–25 % slower, 4 up to
    15 %); the backward (column sums in registers) in 512-thread blocks and enough tiles for one block per SM
    (two per SM ran 4–10 % slower: twice the partial sums), full teams with 1 or 2 rows in flight, half teams
    with 1 (2 spill). Pipelined (`stages` > 1, for blocks that handle several batches): the backward's full teams
    with 2 rows in flight and 2 or 3 stages (the sweep of 2026-11-24, ninth session: 6–12 % faster at B8/L512 and
    at B96/L128 ln2_bwd, even at ln1_bwd); 1 row with 2 stages in twice the row tiles, and the forward's persistent
    full team with 2 stages, ran 5–15 % slower than the unpipelined variants and were dropped."""
    rows = size.B * size.L

    def spread(rows_per_tile: int, blocks: int) -> int:
        return max(1, -(-rows // rows_per_tile // blocks))

    full = -(-size.I // 256)
    half = full // 2
    if op.endswith("_bwd"):
        found = [Knobs(16, spread(16, spec.sm_count), 512, "registers"),
                 Knobs(8, spread(8, 2 * spec.sm_count), 256, "registers"),
                 Knobs(4, spread(4, 4 * spec.sm_count), 128, "registers")]
        for team, inflight, stages in [(full, 1, 1), (full, 2, 1)] + ([(half, 1, 1)] if half else []) + [
                (full, 2, 2), (full, 2, 3)]:
            tile = max(1, 16 // team) * inflight  # the teams of a 512-thread block (at most 16 warps), a batch each
            found.append(Knobs(tile, spread(tile, spec.sm_count), 32 * team * max(1, 16 // team), "registers", team,
                               inflight, stages))
        return list(dict.fromkeys(found))
    found = [Knobs(4, 1, 128, "registers"), Knobs(8, 1, 256, "registers"),
             Knobs(8, spread(8, BLOCKS_PER_SM * spec.sm_count), 256, "registers"),
             Knobs(2, 1, 32 * full, "registers", full, 2), Knobs(4, 1, 64 * full, "registers", full, 2),
             Knobs(4, spread(4, BLOCKS_PER_SM * spec.sm_count), 64 * full, "registers", full, 2)]
    if half:
        found.append(Knobs(4, 1, 64 * half, "registers", half, 2))
    return list(dict.fromkeys(found))
