"""The layer graph: structure, einsums against tensor dims, and its networkx export."""
import dataclasses

import networkx as nx
import pytest
import torch

from substation.errors import GraphError
from substation.graph import LayerGraph, Operator, layer_graph, validate
from substation.sizes import Size

GRAPH = layer_graph()
ODD = Size.from_heads(B=2, L=5, H=3, P=2, U=7)


def test_every_computed_tensor_is_produced_exactly_once():
    producers = {}
    for op in GRAPH.operators:
        for name in op.outputs:
            assert name not in producers, f"{name} produced by {producers[name]} and {op.name}"
            producers[name] = op.name
    sources = {n for n, s in GRAPH.tensors.items() if s.role in ("input", "parameter")}
    assert set(producers) == set(GRAPH.tensors) - sources
    assert sources == {"X", "M", "dY", "Wqkv", "bqkv", "Wo", "bo", "g1", "be1", "W1", "b1", "W2", "b2", "g2", "be2"}


def test_operator_counts_and_kinds():
    fwd, bwd = GRAPH.pass_operators("forward"), GRAPH.pass_operators("backward")
    assert (len(fwd), len(bwd)) == (11, 18)
    assert sum(op.is_contraction for op in fwd) == 6
    assert sum(op.is_contraction for op in bwd) == 12  # two gradients per forward contraction
    fused = {op.name for op in GRAPH.operators if not op.is_contraction}
    assert fused == {"qkv_bias", "softmax", "ln1", "bias_gelu", "ln2", "ln2_bwd", "bias_gelu_bwd", "ln1_bwd",
                     "softmax_bwd", "qkv_bias_bwd", "residual_bwd"}


def test_no_dropout_after_gelu():
    assert GRAPH.operator("bias_gelu").dropout_site is None
    sites = {op.dropout_site for op in GRAPH.operators} - {None}
    assert sites == {"attention", "attention_output", "ffn_output"}


def test_every_parameter_gets_a_gradient_and_every_activation_is_used():
    for name, spec in GRAPH.tensors.items():
        if spec.role == "parameter":
            grad = GRAPH.tensor("d" + name)
            assert grad.grad_of == name and grad.dims == spec.dims
            assert GRAPH.producer(grad.name).pass_ == "backward"
    unused = [n for n, s in GRAPH.tensors.items() if not GRAPH.consumers(n) and s.role not in ("output", "gradient")]
    assert unused == []
    assert GRAPH.consumers("Y") == ()


@pytest.mark.parametrize("op", [op for op in GRAPH.operators if op.is_contraction], ids=lambda op: op.name)
def test_contraction_einsum_agrees_with_tensor_shapes(op):
    ext = ODD.extents
    operands = [torch.randn(GRAPH.tensors[n].shape(ext), dtype=torch.float64) for n in op.inputs]
    out = torch.einsum(op.einsum, *operands)
    assert tuple(out.shape) == GRAPH.tensors[op.outputs[0]].shape(ext)
    inputs, output = op.einsum.split("->")
    assert inputs.split(",") == [GRAPH.tensors[n].dims for n in op.inputs]


def _gradient_contraction(operand: str, output: str) -> Operator:
    """The backward contraction that turns the gradient of `output` into a gradient of `operand`."""
    for bwd in GRAPH.pass_operators("backward"):
        if (bwd.is_contraction and GRAPH.tensors[bwd.outputs[0]].grad_of == operand
                and any(GRAPH.tensors[n].grad_of == output for n in bwd.inputs)):
            return bwd
    raise AssertionError(f"no backward contraction gives the gradient of {operand} from that of {output}")


@pytest.mark.parametrize("fwd", [op for op in GRAPH.pass_operators("forward") if op.is_contraction],
                         ids=lambda op: op.name)
def test_backward_contractions_are_the_forward_ones_gradients(fwd):
    ext = ODD.extents
    values = {n: torch.randn(GRAPH.tensors[n].shape(ext), dtype=torch.float64, requires_grad=True)
              for n in fwd.inputs}
    out = torch.einsum(fwd.einsum, *values.values())
    dout = torch.randn_like(out)
    out.backward(dout)
    for operand in fwd.inputs:
        bwd = _gradient_contraction(operand, fwd.outputs[0])
        args = [dout if GRAPH.tensors[n].grad_of == fwd.outputs[0] else values[n].detach() for n in bwd.inputs]
        torch.testing.assert_close(torch.einsum(bwd.einsum, *args), values[operand].grad, msg=bwd.name)


def test_networkx_export_is_a_bipartite_dag():
    g = GRAPH.to_networkx()
    assert nx.is_directed_acyclic_graph(g)
    assert g.number_of_nodes() == len(GRAPH.tensors) + len(GRAPH.operators)
    for u, v in g.edges:
        assert g.nodes[u]["kind"] != g.nodes[v]["kind"]
    assert g.nodes["qkv_proj"]["einsum"] == "bji,thpi->bjthp"
    assert set(g.predecessors("softmax")) == {"S", "M"}


def test_saved_for_backward():
    assert set(GRAPH.saved_for_backward()) == {"Q", "K", "V", "Pr", "A", "Z", "X1", "N1", "Rs1", "F", "H1", "N2",
                                               "Rs2"}


def _broken(**changes) -> LayerGraph:
    ops = list(GRAPH.operators)
    name = changes.pop("op")
    index = next(i for i, op in enumerate(ops) if op.name == name)
    ops[index] = dataclasses.replace(ops[index], **changes)
    return LayerGraph(tensors=dict(GRAPH.tensors), operators=tuple(ops))


@pytest.mark.parametrize("changes, match", [
    (dict(op="bias_gelu", outputs=("F",)), "produced by both"),
    (dict(op="ffn_in", einsum="bji,ui->buj"), "einsum"),
    (dict(op="qkv_bias", inputs=("QKV", "bqkv", "F")), "before any operator"),
    (dict(op="ffn_in", inputs=("X1", "Wnope")), "unknown tensor 'Wnope'"),
    (dict(op="residual_bwd", outputs=("dX1f",)), "produced by both"),
])
def test_validate_rejects_broken_graphs(changes, match):
    with pytest.raises(GraphError, match=match):
        validate(_broken(**changes))


def test_unknown_names_list_the_known_ones():
    with pytest.raises(GraphError, match="known operators: qkv_proj, qkv_bias"):
        GRAPH.operator("attention")
    with pytest.raises(GraphError, match="known tensors: X, M"):
        GRAPH.tensor("QK")
