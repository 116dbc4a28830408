"""The three graph orders, one signature: `(profile, graph, options) -> Selection`.

- `combined`: one ILP over the forward and the backward operators.
- `bp_first`: an ILP over the backward operators first; the layouts (or absence) it chose for every slot it
  touches are then fixed, and a second ILP covers the forward operators.
- `fp_first`: the reverse.
A split variable T (`SelectOptions.split_vars`) has its own backward layout; the transpose between the two is
paid in the ILP that decides the second of them (`selection.transpose_cost`: a profiled `transpose_T` row or
the labelled bandwidth estimate). By default every tensor the backward reads from the forward may be split, so
the ILP itself inserts a conversion wherever the passes' choices conflict or a transpose pays; `split_vars`
overrides that set. The first ILP of bp_first/fp_first looks ahead: it covers the second pass's operators too,
at no cost, so it minimizes its own pass's time over the choices the second pass can complete, and never
strands it (parameters and their gradients share one layout: no split frees them). `combined` is never worse
than the other two: with the same split variables, their answers are feasible points of its model. The time
limit covers all ILPs of one call.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from substation.config_selection import GRAPH_ORDERS
from substation.config_selection.ilp import Solution, SolverOptions, solve
from substation.config_selection.problem import (BACKWARD, Fixed, SelectionProblem, SlotMap, State, build_problem,
                                                 coupling_key, user_visible_fixes)
from substation.config_selection.profiles import CandidateRow, Profile
from substation.config_selection.selection import (ChosenRow, DefaultConfiguration, Selection, Transpose,
                                                   default_configuration, transpose_cost)
from substation.errors import InfeasibleError, SelectionError
from substation.graph import LayerGraph, Pass
from substation.implementations import registry
from substation.protocol import Registry

log = logging.getLogger(__name__)

_PHASES: dict[str, tuple[tuple[Pass, ...], ...]] = {
    "combined": (("forward", "backward"),),
    "bp_first": (("backward",), ("forward",)),
    "fp_first": (("forward",), ("backward",)),
}


@dataclass(frozen=True)
class SelectOptions:
    """What the user may choose besides the graph order."""

    # None: any tensor the backward reads from the forward may take a backward layout of its own, where the ILP
    # finds the transpose pays or the passes conflict; a tuple: exactly these may (an override; () none).
    split_vars: tuple[str, ...] | None = None
    free_user_layouts: bool = False
    solver: SolverOptions = field(default_factory=SolverOptions)
    # False: the layer is never called with a padding mask, so rows that take none (SDPA flash, options
    # {"mask": false}) may be chosen; by default they are left out.
    padding_mask: bool = True
    # Implementations never chosen, e.g. ("torch",): PyTorch's matmul writes no float32 weight gradient for
    # float32 weights under autocast, a cast the profile does not time.
    exclude_impls: tuple[str, ...] = ()
    # True: rows whose results may differ in their last bits from run to run (float atomics: our attention's
    # fuse_dq=4, PyTorch's SDPA backwards) may be chosen; by default they are left out.
    nondeterministic: bool = False


def masked_rows_only(profile: Profile) -> Profile:
    """The profile without rows that cannot apply a padding mask (options {"mask": false})."""
    keep = tuple(row for row in profile.rows if row.options_dict.get("mask", True) is not False)
    if len(keep) == len(profile.rows):
        return profile
    log.info("left out %d rows that take no padding mask (--no-padding-mask allows them)",
             len(profile.rows) - len(keep))
    return dataclasses.replace(profile, rows=keep)


def row_deterministic(row: CandidateRow, implementations: Registry) -> bool:
    """Whether the row gives the same bits on every run, as its implementation says (`Implementation.deterministic`)."""
    return implementations.find(row.impl, row.covers).deterministic(row.pass_, row.options_dict)


def deterministic_rows_only(profile: Profile, graph: LayerGraph) -> Profile:
    """The profile without rows that are not deterministic (`row_deterministic`)."""
    implementations = registry(graph)
    keep = tuple(row for row in profile.rows if row_deterministic(row, implementations))
    if len(keep) == len(profile.rows):
        return profile
    log.info("left out %d rows that are not deterministic (--nondeterministic allows them)",
             len(profile.rows) - len(keep))
    return dataclasses.replace(profile, rows=keep)


def without_impls(profile: Profile, graph: LayerGraph, impls: Iterable[str]) -> Profile:
    """The profile without the rows of `impls`; SelectionError naming an unknown implementation, or the operators
    no row of another implementation covers."""
    impls = set(impls)
    unknown = sorted(impls - set(registry(graph).names))
    if unknown:
        raise SelectionError(f"cannot exclude {', '.join(unknown)}: no such implementation; known: "
                             f"{', '.join(registry(graph).names)}")
    keep = tuple(row for row in profile.rows if row.impl not in impls)
    covered = {op for row in keep for op in row.covers}
    stranded = [op for op in dict.fromkeys(op for row in profile.rows for op in row.covers) if op not in covered]
    if stranded:
        raise SelectionError(f"excluding {', '.join(sorted(impls))} leaves no row for {', '.join(stranded)}")
    return dataclasses.replace(profile, rows=keep)


def check_split_vars(graph: LayerGraph, split_vars: Iterable[str] | None) -> tuple[str, ...]:
    """The tensors the ILP may split, each once (None: every one that may be split); SelectionError naming the
    tensors that may be split otherwise."""
    allowed = graph.saved_for_backward()
    if split_vars is None:
        return allowed
    split_vars = tuple(dict.fromkeys(split_vars))
    unknown = [t for t in split_vars if t not in allowed]
    if unknown:
        raise SelectionError(f"split_vars {unknown}: a split variable is a forward activation the backward reads, "
                             f"one of: {' '.join(allowed)}")
    return split_vars


def combined(profile: Profile, graph: LayerGraph, options: SelectOptions = SelectOptions()) -> Selection:
    """One ILP over the whole layer, forward and backward."""
    return _run("combined", profile, graph, options)


def bp_first(profile: Profile, graph: LayerGraph, options: SelectOptions = SelectOptions()) -> Selection:
    """The backward's ILP first; its layouts of shared tensors are fixed for the forward's."""
    return _run("bp_first", profile, graph, options)


def fp_first(profile: Profile, graph: LayerGraph, options: SelectOptions = SelectOptions()) -> Selection:
    """The forward's ILP first; its layouts of shared tensors are fixed for the backward's."""
    return _run("fp_first", profile, graph, options)


SELECTORS: dict[str, Callable[[Profile, LayerGraph, SelectOptions], Selection]] = {
    "combined": combined, "bp_first": bp_first, "fp_first": fp_first}


def optimize(profile: Profile, graph: LayerGraph, graph_order: str,
             options: SelectOptions = SelectOptions()) -> Selection:
    """Dispatch to the selector named `graph_order`."""
    if graph_order not in SELECTORS:
        raise SelectionError(f"graph_order={graph_order!r}, expected one of {', '.join(GRAPH_ORDERS)}")
    return SELECTORS[graph_order](profile, graph, options)


def _run(order: str, profile: Profile, graph: LayerGraph, options: SelectOptions) -> Selection:
    split = check_split_vars(graph, options.split_vars)
    default = default_configuration(profile, graph)  # PyTorch's baseline, whatever the ILP may choose from
    if options.padding_mask:
        profile = masked_rows_only(profile)
    if not options.nondeterministic:
        profile = deterministic_rows_only(profile, graph)
    profile = without_impls(profile, graph, options.exclude_impls)
    slots = SlotMap.of(graph, split)
    costs = {t: transpose_cost(profile, graph, t) for t in split}
    deadline = time.monotonic() + options.solver.time_limit_s
    fixed = user_visible_fixes(graph, slots, options.free_user_layouts)
    solutions: list[Solution] = []
    states: dict[str, State] = {}
    earlier_keys: frozenset[str] | None = None  # coupling keys (SDPA backends) the earlier pass chose
    phases = _PHASES[order]
    for n, passes in enumerate(phases):
        earlier = {s: Fixed(state, f"decided by the first pass of {order}") for s, state in states.items()}
        operators = _operators(graph, passes)
        later_passes = [p for phase in phases[n + 1:] for p in phase]
        later = _operators(graph, later_passes)
        # The later pass pays the transposes; looking ahead, a split variable need only exist in both or neither.
        prices = {t: 0.0 if later else us for t, (us, _) in costs.items()}
        what = f"{order}, {'+'.join(passes)} operators" + (
            f", looking ahead to the {'+'.join(later_passes)} operators" if later else "")
        try:
            problem = build_problem(profile, graph, operators, slots, earlier | fixed, prices, earlier_keys, later)
            solution = _own_part(problem, solve(problem, options.solver, max(1.0, deadline - time.monotonic())),
                                 operators)
        except InfeasibleError as err:
            raise InfeasibleError(f"{what}: {err}") from None
        log.info("%s: %.2f us", what, solution.stats.objective_us)
        solutions.append(solution)
        states.update(solution.states)
        chosen = {key for key in (coupling_key(row, graph) for row in solution.rows) if key is not None}
        earlier_keys = frozenset(chosen | (earlier_keys or set()))
    return _selection(order, profile, default, graph, options, split, slots, solutions, costs)


def _operators(graph: LayerGraph, passes: Sequence[Pass]) -> list[str]:
    return [op.name for op in graph.operators if op.pass_ in passes]


def _own_part(problem: SelectionProblem, solution: Solution, operators: Sequence[str]) -> Solution:
    """What an ILP decides for `operators`: their rows and the slots they touch, without its look-ahead's."""
    own = set(operators)
    rows = tuple(row for row in solution.rows if own.issuperset(row.covers))
    touched = {link.slot for link in problem.links if link.op in own}
    touched |= {slot for i, slot, _ in problem.extras if own.issuperset(problem.rows[i].covers)}
    return Solution(rows, {s: state for s, state in solution.states.items() if s in touched}, solution.stats)


def _selection(order: str, profile: Profile, default: DefaultConfiguration, graph: LayerGraph,
               options: SelectOptions, split: Sequence[str], slots: SlotMap, solutions: Sequence[Solution],
               costs: dict[str, tuple[float, str]]) -> Selection:
    """Assemble the answer: every tensor's layout, split variables' backward layouts and transposes, rows."""
    states: dict[str, State] = {}
    for solution in solutions:
        states.update(solution.states)
    layouts, unmaterialized = {}, []
    for name, spec in graph.tensors.items():
        slot = slots.slot(name, "forward")
        state = states.get(slot, spec.dims)  # a tensor no row names keeps its canonical layout
        if state is None:
            unmaterialized.append(name)
        layouts[name] = state or spec.dims
    backward = {t: states.get(t + BACKWARD) or layouts[t] for t in split}
    transposes = tuple(Transpose(t, layouts[t], backward[t], *costs[t]) for t in split
                       if t not in unmaterialized and backward[t] != layouts[t])
    converted = {t.tensor: t.backward for t in transposes}  # a split variable whose layouts agree is no split
    position = {op.name: i for i, op in enumerate(graph.operators)}
    rows = sorted((row for s in solutions for row in s.rows), key=lambda row: position[row.covers[0]])
    return Selection(profile.size, profile.gpu, order, tuple(converted), options.free_user_layouts, layouts, converted,
                     tuple(unmaterialized), tuple(ChosenRow(row, profile.best_us[row.covers]) for row in rows),
                     transposes, default, tuple(s.stats for s in solutions),
                     profile.path, profile.sha256, profile.dropout, tuple(sorted(set(options.exclude_impls))))
