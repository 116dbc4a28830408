"""Fused attention forward (attn_scores + softmax + attn_context in one kernel), FlashAttention-2 style, for any
layout of Q, K, V and Z.

    Q: bhjp, K: bhkp, V: bhkp, M: bk -> Z = dropout(softmax(scale·Q·Kᵀ, keys with M == 0 at -inf))·V: bjhp,
                                        LSE = logsumexp_k(scale·Q·Kᵀ masked): bhj (float32, for a backward)

A block owns `block_m` queries of one (b, h) (one warp per 16) and walks the keys in tiles of `block_n`: K and V
double-buffered in shared memory, S = Q·Kᵀ and Z += A·V on tensor cores (mma.sync m16n8k16, fp16 or bf16 operands,
fp32 accumulation), the online softmax in registers; S, Pr and A are never stored. The dropout mask is
Substation's Philox stream (site `attention`, element indexing of the logical [B, H, J, K] tensor, the device code
of `common.cuh.j2`: one call per 8 elements, 16-bit halves), so it equals `substation.dropout.keep_mask` bit for
bit and a backward can regenerate it; `attention_keep.cuh.j2` looks it up a warp's 16x16 accumulator square at a
time, one Philox call per lane (per 8 keys of a row where L is a multiple of 8, else at most two).
Tensors with p innermost move in 16-byte accesses (cp.async loads), any other layout one element at a time.

The backward (`AttentionBackwardParams`, `attention_bwd.cu.j2`) covers the five backward operators at once:

    Q, K, V: bhjp/bhkp, M: bk, Z, dZ: bjhp, LSE: bhj -> dQ: bhjp, dK, dV: bhkp

in two deterministic kernels (no atomics) that both recompute P from LSE and regenerate the dropout mask: one
per query tile for dQ (and D = rowsum(dZ∘Z)), then one per key tile for dK and dV.

Not yet an implementation of the registry (`substation/implementations.py`): no profile rows.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from substation.device import H100, DeviceSpec
from substation.graph import DROPOUT_SITES, layer_graph
from substation.jit import Cubin
from substation.launch import PackedLaunch
from substation.kernels.base import (DROPOUT_SIGNATURE, ITEMSIZE, BoundKernel, InfeasibleVariantError, KernelParams,
                                     dropout_arguments, strides)
from substation.records import Candidate
from substation.reference import OpArgs, softmax
from substation.sizes import Size

OP = "attn_scores"  # a fused row is named after the first operator it covers, as SDPA's rows are
COVERS = ("attn_scores", "softmax", "attn_context")
INPUTS, OUTPUTS = ("Q", "K", "V", "M"), ("Z", "LSE")
LSE_LAYOUT = "bhj"  # the logsumexp is the kernel's own tensor (no graph tensor), in one fixed layout
DTYPES = ("float16", "bfloat16")  # the mma.sync operand types
HEAD_SIZES = (64, 128)
ROW_LETTER = {"Q": "j", "K": "k", "V": "k", "Z": "j", "dZ": "j", "dQ": "j", "dK": "k", "dV": "k"}  # tile rows' dim
FLOAT32 = ("LSE",)  # the kernels' own float32 tensors; the others have the kernel's dtype

BWD_OP = "attn_context_dgrad_a"  # named, as the forward, after the first operator it covers
BWD_COVERS = ("attn_context_dgrad_a", "attn_context_dgrad_v", "softmax_bwd", "attn_scores_dgrad_q",
              "attn_scores_dgrad_k")
BWD_INPUTS, BWD_OUTPUTS = ("Q", "K", "V", "M", "Z", "dZ", "LSE"), ("dQ", "dK", "dV")
BWD_REGISTERS = 160  # feasibility: per-thread accumulator floats P + block_n (see AttentionBackwardParams.check)


def tensor_dims(name: str) -> str:
    """The logical dims of one of the kernels' tensors."""
    return LSE_LAYOUT if name == "LSE" else layer_graph().tensors[name].dims


def tile_tensors(params: KernelParams, names: tuple[str, ...]) -> list[dict[str, object]]:
    """The template's description of the tiled tensors: strides of b, h, the tile rows' dim and p."""
    layouts, found = dict(params.layouts), []
    for name in names:
        layout = layouts[name]
        st = strides(layout, params.extents)
        found.append(dict(name=name, stride_b=st["b"], stride_h=st["h"], stride_row=st[ROW_LETTER[name]],
                          stride_p=st["p"], vector=layout[-1] == "p", rows_inner=layout[-1] == ROW_LETTER[name]))
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


@dataclass(frozen=True)
class AttentionParams(KernelParams):
    B: int = 1
    H: int = 1
    L: int = 1
    P: int = 64
    block_m: int = 64  # queries per block, 16 per warp
    block_n: int = 64  # keys per tile

    template = "attention.cu.j2"

    def size_fields(self) -> tuple[str, ...]:
        return ("B", "H", "L", "P")

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "h": self.H, "j": self.L, "k": self.L, "p": self.P}

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 32

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
        if self.dtype not in DTYPES:
            raise InfeasibleVariantError(f"{self.op}: dtype {self.dtype!r} has no tensor-core kernel; expected one of "
                                         f"{list(DTYPES)}")
        check_layouts(self, OP, INPUTS + OUTPUTS)
        if self.P not in HEAD_SIZES:
            raise InfeasibleVariantError(f"{self.op}: head size P={self.P} must be one of {list(HEAD_SIZES)} (mma "
                                         f"k-steps of 32)")
        if self.block_m not in (64, 128):
            raise InfeasibleVariantError(f"{self.op}: block_m={self.block_m} must be 64 or 128 (16 queries per warp)")
        if self.block_n not in (32, 64):
            raise InfeasibleVariantError(f"{self.op}: block_n={self.block_n} must be 32 or 64 (A operands of 16 keys, "
                                         f"S in registers)")
        self.check_shared_memory(spec)

    @functools.cached_property
    def candidate(self) -> Candidate:
        layouts = dict(self.layouts)
        return Candidate.make(OP, "forward", "kernel", {n: layouts[n] for n in INPUTS},
                              {n: layouts[n] for n in OUTPUTS}, self.options(), covers=COVERS)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        check_attention_tensors(self, tensors)

    def render_context(self) -> dict[str, object]:
        tensors = tile_tensors(self, ("Q", "K", "V", "Z"))
        mask = strides(dict(self.layouts)["M"], {"b": self.B, "k": self.L})
        return dict(TENSORS=tensors, BLOCK_M=self.block_m, BLOCK_N=self.block_n, P=self.P, L=self.L, H=self.H,
                    THREADS=self.threads, Q_TILES=math.ceil(self.L / self.block_m),
                    K_TILES=math.ceil(self.L / self.block_n), MMA="f16" if self.dtype == "float16" else "bf16",
                    SITE=DROPOUT_SITES["attention"], M_STRIDE_B=mask["b"], M_STRIDE_K=mask["k"])

    def scalars(self, args: OpArgs) -> tuple[float | int, ...]:
        """The scale 1/sqrt(P) and the attention dropout."""
        return (args.scale, *dropout_arguments(args, args.attention_dropout))

    def _bind(self, cubin: Cubin, device: int) -> BoundKernel:
        signature = ("pointer",) * len(self.layouts) + ("float32",) + DROPOUT_SIGNATURE
        main = self.packed(cubin, device, self.name, self.grid, self.threads, self.shared_bytes, signature)
        return BoundKernel(self.tensor_names, main, self.scalars)


def make(size: Size, dtype: str, layouts: Mapping[str, str], **knobs: int) -> AttentionParams:
    """The point at `size` for Q, K, V, M, Z in `layouts` (LSE in its fixed layout)."""
    return AttentionParams(op=OP, dtype=dtype, layouts=tuple({**layouts, "LSE": LSE_LAYOUT}.items()), B=size.B,
                           H=size.H, L=size.L, P=size.P, **knobs)


def variants(size: Size, dtype: str, layouts: Mapping[str, str], spec: DeviceSpec = H100) -> list[AttentionParams]:
    """The knob settings worth timing for one layout combination: 64 or 128 queries per block, 32 or 64 keys per
    tile, those that fit `spec`'s shared memory."""
    found = []
    for block_m, block_n in itertools.product((64, 128), (32, 64)):
        params = make(size, dtype, layouts, block_m=block_m, block_n=block_n)
        try:
            params.check(spec)
        except InfeasibleVariantError:
            continue
        found.append(params)
    return found


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
    where L takes several key tiles), all taking every tensor, the float32 workspace (D, then the fused partial
    dQ) and the same scalars. The workspace comes from PyTorch's caching allocator on every call, as a
    Reduction's does (see BoundKernel)."""

    def __init__(self, names: tuple[str, ...], launches: Sequence[PackedLaunch], scalars: Callable[[OpArgs], tuple],
                 workspace_shape: tuple[int, ...], device: int) -> None:
        super().__init__(names, launches[0], scalars)
        self.launches, self.workspace_shape, self.device = tuple(launches), workspace_shape, torch.device("cuda", device)

    def __call__(self, pointers: Sequence[int], args: OpArgs, stream: int,
                 workspace: torch.Tensor | None = None) -> None:
        if args is not self._last_args:
            self._last_scalars, self._last_args = self.scalars(args), args
        if workspace is None:
            workspace = torch.empty(self.workspace_shape, dtype=torch.float32, device=self.device)
        values = (*pointers, workspace.data_ptr(), *self._last_scalars)
        for launch in self.launches:
            launch(stream, *values)


@dataclass(frozen=True)
class AttentionBackwardParams(KernelParams):
    """The fused attention backward: dQ, dK, dV from Q, K, V, M, Z, dZ and the forward's LSE.

    A block of either kernel owns `block_m` rows (queries in `_dq`, keys in `_dkdv`; 16 per warp) and walks the
    other dim in tiles of `block_n`. Both products of a step stay in registers, so the per-thread accumulators
    (the P/2 + P/2 of dQ's or dK's and dV's, plus block_n/2 + block_n/2 of S and dP) grow with P + block_n.
    `fuse_dq` computes dQ in `_dkdv` instead (one S, dP and dropout mask fewer, float32 partials through memory
    where L takes several key tiles)."""

    B: int = 1
    H: int = 1
    L: int = 1
    P: int = 64
    block_m: int = 64
    block_n: int = 64
    fuse_dq: int = 0  # 1: dQ from _dkdv's dS (float32 partials per key tile, summed in order), no _dq

    template = "attention_bwd.cu.j2"

    def size_fields(self) -> tuple[str, ...]:
        return ("B", "H", "L", "P")

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "h": self.H, "j": self.L, "k": self.L, "p": self.P}

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 32

    @functools.cached_property
    def shared_bytes(self) -> int:
        """The larger kernel's: two row tiles (Q, dZ or K, V) and two stages of two column tiles, plus `_dkdv`'s
        two stages of LSE and D (and, fused, its dSᵀ tile)."""
        ds = self.block_m * (self.block_n + 8) * ITEMSIZE[self.dtype] if self.fuse_dq else 0
        return (2 * self.block_m + 4 * self.block_n) * self.P * ITEMSIZE[self.dtype] + 4 * self.block_n * 4 + ds

    @property
    def row_tiles(self) -> int:
        return math.ceil(self.L / self.block_m)

    @property
    def d_floats(self) -> int:
        """The workspace's D: B·H·L floats, rounded up to 64 (the partial dQ after it stays 256-byte aligned)."""
        return math.ceil(self.B * self.H * self.L / 64) * 64

    def launch_shapes(self) -> list[tuple[str, int, int]]:
        """(kernel suffix, grid, threads) of every launch, in order."""
        rows = math.ceil(self.B * self.H * self.L * self.P // 8 / 256)  # _d and _dqsum: 8 elements a thread
        if not self.fuse_dq:
            return [("dq", self.grid, self.threads), ("dkdv", self.grid, self.threads)]
        return [("d", rows, 256), ("dkdv", self.grid, self.threads)] + [("dqsum", rows, 256)] * (self.row_tiles > 1)

    @functools.cached_property
    def grid(self) -> int:
        return self.B * self.H * math.ceil(self.L / self.block_m)

    def workspace_shape(self) -> tuple[int, ...]:
        """Flat float32: D = rowsum(dZ∘Z) (bhj), then, fused over several key tiles, the partial dQ (key tile, b, h,
        j, p)."""
        partials = self.row_tiles * self.B * self.H * self.L * self.P if self.fuse_dq and self.row_tiles > 1 else 0
        return (self.d_floats + partials,)

    def check(self, spec: DeviceSpec = H100) -> None:
        if self.dtype not in DTYPES:
            raise InfeasibleVariantError(f"{self.op}: dtype {self.dtype!r} has no tensor-core kernel; expected one of "
                                         f"{list(DTYPES)}")
        check_layouts(self, BWD_OP, BWD_INPUTS + BWD_OUTPUTS)
        if self.P not in HEAD_SIZES:
            raise InfeasibleVariantError(f"{self.op}: head size P={self.P} must be one of {list(HEAD_SIZES)} (mma "
                                         f"k-steps of 32)")
        if self.block_m not in (64, 128):
            raise InfeasibleVariantError(f"{self.op}: block_m={self.block_m} must be 64 or 128 (16 rows per warp)")
        if self.block_n not in (32, 64):
            raise InfeasibleVariantError(f"{self.op}: block_n={self.block_n} must be 32 or 64 (A operands of 16, "
                                         f"S and dP in registers)")
        if self.block_m > 4 * self.block_n:
            raise InfeasibleVariantError(f"{self.op}: block_m={self.block_m} must be at most 4·block_n={4 * self.block_n} "
                                         f"(_dq stages Z's tile in the K and V buffers)")
        if self.fuse_dq not in (0, 1):
            raise InfeasibleVariantError(f"{self.op}: fuse_dq={self.fuse_dq} must be 0 or 1")
        if self.P + self.block_n > BWD_REGISTERS:
            raise InfeasibleVariantError(f"{self.op}: P + block_n = {self.P + self.block_n} accumulator floats per "
                                         f"thread exceed {BWD_REGISTERS} (registers would spill)")
        self.check_shared_memory(spec)

    @functools.cached_property
    def candidate(self) -> Candidate:
        layouts = dict(self.layouts)
        return Candidate.make(BWD_OP, "backward", "kernel", {n: layouts[n] for n in BWD_INPUTS},
                              {n: layouts[n] for n in BWD_OUTPUTS}, self.options(), covers=BWD_COVERS)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        check_attention_tensors(self, tensors)

    def render_context(self) -> dict[str, object]:
        tensors = tile_tensors(self, ("Q", "K", "V", "Z", "dZ", "dQ", "dK", "dV"))
        mask = strides(dict(self.layouts)["M"], {"b": self.B, "k": self.L})
        return dict(TENSORS=tensors, T={t["name"]: t for t in tensors}, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    P=self.P, L=self.L, H=self.H, THREADS=self.threads, ROW_TILES=math.ceil(self.L / self.block_m),
                    COL_TILES=math.ceil(self.L / self.block_n), MMA="f16" if self.dtype == "float16" else "bf16",
                    SITE=DROPOUT_SITES["attention"], M_STRIDE_B=mask["b"], M_STRIDE_K=mask["k"], B=self.B,
                    FUSE_DQ=bool(self.fuse_dq), D_FLOATS=self.d_floats,
                    DQ_SLICE=self.P * (self.block_n // 16) // (self.block_m // 16))  # warps share the dQ tile

    def scalars(self, args: OpArgs) -> tuple[float | int, ...]:
        """The scale 1/sqrt(P) and the attention dropout (the forward's)."""
        return (args.scale, *dropout_arguments(args, args.attention_dropout))

    def _bind(self, cubin: Cubin, device: int) -> BoundBackward:
        signature = ("pointer",) * (len(self.layouts) + 1) + ("float32",) + DROPOUT_SIGNATURE
        launches = [self.packed(cubin, device, f"{self.name}_{part}", grid, threads,
                                self.shared_bytes if part in ("dq", "dkdv") else 0, signature)
                    for part, grid, threads in self.launch_shapes()]
        return BoundBackward(self.tensor_names, launches, self.scalars, self.workspace_shape(), device)


def make_backward(size: Size, dtype: str, layouts: Mapping[str, str], **knobs: int) -> AttentionBackwardParams:
    """The backward point at `size` for Q, K, V, M, Z, dZ, dQ, dK, dV in `layouts` (LSE in its fixed layout)."""
    given = {**layouts, "LSE": LSE_LAYOUT}
    return AttentionBackwardParams(op=BWD_OP, dtype=dtype,
                                   layouts=tuple((n, given[n]) for n in BWD_INPUTS + BWD_OUTPUTS if n in given),
                                   B=size.B, H=size.H, L=size.L, P=size.P, **knobs)


def backward_variants(size: Size, dtype: str, layouts: Mapping[str, str], spec: DeviceSpec = H100
                      ) -> list[AttentionBackwardParams]:
    """The knob settings worth timing: block_m 64 or 128 rows, block_n 32 or 64 columns, dQ fused or not, pruned
    by the rules of `check`: S, dP and the P-wide accumulators fit 160 floats per thread (P + block_n <= 160: at
    P = 128 only block_n = 32), block_m <= 4·block_n, and `spec`'s shared memory."""
    found = []
    for block_m, block_n, fuse_dq in itertools.product((64, 128), (32, 64), (0, 1)):
        params = make_backward(size, dtype, layouts, block_m=block_m, block_n=block_n, fuse_dq=fuse_dq)
        try:
            params.check(spec)
        except InfeasibleVariantError:
            continue
        found.append(params)
    return found


def reference_backward(args: OpArgs, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, M: torch.Tensor,
                       dZ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ: bhjp, dK, dV: bhkp by autograd through `reference` (the same dropout mask) from logical Q: bhjp, K, V:
    bhkp, M: bk and dZ: bjhp, in the inputs' dtype."""
    leaves = [x.detach().requires_grad_() for x in (Q, K, V)]
    with torch.enable_grad():
        Z, _ = reference(args, *leaves, M)
        dQ, dK, dV = torch.autograd.grad(Z, leaves, dZ)
    return dQ, dK, dV
