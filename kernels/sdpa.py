"""PyTorch's scaled-dot-product attention (flash, cuDNN, memory-efficient), and flash-attn-4 where it is installed,
as one candidate of the attention subgraph.

One `SdpaAttention` covers the whole attention subgraph in each pass:
- forward row  `attn_scores/fwd sdpa_<backend>`: covers attn_scores, softmax, attn_context;
  Q, K, V (, M) -> Z; S, Pr and A are never materialized;
- backward row `attn_context_dgrad_a/bwd sdpa_<backend>`: covers attn_context_dgrad_a, attn_context_dgrad_v,
  softmax_bwd, attn_scores_dgrad_q, attn_scores_dgrad_k; dZ, Q, K, V, Z (, M) -> dQ, dK, dV; dA and dS are
  never materialized.
The rows have the shape of `config_selection/synthetic.py`'s SDPA rows; options are
`{"backend": <backend>, "mask": <bool>}`, the same in both passes.

**The pair.** The backward needs the forward's logsumexp and the state of the backend's dropout RNG, in the
backend's own format: a forward row of backend X must be followed by the backward row of backend X (and the
same mask option), which the optimizer enforces (`config_selection/problem.py`, couplings).

**The mask.** M is the [B, L] 0/1 padding mask (layout `bk`, the layer's dtype; 1 keeps a key). The
memory-efficient and cuDNN backends add it as an additive bias: log(M) (0 or -inf, one tiny kernel per
forward, timed with it) in a [B, L] buffer padded to a multiple of 16 keys, handed to SDPA as a stride-0
[B, H, L, L] view (no [B, H, L, L] tensor); the backward reuses it from the state. PyTorch's flash
attention takes no mask: its rows have `"mask": false`, name no M, and are valid only for a layer called
without padding (every mask all ones). The optimizer leaves them out unless told so
(`substation optimize --no-padding-mask`), and `SdpaAttention.forward` of an unmasked row refuses a mask.

**Layouts.** Our tensors are contiguous in their layout (row-major in the letter order); SDPA gets the
strided [B, H, L, P] view. Every backend needs the head-size letter p innermost (flash: "Input tensor must
have contiguous last dimension", the others alike), so each of Q, K, V, Z, dZ may take any of the 6 orders of
its other three letters with p last (`accepted_layouts`). What comes out (observed on the H100, PyTorch 2.11,
with the CUDA kernels each call launches listed by torch.profiler):
- flash: Z in Q's layout (`empty_like` of Q's [B, L, H, P] view), dQ, dK, dV in the layouts of Q, K, V;
- cuDNN: Z in Q's layout (`alloc_with_matching_layout`), dQ, dK, dV in the layouts of Q, K, V; dZ is read
  in any accepted layout without a copy;
- memory-efficient: Z always `bjhp` (the kernel writes [B, M, H, K]); dQ, dK, dV always `bjhp`, `bkhp`,
  `bkhp` (contiguous [B, L, H, P] buffers, whatever the operands' strides; were K and V views of one
  buffer, PyTorch would write dK and dV interleaved: the runtime allocates them apart);
- flash and memory-efficient copy dZ into Z's layout first (one `direct_copy` kernel) when dZ has another
  layout: such backward rows read dZ in the layout they name, and their time includes that copy;
- the forward of a masked backend launches one more small kernel, log(M) into the bias buffer (timed).
No other copy is launched (`tests/kernels/test_sdpa.py::test_no_hidden_copies`). `SdpaAttention.forward` and
`backward` check the produced strides (host side, no sync) and raise if a backend ever writes another layout
than its row names; the profiler then records the layout it really wrote.

The profiler times Q, K, V in the p-innermost layouts the kernel profiler lets qkv_bias write (`space.choices`,
the GEMM-readable ones: bhjp, hbjp, jbhp, jhbp), Z and dZ in the p-innermost layouts out_proj's GEMMs can read
or write; all (Q, K, V) combinations forward; backward with dZ in Z's layout for every combination, plus
every other dZ layout where Q, K and V share one layout (the full product would be 5x larger).

**flash-attn-4** (backend `fa4`, impl `flash_attn_cute`; `pip install flash-attn-4`): the CuTe DSL FlashAttention
with Hopper (wgmma, TMA) and Blackwell kernels, called through its functional forward and backward with our
buffers: Z, dQ, dK, dV are written in the layouts of Q, K, V (p innermost; FA4 takes any 16-byte aligned strides),
dZ is read in its own; its logsumexp is the backward's state. It has **no dropout and no padding mask**: its rows
are profiled only at dropout 0 (`substation profile --dropout 0`), and its forward refuses p > 0. Its backward runs
with `deterministic=True` (dQ summed in a fixed order), as our own attention's does.

**Dropout.** SDPA's dropout draws from PyTorch's CUDA generator (Philox, seeded by torch.manual_seed,
offset advanced per call), not from Substation's counter stream (`substation/dropout.py`): its masks differ
from the reference's and from the fused kernels', and `OpArgs.seed/offset` are ignored. Forward and backward
agree: the forward returns the RNG seed/offset it used (in `SdpaState`), the backward regenerates the same
mask from them. Under CUDA-graph capture PyTorch's generator registers the graph (graph-safe philox: the
seed and offset live in device memory and advance per replay), so capture works and each replay draws a
fresh mask, forward and backward of one replay agreeing (tested).
"""
from __future__ import annotations

import importlib.util
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from substation.errors import InputError, LayoutError
from substation.graph import LayerGraph, Operator
from substation.kernels.gpu_check import random_input
from substation.layouts import Configuration, logical, permutation, stored
from substation.protocol import COMPILED_DTYPES, Choice, Env, Implementation, Infeasible, Step, StepContext
from substation.records import Candidate
from substation.reference import OpArgs, softmax
from substation.sizes import Size
from substation.tc_profiling.mapping import gemm_layouts
from substation.sizes import TORCH_DTYPES
from substation.accuracy import relative_error

SDPA_BACKENDS = ("flash", "efficient", "cudnn")  # PyTorch's, in every CUDA build
BACKENDS = (*SDPA_BACKENDS, "fa4")
IMPLS = {backend: f"sdpa_{backend}" for backend in SDPA_BACKENDS} | {"fa4": "flash_attn_cute"}
MASKED = {"flash": False, "efficient": True, "cudnn": True, "fa4": False}  # whether the backend takes the padding mask
HAS_DROPOUT = {"flash": True, "efficient": True, "cudnn": True, "fa4": False}
FORWARD_COVERS = ("attn_scores", "softmax", "attn_context")
BACKWARD_COVERS = ("attn_context_dgrad_a", "attn_context_dgrad_v", "softmax_bwd", "attn_scores_dgrad_q",
                   "attn_scores_dgrad_k")
LOGICAL = "bhjp"  # SDPA's [B, H, L, P] order, in Q's letters (K and V: "bhkp", Z: "bhjp" too)
EFFICIENT_Z = "bjhp"
BIAS_ALIGN = 16  # keys per mask-bias row: 16-byte aligned rows for the memory-efficient kernel


def installed(backend: str) -> bool:
    """Whether the backend's library is importable here (PyTorch's always are). Finding `flash_attn.cute` imports
    its parent: FA4's wheel ships `flash_attn` as a namespace package (nothing runs); where flash-attn 2 owns it,
    FA2's import runs, and its failure means no FA4 here."""
    if backend in SDPA_BACKENDS:
        return True
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # flash-attn 2's package whose import fails here
        return False


def runs_at(backend: str, dropout: float) -> bool:
    """Whether the backend has a kernel for this attention dropout and its library is installed."""
    return (HAS_DROPOUT[backend] or dropout == 0) and installed(backend)


def accepted_layouts(dims: str) -> list[str]:
    """Every layout of a [B, H, L, P]-like tensor a backend reads without a copy: p (the last letter) innermost."""
    inner = dims[-1]
    return ["".join(order) + inner for order in itertools.permutations(dims[:-1])]


def z_layout(backend: str, q: str) -> str:
    """The layout of Z the backend writes, given Q's layout (Q's letters and Z's are the same)."""
    return EFFICIENT_Z if backend == "efficient" else q


def backward_copies(backend: str, z: str, dz: str) -> int:
    """How many copy kernels the backend's backward launches first (included in the row's time): flash and
    memory-efficient copy each of Z and dZ not laid out as [B, L, H, P] (`bjhp`); cuDNN copies nothing."""
    return 0 if backend in ("cudnn", "fa4") else (z != EFFICIENT_Z) + (dz != EFFICIENT_Z)


def grad_layouts(backend: str, q: str, k: str, v: str) -> tuple[str, str, str]:
    """The layouts of dQ, dK, dV the backend's backward writes, given those of Q, K, V."""
    if backend == "efficient":  # contiguous [B, L, H, P] buffers, whatever Q, K, V's strides
        return EFFICIENT_Z, EFFICIENT_Z.replace("j", "k"), EFFICIENT_Z.replace("j", "k")
    return q, k, v  # flash: empty_like of the operands; cuDNN: likewise


def _key_letters(q_layout: str) -> str:
    return q_layout.replace("j", "k")


@dataclass(frozen=True)
class SdpaState:
    """What the backward needs from its forward: logsumexp, the dropout RNG state, the mask bias, extras."""

    logsumexp: Any
    philox_seed: Any
    philox_offset: Any
    bias: Any  # the stride-0 [B, H, L, L] view of log(M), or None
    dropout_p: float
    extras: tuple = ()  # flash/cuDNN: cum_seq_q, cum_seq_k, max_q, max_k


@dataclass(frozen=True)
class SdpaAttention:
    """One candidate of a library attention (an SDPA backend, or flash-attn-4): backend, dtype and sizes, and the
    layout of every tensor of both rows.

    `q`, `k`, `v`: layouts of Q (letters bhjp) and K, V (bhkp); `dz`: dZ's (bjhp; default Z's). What the
    backend writes, Z and dQ, dK, dV, is decided by the backend (`z_layout`, `grad_layouts`); the profiler
    passes `produced` only where a backend was seen to write other layouts than these rules say.
    """

    backend: str
    size: Size
    q: str = "bhjp"
    k: str = "bhkp"
    v: str = "bhkp"
    dz: str = ""  # default: Z's layout
    produced: tuple[tuple[str, str], ...] = ()  # (tensor, layout) overrides of the rules, as observed
    z: str = field(default="", init=False)
    dq: str = field(default="", init=False)
    dk: str = field(default="", init=False)
    dv: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}, expected one of {', '.join(BACKENDS)}")
        seen = dict(self.produced)
        rules = dict(zip(("dQ", "dK", "dV"), grad_layouts(self.backend, self.q, self.k, self.v)))
        rules["Z"] = z_layout(self.backend, self.q)
        for name, field_name in (("Z", "z"), ("dQ", "dq"), ("dK", "dk"), ("dV", "dv")):
            object.__setattr__(self, field_name, seen.get(name, rules[name]))
        if not self.dz:
            object.__setattr__(self, "dz", self.z)
        self.check()

    @property
    def masked(self) -> bool:
        return MASKED[self.backend]

    @property
    def impl(self) -> str:
        return IMPLS[self.backend]

    @property
    def dtype(self) -> str:
        return self.size.dtype

    @property
    def options(self) -> dict[str, object]:
        return {"backend": self.backend, "mask": self.masked}

    def check(self) -> None:
        """LayoutError naming the rule a layout breaks; ValueError for an unknown backend."""
        for name, layout, dims in (("Q", self.q, "bhjp"), ("K", self.k, "bhkp"), ("V", self.v, "bhkp"),
                                   ("dZ", self.dz, "bjhp"), ("Z", self.z, "bjhp"), ("dQ", self.dq, "bhjp"),
                                   ("dK", self.dk, "bhkp"), ("dV", self.dv, "bhkp")):
            if sorted(layout) != sorted(dims) or layout[-1] != "p":
                raise LayoutError(f"{self.impl}: {name} layout {layout!r} must be an order of {dims!r} "
                                  f"with p innermost (the library reads the head dim contiguously, else it copies)")
        if self.backend == "cudnn" and self.dz != self.z:
            # Observed on the H100 (PyTorch 2.11): cuDNN's backward takes dZ's strides without a copy and
            # returns wrong gradients (relative error ~1.5) unless dZ is laid out like Z.
            raise LayoutError(f"sdpa_cudnn: dZ layout {self.dz!r} must be Z's {self.z!r} (cuDNN's backward "
                              "computes wrong gradients from a dZ with other strides)")

    # -- rows -------------------------------------------------------------------------------------------

    def forward_candidate(self) -> Candidate:
        inputs = {"Q": self.q, "K": self.k, "V": self.v} | ({"M": "bk"} if self.masked else {})
        return Candidate.make("attn_scores", "forward", IMPLS[self.backend], inputs, {"Z": self.z}, self.options,
                              covers=FORWARD_COVERS)

    def backward_candidate(self) -> Candidate:
        inputs = {"dZ": self.dz, "Q": self.q, "K": self.k, "V": self.v, "Z": self.z} | (
            {"M": "bk"} if self.masked else {})
        outputs = {"dQ": self.dq, "dK": self.dk, "dV": self.dv}
        return Candidate.make("attn_context_dgrad_a", "backward", IMPLS[self.backend], inputs, outputs,
                              self.options, covers=BACKWARD_COVERS)

    @property
    def label(self) -> str:
        return self.forward_candidate().label

    # -- runtime ----------------------------------------------------------------------------------------

    def _view(self, x, layout: str, name: str):
        """The [B, H, L, P] view of a tensor stored contiguously in `layout` (checked: no copy is hidden)."""
        _check_stored(x, layout, name, self.size)
        return logical(x, layout, LOGICAL if name in ("Q", "Z", "dZ", "dQ") else "bhkp")

    def _stored(self, x, layout: str, name: str, meta: bool = False):
        """A [B, H, L, P] result as the tensor stored in `layout`; LayoutError if the backend wrote another.
        `meta`: x is a fake tensor, whose strides need not be the kernel's: the result is allocated."""
        dims = LOGICAL if name in ("Z", "dQ") else "bhkp"
        in_layout = x.permute(permutation(dims, layout))
        if meta:
            return in_layout.new_empty(in_layout.shape)
        if not in_layout.is_contiguous():
            actual = "".join(sorted(dims, key=lambda d: -x.stride(dims.index(d))))
            error = LayoutError(f"{self.impl} wrote {name} with strides {tuple(x.stride())} for shape "
                                f"{tuple(x.shape)} ([B, H, L, P]), i.e. in layout {actual!r}, not in layout "
                                f"{layout!r} as its row names")
            error.produced = (name, actual)  # type: ignore[attr-defined]
            raise error
        return in_layout

    def mask_bias(self, M):
        """log(M) as a stride-0 [B, H, L, L] view of a [B, L] buffer padded to 16 keys (0 keep, -inf pad)."""
        B, L, H = self.size.B, self.size.L, self.size.H
        if M.dim() != 2 or tuple(M.shape) != (B, L):
            raise InputError(f"{self.impl}: mask M must have shape ({B}, {L}) (layout bk), "
                             f"got {tuple(M.shape)}")
        padded = torch.empty((B, -(-L // BIAS_ALIGN) * BIAS_ALIGN), dtype=M.dtype, device=M.device)
        bias = padded[:, :L]
        torch.log(M, out=bias)  # 1 -> 0, 0 -> -inf, as the reference's masked_fill(-inf)
        return bias[:, None, None, :].expand(B, H, L, L)

    def forward(self, Q, K, V, M, args, meta: bool = False) -> tuple[Any, SdpaState]:
        """Z (in layout `z`) and the state the backward needs. `args` is a `substation.reference.OpArgs`:
        scale and attention_dropout are used; seed/offset are not (SDPA draws from torch's generator).
        `meta`: on fake tensors, for shapes only."""
        aten = torch.ops.aten
        q, k, v = self._view(Q, self.q, "Q"), self._view(K, self.k, "K"), self._view(V, self.v, "V")
        p = float(args.attention_dropout)
        if not self.masked and M is not None:
            raise InputError(f"{self.impl} takes no padding mask: its rows are valid only for a layer "
                             f"called without one (pass M=None)")
        bias = self.mask_bias(M) if self.masked else None
        if self.backend == "fa4":
            return self._fa4_forward(Q, q, k, v, p, args.scale, meta)
        if self.backend == "flash":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, p, False, False, scale=args.scale)
            state = SdpaState(lse, seed, offset, None, p, (cum_q, cum_k, max_q, max_k))
        elif self.backend == "efficient":
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, p, False, scale=args.scale)
            state = SdpaState(lse, seed, offset, bias, p)
        else:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, p, False, False, scale=args.scale)
            state = SdpaState(lse, seed, offset, bias, p, (cum_q, cum_k, max_q, max_k))
        return self._stored(out, self.z, "Z", meta), state

    def backward(self, dZ, Q, K, V, Z, M, state: SdpaState, args) -> tuple[Any, Any, Any]:
        """dQ, dK, dV in the layouts of Q, K, V, from the forward's state (same dropout mask)."""
        aten = torch.ops.aten
        if float(args.attention_dropout) != state.dropout_p:
            raise InputError(f"{self.impl}: backward with attention_dropout={args.attention_dropout}, "
                             f"but its forward ran with {state.dropout_p}")
        q, k, v = self._view(Q, self.q, "Q"), self._view(K, self.k, "K"), self._view(V, self.v, "V")
        z, dz = self._view(Z, self.z, "Z"), self._view(dZ, self.dz, "dZ")
        p = state.dropout_p
        if self.backend == "fa4":
            return self._fa4_backward(Q, q, k, v, z, dz, state, args.scale)
        if self.backend == "flash":
            cum_q, cum_k, max_q, max_k = state.extras
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dz, q, k, v, z, state.logsumexp, cum_q, cum_k, max_q, max_k, p, False, state.philox_seed,
                state.philox_offset, scale=args.scale)
        elif self.backend == "efficient":
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                dz, q, k, v, state.bias, z, state.logsumexp, state.philox_seed, state.philox_offset, p,
                [True, True, True, False], False, scale=args.scale)
        else:
            cum_q, cum_k, max_q, max_k = state.extras
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                dz, q, k, v, z, state.logsumexp, state.philox_seed, state.philox_offset, state.bias, cum_q, cum_k,
                max_q, max_k, p, False, scale=args.scale)
        return self._stored(dq, self.dq, "dQ"), self._stored(dk, self.dk, "dK"), self._stored(dv, self.dv, "dV")


    def _allocated(self, like, name: str, layout: str):
        """An empty tensor stored contiguously in `layout`, and its [B, H, L, P] view (the library writes it)."""
        empty = like.new_empty([self.size.extents[d] for d in layout])
        return empty, logical(empty, layout, LOGICAL if name in ("Z", "dQ") else "bhkp")

    def _fa4_forward(self, Q, q, k, v, p: float, scale: float, meta: bool) -> tuple[Any, SdpaState]:
        """FA4's forward into Z (Q's layout) and a float32 [B, H, L] logsumexp; its views are [B, L, H, P]."""
        if p:
            raise InputError(f"{self.impl} (flash-attn-4) has no dropout: its rows hold for attention_dropout 0 "
                             f"only, got {p}")
        z, z_view = self._allocated(Q, "Z", self.z)
        lse = Q.new_empty((self.size.B, self.size.H, self.size.L), dtype=torch.float32)
        if not meta:
            from flash_attn.cute.interface import _flash_attn_fwd

            _flash_attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                            return_lse=True, out=z_view.transpose(1, 2), lse=lse)
        return z, SdpaState(lse, None, None, None, 0.0)

    def _fa4_backward(self, Q, q, k, v, z, dz, state: SdpaState, scale: float) -> tuple[Any, Any, Any]:
        """FA4's deterministic backward into dQ, dK, dV in the layouts of Q, K, V."""
        from flash_attn.cute.interface import _flash_attn_bwd

        (dq, dq_view), (dk, dk_view), (dv, dv_view) = (self._allocated(Q, name, layout) for name, layout in
                                                       (("dQ", self.dq), ("dK", self.dk), ("dV", self.dv)))
        _flash_attn_bwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), z.transpose(1, 2),
                        dz.transpose(1, 2), state.logsumexp, scale, False, deterministic=True,
                        dq=dq_view.transpose(1, 2), dk=dk_view.transpose(1, 2), dv=dv_view.transpose(1, 2))
        return dq, dk, dv


def _check_stored(x, layout: str, name: str, size: Size) -> None:
    want = tuple(size.extents[d] for d in layout)
    if tuple(x.shape) != want or not x.is_contiguous():
        raise InputError(f"{name} must be a contiguous tensor of shape {want} (layout {layout!r}), got shape "
                         f"{tuple(x.shape)} with strides {tuple(x.stride())}")


# -- what the profiler times -----------------------------------------------------------------------------

def profiled_layouts(tensor: str, size: Size) -> list[str]:
    """The p-innermost layouts of `tensor` in which the GEMMs around the attention can read or write it."""
    return [lay for lay in gemm_layouts(size.with_dtype("float16"))[tensor] if lay[-1] == "p"]


def candidates(size: Size, backends: Sequence[str]) -> list[SdpaAttention]:
    """Every SDPA candidate the profiler times (see the module docstring for the rule), and where Q, K and V
    share any accepted layout (as qkv_bias writes them in one pass), also layouts no GEMM could read."""
    qs, ks, vs = (profiled_layouts(t, size) for t in ("Q", "K", "V"))
    shared = [(q, _key_letters(q), _key_letters(q)) for q in accepted_layouts(LOGICAL)]
    combos = list(itertools.product(qs, ks, vs)) + [c for c in shared if c[0] not in qs]
    dzs = profiled_layouts("dZ", size)
    found: list[SdpaAttention] = []
    for backend in backends:
        for q, k, v in combos:
            z = z_layout(backend, q)
            alike = _key_letters(q) == k == v
            for dz in dzs:
                if dz == z or (alike and backend != "cudnn"):
                    found.append(SdpaAttention(backend, size, q, k, v, dz))
    return found


def forward_candidates(attentions: Sequence[SdpaAttention]) -> list[SdpaAttention]:
    """One attention per distinct forward row (the forward does not depend on dZ's layout)."""
    seen: dict[str, SdpaAttention] = {}
    for att in attentions:
        seen.setdefault(att.forward_candidate().label, att)
    return list(seen.values())


def scale_of(size: Size) -> float:
    return 1 / math.sqrt(size.P)


# -- the GPU side: reference, checks and runners (the profiler's and the tests') --------------------------

def reference(q, k, v, m, dz, scale: float):
    """Z, dQ, dK, dV of attention without dropout on logical [B, H, L, P] tensors (any float dtype; m [B, L]
    0/1 or None), through `substation.reference.softmax` and autograd."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    mask = torch.ones(q.shape[0], k.shape[2], dtype=q.dtype, device=q.device) if m is None else m.to(q.dtype)
    probs, _ = softmax(OpArgs(scale=scale), q @ k.transpose(-1, -2), mask)
    z = probs @ v
    dq, dk, dv = torch.autograd.grad(z, (q, k, v), dz.to(z.dtype))
    return z.detach(), dq, dk, dv


@dataclass
class AttentionData:
    """Random logical inputs of one size and dtype, and the reference outputs with and without the mask."""

    size: Size
    q: Any
    k: Any
    v: Any
    dz: Any
    m: Any
    want: dict  # masked (bool) -> (Z, dQ, dK, dV), logical [B, H, L, P]

    @classmethod
    def make(cls, size: Size, seed: int = 0, reference_dtype: str = "float32") -> AttentionData:
        dtype, gen = TORCH_DTYPES[size.dtype], torch.Generator(device="cuda").manual_seed(seed)
        shape = (size.B, size.H, size.L, size.P)
        q, k, v, dz = (torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(4))
        m = random_input("M", "bk", size.extents, dtype, gen)
        ref = TORCH_DTYPES[reference_dtype]
        want = {masked: reference(q.to(ref), k.to(ref), v.to(ref), m if masked else None, dz.to(ref),
                                  scale_of(size)) for masked in (True, False)}
        return cls(size, q, k, v, dz, m, want)

    def inputs(self, att: SdpaAttention) -> dict[str, Any]:
        """Q, K, V, dZ in the attention's layouts and M (None for an unmasked backend)."""
        return {"Q": stored(self.q, LOGICAL, att.q), "K": stored(self.k, "bhkp", att.k),
                "V": stored(self.v, "bhkp", att.v), "dZ": stored(self.dz, LOGICAL, att.dz),
                "M": self.m if att.masked else None}

    def errors(self, att: SdpaAttention, Z, grads=None) -> dict[str, float]:
        """Max relative error of Z (and dQ, dK, dV) against the reference, per tensor."""
        want = self.want[att.masked]
        got = {"Z": (Z, att.z, LOGICAL)}
        if grads is not None:
            got |= {"dQ": (grads[0], att.dq, LOGICAL), "dK": (grads[1], att.dk, "bhkp"),
                    "dV": (grads[2], att.dv, "bhkp")}
        order = ("Z", "dQ", "dK", "dV")
        return {name: relative_error(logical(x, layout, dims), want[order.index(name)])
                for name, (x, layout, dims) in got.items()}


def op_args(size: Size, p: float):
    return OpArgs(scale=scale_of(size), attention_dropout=p, hidden_dropout=p)


def runners(att: SdpaAttention, data: AttentionData, p: float):
    """(forward error, backward error, forward work, backward work): errors with dropout off against the
    reference; the works run with dropout p on the same inputs (the backward from one forward's state)."""
    t = data.inputs(att)
    off = op_args(att.size, 0.0)
    Z, state = att.forward(t["Q"], t["K"], t["V"], t["M"], off)
    grads = att.backward(t["dZ"], t["Q"], t["K"], t["V"], Z, t["M"], state, off)
    errors = data.errors(att, Z, grads)
    on = op_args(att.size, p)
    Z, state = att.forward(t["Q"], t["K"], t["V"], t["M"], on)
    return (errors["Z"], max(errors[n] for n in ("dQ", "dK", "dV")),
            lambda: att.forward(t["Q"], t["K"], t["V"], t["M"], on),
            lambda: att.backward(t["dZ"], t["Q"], t["K"], t["V"], Z, t["M"], state, on))


def available_backends(dtype: str = "float16") -> list[str]:
    """PyTorch's SDPA backends that run a tiny masked/unmasked forward and backward on this GPU."""
    found = []
    for backend in SDPA_BACKENDS:
        try:
            size = Size.from_heads(B=1, L=64, H=1, P=64, U=64, dtype=dtype)
            data = AttentionData.make(size)
            runners(SdpaAttention(backend, size), data, 0.1)[3]()
            found.append(backend)
        except RuntimeError:
            pass
    return found


# -- the implementation: one per backend, each covering the attention subgraph of both passes --------------

# What an SDPA forward hands its backward, as tensors of the environment (so that a plan keeps only tensors
# between the passes). Outputs the backend leaves undefined (flash and cuDNN's cumulative sequence lengths of
# a dense batch) travel as empty placeholders.
STATE_TENSORS = ("attention_lse", "attention_seed", "attention_offset", "attention_cum_q", "attention_cum_k",
                 "attention_bias")


def _as_tensor(x, device: torch.device) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.empty(0, device=device)


def _as_state(x: torch.Tensor):
    return x if x.numel() else None


class AttentionStep(Step):
    """PyTorch's scaled-dot-product attention over the attention subgraph of one pass. The forward writes Z and
    the backend's state (STATE_TENSORS), which the backward reads; S, Pr, A, dA, dS are never materialized."""

    def __init__(self, ops: Sequence[Operator], choice: Choice, attention: SdpaAttention) -> None:
        super().__init__(ops, choice)
        self.attention = attention
        mask = ("M",) if attention.masked else ()
        if self.pass_ == "forward":
            self.inputs, self.outputs = ("Q", "K", "V", *mask), ("Z", *STATE_TENSORS)
        else:
            self.inputs, self.outputs = ("dZ", "Q", "K", "V", "Z", *mask, *STATE_TENSORS), ("dQ", "dK", "dV")

    def _forward(self, env: Env, ctx: StepContext, meta: bool) -> Env:
        mask = env["M"] if self.attention.masked else None
        z, state = self.attention.forward(env["Q"], env["K"], env["V"], mask, ctx.args, meta)
        bias = state.bias[:, 0, 0, :] if state.bias is not None else None  # the [B, L] row buffer, padded
        cum_q, cum_k = state.extras[:2] if state.extras else (None, None)
        values = (state.logsumexp, state.philox_seed, state.philox_offset, cum_q, cum_k, bias)
        return {"Z": z} | {name: _as_tensor(x, z.device) for name, x in zip(STATE_TENSORS, values)}

    def _state(self, env: Env, args: OpArgs) -> SdpaState:
        lse, seed, offset, cum_q, cum_k, bias = (env[name] for name in STATE_TENSORS)
        B, H, L = self.attention.size.B, self.attention.size.H, self.attention.size.L
        bias = bias[:, None, None, :].expand(B, H, L, L) if bias.numel() else None
        extras = (_as_state(cum_q), _as_state(cum_k), L, L) if self.attention.backend != "efficient" else ()
        return SdpaState(lse, seed, offset, bias, float(args.attention_dropout), extras)

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        if self.pass_ == "forward":
            return self._forward(env, ctx, meta=False)
        mask = env["M"] if self.attention.masked else None
        grads = self.attention.backward(env["dZ"], env["Q"], env["K"], env["V"], env["Z"], mask,
                                        self._state(env, ctx.args), ctx.args)
        return dict(zip(("dQ", "dK", "dV"), grads))

    def meta(self, env: Env, ctx: StepContext) -> Env:
        if self.pass_ == "forward":
            return self._forward(env, ctx, meta=True)
        att, extents = self.attention, self.attention.size.extents
        return {name: env["Q"].new_empty([extents[d] for d in layout])
                for name, layout in (("dQ", att.dq), ("dK", att.dk), ("dV", att.dv))}


class Sdpa(Implementation):
    """One SDPA backend over the attention subgraph: a forward row and a backward row, run as a pair."""

    coupled = True

    def __init__(self, backend: str) -> None:
        self.backend, self.impl = backend, IMPLS[backend]

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return FORWARD_COVERS, BACKWARD_COVERS

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        try:
            att = SdpaAttention(self.backend, size, layouts["Q"], layouts["K"], layouts["V"], layouts.get("dZ", ""))
        except LayoutError as err:
            yield Infeasible(self.impl, tuple(op.name for op in ops), str(err))
            return
        yield att.forward_candidate() if ops[0].pass_ == "forward" else att.backward_candidate()

    def attention(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size
                  ) -> SdpaAttention:
        """The attention of this choice in this configuration, checked: what the backend writes must be what the
        configuration stores."""
        if choice.options.get("backend") != self.backend:
            raise self.error(ops, f"with options {dict(choice.options)} names no SDPA backend, or another than "
                                  f"{self.backend!r}")
        pass_ = ops[0].pass_
        # The forward reads no dZ: with Z converted between the passes (a split variable), dZ's layout follows
        # the backward's Z, not the forward's.
        dz = config.layouts["dZ"] if pass_ == "backward" else ""
        try:
            att = SdpaAttention(self.backend, size, q=config.layout("Q", pass_), k=config.layout("K", pass_),
                                v=config.layout("V", pass_), dz=dz)
        except LayoutError as err:
            raise self.error(ops, str(err)) from None
        written = {"Z": att.z} if pass_ == "forward" else {"dQ": att.dq, "dK": att.dk, "dV": att.dv}
        for tensor, layout in written.items():
            if config.layouts[tensor] != layout:
                raise self.error(ops, f"writes {tensor} as {layout!r}, the configuration stores it as "
                                      f"{config.layouts[tensor]!r}")
        return att

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        self.attention(ops, choice, config, size)

    def deterministic(self, pass_: str, options: Mapping[str, object]) -> bool:
        """PyTorch's SDPA backwards add dQ up by float atomics unless torch.use_deterministic_algorithms(True) is on
        (then they take a slower path than the one profiled: ATen's attention_backward.cu, "defaults to a
        non-deterministic algorithm"); flash-attn-4 runs its deterministic backward."""
        return pass_ == "forward" or self.backend == "fa4"

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        if not installed(self.backend):
            raise self.error(ops, "needs flash-attn-4, which is not installed (pip install flash-attn-4)")
        return AttentionStep(ops, choice, self.attention(ops, choice, config, size.with_dtype(COMPILED_DTYPES[dtype])))


IMPLEMENTATIONS = tuple(Sdpa(backend) for backend in BACKENDS)
