"""The one protocol every implementation of graph operators follows, and the registry that holds them.

An implementation (cuBLASLt, legacy cuBLAS, cuBLASLt with the bias epilogue, the fused-kernel families,
PyTorch's SDPA backends, the torch reference) covers one or more operators of the graph at once (a
*cover*: its first operator names the profile row). Each is one registered file that says
- which covers it implements (`covers`),
- its candidates for a size and a layout assignment, or why there is none (`candidates`),
- whether a configuration's choice fits a configuration and size (`check`: CPU-only, no GPU),
- and `bind`: everything a call needs but the tensors, resolved once (function handle, packed arguments,
  GEMM descriptors and algorithm, output shapes), as a `Step`.
The profilers and the runtime look implementations up here by the `impl` name profile rows and
configuration files carry. The reference of every cover is the graph's own operators
(`substation.reference.run_operator`), the same for all implementations.
"""
from __future__ import annotations

import abc
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from substation.device import H100, DeviceSpec
from substation.errors import ConfigurationFileError
from substation.graph import LayerGraph, Operator
from substation.layouts import Configuration
from substation.records import Candidate
from substation.reference import OpArgs
from substation.sizes import Size

Tensor = torch.Tensor
Env = dict[str, Tensor]
COMPILED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}  # what compiled plans run in


@dataclass(frozen=True)
class Choice:
    """The implementation of one operator, or of several at once (`covers`), as a configuration names it."""

    covers: tuple[str, ...]
    impl: str
    options: Mapping[str, object] = field(default_factory=dict)
    label: str = ""
    predicted_us: float | None = None


@dataclass(frozen=True)
class Infeasible:
    """Why an implementation has no candidate for a cover in some layouts (the rule it breaks)."""

    impl: str
    covers: tuple[str, ...]
    reason: str


@dataclass
class StepContext:
    """What every step of one pass shares: the operators' scalars, the dims' extents, the CUDA stream every
    launch goes to (looked up once per pass, not per launch; 0 off the GPU) and the tensors a step should
    write its outputs into instead of allocating them (the graphed backward's gradient buffer)."""

    args: OpArgs
    extents: Mapping[str, int]
    stream: int = 0
    into: Mapping[str, Tensor] = field(default_factory=dict)


def op_layouts(op: Operator, config: Configuration) -> dict[str, str]:
    """The layouts the operator reads its inputs in (its pass's) and writes its outputs in."""
    return {t: config.layout(t, op.pass_) for t in op.inputs} | {t: config.layouts[t] for t in op.outputs}


def alert_nondeterministic(caller: str) -> None:
    """What PyTorch does for an op without a deterministic implementation under
    `torch.use_deterministic_algorithms(True)`: raise (or, with warn_only, warn); nothing otherwise."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (f"{caller} is not deterministic (float atomics), but torch.use_deterministic_algorithms(True) is set: "
               f"optimize without --nondeterministic for a configuration that is")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, stacklevel=3)
    else:
        raise RuntimeError(message)


class Step(abc.ABC):
    """One bound implementation of a cover: reads `inputs` from the environment, returns `outputs`.

    `views` names outputs that are views of another output (a base the step allocates whole): a plan keeps
    the base between the passes and makes the views again, so that no two kept tensors share memory."""

    views: Mapping[str, tuple[str, int]] = {}  # output -> (base output, index along the base's first dim)

    def __init__(self, ops: Sequence[Operator], choice: Choice) -> None:
        self.ops, self.choice = tuple(ops), choice
        self.pass_ = ops[0].pass_
        produced = {t for op in ops for t in op.outputs}
        self.inputs = tuple(dict.fromkeys(t for op in ops for t in op.inputs if t not in produced))
        self.outputs = tuple(dict.fromkeys(t for op in ops for t in op.outputs))

    @property
    def name(self) -> str:
        return "+".join(op.name for op in self.ops)

    @abc.abstractmethod
    def __call__(self, env: Env, ctx: StepContext) -> Env:
        """Run on the environment's tensors (each contiguous in its layout); the new tensors."""

    def meta(self, env: Env, ctx: StepContext) -> Env:
        """The outputs' shapes, dtypes and devices without running anything (fake tensors under
        `torch._subclasses.FakeTensorMode`, for `torch.compile`); steps made of torch ops run themselves."""
        return self(env, ctx)

    def writes_into(self, tensor: str, dtype: torch.dtype) -> bool:
        """Whether the step writes output `tensor` itself into an `into` tensor of `dtype` (otherwise the plan copies
        it there afterwards)."""
        return False


class AllocatingStep(Step):
    """A step writing outputs of fixed shapes (its layouts at the bound size), allocated per call from PyTorch's
    caching allocator, or written where the context's `into` names them."""

    def bind_outputs(self, layouts: Mapping[str, str], extents: Mapping[str, int], dtype: torch.dtype,
                     device: torch.device) -> None:
        self.shapes = {t: tuple(extents[d] for d in layouts[t]) for t in self.outputs}
        self.dtype, self.device = dtype, device

    def writes_into(self, tensor: str, dtype: torch.dtype) -> bool:
        return tensor in self.shapes and dtype == self.dtype

    def allocate(self, into: Mapping[str, Tensor]) -> Env:
        return {t: into[t] if t in into and self.writes_into(t, into[t].dtype)
                else torch.empty(shape, dtype=self.dtype, device=self.device) for t, shape in self.shapes.items()}

    def meta(self, env: Env, ctx: StepContext) -> Env:
        return self.allocate({})


class Implementation(abc.ABC):
    """An implementation of covers of the graph: what profile rows and configurations name `impl`."""

    impl: str = ""
    # Whether its forward row needs the backward row of the same implementation and options (and the other way
    # round): the backward reads state only its own forward writes (an SDPA backend's logsumexp and RNG state).
    coupled: bool = False

    @abc.abstractmethod
    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        """The operator groups this implementation runs as one call (or one kernel)."""

    @abc.abstractmethod
    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        """Its candidates for the cover `ops` with tensors in `layouts` (the rows a profile may hold, before any
        GPU-side choice such as a GEMM algorithm), or an Infeasible naming the rule that excludes them."""

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        """ConfigurationFileError naming the field where a configuration's choice cannot run its layouts at this
        size; needs no GPU. The default accepts every choice of a cover this implementation has."""

    def first_candidate(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]) -> Candidate | None:
        """The first of `candidates` that is not an Infeasible, or None."""
        return next((c for c in self.candidates(ops, size, layouts) if not isinstance(c, Infeasible)), None)

    def cover_layouts(self, ops: Sequence[Operator], config: Configuration) -> dict[str, str]:
        """The layouts of the cover's tensors in a configuration, as `candidates` takes them."""
        return {t: layout for op in ops for t, layout in op_layouts(op, config).items()}

    def at_size(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> Choice:
        """This choice, made at another batch and length, for `size`: as it is where it fits (`check`), else this
        implementation's first candidate in the same layouts at `size` (a GEMM: the call of its layouts there,
        with cuBLASLt's heuristic algorithm, since the one profiled was timed on another problem; a kernel: its
        first variant that fits). ConfigurationFileError where it has none."""
        try:
            self.check(ops, choice, config, size)
            return choice
        except ConfigurationFileError as err:
            found = self.first_candidate(ops, size, self.cover_layouts(ops, config))
            if found is None:
                raise self.error(ops, f"has no candidate at B={size.B}, L={size.L} in these layouts ({err})") from None
            return dataclasses.replace(choice, options=found.options_dict, label=found.label, predicted_us=None)

    def for_padded_batches(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size
                           ) -> Choice:
        """This choice for batches whose padding leaves whole tiles of keys masked, where it has a variant that
        turns them into less time than the profile, timed on one batch without such tiles, can show. The
        default: as it is."""
        return choice

    def builds(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size,
               spec: DeviceSpec = H100) -> list:
        """What nvcc builds for this choice at `size` (its dtype) on `spec`'s GPU, each with a `compile(spec)`
        (`substation compile` builds them ahead of the first step). The default: nothing (a library call)."""
        return []

    @abc.abstractmethod
    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        """The step that runs this choice at `size` (its B and L included) in `dtype` on `device`, checked."""

    def deterministic(self, pass_: str, options: Mapping[str, object]) -> bool:
        """Whether a row of this implementation in `pass_` with these options gives the same bits on every run (no
        float atomics across blocks). `optimize` leaves the others out unless told otherwise (--nondeterministic)."""
        return True

    def error(self, ops: Sequence[Operator], message: str) -> ConfigurationFileError:
        return ConfigurationFileError(f"operators.{ops[0].name}: impl {self.impl!r} {message}")


class Registry:
    """Implementations by impl name; several may share a name when they cover different operators (the fused
    kernel families all answer to `kernel`)."""

    def __init__(self, implementations: Sequence[Implementation], graph: LayerGraph) -> None:
        self.graph = graph
        self._by_cover: dict[tuple[str, tuple[str, ...]], Implementation] = {}
        for implementation in implementations:
            for cover in implementation.covers(graph):
                self._by_cover[implementation.impl, cover] = implementation

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(impl for impl, _ in self._by_cover))

    def covers(self, impl: str) -> tuple[tuple[str, ...], ...]:
        return tuple(cover for name, cover in self._by_cover if name == impl)

    def of_type(self, kind: type[Implementation]) -> list[Implementation]:
        """The registered implementations of one class (each SDPA backend, say), in registration order."""
        return list(dict.fromkeys(found for found in self._by_cover.values() if isinstance(found, kind)))

    def coupled(self, impl: str) -> bool:
        """Whether rows of `impl` come in forward/backward pairs (`Implementation.coupled`)."""
        return any(found.coupled for (name, _), found in self._by_cover.items() if name == impl)

    def find(self, impl: str, covers: Sequence[str]) -> Implementation:
        """The implementation a profile row or configuration names; ConfigurationFileError if none exists."""
        found = self._by_cover.get((impl, tuple(covers)))
        if found is None:
            if impl not in self.names:
                raise ConfigurationFileError(f"operators.{covers[0]}: impl {impl!r} is not one this version of "
                                             f"Substation runs; known: {', '.join(self.names)}")
            raise ConfigurationFileError(f"operators.{covers[0]}: impl {impl!r} covers {list(self.covers(impl))}, "
                                         f"not {list(covers)}")
        return found

    def for_operator(self, op: str) -> list[tuple[str, Implementation]]:
        """(impl, implementation) of every single-operator cover of `op`, in registration order."""
        return [(impl, found) for (impl, cover), found in self._by_cover.items() if cover == (op,)]
