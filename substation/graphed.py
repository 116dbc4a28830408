"""An Encoder step, or the step of a chain of Encoders (an `EncoderStack`), replayed from two CUDA graphs
(`cuda_graphs=True`): the whole forward and the whole backward each cost the host one graph launch instead of ~30
library calls and kernel launches per layer from Python, so a step as the user calls it takes about its graphed
time. In a chain each Encoder's Y is the next one's x inside the graphs: nothing is copied between layers.

Captured on the first call for a (device, batch, length, dropout on/off), after one eager warm-up of both
passes (which loads every kernel and warms cuBLASLt and cuDNN up), into a memory pool that the training graphs of
every shape share (`GraphPool`): once a shape is captured, its forward's saved tensors go back to the pool, so that
the next shape's capture may place its own there. A shape's saved tensors are then live only between its forward
replay and its backward, and the pool holds little more than the largest shape's instead of every shape's (a
24-layer BERT-large stack at B8 trained at lengths 64, 128, ..., 512 in turn: 6.1 GiB reserved for lengths 128 to
512, against 17.2 with a pool per shape; `scripts/graph_pools.py`, H200). Where no gradient can be asked for
(under torch.no_grad or inference_mode, or nothing requires grad: evaluation), the shape gets a forward-only graph
instead, in a pool of their own, kept apart from the training graphs so that evaluating never pushes them out: no
backward is captured, no gradient buffer made, and the pool holds one layer's tensors at a time. A replay
overwrites what the pool holds, hence:
- Y and dX are returned as copies, which survive the next step; the parameter gradients are handed out as
  they are, in the parameters' dtype (float32 under autocast, whose weight casts the forward graph makes), from
  one of two buffers (`GradientBuffers`) that a backward replay writes only while nobody else holds it;
- a training forward replays only while no graphed forward of any shape still awaits its backward (its autograd
  graph alive, its backward not run yet): otherwise, as with activation checkpointing or several forwards before
  one backward, it runs eagerly, correct and slower; a backward whose saved tensors a later forward overwrote (a
  second backward through a retained graph) is refused;
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
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from substation.errors import InputError
from substation.kernels.convert import Converter
from substation.layouts import to_layout
from substation.mixed_precision import parameters_state, same_places
from substation.reference import OpArgs
from substation.runtime import Plan

Tensor = torch.Tensor


class _Token:
    """Lives as long as one graphed forward's autograd graph: its end releases the forward's saved tensors."""


@dataclasses.dataclass(eq=False)
class WeightCopies:
    """One link's parameters in the step's dtype (autocast's, for float32 parameters) and the launch that casts them
    there. A chain's graphs of every shape share them (`StepGraphs`): each training forward graph casts the current
    parameters into them first, and a backward reads what its forward cast, since the parameters do not change
    between a forward and its backward (autograd would refuse that too) and graphs never run at once. One set per
    chain, not per shape: 0.6 GB for 24 BERT-large layers in float16.

    A forward-only graph does not cast: before its replay the copies are cast again only where the parameters
    changed since (`held`), so that an evaluation loop casts once, not at every step (for 24 BERT-large layers
    1.8 GB of traffic, ~0.4 ms of a 6.8 ms B8/L512 evaluation step on an H200)."""

    tensors: tuple[Tensor, ...]
    cast: Converter
    held: tuple | None = None  # the parameters' state (`parameters_state`) the copies hold; None: unknown

    @classmethod
    def of(cls, sources: Sequence[Tensor], dtype: torch.dtype) -> WeightCopies:
        return cls(tuple(torch.empty_like(p, dtype=dtype) for p in sources),
                   Converter([p.numel() for p in sources], sources[0].dtype, dtype, sources[0].device))

    def fits(self, sources: Sequence[Tensor], dtype: torch.dtype) -> bool:
        return self.tensors[0].dtype == dtype and same_places(self.tensors, sources)

    def refresh(self, sources: Sequence[Tensor]) -> None:
        """Cast `sources` into the copies (a launch on the current stream) unless they hold their values already."""
        state = parameters_state(sources)
        if state != self.held:
            self.cast(self.tensors, sources)
            self.held = state


@dataclasses.dataclass(eq=False)
class Link:
    """One Encoder's step in a graphed chain: its plan, arguments and parameters, and what the capture keeps."""

    encoder: Any  # an Encoder (this module is below encoder.py: duck-typed)
    plan: Plan
    args: OpArgs  # its dropout (seed, offset) becomes `state`, set from `counter` inside the forward graph
    counter: Tensor | None  # the Encoder's dropout state, `rng_state` (None without dropout)
    sources: tuple[Tensor, ...]  # the Encoder's parameters, as it holds them
    # Under autocast the step reads copies in its dtype, cast from the parameters (one launch of our conversion
    # kernel) inside a training forward graph, or before a forward-only replay where they changed, so that each
    # replay reads the current weights; None: the parameters themselves
    copies: WeightCopies | None = None
    env: dict = dataclasses.field(default_factory=dict)  # the forward's tensors, while the backward is captured

    def __post_init__(self) -> None:
        self.sources = tuple(p.detach() for p in self.sources)
        self.state = self.counter.clone() if self.counter is not None else None
        self.args = dataclasses.replace(self.args, rng=self.state)
        self.params, self.cast = (self.sources, None) if self.copies is None else (self.copies.tensors,
                                                                                   self.copies.cast)

    @property
    def layouts(self):
        return self.encoder.config.layouts


def _use_count(tensor: Tensor) -> int:
    """How many tensors (and storage objects) hold the memory of `tensor`."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class GradientBuffers:
    """A chain's parameter gradients, in the parameters' dtype, as the backward graphs write them: two flat buffers
    whose views are handed out as the gradients themselves, no copy (under autocast the wgrad GEMMs write float32
    straight from their accumulators), shared by the graphs of every shape.

    AccumulateGrad keeps a handed-out gradient as the parameter's .grad; zero_grad's default (set_to_none) lets it
    go before the next step. Where it is kept -- gradients accumulated over micro-batches, zero_grad(set_to_none=
    False), a reference the user holds -- the next replay writes the other buffer, so nothing held is overwritten;
    where both are held, the first one's gradients are copied aside for the replay and put back after it."""

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device) -> None:
        self.shapes, self.dtype, self.device = tuple(shapes), dtype, device
        self.sizes = tuple(shape.numel() for shape in self.shapes)
        self.flats = tuple(torch.empty(sum(self.sizes), dtype=dtype, device=device) for _ in range(2))
        self.unheld = _use_count(self.flats[0])  # the count while only this object holds a buffer

    def fits(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device) -> bool:
        return (tuple(shapes), dtype, device) == (self.shapes, self.dtype, self.device)

    def views(self, flat: Tensor) -> list[Tensor]:
        """The gradients in `flat` (one of the buffers, or a scratch buffer like them)."""
        return [v.view(shape) for v, shape in zip(flat.split(self.sizes), self.shapes)]

    def free(self) -> int | None:
        """The index of a buffer nobody else holds (None: both are held)."""
        return next((i for i, flat in enumerate(self.flats) if _use_count(flat) == self.unheld), None)


class GraphPool:
    """One memory pool that graphs of several shapes capture into, the stream they are captured on, and the count of
    training forwards replayed from them: a shape's saved tensors stay intact only until another forward of the pool
    replays. One capture stream for all: the caching allocator hands a free block only to an allocation on the
    stream it was made on, so captures on streams of their own would share nothing."""

    def __init__(self, device: torch.device) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)
        self.forwards = 0


class GraphedStep:
    """The compiled steps of a chain of Encoders (one, or a stack applied in turn, each one's Y the next one's x)
    captured as CUDA graphs over static input buffers: the forward, and a backward per gradient buffer; without
    `gradients`, the forward alone, keeping no layer's tensors past the next layer (inference)."""

    def __init__(self, links: Sequence[Link], x: Tensor, mask: Tensor, names: Sequence[str],
                 gradients: GradientBuffers | None, pool: GraphPool) -> None:
        self.links, self.names, self.gradients, self.pool = tuple(links), tuple(names), gradients, pool
        self.param_pointers = self._pointers(self.sources)
        self.x, self.mask, self.dy = x.detach().clone(), mask.detach().clone(), torch.zeros_like(x)
        self.generation = 0
        self.outstanding: set[int] = set()  # graphed forwards whose backward may still come
        self._capture()

    @property
    def sources(self) -> list[Tensor]:
        """Every link's parameters, in order: the graphed function's inputs after x and the mask."""
        return [p for link in self.links for p in link.sources]

    @staticmethod
    def _pointers(params: Sequence[Tensor]) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in params)

    def matches(self, params: Sequence[Tensor]) -> bool:
        """Whether these parameters live where the graphs read theirs."""
        return self._pointers(params) == self.param_pointers

    @property
    def trains(self) -> bool:
        return self.gradients is not None

    def _forward(self, advance: bool) -> Tensor:
        """Y (bji) of the chain on the static x."""
        h = self.x
        for link in self.links:
            if link.cast is not None and self.trains:  # a forward-only replay is preceded by `_refresh_copies`
                link.cast(link.params, link.sources)
            if advance and link.counter is not None:
                link.state.copy_(link.counter)
                link.counter[1] += 1
            link.env = link.encoder.run_forward(link.plan, h, self.mask, link.params, link.args)
            h = to_layout(link.env["Y"], link.layouts["Y"], "bji")
            if not self.trains:  # let the next layer's tensors take this one's memory in the pool
                link.env = {}
        return h

    def _backward(self, into: Sequence[dict[str, Tensor]]) -> None:
        g = self.dy
        for index in reversed(range(len(self.links))):
            link = self.links[index]
            g = link.encoder.run_backward(link.plan, link.env, g, link.args, into[index])[0]

    def _grad_names(self) -> list[tuple[int, str]]:
        return [(index, "d" + name) for index in range(len(self.links)) for name in self.names]

    def _staging(self) -> None:
        """Which gradients the backward's steps write straight into the gradient buffers (in the parameters'
        dtype), and a buffer in the step's dtype for the others and the first link's dX (in its layout): one copy
        at the end of a backward graph moves those others into the gradient buffer."""
        grad_dtype = self.gradients.dtype
        writers = [{t: step for step in link.plan.backward for t in step.outputs} for link in self.links]
        self.staged = [i for i, (index, name) in enumerate(self._grad_names())
                       if not writers[index][name].writes_into(name, grad_dtype)]
        self.dx_shape = to_layout(self.x, "bji", self.links[0].layouts["dX"]).shape
        sizes = [self.dx_shape.numel()] + [self.gradients.sizes[i] for i in self.staged]
        views = torch.empty(sum(sizes), dtype=self.x.dtype, device=self.x.device).split(sizes)
        self.dx = views[0].view(self.dx_shape)
        self.staging = [v.view(self.gradients.shapes[i]) for v, i in zip(views[1:], self.staged)]
        self.unstage = Converter(sizes[1:], self.x.dtype, grad_dtype, self.x.device) if self.staged else None

    def _into(self, flat: Tensor) -> tuple[list[dict[str, Tensor]], list[Tensor]]:
        """Per link the tensors its backward writes when the gradients go to `flat`, and the staged gradients'
        places in `flat`."""
        grads = self.gradients.views(flat)
        staging = dict(zip(self.staged, self.staging))
        into: list[dict[str, Tensor]] = [{} for _ in self.links]
        into[0]["dX"] = self.dx
        for i, (index, name) in enumerate(self._grad_names()):
            into[index][name] = staging.get(i, grads[i])
        return into, [grads[i] for i in self.staged]

    def _backward_into(self, flat: Tensor) -> None:
        into, staged_places = self._into(flat)
        self._backward(into)
        if self.unstage is not None:
            self.unstage(staged_places, self.staging)

    def _capture(self) -> None:
        if not self.trains:
            self._capture_forward()
            return
        self._forget_copies()
        self._staging()
        free = self.gradients.free()
        # The warm-up writes a buffer nobody holds (it also prepares the float32 GEMM calls before any capture).
        scratch = self.gradients.flats[free] if free is not None else torch.empty_like(self.gradients.flats[0])
        side = self.pool.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            self._forward(advance=False)  # warm-up: nothing may load or initialize in a capture
            self._backward_into(scratch)
            self.forward_graph = torch.cuda.CUDAGraph()
            with _capturing(self.forward_graph, side, self.pool.handle):
                self.y = self._forward(advance=True)
            kept = [dict(link.env) for link in self.links]
            self.backward_graphs = []
            for flat in self.gradients.flats:
                graph = torch.cuda.CUDAGraph()
                with _capturing(graph, side, self.pool.handle):
                    self._backward_into(flat)
                self.backward_graphs.append(graph)
                # Only the forward's tensors stay: the backward's intermediates go back to the pool, where the next
                # backward graph's capture takes the same memory (the two never run at once), and its gradients are
                # views of a buffer, which would count as holding it.
                for link, env in zip(self.links, kept):
                    link.env = dict(env)
        torch.cuda.current_stream().wait_stream(side)
        # The saved tensors go back to the pool too, for other shapes' captures: the graphs keep writing and reading
        # them where they are.
        for link in self.links:
            link.env = {}
        del kept

    def _refresh_copies(self) -> None:
        for link in self.links:
            if link.copies is not None:
                link.copies.refresh(link.sources)

    def _forget_copies(self) -> None:
        """A training forward cast the parameters into the copies inside its graph, unseen by `WeightCopies.held`."""
        for link in self.links:
            if link.copies is not None:
                link.copies.held = None

    def _capture_forward(self) -> None:
        self._refresh_copies()
        side = self.pool.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            self._forward(advance=False)  # warm-up: nothing may load or initialize in a capture
            self.forward_graph = torch.cuda.CUDAGraph()
            with _capturing(self.forward_graph, side, self.pool.handle):
                self.y = self._forward(advance=True)
        torch.cuda.current_stream().wait_stream(side)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, int]:
        """Y (a copy, bji) and the replay's generation."""
        self.x.copy_(x)
        self.mask.copy_(mask)
        if self.trains:
            self._forget_copies()
        else:
            self._refresh_copies()
        self.forward_graph.replay()
        self.pool.forwards += 1
        self.generation = self.pool.forwards
        return self.y.clone(), self.generation

    def backward(self, dy: Tensor, generation: int) -> tuple[Tensor, ...]:
        """dX (a copy) and every link's parameter gradients (in a gradient buffer, each in its parameter's dtype)
        of the forward replay `generation`."""
        if generation != self.pool.forwards:  # a second backward through a graph retained past another forward
            raise RuntimeError("graphed Encoder: this step's saved tensors were overwritten by a later forward")
        self.dy.copy_(dy)
        free = self.gradients.free()
        if free is None:
            return self._backward_aside()
        self.backward_graphs[free].replay()
        return (to_layout(self.dx.clone(), self.links[0].layouts["dX"], "bji"),
                *self.gradients.views(self.gradients.flats[free]))

    def _backward_aside(self) -> tuple[Tensor, ...]:
        """The backward where both gradient buffers are held: the first buffer's gradients are copied aside, the
        backward replays into it, and once the new gradients are copied out the held ones go back. (The forward's
        saved tensors exist only where the graphs left them, so the backward cannot run eagerly instead.)"""
        warnings.warn("graphed Encoder: both gradient buffers are still held (earlier steps' .grad kept alive), so "
                      "this backward copies one aside and back; let go of old gradients, or "
                      "zero_grad(set_to_none=True)", stacklevel=2)
        flat = self.gradients.flats[0]
        held = flat.clone()
        self.backward_graphs[0].replay()
        fresh = flat.clone()
        flat.copy_(held)
        return (to_layout(self.dx.clone(), self.links[0].layouts["dX"], "bji"), *self.gradients.views(fresh))

    def hold(self, generation: int) -> _Token:
        """A token whose end (with the autograd graph that holds it) releases forward `generation`."""
        token = _Token()
        self.outstanding.add(generation)
        weakref.finalize(token, self.outstanding.discard, generation)
        return token


class StepGraphs:
    """The captured chains of one Encoder or of one stack, per (device, dtype, batch, length, dropout): the training
    graphs of the `max_shapes` shapes used last, the memory pool and the gradient buffers they share, and apart from
    them the forward-only graphs of the `max_shapes` shapes evaluated last, in a pool of their own."""

    def __init__(self, max_shapes: int) -> None:
        self.max_shapes = max_shapes
        self._steps: OrderedDict[tuple, GraphedStep] = OrderedDict()
        self._forward_only: OrderedDict[tuple, GraphedStep] = OrderedDict()
        self._gradients: GradientBuffers | None = None
        self._weight_copies: dict[int, WeightCopies] = {}  # per link of the chain, shared by every shape's graphs
        self._warned_of_dropping = False

    def __len__(self) -> int:
        """How many training shapes are captured (forward-only graphs apart: `len(graphs.forward_only)`)."""
        return len(self._steps)

    @property
    def forward_only(self) -> OrderedDict[tuple, GraphedStep]:
        return self._forward_only

    def __reduce__(self):
        """A copy (deepcopy, pickling) is empty: graphs belong to this process and to these tensors, and a copy's
        owner captures its own."""
        return StepGraphs, (self.max_shapes,)

    def forward(self, encoders: Sequence, names: Sequence[str], x: Tensor, mask: Tensor | None) -> Tensor | None:
        """Y of `encoders` applied in turn to x (checked, in the step's dtype), replayed from the chain's graphs
        (captured on first use, and again where a parameter moved to new storage); `names`: the Encoders'
        parameters, in order. None where the step runs eagerly instead: an Encoder whose plan is a reference plan,
        or runs PyTorch ops that draw Substation's dropout from host integers (a graph would fix them), Encoders of
        different dtypes, or an earlier graphed forward's tensors still awaiting its backward. Where no gradient
        can be asked for (grad mode off, or neither x nor a parameter requires grad), Y comes from the shape's
        forward-only graph, outside autograd."""
        flat = _parameters(encoders, names)
        trains = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in flat))
        graphed = self._graphed(encoders, names, flat, x, mask, trains)
        if graphed is None:
            return None
        mask = encoders[0].mask_or_ones(x, mask)
        if not trains:
            return graphed.forward(x, mask)[0]
        if any(step.outstanding for step in self._steps.values()):  # its replay would overwrite their saved tensors
            return None
        return GraphedFunction.apply(graphed, x, mask, *flat)

    def capture(self, encoders: Sequence, names: Sequence[str], x: Tensor, trains: bool) -> bool:
        """Capture the chain's training (or forward-only) graphs for x's shape ahead of use, unless kept already;
        nothing is replayed, so no gradient, output or dropout state changes. Whether the chain can be graphed."""
        return self._graphed(encoders, names, _parameters(encoders, names), x, None, trains) is not None

    def _graphed(self, encoders: Sequence, names: Sequence[str], flat: Sequence[Tensor], x: Tensor,
                 mask: Tensor | None, trains: bool) -> GraphedStep | None:
        """The chain's kept graphs of x's shape and kind, captured where there are none or the parameters (`flat`,
        `_parameters`) moved; None where the chain runs eagerly (`forward`)."""
        plans = [encoder.checked_plan(x, mask) for encoder in encoders]  # before the all-ones mask: no check
        dropouts = tuple(encoder.step_dropout() for encoder in encoders)
        if (len({encoder.dtype for encoder in encoders}) > 1
                or any(not plan.compiled or (plan.fixed_dropout and any(d)) for plan, d in zip(plans, dropouts))):
            return None
        if torch.cuda.is_current_stream_capturing():
            # Its warm-up steps replayed its own graphs, so nothing of the eager path (cuDNN's plans included) was
            # warmed up for this capture.
            raise InputError("an Encoder with cuda_graphs=True replays CUDA graphs of its own and cannot be "
                             "captured in another: set encoder.cuda_graphs = False to capture it yourself")
        sources = [tuple(flat[i:i + len(names)]) for i in range(0, len(flat), len(names))]  # each encoder's
        key = (x.device, x.dtype, x.shape[0], x.shape[1], dropouts)
        steps = self._steps if trains else self._forward_only
        graphed = steps.get(key)
        if graphed is None or not graphed.matches(flat):
            if trains:
                shapes = [p.shape for p in flat]  # looked at only when capturing: a replay's gradients fit its buffers
                if self._gradients is None or not self._gradients.fits(shapes, flat[0].dtype, x.device):
                    self._gradients = GradientBuffers(shapes, flat[0].dtype, x.device)
            links = []
            for index, (encoder, plan, dropout, params) in enumerate(zip(encoders, plans, dropouts, sources)):
                counter = encoder.rng_state if any(dropout) else None
                links.append(Link(encoder, plan, encoder.step_args(plan, counter, *dropout), counter, params,
                                  self._copies(index, params, x.dtype)))
            gradients = self._gradients if trains else None
            graphed = self._kept(steps, key, lambda: GraphedStep(links, x, encoders[0].mask_or_ones(x, mask), names,
                                                                 gradients, self._pool(steps, x.device)))
        steps.move_to_end(key)
        return graphed

    @staticmethod
    def _pool(steps: OrderedDict, device: torch.device) -> GraphPool:
        """The pool that the kept graphs of `steps` (one kind) captured into, or a new one where none is kept on
        `device`: a pool whose graphs are all gone may not be captured into again (PyTorch's allocator asserts
        that a shared pool still has users). Looked up at each try of a capture, since running out of memory drops
        kept graphs."""
        kept = (graphed.pool for graphed in steps.values() if graphed.x.device == device)
        return next(kept, None) or GraphPool(device)

    def _copies(self, index: int, sources: Sequence[Tensor], dtype: torch.dtype) -> WeightCopies | None:
        """Link `index`'s parameters in `dtype` where they are of another (autocast), made once for every shape."""
        if all(p.dtype == dtype for p in sources):
            return None
        found = self._weight_copies.get(index)
        if found is None or not found.fits(sources, dtype):
            found = self._weight_copies[index] = WeightCopies.of(sources, dtype)
        return found

    def _kept(self, steps: OrderedDict, key: tuple, capture: Callable[[], GraphedStep]) -> GraphedStep:
        """`capture()` kept in `steps` (training or forward-only graphs) as `key`'s graphs (in place of stale ones),
        the newest of at most `max_shapes`."""
        steps.pop(key, None)
        graphed = steps[key] = self._captured(steps, capture)
        if len(steps) > self.max_shapes:
            steps.popitem(last=False)
            self._warn_of_dropped(f"a shape beyond max_shapes={self.max_shapes} was captured", 1, len(steps))
        return graphed

    def _captured(self, steps: OrderedDict, capture: Callable[[], GraphedStep]) -> GraphedStep:
        """`capture()`, after dropping the graphs of the shapes used longest ago for as long as it runs out of
        memory, those of `steps`' kind first. A kind's shapes share one pool, which the new shape's capture adds to
        where it needs more than its largest shape did; the pool's memory comes back only once all of its graphs are
        gone, so a drop helps where the other kind's pool goes with it, or where the new shape fits once its own
        kind's pool is gone. Out of memory with none left to drop is raised."""
        dropped = 0
        while True:
            try:
                graphed = capture()
                break
            except torch.OutOfMemoryError:
                if not (self._steps or self._forward_only):
                    raise
            # outside the handler: the failed capture's frames are let go
            (steps if steps else self._steps or self._forward_only).popitem(last=False)
            dropped += 1
            gc.collect()  # a GraphedStep and its graphs reference each other: free the pool now
            torch.cuda.empty_cache()
        if dropped:  # the new shape's graphs are kept beside those left
            self._warn_of_dropped("out of GPU memory capturing a new shape", dropped, len(steps) + 1)
        return graphed

    def _warn_of_dropped(self, why: str, dropped: int, kept: int) -> None:
        """Once per stack: a loader that pads each batch to its longest sequence brings a new length most steps, and
        each costs a capture."""
        if self._warned_of_dropping:
            return
        self._warned_of_dropping = True
        warnings.warn(f"graphed Encoder: {why}, so the graphs of the {dropped} shape(s) used longest ago were dropped "
                      f"({kept} kept). A shape whose graphs are not kept is captured when it "
                      "comes, which takes as long as 20-60 steps (0.8-0.9 s for 24 BERT-large layers on an H100): pad "
                      "batches to a few lengths (length_multiple=64), or raise max_shapes where memory allows",
                      stacklevel=6)


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
        # The saved tensors are used: let the next forward replay now, not once autograd's graph is gone. A training
        # loop written at a script's top level keeps the last step's loss, and with it that graph, until the next
        # forward has returned; holding the generation till then made every step after the first run eagerly.
        # (A second backward through a retained graph after another forward is refused by the generation check.)
        ctx.token = None
        return (None, dx, None, *grads)


def _parameters(encoders: Sequence, names: Sequence[str]) -> list[Tensor]:
    """The chain's parameters, encoder by encoder, each in the order of `names`."""
    return [getattr(encoder, name) for encoder in encoders for name in names]
