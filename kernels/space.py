"""Which layouts the kernel profiler tries for each fused operator (the full space does not fit).

Rule, per tensor of the operator:
1. a tensor that some contraction reads or writes takes every layout in which one strided-batched
   GEMM call can read or write it (the optimizer cannot choose any other layout for it anyway),
   except the user-visible X, Y, dX, dY, which keep `bji`;
   Q, K, V and their gradients also take every layout SDPA reads or writes without a copy (p innermost:
   `sdpa.accepted_layouts`), since an SDPA row may replace the GEMMs that read them;
2. a tensor no contraction touches (softmax's Pr, LayerNorm's N and Rs, biases, the mask) is written
   in the layout of the producing operator's first tensor with the same dims (else its canonical
   layout), and an operator that reads it tries every layout its producer can write.
The cross product of rule-1 choices is sampled down to `max_combos` (seeded), always keeping the
canonical combination, the ones where every tensor has one layout, and those an SDPA row can pair
with: Q, K, V (or dQ, dK, dV) in one p-innermost layout and the stacked tensor with p innermost too;
`coverage` reports the share.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from substation.graph import LayerGraph, Operator, layer_graph
from substation.kernels.sdpa import accepted_layouts
from substation.layouts import USER_VISIBLE
from substation.sizes import Size
from substation.tc_profiling.mapping import gemm_layouts


SDPA_OPERANDS = ("Q", "K", "V", "dQ", "dK", "dV")


@dataclass(frozen=True)
class LayoutSpace:
    combos: tuple[dict[str, str], ...]
    total: int  # combinations before sampling

    @property
    def coverage(self) -> float:
        return len(self.combos) / self.total


def _twin(op: Operator, tensor: str, graph: LayerGraph) -> str | None:
    """The first other tensor of the operator with the same dims, whose layout a derived tensor copies."""
    dims = sorted(graph.tensors[tensor].dims)
    return next((t for t in op.inputs + op.outputs if t != tensor and sorted(graph.tensors[t].dims) == dims
                 and _is_chosen(t, graph)), None)


def _is_chosen(tensor: str, graph: LayerGraph) -> bool:
    """Rule 1 tensors: user-visible, or read or written by some contraction."""
    touching = (*graph.consumers(tensor), graph.producer(tensor))
    return tensor in USER_VISIBLE or any(op is not None and op.is_contraction for op in touching)


def choices(tensor: str, graph: LayerGraph, size: Size) -> tuple[str, ...]:
    """The layouts the profiler tries for a tensor (rules 1 and 2)."""
    canonical = graph.tensors[tensor].dims
    if tensor in USER_VISIBLE:
        return (canonical,)
    gemm = gemm_layouts(size.with_dtype("float16"))
    if tensor in SDPA_OPERANDS:
        return gemm[tensor] + tuple(lay for lay in accepted_layouts(canonical) if lay not in gemm[tensor])
    if tensor in gemm:
        return gemm[tensor]
    producer = graph.producer(tensor)
    twin = _twin(producer, tensor, graph) if producer is not None else None
    return choices(twin, graph, size) if twin else (canonical,)


def _pairs_with_sdpa(combo: dict[str, str]) -> bool:
    """Q, K, V (or dQ, dK, dV) all named, in one p-innermost layout (k read as j), the stacked QKV or dQKV
    with p innermost: what an SDPA row reads, written by qkv_bias (read by qkv_bias_bwd) in one pass."""
    for group, stacked in ((("Q", "K", "V"), "QKV"), (("dQ", "dK", "dV"), "dQKV")):
        if all(t in combo for t in group) and stacked in combo:
            shared = {combo[t].replace("k", "j") for t in group}
            if len(shared) == 1 and combo[group[0]][-1] == "p" and combo[stacked][-1] == "p":
                return True
    return False


def profiled_layout_space(op: Operator, size: Size, max_combos: int = 64, seed: int = 0,
                 graph: LayerGraph | None = None) -> LayoutSpace:
    """The layout combinations to profile for a fused operator (sampled down to `max_combos`)."""
    graph = graph or layer_graph()
    tensors = op.inputs + op.outputs
    follows = {t: _twin(op, t, graph) for t in op.outputs if not _is_chosen(t, graph)}
    free = {t: choices(t, graph, size) for t in tensors if follows.get(t) is None}
    names = list(free)
    combos = [dict(zip(names, c)) for c in itertools.product(*(free[n] for n in names))]
    total = len(combos)
    if total > max_combos:
        keep = [combos[0]] + [c for c in combos[1:] if len(set(c.values())) == 1 or _pairs_with_sdpa(c)]
        rest = [c for c in combos if c not in keep]
        combos = keep + random.Random(seed).sample(rest, max(0, max_combos - len(keep)))
    return LayoutSpace(tuple({t: c.get(t) or c[follows[t]] for t in tensors} for c in combos), total)
