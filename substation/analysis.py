"""Flop and minimum data movement of every operator: the table the paper opens with.

Minimum bytes: every input read once and every output written once, in the given dtype. A
contraction's flop is 2 per multiply-add of its einsum; a fused operator's is its per-element
count (`Operator.flop_per_element`) times the elements of the tensor it iterates over.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd

from substation.graph import LayerGraph, Operator, layer_graph
from substation.sizes import Size

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# Rates measured on an H100 80GB HBM3 (docs/DESIGN.md): fp16 tensor-core matmul and device-to-device copy.
H100_MATMUL_TFLOPS = 750.0
H100_COPY_TBS = 2.97
KINDS = ("contraction", "normalization", "elementwise")


@dataclass(frozen=True)
class OperatorCost:
    op: str
    pass_: str
    kind: str
    flop: int
    bytes: int


def _numel(graph: LayerGraph, tensor: str, size: Size) -> int:
    return math.prod(graph.tensors[tensor].shape(size.extents))


def operator_cost(op: Operator, size: Size, graph: LayerGraph) -> OperatorCost:
    ext = size.extents
    if op.is_contraction:
        letters = set(op.einsum.replace(",", "").replace("->", ""))
        flop = 2 * math.prod(ext[d] for d in letters)
    else:
        flop = op.flop_per_element * _numel(graph, op.flop_tensor, size)
    moved = sum(_numel(graph, t, size) for t in op.inputs + op.outputs) * ITEMSIZE[size.dtype]
    return OperatorCost(op.name, op.pass_, op.kind, flop, moved)


def operator_costs(size: Size, graph: LayerGraph | None = None) -> pd.DataFrame:
    """One row per operator: op, pass, kind, flop, bytes (forward operators first)."""
    graph = graph or layer_graph()
    rows = [asdict(operator_cost(op, size, graph)) for op in graph.operators]
    return pd.DataFrame(rows).rename(columns={"pass_": "pass"})


def totals_by_kind(costs: pd.DataFrame, matmul_tflops: float = H100_MATMUL_TFLOPS,
                   copy_tbs: float = H100_COPY_TBS) -> pd.DataFrame:
    """Per kind: flop and bytes with their shares, and the time each takes at the given rates.

    `flop_us` is the time at the matmul rate, `bytes_us` at the copy rate; `bound_us` sums, per
    operator, the larger of the two: the roofline time of that kind's operators.
    """
    per_op_bound = [max(f / (matmul_tflops * 1e6), b / (copy_tbs * 1e6)) for f, b in zip(costs.flop, costs.bytes)]
    costs = costs.assign(bound_us=per_op_bound)
    totals = costs.groupby("kind").agg(flop=("flop", "sum"), bytes=("bytes", "sum"), bound_us=("bound_us", "sum"))
    totals = totals.reindex([k for k in KINDS if k in totals.index])
    totals.loc["total"] = totals.sum()
    totals["flop_pct"] = 100 * totals.flop / totals.flop["total"]
    totals["bytes_pct"] = 100 * totals.bytes / totals.bytes["total"]
    totals["flop_us"] = totals.flop / (matmul_tflops * 1e6)
    totals["bytes_us"] = totals.bytes / (copy_tbs * 1e6)
    columns = ["flop", "flop_pct", "bytes", "bytes_pct", "flop_us", "bytes_us", "bound_us"]
    return totals[columns].reset_index().rename(columns={"index": "kind"})


def plot_shares(totals: pd.DataFrame, path: str, title: str) -> None:
    """A bar chart of flop share beside byte share for each kind of operator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = totals[totals.kind != "total"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(kinds))
    ax.bar([x - 0.2 for x in xs], kinds.flop_pct, width=0.4, label="% of flop")
    ax.bar([x + 0.2 for x in xs], kinds.bytes_pct, width=0.4, label="% of bytes moved")
    ax.set_xticks(list(xs), kinds.kind)
    ax.set_ylabel("share (%)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
