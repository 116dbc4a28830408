"""The selection problem one ILP solves: operators to cover, candidate rows, and the layout *slots* rows link.

A **slot** is what one set of layout binaries decides. It is a tensor's layout, shared by the tensor's
tied gradient (`dWqkv` is stored like `Wqkv`, see `tied_layouts`); a split variable T has a second slot
`T@bwd` that the backward's readers use. A slot's **state** is one of its layouts, or None: the tensor
is not materialized, because it lives only inside a multi-operator cover (SDPA's S, Pr, A).

A **link** ties an operator to a tensor it reads or writes and that at least one of its candidate rows
names: whichever row covers the operator fixes the slot's state (the row's layout of the tensor, or None
if the row does not name it). A tensor that a row names although none of its covered operators touches
it (an SDPA backward row reading the mask) is an **extra**: the row may only run if the slot has that
layout. A **coupling** ties rows that only work as a pair: an SDPA forward row of backend X (and mask
option) leaves the logsumexp and dropout RNG state that only the backward row of the same backend reads, so
the forward and the backward choose SDPA rows of one key together (`coupling_key`). `build_problem` also
presolves: it propagates the links until every slot's domain and every
row agree (arc consistency), and raises `InfeasibleError` naming the tensors when a domain empties.
Operators in `look_ahead` are covered like the others but their rows cost nothing: the first ILP of
bp_first/fp_first only has to leave the second pass a cover, not pay for it.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

import networkx as nx

from substation.config_selection.profiles import CandidateRow, Profile
from substation.errors import InfeasibleError
from substation.graph import LayerGraph, Pass
from substation.implementations import registry
from substation.layouts import USER_VISIBLE, tied_layouts

log = logging.getLogger(__name__)

BACKWARD = "@bwd"  # suffix of a split variable's backward slot
State = str | None  # a layout, or None: not materialized


@dataclass(frozen=True)
class SlotMap:
    """Which slot a tensor uses in each pass: ties merge gradients into their parameter's slot."""

    ties: Mapping[str, str]
    split_vars: frozenset[str]

    @classmethod
    def of(cls, graph: LayerGraph, split_vars: Iterable[str] = ()) -> SlotMap:
        return cls(tied_layouts(graph), frozenset(split_vars))

    def slot(self, tensor: str, pass_: Pass) -> str:
        base = self.ties.get(tensor, tensor)
        return base + BACKWARD if pass_ == "backward" and base in self.split_vars else base

    @staticmethod
    def tensor(slot: str) -> str:
        """The tensor whose layout the slot decides (a split variable's name for both its slots)."""
        return slot.removesuffix(BACKWARD)

    def partner(self, slot: str) -> str | None:
        """The other slot of a split variable, None for any other slot."""
        base = self.tensor(slot)
        if base not in self.split_vars:
            return None
        return base if slot.endswith(BACKWARD) else base + BACKWARD


@dataclass(frozen=True)
class Fixed:
    """A slot's state decided before this ILP, and why (user-visible, or an earlier pass of bp_first/fp_first)."""

    state: State
    reason: str


@dataclass(frozen=True)
class Link:
    """Operator `op` touches `tensor`; the row covering `op` decides the state of `slot`."""

    op: str
    tensor: str
    slot: str


@dataclass(frozen=True)
class SplitPair:
    """A split variable's forward and backward slots; `transpose_us` is paid where their layouts differ."""

    tensor: str
    forward: str
    backward: str
    transpose_us: float


def coupling_key(row: CandidateRow, graph: LayerGraph) -> str | None:
    """The pair a row belongs to: rows of a coupled implementation (an SDPA backend) with one mask option, forward
    and backward, else None."""
    if not registry(graph).coupled(row.impl):
        return None
    masked = row.options_dict.get("mask", True)
    return row.impl if masked else f"{row.impl} (no mask)"


@dataclass(frozen=True)
class Coupling:
    """sum(y[forward]) - sum(y[backward]) == rhs. rhs is 0 when both passes are in the problem; with one pass
    only (the second ILP of bp_first/fp_first), the rows of the pass present must add up to what the earlier
    pass chose (1: it chose a row of this key, 0: it did not), signed as the side present."""

    key: str
    forward: tuple[int, ...]  # positions in SelectionProblem.rows
    backward: tuple[int, ...]
    rhs: int


@dataclass(frozen=True)
class SelectionProblem:
    """One ILP's input. Rows are those whose covers lie in `operators` and that survived presolve."""

    operators: tuple[str, ...]
    rows: tuple[CandidateRow, ...]
    links: tuple[Link, ...]
    extras: tuple[tuple[int, str, str], ...]  # (position in rows, slot, layout the row needs)
    domains: Mapping[str, frozenset[State]]  # slot -> states it may take
    split_pairs: tuple[SplitPair, ...]
    fixed: Mapping[str, Fixed]
    splittable: frozenset[str] = frozenset()  # tensors --split_vars accepts, for the advice in errors
    split_vars: frozenset[str] = frozenset()  # those the problem already splits (none to suggest again)
    couplings: tuple[Coupling, ...] = ()
    look_ahead: frozenset[str] = frozenset()  # operators covered at no cost (see the module docstring)

    def price(self, row: CandidateRow) -> float:
        """What choosing the row costs in the objective: its median, or nothing for a look-ahead operator's."""
        return 0.0 if self.look_ahead.issuperset(row.covers) else row.median_us

    def row_state(self, row: CandidateRow, link: Link) -> State:
        """The state the row gives the link's slot: its layout of the tensor, or None if it does not name it."""
        return row.layout_of.get(link.tensor)

    def ignores(self, row: CandidateRow, link: Link) -> bool:
        """Whether the row leaves the link's slot free: it does not name a tensor that exists whatever the rows
        choose (an input, such as the padding mask M, which an attention taking no mask does not read)."""
        return _ignores(row, link, self.domains)

    def layouts(self, slot: str) -> list[str]:
        """The slot's possible layouts, sorted (one binary each)."""
        return sorted(state for state in self.domains[slot] if state is not None)

    def to_networkx(self) -> nx.DiGraph:
        """The selection graph: row -> operator edges (covers), row -> tensor-slot edges (layout, None: hidden)."""
        graph = nx.DiGraph()
        graph.add_nodes_from((("op", op) for op in self.operators), kind="operator")
        graph.add_nodes_from(((("slot", s), {"kind": "slot", "domain": sorted(map(str, d))})
                              for s, d in self.domains.items()))
        links_of = defaultdict(list)
        for link in self.links:
            links_of[link.op].append(link)
        for position, row in enumerate(self.rows):
            node = ("row", position)
            graph.add_node(node, kind="row", label=row.label, impl=row.impl, median_us=row.median_us)
            for op in row.covers:
                graph.add_edge(node, ("op", op))
                for link in links_of[op]:
                    graph.add_edge(node, ("slot", link.slot), layout=self.row_state(row, link))
        for position, slot, layout in self.extras:
            graph.add_edge(("row", position), ("slot", slot), layout=layout, extra=True)
        return graph


def _ignores(row: CandidateRow, link: Link, domains: Mapping[str, Set[State]]) -> bool:
    return link.tensor not in row.layout_of and None not in domains[link.slot]


def can_be_absent(graph: LayerGraph, slots: SlotMap, slot: str) -> bool:
    """Whether a slot may hold no layout: only a produced tensor, not an input or a parameter (nor its gradient,
    which shares the parameter's slot)."""
    return graph.producer(slots.tensor(slot)) is not None


USER_VISIBLE_REASON = "user-visible (--free-user-layouts frees it)"


def user_visible_fixes(graph: LayerGraph, slots: SlotMap, free_user_layouts: bool) -> dict[str, Fixed]:
    """X, Y, dX, dY keep their canonical layout (`bji`) unless the user frees them."""
    if free_user_layouts:
        return {}
    return {slots.slot(t, "forward"): Fixed(graph.tensors[t].dims, USER_VISIBLE_REASON)
            for t in USER_VISIBLE}


def _links(graph: LayerGraph, slots: SlotMap, operators: Sequence[str], rows: Sequence[CandidateRow]) -> list[Link]:
    """(op, tensor) for every tensor an operator touches that at least one of its rows names."""
    named: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        for op in row.covers:
            named[op].update(row.layout_of)
    links = []
    for name in operators:
        op = graph.operator(name)
        links += [Link(name, t, slots.slot(t, op.pass_)) for t in dict.fromkeys(op.inputs + op.outputs)
                  if t in named[name]]
    return links


def _extras(graph: LayerGraph, slots: SlotMap, rows: Sequence[CandidateRow]) -> list[tuple[int, str, str]]:
    extras = []
    for position, row in enumerate(rows):
        touched = {t for op in row.covers for t in graph.operator(op).inputs + graph.operator(op).outputs}
        extras += [(position, slots.slot(t, row.pass_), layout)  # type: ignore[arg-type]
                   for t, layout in row.layouts if t not in touched]
    return extras


def build_problem(profile: Profile, graph: LayerGraph, operators: Sequence[str], slots: SlotMap,
                  fixed: Mapping[str, Fixed], transpose_us: Mapping[str, float],
                  earlier_keys: frozenset[str] | None = None, look_ahead: Sequence[str] = ()) -> SelectionProblem:
    """The presolved problem of covering `operators` and `look_ahead` (whose rows cost nothing); `fixed` pins
    slots, `transpose_us` prices split vars; `earlier_keys`: the coupling keys of the rows an earlier pass chose
    (None: there was no earlier pass)."""
    operators = [*operators, *look_ahead]
    ops = set(operators)
    rows = [row for row in profile.rows if ops.issuperset(row.covers)]
    links = _links(graph, slots, operators, rows)
    extras = _extras(graph, slots, rows)
    seen: dict[str, set[State]] = defaultdict(set)
    for link in links:
        seen[link.slot].update(row.layout_of.get(link.tensor) for row in rows if link.op in row.covers)
    for position, slot, layout in extras:
        seen[slot].add(layout)
    for slot in list(seen):
        partner = slots.partner(slot)
        if partner is not None and partner not in seen and partner in fixed:
            seen[partner] = set()  # an earlier pass decided the other half: price the transpose here
    domains = {}
    for slot, states in seen.items():
        if slot in fixed:
            domains[slot] = {fixed[slot].state}
        else:
            domains[slot] = {s for s in states if s is not None}
            if can_be_absent(graph, slots, slot):
                domains[slot].add(None)
    problem = _presolve(graph, slots, operators, rows, links, extras, domains, fixed)
    pairs = tuple(SplitPair(t, t, t + BACKWARD, transpose_us[t]) for t in sorted(slots.split_vars)
                  if t in problem.domains and t + BACKWARD in problem.domains)
    couplings = _couplings(graph, operators, problem.rows, earlier_keys)
    return SelectionProblem(problem.operators, problem.rows, problem.links, problem.extras, problem.domains,
                            pairs, dict(fixed), frozenset(graph.saved_for_backward()), slots.split_vars, couplings,
                            frozenset(look_ahead))


def _couplings(graph: LayerGraph, operators: Sequence[str], rows: Sequence[CandidateRow],
               earlier_keys: frozenset[str] | None) -> tuple[Coupling, ...]:
    """One Coupling per key with rows here; with one pass only, also for each key the earlier pass chose
    (InfeasibleError if none of its rows is left to complete the pair)."""
    passes = {graph.operator(op).pass_ for op in operators}
    sides: dict[str, dict[str, list[int]]] = {key: {"forward": [], "backward": []} for key in earlier_keys or ()}
    for position, row in enumerate(rows):
        key = coupling_key(row, graph)
        if key is not None:
            sides.setdefault(key, {"forward": [], "backward": []})[row.pass_].append(position)
    couplings = []
    for key, side in sorted(sides.items()):
        if len(passes) == 2:
            couplings.append(Coupling(key, tuple(side["forward"]), tuple(side["backward"]), 0))
        elif earlier_keys is not None:
            chosen = int(key in earlier_keys)
            (present,) = passes
            if chosen and not side[present]:
                raise InfeasibleError(f"no configuration exists: the earlier pass chose {key} rows, and no {present} "
                                      f"row of {key} is left to pair with them (it needs the other pass's state); "
                                      f"try --graph_order combined")
            couplings.append(Coupling(key, tuple(side["forward"]), tuple(side["backward"]),
                                      chosen if present == "forward" else -chosen))
    return tuple(couplings)


def _presolve(graph: LayerGraph, slots: SlotMap, operators: Sequence[str], rows: list[CandidateRow],
              links: list[Link], extras: list[tuple[int, str, str]], domains: dict[str, set[State]],
              fixed: Mapping[str, Fixed]) -> SelectionProblem:
    """Arc consistency: drop rows that need a state outside a domain and states no row of a link allows."""
    links_of: dict[str, list[Link]] = defaultdict(list)
    for link in links:
        links_of[link.op].append(link)
    needs = [{link.slot: row.layout_of.get(link.tensor) for op in row.covers for link in links_of[op]
              if not _ignores(row, link, domains)} for row in rows]
    for position, slot, layout in extras:
        needs[position][slot] = layout
    alive = list(range(len(rows)))
    while True:
        alive = [i for i in alive if all(state in domains[slot] for slot, state in needs[i].items())]
        covering: dict[str, list[int]] = defaultdict(list)
        for i in alive:
            for op in rows[i].covers:
                covering[op].append(i)
        bare = [op for op in operators if not covering[op]]
        if bare:
            raise InfeasibleError(_bare_message(graph, slots, bare[0], rows, needs, domains, fixed))
        changed = _narrow(graph, slots, links, rows, covering, domains, fixed)
        if not changed:
            break
    keep = {i: n for n, i in enumerate(alive)}
    kept_extras = tuple((keep[i], slot, layout) for i, slot, layout in extras if i in keep)
    log.debug("presolve: %d of %d rows, %d slots", len(alive), len(rows), len(domains))
    return SelectionProblem(tuple(operators), tuple(rows[i] for i in alive), tuple(links), kept_extras,
                            {s: frozenset(d) for s, d in domains.items()}, (), dict(fixed))


def _narrow(graph: LayerGraph, slots: SlotMap, links: list[Link], rows: list[CandidateRow],
            covering: Mapping[str, list[int]], domains: dict[str, set[State]], fixed: Mapping[str, Fixed]) -> bool:
    """Shrink each slot's domain to what every linked operator's rows allow; True if anything shrank."""
    allowed: dict[Link, set[State]] = {link: {rows[i].layout_of.get(link.tensor) for i in covering[link.op]
                                              if not _ignores(rows[i], link, domains)} or set(domains[link.slot])
                                       for link in links}
    changed = False
    for link, states in allowed.items():
        narrowed = domains[link.slot] & states
        if narrowed != domains[link.slot]:
            domains[link.slot], changed = narrowed, True
        if not narrowed:
            raise InfeasibleError(_empty_message(graph, slots, link.slot, allowed, fixed))
    for slot in list(domains):  # a split variable exists in the backward exactly when it does in the forward
        partner = slots.partner(slot)
        if partner not in domains:
            continue
        narrowed = domains[slot] - {None} if None not in domains[partner] else domains[slot]
        narrowed = narrowed & {None} if domains[partner] == {None} else narrowed
        if narrowed != domains[slot]:
            domains[slot], changed = narrowed, True
            if not narrowed:
                raise InfeasibleError(_empty_message(graph, slots, slot, allowed, fixed))
    return changed


def show(state: State) -> str:
    return "not materialized" if state is None else state


def _states(states: Iterable[State]) -> str:
    return "{" + ", ".join(sorted(map(show, states))) + "}"


def advice(splittable: Iterable[str], split_vars: Iterable[str], tensors: Iterable[str],
           fixed_reasons: Iterable[str]) -> str:
    """What to try: split the tensors that can be split and are not yet, or free user-visible ones.

    Pass as `tensors` only those a split could help (not the ones fixed to "not materialized"); `split_vars`
    are the problem's own, listed again in the suggested `--split_vars`, which replaces them.
    """
    split_vars = set(split_vars)
    new = [t for t in sorted(set(tensors)) if t in set(splittable) - split_vars]
    tips = []
    if new:
        tips.append(f"--split_vars {' '.join(sorted(split_vars | set(new)))}")
    if USER_VISIBLE_REASON in set(fixed_reasons):
        tips.append("--free-user-layouts")
    tips.append("profiling more layouts of these tensors")
    return "try " + ", or ".join(tips)


def _empty_message(graph: LayerGraph, slots: SlotMap, slot: str, allowed: Mapping[Link, set[State]],
                   fixed: Mapping[str, Fixed]) -> str:
    wants = [f"{link.op} has rows for {{{', '.join(sorted(map(show, states)))}}}"
             for link, states in allowed.items() if link.slot == slot]
    if slot in fixed:
        wants.insert(0, f"fixed to {show(fixed[slot].state)} ({fixed[slot].reason})")
    tensor = slots.tensor(slot)
    which = f"{tensor} (backward layout)" if slot.endswith(BACKWARD) else tensor
    by_pass: dict[str, set[State]] = {}
    for link, states in allowed.items():
        if link.slot == slot:
            pass_ = graph.operator(link.op).pass_
            by_pass[pass_] = by_pass.get(pass_, states) & states
    # A split only separates the backward's readers from the forward: it helps if each pass agrees alone.
    splittable = [tensor] if len(by_pass) > 1 and all(by_pass.values()) else []
    reasons = [f.reason for s, f in fixed.items() if s == slot]
    return (f"no configuration exists: tensor {which} can take no layout its operators share: {'; '.join(wants)}; "
            f"{advice(graph.saved_for_backward(), slots.split_vars, splittable, reasons)}")


def _bare_message(graph: LayerGraph, slots: SlotMap, op: str, rows: list[CandidateRow], needs: list[dict[str, State]],
                  domains: Mapping[str, set[State]], fixed: Mapping[str, Fixed]) -> str:
    """Which tensors left `op` without a row: those whose state each of its rows needs outside the domain."""
    blockers: dict[str, set[State]] = defaultdict(set)
    for i, row in enumerate(rows):
        if op in row.covers:
            for slot, state in needs[i].items():
                if state not in domains[slot]:
                    blockers[slot].add(state)
    parts = [f"{slots.tensor(s)}{' (backward layout)' if s.endswith(BACKWARD) else ''} must be {_states(domains[s])}"
             + (f" ({fixed[s].reason})" if s in fixed else "") + f" but its rows need {_states(states)}"
             for s, states in sorted(blockers.items())]
    splittable = [slots.tensor(s) for s in blockers if domains[s] != {None}]
    reasons = [fixed[s].reason for s in blockers if s in fixed]
    return (f"no configuration exists: operator {op} has no candidate row left: {'; '.join(parts)}; "
            f"{advice(graph.saved_for_backward(), slots.split_vars, splittable, reasons)}")
