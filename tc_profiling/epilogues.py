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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from substation.graph import LayerGraph, layer_graph
from substation.records import Candidate
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
