"""The ILP (pulp; HiGHS through highspy by default, CBC as the alternative) over one `SelectionProblem`.

Binaries: y[r] per candidate row, x[s, l] per slot s and layout l. Constraints:
  cover     every operator o:                  sum(y[r] : r covers o) == 1
  link      every link (o, T -> s), layout l:  sum(y[r] : r covers o, r has T:l) == x[s, l]   (the tight form)
  extra     a row naming T:l outside its covered operators:  y[r] <= x[s, l]
  exist     every slot:  sum_l x[s, l] == 1, or <= 1 where the tensor may be hidden inside a cover
  split     a split variable T:  sum_l x[T, l] == sum_l x[T@bwd, l];  z[T] >= x[T, l] - x[T@bwd, l]
  couple    rows that only work as a pair (SDPA backend X: the backward reads the forward's logsumexp and RNG
            state):  sum(y[r] : forward rows of X) == sum(y[r] : backward rows of X)
Objective: sum(median_us[r] * y[r]) + sum(transpose_us[T] * z[T]), z continuous in [0, 1]; rows of look-ahead
operators (the second pass, seen from the first ILP of bp_first/fp_first) cost 0.
Linking each operator's rows to the layouts with equalities (not `y <= x`) is what keeps the LP
relaxation tight: a fractional layout cannot be shared by rows of several operators at once.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import os
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import pulp

from substation.config_selection import SOLVERS
from substation.config_selection.problem import BACKWARD, SelectionProblem, SlotMap, State, advice, show
from substation.config_selection.profiles import CandidateRow
from substation.errors import InfeasibleError, SelectionError

log = logging.getLogger(__name__)

HIGHS_PROBING_RULE = 1 << 15  # HiGHS presolve rule 15, "Probing", in its `presolve_rule_off` bit mask


@functools.cache
def _silence_highs_banner() -> None:
    """Create the process's first HiGHS instance with fd 1 pointed at /dev/null.

    HiGHS prints its banner to stdout from the constructor of the first instance of a process, before
    pulp can set `output_flag` off; this keeps it out of `substation optimize`'s printed table.
    """
    try:
        import highspy

        sys.stdout.flush()
        saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    except (ImportError, OSError, ValueError):
        return
    try:
        os.dup2(devnull, 1)
        with contextlib.suppress(Exception):
            highspy.Highs()
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@dataclass(frozen=True)
class SolverOptions:
    """Which solver, its wall-clock limit per `optimize` call, and the relative MIP gap it stops at."""

    solver: str = "highs"
    time_limit_s: float = 60.0
    gap_rel: float = 1e-6
    threads: int | None = None
    # HiGHS's presolve *probing* spent 5 of 5.5 s on an 8k-row synthetic BERT-large model (README.md);
    # without it the same model solves to the same optimum in 0.4 s. True turns it back on.
    highs_probing: bool = False

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise SelectionError(f"solver={self.solver!r}, expected one of {', '.join(SOLVERS)}")
        if not (isinstance(self.time_limit_s, (int, float)) and 0 < self.time_limit_s < math.inf):
            raise SelectionError(f"time_limit_s={self.time_limit_s!r}, expected a positive number of seconds")

    def pulp_solver(self, time_limit_s: float) -> pulp.LpSolver:
        if self.solver == "highs":
            _silence_highs_banner()
            params = {} if self.highs_probing else {"presolve_rule_off": HIGHS_PROBING_RULE}
            return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=self.gap_rel, threads=self.threads, **params)
        kwargs = {"msg": False, "timeLimit": time_limit_s, "gapRel": self.gap_rel, "threads": self.threads}
        installed = pulp.COIN_CMD(**kwargs)
        if installed.available():
            return installed  # a `cbc` on PATH (pulp[cbc]); pulp 4.0 drops the bundled one
        with warnings.catch_warnings():  # pulp 3.3 deprecates its bundled CBC, which still works
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(**kwargs)


@dataclass(frozen=True)
class SolveStats:
    """One solver call: model size, time and outcome. `optimal` is False for a time-limited incumbent."""

    solver: str
    operators: int
    status: str
    optimal: bool
    binaries: int
    continuous: int
    constraints: int
    seconds: float
    objective_us: float


@dataclass(frozen=True)
class Solution:
    """The chosen rows (in problem order) and the state of every slot of the problem."""

    rows: tuple[CandidateRow, ...]
    states: Mapping[str, State]
    stats: SolveStats


@dataclass
class _Model:
    prob: pulp.LpProblem
    y: list[pulp.LpVariable]
    x: dict[str, dict[str, pulp.LpVariable]]
    relax: dict[str, pulp.LpVariable]


def _variable(prob: pulp.LpProblem, name: str, cat: str, up: float = 1.0) -> pulp.LpVariable:
    """A variable of `prob`: through `add_variable` where pulp has it (pulp 3.3+; 4.0 requires it)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=0, upBound=up, cat=cat)
    return pulp.LpVariable(name, lowBound=0, upBound=up, cat=cat)


def _add(prob: pulp.LpProblem, terms: list[tuple[pulp.LpVariable, float]], sense: int, rhs: float = 0.0) -> None:
    prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), sense=sense, rhs=rhs))


def _tie(model: _Model, slot: str, terms: list[tuple[pulp.LpVariable, float]], sense: int) -> None:
    """terms (sense) 0, or, in the elastic model, within +-relax[slot] of it."""
    relax = model.relax.get(slot)
    if relax is None:
        _add(model.prob, terms, sense)
        return
    if sense in (pulp.LpConstraintEQ, pulp.LpConstraintLE):
        _add(model.prob, terms + [(relax, -1.0)], pulp.LpConstraintLE)
    if sense in (pulp.LpConstraintEQ, pulp.LpConstraintGE):
        _add(model.prob, terms + [(relax, 1.0)], pulp.LpConstraintGE)


def _build(problem: SelectionProblem, elastic: bool = False) -> _Model:
    """The ILP; `elastic` lets each slot's link and extra constraints break at a cost of 1 (diagnosis)."""
    prob = pulp.LpProblem("substation_selection", pulp.LpMinimize)
    y = [_variable(prob, f"y{i}", pulp.LpBinary) for i in range(len(problem.rows))]
    x = {slot: {layout: _variable(prob, f"x{n}_{layout}", pulp.LpBinary) for layout in problem.layouts(slot)}
         for n, slot in enumerate(sorted(problem.domains))}
    relax = {slot: _variable(prob, f"r{n}", pulp.LpBinary) for n, slot in enumerate(sorted(x))} if elastic else {}
    model = _Model(prob, y, x, relax)
    covering: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(problem.rows):
        for op in row.covers:
            covering[op].append(i)
    for op in problem.operators:
        _add(prob, [(y[i], 1.0) for i in covering[op]], pulp.LpConstraintEQ, 1.0)
    for link in problem.links:
        by_state: dict[State, list[int]] = defaultdict(list)
        free = False  # whether a row of the operator leaves the slot to the others (problem.ignores)
        for i in covering[link.op]:
            if problem.ignores(problem.rows[i], link):
                free = True
            else:
                by_state[problem.row_state(problem.rows[i], link)].append(i)
        # A chosen row's layout is the slot's (==), or, where a row may leave the slot free, implies it (<=).
        sense = pulp.LpConstraintLE if free else pulp.LpConstraintEQ
        for layout, var in x[link.slot].items():
            _tie(model, link.slot, [(y[i], 1.0) for i in by_state[layout]] + [(var, -1.0)], sense)
    for i, slot, layout in problem.extras:
        _tie(model, slot, [(y[i], 1.0), (x[slot][layout], -1.0)], pulp.LpConstraintLE)
    for coupling in problem.couplings:
        _add(prob, [(y[i], 1.0) for i in coupling.forward] + [(y[i], -1.0) for i in coupling.backward],
             pulp.LpConstraintEQ, float(coupling.rhs))
    for slot, layouts in x.items():
        if layouts:
            must = None not in problem.domains[slot]
            _add(prob, [(v, 1.0) for v in layouts.values()], pulp.LpConstraintEQ if must else pulp.LpConstraintLE, 1.0)
    objective = [] if elastic else [(y[i], problem.price(row)) for i, row in enumerate(problem.rows)]
    for pair in problem.split_pairs:
        forward, backward = x[pair.forward], x[pair.backward]
        _add(prob, [(v, 1.0) for v in forward.values()] + [(v, -1.0) for v in backward.values()],
             pulp.LpConstraintEQ)
        z = _variable(prob, f"z_{pair.tensor}", pulp.LpContinuous)
        for layout in sorted(set(forward) | set(backward)):
            terms = [(z, 1.0)] + ([(forward[layout], -1.0)] if layout in forward else []) + (
                [(backward[layout], 1.0)] if layout in backward else [])
            _add(prob, terms, pulp.LpConstraintGE)
        if not elastic:
            objective.append((z, pair.transpose_us))
    objective += [(r, 1.0) for r in relax.values()]
    prob.setObjective(pulp.LpAffineExpression(objective))
    return model


def _run(model: _Model, options: SolverOptions, time_limit_s: float) -> tuple[bool, str, float]:
    """Solve; (optimal, status text, seconds). InfeasibleError without a message if the model is infeasible."""
    start = time.perf_counter()
    model.prob.solve(options.pulp_solver(time_limit_s))
    seconds = time.perf_counter() - start
    status, solution = model.prob.status, model.prob.sol_status
    described = f"status {pulp.LpStatus[status]!r}, solution {pulp.LpSolution[solution]!r}"
    if status == pulp.LpStatusInfeasible or solution == pulp.LpSolutionInfeasible:
        raise InfeasibleError(described)
    if status == pulp.LpStatusOptimal and solution == pulp.LpSolutionOptimal:
        return True, "optimal", seconds
    if status == pulp.LpStatusOptimal and solution == pulp.LpSolutionIntegerFeasible:
        return False, f"feasible, not proven optimal within the time limit of {time_limit_s:.0f} s", seconds
    raise SelectionError(f"{options.solver} found no configuration within {time_limit_s:.0f} s ({described}); "
                         f"raise --time-limit")


def _extract(problem: SelectionProblem, model: _Model) -> tuple[tuple[CandidateRow, ...], dict[str, State]]:
    """Chosen rows and slot states; SelectionError if the solver's answer breaks the cover constraints."""
    chosen = tuple(row for row, var in zip(problem.rows, model.y) if (var.varValue or 0.0) > 0.5)
    counts: dict[str, int] = defaultdict(int)
    for row in chosen:
        for op in row.covers:
            counts[op] += 1
    broken = [op for op in problem.operators if counts[op] != 1]
    if broken:
        raise SelectionError(f"the solver's answer covers operators {broken} other than exactly once")
    states: dict[str, State] = {}
    for slot, layouts in model.x.items():
        on = [layout for layout, var in layouts.items() if (var.varValue or 0.0) > 0.5]
        states[slot] = on[0] if on else None
    return chosen, states


def solve(problem: SelectionProblem, options: SolverOptions, time_limit_s: float | None = None) -> Solution:
    """The cheapest cover of the problem's operators; InfeasibleError names conflicting tensors if none exists."""
    model = _build(problem)
    limit = options.time_limit_s if time_limit_s is None else time_limit_s
    try:
        optimal, status, seconds = _run(model, options, limit)
    except InfeasibleError:
        raise InfeasibleError(diagnose(problem, options, limit)) from None
    rows, states = _extract(problem, model)
    continuous = len(problem.split_pairs)
    binaries = len(model.prob.variables()) - continuous
    stats = SolveStats(options.solver, len(problem.operators), status, optimal, binaries, continuous,
                       model.prob.numConstraints(), seconds, float(pulp.value(model.prob.objective)))
    level = logging.INFO if optimal else logging.WARNING
    log.log(level, "%s: %s in %.2f s, %d binaries, %d constraints, objective %.2f us", options.solver, status,
            seconds, stats.binaries, stats.constraints, stats.objective_us)
    return Solution(rows, states, stats)


def diagnose(problem: SelectionProblem, options: SolverOptions, time_limit_s: float) -> str:
    """Why the problem is infeasible: the fewest tensors whose layout agreement must break (an elastic ILP)."""
    model = _build(problem, elastic=True)
    try:
        _run(model, options, time_limit_s)
    except InfeasibleError:
        return (f"no configuration exists: the candidate rows cannot cover operators {list(problem.operators)} "
                f"exactly once (their `covers` overlap); check the profile's multi-operator rows")
    except SelectionError as err:
        return f"no configuration exists, and the diagnosis did not finish: {err}"
    broken = sorted(slot for slot, var in model.relax.items() if (var.varValue or 0.0) > 0.5)
    wants = []
    for slot in broken:
        per_op = defaultdict(set)
        for link in problem.links:
            if link.slot == slot:
                per_op[link.op].update(problem.row_state(r, link) for r in problem.rows if link.op in r.covers)
        fixed = f" (fixed to {show(problem.fixed[slot].state)}: {problem.fixed[slot].reason})" \
            if slot in problem.fixed else ""
        shown = "; ".join(f"{op} has rows for {{{', '.join(sorted(map(show, s)))}}}" for op, s in per_op.items())
        wants.append(f"{slot.replace(BACKWARD, ' (backward layout)')}{fixed}: {shown}")
    tensors = sorted({SlotMap.tensor(slot) for slot in broken})
    reasons = [problem.fixed[s].reason for s in broken if s in problem.fixed]
    return (f"no configuration exists: the layouts of tensors {', '.join(tensors)} conflict between the rows of their "
            f"operators, taken together: {' | '.join(wants)}; "
            f"{advice(problem.splittable, problem.split_vars, tensors, reasons)}")
