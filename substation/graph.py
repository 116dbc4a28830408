"""The dataflow graph of one BERT encoder layer (HF `BertLayer`, post-LN), forward and backward, as data.

Dimension letters (lower case, as in layouts): b batch, j query position, k key position, h heads,
p head size, i embedding (= h*p), u FFN width, t which of q/k/v. A tensor's `dims` are its canonical
dimension order, which is also its default layout (PyTorch's own layout of that tensor).

Every operator is either a *contraction* (one einsum over the letters, one GEMM call) or a *fused*
operator (all elementwise and normalization work between two contractions, one kernel). Dropout is
no tensor: fused operators regenerate its mask from (seed, offset, site), so forward and backward agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Literal

import networkx as nx

from substation.errors import GraphError

Pass = Literal["forward", "backward"]
Kind = Literal["contraction", "normalization", "elementwise"]
Role = Literal["input", "parameter", "activation", "gradient", "output"]

# Dropout sites: each fused operator that drops out draws from its own Philox stream.
DROPOUT_SITES = {"attention": 0, "attention_output": 1, "ffn_output": 2}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the layer. `dims` is its canonical letter order (and default layout)."""

    name: str
    dims: str
    role: Role
    doc: str
    grad_of: str | None = None  # for a gradient: the tensor it is the (partial) gradient of

    def shape(self, extents: dict[str, int]) -> tuple[int, ...]:
        return tuple(extents[d] for d in self.dims)


@dataclass(frozen=True)
class Operator:
    """One operator. Contractions carry their einsum over the canonical dims of inputs and output."""

    name: str
    pass_: Pass
    kind: Kind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    doc: str
    einsum: str | None = None
    dropout_site: str | None = None  # which DROPOUT_SITES stream a fused operator draws from
    # A fused operator's arithmetic, for the analysis: flop_per_element per element of flop_tensor.
    flop_per_element: int = 0
    flop_tensor: str | None = None

    @property
    def is_contraction(self) -> bool:
        return self.kind == "contraction"


@dataclass(frozen=True)
class LayerGraph:
    """All tensors and operators (forward in execution order, then backward in execution order)."""

    tensors: dict[str, TensorSpec] = field(hash=False)
    operators: tuple[Operator, ...]
    variant: str = "bert"  # which layer this is the graph of (`VARIANTS`)

    def tensor(self, name: str) -> TensorSpec:
        try:
            return self.tensors[name]
        except KeyError:
            raise GraphError(f"unknown tensor {name!r}; known tensors: {', '.join(self.tensors)}") from None

    def operator(self, name: str) -> Operator:
        for op in self.operators:
            if op.name == name:
                return op
        raise GraphError(f"unknown operator {name!r}; known operators: {', '.join(o.name for o in self.operators)}")

    def pass_operators(self, pass_: Pass) -> tuple[Operator, ...]:
        return tuple(op for op in self.operators if op.pass_ == pass_)

    def producer(self, tensor: str) -> Operator | None:
        """The operator that writes `tensor`, or None for inputs and parameters."""
        return next((op for op in self.operators if tensor in op.outputs), None)

    def consumers(self, tensor: str) -> tuple[Operator, ...]:
        return tuple(op for op in self.operators if tensor in op.inputs)

    def saved_for_backward(self) -> tuple[str, ...]:
        """Forward activations that the backward reads: what autograd must keep between the passes."""
        forward_outputs = {t for op in self.pass_operators("forward") for t in op.outputs}
        backward_inputs = {t for op in self.pass_operators("backward") for t in op.inputs}
        return tuple(t for t in self.tensors if t in forward_outputs & backward_inputs)

    def to_networkx(self) -> nx.DiGraph:
        """A bipartite DiGraph: tensor nodes (kind='tensor') and operator nodes (kind='operator')."""
        graph = nx.DiGraph()
        for spec in self.tensors.values():
            graph.add_node(spec.name, kind="tensor", dims=spec.dims, role=spec.role)
        for op in self.operators:
            graph.add_node(op.name, kind="operator", op_kind=op.kind, pass_=op.pass_, einsum=op.einsum)
            graph.add_edges_from((t, op.name) for t in op.inputs)
            graph.add_edges_from((op.name, t) for t in op.outputs)
        return graph


def _contraction(name: str, pass_: Pass, a: str, b: str, out: str, doc: str, tensors: dict) -> Operator:
    einsum = f"{tensors[a].dims},{tensors[b].dims}->{tensors[out].dims}"
    return Operator(name, pass_, "contraction", (a, b), (out,), doc, einsum=einsum)


def _tensors() -> dict[str, TensorSpec]:
    specs = [
        TensorSpec("X", "bji", "input", "layer input"),
        TensorSpec("M", "bk", "input", "attention mask: 1 keeps a key position, 0 pads it"),
        TensorSpec("Wqkv", "thpi", "parameter", "query/key/value weights (HF query/key/value.weight)"),
        TensorSpec("bqkv", "thp", "parameter", "query/key/value biases"),
        TensorSpec("Wo", "ihp", "parameter", "attention output projection (HF attention.output.dense)"),
        TensorSpec("bo", "i", "parameter", "attention output bias"),
        TensorSpec("g1", "i", "parameter", "LayerNorm 1 weight (HF attention.output.LayerNorm)"),
        TensorSpec("be1", "i", "parameter", "LayerNorm 1 bias"),
        TensorSpec("W1", "ui", "parameter", "FFN in weight (HF intermediate.dense)"),
        TensorSpec("b1", "u", "parameter", "FFN in bias"),
        TensorSpec("W2", "iu", "parameter", "FFN out weight (HF output.dense)"),
        TensorSpec("b2", "i", "parameter", "FFN out bias"),
        TensorSpec("g2", "i", "parameter", "LayerNorm 2 weight (HF output.LayerNorm)"),
        TensorSpec("be2", "i", "parameter", "LayerNorm 2 bias"),
        TensorSpec("QKV", "bjthp", "activation", "X·Wqkv, before the bias"),
        TensorSpec("Q", "bhjp", "activation", "queries, biased"),
        TensorSpec("K", "bhkp", "activation", "keys, biased"),
        TensorSpec("V", "bhkp", "activation", "values, biased"),
        TensorSpec("S", "bhjk", "activation", "attention scores Q·Kᵀ, unscaled"),
        TensorSpec("Pr", "bhjk", "activation", "softmax(S/sqrt(P) + mask): attention probabilities"),
        TensorSpec("A", "bhjk", "activation", "dropout(Pr)"),
        TensorSpec("Z", "bjhp", "activation", "A·V, the attention context"),
        TensorSpec("O", "bji", "activation", "Z·Wo, before the bias"),
        TensorSpec("X1", "bji", "activation", "LayerNorm1(dropout(O + bo) + X)"),
        TensorSpec("N1", "bji", "activation", "LayerNorm 1's normalized input (before gamma/beta)"),
        TensorSpec("Rs1", "bj", "activation", "LayerNorm 1's reciprocal standard deviation"),
        TensorSpec("F", "bju", "activation", "X1·W1, before the bias"),
        TensorSpec("H1", "bju", "activation", "GELU(F + b1)"),
        TensorSpec("G", "bji", "activation", "H1·W2, before the bias"),
        TensorSpec("Y", "bji", "output", "LayerNorm2(dropout(G + b2) + X1): the layer output"),
        TensorSpec("N2", "bji", "activation", "LayerNorm 2's normalized input"),
        TensorSpec("Rs2", "bj", "activation", "LayerNorm 2's reciprocal standard deviation"),
    ]
    specs.append(TensorSpec("dY", "bji", "input", "gradient of the loss w.r.t. Y", grad_of="Y"))
    gradients = [
        ("dR2", "bji", "gradient of LayerNorm 2's input (flows unchanged into the X1 residual)", None),
        ("dG", "bji", "gradient of G (and, summed, of b2)", "G"),
        ("dH1", "bju", "gradient of H1", "H1"),
        ("dF", "bju", "gradient of F (and, summed, of b1)", "F"),
        ("dX1f", "bji", "X1's gradient through the FFN (the part besides the residual)", "X1"),
        ("dR1", "bji", "gradient of LayerNorm 1's input (flows unchanged into the X residual)", None),
        ("dO", "bji", "gradient of O (and, summed, of bo)", "O"),
        ("dZ", "bjhp", "gradient of Z", "Z"),
        ("dA", "bhjk", "gradient of A", "A"),
        ("dV", "bhkp", "gradient of V", "V"),
        ("dS", "bhjk", "gradient of S", "S"),
        ("dQ", "bhjp", "gradient of Q", "Q"),
        ("dK", "bhkp", "gradient of K", "K"),
        ("dQKV", "bjthp", "gradient of QKV (and, summed, of bqkv)", "QKV"),
        ("dXa", "bji", "X's gradient through the attention (the part besides the residual)", "X"),
        ("dX", "bji", "gradient of the loss w.r.t. X", "X"),
    ]
    specs += [TensorSpec(n, d, "gradient", doc, grad_of=g) for n, d, doc, g in gradients]
    for param in [s for s in specs if s.role == "parameter"]:
        specs.append(TensorSpec("d" + param.name, param.dims, "gradient", f"gradient of {param.name}",
                                grad_of=param.name))
    return {s.name: s for s in specs}


def _operators(t: dict[str, TensorSpec]) -> tuple[Operator, ...]:
    fwd: list[Operator] = [
        _contraction("qkv_proj", "forward", "X", "Wqkv", "QKV", "the fused Q, K, V projection", t),
        Operator("qkv_bias", "forward", "elementwise", ("QKV", "bqkv"), ("Q", "K", "V"),
                 "add the biases, split QKV into Q, K, V (K, V indexed by key position k)",
                 flop_per_element=1, flop_tensor="QKV"),
        _contraction("attn_scores", "forward", "Q", "K", "S", "S = Q·Kᵀ", t),
        Operator("softmax", "forward", "normalization", ("S", "M"), ("Pr", "A"),
                 "Pr = softmax_k(S/sqrt(P) + mask); A = dropout(Pr)",
                 dropout_site="attention", flop_per_element=8, flop_tensor="S"),
        _contraction("attn_context", "forward", "A", "V", "Z", "Z = A·V", t),
        _contraction("out_proj", "forward", "Z", "Wo", "O", "the attention output projection", t),
        Operator("ln1", "forward", "normalization", ("O", "bo", "X", "g1", "be1"), ("X1", "N1", "Rs1"),
                 "X1 = LayerNorm(dropout(O + bo) + X) with gamma g1, beta be1",
                 dropout_site="attention_output", flop_per_element=10, flop_tensor="O"),
        _contraction("ffn_in", "forward", "X1", "W1", "F", "the FFN's first projection", t),
        Operator("bias_gelu", "forward", "elementwise", ("F", "b1"), ("H1",), "H1 = GELU_erf(F + b1)",
                 flop_per_element=8, flop_tensor="F"),
        _contraction("ffn_out", "forward", "H1", "W2", "G", "the FFN's second projection", t),
        Operator("ln2", "forward", "normalization", ("G", "b2", "X1", "g2", "be2"), ("Y", "N2", "Rs2"),
                 "Y = LayerNorm(dropout(G + b2) + X1) with gamma g2, beta be2",
                 dropout_site="ffn_output", flop_per_element=10, flop_tensor="G"),
    ]
    bwd: list[Operator] = [
        Operator("ln2_bwd", "backward", "normalization", ("dY", "N2", "Rs2", "g2"),
                 ("dR2", "dG", "dg2", "dbe2", "db2"),
                 "LayerNorm 2 backward, dropout backward, gamma/beta/bias gradient reductions",
                 dropout_site="ffn_output", flop_per_element=13, flop_tensor="dY"),
        _contraction("ffn_out_dgrad", "backward", "dG", "W2", "dH1", "data gradient of ffn_out", t),
        _contraction("ffn_out_wgrad", "backward", "dG", "H1", "dW2", "weight gradient of ffn_out", t),
        Operator("bias_gelu_bwd", "backward", "elementwise", ("dH1", "F", "b1"), ("dF", "db1"),
                 "dF = dH1 · GELU'(F + b1); db1 = Σ_bj dF", flop_per_element=14, flop_tensor="F"),
        _contraction("ffn_in_dgrad", "backward", "dF", "W1", "dX1f", "data gradient of ffn_in", t),
        _contraction("ffn_in_wgrad", "backward", "dF", "X1", "dW1", "weight gradient of ffn_in", t),
        Operator("ln1_bwd", "backward", "normalization", ("dX1f", "dR2", "N1", "Rs1", "g1"),
                 ("dR1", "dO", "dg1", "dbe1", "dbo"),
                 "sum X1's two gradients, LayerNorm 1 backward, dropout backward, reductions",
                 dropout_site="attention_output", flop_per_element=14, flop_tensor="dR2"),
        _contraction("out_proj_dgrad", "backward", "dO", "Wo", "dZ", "data gradient of out_proj", t),
        _contraction("out_proj_wgrad", "backward", "dO", "Z", "dWo", "weight gradient of out_proj", t),
        _contraction("attn_context_dgrad_a", "backward", "dZ", "V", "dA", "dA = dZ·Vᵀ", t),
        _contraction("attn_context_dgrad_v", "backward", "A", "dZ", "dV", "dV = Aᵀ·dZ", t),
        Operator("softmax_bwd", "backward", "normalization", ("dA", "Pr"), ("dS",),
                 "dropout backward, then dS = Pr·(dPr − Σ_k dPr·Pr)/sqrt(P)",
                 dropout_site="attention", flop_per_element=6, flop_tensor="dA"),
        _contraction("attn_scores_dgrad_q", "backward", "dS", "K", "dQ", "dQ = dS·K", t),
        _contraction("attn_scores_dgrad_k", "backward", "dS", "Q", "dK", "dK = dSᵀ·Q", t),
        Operator("qkv_bias_bwd", "backward", "elementwise", ("dQ", "dK", "dV"), ("dQKV", "dbqkv"),
                 "stack dQ, dK, dV into dQKV; dbqkv = Σ_bj dQKV", flop_per_element=1, flop_tensor="dQKV"),
        _contraction("qkv_proj_dgrad", "backward", "dQKV", "Wqkv", "dXa", "data gradient of qkv_proj", t),
        _contraction("qkv_proj_wgrad", "backward", "dQKV", "X", "dWqkv", "weight gradient of qkv_proj", t),
        Operator("residual_bwd", "backward", "elementwise", ("dXa", "dR1"), ("dX",),
                 "dX = dXa + dR1: X's gradients through the attention and the residual",
                 flop_per_element=1, flop_tensor="dX"),
    ]
    return tuple(fwd + bwd)


# Layer variant -> (its tensors, its operators over them). A second variant (pre-LN, ReLU) is one more entry; the
# graph is then passed down to whatever runs or profiles that layer.
VARIANTS = {"bert": (_tensors, _operators)}  # HF BertLayer: post-LN, exact erf GELU


@cache
def layer_graph(variant: str = "bert") -> LayerGraph:
    """The graph of a layer variant (built once per variant; it does not depend on the problem size)."""
    if variant not in VARIANTS:
        raise GraphError(f"unknown layer variant {variant!r}; known: {', '.join(VARIANTS)}")
    make_tensors, make_operators = VARIANTS[variant]
    tensors = make_tensors()
    graph = LayerGraph(tensors=tensors, operators=make_operators(tensors), variant=variant)
    validate(graph)
    return graph


def validate(graph: LayerGraph) -> None:
    """Structural checks: names resolve, every non-input tensor is produced exactly once, einsums agree."""
    produced: dict[str, str] = {}
    for op in graph.operators:
        for name in op.inputs + op.outputs:
            graph.tensor(name)
        for name in op.inputs:
            if graph.tensors[name].role not in ("input", "parameter") and name not in produced:
                raise GraphError(f"{op.name} reads {name!r} before any operator listed earlier writes it")
        for name in op.outputs:
            if name in produced:
                raise GraphError(f"tensor {name!r} is produced by both {produced[name]!r} and {op.name!r}")
            produced[name] = op.name
        if op.is_contraction:
            operands = ",".join(graph.tensors[n].dims for n in op.inputs)
            if op.einsum != f"{operands}->{graph.tensors[op.outputs[0]].dims}":
                raise GraphError(f"{op.name}: einsum {op.einsum!r} does not match its tensors' dims")
    for spec in graph.tensors.values():
        is_source = spec.role in ("input", "parameter")
        if is_source == (spec.name in produced):
            raise GraphError(f"tensor {spec.name!r} ({spec.role}) must be produced "
                             f"{'by no operator' if is_source else 'exactly once'}")
