"""One configuration for several sizes: profiles of one layer shape (H, P, U) in one dtype on one GPU at several
batch sizes and lengths, combined so that the selection ILP, unchanged, minimizes the weighted sum of the layer's
times at those sizes; and any selection read at another profile's size.

A configuration keeps, at every size, each choice's covers, implementation, layouts and size-free options: a
kernel's variant knobs, an SDPA backend and its mask. A GEMM row's options are instead its call at the profiled
size (m, n, k, leading dimensions, strides) and the cuBLASLt algorithm timed there; at another size the runtime maps
the call again. So a row's *key* is (covers, pass, impl, layouts) plus its options unless the implementation is a
GEMM call (`call_impls`), and a key costs, at each size, its best row there. The combined profile has one row per
key measured at every size, costing the weighted sum of those best times; its options and label are the first
(primary) size's, whose GEMM calls the configuration file records. Keys measured at some sizes only are left out
and counted (`Combined.dropped`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from substation.config_selection.profiles import TRANSPOSE_PREFIX, CandidateRow, Profile
from substation.config_selection.selection import (ChosenRow, Selection, Transpose, default_configuration,
                                                   transpose_cost)
from substation.errors import SelectionError
from substation.graph import LayerGraph
from substation.implementations import registry
from substation.sizes import size_name
from substation.kernels.gemm_epilogue import GemmEpilogue
from substation.tc_profiling.epilogues import CublasLtBias
from substation.tc_profiling.gemm import GemmImplementation

Key = tuple[tuple[str, ...], str, str, tuple[tuple[str, str], ...], str]


def call_impls(graph: LayerGraph) -> frozenset[str]:
    """The implementations whose options are one library call at the profiled size: the GEMMs, the bias epilogue,
    the GEMMs with our epilogues (whose tile shape a configuration keeps at every size, `GemmEpilogue.at_size`)."""
    found = [implementation for kind in (GemmImplementation, CublasLtBias, GemmEpilogue)
             for implementation in registry(graph).of_type(kind)]
    return frozenset(implementation.impl for implementation in found)


def row_key(row: CandidateRow, calls: frozenset[str]) -> Key:
    """What a configuration keeps of the row at every size (the module docstring)."""
    return row.covers, row.pass_, row.impl, row.layouts, "" if row.impl in calls else row.options


def best_by_key(profile: Profile, calls: frozenset[str]) -> dict[Key, CandidateRow]:
    """The cheapest row of each key, in the profile's row order."""
    best: dict[Key, CandidateRow] = {}
    for row in profile.rows:
        key = row_key(row, calls)
        if key not in best or row.median_us < best[key].median_us:
            best[key] = row
    return best


@dataclass(frozen=True)
class Combined:
    """The profiles of several sizes as one: `profile` is what the ILP reads (module docstring)."""

    profile: Profile
    parts: tuple[Profile, ...]  # the profile of each size, the primary first
    weights: tuple[float, ...]
    dropped: int  # keys measured at some of the sizes only


def combine_profiles(profiles: Sequence[Profile], weights: Sequence[float], graph: LayerGraph) -> Combined:
    """One profile whose rows cost the weighted sum over the sizes; SelectionError where the profiles are not one
    layer shape, dtype and GPU at distinct sizes, or where an operator has no key measured at every size. One
    profile is its own combination, its rows as they are."""
    _check_one_layer(profiles, weights)
    if len(profiles) == 1:
        return Combined(profiles[0], tuple(profiles), tuple(weights), 0)
    calls = call_impls(graph)
    best = [best_by_key(profile, calls) for profile in profiles]
    common = [key for key in best[0] if all(key in other for other in best[1:])]
    rows = tuple(dataclasses.replace(best[0][key], index=n,
                                     median_us=sum(w * at[key].median_us for w, at in zip(weights, best)))
                 for n, key in enumerate(common))
    bare = [op.name for op in graph.operators if not any(op.name in row.covers for row in rows)]
    if bare:
        raise SelectionError(f"no candidate of {', '.join(bare)} was measured at every size "
                             f"({', '.join(p.path for p in profiles)}); profile them alike")
    digest = hashlib.sha256("".join(profile.sha256 for profile in profiles).encode()).hexdigest()
    profile = Profile(" + ".join(p.path for p in profiles), tuple(f"{p.path}/{f}" for p in profiles for f in p.files),
                      digest, profiles[0].size, profiles[0].gpu, profiles[0].dropout, rows,
                      _weighted_transposes(profiles, weights, graph))
    return Combined(profile, tuple(profiles), tuple(weights), len(set().union(*best)) - len(common))


def _check_one_layer(profiles: Sequence[Profile], weights: Sequence[float]) -> None:
    if len(weights) != len(profiles):
        raise SelectionError(f"{len(weights)} weights for {len(profiles)} profiles: give one weight per profile")
    if any(not (0 < w < math.inf) for w in weights):
        raise SelectionError(f"weights {list(weights)}: each must be a positive finite number")
    first = profiles[0]
    for profile in profiles[1:]:
        shape = {d: v for d, v in profile.size.dims().items() if d not in "BL"}
        want = {d: v for d, v in first.size.dims().items() if d not in "BL"}
        if shape != want or profile.size.dtype != first.size.dtype or profile.gpu != first.gpu:
            raise SelectionError(f"{profile.path} is of {shape}, {profile.size.dtype} on {profile.gpu!r}; "
                                 f"{first.path} of {want}, {first.size.dtype} on {first.gpu!r}: one configuration "
                                 "serves one layer shape in one dtype on one GPU (only B and L may differ)")
        if profile.dropout != first.dropout:
            raise SelectionError(f"{profile.path} was timed at dropout {profile.dropout}, {first.path} at "
                                 f"{first.dropout}: the sizes of one configuration are weighed at one dropout")
    names = [size_name(profile.size) for profile in profiles]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SelectionError(f"several profiles of size {', '.join(twice)} "
                             f"({', '.join(p.path for p in profiles if size_name(p.size) in twice)}): give each "
                             "size once")


def _weighted_transposes(profiles: Sequence[Profile], weights: Sequence[float],
                         graph: LayerGraph) -> dict[str, CandidateRow]:
    """Each split candidate's transpose as one row costing the weighted sum of its cost at each size."""
    rows = {}
    for tensor in graph.saved_for_backward():
        costs = [transpose_cost(profile, graph, tensor) for profile in profiles]
        label = "; ".join(f"{size_name(p.size)}: {source}" for p, (_, source) in zip(profiles, costs))
        rows[tensor] = CandidateRow(-1, TRANSPOSE_PREFIX + tensor, "forward", (TRANSPOSE_PREFIX + tensor,), (),
                                    "weighted", "{}", f"weighted over sizes ({label})",
                                    sum(w * us for w, (us, _) in zip(weights, costs)), "")
    return rows


def at_size(selection: Selection, profile: Profile, graph: LayerGraph) -> Selection:
    """The selection's configuration read with another profile of its layer shape: each chosen row replaced by
    the best row of its key there, the transposes, default configuration and best rows that profile's.
    SelectionError naming the operators whose choice the profile has no row for."""
    calls = call_impls(graph)
    best = best_by_key(profile, calls)
    missing = [choice.row.label for choice in selection.choices if row_key(choice.row, calls) not in best]
    if missing:
        raise SelectionError(f"{profile.path} has no row for the configuration's {'; '.join(missing)}: it cannot "
                             f"price the configuration at {size_name(profile.size)}")
    choices = tuple(ChosenRow(best[row_key(c.row, calls)], profile.best_us[c.row.covers]) for c in selection.choices)
    transposes = tuple(Transpose(t.tensor, t.forward, t.backward, *transpose_cost(profile, graph, t.tensor))
                       for t in selection.transposes)
    return dataclasses.replace(selection, size=profile.size, gpu=profile.gpu, choices=choices, transposes=transposes,
                               default=default_configuration(profile, graph), profile_path=profile.path,
                               profile_sha256=profile.sha256, profile_dropout=profile.dropout)


@dataclass(frozen=True)
class AtSize:
    """A configuration read at one of the sizes it serves, and that size's weight in the objective."""

    selection: Selection
    weight: float


def for_sizes(selection: Selection, combined: Combined, graph: LayerGraph) -> tuple[AtSize, ...]:
    """A selection made on `combined.profile` at each of its sizes (`at_size`), the primary first; the selection
    as it is where there is one size."""
    if len(combined.parts) == 1:
        return (AtSize(selection, combined.weights[0]),)
    return tuple(AtSize(at_size(selection, profile, graph), w) for profile, w in zip(combined.parts, combined.weights))


def weighted_total_us(sizes: Sequence[AtSize]) -> float:
    """The objective over several sizes: each size's predicted total times its weight."""
    return sum(at.weight * at.selection.predicted_total_us for at in sizes)


def format_sizes(sizes: Sequence[AtSize], dropped: int) -> str:
    """What the printed report adds for several sizes: each size's total, the weighted total, what was left out."""
    lines = [f"at {size_name(at.selection.size)} (weight {at.weight:g}, {at.selection.profile_path}): predicted "
             f"{at.selection.predicted_total_us:.2f} us" + _beside_default(at.selection) for at in sizes]
    lines.append(f"weighted total over {len(sizes)} sizes: {weighted_total_us(sizes):.2f} us; {dropped} candidates "
                 "measured at some of the sizes only were left out")
    return "\n".join(lines)


def _beside_default(selection: Selection) -> str:
    default = selection.default.total_us
    return "" if default is None else f", default configuration {default:.2f} us"

