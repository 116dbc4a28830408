"""How `Encoder` runs a configuration: every operator bound once to the implementation chosen for it.

A configuration file names, per operator, an implementation and its options: `cublaslt` with the
recorded algorithm, `cublas`, `cublaslt_bias` over qkv_proj and qkv_bias (one call with the bias
epilogue), `kernel` with its knobs, `sdpa_<backend>` over the attention subgraph, `torch`. `bind_plan` turns each into a `Step` holding everything a call needs but the tensors (the GEMM's
descriptors and rebuilt algorithm, the kernel's compiled cubin, the SDPA layouts), so a step costs one
library call or launch and no planning: the call the Encoder makes is the call the profile timed. `reference_plan` runs every operator's torch reference
instead (CPU, float32/64, or when a configuration has no file). `breakdown` times every step in place.
"""
from __future__ import annotations

import abc
import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from substation.errors import ConfigurationFileError
from substation.graph import LayerGraph, Operator, layer_graph
from substation.layouts import Configuration, to_layout
from substation.reference import OpArgs, run_operator
from substation.sizes import Size

Tensor = torch.Tensor
Env = dict[str, Tensor]
COMPILED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
ATTENTION_STATE = "attention_state"  # what an SDPA forward hands its backward (not a tensor of the graph)


@dataclass(frozen=True)
class Choice:
    """The implementation of one operator, or of several at once (`covers`), as a configuration names it."""

    covers: tuple[str, ...]
    impl: str
    options: Mapping[str, object] = field(default_factory=dict)
    label: str = ""
    predicted_us: float | None = None


def file_choices(data: Mapping[str, object]) -> dict[str, Choice]:
    """Operator -> Choice from a loaded configuration dict (config_selection.load_configuration)."""
    choices = {}
    for op, entry in data["operators"].items():  # type: ignore[union-attr]
        covers = tuple(entry.get("covers", [op]))
        if op == covers[0]:
            choice = Choice(covers, entry["impl"], dict(entry["options"]), entry["label"], entry["predicted_us"])
            choices.update({name: choice for name in covers})
    return choices


def default_choices(config: Configuration, size: Size, dtype: str, graph: LayerGraph | None = None) -> dict[str, Choice]:
    """A runnable choice for every operator of any configuration, without a profile: cuBLASLt's first
    heuristic algorithm where one GEMM call maps the layouts, else torch.einsum; the first feasible kernel
    variant of a fused operator, else PyTorch's ops. Correct, not tuned: tests and new configurations."""
    from substation.kernels.registry import registry
    from substation.tc_profiling.mapping import map_contraction

    graph, kernels = graph or layer_graph(), registry()
    choices = {}
    for op in graph.operators:
        layouts = _op_layouts(op, config)
        if op.is_contraction:
            mapped = map_contraction(op, layouts, size.extents).call is not None
            choices[op.name] = Choice((op.name,), "cublaslt" if mapped else "torch")
            continue
        found = kernels[op.name].variants(op.name, size, dtype, layouts) if op.name in kernels else []
        choices[op.name] = Choice((op.name,), "kernel", found[0].options()) if found else Choice((op.name,), "torch")
    return choices


def _op_layouts(op: Operator, config: Configuration) -> dict[str, str]:
    """The layouts the operator reads its inputs in (its pass's) and writes its outputs in."""
    return {t: config.layout(t, op.pass_) for t in op.inputs} | {t: config.layouts[t] for t in op.outputs}


# ---- steps ---------------------------------------------------------------------------------------------------
class Step(abc.ABC):
    """One bound implementation: reads `inputs` from the environment, returns `outputs`."""

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
    def __call__(self, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> Env:
        """Run on the environment's tensors (each contiguous in its layout); the new tensors. Steps that allocate
        their outputs write those named in `into` there instead (`Plan.run` copies the others)."""


class TransposeStep(Step):
    """A split variable's copy into the layout the backward reads, at the end of the forward."""

    def __init__(self, tensor: str, src: str, dst: str) -> None:
        self.ops, self.pass_, self.inputs, self.outputs = (), "forward", (tensor,), (tensor,)
        self.choice = Choice((), "transpose", label=f"transpose {tensor}:{src} -> {tensor}:{dst}")
        self.tensor, self.src, self.dst = tensor, src, dst

    @property
    def name(self) -> str:
        return f"transpose_{self.tensor}"

    def __call__(self, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> Env:
        return {self.tensor: to_layout(env[self.tensor], self.src, self.dst)}


class ReferenceStep(Step):
    """The operator's torch reference (`substation.reference`): einsum, or the fused operator's PyTorch ops."""

    def __init__(self, op: Operator, config: Configuration, graph: LayerGraph, choice: Choice | None = None) -> None:
        super().__init__([op], choice or Choice((op.name,), "torch"))
        self.config, self.graph = config, graph

    def __call__(self, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> Env:
        return run_operator(self.ops[0], env, self.config, args, extents, self.graph)


class _Allocating(Step):
    """A step writing outputs of fixed shapes: allocated per call from PyTorch's caching allocator."""

    def bind_outputs(self, layouts: Mapping[str, str], extents: Mapping[str, int], dtype: torch.dtype,
                     device: torch.device) -> None:
        self.shapes = {t: tuple(extents[d] for d in layouts[t]) for t in self.outputs}
        self.dtype, self.device = dtype, device

    def allocate(self, into: Env | None) -> Env:
        into = into or {}
        return {t: into[t] if t in into else torch.empty(shape, dtype=self.dtype, device=self.device)
                for t, shape in self.shapes.items()}


class GemmStep(_Allocating):
    """One strided-batched GEMM: cuBLASLt with a rebuilt algorithm, or legacy cuBLAS."""

    def __init__(self, op: Operator, choice: Choice, run: Callable[[int, int, int], None], a: str, b: str) -> None:
        super().__init__([op], choice)
        self.run, self.a, self.b, self.c = run, a, b, op.outputs[0]

    def __call__(self, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> Env:
        out = self.allocate(into)
        self.run(env[self.a].data_ptr(), env[self.b].data_ptr(), out[self.c].data_ptr())
        return out


class KernelStep(_Allocating):
    """One of Substation's fused kernels (a compiled template variant)."""

    def __init__(self, op: Operator, choice: Choice, params, cubin) -> None:
        super().__init__([op], choice)
        self.params, self.cubin = params, cubin

    def __call__(self, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> Env:
        out = self.allocate(into)
        self.params.enqueue(self.cubin, {t: env[t] for t in self.inputs} | out, args)
        return out


class BiasEpilogueStep(Step):
    """One cuBLASLt GEMM whose bias epilogue also does the operator that biases and splits its result
    (`tc_profiling/epilogues.py`): the result, laid out with the split letter outermost, is allocated whole and
    its slices are the operator's outputs (Q, K, V), contiguous views that keep it alive."""

    def __init__(self, ops: Sequence[Operator], choice: Choice, epilogue, matmul, algorithm, dtype: torch.dtype,
                 device: torch.device, extents: Mapping[str, int]) -> None:
        super().__init__(ops, choice)
        self.a, self.b = epilogue.mapping.a_operand, epilogue.mapping.b_operand
        self.bias, self.slices = epilogue.split.bias, tuple(name for name, _ in epilogue.slices)
        self.outputs = self.slices  # the whole result is never a tensor of the graph's
        self.shape = tuple(extents[d] for d in epilogue.result_layout)
        self.matmul, self.algorithm, self.dtype, self.device = matmul, algorithm, dtype, device
        self._bias_pointer = None

    def __call__(self, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> Env:
        result = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        bias = env[self.bias].data_ptr()
        if bias != self._bias_pointer:  # an attribute of the matmul descriptor: set once per parameter storage
            self.matmul.set_epilogue_pointer(bias)
            self._bias_pointer = bias
        self.matmul(env[self.a].data_ptr(), env[self.b].data_ptr(), result.data_ptr(), self.algorithm)
        return {name: result[index] for index, name in enumerate(self.slices)}


class AttentionStep(Step):
    """PyTorch's scaled-dot-product attention (`kernels/sdpa.py`) over the attention subgraph of one pass.

    The forward leaves the backend's state (logsumexp, dropout RNG state) in the environment as
    ATTENTION_STATE, which the plan keeps for the backward; S, Pr, A, dA, dS are never materialized.
    """

    def __init__(self, ops: Sequence[Operator], choice: Choice, attention) -> None:
        super().__init__(ops, choice)
        self.attention = attention
        mask = ("M",) if attention.masked else ()
        if self.pass_ == "forward":
            self.inputs, self.outputs = ("Q", "K", "V", *mask), ("Z", ATTENTION_STATE)
        else:
            self.inputs, self.outputs = ("dZ", "Q", "K", "V", "Z", *mask, ATTENTION_STATE), ("dQ", "dK", "dV")

    def __call__(self, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> Env:
        mask = env["M"] if self.attention.masked else None
        if self.pass_ == "forward":
            z, state = self.attention.forward(env["Q"], env["K"], env["V"], mask, args)
            return {"Z": z, ATTENTION_STATE: state}
        grads = self.attention.backward(env["dZ"], env["Q"], env["K"], env["V"], env["Z"], mask,
                                        env[ATTENTION_STATE], args)
        return dict(zip(("dQ", "dK", "dV"), grads))


# ---- plans ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The steps of each pass in execution order, and what the forward must keep for the backward."""

    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    saved: tuple[str, ...]  # tensors, and ATTENTION_STATE where an SDPA step runs
    compiled: bool

    @property
    def fixed_dropout(self) -> bool:
        """Whether a PyTorch-ops step draws Substation's dropout from host integers (seed, offset), which a CUDA
        graph would capture once; compiled kernels read them from device memory instead."""
        return self.compiled and any(isinstance(s, ReferenceStep) and s.ops[0].dropout_site for s in self.steps)

    @property
    def takes_mask(self) -> bool:
        """False where the attention runs a backend without a padding mask (flash): then M is all ones."""
        return not any(isinstance(s, AttentionStep) and not s.attention.masked for s in self.forward)

    def run(self, pass_: str, env: Env, args: OpArgs, extents: Mapping[str, int], into: Env | None = None) -> None:
        """Run one pass's steps on the environment; outputs named in `into` end up in those tensors."""
        for step in self.forward if pass_ == "forward" else self.backward:
            env.update(step(env, args, extents, into))
        for name, dst in (into or {}).items():
            if env[name] is not dst:  # a step that could not write there (a torch op, SDPA)
                dst.copy_(env[name])
                env[name] = dst

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.forward + self.backward


def _plan(steps: Sequence[Step], config: Configuration, graph: LayerGraph, compiled: bool) -> Plan:
    backward = [s for s in steps if s.pass_ == "backward"]
    written = {t for s in backward for t in s.outputs} | {"dY"}
    sources = {name for name, spec in graph.tensors.items() if spec.role == "parameter"}
    read = dict.fromkeys(t for s in backward for t in s.inputs if t not in written and t not in sources)
    saved = tuple(read)  # forward activations, inputs (X, M) and SDPA's state, in the order first read
    produced = {t for step in steps for t in step.outputs}
    transposes = tuple(TransposeStep(t, config.layouts[t], layout) for t, layout in config.backward.items()
                       if layout != config.layouts[t] and t in produced)
    return Plan(tuple(s for s in steps if s.pass_ == "forward") + transposes, tuple(backward), saved, compiled)


def reference_plan(config: Configuration, graph: LayerGraph | None = None) -> Plan:
    graph = graph or layer_graph()
    return _plan([ReferenceStep(op, config, graph) for op in graph.operators], config, graph, compiled=False)


@functools.cache
def _cublaslt_handle(device: int):
    from substation.tc_profiling.cublaslt import Handle

    with torch.cuda.device(device):
        return Handle()


@functools.cache
def _legacy_cublas(device: int):
    from substation.tc_profiling.gemm import LegacyCublas

    with torch.cuda.device(device):
        return LegacyCublas()


def _check_call(op: Operator, choice: Choice, call) -> None:
    """The GEMM arguments a row recorded must be those of these layouts at this size."""
    recorded = {k: choice.options[k] for k in call.options() if k in choice.options}
    expected = {k: call.options()[k] for k in recorded}
    if recorded != expected:
        wrong = sorted(k for k in recorded if recorded[k] != expected[k])
        raise ConfigurationFileError(
            f"operators.{op.name}: the recorded GEMM call ({', '.join(f'{k}={recorded[k]}' for k in wrong)}) is not "
            f"the call of its layouts at this size ({', '.join(f'{k}={expected[k]}' for k in wrong)}): the "
            "configuration was made for another size")


def _bind_gemm(op: Operator, choice: Choice, layouts: Mapping[str, str], size: Size, dtype: torch.dtype,
               device: int) -> Step:
    from substation.tc_profiling.mapping import map_contraction

    mapping = map_contraction(op, layouts, size.extents)
    if mapping.call is None:
        raise ConfigurationFileError(f"operators.{op.name}: impl {choice.impl!r} cannot run layouts {dict(layouts)}: "
                                     f"{mapping.reason}")
    _check_call(op, choice, mapping.call)
    call = mapping.call
    if choice.impl == "cublas":
        legacy = _legacy_cublas(device)
        run = lambda a, b, c: legacy(call, dtype, a, b, c)  # noqa: E731
    else:
        run = _bind_cublaslt(op, choice, call, dtype, device)
    return GemmStep(op, choice, run, mapping.a_operand, mapping.b_operand)


def _bind_cublaslt(op: Operator, choice: Choice, call, dtype: torch.dtype, device: int) -> Callable:
    from substation.tc_profiling.cublaslt import LtMatmul

    matmul = LtMatmul(_cublaslt_handle(device), call, dtype)
    algorithm = _lt_algorithm(op, choice, matmul)
    return lambda a, b, c: matmul(a, b, c, algorithm)


def _lt_algorithm(op: Operator, choice: Choice, matmul):
    """The recorded cuBLASLt algorithm, rebuilt and checked; else (with a warning) cuBLASLt's first choice."""
    from substation.tc_profiling.cublaslt import WORKSPACE_BYTES

    algorithm = None
    if "algo_id" in choice.options:
        algorithm = matmul.algorithm_from_options(dict(choice.options))  # type: ignore[arg-type]
        try:
            if matmul.check(algorithm) > WORKSPACE_BYTES:
                raise RuntimeError(f"it needs more than {WORKSPACE_BYTES} bytes of workspace")
        except Exception as err:  # e.g. an fp16 profile's algorithm run in bf16
            warnings.warn(f"{op.name}: the recorded cuBLASLt algorithm cannot run here ({err}); using cuBLASLt's "
                          "first heuristic choice instead", stacklevel=5)
            algorithm = None
    if algorithm is None:
        found = matmul.algorithms(1)
        if not found:
            raise ConfigurationFileError(f"operators.{op.name}: cuBLASLt offers no algorithm for {matmul.call}")
        algorithm = found[0]
    return algorithm


def bias_epilogue_of(ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size):
    """The bias epilogue (`tc_profiling.epilogues.BiasEpilogue`) a `cublaslt_bias` choice runs in this
    configuration at this size: its operand, bias and slice layouts must be the configuration's."""
    from substation.tc_profiling.epilogues import SPLITS, bias_epilogue

    split = next((s for s in SPLITS if (s.contraction, s.operator) == tuple(o.name for o in ops)), None)
    if split is None:
        raise ConfigurationFileError(f"operators.{ops[0].name}: impl {choice.impl!r} covers "
                                     f"{[o.name for o in ops]}, which no bias epilogue covers")
    first_slice = ops[1].outputs[0]  # Q: the result's letters without the split letter
    (a, b), (result,) = ops[0].inputs, ops[0].outputs
    layouts = {a: config.layout(a), b: config.layout(b), result: split.letter + config.layouts[first_slice]}
    epilogue = bias_epilogue(split, layouts, size.extents)
    if isinstance(epilogue, str):
        raise ConfigurationFileError(f"operators.{ops[0].name}: impl {choice.impl!r} cannot run layouts {layouts}: "
                                     f"{epilogue}")
    wanted = {split.bias: epilogue.bias_layout, **dict(epilogue.slices)}
    wrong = {t: layout for t, layout in wanted.items() if config.layouts[t] != layout}
    if wrong:
        raise ConfigurationFileError(f"operators.{ops[0].name}: {choice.impl} needs {wrong}, the configuration "
                                     f"stores {({t: config.layouts[t] for t in wrong})}")
    _check_call(ops[0], choice, epilogue.mapping.call)
    if choice.options.get("bias_batch_stride", epilogue.bias_batch_stride) != epilogue.bias_batch_stride:
        raise ConfigurationFileError(f"operators.{ops[0].name}: bias_batch_stride={choice.options['bias_batch_stride']}"
                                     f" is not {epilogue.bias_batch_stride}: the configuration was made for another size")
    return epilogue


def _bind_bias_epilogue(ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size,
                        dtype: torch.dtype, device: int) -> Step:
    from substation.tc_profiling.cublaslt import LtMatmul

    epilogue = bias_epilogue_of(ops, choice, config, size)
    matmul = LtMatmul(_cublaslt_handle(device), epilogue.call, dtype, "bias", epilogue.bias_batch_stride)
    return BiasEpilogueStep(ops, choice, epilogue, matmul, _lt_algorithm(ops[0], choice, matmul), dtype,
                            torch.device("cuda", device), size.extents)


def _bind_kernel(op: Operator, choice: Choice, layouts: Mapping[str, str], size: Size, dtype: str) -> Step:
    from substation.kernels.base import InfeasibleError
    from substation.kernels.registry import kernel_params

    try:
        params = kernel_params(op.name, size, dtype, layouts, choice.options)
    except (InfeasibleError, TypeError) as err:
        raise ConfigurationFileError(f"operators.{op.name}: kernel {choice.label or dict(choice.options)} does not "
                                     f"fit this size and dtype: {err}") from None
    return KernelStep(op, choice, params, params.compile())


def _bind_attention(ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size,
                    dtype: torch.dtype) -> Step:
    from substation.kernels.sdpa import IMPLS, SdpaAttention

    backend = choice.options.get("backend")
    if IMPLS.get(backend) != choice.impl:  # type: ignore[arg-type]
        raise ConfigurationFileError(f"operators.{ops[0].name}: impl {choice.impl!r} with options "
                                     f"{dict(choice.options)} names no SDPA backend of {list(IMPLS.values())}")
    attention = SdpaAttention(backend, size.with_dtype(COMPILED_DTYPES[dtype]), q=config.layout("Q", ops[0].pass_),
                              k=config.layout("K", ops[0].pass_), v=config.layout("V", ops[0].pass_),
                              dz=config.layouts["dZ"])
    written = {"Z": attention.z} if ops[0].pass_ == "forward" else {"dQ": attention.dq, "dK": attention.dk,
                                                                     "dV": attention.dv}
    for tensor, layout in written.items():
        if config.layouts[tensor] != layout:
            raise ConfigurationFileError(f"operators.{ops[0].name}: {choice.impl} writes {tensor} as {layout!r}, the "
                                         f"configuration stores it as {config.layouts[tensor]!r}")
    return AttentionStep(ops, choice, attention)


def compile_kernels(choices: Mapping[str, Choice], config: Configuration, size: Size, dtype: str,
                    graph: LayerGraph | None = None) -> int:
    """Compile (or find in the disk cache) every chosen kernel; needs nvcc, no GPU. The number compiled."""
    graph, fresh = graph or layer_graph(), 0
    for op in graph.operators:
        choice = choices[op.name]
        if choice.impl == "kernel" and op.name == choice.covers[0]:
            step = _bind_kernel(op, choice, _op_layouts(op, config), size, dtype)
            fresh += not step.cubin.cached
    return fresh


def bind_plan(choices: Mapping[str, Choice], config: Configuration, size: Size, dtype: torch.dtype,
              device: torch.device, graph: LayerGraph | None = None) -> Plan:
    """Bind every chosen implementation for `size` (its B and L included) in `dtype` on a CUDA `device`."""
    graph = graph or layer_graph()
    if dtype not in COMPILED_DTYPES:
        raise TypeError(f"compiled plans run in {list(COMPILED_DTYPES)}, not {dtype}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    steps: list[Step] = []
    with torch.cuda.device(index):
        for op in graph.operators:
            choice = choices.get(op.name)
            if choice is None:
                raise ConfigurationFileError(f"operators.{op.name}: no implementation chosen")
            if op.name != choice.covers[0]:
                continue  # bound with the first operator it covers
            layouts = _op_layouts(op, config)
            if choice.impl in ("cublaslt", "cublas") and op.is_contraction:
                step = _bind_gemm(op, choice, layouts, size, dtype, index)
            elif choice.impl == "kernel":
                step = _bind_kernel(op, choice, layouts, size, COMPILED_DTYPES[dtype])
            elif choice.impl == "cublaslt_bias":
                step = _bind_bias_epilogue([graph.operator(o) for o in choice.covers], choice, config, size, dtype, index)
            elif choice.impl.startswith("sdpa_"):
                step = _bind_attention([graph.operator(o) for o in choice.covers], choice, config, size, dtype)
            elif choice.impl == "torch":
                step = ReferenceStep(op, config, graph, choice)
            else:
                raise ConfigurationFileError(f"operators.{op.name}: impl {choice.impl!r} is not runnable by this "
                                             "version of the Encoder")
            if isinstance(step, _Allocating):
                step.bind_outputs(layouts, size.extents, dtype, torch.device("cuda", index))
            steps.append(step)
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


def _host_us(call: Callable[[], object], repeats: int = 20) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / repeats * 1e6


def breakdown(encoder, x: Tensor, runs: int = 25, attention_mask: Tensor | None = None) -> list[OperatorTime]:
    """Time every step of the encoder's plan on x's device, each in isolation on real intermediate tensors
    (L2 flushed, as the profilers time them), in execution order."""
    from substation.timing import Timer

    plan, args, env, extents = encoder.prepared_step(x, attention_mask)
    timer, rows = Timer(runs=runs), []
    for step in plan.steps:
        call = functools.partial(step, env, args, extents)
        timing = timer(call)
        host = _host_us(call)
        env.update(call())
        rows.append(OperatorTime(step.name, step.pass_, step.choice.impl, step.choice.label, step.choice.predicted_us,
                                 timing.median_us, timing.min_us, host))
    return rows
