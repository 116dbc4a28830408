"""qkv_proj's backward straight from the attention's dQ, dK and dV (impl `cublaslt_sliced`): one cover of
qkv_bias_bwd, qkv_proj_dgrad, qkv_proj_wgrad and residual_bwd, in which the stacked gradient dQKV and the attention
path's share of X's gradient (dXa) never exist.

The attention backward writes dQ, dK and dV apart (SDPA's backends allocate them). qkv_bias_bwd exists to stack
them into dQKV for the two GEMMs, and residual_bwd to add the residual's gradient dR1 to dXa: two passes over
data the GEMMs read or write anyway. Here Wqkv is read one slice at a time (t outermost, so Wqkv[t] is contiguous):
- dX = dR1 + dQ·Wqkv[0] + dK·Wqkv[1] + dV·Wqkv[2]: three cuBLASLt calls accumulating into dX (β = 1), the first
  reading dR1 as its C;
- dWqkv[t] = dQKV[t]ᵀ·X: three calls, each writing its slice;
- dbqkv[t] = Σ_bj dQKV[t]: option `bias_grad` = `epilogue`, cuBLASLt's BGRADA/BGRADB epilogue of the wgrad call
  (the sum over its k, which is b, j), or `kernel`, our bias-gradient kernel (`bias_grad.py`) on each slice.
Options `dgrad_algo` and `wgrad_algo` name cuBLASLt's heuristic algorithm by rank (0: its first choice), the same
for the three slices of each; the profiler times ranks 0 to 2, and a rank the heuristic does not reach at another
size falls back to its last offer. dX is rounded to the input dtype after each of its three calls, where the
stacked path rounds dXa and then dX: two more roundings of partial sums of the same magnitude, within the tests'
tolerance. Under autocast the kernel variant writes a float32 dWqkv itself; the epilogue variant writes it in the
compute dtype (cuBLASLt writes the bias gradient in D's type), and the plan casts it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from substation.device import H100, DeviceSpec
from substation.graph import LayerGraph, Operator, layer_graph
from substation.kernels.bias_grad import BiasGradient, BiasGradientLaunch
from substation.kernels.gpu_check import checked_step
from substation.layouts import Configuration
from substation.protocol import AllocatingStep, Choice, Env, Implementation, Infeasible, Step, StepContext
from substation.records import Candidate
from substation.sizes import TORCH_DTYPES, Size
from substation.tc_profiling.cublaslt import LtMatmul, device_handle, is_rank, ranked_algorithm
from substation.tc_profiling.mapping import GemmMapping, map_contraction

IMPL = "cublaslt_sliced"
COVER = ("qkv_bias_bwd", "qkv_proj_dgrad", "qkv_proj_wgrad", "residual_bwd")
SLICES = ("dQ", "dK", "dV")  # dQKV[0], dQKV[1], dQKV[2]
BIAS_GRADIENTS = ("epilogue", "kernel")
RANKS = (0, 1, 2)  # cuBLASLt heuristic ranks the profiler times per call kind
# One slice's GEMMs, over dQ's letters (dK and dV index keys by k where dQ has j: `_as_query`).
_DGRAD = Operator("qkv_proj_dgrad", "backward", "contraction", ("dQKV", "Wqkv"), ("dX",),
                  "dX += dQKV[t]·Wqkv[t]", einsum="bjhp,hpi->bji")
_WGRAD = Operator("qkv_proj_wgrad", "backward", "contraction", ("dQKV", "X"), ("dWqkv",),
                  "dWqkv[t] = dQKV[t]ᵀ·X", einsum="bjhp,bji->hpi")


def _as_query(layout: str) -> str:
    return layout.replace("k", "j")


def _outputs(ops: Sequence[Operator]) -> tuple[str, ...]:
    """What the cover stores: dbqkv, dWqkv and dX (dQKV and dXa are consumed inside it)."""
    consumed = {t for op in ops for t in op.inputs}
    return tuple(t for op in ops for t in op.outputs if t not in consumed)


@dataclass(frozen=True)
class SlicedCalls:
    """The calls of one layout assignment: per slice, the dgrad's and the wgrad's mapping, and the bias-gradient
    kernel's view of the slice as [O, U, I] with U its h and p."""

    layouts: tuple[tuple[str, str], ...]  # the cover's tensors, sorted by name
    dgrad: tuple[GemmMapping, ...]
    wgrad: tuple[GemmMapping, ...]
    bias_views: tuple[tuple[int, int, int], ...]
    slice_elements: int  # elements of Wqkv[t] (and dWqkv[t])

    def bias_kernels(self, dtype: str, spec: DeviceSpec) -> list[BiasGradient]:
        """The bias-gradient kernels of the three slices, for `dtype` (a name) on `spec`'s GPU."""
        return [BiasGradient(o, u, i, dtype, spec.sm_count) for o, u, i in self.bias_views]


def sliced_calls(layouts: Mapping[str, str], extents: Mapping[str, int]) -> SlicedCalls | str:
    """The calls of the cover in these layouts (of dQ, dK, dV, Wqkv, X, dR1 and the outputs), or why there are none."""
    weights, grad = layouts["Wqkv"], layouts["dWqkv"]
    if weights[0] != "t":
        return f"Wqkv:{weights} does not start with 't': its slices Wqkv[t] would not be contiguous"
    if grad != weights:
        return f"dWqkv:{grad} is not laid out as Wqkv:{weights}"
    if layouts["dR1"] != layouts["dX"]:
        return f"dR1:{layouts['dR1']} is not laid out as dX:{layouts['dX']} (one cuBLASLt layout for C and D)"
    order = "".join(d for d in weights if d in "hp")
    if layouts["dbqkv"] != "t" + order:
        return f"dbqkv:{layouts['dbqkv']}: the bias-gradient kernel writes each slice's sums as t{order}"
    dgrad, wgrad, views = [], [], []
    for name in SLICES:
        grad_slice = _as_query(layouts[name])
        for op, own in ((_DGRAD, {"Wqkv": weights[1:], "dX": layouts["dX"]}),
                        (_WGRAD, {"X": layouts["X"], "dWqkv": weights[1:]})):
            mapping = map_contraction(op, {"dQKV": grad_slice} | own, extents)
            if mapping.call is None:
                return f"{name}:{layouts[name]} in {op.name}: {mapping.reason}"
            (dgrad if op is _DGRAD else wgrad).append(mapping)
        at = grad_slice.index(order[0])
        views.append((math.prod(extents[d] for d in grad_slice[:at]), extents["h"] * extents["p"],
                      math.prod(extents[d] for d in grad_slice[at + 2:])))
    return SlicedCalls(tuple(sorted(layouts.items())), tuple(dgrad), tuple(wgrad), tuple(views),
                       math.prod(extents[d] for d in weights[1:]))


def bias_gradients(calls: SlicedCalls) -> tuple[str, ...]:
    """The bias-gradient options these calls take: cuBLASLt 13's BGRADA/BGRADB reduce an operand over k only where k
    is not its unit-stride dimension (CUBLAS_STATUS_NOT_SUPPORTED otherwise, on the H100), so a slice laid out with
    b, j innermost leaves the sums to the kernel."""
    letters = dict(calls.layouts)
    epilogue = all(_as_query(letters[name])[-1] in "hp" for name in SLICES)
    return BIAS_GRADIENTS if epilogue else tuple(b for b in BIAS_GRADIENTS if b != "epilogue")


def variants(calls: SlicedCalls) -> list[dict[str, object]]:
    return [{"bias_grad": bias_grad, "dgrad_algo": dgrad, "wgrad_algo": wgrad}
            for bias_grad in bias_gradients(calls) for dgrad in RANKS for wgrad in RANKS]


def candidate(ops: Sequence[Operator], layouts: Mapping[str, str], options: Mapping[str, object]) -> Candidate:
    """The row of the cover in these layouts of its inputs and outputs."""
    outputs = _outputs(ops)
    return Candidate.make(ops[0].name, ops[0].pass_, IMPL, {t: lay for t, lay in layouts.items() if t not in outputs},
                          {t: layouts[t] for t in outputs}, options, covers=COVER)


class SlicedQkvBackward(Implementation):
    """The cover as six cuBLASLt calls and three bias-gradient kernels (module docstring)."""

    impl = IMPL

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return (COVER,)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        found = sliced_calls(layouts, size.extents)
        if isinstance(found, str):
            yield Infeasible(self.impl, COVER, found)
        else:
            yield from (candidate(ops, dict(found.layouts), options) for options in variants(found))

    def cover_layouts(self, ops: Sequence[Operator], config: Configuration) -> dict[str, str]:
        produced = {t for op in ops for t in op.outputs}
        inputs = {t for op in ops for t in op.inputs if t not in produced}
        return {t: config.layout(t, "backward") for t in inputs} | {t: config.layouts[t] for t in _outputs(ops)}

    def calls(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> SlicedCalls:
        """The calls this choice makes in the configuration's layouts at this size, its options checked."""
        found = sliced_calls(self.cover_layouts(ops, config), size.extents)
        if isinstance(found, str):
            raise self.error(ops, f"cannot run these layouts: {found}")
        options = dict(choice.options)
        if options.get("bias_grad") in BIAS_GRADIENTS and options["bias_grad"] not in bias_gradients(found):
            raise self.error(ops, f"bias_grad={options['bias_grad']!r}: cuBLASLt's bias-gradient epilogue cannot "
                                  "reduce dQ, dK, dV laid out with b, j innermost; take bias_grad='kernel'")
        if options.get("bias_grad") not in BIAS_GRADIENTS or not all(
                is_rank(options.get(k)) for k in ("dgrad_algo", "wgrad_algo")):
            raise self.error(ops, f"options {options}: expected bias_grad one of {BIAS_GRADIENTS} and "
                                  "dgrad_algo, wgrad_algo cuBLASLt heuristic ranks (integers from 0)")
        return found

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        self.calls(ops, choice, config, size)

    def builds(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size,
               spec: DeviceSpec = H100) -> list[BiasGradient]:
        """What nvcc builds for this choice at `size` (its dtype): the bias-gradient kernels where it takes them."""
        calls = self.calls(ops, choice, config, size)
        return calls.bias_kernels(size.dtype, spec) if choice.options["bias_grad"] == "kernel" else []

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        return SlicedStep(ops, choice, self.calls(ops, choice, config, size), size.extents, dtype, device)


class SlicedStep(AllocatingStep):
    """The bound calls: dX accumulated over the slices from dR1, each dWqkv and dbqkv slice written apart."""

    def __init__(self, ops: Sequence[Operator], choice: Choice, calls: SlicedCalls, extents: Mapping[str, int],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(ops, choice)
        self.outputs = _outputs(ops)
        self.bind_outputs(dict(calls.layouts), extents, dtype, device)
        self.calls, self.handle = calls, device_handle(device.index)
        self.in_epilogue = choice.options["bias_grad"] == "epilogue"
        self.ranks = {"dgrad": int(choice.options["dgrad_algo"]), "wgrad": int(choice.options["wgrad_algo"])}
        self.dgrad = [self._matmul(mapping, "dgrad", dtype, beta=1.0) for mapping in calls.dgrad]
        self.wgrad: dict[torch.dtype, list] = {dtype: self._wgrad(dtype)}
        self.bias = [] if self.in_epilogue else [
            BiasGradientLaunch(kernels, device)
            for kernels in calls.bias_kernels(str(dtype).removeprefix("torch."), DeviceSpec.of(device.index))]
        self._bias_pointers = [0] * len(SLICES)

    def _matmul(self, mapping: GemmMapping, kind: str, out_dtype: torch.dtype, beta: float = 0.0,
                epilogue: str = "none") -> tuple[LtMatmul, object, bool]:
        """A bound call, its algorithm, and whether the slice is cuBLAS's A."""
        matmul = LtMatmul(self.handle, mapping.call, self.dtype, epilogue, out_dtype=out_dtype, beta=beta)
        return matmul, ranked_algorithm(matmul, self.ranks[kind]), mapping.a_operand == "dQKV"

    def _wgrad(self, out_dtype: torch.dtype) -> list:
        return [self._matmul(m, "wgrad", out_dtype, epilogue=(
            ("bgrad_a" if m.a_operand == "dQKV" else "bgrad_b") if self.in_epilogue else "none"))
            for m in self.calls.wgrad]

    def writes_into(self, tensor: str, dtype: torch.dtype) -> bool:
        return tensor in self.shapes and (dtype == self.dtype or (
            tensor == "dWqkv" and dtype == torch.float32 and not self.in_epilogue))

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        out = self.allocate(ctx.into)
        dx, dw, db = out["dX"], out["dWqkv"], out["dbqkv"]
        weights, x = env["Wqkv"].data_ptr(), env["X"].data_ptr()
        weight_slice = self.calls.slice_elements * env["Wqkv"].element_size()
        grad_slice = self.calls.slice_elements * dw.element_size()
        bias_slice = db.numel() // len(SLICES) * db.element_size()
        wgrad = self.wgrad.get(dw.dtype)
        if wgrad is None:
            wgrad = self.wgrad[dw.dtype] = self._wgrad(dw.dtype)
        source = env["dR1"].data_ptr()
        for t, name in enumerate(SLICES):
            grad, bias = env[name].data_ptr(), db.data_ptr() + t * bias_slice
            matmul, algorithm, grad_first = self.dgrad[t]
            w = weights + t * weight_slice
            matmul(*((grad, w) if grad_first else (w, grad)), dx.data_ptr(), algorithm, ctx.stream, source=source)
            source = dx.data_ptr()
            matmul, algorithm, grad_first = wgrad[t]
            if self.in_epilogue and self._bias_pointers[t] != bias:  # a descriptor attribute: set when it moves
                matmul.set_epilogue_pointer(bias)
                self._bias_pointers[t] = bias
            matmul(*((grad, x) if grad_first else (x, grad)), dw.data_ptr() + t * grad_slice, algorithm, ctx.stream)
            if not self.in_epilogue:
                self.bias[t](grad, bias, ctx.stream)
        return out


def assignments(size: Size, graph: LayerGraph | None = None) -> list[dict[str, str]]:
    """The layout assignments the profiler times: dQ, dK and dV alike (as the attention implementations write
    them), X, dR1 and dX as PyTorch's [B, L, I] (X and dX are the user's), every Wqkv with t outermost."""
    graph = graph or layer_graph()
    found = []
    for grad in ("bjhp", "bjph", "hpbj", "phbj", "jbhp", "jbph", "hpjb", "phjb"):
        for rest in ("hpi", "phi", "ihp", "iph"):
            layouts = {"dQ": grad, "dK": grad.replace("j", "k"), "dV": grad.replace("j", "k"), "Wqkv": "t" + rest,
                       "dWqkv": "t" + rest, "dbqkv": "t" + "".join(d for d in rest if d in "hp"),
                       "X": graph.tensors["X"].dims, "dR1": "bji", "dX": "bji"}
            if not isinstance(sliced_calls(layouts, size.extents), str):
                found.append(layouts)
    return found


@dataclass(frozen=True)
class SlicedGroup:
    """One profiled layout assignment and variant in one dtype: a task of the kernel profiler."""

    layouts: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, object], ...]
    dtype: str

    @property
    def candidate(self) -> Candidate:
        graph = layer_graph()
        return candidate([graph.operator(name) for name in COVER], dict(self.layouts), dict(self.options))

    def checked_runner(self, size: Size) -> tuple[Callable[[], None], float]:
        """A closure running the cover on random inputs (never zeros) in these layouts, and its outputs' max
        relative error against the float64 reference of the four operators (the graph's own)."""
        graph, layouts = layer_graph(), dict(self.layouts)
        calls = sliced_calls(layouts, size.extents)
        assert not isinstance(calls, str), calls
        step = SlicedStep([graph.operator(name) for name in COVER], Choice(COVER, IMPL, dict(self.options)), calls,
                          size.extents, TORCH_DTYPES[size.dtype], torch.device("cuda", torch.cuda.current_device()))
        return checked_step(step, layouts, size)


def profiled_groups(size: Size) -> list[SlicedGroup]:
    found = []
    for layouts in assignments(size):
        calls = sliced_calls(layouts, size.extents)
        assert not isinstance(calls, str), calls
        found += [SlicedGroup(tuple(sorted(layouts.items())), tuple(options.items()), size.dtype)
                  for options in variants(calls)]
    return found
