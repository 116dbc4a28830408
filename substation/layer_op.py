"""The Encoder layer's forward and backward as `torch.library` custom ops, so that `torch.compile` traces a model
holding Encoders with each layer one opaque node of its graph (as FlashAttention registers its kernels).

    substation::layer_forward(int layer, Tensor x, Tensor? mask, Tensor[] params, Tensor? rng,
                              float attention_dropout, float hidden_dropout) -> Tensor[]     # [Y, *saved(, rng)]
    substation::layer_backward(int layer, Tensor dy, Tensor x, Tensor? mask, Tensor[] params, Tensor[] saved,
                               Tensor? rng, float attention_dropout, float hidden_dropout) -> Tensor[]  # [dX, *grads]

x, Y, dY, dX: bji; mask: [B, L] in x's dtype (1 keep, 0 pad) or None (no padding); params: the Encoder's 12
PARAMETERS in their layouts, grads likewise; rng: this step's dropout (seed, offset), int64 [2], or None without
dropout; saved: the tensors of `plan.saved` (what the backward reads, views kept as their base) but X and M, which
it rebuilds from x and mask (free in the user's layouts, every shipped file's; one transpose otherwise), so that
no output is an input.

Op arguments may only be tensors and scalars, so `layer` is an int handle into a process-wide table of the
Encoders, which holds their configuration, their bound plans and their compiled kernels. The table holds weak
references: a compiled graph keeps the handle as a constant and must not keep an Encoder (its plans, its CUDA
graphs and their memory) alive after the model that held it is gone; while the model lives, it holds the Encoder.

The fake implementations run the plan without launching anything (`Plan.run_meta`: the steps' outputs allocated
on the fake tensors' device, torch-op steps run on the fake tensors themselves). Outside torch.compile, `layer`
calls the same implementations through an `autograd.Function` instead, without the dispatcher's per-call cost.
"""
from __future__ import annotations

import itertools
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from substation.layouts import to_layout
from substation.mixed_precision import autocast_off

if TYPE_CHECKING:
    from substation.encoder import Encoder

Tensor = torch.Tensor
REBUILT = ("X", "M")  # saved inputs the backward rebuilds from x and mask instead of receiving them

_layers: dict[int, weakref.ref] = {}
_handles = itertools.count()


def register(encoder: Encoder) -> int:
    """A new handle naming `encoder` in the ops' arguments; it leaves the table when the Encoder is collected."""
    handle = next(_handles)
    _layers[handle] = weakref.ref(encoder, lambda _, handle=handle: _layers.pop(handle, None))
    return handle


def lookup(handle: int) -> Encoder:
    encoder = _layers[handle]() if handle in _layers else None
    if encoder is None:
        raise RuntimeError(f"substation layer handle {handle} names no live Encoder: the module that held it is gone")
    return encoder


def saved_names(plan) -> tuple[str, ...]:
    """What the forward op returns after Y, in order: the tensors the backward reads but X and M."""
    return tuple(name for name in plan.saved if name not in REBUILT)


# ---- the implementations ----------------------------------------------------------------------------------
def _forward(handle: int, x: Tensor, mask: Tensor | None, params: Sequence[Tensor], rng: Tensor | None,
             attention_dropout: float, hidden_dropout: float, meta: bool = False) -> list[Tensor]:
    """[Y (bji), *saved]; `meta`: run the plan on fake tensors, launching nothing."""
    encoder = lookup(handle)
    plan = encoder.checked_plan(x, mask)
    args = encoder.step_args(plan, None if meta else rng, attention_dropout, hidden_dropout)
    env = encoder.environment(x, encoder.mask_or_ones(x, mask, cache=not meta), params)
    encoder.run_pass(plan, "forward", env, args, encoder.extents(x), meta=meta)
    return [to_layout(env["Y"], encoder.config.layouts["Y"], "bji"), *(env[name] for name in saved_names(plan))]


def _backward(handle: int, dy: Tensor, x: Tensor, mask: Tensor | None, params: Sequence[Tensor],
              saved: Sequence[Tensor], rng: Tensor | None, attention_dropout: float, hidden_dropout: float,
              meta: bool = False) -> list[Tensor]:
    """[dX (bji), *the gradient of each parameter in its layout]."""
    encoder = lookup(handle)
    plan = encoder.plan(x.shape[0], x.shape[1], x.device, x.dtype)
    args = encoder.step_args(plan, None if meta else rng, attention_dropout, hidden_dropout)
    env = encoder.environment(x, encoder.mask_or_ones(x, mask, cache=not meta), params)
    env |= dict(zip(saved_names(plan), saved))
    with autocast_off(x.device.type):  # a backward called inside an autocast region
        return list(encoder.run_backward(plan, env, dy, args, meta=meta))


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _unaliased(outputs: list[Tensor], inputs: Sequence[Tensor | None]) -> list[Tensor]:
    """The outputs, where one shares storage with an input or another output a copy with its strides: a custom
    op's outputs may alias nothing (torch.library checks it). Plans keep no two tensors in one storage (a step's
    views are made again from their base), so this copies nothing unless a step returns a view of its input."""
    count = Counter(_storage(t) for t in [*outputs, *(t for t in inputs if t is not None)])
    return [_copy(t) if count[_storage(t)] > 1 else t for t in outputs]


def _copy(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _empty_like(outputs: list[Tensor]) -> list[Tensor]:
    """Fresh tensors with the outputs' shapes, strides and dtypes: what a fake returns."""
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in outputs]


# ---- the ops ------------------------------------------------------------------------------------------------
def _with_rng(outputs: list[Tensor], rng: Tensor | None) -> list[Tensor]:
    """The forward op's outputs and, last, the dropout state it drew from. The backward takes its state from the
    forward op's outputs, not from the op's input: AOTAutograd's partitioner may recompute that input in the
    backward graph (a clone of the Encoder's state buffer) from the buffer, which the step has advanced by then,
    and the backward would regenerate other masks than the forward drew."""
    return outputs if rng is None else [*outputs, rng.clone()]


@torch.library.custom_op("substation::layer_forward", mutates_args=())
def layer_forward(layer: int, x: Tensor, mask: Tensor | None, params: list[Tensor], rng: Tensor | None,
                  attention_dropout: float, hidden_dropout: float) -> list[Tensor]:
    outputs = _forward(layer, x, mask, params, rng, attention_dropout, hidden_dropout)
    return _with_rng(_unaliased(outputs, [x, mask, *params, rng]), rng)


@layer_forward.register_fake
def _(layer, x, mask, params, rng, attention_dropout, hidden_dropout):
    outputs = _empty_like(_forward(layer, x, mask, params, rng, attention_dropout, hidden_dropout, meta=True))
    return _with_rng(outputs, rng)


@torch.library.custom_op("substation::layer_backward", mutates_args=())
def layer_backward(layer: int, dy: Tensor, x: Tensor, mask: Tensor | None, params: list[Tensor],
                   saved: list[Tensor], rng: Tensor | None, attention_dropout: float,
                   hidden_dropout: float) -> list[Tensor]:
    outputs = _backward(layer, dy, x, mask, params, saved, rng, attention_dropout, hidden_dropout)
    return _unaliased(outputs, [dy, x, mask, *params, *saved, rng])


@layer_backward.register_fake
def _(layer, dy, x, mask, params, saved, rng, attention_dropout, hidden_dropout):
    return _empty_like(_backward(layer, dy, x, mask, params, saved, rng, attention_dropout, hidden_dropout,
                                 meta=True))


# ---- autograd: the ops' registration and the eager Function share what they keep ---------------------------
def _keep(ctx, layer: int, x: Tensor, mask: Tensor | None, params: Sequence[Tensor], rng: Tensor | None,
          attention_dropout: float, hidden_dropout: float, saved: Sequence[Tensor]) -> None:
    ctx.layer, ctx.dropout, ctx.n_params = layer, (attention_dropout, hidden_dropout), len(params)
    ctx.save_for_backward(x, mask, rng, *params, *saved)


def _kept(ctx) -> tuple:
    """(x, mask, params, saved, rng, attention_dropout, hidden_dropout), as `_backward` takes them after dy."""
    x, mask, rng, *rest = ctx.saved_tensors
    params, saved = rest[:ctx.n_params], rest[ctx.n_params:]
    return x, mask, params, saved, rng, *ctx.dropout


def _setup_context(ctx, inputs, output) -> None:
    layer, x, mask, params, rng, attention_dropout, hidden_dropout = inputs
    ctx.mark_non_differentiable(*output[1:])
    saved, rng = (output[1:-1], output[-1]) if rng is not None else (output[1:], None)
    _keep(ctx, layer, x, mask, params, rng, attention_dropout, hidden_dropout, saved)


def _op_backward(ctx, grads: list[Tensor]):
    dx, *param_grads = layer_backward(ctx.layer, grads[0], *_kept(ctx))
    return None, dx, None, param_grads, None, None, None


layer_forward.register_autograd(_op_backward, setup_context=_setup_context)


class _EagerLayer(torch.autograd.Function):
    """The ops' implementations called directly: outside torch.compile, a step pays no dispatcher or pytree work,
    and the saved tensors may alias (nothing is copied)."""

    @staticmethod
    def forward(ctx, layer: int, x: Tensor, mask: Tensor | None, rng: Tensor | None, attention_dropout: float,
                hidden_dropout: float, *params: Tensor) -> Tensor:
        y, *saved = _forward(layer, x, mask, params, rng, attention_dropout, hidden_dropout)
        _keep(ctx, layer, x, mask, params, rng, attention_dropout, hidden_dropout, saved)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        dx, *param_grads = _backward(ctx.layer, dy, *_kept(ctx))
        return None, dx, None, None, None, None, *param_grads


def layer(handle: int, x: Tensor, mask: Tensor | None, params: Sequence[Tensor], rng: Tensor | None,
          attention_dropout: float, hidden_dropout: float) -> Tensor:
    """Y (bji) of the Encoder `handle` on x, differentiable in x and params: the custom op while torch.compile
    traces, else the eager Function."""
    if torch.compiler.is_compiling():
        return layer_forward(handle, x, mask, list(params), rng, attention_dropout, hidden_dropout)[0]
    return _EagerLayer.apply(handle, x, mask, rng, attention_dropout, hidden_dropout, *params)
