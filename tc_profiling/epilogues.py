"""cuBLASLt's bias epilogue as one implementation of a contraction and the operator that adds its bias.

cuBLASLt's BIAS epilogue adds a vector along the result's unit-stride group (cuBLAS's rows), the vector of
batch i starting at i·BIAS_BATCH_STRIDE. In this graph one operator is nothing but such a bias and a split:
qkv_bias, which adds bqkv to QKV and cuts it into Q, K, V along t. Where QKV is laid out with t outermost
and h, p innermost (`tbjhp`, `tjbhp`, ...), the GEMM batches over t with X broadcast (`batch_over`, see
`mapping.py`), the epilogue adds bqkv[t] to batch t, and Q, K, V are QKV[0], QKV[1], QKV[2]: contiguous, in
QKV's layout without t. One call then covers qkv_proj and qkv_bias (impl `cublaslt_bias`), and QKV never
exists apart from Q, K, V.

Not covered, and why:
- out_proj, ffn_out: their biases are added inside ln1/ln2, between a dropout and the residual; an epilogue
  there needs LayerNorm kernels without the bias, which would save reading a 2 KB vector.
- ffn_in: cuBLASLt's GELU_BIAS computes the tanh approximation of GELU, not BertLayer's erf
  (`tests/tc_profiling/test_gemm_gpu.py`); a bias-only epilogue leaves the GELU kernel as it is.
- bias gradients (BGRADA/BGRADB on the weight-gradient GEMMs): qkv_bias_bwd must still stack SDPA's separate
  dQ, dK, dV into dQKV, and bias_gelu_bwd and the LayerNorm backwards sum their bias gradients on data
  they read anyway.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from substation.graph import LayerGraph, Operator, layer_graph
from substation.layouts import Configuration
from substation.protocol import Choice, Env, Implementation, Infeasible, Step, StepContext
from substation.records import Candidate
from substation.sizes import Size
from substation.tc_profiling.cublaslt import LtMatmul, bound_algorithm, device_handle
from substation.tc_profiling.gemm import check_call
from substation.tc_profiling.mapping import GemmCall, GemmMapping, letter_groups, map_contraction

IMPL = "cublaslt_bias"


@dataclass(frozen=True)
class Split:
    """A contraction whose result an operator only biases and cuts along one letter."""

    contraction: str  # qkv_proj
    operator: str  # qkv_bias
    bias: str  # bqkv
    letter: str  # t: the result's outermost letter, the batch of the GEMM and the index of the slices


SPLITS = (Split("qkv_proj", "qkv_bias", "bqkv", "t"),)


@dataclass(frozen=True)
class BiasEpilogue:
    """One layout assignment the epilogue implements: the GEMM's mapping (result layout included), the bias's
    layout and batch stride, and the layouts of the slices."""

    split: Split
    mapping: GemmMapping
    bias_layout: str
    bias_batch_stride: int
    slices: tuple[tuple[str, str], ...]  # (tensor, layout) of the operator's outputs

    @property
    def call(self) -> GemmCall:
        assert self.mapping.call is not None
        return self.mapping.call

    @property
    def result_layout(self) -> str:
        return dict(self.mapping.layouts)[self.mapping.layouts[2][0]]

    def options(self) -> dict[str, object]:
        return self.call.options() | {"a": self.mapping.a_operand, "bias_batch_stride": self.bias_batch_stride}

    def candidate(self, extra: Mapping[str, object], graph: LayerGraph | None = None) -> Candidate:
        """The row's candidate: the contraction's operands and the bias in, the slices out."""
        graph = graph or layer_graph()
        (a, la), (b, lb), _ = self.mapping.layouts
        return Candidate.make(self.split.contraction, graph.operator(self.split.contraction).pass_, IMPL,
                              {a: la, b: lb, self.split.bias: self.bias_layout}, dict(self.slices),
                              self.options() | dict(extra), covers=(self.split.contraction, self.split.operator))


def broadcast(bias, bias_layout: str, layout: str):
    """A torch bias laid out as `bias_layout`, viewed with unit dims for the letters of `layout` it lacks: what
    adds it to a tensor laid out as `layout`."""
    letters = [d for d in layout if d in bias_layout]
    moved = bias.permute([bias_layout.index(d) for d in letters])
    return moved.reshape([moved.shape[letters.index(d)] if d in bias_layout else 1 for d in layout])


def slice_layouts(split: Split, result_layout: str, graph: LayerGraph | None = None) -> tuple[tuple[str, str], ...]:
    """The layouts of the slices result[0], result[1], ... along the outermost letter, in each output's letters."""
    graph = graph or layer_graph()
    result = graph.operator(split.contraction).outputs[0]
    rest = graph.tensors[result].dims.replace(split.letter, "")
    slices = []
    for name in graph.operator(split.operator).outputs:
        dims = graph.tensors[name].dims  # the result's letters, but K and V index keys by k where QKV has j
        rename = dict(zip([d for d in rest if d not in dims], [d for d in dims if d not in rest]))
        slices.append((name, "".join(rename.get(d, d) for d in result_layout[1:])))
    return tuple(slices)


def bias_epilogue(split: Split, layouts: Mapping[str, str], extents: Mapping[str, int],
                  graph: LayerGraph | None = None) -> BiasEpilogue | str:
    """The epilogue for these operand and result layouts, or why there is none."""
    graph = graph or layer_graph()
    op = graph.operator(split.contraction)
    result = op.outputs[0]
    if layouts[result][0] != split.letter:
        return f"{result}:{layouts[result]} does not start with {split.letter!r}: its slices would not be contiguous"
    mapping = map_contraction(op, layouts, extents, batch_over=split.letter)
    if mapping.call is None:
        return mapping.reason or "no GEMM call"
    groups = letter_groups(op.einsum)
    rows = next(letters for letters in (groups["m"], groups["n"]) if layouts[result][-1] in letters)
    rows = "".join(d for d in layouts[result] if d in rows and d != split.letter)
    bias_letters = graph.tensors[split.bias].dims
    if sorted(split.letter + rows) != sorted(bias_letters):
        return (f"the epilogue adds its bias along {result}'s unit-stride letters {rows!r}, but {split.bias} runs "
                f"over {bias_letters!r}")
    return BiasEpilogue(split, mapping, split.letter + rows, mapping.call.m, slice_layouts(split, layouts[result], graph))


def enumerate_epilogues(extents: Mapping[str, int], graph: LayerGraph | None = None
                        ) -> Iterator[tuple[Split, dict[str, str], BiasEpilogue | str]]:
    """Every layout assignment of every split's contraction whose result starts with the split letter, with its
    epilogue or the reason there is none."""
    graph = graph or layer_graph()
    for split in SPLITS:
        op = graph.operator(split.contraction)
        a, b, result = (*op.inputs, *op.outputs)
        rest = graph.tensors[result].dims.replace(split.letter, "")
        for la, lb, lc in itertools.product(*(map("".join, itertools.permutations(dims))
                                              for dims in (graph.tensors[a].dims, graph.tensors[b].dims, rest))):
            layouts = {a: la, b: lb, result: split.letter + lc}
            yield split, layouts, bias_epilogue(split, layouts, extents, graph)


class BiasEpilogueStep(Step):
    """One cuBLASLt GEMM whose bias epilogue also does the operator that biases and splits its result: the
    result, laid out with the split letter outermost, is allocated whole (under the contraction's output name)
    and its slices are the operator's outputs (Q, K, V), contiguous views of it."""

    def __init__(self, ops: Sequence[Operator], choice: Choice, epilogue: BiasEpilogue, matmul: LtMatmul,
                 algorithm, dtype: torch.dtype, device: torch.device, extents: Mapping[str, int]) -> None:
        super().__init__(ops, choice)
        self.a, self.b = epilogue.mapping.a_operand, epilogue.mapping.b_operand
        self.bias, self.result = epilogue.split.bias, ops[0].outputs[0]
        self.slices = tuple(name for name, _ in epilogue.slices)
        self.outputs = (self.result, *self.slices)
        self.views = {name: (self.result, index) for index, name in enumerate(self.slices)}
        self.shape = tuple(extents[d] for d in epilogue.result_layout)
        self.matmul, self.algorithm, self.dtype, self.device = matmul, algorithm, dtype, device
        self._bias_pointer = None

    def _outputs(self, result: torch.Tensor) -> Env:
        return {self.result: result} | {name: result[index] for index, name in enumerate(self.slices)}

    def __call__(self, env: Env, ctx: StepContext) -> Env:
        result = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        bias = env[self.bias].data_ptr()
        if bias != self._bias_pointer:  # an attribute of the matmul descriptor: set once per parameter storage
            self.matmul.set_epilogue_pointer(bias)
            self._bias_pointer = bias
        self.matmul(env[self.a].data_ptr(), env[self.b].data_ptr(), result.data_ptr(), self.algorithm, ctx.stream)
        return self._outputs(result)

    def meta(self, env: Env, ctx: StepContext) -> Env:
        return self._outputs(torch.empty(self.shape, dtype=self.dtype, device=self.device))


class CublasLtBias(Implementation):
    """A split's contraction and its bias-and-split operator as one cuBLASLt call with the BIAS epilogue."""

    impl = IMPL

    def covers(self, graph: LayerGraph) -> tuple[tuple[str, ...], ...]:
        return tuple((split.contraction, split.operator) for split in SPLITS)

    def candidates(self, ops: Sequence[Operator], size: Size, layouts: Mapping[str, str]
                   ) -> Iterator[Candidate | Infeasible]:
        split = self.split(ops)
        found = bias_epilogue(split, layouts, size.extents)
        if isinstance(found, str):
            yield Infeasible(self.impl, (split.contraction, split.operator), found)
        else:
            yield found.candidate({})

    def split(self, ops: Sequence[Operator]) -> Split:
        found = next((s for s in SPLITS if (s.contraction, s.operator) == tuple(o.name for o in ops)), None)
        if found is None:
            raise self.error(ops, f"covers {[o.name for o in ops]}, which no bias epilogue covers")
        return found

    def cover_layouts(self, ops: Sequence[Operator], config: Configuration) -> dict[str, str]:
        """The operands' layouts and the result's: the split letter before the first slice's letters (the
        result is never stored, so the configuration has no layout of its own for it)."""
        split = self.split(ops)
        first_slice = ops[1].outputs[0]  # Q: the result's letters without the split letter
        (a, b), (result,) = ops[0].inputs, ops[0].outputs
        return {a: config.layout(a), b: config.layout(b), result: split.letter + config.layouts[first_slice]}

    def epilogue(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> BiasEpilogue:
        """The epilogue this choice runs in this configuration at this size: its operand, bias and slice layouts
        must be the configuration's, its call and bias stride those the configuration recorded."""
        split, layouts = self.split(ops), self.cover_layouts(ops, config)
        epilogue = bias_epilogue(split, layouts, size.extents)
        if isinstance(epilogue, str):
            raise self.error(ops, f"cannot run layouts {layouts}: {epilogue}")
        wanted = {split.bias: epilogue.bias_layout, **dict(epilogue.slices)}
        wrong = {t: layout for t, layout in wanted.items() if config.layouts[t] != layout}
        if wrong:
            raise self.error(ops, f"needs {wrong}, the configuration stores {({t: config.layouts[t] for t in wrong})}")
        check_call(ops[0], choice, epilogue.mapping.call, lambda message: self.error(ops, message))
        recorded = choice.options.get("bias_batch_stride", epilogue.bias_batch_stride)
        if recorded != epilogue.bias_batch_stride:
            raise self.error(ops, f"records bias_batch_stride={recorded}, not {epilogue.bias_batch_stride}: the "
                                  "configuration was made for another size")
        return epilogue

    def check(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size) -> None:
        self.epilogue(ops, choice, config, size)

    def bind(self, ops: Sequence[Operator], choice: Choice, config: Configuration, size: Size, dtype: torch.dtype,
             device: torch.device) -> Step:
        epilogue = self.epilogue(ops, choice, config, size)
        matmul = LtMatmul(device_handle(device.index), epilogue.call, dtype, "bias", epilogue.bias_batch_stride)
        algorithm = bound_algorithm(ops, choice, matmul, lambda message: self.error(ops, message))
        return BiasEpilogueStep(ops, choice, epilogue, matmul, algorithm, dtype, device, size.extents)
