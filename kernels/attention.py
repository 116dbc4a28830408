"""Fused attention forward (attn_scores + softmax + attn_context in one kernel), FlashAttention-2 style, for any
layout of Q, K, V and Z.

    Q: bhjp, K: bhkp, V: bhkp, M: bk -> Z = dropout(softmax(scale·Q·Kᵀ, keys with M == 0 at -inf))·V: bjhp,
                                        LSE = logsumexp_k(scale·Q·Kᵀ masked): bhj (float32, for a backward)

A block owns `block_m` queries of one (b, h) (one warp per 16) and walks the keys in tiles of `block_n`: K and V
double-buffered in shared memory, S = Q·Kᵀ and Z += A·V on tensor cores (mma.sync m16n8k16, or on Hopper wgmma
m64nNk16 where `wgmma` says so; fp16 or bf16 operands, fp32 accumulation), the online softmax in registers; S, Pr and A are never stored. The dropout mask is
Substation's Philox stream (site `attention`, element indexing of the logical [B, H, J, K] tensor, the device code
of `common.cuh.j2`: one call per 8 elements, 16-bit halves), so it equals `substation.dropout.keep_mask` bit for
bit and a backward can regenerate it; `attention_keep.cuh.j2` looks it up a warp's 16x16 accumulator square at a
time, one Philox call per lane (per 8 keys of a row where L is a multiple of 8, else at most two).
Tensors with p innermost move in 16-byte accesses (cp.async loads), any other layout one element at a time.

The backward (`AttentionBackwardParams`, `attention_bwd.cu.j2`) covers the five backward operators at once:

    Q, K, V: bhjp/bhkp, M: bk, Z, dZ: bjhp, LSE: bhj -> dQ: bhjp, dK, dV: bhkp

in kernels that recompute P from LSE and regenerate the dropout mask: one per query tile for dQ (and
D = rowsum(dZ∘Z)), then one per key tile for dK and dV; or (`fuse_dq`) one per key tile for all three, after a
small pass for D where L takes several key tiles (where one covers L, the block works D out itself). Every variant
is deterministic (no float atomics) but `fuse_dq=4`, which `optimize` takes only with --nondeterministic.

**The implementation** (`FusedAttention`, impl `attention`, registered in `substation/implementations.py` after
the SDPA backends): a forward row `attn_scores/fwd attention{block_m,block_n} Q K V M -> Z` covering attn_scores,
softmax and attn_context, and a backward row `attn_context_dgrad_a/bwd attention{block_m,block_n,fuse_dq}
Q K V M Z dZ -> dQ dK dV` covering the five backward operators. Rows name graph tensors only: the LSE (fixed
layout bhj, float32) travels from the forward's step to the backward's as the plan's tensor `attention_kernel_lse`,
as SDPA's state does. The implementation is `coupled`: a backward row needs some forward row of this
implementation (its LSE); the knobs need not match, since the LSE and the dropout mask do not depend on tiles.

**Stacked** (deliverable: no stacking copy after our backward): a third row, `attn_context_dgrad_a/bwd
attention{...} Q K V M Z dZ -> dQKV dbqkv`, also covers qkv_bias_bwd. The backward writes dQ, dK, dV straight into
their slices dQKV[t] (the kernels take the slices' strides and the host offsets the pointer), and the bias gradient
dbqkv = Σ_bj dQKV too: every block writing rows of a slice also writes their column sums (of the values it
stores; where dQ leaves `_dkdv` from registers, K's column sums weighted by each key's Σ_j dS) as float32
partials, and a last small kernel (`_dbsum`) adds them in a fixed order. So the separate dQ, dK,
dV, the pass that stacks them and a pass reading dQKV again never exist. dQKV and dbqkv take any order of their
letters.

Candidates for given layouts: every tile variant (`variants`, `backward_variants`) of the kernels, which take any
order of every tensor's letters; Infeasible where none fits (a dtype without tensor cores, P not 64 or 128).
What the profiler times (`profiled_points`, bounded): Q, K, V sharing one of the six p-innermost orders (k read as
j; what qkv_bias writes in one pass, and where SDPA rows are timed too), Z in Q's layout or `bjhp` (where the SDPA
backends write it), M `bk`; the backward with those Q, K, V, M, Z, dZ in Z's layout and dQ, dK, dV in Q's, K's,
V's layouts: 11 layout combinations, every tile variant of each at its occupancy levels and, on Hopper at P = 64,
with its products on mma.sync and on wgmma (at B8/L512: 220 forward and 814 backward points, and 814 more stacked).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from substation.accuracy import relative_error
from substation.device import H100, DeviceSpec
from substation.graph import DROPOUT_SITES, LayerGraph, Operator, layer_graph
from substation.jit import Cubin
from substation.launch import PackedLaunch
from substation.kernels.base import (ARCH_SPECIFIC, DROPOUT_SIGNATURE, ITEMSIZE, SUM_TX, SUM_TY, BoundKernel,
                                     InfeasibleVariantError, KernelImplementation, KernelParams, ScaledDropoutLaunch,
                                     dropout_arguments, feasible, strides)
from substation.kernels.gpu_check import op_args, random_input
from substation.kernels.sdpa import EFFICIENT_Z, accepted_layouts
from substation.layouts import Configuration, logical, stored
from substation.protocol import AllocatingStep, Choice, Env, Infeasible, Step, StepContext, alert_nondeterministic
from substation.records import Candidate
from substation.reference import OpArgs, softmax
from substation.sizes import Size

IMPL = "attention"  # the impl profile rows and configurations name
ATOMIC_DQ = 4  # the backward's fuse_dq that adds dQ up by float atomics (the one not deterministic)
OP = "attn_scores"  # a fused row is named after the first operator it covers, as SDPA's rows are
COVERS = ("attn_scores", "softmax", "attn_context")
INPUTS, OUTPUTS = ("Q", "K", "V", "M"), ("Z", "LSE")
LSE_LAYOUT = "bhj"  # the logsumexp is the kernel's own tensor (no graph tensor), in one fixed layout
DTYPES = ("float16", "bfloat16")  # the mma.sync operand types
HEAD_SIZES = (64, 128)
ROW_LETTER = {"Q": "j", "K": "k", "V": "k", "Z": "j", "dZ": "j", "dQ": "j", "dK": "k", "dV": "k",
              "dQKV": "j"}  # tile rows' dim (a stacked dQKV's: every slice's)
FLOAT32 = ("LSE",)  # the kernels' own float32 tensors; the others have the kernel's dtype

BWD_OP = "attn_context_dgrad_a"  # named, as the forward, after the first operator it covers
BWD_COVERS = ("attn_context_dgrad_a", "attn_context_dgrad_v", "softmax_bwd", "attn_scores_dgrad_q",
              "attn_scores_dgrad_k")
BWD_INPUTS, BWD_OUTPUTS = ("Q", "K", "V", "M", "Z", "dZ", "LSE"), ("dQ", "dK", "dV")
STACKED_COVERS = BWD_COVERS + ("qkv_bias_bwd",)  # the backward writing dQ, dK, dV into dQKV, and dbqkv
STACKED_OUTPUTS = ("dQKV", "dbqkv")
SLICES = ("dQ", "dK", "dV")  # dQKV[t] for t = 0, 1, 2
MAX_WARPS = 16  # min_blocks' ceiling: 65536 registers / 64 a thread / 32 lanes
BASE_WARPS = 8  # the warps an SM holds of the uncapped kernels (their ~200-250 registers a thread)
BLOCK_RESERVED_SHARED = 1024  # bytes of shared memory the driver keeps for every resident block
BWD_REGISTERS = 160  # feasibility: per-thread accumulator floats P + block_n (see AttentionBackwardParams.check)


def tensor_dims(name: str) -> str:
    """The logical dims of one of the kernels' tensors."""
    return LSE_LAYOUT if name == "LSE" else layer_graph().tensors[name].dims


def tile_tensors(params: KernelParams, names: tuple[str, ...]) -> list[dict[str, object]]:
    """The template's description of the tiled tensors: strides of b, h, the tile rows' dim and p. Where the point
    writes a stacked dQKV, dQ, dK and dV are its slices dQKV[t]: its strides, its j the rows of each."""
    layouts, found = dict(params.layouts), []
    for name in names:
        source = "dQKV" if "dQKV" in layouts and name in SLICES else name
        layout, row = layouts[source], ROW_LETTER[source]
        st = strides(layout, params.extents)
        found.append(dict(name=name, stride_b=st["b"], stride_h=st["h"], stride_row=st[row], stride_p=st["p"],
                          vector=layout[-1] == "p", rows_inner=layout[-1] == row))
    return found


def check_layouts(params: KernelParams, op: str, names: tuple[str, ...]) -> None:
    """InfeasibleVariantError unless `params` gives layouts for exactly `names` (in order) of op `op`, each an
    order of its tensor's dims (LSE in its fixed layout)."""
    given = tuple(name for name, _ in params.layouts)
    if params.op != op or given != names:
        raise InfeasibleVariantError(f"{params.op}: layouts are given for {given}, expected op {op!r} with {names}")
    for name, layout in params.layouts:
        dims = tensor_dims(name)
        if sorted(layout) != sorted(dims) or (name == "LSE" and layout != LSE_LAYOUT):
            raise InfeasibleVariantError(f"{params.op}: {name}:{layout} must be "
                                         f"{LSE_LAYOUT if name == 'LSE' else 'an order of ' + repr(dims)}")


def check_attention_tensors(params: KernelParams, tensors: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming the first tensor that is missing, misshapen, of another dtype (LSE float32, the others
    the kernel's dtype), strided, misaligned (p innermost: 16 bytes) or not on the first tensor's GPU."""
    first = params.layouts[0][0]
    device = tensors[first].device if first in tensors else None
    for name, layout in params.layouts:
        if name not in tensors:
            raise ValueError(f"{params.op}: tensor {name!r} is missing; expected {list(params.tensor_names)}")
        t, shape = tensors[name], params.tensor_shape(layout)
        dtype = torch.float32 if name in FLOAT32 else getattr(torch, params.dtype)
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device or not t.is_cuda:
            raise ValueError(f"{params.op}: {name=}, {t.shape=}, {t.dtype=}, contiguous={t.is_contiguous()}, "
                             f"{t.device=}, expected a contiguous {dtype} CUDA tensor of shape {shape} (layout "
                             f"{layout!r}) on {first}'s device {device}")
        address = t.data_ptr()
        if name in ROW_LETTER and layout[-1] == "p" and address % 16:
            raise ValueError(f"{params.op}: {name=} starts at {address:#x}; with p innermost its 16-byte accesses "
                             f"need it aligned to 16 bytes")


WGMMA_HEAD_SIZE = 64  # wgmma's 128-byte swizzle takes the shared tiles as they are: rows of 64 16-bit elements
WGMMA_ARCH = "sm_90"  # the device architecture whose arch-specific target (ARCH_SPECIFIC) has wgmma


@dataclass(frozen=True)
class AttentionTiles(KernelParams):
    """What the forward and the backward kernels share: the sizes, and `block_m` rows per block (16 per warp)
    walking the other dim in tiles of `block_n`; `min_blocks` > 1 asks the compiler to fit that many blocks on an
    SM (`__launch_bounds__`: at most 65536 / (min_blocks·threads) registers a thread, spilling past them). The
    kernels are latency-bound at 8 warps an SM (ncu, B8/L512 backward: 246 registers, 12.5 % occupancy, a third of
    the issue slots busy), so more warps may pay for a few spills."""

    B: int = 1
    H: int = 1
    L: int = 1
    P: int = 64
    block_m: int = 64
    block_n: int = 64
    min_blocks: int = 1  # 1: the compiler's choice of registers
    wgmma: int = 0  # which products Hopper's warpgroup MMA takes from mma.sync (0: none; see the subclass)

    wgmma_levels = (0,)  # the `wgmma` values the kernel has

    def size_fields(self) -> tuple[str, ...]:
        return ("B", "H", "L", "P")

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "h": self.H, "j": self.L, "k": self.L, "p": self.P, "t": len(SLICES)}

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 32

    @property
    def keep_blocks(self) -> int:
        """The Philox blocks of the attention tensor, B·H·L·L / 8: under 2^32 the keep lookup's index is 32-bit
        (attention_keep.cuh.j2)."""
        return self.B * self.H * self.L * self.L // 8

    @property
    def stacked(self) -> bool:
        """Whether the point writes dQ, dK, dV as the slices of a stacked dQKV (the stacked backward row; never a
        forward point)."""
        return "dQKV" in dict(self.layouts)

    def check_tiles(self, op: str, names: tuple[str, ...], spec: DeviceSpec) -> None:
        """The rules both passes share: a tensor-core dtype, every tensor's letters, the head size, the tiles, and
        `wgmma` (on `spec`'s GPU)."""
        if self.dtype not in DTYPES:
            raise InfeasibleVariantError(f"{self.op}: dtype {self.dtype!r} has no tensor-core kernel; expected one of "
                                         f"{list(DTYPES)}")
        check_layouts(self, op, names)
        if self.P not in HEAD_SIZES:
            raise InfeasibleVariantError(f"{self.op}: head size P={self.P} must be one of {list(HEAD_SIZES)} (mma "
                                         f"k-steps of 32)")
        if self.block_m not in (64, 128):
            raise InfeasibleVariantError(f"{self.op}: block_m={self.block_m} must be 64 or 128 (16 rows per warp)")
        if self.block_n not in (32, 64):
            raise InfeasibleVariantError(f"{self.op}: block_n={self.block_n} must be 32 or 64 (A operands of 16, "
                                         f"the products' accumulators in registers)")
        self.check_wgmma(spec)

    def check_wgmma(self, spec: DeviceSpec) -> None:
        """wgmma: one of the kernel's levels; P = 64 and a Hopper GPU where it is on."""
        if self.wgmma not in self.wgmma_levels:
            levels = ", ".join(map(str, self.wgmma_levels[:-1])) + f" or {self.wgmma_levels[-1]}"
            raise InfeasibleVariantError(f"{self.op}: wgmma={self.wgmma} must be {levels}")
        if self.wgmma and self.P != WGMMA_HEAD_SIZE:
            raise InfeasibleVariantError(f"{self.op}: wgmma={self.wgmma} needs P={WGMMA_HEAD_SIZE} (its 128-byte "
                                         f"swizzled operands are the shared tiles' rows), not P={self.P}")
        if self.wgmma and spec.arch != WGMMA_ARCH:
            raise InfeasibleVariantError(f"{self.op}: wgmma={self.wgmma} is Hopper's ({ARCH_SPECIFIC[WGMMA_ARCH]}), "
                                         f"not {spec.name}'s ({spec.arch})")

    def options(self) -> dict[str, object]:
        """The knobs, `min_blocks` only where it asks for more than the compiler's choice and `wgmma` only where it
        is on (so rows profiled before they existed keep their labels)."""
        found = super().options()
        if self.min_blocks == 1:
            del found["min_blocks"]
        if not self.wgmma:
            del found["wgmma"]
        return found

    def compile_arch(self, spec: DeviceSpec) -> str:
        """wgmma is in sm_90a only, the arch-specific target of sm_90."""
        return ARCH_SPECIFIC[spec.arch] if self.wgmma else spec.arch

    def check_occupancy(self, spec: DeviceSpec) -> None:
        """`min_blocks` blocks must fit an SM: their warps (at most 16, i.e. at least 64 registers a thread of the
        SM's 65536) and their shared memory (the per-block opt-in limit plus the 1 KiB the driver reserves for
        each block is the SM's capacity on sm_80 and sm_90)."""
        warps = self.min_blocks * self.threads // 32
        if self.min_blocks < 1 or warps > MAX_WARPS:
            raise InfeasibleVariantError(f"{self.op}: min_blocks={self.min_blocks} must be >= 1 and put at most "
                                         f"{MAX_WARPS} warps on an SM (at least 64 registers a thread), not {warps}")
        needed = self.min_blocks * (self.shared_bytes + BLOCK_RESERVED_SHARED)
        if needed > spec.max_shared_bytes_per_block + BLOCK_RESERVED_SHARED:
            raise InfeasibleVariantError(f"{self.op}: min_blocks={self.min_blocks} blocks of {self.shared_bytes} "
                                         f"bytes of shared memory exceed an SM of {spec.name}")


@dataclass(frozen=True)
class AttentionParams(ScaledDropoutLaunch, AttentionTiles):
    """The fused attention forward: a block owns `block_m` queries and walks the keys in tiles of `block_n`.
    `wgmma` 1 computes S = Q·Kᵀ, 2 also Z += A·V, by Hopper's warpgroup MMA (sm_90a; P = 64) instead of mma.sync:
    a warpgroup of four warps owns 64 of the block's queries."""

    wgmma_levels = (0, 1, 2)  # 0: mma.sync for both products; 1: S by wgmma; 2: both

    template = "attention.cu.j2"

    @functools.cached_property
    def shared_bytes(self) -> int:
        """The Q tile (Z staged over it) and two stages of K and V tiles."""
        return (self.block_m + 4 * self.block_n) * self.P * ITEMSIZE[self.dtype]

    @functools.cached_property
    def grid(self) -> int:
        return self.B * self.H * math.ceil(self.L / self.block_m)

    def vector(self, name: str) -> bool:
        """Whether a tensor moves in 16-byte accesses: p innermost."""
        return dict(self.layouts)[name][-1] == "p"

    def check(self, spec: DeviceSpec = H100) -> None:
        self.check_tiles(OP, INPUTS + OUTPUTS, spec)
        self.check_shared_memory(spec)
        self.check_occupancy(spec)

    @functools.cached_property
    def candidate(self) -> Candidate:
        layouts = dict(self.layouts)
        return Candidate.make(OP, "forward", IMPL, {n: layouts[n] for n in INPUTS},
                              {n: layouts[n] for n in OUTPUTS if n != "LSE"}, self.options(), covers=COVERS)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        check_attention_tensors(self, tensors)

    def render_context(self) -> dict[str, object]:
        tensors = tile_tensors(self, ("Q", "K", "V", "Z"))
        mask = strides(dict(self.layouts)["M"], {"b": self.B, "k": self.L})
        return dict(TENSORS=tensors, BLOCK_M=self.block_m, BLOCK_N=self.block_n, P=self.P, L=self.L, H=self.H,
                    KEEP_BLOCKS=self.keep_blocks, THREADS=self.threads, MIN_BLOCKS=self.min_blocks,
                    Q_TILES=math.ceil(self.L / self.block_m),
                    K_TILES=math.ceil(self.L / self.block_n), MMA="f16" if self.dtype == "float16" else "bf16",
                    SITE=DROPOUT_SITES["attention"], M_STRIDE_B=mask["b"], M_STRIDE_K=mask["k"], WGMMA=self.wgmma)


def make(size: Size, dtype: str, layouts: Mapping[str, str], **knobs: int) -> AttentionParams:
    """The point at `size` for Q, K, V, M, Z in `layouts` (LSE in its fixed layout)."""
    return AttentionParams(op=OP, dtype=dtype, layouts=tuple({**layouts, "LSE": LSE_LAYOUT}.items()), B=size.B,
                           H=size.H, L=size.L, P=size.P, **knobs)


def occupancy_levels(block_m: int) -> tuple[int, ...]:
    """The `min_blocks` worth timing for blocks of `block_m` rows: the compiler's choice (1), and the block counts
    that put 12 or 16 warps on an SM (more than the 8 the uncapped kernels reach): 3 and 4 blocks of 4 warps,
    2 of 8."""
    warps = block_m // 16
    return (1, *(m for m in (2, 3, 4) if BASE_WARPS < m * warps <= MAX_WARPS))


def timed_wgmma_levels(kind: type[AttentionTiles]) -> tuple[int, ...]:
    """The `wgmma` levels the profiler times: off, and the kernel's highest (on the H100, B8/L512 and B96/L128,
    the forward's level 2 beat its level 1 at every tile shape's best: scripts/time_attention.py --wgmma)."""
    return 0, kind.wgmma_levels[-1]


def variants(size: Size, dtype: str, layouts: Mapping[str, str], spec: DeviceSpec = H100) -> list[AttentionParams]:
    """The knob settings worth timing for one layout combination: 64 or 128 queries per block, 32 or 64 keys per
    tile, each at its `occupancy_levels` and `timed_wgmma_levels`, those that fit `spec` (its shared memory, per
    block and per SM; wgmma on Hopper only)."""
    return feasible((make(size, dtype, layouts, block_m=block_m, block_n=block_n, min_blocks=min_blocks, wgmma=wgmma)
                     for block_m, block_n in itertools.product((64, 128), (32, 64))
                     for min_blocks in occupancy_levels(block_m)
                     for wgmma in timed_wgmma_levels(AttentionParams)), spec)


def reference(args: OpArgs, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, M: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Z: bjhp and LSE: bhj from logical Q: bhjp, K, V: bhkp, M: bk, through the graph's own operators (the
    reference softmax and its dropout), in the inputs' dtype."""
    S = torch.einsum("bhjp,bhkp->bhjk", Q, K)
    _, A = softmax(args, S, M)
    logits = (S * args.scale).masked_fill(M[:, None, None, :] == 0, -math.inf)
    return torch.einsum("bhjk,bhkp->bjhp", A, V), torch.logsumexp(logits, dim=-1)


class BoundBackward(BoundKernel):
    """The backward's launches on one device, in order (`_dq` then `_dkdv`; fused: `_d`, `_dkdv`, then `_dqsum`
    where L takes several key tiles, else `_dkdv` alone), all taking every tensor, the float32 workspace (D, then
    the fused partial dQ; none for `_dkdv` alone) and the same scalars. The workspace comes from PyTorch's caching
    allocator on every call, as a Reduction's does (see BoundKernel)."""

    def __init__(self, names: tuple[str, ...], launches: Sequence[PackedLaunch], scalars: Callable[[OpArgs], tuple],
                 workspace_shape: tuple[int, ...], device: int, slice_bytes: tuple[int, ...] = ()) -> None:
        """`slice_bytes`: where a tensor is a stacked dQKV, the byte offsets of dQKV[0], [1], [2] in it (the kernels
        take the three slices' addresses in its place)."""
        super().__init__(names, launches[0], scalars)
        self._launches, self.workspace_shape, self.device = tuple(launches), workspace_shape, torch.device("cuda", device)
        self.slice_bytes, self.stacked_at = slice_bytes, names.index("dQKV") if slice_bytes else None

    def __call__(self, pointers: Sequence[int], args: OpArgs, stream: int,
                 workspace: torch.Tensor | None = None) -> None:
        if args is not self._last_args:
            self._last_scalars, self._last_args = self.scalars(args), args
        if workspace is None and self.workspace_shape[0]:  # none where _dkdv alone runs (it works D out)
            workspace = torch.empty(self.workspace_shape, dtype=torch.float32, device=self.device)
        if self.slice_bytes:
            at = self.stacked_at
            pointers = (*pointers[:at], *(pointers[at] + offset for offset in self.slice_bytes), *pointers[at + 1:])
        values = (*pointers, 0 if workspace is None else workspace.data_ptr(), *self._last_scalars)
        for launch in self._launches:
            launch(stream, *values)

    @property
    def launches(self) -> tuple[PackedLaunch, ...]:
        return self._launches


@dataclass(frozen=True)
class AttentionBackwardParams(AttentionTiles):
    """The fused attention backward: dQ, dK, dV from Q, K, V, M, Z, dZ and the forward's LSE.

    A block of either kernel owns `block_m` rows (queries in `_dq`, keys in `_dkdv`; 16 per warp) and walks the
    other dim in tiles of `block_n`. Both products of a step stay in registers, so the per-thread accumulators
    (the P/2 + P/2 of dQ's or dK's and dV's, plus block_n/2 + block_n/2 of S and dP) grow with P + block_n.
    `fuse_dq` computes dQ in `_dkdv` instead (one S, dP and dropout mask fewer). Where L takes several key tiles,
    their parts of dQ go through memory as float32 partials, one per key tile, added up in key-tile order: by
    `_dqsum` after the whole grid (`fuse_dq=1`), or (`fuse_dq=2`) by the last of each (b, h)'s blocks to finish,
    counted by an integer atomic, while the other blocks still run: the same sums, one launch fewer. `fuse_dq=4`
    adds every key tile's part into one float32 accumulator by float atomics (red.add, in L2: at B8/L512 the
    partials are 4x its 16.8 MB and went to DRAM and back), which `_dqsum` rounds: not deterministic.
    `wgmma` 1 computes `_dkdv`'s four products (Sᵀ = K·Qᵀ, dAᵀ = V·dZᵀ, dV += Aᵀ·dZ, dK += dSᵀ·Q) by Hopper's
    warpgroup MMA (sm_90a; P = 64) instead of mma.sync: a warpgroup of four warps owns 64 of the block's keys.
    `_dq`, `_d`, `_dqsum`, `_dbsum` and the fused dQ product stay on mma.sync.
    `split_queries` serves padded batches: a block per key tile cannot finish in fewer waves when a quarter of the
    tiles hold padding only (384 live tiles of 512 still take two waves of 264 blocks on the H100). Two blocks per
    tile, each walking half the queries, can: `_d` counts the live tiles of each key tile index and picks the first
    index to split (`first_split_tile`: 256 whole blocks then 256 halves there). The grid runs key tiles
    outermost, so whole blocks take wave slots first, halves next, padding last. Unsplit, the second block of a tile
    returns at once, so a full batch runs the one-block walk; split, the first of the two to finish stores its
    float32 dK and dV for the other to add (a + b = b + a: deterministic), and `_dqsum` skips the partial dQ of
    the padding's tiles, which `_dkdv` then leaves unwritten."""

    fuse_dq: int = 0  # 1: dQ from _dkdv's dS (float32 partials per key tile, summed in order), no _dq; 2: summed
    # by the last key tile of each (b, h); 4 (ATOMIC_DQ): added up by float atomics, in no fixed order
    split_queries: int = 0  # 1: two `_dkdv` blocks per key tile, each walking half the queries, for the last key
    # tiles where the batch's live tiles end sooner so (decided on the GPU, `first_split_tile`); fuse_dq 1 or 4,
    # L > block_m

    wgmma_levels = (0, 1)  # 0: mma.sync; 1: _dkdv's products by wgmma

    def options(self) -> dict[str, object]:
        """The knobs, `split_queries` only where it is on (rows profiled before it existed keep their labels)."""
        found = super().options()
        if not self.split_queries:
            del found["split_queries"]
        return found

    def slice_offsets(self) -> tuple[int, ...]:
        """Elements from the stacked dQKV's start to dQKV[0], [1], [2]."""
        stride = strides(dict(self.layouts)["dQKV"], self.extents)["t"]
        return tuple(t * stride for t in range(len(SLICES)))

    @property
    def d_inside(self) -> bool:
        """Whether `_dkdv` works out D itself (fused, one key tile covering L: its block reads every query tile
        once), loading Z beside dZ, instead of a `_d` pass."""
        return bool(self.fuse_dq) and self.row_tiles == 1

    template = "attention_bwd.cu.j2"

    @functools.cached_property
    def shared_bytes(self) -> int:
        """The larger kernel's: two row tiles (Q, dZ or K, V) and two stages of two column tiles, plus `_dkdv`'s
        two stages of LSE and D (and, fused, its dSᵀ tile; working D out itself, two stages of Z tiles, and, stacked,
        each key's float32 sum of dS)."""
        ds = self.block_m * (self.block_n + 8) * ITEMSIZE[self.dtype] if self.fuse_dq else 0
        tiles = 2 * self.block_m + (6 if self.d_inside else 4) * self.block_n
        key_sums = self.block_m * 4 if self.stacked and self.d_inside else 0  # dbqkv's: each key's Σ_j dS
        return tiles * self.P * ITEMSIZE[self.dtype] + 4 * self.block_n * 4 + ds + key_sums

    @property
    def row_tiles(self) -> int:
        return math.ceil(self.L / self.block_m)

    @property
    def d_floats(self) -> int:
        """The workspace's D: B·H·L floats, rounded up to 64 (the partial dQ after it stays 256-byte aligned); none
        where `_dkdv` works D out itself."""
        return 0 if self.d_inside else math.ceil(self.B * self.H * self.L / 64) * 64

    @property
    def dq_partial_floats(self) -> int:
        """Fused over several key tiles: the partial dQ of every key tile (key tile, b, h, j, p), then the int32
        counts of blocks done (`count_words`)."""
        if not self.fuse_dq or self.row_tiles == 1:
            return 0
        return self.dq_slices * self.B * self.H * self.L * self.P + self.count_words

    @property
    def dq_slices(self) -> int:
        """The float32 dQ partials' slices in the workspace: one per key tile, or one accumulator (fuse_dq=4)."""
        return 1 if self.fuse_dq == ATOMIC_DQ else self.row_tiles

    @property
    def count_words(self) -> int:
        """fuse_dq=2: the count of key tiles done, one per (b, h); `bias_in_dqsum`: of `_dqsum` blocks done, one per
        head; rounded up to 64 words."""
        if self.fuse_dq == 2:
            return math.ceil(self.B * self.H / 64) * 64
        return math.ceil(self.H / 64) * 64 if self.bias_in_dqsum else 0

    @property
    def dqsum_launch(self) -> bool:
        """Whether a `_dqsum` launch rounds dQ after `_dkdv`: fuse_dq=1 or 4 where L takes several key tiles."""
        return self.fuse_dq in (1, ATOMIC_DQ) and self.row_tiles > 1

    @property
    def bias_in_dqsum(self) -> bool:
        """Stacked with a `_dqsum` launch: the last of each head's `_dqsum` blocks adds up that head's dbqkv
        partials, as `_dbsum` does, so no `_dbsum` launch follows."""
        return self.stacked and self.dqsum_launch

    @property
    def bias_partial_floats(self) -> int:
        """Stacked: dbqkv's partial sums, one per (t, b, row tile, h, p)."""
        return len(SLICES) * self.B * self.row_tiles * self.H * self.P if self.stacked else 0

    @property
    def split_words(self) -> int:
        """split_queries: the decision, one count per key tile of its halves' progress, then each sequence's live
        key tiles (for `_dqsum`), rounded up to 64 words (the partials after them stay 256-byte aligned)."""
        return math.ceil((1 + self.grid + self.B) / 64) * 64 if self.split_queries else 0

    @property
    def split_partial_floats(self) -> int:
        """split_queries: the float32 dK and dV accumulators of the first half of each key tile to finish."""
        return 2 * self.grid * self.block_m * self.P if self.split_queries else 0

    def launch_shapes(self) -> list[tuple[str, int, int]]:
        """(kernel suffix, grid, threads) of every launch, in order."""
        if not self.fuse_dq:
            found = [("dq", self.grid, self.threads), ("dkdv", self.grid, self.threads)]
        elif self.d_inside:
            found = [("dkdv", self.grid, self.threads)]
        else:  # _d: 8 elements a thread (fuse_dq=2: it zeroes the counts); _dqsum: a block per (b, h, query tile)
            found = [("d", math.ceil(self.B * self.H * self.L * self.P // 8 / 256), 256),
                     ("dkdv", self.grid * (1 + self.split_queries), self.threads)]
            found += [("dqsum", self.grid, 256)] * self.dqsum_launch
        dbsum = self.stacked and not self.bias_in_dqsum
        return found + [("dbsum", math.ceil(len(SLICES) * self.H * self.P / SUM_TX), SUM_TX * SUM_TY)] * dbsum

    @functools.cached_property
    def grid(self) -> int:
        """A block per (b, h, key tile): `_dkdv`'s grid, each half of it with `split_queries`."""
        return self.B * self.H * math.ceil(self.L / self.block_m)

    def workspace_shape(self) -> tuple[int, ...]:
        """Flat float32: D = rowsum(dZ∘Z) (bhj), the partial dQ, dbqkv's partial sums, the split's words and
        partials, each where the point has them (`d_floats`, `dq_partial_floats`, `bias_partial_floats`,
        `split_words`, `split_partial_floats`)."""
        return (self.d_floats + self.dq_partial_floats + self.bias_partial_floats + self.split_words
                + self.split_partial_floats,)

    def check(self, spec: DeviceSpec = H100) -> None:
        self.check_tiles(BWD_OP, BWD_INPUTS + (STACKED_OUTPUTS if self.stacked else BWD_OUTPUTS), spec)
        if self.block_m > 4 * self.block_n:
            raise InfeasibleVariantError(f"{self.op}: block_m={self.block_m} must be at most 4·block_n={4 * self.block_n} "
                                         f"(_dq stages Z's tile in the K and V buffers)")
        if self.fuse_dq not in (0, 1, 2, ATOMIC_DQ):
            raise InfeasibleVariantError(f"{self.op}: fuse_dq={self.fuse_dq} must be 0, 1, 2 or 4")
        if self.fuse_dq in (2, ATOMIC_DQ) and self.row_tiles == 1:
            raise InfeasibleVariantError(f"{self.op}: fuse_dq={self.fuse_dq} sums the dQ partials of several key "
                                         f"tiles, but one key tile of block_m={self.block_m} covers L={self.L} "
                                         f"(fuse_dq=1 is the same kernel)")
        if self.split_queries not in (0, 1):
            raise InfeasibleVariantError(f"{self.op}: split_queries={self.split_queries} must be 0 or 1")
        if self.split_queries and (self.fuse_dq not in (1, ATOMIC_DQ) or self.row_tiles == 1):
            raise InfeasibleVariantError(f"{self.op}: split_queries=1 splits the fused walk of one of several key "
                                         f"tiles (fuse_dq 1 or 4, L > block_m), not fuse_dq={self.fuse_dq} with "
                                         f"{self.row_tiles} key tile(s)")
        if self.P + self.block_n > BWD_REGISTERS:
            raise InfeasibleVariantError(f"{self.op}: P + block_n = {self.P + self.block_n} accumulator floats per "
                                         f"thread exceed {BWD_REGISTERS} (registers would spill)")
        self.check_shared_memory(spec)
        self.check_occupancy(spec)

    @functools.cached_property
    def candidate(self) -> Candidate:
        layouts = dict(self.layouts)
        inputs = {n: layouts[n] for n in BWD_INPUTS if n != "LSE"}
        outputs = STACKED_OUTPUTS if self.stacked else BWD_OUTPUTS
        return Candidate.make(BWD_OP, "backward", IMPL, inputs, {n: layouts[n] for n in outputs}, self.options(),
                              covers=STACKED_COVERS if self.stacked else BWD_COVERS)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        check_attention_tensors(self, tensors)

    def render_context(self) -> dict[str, object]:
        tensors = tile_tensors(self, ("Q", "K", "V", "Z", "dZ", "dQ", "dK", "dV"))
        layouts = dict(self.layouts)
        mask = strides(layouts["M"], {"b": self.B, "k": self.L})
        bias = strides(layouts["dbqkv"], self.extents) if self.stacked else {}
        return dict(TENSORS=tensors, T={t["name"]: t for t in tensors}, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    P=self.P, L=self.L, H=self.H, THREADS=self.threads, MIN_BLOCKS=self.min_blocks,
                    ROW_TILES=self.row_tiles, KEEP_BLOCKS=self.keep_blocks,
                    COL_TILES=math.ceil(self.L / self.block_n), MMA="f16" if self.dtype == "float16" else "bf16",
                    SITE=DROPOUT_SITES["attention"], M_STRIDE_B=mask["b"], M_STRIDE_K=mask["k"], B=self.B,
                    FUSE_DQ=bool(self.fuse_dq), LAST_BLOCK_SUMS=self.fuse_dq == 2,
                    ATOMIC_DQ=self.fuse_dq == ATOMIC_DQ, DQ_SLICES=self.dq_slices, BIAS_IN_DQSUM=self.bias_in_dqsum,
                    D_FLOATS=self.d_floats,
                    COUNT_OFFSET=self.d_floats + self.dq_partial_floats - self.count_words, STACKED=self.stacked,
                    DB=bias, BIAS_OFFSET=self.d_floats + self.dq_partial_floats,
                    DQ_SLICE=self.P * (self.block_n // 16) // (self.block_m // 16),  # warps share the dQ tile
                    WGMMA=self.wgmma, SPLIT=bool(self.split_queries), TILE_BLOCKS=self.grid,
                    SPLIT_OFFSET=self.d_floats + self.dq_partial_floats + self.bias_partial_floats,
                    SPLIT_WORDS=self.split_words)

    def scalars(self, args: OpArgs) -> tuple[float | int, ...]:
        """The scale 1/sqrt(P) and the attention dropout (the forward's)."""
        return (args.scale, *dropout_arguments(args, args.attention_dropout))

    def _bind(self, cubin: Cubin, device: int) -> BoundBackward:
        tensors = len(self.layouts) + (len(SLICES) - 1) * self.stacked  # a stacked dQKV is three slices' addresses
        signature = ("pointer",) * (tensors + 1) + ("float32",) + DROPOUT_SIGNATURE + ("int32",) * self.split_queries
        launches = [self.packed(cubin, device, f"{self.name}_{part}", grid, threads,
                                self.shared_bytes if part in ("dq", "dkdv") else 0, signature)
                    for part, grid, threads in self.launch_shapes()]
        slice_bytes = tuple(o * ITEMSIZE[self.dtype] for o in self.slice_offsets()) if self.stacked else ()
        scalars = self.scalars
        if self.split_queries:  # `_d` decides the split from the wave slots `_dkdv`'s blocks have on this device
            dkdv = next(launch for launch in launches if launch.name.endswith("_dkdv"))
            slots = dkdv.resident_blocks() * DeviceSpec.of(device).sm_count
            scalars = functools.partial(with_slots, self.scalars, slots)
        return BoundBackward(self.tensor_names, launches, scalars, self.workspace_shape(), device, slice_bytes)


def with_slots(scalars: Callable[[OpArgs], tuple], slots: int, args: OpArgs) -> tuple:
    """A split backward's scalars: the point's, then the blocks of `_dkdv` the device holds at once."""
    return (*scalars(args), slots)


HALF_TENTHS = 6  # a half-block of the split, in tenths of a whole block's time (B8/L512 timelines: 30.3 / 50.8 us)


def split_makespan(whole: int, halves: int, slots: int) -> int:
    """When `_dkdv`'s grid ends, in tenths of a whole block's time, where `whole` blocks and then `halves`
    half-blocks take the first of `slots` wave slots to free up (whole blocks in waves; the slots the last partial
    wave leaves free take halves a wave earlier than the others). The template's `split_makespan`, in integers so
    that both agree exactly."""
    waves, rest = divmod(whole, slots)
    wholes_end = 10 * waves + (10 if rest else 0)
    if not halves:
        return wholes_end
    best, j = None, 1
    while best is None or 10 * waves + HALF_TENTHS * j < best:
        for late in (0, 1):
            end = 10 * (waves + late) + HALF_TENTHS * j
            early_fit = (end - 10 * waves) // HALF_TENTHS
            late_fit = (end - 10 * (waves + 1)) // HALF_TENTHS if end >= 10 * (waves + 1) else 0
            if (slots - rest) * early_fit + rest * late_fit >= halves and (best is None or end < best):
                best = end
        j += 1
    return max(best, wholes_end)


def live_blocks_per_tile(M: torch.Tensor, block_m: int, heads: int) -> list[int]:
    """The live `_dkdv` blocks of each key tile index that `_d` counts for `first_split_tile`, from a logical mask
    M: bk: each sequence's tiles up to its last unmasked key (at least one), times the heads."""
    keys = torch.arange(M.shape[1], device=M.device)
    tiles = (M.ne(0) * keys).amax(dim=1) // block_m + 1
    return [heads * int((tiles > k).sum()) for k in range(math.ceil(M.shape[1] / block_m))]


def first_split_tile(live: Sequence[int], slots: int) -> int:
    """The first key tile index `_dkdv` splits into two half-blocks (the rule `_d` applies on the GPU; len(live):
    none), from the live blocks (sequences x heads) of each key tile index and the device's wave `slots`: the one
    whose grid of whole blocks, then halves, ends first by `split_makespan`, the fewest splits among equals.
    B8/L512 on the H100 (264 slots): 4 x 128 live blocks split none (2 waves, against 2.2 or more with halves);
    with a quarter of the keys padding (3 x 128), the last live index splits: 256 whole blocks and 256 halves end
    at 1.6 whole-block times, against 2 unsplit and 1.8 all split."""
    whole, halves = sum(live), 0
    first, best = len(live), split_makespan(whole, 0, slots)
    for k in reversed(range(len(live))):
        whole -= live[k]
        halves += 2 * live[k]
        end = split_makespan(whole, halves, slots)
        if end < best:
            best, first = end, k
    return first


def make_backward(size: Size, dtype: str, layouts: Mapping[str, str], **knobs: int) -> AttentionBackwardParams:
    """The backward point at `size` for Q, K, V, M, Z, dZ, and dQ, dK, dV or (stacked) dQKV, dbqkv in `layouts`
    (LSE in its fixed layout)."""
    given = {**layouts, "LSE": LSE_LAYOUT}
    return AttentionBackwardParams(op=BWD_OP, dtype=dtype,
                                   layouts=tuple((n, given[n]) for n in BWD_INPUTS + BWD_OUTPUTS + STACKED_OUTPUTS
                                                 if n in given),
                                   B=size.B, H=size.H, L=size.L, P=size.P, **knobs)


def configured_points(config: Mapping) -> list[AttentionParams | AttentionBackwardParams]:
    """The points of our attention a configuration (the dict of its JSON twin) runs at its size: forward, backward,
    either left out where it takes an SDPA backend."""
    size, found = Size(**config["size"]), []
    for op, build in (("attn_scores", make), ("attn_context_dgrad_a", make_backward)):
        choice = config["operators"][op]
        if choice["impl"] == IMPL:  # in the kernels' order of the tensors (make_backward orders its own)
            layouts = {n: choice["layouts"][n] for n in ("Q", "K", "V", "M", "Z", *choice["layouts"])}
            found.append(build(size, config["dtype"], layouts, **choice["options"]))
    return found


def backward_variants(size: Size, dtype: str, layouts: Mapping[str, str], spec: DeviceSpec = H100
                      ) -> list[AttentionBackwardParams]:
    """The knob settings worth timing: block_m 64 or 128 rows, block_n 32 or 64 columns, dQ apart or fused (its
    partials summed after the grid or by each (b, h)'s last block, or added up by float atomics, where L takes
    several key tiles), each at its `occupancy_levels` and `timed_wgmma_levels`, pruned by the rules of `check`:
    S, dP and the P-wide accumulators fit 160 floats per thread (P + block_n <= 160: at P = 128 only block_n = 32),
    block_m <= 4·block_n, and `spec`'s shared memory (per block and per SM; wgmma on Hopper only)."""
    return feasible((make_backward(size, dtype, layouts, block_m=block_m, block_n=block_n, fuse_dq=fuse_dq,
                                   min_blocks=min_blocks, wgmma=wgmma)
                     for block_m, block_n, fuse_dq in itertools.product((64, 128), (32, 64), (0, 1, 2, ATOMIC_DQ))
                     for min_blocks in occupancy_levels(block_m)
                     for wgmma in timed_wgmma_levels(AttentionBackwardParams)), spec)


def reference_backward(args: OpArgs, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, M: torch.Tensor,
                       dZ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ: bhjp, dK, dV: bhkp by autograd through `reference` (the same dropout mask) from logical Q: bhjp, K, V:
    bhkp, M: bk and dZ: bjhp, in the inputs' dtype."""
    leaves = [x.detach().requires_grad_() for x in (Q, K, V)]
    with torch.enable_grad():
        Z, _ = reference(args, *leaves, M)
        dQ, dK, dV = torch.autograd.grad(Z, leaves, dZ)
    return dQ, dK, dV


# -- what the profiler times ---------------------------------------------------------------------------------
def profiled_layouts() -> list[dict[str, str]]:
    """The layout combinations the profiler times (the module docstring's rule), each with every tensor of the
    backward row: Q, K, V in one p-innermost order, Z in Q's layout or bjhp, M bk, dZ like Z, dQ, dK, dV like Q,
    K, V."""
    found = []
    for q in accepted_layouts("bhjp"):
        k = q.replace("j", "k")
        for z in dict.fromkeys((q, EFFICIENT_Z)):
            found.append(dict(Q=q, K=k, V=k, M="bk", Z=z, dZ=z, dQ=q, dK=k, dV=k))
    return found


STACKED_LAYOUTS = {"dQKV": "bjthp", "dbqkv": "thp"}  # the stacked row's profiled: the graph's (qkv_proj's GEMMs')


def profiled_points(size: Size, dtype: str, spec: DeviceSpec = H100) -> list[KernelParams]:
    """Every forward and backward point the profiler times at `size` in `dtype`: each combination of
    `profiled_layouts` with every tile variant that fits `spec` (none where the kernels do not run: P not 64 or
    128, a dtype without tensor cores), and the backward's once more writing a stacked dQKV (STACKED_LAYOUTS)."""
    forward, backward, stacked = [], [], []
    for layouts in profiled_layouts():
        forward += variants(size, dtype, {n: layouts[n] for n in INPUTS if n != "LSE"} | {"Z": layouts["Z"]}, spec)
        backward += backward_variants(size, dtype, layouts, spec)
        inputs = {n: layouts[n] for n in BWD_INPUTS if n != "LSE"}
        stacked += backward_variants(size, dtype, inputs | STACKED_LAYOUTS, spec)
    return list(dict.fromkeys(forward)) + backward + stacked


# -- the GPU side: the profiler's checked runners -------------------------------------------------------------
def _inputs(size: Size, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random logical Q: bhjp, K, V: bhkp, dZ: bjhp and a 0/1 mask M: bk keeping key 0 (seeded)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    found = {n: torch.randn(size.B, size.H, size.L, size.P, device="cuda", generator=gen).to(dtype) for n in "QKV"}
    found["dZ"] = torch.randn(size.B, size.L, size.H, size.P, device="cuda", generator=gen).to(dtype)
    return found | {"M": random_input("M", "bk", size.extents, dtype, gen)}


def stacked_gradients(dQKV: torch.Tensor, layout: str, dbqkv: torch.Tensor, bias_layout: str
                      ) -> dict[str, torch.Tensor]:
    """The logical dQ: bhjp, dK, dV: bhkp and dbqkv: thp of a stacked row's outputs."""
    stacked = logical(dQKV, layout, tensor_dims("dQKV"))  # bjthp
    found = {name: stacked[:, :, t].permute(0, 2, 1, 3) for t, name in enumerate(SLICES)}
    return found | {"dbqkv": logical(dbqkv, bias_layout, tensor_dims("dbqkv"))}


def reference_bias(gradients: Sequence[torch.Tensor]) -> torch.Tensor:
    """dbqkv: thp = Σ_bj of dQ: bhjp, dK, dV: bhkp."""
    return torch.stack([g.sum(dim=(0, 2)) for g in gradients])


def checked_runner(params: AttentionParams | AttentionBackwardParams, size: Size, p: float
                   ) -> tuple[Callable[[], None], float]:
    """A closure launching the point on random inputs in its layouts (bound once, on PyTorch's current stream),
    and its outputs' max relative error vs the float64 reference on the same inputs and dropout masks (Z, or dQ,
    dK, dV by autograd through the reference, and dbqkv). A backward point reads the LSE and Z of one forward
    launch (the first forward variant in its layouts: the LSE does not depend on the forward's tiles)."""
    dtype, args, device = getattr(torch, params.dtype), op_args(size, p), torch.cuda.current_device()
    spec, logical_inputs = DeviceSpec.of(device), _inputs(size, getattr(torch, params.dtype))
    lay = dict(params.layouts)
    tensors = {n: stored(x, tensor_dims(n), lay[n]) for n, x in logical_inputs.items() if n in lay}
    for name in ("Z", *BWD_OUTPUTS, *STACKED_OUTPUTS):
        if name in lay and name not in tensors:
            tensors[name] = torch.empty([params.extents[d] for d in lay[name]], device="cuda", dtype=dtype)
    tensors["LSE"] = torch.empty((size.B, size.H, size.L), device="cuda")
    forward = params if isinstance(params, AttentionParams) else variants(
        size, params.dtype, {n: lay[n] for n in ("Q", "K", "V", "M", "Z")}, spec)[0]
    forward.launch(forward.compile(spec), {n: tensors[n] for n in forward.tensor_names}, args)
    params.check_tensors(tensors)
    bound = params.bind(params.compile(spec), device)
    pointers = [tensors[name].data_ptr() for name in bound.names]

    def run() -> None:
        bound(pointers, args, torch.cuda.current_stream().cuda_stream)

    run()
    exact = [logical_inputs[n].double() for n in ("Q", "K", "V", "M")]
    if isinstance(params, AttentionParams):
        want = dict(zip(("Z", "LSE"), reference(args, *exact)))
    else:
        want = dict(zip(SLICES, reference_backward(args, *exact, logical_inputs["dZ"].double())))
    if params.stacked:
        want["dbqkv"] = reference_bias([want[n] for n in SLICES])
        got = stacked_gradients(tensors["dQKV"], lay["dQKV"], tensors["dbqkv"], lay["dbqkv"])
    else:
        got = {n: logical(tensors[n], lay[n], tensor_dims(n)) for n in want}
    error = max(relative_error(got[n], w) for n, w in want.items())
    return run, error


# -- the implementation: forward and backward rows over the attention subgraph --------------------------------
LSE_STATE = "attention_kernel_lse"  # the plan's name of the LSE the forward step hands the backward step


class FusedAttentionStep(AllocatingStep):
    """The fused attention kernel of one pass, bound to one device. The forward reads Q, K, V, M and writes Z and
    the LSE (float32, bhj, as `LSE_STATE`); the backward reads them with Z and dZ and writes dQ, dK, dV, or the
    stacked dQKV and dbqkv (its launches take a float32 workspace from PyTorch's caching allocator per call).
    S, Pr, A, dA, dS are never materialized."""

    def __init__(self, ops: Sequence[Operator], choice: Choice, params: KernelParams, bound: BoundKernel,
                 layouts: Mapping[str, str], extents: Mapping[str, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(ops, choice)
        self.params, self.bound = params, bound
        env = {"LSE": LSE_STATE}  # the kernel's tensor -> the plan's
        self.names = tuple(env.get(name, name) for name in bound.names)
        written = FusedAttention.written(ops)
        self.inputs = tuple(env.get(n, n) for n in bound.names if n not in written)
        self.outputs = tuple(env.get(n, n) for n in bound.names if n in written)
        self.shapes = {t: tuple(extents[d] for d in layouts[t]) for t in self.outputs if t != LSE_STATE}
        self.dtype, self.device = dtype, device
        self.lse_shape = (extents["b"], extents["h"], extents["j"])
        self.atomic = isinstance(params, AttentionBackwardParams) and params.fuse_dq == ATOMIC_DQ

    def allocate(self, into: Mapping[str, Tensor]) -> Env:
        out = super().allocate(into)
        if self.pass_ == "forward":
            out[LSE_STATE] = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        return out

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        if self.atomic:
            alert_nondeterministic(f"{self.name} (attention fuse_dq={ATOMIC_DQ})")
        out = self.allocate(ctx.into)
        self.bound([(out[name] if name in out else env[name]).data_ptr() for name in self.names], ctx.args,
                   ctx.stream)
        return out


# Where an Encoder for padded batches takes `split_queries` (`FusedAttention.for_padded_batches`). Over two key tiles
# the split variant cost B8/H16 6-7 us more per backward on the H100 on every batch, padded or not (its `_d` decides,
# its `_dqsum` reads each sequence's live tiles: 48.6 against 42.6 us at L = 256), while 264 wave slots hold all 256
# whole blocks, so that `first_split_tile` splits nothing; from three (L = 384, 512) it gained 5-22 us on batches of
# random lengths (`layouts/h100-padded-batches-eighteenth.txt`).
SPLIT_MIN_KEY_TILES = 3


class FusedAttention(KernelImplementation):
    """Substation's fused attention kernels (`AttentionParams`, `AttentionBackwardParams`) over the attention
    subgraph: a forward and a backward row, coupled through the forward's LSE; the backward's also as the stacked
    row, which covers qkv_bias_bwd too."""

    impl = IMPL
    coupled = True

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return COVERS, BWD_COVERS, STACKED_COVERS

    @staticmethod
    def written(ops: Sequence[Operator]) -> tuple[str, ...]:
        """What the row writes (the forward's LSE included)."""
        if ops[0].pass_ == "forward":
            return OUTPUTS
        return STACKED_OUTPUTS if any(op.name == "qkv_bias_bwd" for op in ops) else BWD_OUTPUTS

    @classmethod
    def names(cls, ops: Sequence[Operator]) -> tuple[str, ...]:
        """The graph tensors of the pass's row, in the kernel's order (no LSE)."""
        names = (INPUTS if ops[0].pass_ == "forward" else BWD_INPUTS) + cls.written(ops)
        return tuple(n for n in names if n != "LSE")

    def cover_layouts(self, ops: Sequence[Operator], config: Configuration) -> dict[str, str]:
        """The row's tensors in the pass's layouts (the backward also reads M and Z, which its operators do not)."""
        pass_, written = ops[0].pass_, self.written(ops)
        return {t: config.layouts[t] if t in written else config.layout(t, pass_) for t in self.names(ops)}

    def ordered(self, ops: Sequence[Operator], layouts: Mapping[str, str]) -> dict[str, str]:
        """The kernel's tensors in its order, each in its given layout or, where none is given, canonical."""
        return {n: layouts.get(n, layer_graph().tensors[n].dims) for n in self.names(ops)}

    @staticmethod
    def family(ops: Sequence[Operator]) -> tuple[Callable[..., KernelParams], Callable[..., list[KernelParams]]]:
        """The pass's point builder and its variant list."""
        return (make, variants) if ops[0].pass_ == "forward" else (make_backward, backward_variants)

    def point(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str],
              options: Mapping[str, object]) -> KernelParams:
        """The kernel point of this pass at `size` (its dtype) in `layouts` with the knobs `options`, unchecked;
        TypeError names an unknown knob."""
        build, _ = self.family(ops)
        return build(size, size.dtype, self.ordered(ops, layouts), **options)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        covers = tuple(op.name for op in ops)
        found = self.cover_variants(ops, size, self.ordered(ops, layouts), H100)
        if not found:
            try:
                self.point(ops, size, layouts, {}).check()
                reason = "no tile variant fits"
            except InfeasibleVariantError as err:
                reason = str(err)
            yield Infeasible(self.impl, covers, reason)
        for params in found:
            yield params.candidate

    def chosen_point(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size
                     ) -> KernelParams:
        params = self.point(ops, size, self.cover_layouts(ops, config), choice.options)
        params.check()
        return params

    def for_padded_batches(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size
                           ) -> Choice:
        """A backward with the fused dQ walk over at least `SPLIT_MIN_KEY_TILES` key tiles takes `split_queries`:
        on a batch whose padding masks whole key tiles it finishes in fewer waves (decided on the GPU from the mask,
        per batch), and on one without such tiles it runs the one-block walk after an idle launch of the second
        blocks (B8/L512 on the H100: 147.0 against 145.9 us; L = 384: 94.8 against 96.6). The profile times one
        batch without padding tiles, so it never weighs the split: an Encoder told its batches are padded takes it
        (`Encoder(padded_batches=...)`). Not profiled, so the choice has no prediction."""
        if ops[0].pass_ == "forward" or choice.options.get("split_queries"):
            return choice
        options = dict(choice.options) | {"split_queries": 1}
        try:
            params = self.point(ops, size, self.cover_layouts(ops, config), options)
            params.check()
        except InfeasibleVariantError:  # dQ apart or summed by the last block, or one key tile at this length
            return choice
        if params.row_tiles < SPLIT_MIN_KEY_TILES:
            return choice
        return dataclasses.replace(choice, options=options, label=params.label, predicted_us=None)

    def cover_variants(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str], spec: DeviceSpec
                       ) -> list[KernelParams]:
        _, listed = self.family(ops)
        return listed(size, size.dtype, layouts, spec)

    def deterministic(self, pass_: str, options: Mapping[str, object]) -> bool:
        return options.get("fuse_dq") != ATOMIC_DQ

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        params, spec = self.runnable(ops, choice, config, size, dtype, device)
        bound = params.bind(params.compile(spec), device.index)
        return FusedAttentionStep(ops, choice, params, bound, self.cover_layouts(ops, config), size.extents, dtype,
                                  device)
