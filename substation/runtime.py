"""How `Encoder` runs a configuration: every chosen implementation bound once, as the steps of a plan.

A configuration file names, per operator (or per cover of several operators), an implementation and its
options. `bind_plan` looks each up in the registry (`substation.implementations`) and binds it
(`substation.protocol`): the step then holds everything a call needs but the tensors (GEMM descriptors and
rebuilt algorithm, the kernel's loaded function and packed arguments, the SDPA layouts), so that a call costs
one library call or launch and no planning: the call the Encoder makes is the call the profile timed.
`reference_plan` runs every operator's torch reference instead (CPU, float32/64). `breakdown` times every step
in place.
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from substation.device import H100, DeviceSpec
from substation.errors import ConfigurationFileError
from substation.graph import LayerGraph, Operator, layer_graph
from substation.implementations import registry
from substation.layouts import Configuration, to_layout
from substation.protocol import COMPILED_DTYPES, Choice, Env, Registry, Step, StepContext, op_layouts
from substation.reference import OpArgs
from substation.sizes import Size
from substation.timing import Timer, host_us
from substation.torch_ops import ReferenceStep

Tensor = torch.Tensor


def file_choices(data: Mapping[str, object]) -> dict[str, Choice]:
    """Operator -> Choice from a loaded configuration dict (`substation.config_file.load_configuration`)."""
    choices = {}
    for op, entry in data["operators"].items():  # type: ignore[union-attr]
        covers = tuple(entry.get("covers", [op]))
        if op == covers[0]:
            choice = Choice(covers, entry["impl"], dict(entry["options"]), entry["label"], entry["predicted_us"])
            choices.update({name: choice for name in covers})
    return choices


def default_choices(config: Configuration, size: Size, graph: LayerGraph | None = None) -> dict[str, Choice]:
    """A runnable choice for every operator of any configuration, without a profile: the first implementation
    in the registry's order of preference with a candidate for the operator's layouts (cuBLASLt with its
    heuristic algorithm, else our kernel's first variant, else PyTorch's ops). Correct, not tuned: tests and
    new configurations."""
    graph = graph or layer_graph()
    implementations = registry(graph)
    return {op.name: _first_choice(op, config, size, implementations) for op in graph.operators}


def _first_choice(op: Operator, config: Configuration, size: Size, implementations: Registry) -> Choice:
    """The first implementation of `op` alone, in the registry's order, with a candidate in its layouts."""
    layouts = op_layouts(op, config)
    for impl, implementation in implementations.for_operator(op.name):
        found = implementation.first_candidate([op], size, layouts)
        if found is not None:
            return Choice((op.name,), impl, found.options_dict, found.label)
    raise ConfigurationFileError(f"operators.{op.name}: no implementation runs layouts {layouts}")  # torch runs all


class TransposeStep(Step):
    """A split variable's copy into the layout the backward reads, at the end of the forward."""

    def __init__(self, tensor: str, src: str, dst: str) -> None:
        self.ops, self.pass_, self.inputs, self.outputs = (), "forward", (tensor,), (tensor,)
        self.choice = Choice((), "transpose", label=f"transpose {tensor}:{src} -> {tensor}:{dst}")
        self.tensor, self.src, self.dst = tensor, src, dst

    @property
    def name(self) -> str:
        return f"transpose_{self.tensor}"

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        return {self.tensor: to_layout(env[self.tensor], self.src, self.dst)}


@dataclass(frozen=True)
class Plan:
    """The steps of each pass in execution order, and what the forward keeps for the backward: `saved` names
    tensors no two of which share memory (a step's views are kept as their base, `views` makes them again)."""

    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    saved: tuple[str, ...]
    views: Mapping[str, tuple[str, int]]
    compiled: bool

    @property
    def fixed_dropout(self) -> bool:
        """Whether a PyTorch-ops step draws Substation's dropout from host integers (seed, offset), which a CUDA
        graph would capture once; compiled kernels read them from device memory instead."""
        return self.compiled and any(isinstance(s, ReferenceStep) and s.ops[0].dropout_site for s in self.steps)

    @property
    def takes_mask(self) -> bool:
        """False where the attention runs a backend without a padding mask (flash): then M is all ones."""
        return any("M" in step.inputs for step in self.forward)

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.forward + self.backward

    def context(self, args: OpArgs, extents: Mapping[str, int], into: Mapping[str, Tensor] | None = None
                ) -> StepContext:
        stream = torch.cuda.current_stream().cuda_stream if self.compiled else 0
        return StepContext(args, extents, stream, into or {})

    def _restore_views(self, env: Env) -> None:
        """A backward from the kept tensors: make the views of their bases again."""
        for name, (base, index) in self.views.items():
            if name not in env and base in env:
                env[name] = env[base][index]

    def run(self, pass_: str, env: Env, args: OpArgs, extents: Mapping[str, int],
            into: Mapping[str, Tensor] | None = None) -> None:
        """Run one pass's steps on the environment; outputs named in `into` end up in those tensors."""
        ctx = self.context(args, extents, into)
        self._restore_views(env)
        for step in self.forward if pass_ == "forward" else self.backward:
            env.update(step(env, ctx))
        for name, dst in ctx.into.items():
            if env[name] is not dst:  # a step that could not write there (a torch op, SDPA)
                dst.copy_(env[name])
                env[name] = dst

    def run_meta(self, pass_: str, env: Env, args: OpArgs, extents: Mapping[str, int]) -> None:
        """`run` without running anything: every step's outputs with their shapes, dtypes and devices (on fake
        tensors, what `torch.compile` traces)."""
        ctx = StepContext(args, extents)
        self._restore_views(env)
        for step in self.forward if pass_ == "forward" else self.backward:
            env.update(step.meta(env, ctx))


def _plan(steps: Sequence[Step], config: Configuration, graph: LayerGraph, compiled: bool) -> Plan:
    backward = [s for s in steps if s.pass_ == "backward"]
    written = {t for s in backward for t in s.outputs} | {"dY"}
    sources = {name for name, spec in graph.tensors.items() if spec.role == "parameter"}
    read = [t for s in backward for t in s.inputs if t not in written and t not in sources]
    views = {name: view for s in steps for name, view in s.views.items()}
    saved = tuple(dict.fromkeys(views[t][0] if t in views else t for t in read))  # in the order first read
    produced = {t for step in steps for t in step.outputs}
    transposes = tuple(TransposeStep(t, config.layouts[t], layout) for t, layout in config.backward.items()
                       if layout != config.layouts[t] and t in produced)
    return Plan(tuple(s for s in steps if s.pass_ == "forward") + transposes, tuple(backward), saved, views, compiled)


def reference_plan(config: Configuration, graph: LayerGraph | None = None) -> Plan:
    graph = graph or layer_graph()
    return _plan([ReferenceStep(op, config, graph) for op in graph.operators], config, graph, compiled=False)


def _covers(choices: Mapping[str, Choice], graph: LayerGraph):
    """(operators, choice) of every chosen cover, in the graph's order (each at its first operator)."""
    for op in graph.operators:
        choice = choices.get(op.name)
        if choice is None:
            raise ConfigurationFileError(f"operators.{op.name}: no implementation chosen")
        if op.name == choice.covers[0]:
            yield [graph.operator(name) for name in choice.covers], choice


def check_choices(choices: Mapping[str, Choice], config: Configuration, size: Size,
                  graph: LayerGraph | None = None) -> None:
    """ConfigurationFileError naming the first choice that cannot run this configuration at this size (no GPU)."""
    graph = graph or layer_graph()
    implementations = registry(graph)
    passes: dict[str, set[str]] = {}  # a coupled implementation's: which passes it is chosen for
    for ops, choice in _covers(choices, graph):
        implementations.find(choice.impl, choice.covers).check(ops, choice, config, size)
        if implementations.coupled(choice.impl):
            passes.setdefault(choice.impl, set()).add(ops[0].pass_)
    for impl, chosen in passes.items():
        if len(chosen) == 1:  # e.g. a forward storing GELU' where F belongs, before a backward that reads F
            raise ConfigurationFileError(f"{impl} is chosen for the {chosen.pop()} only: its rows run as a "
                                         "forward and backward pair (one reads what only the other writes)")


def choices_at_size(choices: Mapping[str, Choice], config: Configuration, size: Size,
                    graph: LayerGraph | None = None) -> dict[str, Choice]:
    """A configuration's choices, made at another batch and length, for `size` (`Implementation.at_size`): the
    layouts and implementations stay, what depends on B and L is re-planned (no GPU needed)."""
    graph = graph or layer_graph()
    implementations = registry(graph)
    resized, fallen = {}, set()
    for ops, choice in _covers(choices, graph):
        try:
            found = implementations.find(choice.impl, choice.covers).at_size(ops, choice, config, size)
            resized.update({name: found for name in choice.covers})
        except ConfigurationFileError as err:  # e.g. no LayerNorm variant's rows divide an odd length
            resized.update({op.name: _first_choice(op, config, size, implementations) for op in ops})
            fallen.add(choice.impl)
            warnings.warn(f"{err}: running {', '.join(resized[op.name].impl for op in ops)} instead", stacklevel=3)
    # A coupled implementation's rows run only as a pair (one pass reads what only the other writes): where one of
    # its covers fell back, so do the others.
    for ops, choice in _covers(resized, graph):
        if choice.impl in fallen and implementations.coupled(choice.impl):
            resized.update({op.name: _first_choice(op, config, size, implementations) for op in ops})
            warnings.warn(f"{choice.impl} runs its covers only as a pair, and one fell back at B={size.B}, "
                          f"L={size.L}: running {', '.join(resized[op.name].impl for op in ops)} instead", stacklevel=3)
    return resized


def padded_batch_choices(choices: Mapping[str, Choice], config: Configuration, size: Size,
                         graph: LayerGraph | None = None) -> dict[str, Choice]:
    """The choices at `size` for batches whose padding leaves whole key tiles masked
    (`Implementation.for_padded_batches`: what the profile, timed on one unpadded batch, cannot weigh)."""
    graph = graph or layer_graph()
    implementations = registry(graph)
    found = {}
    for ops, choice in _covers(choices, graph):
        padded = implementations.find(choice.impl, choice.covers).for_padded_batches(ops, choice, config, size)
        found.update({name: padded for name in choice.covers})
    return found


def chosen_kernels(choices: Mapping[str, Choice], config: Configuration, size: Size,
                   graph: LayerGraph | None = None, spec: DeviceSpec = H100) -> list:
    """What nvcc builds for these choices at `size` (its dtype) on `spec`'s GPU (each implementation's `builds`: our
    kernels' parameter points, the GEMMs with our epilogues, the bias-gradient kernels beside library GEMMs), each
    with a `compile(spec)`."""
    graph = graph or layer_graph()
    kernels = registry(graph)
    return [kernel for ops, choice in _covers(choices, graph)
            for kernel in kernels.find(choice.impl, choice.covers).builds(ops, choice, config, size, spec)]


def build(kernels: Iterable, spec: DeviceSpec = H100, done: Callable[[], object] | None = None) -> dict:
    """Compile (or find in the disk cache) `kernels` (anything with `compile(spec)`, hashable) for `spec`'s
    architecture, one nvcc per core, calling `done` after each (a progress bar's update); needs nvcc, no GPU.
    Each kernel -> whether it was compiled (False: it came from the cache)."""
    unique = list(dict.fromkeys(kernels))
    fresh = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:  # nvcc runs in subprocesses: threads suffice
        futures = {pool.submit(kernel.compile, spec): kernel for kernel in unique}
        for future in as_completed(futures):
            fresh[futures[future]] = not future.result().cached
            if done is not None:
                done()
    return fresh


def compile_kernels(choices: Mapping[str, Choice], config: Configuration, size: Size, spec: DeviceSpec = H100,
                    graph: LayerGraph | None = None) -> int:
    """`build` every chosen kernel at `size` (its dtype) for `spec`'s architecture. The number compiled."""
    return sum(build(chosen_kernels(choices, config, size, graph, spec), spec).values())


def bind_plan(choices: Mapping[str, Choice], config: Configuration, size: Size, dtype: torch.dtype,
              device: torch.device, graph: LayerGraph | None = None) -> Plan:
    """Bind every chosen implementation for `size` (its B and L included) in `dtype` on a CUDA `device`."""
    graph = graph or layer_graph()
    if dtype not in COMPILED_DTYPES:
        raise TypeError(f"compiled plans run in {list(COMPILED_DTYPES)}, not {dtype}")
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    implementations = registry(graph)
    with torch.cuda.device(device):
        steps = [implementations.find(choice.impl, choice.covers).bind(ops, choice, config, size, dtype, device)
                 for ops, choice in _covers(choices, graph)]
    return _plan(steps, config, graph, compiled=True)


# ---- per-operator timing -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OperatorTime:
    """One step of a plan timed in place, beside what the optimizer predicted for it; `host_us` is what
    enqueueing it costs the CPU (Python, argument packing, the library call)."""

    op: str
    pass_: str
    impl: str
    label: str
    predicted_us: float | None
    measured_us: float
    min_us: float
    host_us: float


def breakdown(encoder, x: Tensor, runs: int = 25, attention_mask: Tensor | None = None) -> list[OperatorTime]:
    """Time every step of the encoder's plan on x's device, each in isolation on real intermediate tensors
    (L2 flushed, as the profilers time them), in execution order."""
    plan, args, env, extents = encoder.prepared_step(x, attention_mask)
    timer, rows, ctx = Timer(runs=runs), [], plan.context(args, extents)
    for step in plan.steps:
        call = functools.partial(step, env, ctx)
        timing = timer(call)
        host = host_us(call, calls=20, rounds=3)
        env.update(call())
        rows.append(OperatorTime(step.name, step.pass_, step.choice.impl, step.choice.label, step.choice.predicted_us,
                                 timing.median_us, timing.min_us, host))
    return rows
