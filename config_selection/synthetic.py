"""Synthetic profiles: a fake runner writing `contractions.csv` and `kernels.csv` with analytic, seeded times.

For developing and testing the optimizer without a GPU. Rows go through `RecordWriter`, exactly as the
profilers write them. Times (µs, deterministic for a given `SyntheticSpec`):

- contractions (impl `cublaslt`): every layout combination one strided-batched GEMM can run
  (`map_contraction`), `algorithms` rows each: launch + flop / 600 TFLOP/s, times a layout penalty
  (transposed operands, a seeded per-layout factor) and a seeded per-algorithm factor;
  plus one `torch` row at canonical layouts (einsum; a copy of the result where no single GEMM fits).
- fused operators (impl `kernel`): the canonical layout combination of the operator's tensors and up to
  `fused_combos` more, all of them or a seeded sample, from the product of each tensor's *useful* layouts
  (those every neighbouring contraction can run as one GEMM, see `_Runner._useful_layouts`); launch +
  bytes / 2.9 TB/s, times a penalty that grows with the number of distinct innermost letters
  (uncoalesced access) and a seeded factor; plus one `torch` row at canonical layouts (several
  launches and passes).
- optional `sdpa_flash` rows covering the attention subgraph: forward (attn_scores, softmax, attn_context:
  Q, K, V, M -> Z) and backward (the five attention backward operators: dZ, Q, K, V, Z, M -> dQ, dK, dV),
  over the same (Q, K, V, Z) layouts with the head-size letter p innermost, as flash attention needs;
  `sdpa_backends` adds the same rows for other backends (`sdpa_efficient`, `sdpa_cudnn`), `sdpa_factors`
  scales each backend's forward and backward times (to make mixing backends across passes look cheap).
- optional `transpose_<T>` rows in kernels.csv, `failed_ops` (rows written as failed) and `omit_ops`.

`free_tensors` keeps a profile small enough to brute-force: every other tensor appears only in its
canonical layout.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from substation.version import __version__
from substation.analysis import ITEMSIZE
from substation.config_selection.profiles import CONTRACTIONS_CSV, KERNELS_CSV, TRANSPOSE_PREFIX
from substation.graph import LayerGraph, Operator, layer_graph
from substation.kernels.sdpa import BACKWARD_COVERS, FORWARD_COVERS, IMPLS, MASKED
from substation.layouts import USER_VISIBLE, enumerate_layouts, tied_layouts
from substation.records import DEFAULT_DROPOUT, Candidate, ProfileRow, RecordWriter
from substation.sizes import Size
from substation.tc_profiling.mapping import map_contraction

SYNTHETIC_GPU = "Synthetic GPU (analytic times, sm_90)"
VERSIONS = {"substation": __version__, "timing": "synthetic"}
FLOP_PER_US = 600e6  # 600 TFLOP/s
BYTES_PER_US = 2.9e6  # 2.9 TB/s
LAUNCH_US = 3.0


@dataclass(frozen=True)
class SyntheticSpec:
    """What to write. The defaults give a layer-shaped profile of about 8k rows."""

    size: Size
    seed: int = 0
    algorithms: int = 4  # cublaslt rows per feasible GEMM layout
    fused_combos: int = 512  # kernel rows per fused operator (fewer if it has fewer combinations)
    free_user_layouts: bool = False  # whether fused rows time X, Y, dX, dY in other layouts than bji
    sdpa: bool = True
    sdpa_combos: int = 128  # (Q, K, V, Z) layout combinations of the sdpa_flash rows
    # SDPA backends with rows (flash: options {"backend": "flash"}; others also {"mask": true}), and
    # (backend, forward factor, backward factor) multiplying their times (default 1)
    sdpa_backends: tuple[str, ...] = ("flash",)
    sdpa_factors: tuple[tuple[str, float, float], ...] = ()
    free_tensors: tuple[str, ...] | None = None  # None: every tensor free; else the others stay canonical
    noise: float = 0.05
    transpose_rows: tuple[str, ...] = ()  # tensors T that get a `transpose_<T>` row in kernels.csv
    failed_ops: tuple[str, ...] = ()  # operators whose rows are all written as failed
    omit_ops: tuple[str, ...] = ()  # operators that get no rows at all
    gpu: str = SYNTHETIC_GPU
    dropout: float = DEFAULT_DROPOUT  # the kernel rows' probability (the contraction rows have none, as profiled)


@functools.cache
def gemm_combos(graph: LayerGraph) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Per contraction, every layout combination of (inputs, output) that one strided-batched GEMM can run.

    (Whether one call fits depends on the layouts only, not on the extents.)
    """
    unit = dict.fromkeys("bjkhpiut", 2)
    combos = {}
    for op in graph.operators:
        if op.is_contraction:
            tensors = (*op.inputs, *op.outputs)
            every = itertools.product(*(enumerate_layouts(graph.tensors[t].dims) for t in tensors))
            combos[op.name] = tuple(c for c in every if map_contraction(op, dict(zip(tensors, c)), unit).call)
    return combos


class _Runner:
    """Generates the rows of one spec, drawing every random number from one seeded stream, in graph order."""

    def __init__(self, spec: SyntheticSpec, graph: LayerGraph) -> None:
        self.spec, self.graph = spec, graph
        self.contractions = {op.name for op in graph.operators if op.is_contraction}
        self.rng = random.Random(spec.seed)
        self.ext = spec.size.extents
        self.useful = self._useful_layouts()

    def _useful_layouts(self) -> dict[str, list[str]]:
        """Per tensor, canonical first: the layouts every contraction touching it can run as one GEMM.

        Tensors no contraction touches take the useful layouts of the tensors with the same dims (N1 those of
        X1, Pr those of S); user-visible tensors stay canonical unless the spec frees them. A real kernel
        profiler would not time layouts no neighbouring GEMM can produce or consume either.
        """
        per_op: dict[str, list[set[str]]] = {name: [] for name in self.graph.tensors}
        for name, combos in gemm_combos(self.graph).items():
            op = self.graph.operator(name)
            for position, tensor in enumerate((*op.inputs, *op.outputs)):
                per_op[tensor].append({combo[position] for combo in combos})
        by_dims: dict[str, set[str]] = {}
        for name, sets in per_op.items():
            if sets:
                by_dims.setdefault(self.graph.tensors[name].dims, set()).update(set.intersection(*sets))
        useful = {}
        for name, spec in self.graph.tensors.items():
            layouts = set.intersection(*per_op[name]) if per_op[name] else by_dims.get(
                spec.dims, set(enumerate_layouts(spec.dims)))
            fixed_user = name in USER_VISIBLE and not self.spec.free_user_layouts
            vector = not per_op[name] and (spec.role == "parameter" or name in tied_layouts(self.graph))
            if fixed_user or vector:  # biases, LayerNorm weights and their gradients: one canonical layout
                layouts = set()
            allowed = self.allowed(name)
            useful[name] = [spec.dims] + sorted(lay for lay in layouts if lay in allowed and lay != spec.dims)
        return useful

    def allowed(self, tensor: str) -> list[str]:
        dims = self.graph.tensors[tensor].dims
        free = self.spec.free_tensors is None or tensor in self.spec.free_tensors
        return enumerate_layouts(dims) if free else [dims]

    def nbytes(self, tensor: str) -> int:
        return math.prod(self.graph.tensors[tensor].shape(self.ext)) * ITEMSIZE[self.spec.size.dtype]

    def jitter(self) -> float:
        return 1.0 + self.spec.noise * self.rng.random()

    def row(self, candidate: Candidate, median_us: float) -> ProfileRow:
        spec = self.spec
        dropout = None if candidate.op in self.contractions else spec.dropout
        if any(op in spec.failed_ops for op in candidate.covers):
            return ProfileRow.make(candidate, spec.size, spec.gpu, VERSIONS, runs=0, median_us=None, min_us=None,
                                   status="failed", error="CUBLAS_STATUS_NOT_SUPPORTED (synthetic failure)",
                                   dropout=dropout)
        return ProfileRow.make(candidate, spec.size, spec.gpu, VERSIONS, runs=20, median_us=median_us,
                               min_us=median_us * 0.97, dropout=dropout)

    def skip(self, covers: Sequence[str]) -> bool:
        return any(op in self.spec.omit_ops for op in covers)

    # -- contractions ------------------------------------------------------------------------------------

    def contraction_rows(self, op: Operator) -> Iterator[ProfileRow]:
        tensors = (*op.inputs, *op.outputs)
        flop = 2 * math.prod(self.ext[d] for d in set(op.einsum.replace(",", "").replace("->", "")))
        base = flop / FLOP_PER_US
        for combo in gemm_combos(self.graph)[op.name]:
            if not all(layout in self.allowed(t) for t, layout in zip(tensors, combo)):
                continue
            layouts = dict(zip(tensors, combo))
            mapping = map_contraction(op, layouts, self.ext)
            call = mapping.call
            assert call is not None  # gemm_combos holds feasible combinations only
            layout_factor = 1.0 + 0.08 * call.transa + 0.05 * call.transb + 0.25 * self.rng.random()
            for algo in range(self.spec.algorithms):
                median = LAUNCH_US + base * layout_factor * (0.95 + 0.3 * self.rng.random()) * self.jitter()
                candidate = Candidate.make(op.name, op.pass_, "cublaslt", {t: layouts[t] for t in op.inputs},
                                           {t: layouts[t] for t in op.outputs},
                                           call.options() | {"algo": algo, "a": mapping.a_operand})
                yield self.row(candidate, median)
        canonical = {t: self.graph.tensors[t].dims for t in tensors}
        copy_us = 0.0 if map_contraction(op, canonical, self.ext).call else LAUNCH_US + 2 * self.nbytes(
            op.outputs[0]) / BYTES_PER_US
        candidate = Candidate.make(op.name, op.pass_, "torch", {t: canonical[t] for t in op.inputs},
                                   {t: canonical[t] for t in op.outputs}, {"einsum": op.einsum})
        yield self.row(candidate, (LAUNCH_US + base * 1.15 + copy_us) * self.jitter())

    # -- fused operators ---------------------------------------------------------------------------------

    def combos(self, tensors: Sequence[str], count: int, inner: str = "") -> list[tuple[str, ...]]:
        """The canonical combination, then up to `count` more: all of, or a seeded sample from, the product of
        useful layouts (only those whose innermost letter is in `inner`, if given, for tensors of 2+ dims)."""
        choices = [[lay for lay in self.useful[t] if not inner or len(lay) < 2 or lay[-1] in inner]
                   or [self.useful[t][0]] for t in tensors]
        found = dict.fromkeys([tuple(self.graph.tensors[t].dims for t in tensors)])
        total = math.prod(map(len, choices))
        if total <= count:
            found.update(dict.fromkeys(itertools.product(*choices)))
            return list(found)
        for _ in range(20 * count):
            if len(found) > count:
                break
            found[tuple(self.rng.choice(c) for c in choices)] = None
        return list(found)

    def fused_time(self, tensors: Sequence[str], layouts: Sequence[str]) -> float:
        inner = {layout[-1] for layout in layouts if len(layout) > 1}
        factor = 1.0 + 0.3 * max(len(inner) - 1, 0) + 0.2 * self.rng.random()
        return (LAUNCH_US + sum(map(self.nbytes, tensors)) / BYTES_PER_US * factor) * self.jitter()

    def fused_rows(self, op: Operator) -> Iterator[ProfileRow]:
        tensors = tuple(dict.fromkeys((*op.inputs, *op.outputs)))
        for combo in self.combos(tensors, self.spec.fused_combos):
            layouts = dict(zip(tensors, combo))
            candidate = Candidate.make(op.name, op.pass_, "kernel", {t: layouts[t] for t in op.inputs},
                                       {t: layouts[t] for t in op.outputs}, {"vec": 8 if combo[0][-1] != "b" else 1})
            yield self.row(candidate, self.fused_time(tensors, combo))
        canonical = {t: self.graph.tensors[t].dims for t in tensors}
        launches = 4 if op.kind == "normalization" else 2
        candidate = Candidate.make(op.name, op.pass_, "torch", {t: canonical[t] for t in op.inputs},
                                   {t: canonical[t] for t in op.outputs}, {"launches": launches})
        torch_us = launches * LAUNCH_US + 2.5 * sum(map(self.nbytes, tensors)) / BYTES_PER_US
        yield self.row(candidate, torch_us * self.jitter())

    # -- SDPA and transposes -----------------------------------------------------------------------------

    def sdpa_rows(self) -> Iterator[ProfileRow]:
        """Flash attention forward and backward over the same seeded (Q, K, V, Z) layouts, p innermost.

        The backward writes each gradient in its tensor's layout (dQ like Q, ...) and reads dZ like Z, as
        PyTorch's flash backward does; it also reads Z and the mask, which none of its covered operators
        touch (extras in the ILP).
        """
        flop = 2 * math.prod(self.ext[d] for d in "bhjkp")
        mask = self.graph.tensors["M"].dims
        for q, k, v, z in self.combos(("Q", "K", "V", "Z"), self.spec.sdpa_combos, inner="p"):
            if not all(layout in self.allowed(t) for t, layout in zip(("dQ", "dK", "dV", "dZ"), (q, k, v, z))):
                continue  # a small profile keeps every tensor but the free ones canonical
            factors = {backend: (f, b) for backend, f, b in self.spec.sdpa_factors}
            for backend in self.spec.sdpa_backends:
                forward_factor, backward_factor = factors.get(backend, (1.0, 1.0))
                passes = [(FORWARD_COVERS, {"Q": q, "K": k, "V": v, "M": mask}, {"Z": z}, 2 * flop / 0.7,
                           forward_factor),
                          (BACKWARD_COVERS, {"dZ": z, "Q": q, "K": k, "V": v, "Z": z, "M": mask},
                           {"dQ": q, "dK": k, "dV": v}, 5 * flop / 0.55, backward_factor)]
                options = {"backend": backend} | ({} if backend == "flash" else {"mask": MASKED[backend]})
                for covers, inputs, outputs, work, factor in passes:
                    first = self.graph.operator(covers[0])
                    if self.skip(covers):
                        continue
                    if not MASKED[backend] and backend != "flash":  # as profiled: no M (flash's rows keep it)
                        inputs = {name: layout for name, layout in inputs.items() if name != "M"}
                    candidate = Candidate.make(first.name, first.pass_, IMPLS[backend], inputs, outputs,
                                               options, covers=covers)
                    median = LAUNCH_US + work / FLOP_PER_US * (1 + 0.2 * self.rng.random())
                    yield self.row(candidate, median * self.jitter() * factor)

    def transpose_row(self, tensor: str) -> ProfileRow:
        dims = self.graph.tensors[tensor].dims
        candidate = Candidate.make(TRANSPOSE_PREFIX + tensor, "backward", "kernel", {}, {tensor: dims})
        return self.row(candidate, (LAUNCH_US + 2.2 * self.nbytes(tensor) / BYTES_PER_US) * self.jitter())

    def kernel_rows(self) -> Iterator[ProfileRow]:
        for op in self.graph.operators:
            if not op.is_contraction and not self.skip([op.name]):
                yield from self.fused_rows(op)
        if self.spec.sdpa:
            yield from self.sdpa_rows()
        for tensor in self.spec.transpose_rows:
            yield self.transpose_row(tensor)

    def contraction_rows_all(self) -> Iterator[ProfileRow]:
        for op in self.graph.operators:
            if op.is_contraction and not self.skip([op.name]):
                yield from self.contraction_rows(op)


def write_synthetic_profile(directory: str | Path, spec: SyntheticSpec, graph: LayerGraph | None = None,
                            files: Sequence[str] = (CONTRACTIONS_CSV, KERNELS_CSV)) -> list[Path]:
    """Write the spec's rows into `directory` (contractions.csv and/or kernels.csv); returns the paths written."""
    runner = _Runner(spec, graph or layer_graph())
    directory = Path(directory)
    sources = {CONTRACTIONS_CSV: runner.contraction_rows_all, KERNELS_CSV: runner.kernel_rows}
    written = []
    for name in (CONTRACTIONS_CSV, KERNELS_CSV):
        rows = sources[name]()  # generated even when not written, so the other file's times stay the same
        if name not in files:
            for _ in rows:
                pass
            continue
        with RecordWriter(directory / name) as writer:
            for row in rows:
                writer.write(row)
        written.append(directory / name)
    return written
