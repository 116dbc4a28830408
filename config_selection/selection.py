"""The optimizer's answer (`Selection`), the default configuration it is compared with, and the printed table.

The **default configuration** is the PyTorch-style baseline on the same profile: every tensor in its
canonical layout (`TensorSpec.dims`), every operator run on its own (a row whose `covers` is just that
operator), by the cheapest ok row whose implementation is one of `DEFAULT_IMPLS` (cuBLAS / cuBLASLt for
a contraction, PyTorch's op sequence for a fused operator) and whose every tensor is in canonical layout.
If some operator has no such row, the default has no total and `missing` names those operators.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import pandas as pd

from substation.analysis import ITEMSIZE
from substation.config_selection.ilp import SolveStats
from substation.config_selection.profiles import CandidateRow, Profile
from substation.graph import LayerGraph
from substation.sizes import Size

DEFAULT_IMPLS = ("cublas", "cublaslt", "torch")
# Without a profiled `transpose_<T>` row, a split variable's transpose is estimated as one read and one
# write of the tensor at the H100's measured copy bandwidth (docs/DESIGN.md: 2.97 TB/s, rounded down).
TRANSPOSE_BYTES_PER_S = 2.9e12


@dataclass(frozen=True)
class Transpose:
    """A split variable stored in the forward as `forward` and transposed to `backward` for the backward's readers."""

    tensor: str
    forward: str
    backward: str
    us: float
    source: str  # "profile: <label>" or "estimate: ..."


@dataclass(frozen=True)
class ChosenRow:
    """A chosen row, and the cheapest row of the profile covering the same operators (any layouts)."""

    row: CandidateRow
    best_us: float

    @property
    def gap_us(self) -> float:
        """What the global choice cost this piece against its own unconstrained best row."""
        return self.row.median_us - self.best_us


@dataclass(frozen=True)
class DefaultConfiguration:
    """Canonical layouts, one unfused cublas/cublaslt/torch row per operator (see the module docstring)."""

    rows: tuple[CandidateRow, ...]
    missing: tuple[str, ...]  # operators without a canonical single-operator row of those implementations

    @property
    def total_us(self) -> float | None:
        return None if self.missing else sum(row.median_us for row in self.rows)


@dataclass(frozen=True)
class Selection:
    """One layout per tensor and one row per operator, chosen for a profile by one graph order.

    `layouts` gives every tensor its (forward) layout, e.g. {"X": "bji", "QKV": "bjthp", ...}; tensors in
    `unmaterialized` live only inside a chosen multi-operator row and carry their canonical layout.
    `split_vars` are the tensors the backward reads in a layout of their own, each converted at the end of the
    forward (`transposes`, in the same order); `backward` gives each that layout.
    """

    size: Size
    gpu: str
    graph_order: str
    split_vars: tuple[str, ...]
    free_user_layouts: bool
    layouts: Mapping[str, str]
    backward: Mapping[str, str]
    unmaterialized: tuple[str, ...]
    choices: tuple[ChosenRow, ...]  # in graph order of each row's first covered operator
    transposes: tuple[Transpose, ...]
    default: DefaultConfiguration
    solves: tuple[SolveStats, ...]
    profile_path: str
    profile_sha256: str
    profile_dropout: float | None  # the dropout probability the profile's kernels ran with (None: none did)
    excluded_impls: tuple[str, ...] = ()  # implementations whose rows the ILP left out

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", MappingProxyType(dict(self.layouts)))
        object.__setattr__(self, "backward", MappingProxyType(dict(self.backward)))

    @property
    def predicted_total_us(self) -> float:
        """The chosen rows' medians plus the split variables' transposes."""
        return sum(c.row.median_us for c in self.choices) + sum(t.us for t in self.transposes)

    @property
    def optimal(self) -> bool:
        """False if any solve stopped at its time limit with an incumbent not proven optimal."""
        return all(stats.optimal for stats in self.solves)

    def choice_for(self, op: str) -> ChosenRow:
        return next(c for c in self.choices if op in c.row.covers)


def default_configuration(profile: Profile, graph: LayerGraph) -> DefaultConfiguration:
    """The PyTorch-style baseline on this profile (module docstring); `missing` names operators without one."""
    best: dict[str, CandidateRow] = {}
    for row in profile.rows:
        op = row.covers[0]
        if (len(row.covers) == 1 and row.impl in DEFAULT_IMPLS
                and all(layout == graph.tensors[t].dims for t, layout in row.layouts)
                and (op not in best or row.median_us < best[op].median_us)):
            best[op] = row
    missing = tuple(op.name for op in graph.operators if op.name not in best)
    return DefaultConfiguration(tuple(best[op.name] for op in graph.operators if op.name in best), missing)


def transpose_cost(profile: Profile, graph: LayerGraph, tensor: str) -> tuple[float, str]:
    """(µs, source) of transposing `tensor`: the cheapest `transpose_<tensor>` row, else the bandwidth estimate."""
    row = profile.transposes.get(tensor)
    if row is not None:
        return row.median_us, f"profile: {row.label}"
    nbytes = math.prod(graph.tensors[tensor].shape(profile.size.extents)) * ITEMSIZE[profile.size.dtype]
    us = 2 * nbytes / TRANSPOSE_BYTES_PER_S * 1e6
    return us, f"estimate: 2 x {nbytes} B / {TRANSPOSE_BYTES_PER_S:g} B/s (no transpose_{tensor} row)"


def _layouts_text(row: CandidateRow) -> str:
    return " ".join(f"{t}:{layout}" for t, layout in row.layouts)


def _piece(row: CandidateRow) -> str:
    """The operator a row covers, or `first +N` for a row covering N more (SDPA: `attn_scores +2`)."""
    return row.covers[0] + (f" +{len(row.covers) - 1}" if len(row.covers) > 1 else "")


def selection_table(selection: Selection) -> pd.DataFrame:
    """One line per chosen row (and per transpose): impl, layouts, µs, share of the total, best, gap.

    `best_us` is the cheapest row of the profile covering the same operators in any layouts, `gap_us`
    what the global choice cost the row against it.
    """
    total = selection.predicted_total_us
    lines = [{"operator": _piece(c.row), "impl": c.row.impl, "layouts": _layouts_text(c.row),
              "predicted_us": c.row.median_us, "share_pct": 100 * c.row.median_us / total,
              "best_us": c.best_us, "gap_us": c.gap_us} for c in selection.choices]
    lines += [{"operator": f"transpose {t.tensor}", "impl": t.source.split(":")[0],
               "layouts": f"{t.tensor}:{t.forward} -> {t.tensor}:{t.backward}", "predicted_us": t.us,
               "share_pct": 100 * t.us / total, "best_us": math.nan, "gap_us": math.nan} for t in selection.transposes]
    return pd.DataFrame(lines, columns=["operator", "impl", "layouts", "predicted_us", "share_pct", "best_us",
                                        "gap_us"])


def _solver_summary(solves: Sequence[SolveStats]) -> str:
    return "; ".join(f"{s.solver} {s.status} in {s.seconds:.2f} s ({s.operators} operators, {s.binaries} binaries, "
                     f"{s.constraints} constraints)" for s in solves)


def format_report(selection: Selection) -> str:
    """The printed choice: the table, the layout conversions (split variables), predicted total, and the default
    configuration beside it."""
    size = selection.size
    table = selection_table(selection).to_string(index=False, float_format=lambda v: f"{v:.2f}", na_rep="")
    dropout = "no dropout" if selection.profile_dropout is None else f"dropout {selection.profile_dropout:g}"
    lines = [f"{selection.graph_order} on {selection.profile_path} ({size.dims()}, {size.dtype}, {selection.gpu}, "
             f"{dropout})", table]
    lines += [f"layout conversion {t.tensor}: {t.forward} -> {t.backward} for the backward, {t.us:.2f} us ({t.source})"
              for t in selection.transposes] or ["layout conversions: none (the backward reads every tensor in its "
                                                 "forward layout)"]
    if selection.unmaterialized:
        lines.append(f"not materialized (inside a chosen multi-operator row): {' '.join(selection.unmaterialized)}")
    lines.append(f"predicted total: {selection.predicted_total_us:.2f} us"
                 f"{'' if selection.optimal else ' (NOT proven optimal: a solve hit its time limit)'}; "
                 f"{_solver_summary(selection.solves)}")
    default = selection.default.total_us
    if default is None:
        lines.append(f"default configuration: none: no canonical-layout single-operator {'/'.join(DEFAULT_IMPLS)} "
                     f"row for {', '.join(selection.default.missing)}")
    else:
        lines.append(f"default configuration (canonical layouts, cheapest unfused {'/'.join(DEFAULT_IMPLS)} row per "
                     f"operator): {default:.2f} us; chosen is {default / selection.predicted_total_us:.2f}x faster")
    return "\n".join(lines)
