"""Float32 parameters under `torch.autocast`: the layer runs in the autocast dtype from a cached low-precision copy
of its weights, and their gradients reach the float32 parameters.

This is what autocast's own weight cache does for `nn.Linear`, for a layer that autocast cannot see into (one
custom op): the copy is made once and made again (one `_foreach_copy_`: one launch on a GPU) only when a parameter
changed or moved, so that the 24 layers of a model in a gradient accumulation loop cast their weights once per
optimizer step, not once per forward. A change is an in-place op on a parameter (its version counter moves) or any
`torch.optim` optimizer's step (a global step hook counts them): fused AdamW updates the parameters without moving
their version counters, which alone left the layer running its first weights. An edit through `param.data` moves
neither: `weights_edited()` (`Encoder.refresh_weights()`) has every copy made again then (`parameters_state`, which
the graphed steps' shared copies check too). The backward casts the
low-precision gradients back in one launch; an inf or NaN stays one, so that `torch.amp.GradScaler` sees it and
skips the step.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

Tensor = torch.Tensor


def autocast_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype autocast runs a layer with `dtype` parameters in on `device_type`, or None where it does not
    apply (autocast off, or parameters that are not float32: autocast leaves float64 and half precision alone)."""
    if dtype != torch.float32 or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off inside the layer, where it is on: the plan's PyTorch ops (SDPA, a reference step) must run in
    the step's dtype, as its kernels do, not autocast's per-op choice (float32 for softmax, rsqrt, sums)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else contextlib.nullcontext()


_optimizer_steps = 0  # the steps any torch.optim optimizer took in this process
_edits = 0  # the calls of weights_edited()


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def weights_edited() -> None:
    """Every low-precision copy of any layer's weights is made again before it is read next: parameters were edited
    through `.data`, which moves neither their version counters nor an optimizer's step count."""
    global _edits
    _edits += 1


def parameters_state(params: Sequence[Tensor]) -> tuple:
    """What a copy of `params` must have been made at to still hold their values: equal states, equal values (as far
    as `torch` can tell: any in-place op, a move to new storage, an optimizer step or `weights_edited()` changes it)."""
    return (_optimizer_steps, _edits, *((p._version, p.data_ptr(), p.device) for p in params))


class WeightCache:
    """Low-precision copies of one layer's parameters, one set per dtype, refreshed when a parameter changed."""

    def __init__(self) -> None:
        self._copies: dict[torch.dtype, tuple[tuple, list[Tensor]]] = {}

    def cast(self, params: Sequence[Tensor], dtype: torch.dtype) -> tuple[Tensor, ...]:
        """The parameters in `dtype`, differentiable: their gradients come back in the parameters' dtype."""
        if torch.compiler.is_compiling():  # traced: plain casts, which the compiler fuses and caches itself
            return tuple(p.to(dtype) for p in params)
        return _Cast.apply(self, dtype, *params)

    def refreshed(self, params: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
        key = parameters_state(params)
        found = self._copies.get(dtype)
        # Under CUDA-graph capture the copy must be in the graph, so that each replay reads the current weights.
        capturing = params[0].is_cuda and torch.cuda.is_current_stream_capturing()
        if found is None or found[0] != key or capturing:
            copies = found[1] if found is not None and same_places(found[1], params) else [
                torch.empty_like(p, dtype=dtype) for p in params]
            with torch.no_grad():
                torch._foreach_copy_(copies, list(params))
            self._copies[dtype] = (key, copies)
        return self._copies[dtype][1]


def same_places(copies: Sequence[Tensor], params: Sequence[Tensor]) -> bool:
    """Whether `copies` can hold `params` as they are now: one per parameter, of its shape, on its device."""
    return len(copies) == len(params) and all(c.shape == p.shape and c.device == p.device
                                              for c, p in zip(copies, params))


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cache: WeightCache, dtype: torch.dtype, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.dtypes = [p.dtype for p in params]
        ctx.set_materialize_grads(False)  # an unused copy's gradient stays None, not zeros to cast
        # Views: each forward's outputs are tensors of their own (autograd gives each its own history), over the
        # one cached storage.
        return tuple(c.view_as(c) for c in cache.refreshed(params, dtype))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        out = [torch.empty_like(g, dtype=ctx.dtypes[i]) for i, g in present]
        torch._foreach_copy_(out, [g for _, g in present])
        full: list[Tensor | None] = [None] * len(grads)
        for (i, _), g in zip(present, out):
            full[i] = g
        return None, None, *full
