"""Map a contraction under given layouts onto one cuBLAS strided-batched GEMM call, or say why not.

The einsum's letters fall into four groups: batch (in both operands and the result), M (first operand
and result), N (second operand and result) and K (both operands, summed). One strided-batched call
can execute the layouts when, in every tensor, each group's letters are adjacent and in the same
order as in the other tensors (so the group flattens to one index with one stride), and each
tensor's innermost letter belongs to one of its two matrix groups (cuBLAS needs a unit stride).

cuBLAS is column-major: the group with unit stride is a matrix's rows. The result's unit-stride
group therefore decides which operand goes first: with N innermost in the result, the call computes
Cᵀ = Bᵀ·Aᵀ, so the second operand of the einsum becomes cuBLAS's A.

`batch_over` moves letters of the M or N group into the batch, the operand without them read at batch
stride 0 (a broadcast): QKV laid out `tbjhp` is then three GEMMs over t, one call, where no plain
mapping exists (t is not adjacent to h, p). The profiler uses it only for the bias epilogue's rows
(`tc_profiling/epilogues.py`), whose Q, K, V are QKV's slices along an outermost t.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from substation.graph import LayerGraph, Operator, layer_graph
from substation.sizes import Size

@dataclass(frozen=True)
class GemmCall:
    """The arguments of one cublasGemmStridedBatchedEx call (column-major): C = op(A)·op(B) per batch."""

    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int

    @property
    def flop(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    def options(self) -> dict[str, object]:
        """The call's arguments as profile-row options."""
        return {"transa": "T" if self.transa else "N", "transb": "T" if self.transb else "N", "m": self.m,
                "n": self.n, "k": self.k, "lda": self.lda, "ldb": self.ldb, "ldc": self.ldc,
                "stride_a": self.stride_a, "stride_b": self.stride_b, "stride_c": self.stride_c,
                "batch": self.batch}


@dataclass(frozen=True)
class GemmMapping:
    """A contraction's layouts and the call that executes them (`call` None: `reason` says why not)."""

    op: str
    layouts: tuple[tuple[str, str], ...]  # (tensor, layout) for the two operands, then the result
    call: GemmCall | None
    a_operand: str | None = None  # the graph tensor passed as cuBLAS's A (the other one is B)
    b_operand: str | None = None
    reason: str | None = None


def letter_groups(einsum: str) -> dict[str, str]:
    """Group letters of an einsum `ab,bc->ac`, each in the order the result (or first operand) has them."""
    inputs, out = einsum.split("->")
    a, b = inputs.split(",")
    order = out + a + b
    ordered = lambda letters: "".join(sorted(set(letters), key=order.index))  # noqa: E731
    return {"batch": ordered(set(a) & set(b) & set(out)), "m": ordered((set(a) & set(out)) - set(b)),
            "n": ordered((set(b) & set(out)) - set(a)), "k": ordered((set(a) & set(b)) - set(out))}


def _span(layout: str, letters: str) -> str | None:
    """The group's letters as they appear in the layout, or None unless they are adjacent."""
    positions = sorted(layout.index(d) for d in letters)
    if positions != list(range(positions[0], positions[0] + len(positions))):
        return None
    return layout[positions[0]:positions[-1] + 1]


def _stride(layout: str, letters: str, extents: Mapping[str, int]) -> int:
    """Row-major stride of a flattened group: the product of the extents of the letters inside it."""
    last = max(layout.index(d) for d in letters)
    return math.prod(extents[d] for d in layout[last + 1:])


def map_contraction(op: Operator, layouts: Mapping[str, str], extents: Mapping[str, int],
                    batch_over: str = "") -> GemmMapping:
    """The GEMM call that computes `op` with its tensors in `layouts`, or the reason there is none;
    `batch_over`: M or N letters to batch over, broadcasting the operand that lacks them."""
    (a, b), (c,) = op.inputs, op.outputs
    roles = {a: ("m", "k"), b: ("k", "n"), c: ("m", "n")}
    pairs = tuple((t, layouts[t]) for t in (a, b, c))
    groups = letter_groups(op.einsum)
    infeasible = lambda why: GemmMapping(op.name, pairs, None, reason=why)  # noqa: E731
    if batch_over:
        moved = next((g for g in ("m", "n") if set(batch_over) < set(groups[g])), None)
        if moved is None or groups["batch"]:
            return infeasible(f"batch_over={batch_over!r} must be some, not all, letters of the M or N group "
                              f"({groups['m']!r}, {groups['n']!r}) of a contraction without batch letters")
        groups = groups | {"batch": batch_over, moved: "".join(d for d in groups[moved] if d not in batch_over)}
    if not (groups["m"] and groups["n"] and groups["k"]):
        return infeasible("an empty M, N or K group: not a GEMM")
    order: dict[str, str] = {}
    for tensor, layout in pairs:
        for group in ("batch", *roles[tensor]):
            if not groups[group] or not set(groups[group]) <= set(layout):  # a broadcast operand lacks the batch
                continue
            span = _span(layout, groups[group])
            if span is None:
                return infeasible(f"{group.upper()} letters {groups[group]!r} are not adjacent in {tensor}:{layout}")
            if order.setdefault(group, span) != span:
                return infeasible(f"{group.upper()} letters are ordered {order[group]!r} in one tensor "
                                  f"but {span!r} in {tensor}:{layout}")
    inner = {}
    for tensor, layout in pairs:
        inner[tensor] = next((g for g in roles[tensor] if layout[-1] in groups[g]), None)
        if inner[tensor] is None:
            return infeasible(f"innermost letter {layout[-1]!r} of {tensor}:{layout} is a batch letter: "
                              "no unit stride for the GEMM")
    ext = lambda group: math.prod(extents[d] for d in groups[group])  # noqa: E731
    stride = lambda tensor, group: _stride(layouts[tensor], groups[group], extents)  # noqa: E731
    # Column-major rows are the unit-stride group; C's decides which operand cuBLAS sees first.
    first, second = (a, b) if inner[c] == "m" else (b, a)
    rows, cols = ("m", "n") if inner[c] == "m" else ("n", "m")
    outer = lambda tensor: next(g for g in roles[tensor] if g != inner[tensor])  # noqa: E731
    batch = ext("batch") if groups["batch"] else 1
    batch_stride = lambda tensor: (stride(tensor, "batch")  # noqa: E731
                                   if groups["batch"] and set(groups["batch"]) <= set(layouts[tensor]) else 0)
    call = GemmCall(
        transa=inner[first] == "k", transb=inner[second] != "k",
        m=ext(rows), n=ext(cols), k=ext("k"),
        lda=stride(first, outer(first)), ldb=stride(second, outer(second)), ldc=stride(c, cols),
        stride_a=batch_stride(first), stride_b=batch_stride(second), stride_c=batch_stride(c), batch=batch)
    return GemmMapping(op.name, pairs, call, a_operand=first, b_operand=second)


def enumerate_mappings(op: Operator, extents: Mapping[str, int], dims: Mapping[str, str]) -> Iterator[GemmMapping]:
    """Every layout assignment of the contraction's operands and result, feasible or not."""
    tensors = (*op.inputs, *op.outputs)
    orders = [("".join(p) for p in itertools.permutations(dims[t])) for t in tensors]
    for combo in itertools.product(*(list(o) for o in orders)):
        yield map_contraction(op, dict(zip(tensors, combo)), extents)


@functools.cache
def gemm_layouts(size: Size, graph: LayerGraph | None = None) -> dict[str, tuple[str, ...]]:
    """Every layout in which some feasible GEMM mapping reads or writes each tensor of the graph."""
    graph = graph or layer_graph()
    dims = {name: spec.dims for name, spec in graph.tensors.items()}
    found: dict[str, set[str]] = defaultdict(set)
    for op in graph.operators:
        if op.is_contraction:
            for mapping in enumerate_mappings(op, size.extents, dims):
                if mapping.call is not None:
                    for tensor, layout in mapping.layouts:
                        found[tensor].add(layout)
    return {t: tuple(sorted(ls, key=lambda lay: (lay != dims[t], lay))) for t, ls in found.items()}
