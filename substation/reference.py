"""The torch reference of every operator of the layer graph, under any layouts of its inputs and outputs.

A fused operator's math is written once, on *logical* tensors (canonical dims order); `run_operator`
permutes its inputs from their layouts into that order and its outputs into theirs. A contraction
needs no such step: its einsum is written directly over the layouts' letters. These functions are
the oracle of every GPU kernel and GEMM mapping, so they favour clarity over speed.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from substation.dropout import dropout
from substation.errors import GraphError, InputError
from substation.graph import DROPOUT_SITES, LayerGraph, Operator, layer_graph
from substation.layouts import Configuration, permutation

Tensor = torch.Tensor


@dataclass(frozen=True)
class OpArgs:
    """The non-tensor arguments of the fused operators. Dropout probabilities are 0 in eval mode."""

    scale: float  # 1/sqrt(P), applied to the attention scores
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    seed: int = 0
    offset: int = 0
    # PyTorch's own dropout (its generator, not Substation's Philox stream): only to time what PyTorch
    # pays for the same operator; forward and backward then draw different masks.
    native_dropout: bool = False
    # (seed, offset) as an int64 [2] CUDA tensor: what the GPU kernels read (device memory, so that a CUDA
    # graph's replays can advance the offset); None on the reference path, which uses seed and offset.
    rng: Tensor | None = None

    def with_device_rng(self, device: torch.device | str) -> OpArgs:
        """These arguments with `rng` holding (seed, offset) on `device` (one host-to-device copy: not
        during CUDA-graph capture)."""
        state = torch.tensor([self.seed, self.offset], dtype=torch.uint64).view(torch.int64)
        return dataclasses.replace(self, rng=state.to(device))

    def rng_pointer(self, p: float) -> int:
        """The device address of `rng` for a kernel with dropout probability p (0: no dropout, no state)."""
        if p == 0:
            return 0
        if self.rng is None or not self.rng.is_cuda or self.rng.dtype != torch.int64 or self.rng.numel() != 2:
            raise ValueError("dropout on the GPU reads (seed, offset) from device memory: pass "
                             "OpArgs(...).with_device_rng('cuda') (an int64 [2] CUDA tensor in `rng`)")
        return self.rng.data_ptr()

    def drop(self, x: Tensor, site: str) -> Tensor:
        """Inverted dropout of a logical tensor; the same call in the backward regenerates the same mask."""
        p = self.attention_dropout if site == "attention" else self.hidden_dropout
        if p == 0:
            return x
        if self.native_dropout:
            return torch.nn.functional.dropout(x, p)
        return dropout(x, p, self.seed, self.offset, DROPOUT_SITES[site])


def qkv_bias(a: OpArgs, QKV: Tensor, bqkv: Tensor) -> tuple[Tensor, ...]:
    biased = QKV + bqkv  # bjthp + thp
    return tuple(biased[:, :, t].permute(0, 2, 1, 3) for t in range(3))  # bjhp -> bhjp


def softmax(a: OpArgs, S: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    # -inf gives padded keys exactly zero weight, as HF's additive finfo.min does.
    logits = (S * a.scale).masked_fill(M[:, None, None, :] == 0, -math.inf)
    Pr = torch.softmax(logits, dim=-1)
    return Pr, a.drop(Pr, "attention")


def _layer_norm(a: OpArgs, x: Tensor, bias: Tensor, residual: Tensor, gamma: Tensor, beta: Tensor,
                site: str) -> tuple[Tensor, Tensor, Tensor]:
    r = a.drop(x + bias, site) + residual
    mean = r.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((r - mean).square().mean(dim=-1, keepdim=True) + a.layer_norm_eps)
    normalized = (r - mean) * rstd
    return normalized * gamma + beta, normalized, rstd.squeeze(-1)


def ln1(a: OpArgs, O: Tensor, bo: Tensor, X: Tensor, g1: Tensor, be1: Tensor) -> tuple[Tensor, ...]:
    return _layer_norm(a, O, bo, X, g1, be1, "attention_output")


def ln2(a: OpArgs, G: Tensor, b2: Tensor, X1: Tensor, g2: Tensor, be2: Tensor) -> tuple[Tensor, ...]:
    return _layer_norm(a, G, b2, X1, g2, be2, "ffn_output")


def bias_gelu(a: OpArgs, F: Tensor, b1: Tensor) -> tuple[Tensor]:
    return (torch.nn.functional.gelu(F + b1),)  # the exact erf GELU, HF's "gelu"


def _layer_norm_bwd(a: OpArgs, dout: Tensor, normalized: Tensor, rstd: Tensor, gamma: Tensor,
                    site: str) -> tuple[Tensor, ...]:
    reduce_bj = (0, 1)
    dgamma = (dout * normalized).sum(reduce_bj)
    dbeta = dout.sum(reduce_bj)
    dn = dout * gamma
    dr = rstd[..., None] * (dn - dn.mean(-1, keepdim=True)
                            - normalized * (dn * normalized).mean(-1, keepdim=True))
    dbiased = a.drop(dr, site)  # dropout's backward applies the forward's scaled mask
    return dr, dbiased, dgamma, dbeta, dbiased.sum(reduce_bj)


def ln2_bwd(a: OpArgs, dY: Tensor, N2: Tensor, Rs2: Tensor, g2: Tensor) -> tuple[Tensor, ...]:
    return _layer_norm_bwd(a, dY, N2, Rs2, g2, "ffn_output")


def ln1_bwd(a: OpArgs, dX1f: Tensor, dR2: Tensor, N1: Tensor, Rs1: Tensor, g1: Tensor) -> tuple[Tensor, ...]:
    return _layer_norm_bwd(a, dX1f + dR2, N1, Rs1, g1, "attention_output")


def gelu_slope(x: Tensor) -> Tensor:
    """GELU_erf'(x) = Phi(x) + x·phi(x)."""
    cdf = 0.5 * (1 + torch.erf(x * math.sqrt(0.5)))
    return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def bias_gelu_bwd(a: OpArgs, dH1: Tensor, F: Tensor, b1: Tensor) -> tuple[Tensor, Tensor]:
    dF = dH1 * gelu_slope(F + b1)
    return dF, dF.sum((0, 1))


def softmax_bwd(a: OpArgs, dA: Tensor, Pr: Tensor) -> tuple[Tensor]:
    dPr = a.drop(dA, "attention")
    return (Pr * (dPr - (dPr * Pr).sum(-1, keepdim=True)) * a.scale,)


def qkv_bias_bwd(a: OpArgs, dQ: Tensor, dK: Tensor, dV: Tensor) -> tuple[Tensor, Tensor]:
    dQKV = torch.stack([g.permute(0, 2, 1, 3) for g in (dQ, dK, dV)], dim=2)  # bhjp -> bjthp
    return dQKV, dQKV.sum((0, 1))


def residual_bwd(a: OpArgs, dXa: Tensor, dR1: Tensor) -> tuple[Tensor]:
    return (dXa + dR1,)


FUSED: dict[str, Callable[..., tuple[Tensor, ...]]] = {
    f.__name__: f for f in (qkv_bias, softmax, ln1, bias_gelu, ln2, ln2_bwd, bias_gelu_bwd, ln1_bwd,
                            softmax_bwd, qkv_bias_bwd, residual_bwd)
}


def cover_reference(ops: Sequence[Operator], inputs: Mapping[str, Tensor], layouts: Mapping[str, str], args: OpArgs,
                    graph: LayerGraph | None = None) -> dict[str, Tensor]:
    """Several operators in turn, in float64, on inputs stored in `layouts`: every tensor they read or write, in the
    graph's canonical layouts (what an implementation of a multi-operator cover is checked against)."""
    graph = graph or layer_graph()
    env = {t: x.double().permute(permutation(layouts[t], graph.tensors[t].dims)) for t, x in inputs.items()}
    for op in ops:
        if op.is_contraction:
            env[op.outputs[0]] = torch.einsum(op.einsum, *(env[t] for t in op.inputs))
        else:
            env.update(zip(op.outputs, FUSED[op.name](args, *(env[t] for t in op.inputs))))
    return env


def check_shape(op: str, tensor: str, value: Tensor, layout: str, extents: Mapping[str, int]) -> None:
    want = tuple(extents[d] for d in layout)
    if tuple(value.shape) != want:
        raise InputError(f"{op}: tensor {tensor!r} in layout {layout!r} must have shape {want}, "
                         f"got {tuple(value.shape)}")


def run_operator(op: Operator, inputs: Mapping[str, Tensor], config: Configuration, args: OpArgs,
                 extents: Mapping[str, int], graph: LayerGraph | None = None) -> dict[str, Tensor]:
    """Run `op` on inputs stored in the layouts `config` gives its pass; outputs in their layouts."""
    graph = graph or layer_graph()
    in_layouts = [config.layout(name, op.pass_) for name in op.inputs]
    for name, layout in zip(op.inputs, in_layouts):
        check_shape(op.name, name, inputs[name], layout, extents)
    out_layouts = [config.layouts[name] for name in op.outputs]
    if op.is_contraction:
        spec = f"{in_layouts[0]},{in_layouts[1]}->{out_layouts[0]}"
        return {op.outputs[0]: torch.einsum(spec, *(inputs[n] for n in op.inputs)).contiguous()}
    try:
        fn = FUSED[op.name]
    except KeyError:
        raise GraphError(f"no reference for operator {op.name!r}; known: {', '.join(FUSED)}") from None
    logical = [inputs[name].permute(permutation(layout, graph.tensors[name].dims))
               for name, layout in zip(op.inputs, in_layouts)]
    results = fn(args, *logical)
    return {name: value.permute(permutation(graph.tensors[name].dims, layout)).contiguous()
            for name, value, layout in zip(op.outputs, results, out_layouts)}
