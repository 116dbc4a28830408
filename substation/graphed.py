"""An Encoder step replayed from two CUDA graphs (`Encoder(..., cuda_graphs=True)`): the whole forward and the
whole backward each cost the host one graph launch instead of ~30 library calls and kernel launches from
Python, so a step as the user calls it takes about its graphed time.

Captured on the first call for a (device, batch, length, dropout on/off), after one eager warm-up of both
passes (which loads every kernel and warms cuBLASLt and cuDNN up), into one memory pool: static inputs (x,
mask, dY), the forward's saved tensors, the backward's gradients. A replay overwrites them, hence:
- Y, dX and the parameter gradients are returned as copies, which survive the next step; the backward's
  steps write dX and every gradient into one buffer, so that one copy (one launch) returns them all;
- a forward replays only while no earlier graphed forward of the same graphs still awaits its backward
  (its autograd graph alive): otherwise, as with activation checkpointing or several forwards before one
  backward, it runs eagerly, correct and slower;
- the dropout (seed, offset) is copied and advanced inside the forward graph, so replays draw new masks.
Parameters are read where they live: an optimizer's in-place update is seen by the next replay; a parameter
moved to new storage makes the Encoder capture again.

Only eager calls replay these graphs: while torch.compile traces an Encoder, its step is the custom ops of
`substation.layer_op`, which torch.compile's own CUDA graphs (`mode="reduce-overhead"`) may capture instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Sequence

import torch

from substation.layouts import to_layout
from substation.reference import OpArgs
from substation.runtime import Plan

Tensor = torch.Tensor


class _Token:
    """Lives as long as one graphed forward's autograd graph: its end releases the forward's saved tensors."""


class GraphedStep:
    """A compiled plan's forward and backward captured as CUDA graphs over static input buffers."""

    def __init__(self, encoder, plan: Plan, x: Tensor, mask: Tensor, args: OpArgs, counter: Tensor | None,
                 names: Sequence[str], params: Sequence[Tensor]) -> None:
        self.encoder, self.plan, self.names = encoder, plan, tuple(names)
        self.params = tuple(p.detach() for p in params)  # the parameters, or their cached low-precision copies
        self.param_pointers = self._pointers(self.params)
        self.x, self.mask, self.dy = x.detach().clone(), mask.detach().clone(), torch.zeros_like(x)
        self.counter = counter  # the Encoder's dropout state, `rng_state` (None without dropout)
        self.state = counter.clone() if counter is not None else None
        self.args = dataclasses.replace(args, rng=self.state)
        self.generation = 0
        self.outstanding: set[int] = set()  # graphed forwards whose backward may still come
        self._capture()

    @staticmethod
    def _pointers(params: Sequence[Tensor]) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in params)

    def matches(self, params: Sequence[Tensor]) -> bool:
        """Whether these parameters live where the graphs read theirs."""
        return self._pointers(params) == self.param_pointers

    def _forward(self, advance: bool) -> dict:
        if advance and self.counter is not None:
            self.state.copy_(self.counter)
            self.counter[1] += 1
        return self.encoder.run_forward(self.plan, self.x, self.mask, self.params, self.args)

    def _backward(self, forward_env: dict, into: dict[str, Tensor] | None = None) -> tuple[Tensor, ...]:
        return self.encoder.run_backward(self.plan, forward_env, self.dy, self.args, into)

    def _gradient_buffer(self) -> None:
        """One flat buffer holding dX (in its layout) and every parameter gradient, and their views into it."""
        layouts = self.encoder.config.layouts
        shapes = {"dX": to_layout(self.x, "bji", layouts["dX"]).shape}
        shapes |= {"d" + name: p.shape for name, p in zip(self.names, self.params)}
        self.grad_shapes = tuple(shapes.values())
        self.grad_sizes = tuple(shape.numel() for shape in self.grad_shapes)
        self.grad_buffer = torch.empty(sum(self.grad_sizes), dtype=self.x.dtype, device=self.x.device)
        self.into = dict(zip(shapes, self._views(self.grad_buffer)))

    def _views(self, flat: Tensor) -> list[Tensor]:
        return [v.view(shape) for v, shape in zip(flat.split(self.grad_sizes), self.grad_shapes)]

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            self._backward(self._forward(advance=False))  # warm-up: nothing may load or initialize in a capture
            self.forward_graph = torch.cuda.CUDAGraph()
            with _capturing(self.forward_graph, side):
                self.env = self._forward(advance=True)
            self._gradient_buffer()
            self.backward_graph = torch.cuda.CUDAGraph()
            with _capturing(self.backward_graph, side, pool=self.forward_graph.pool()):
                self._backward(self.env, self.into)
        torch.cuda.current_stream().wait_stream(side)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, int]:
        """Y (a copy, bji) and the replay's generation."""
        self.x.copy_(x)
        self.mask.copy_(mask)
        self.forward_graph.replay()
        self.generation += 1
        return to_layout(self.env["Y"], self.encoder.config.layouts["Y"], "bji").clone(), self.generation

    def backward(self, dy: Tensor, generation: int) -> tuple[Tensor, ...]:
        """dX and the parameter gradients (copies) of the forward replay `generation`."""
        if generation != self.generation:  # cannot happen while `outstanding` guards the forward replays
            raise RuntimeError("graphed Encoder: this step's saved tensors were overwritten by a later forward")
        self.dy.copy_(dy)
        self.backward_graph.replay()
        dx, *grads = self._views(self.grad_buffer.clone())
        return (to_layout(dx, self.encoder.config.layouts["dX"], "bji"), *grads)

    def hold(self, generation: int) -> _Token:
        """A token whose end (with the autograd graph that holds it) releases forward `generation`."""
        token = _Token()
        self.outstanding.add(generation)
        weakref.finalize(token, self.outstanding.discard, generation)
        return token


# A capture is invalidated by any CUDA call that could synchronize made meanwhile; a user's process makes such
# calls from other threads (a DataLoader's pin-memory thread allocating pinned memory, DDP's NCCL watchdog querying
# events): "thread_local" lets those go on and keeps only this thread's calls out of the capture.
CAPTURE_ERROR_MODE = "thread_local"


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool=None):
    """torch.cuda.graph with the garbage collector paused: a finalizer run on this thread mid-capture (of a foreign
    library's buffer, say, freeing device memory) would make a call the capture cannot hold. torch.cuda.graph
    collects garbage before it begins."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
            yield
    finally:
        if was_enabled:
            gc.enable()


class GraphedFunction(torch.autograd.Function):
    """Autograd's view of a graphed step: parameters are inputs so that it returns their gradients."""

    @staticmethod
    def forward(ctx, graphed: GraphedStep, x: Tensor, mask: Tensor, *params: Tensor) -> Tensor:
        y, generation = graphed.forward(x, mask)
        # Held as long as autograd keeps this step's graph (freed at once where it keeps none, as under no_grad).
        ctx.graphed, ctx.generation, ctx.token = graphed, generation, graphed.hold(generation)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        dx, *grads = ctx.graphed.backward(dy.contiguous(), ctx.generation)
        return (None, dx, None, *grads)
