"""Fused attention forward (attn_scores + softmax + attn_context in one kernel), FlashAttention-2 style, for any
layout of Q, K, V and Z.

    Q: bhjp, K: bhkp, V: bhkp, M: bk -> Z = dropout(softmax(scale·Q·Kᵀ, keys with M == 0 at -inf))·V: bjhp,
                                        LSE = logsumexp_k(scale·Q·Kᵀ masked): bhj (float32, for a backward)

A block owns `block_m` queries of one (b, h) (one warp per 16) and walks the keys in tiles of `block_n`: K and V
double-buffered in shared memory, S = Q·Kᵀ and Z += A·V on tensor cores (mma.sync m16n8k16, fp16 or bf16 operands,
fp32 accumulation), the online softmax in registers; S, Pr and A are never stored. The dropout mask is
Substation's Philox stream (site `attention`, element indexing of the logical [B, H, J, K] tensor, the device code
of `common.cuh.j2`), so it equals `substation.dropout.keep_mask` bit for bit and a backward can regenerate it.
Tensors with p innermost move in 16-byte accesses (cp.async loads), any other layout one element at a time.

Not yet an implementation of the registry (`substation/implementations.py`): no backward, no profile rows.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from substation.device import H100, DeviceSpec
from substation.graph import DROPOUT_SITES, layer_graph
from substation.jit import Cubin
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
ROW_LETTER = {"Q": "j", "K": "k", "V": "k", "Z": "j"}  # the dim a tensor's tile rows run along


def tensor_dims(name: str) -> str:
    """The logical dims of one of the kernel's tensors."""
    return LSE_LAYOUT if name == "LSE" else layer_graph().tensors[name].dims


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
        names = tuple(name for name, _ in self.layouts)
        if self.op != OP or names != INPUTS + OUTPUTS:
            raise InfeasibleVariantError(f"{self.op}: layouts are given for {names}, expected op {OP!r} with "
                                         f"{INPUTS + OUTPUTS}")
        for name, layout in self.layouts:
            dims = tensor_dims(name)
            if sorted(layout) != sorted(dims) or (name == "LSE" and layout != LSE_LAYOUT):
                raise InfeasibleVariantError(f"{self.op}: {name}:{layout} must be "
                                             f"{LSE_LAYOUT if name == 'LSE' else 'an order of ' + repr(dims)}")
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

    def check_alignment(self, tensors: Mapping) -> None:
        """Tensors with p innermost move in 16-byte accesses."""
        for name in ("Q", "K", "V", "Z"):
            address = tensors[name].data_ptr()
            if self.vector(name) and address % 16:
                raise ValueError(f"{self.op}: {name=} starts at {address:#x}; with p innermost its 16-byte accesses "
                                 f"need it aligned to 16 bytes")

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming the first tensor that is missing, misshapen, of another dtype (LSE is float32, the
        others the kernel's dtype), strided, misaligned or not on the first tensor's GPU."""
        device = tensors["Q"].device if "Q" in tensors else None
        for name, layout in self.layouts:
            if name not in tensors:
                raise ValueError(f"{self.op}: tensor {name!r} is missing; expected {list(self.tensor_names)}")
            t, shape = tensors[name], self.tensor_shape(layout)
            dtype = torch.float32 if name == "LSE" else getattr(torch, self.dtype)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device or not t.is_cuda:
                raise ValueError(f"{self.op}: {name=}, {t.shape=}, {t.dtype=}, contiguous={t.is_contiguous()}, "
                                 f"{t.device=}, expected a contiguous {dtype} CUDA tensor of shape {shape} (layout "
                                 f"{layout!r}) on Q's device {device}")
        self.check_alignment(tensors)

    def render_context(self) -> dict[str, object]:
        tensors = []
        for name in ("Q", "K", "V", "Z"):
            layout = dict(self.layouts)[name]
            st = strides(layout, self.extents)
            tensors.append(dict(name=name, stride_b=st["b"], stride_h=st["h"], stride_row=st[ROW_LETTER[name]],
                                stride_p=st["p"], vector=self.vector(name), rows_inner=layout[-1] == ROW_LETTER[name]))
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
