"""The selection ILP against an exhaustive search, across graph orders, split variables and infeasible inputs."""
import dataclasses
import itertools
import math
from collections import defaultdict

import pulp
import pytest

from substation.config_selection import SelectOptions, SolverOptions, bp_first, combined, fp_first, optimize
from substation.config_selection.selection import format_report, transpose_cost
from substation.errors import InfeasibleError, SelectionError
from substation.graph import layer_graph
from substation.layouts import USER_VISIBLE, Configuration, tied_layouts

GRAPH = layer_graph()
# The model the exhaustive search enumerates: no tensor takes two layouts, every row (SDPA's backwards, not
# deterministic, too).
NO_SPLIT = SelectOptions(split_vars=(), nondeterministic=True)
ANY_ROW = SelectOptions(nondeterministic=True)


def exhaustive(profile, graph=GRAPH, split=()):
    """The cheapest configuration by trying every state of every slot: written from the rules, not the ILP.

    A slot is a tensor (a parameter's gradient shares the parameter's; a split variable has a second one
    for its backward readers). Its state is a layout or None (not materialized). A row fits an assignment
    if, for every tensor T of each operator it covers that some row covering that operator names, the row
    names T in the slot's layout (or does not name it and the slot is None), and every other tensor the
    row names has its slot's layout. Inputs and parameters exist; X, Y, dX, dY keep their canonical
    layout. A split variable exists in both passes or in neither and pays its transpose where the layouts
    differ. Each assignment's cost is the cheapest exact cover of the operators by fitting rows.
    """
    ties = tied_layouts(graph)

    def slot(tensor, pass_):
        base = ties.get(tensor, tensor)
        return base + "@bwd" if pass_ == "backward" and base in split else base

    named = defaultdict(set)
    for row in profile.rows:
        for op in row.covers:
            named[op] |= set(row.layout_of)
    groups = defaultdict(list)  # covers -> [(needs, µs)]
    domains = defaultdict(set)
    for row in profile.rows:
        needs, touched = {}, set()
        for name in row.covers:
            op = graph.operator(name)
            for t in op.inputs + op.outputs:
                touched.add(t)
                if t in named[name]:
                    needs[slot(t, op.pass_)] = row.layout_of.get(t)
        needs.update({slot(t, row.pass_): layout for t, layout in row.layouts if t not in touched})
        groups[row.covers].append((needs, row.median_us))
        for s, state in needs.items():
            domains[s].add(state)
    for s, states in domains.items():
        tensor = s.removesuffix("@bwd")
        if graph.producer(tensor) is None:
            states.discard(None)
        if tensor in USER_VISIBLE:
            states &= {graph.tensors[tensor].dims}
    slots = sorted(domains)
    group_slots = {covers: sorted({s for needs, _ in rows for s in needs}) for covers, rows in groups.items()}
    memo = {}

    def group_cost(covers, assign):
        key = (covers, tuple(assign[s] for s in group_slots[covers]))
        if key not in memo:
            memo[key] = min((us for needs, us in groups[covers] if all(assign[s] == v for s, v in needs.items())),
                            default=math.inf)
        return memo[key]

    ops = tuple(op.name for op in graph.operators)
    best = math.inf
    for states in itertools.product(*(sorted(domains[s], key=str) for s in slots)):
        assign = dict(zip(slots, states))
        extra = 0.0
        for t in split:
            f, b = assign.get(t), assign.get(t + "@bwd", assign.get(t))
            if (f is None) != (b is None):
                extra = math.inf
            elif f != b:
                extra += transpose_cost(profile, graph, t)[0]
        if extra < math.inf:
            costs = {covers: group_cost(covers, assign) for covers in groups}
            best = min(best, extra + _cover(ops, costs))
    return best


def _cover(ops, costs):
    """The cheapest exact cover of `ops` by groups of operators (first uncovered operator first)."""
    if not ops:
        return 0.0
    return min((us + _cover(tuple(o for o in ops if o not in covers), costs) for covers, us in costs.items()
                if ops[0] in covers and us < math.inf and set(covers) <= set(ops)), default=math.inf)


@pytest.mark.parametrize("name", ["ffn", "ffn_seed1", "attention", "attention_seed3"])
def test_combined_equals_exhaustive_search(profiles, name):
    profile = profiles[name]
    selection = combined(profile, GRAPH, NO_SPLIT)
    assert selection.optimal
    assert selection.predicted_total_us == pytest.approx(exhaustive(profile), rel=1e-9)


@pytest.mark.parametrize("name, split", [("ffn", ("X1",)), ("ffn_seed1", ("X1", "F")), ("attention", ("Q",))])
def test_split_vars_equal_exhaustive_search_and_never_worse(profiles, name, split):
    profile = profiles[name]
    plain = combined(profile, GRAPH, NO_SPLIT)
    split_selection = combined(profile, GRAPH, SelectOptions(split_vars=split, nondeterministic=True))
    assert split_selection.predicted_total_us == pytest.approx(exhaustive(profile, split=split), rel=1e-9)
    assert split_selection.predicted_total_us <= plain.predicted_total_us + 1e-9
    # By default any shared tensor may be split: never worse than a chosen few.
    assert combined(profile, GRAPH, ANY_ROW).predicted_total_us <= split_selection.predicted_total_us + 1e-9


def test_attention_profile_chooses_sdpa_and_hides_its_tensors(profiles):
    """Where nondeterminism is allowed (SDPA's backwards add dQ up by float atomics); by default the subgraph's
    own operators run."""
    assert not combined(profiles["attention"], GRAPH).choice_for("softmax").row.impl.startswith("sdpa_")
    selection = combined(profiles["attention"], GRAPH, ANY_ROW)
    assert selection.choice_for("softmax").row.impl == "sdpa_flash"
    assert set(selection.unmaterialized) == {"S", "Pr", "A", "dA", "dS"}
    assert selection.choice_for("attn_scores") is selection.choice_for("attn_context")
    Configuration(selection.layouts, selection.backward)  # a valid configuration of the whole graph


@pytest.mark.parametrize("options", [SelectOptions(), NO_SPLIT], ids=["any split", "no split"])
@pytest.mark.parametrize("name", ["ffn", "ffn_seed1", "attention", "attention_seed3", "layer"])
def test_combined_never_worse_than_sequential_orders(profiles, name, options):
    """With the same split variables, the sequential orders' answers are feasible points of combined's model;
    and their first ILP looks ahead, so they find one wherever combined does (before, bp_first on ffn without
    split variables stranded its forward pass: 'no configuration exists')."""
    profile = profiles[name]
    best = combined(profile, GRAPH, options).predicted_total_us
    for order in (bp_first, fp_first):
        assert best <= order(profile, GRAPH, options).predicted_total_us + 1e-9, order.__name__


@pytest.mark.parametrize("order", ["combined", "bp_first", "fp_first"])
def test_predicted_total_is_the_sum_of_the_chosen_rows(profiles, order):
    selection = optimize(profiles["layer"], GRAPH, order)
    covered = [op for choice in selection.choices for op in choice.row.covers]
    assert sorted(covered) == sorted(op.name for op in GRAPH.operators)
    rows = sum(choice.row.median_us for choice in selection.choices)
    assert selection.predicted_total_us == pytest.approx(rows + sum(t.us for t in selection.transposes), abs=1e-9)
    assert selection.predicted_total_us == pytest.approx(sum(s.objective_us for s in selection.solves), rel=1e-7)
    assert selection.predicted_total_us < selection.default.total_us
    assert all(choice.gap_us >= 0 for choice in selection.choices)
    report = format_report(selection)
    assert "predicted total" in report and "default configuration" in report


def test_highs_and_cbc_agree(profiles):
    highs = combined(profiles["layer"], GRAPH)
    cbc = combined(profiles["layer"], GRAPH, SelectOptions(solver=SolverOptions(solver="cbc", time_limit_s=30)))
    assert cbc.solves[0].solver == "cbc" and cbc.optimal
    assert cbc.predicted_total_us == pytest.approx(highs.predicted_total_us, rel=1e-6)


def test_a_time_limited_answer_is_reported_as_not_optimal(profiles, monkeypatch):
    solve = pulp.LpProblem.solve

    def stopped_at_the_limit(self, solver=None, **kwargs):
        status = solve(self, solver, **kwargs)
        self.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible)  # what a time limit reports
        return status

    monkeypatch.setattr(pulp.LpProblem, "solve", stopped_at_the_limit)
    selection = combined(profiles["ffn"], GRAPH)
    assert not selection.optimal and "not proven optimal" in selection.solves[0].status
    assert "NOT proven optimal" in format_report(selection)


def test_no_solution_within_the_time_limit_is_an_error(profiles, monkeypatch):
    monkeypatch.setattr(pulp.LpProblem, "solve",
                        lambda self, solver=None, **kw: self.assignStatus(pulp.LpStatusNotSolved,
                                                                          pulp.LpSolutionNoSolutionFound))
    with pytest.raises(SelectionError, match="no configuration within .* raise --time-limit"):
        combined(profiles["ffn"], GRAPH)


def test_transpose_time_comes_from_a_profile_row_or_an_estimate(profiles, specs, tmp_path):
    from substation.config_selection.synthetic import write_synthetic_profile
    from substation.config_selection.profiles import load_profile

    profile = profiles["ffn"]
    us, source = transpose_cost(profile, GRAPH, "X1")
    nbytes = 2 * 16 * 16 * 2  # B * L * I float16 elements
    assert source.startswith(f"estimate: 2 x {nbytes} B / 2.9e+12 B/s")
    assert us == pytest.approx(2 * nbytes / 2.9e12 * 1e6)
    spec = dataclasses.replace(specs["ffn"], transpose_rows=("X1",))
    write_synthetic_profile(tmp_path, spec, GRAPH)
    us, source = transpose_cost(load_profile(tmp_path, GRAPH), GRAPH, "X1")
    assert source.startswith("profile: transpose_X1/bwd kernel") and us > 3


def test_the_first_pass_leaves_the_second_a_layout_it_can_read(profiles):
    """fp_first stores X1 as the forward likes best ('bji'); once no backward row reads X1 so, the forward's
    look-ahead picks a layout the backward reads instead of stranding it where X1 may not be split, and keeps
    'bji' with a conversion for the backward where it may."""
    assert fp_first(profiles["ffn"], GRAPH, NO_SPLIT).layouts["X1"] == "bji"
    profile = _keep(profiles["ffn"], lambda row: row.covers != ("ffn_in_wgrad",) or row.layout_of["X1"] != "bji")
    selection = fp_first(profile, GRAPH, NO_SPLIT)
    assert selection.layouts["X1"] != "bji"
    assert combined(profile, GRAPH, NO_SPLIT).predicted_total_us <= selection.predicted_total_us + 1e-9
    converted = fp_first(profile, GRAPH)
    assert converted.layouts["X1"] == "bji" and converted.backward["X1"] != "bji" and "X1" in converted.split_vars


def test_unknown_split_var_lists_the_tensors_that_can_be_split(profiles):
    with pytest.raises(SelectionError, match=r"split_vars \['Nope', 'X'\].*one of: Q K V Pr A Z X1"):
        combined(profiles["ffn"], GRAPH, SelectOptions(split_vars=("Nope", "X")))
    with pytest.raises(SelectionError, match="graph_order='sideways'"):
        optimize(profiles["ffn"], GRAPH, "sideways")


def test_excluded_implementations_are_never_chosen_nor_the_baseline_changed(profiles):
    profile = profiles["ffn"]
    every = combined(profile, GRAPH)
    assert "torch" in {choice.row.impl for choice in every.choices} and every.excluded_impls == ()
    without = combined(profile, GRAPH, SelectOptions(exclude_impls=("kernel", "kernel")))
    assert "kernel" not in {choice.row.impl for choice in without.choices} and without.excluded_impls == ("kernel",)
    assert without.predicted_total_us >= every.predicted_total_us and without.default == every.default
    with pytest.raises(SelectionError, match="excluding torch leaves no row for attn_context, attn_context_dgrad_a"):
        combined(profile, GRAPH, SelectOptions(exclude_impls=("torch",)))
    with pytest.raises(SelectionError, match="cannot exclude cutlass: no such implementation; known: cublaslt"):
        combined(profile, GRAPH, SelectOptions(exclude_impls=("cutlass",)))


def _keep(profile, rule):
    rows = tuple(row for row in profile.rows if rule(row))
    return dataclasses.replace(profile, rows=rows)


def test_conflicting_layouts_name_the_tensor_and_suggest_split_vars(profiles):
    # The forward writes and reads X1 only as 'bji'; ffn_in_wgrad, in the backward, never reads it so.
    forward = {("ln1",), ("ffn_in",), ("ln2",)}
    profile = _keep(profiles["ffn"], lambda row: row.covers not in forward | {("ffn_in_wgrad",)}
                    or (row.layout_of["X1"] == "bji") == (row.covers in forward))
    with pytest.raises(InfeasibleError, match=r"tensor X1 can take no layout .*ffn_in has rows for \{bji\}.*"
                                              r"ffn_in_wgrad has rows for \{[a-z, ]+\}.*--split_vars X1"):
        combined(profile, GRAPH, NO_SPLIT)
    with pytest.raises(InfeasibleError, match=r"--split_vars F X1\b"):  # the suggestion keeps those given
        combined(profile, GRAPH, SelectOptions(split_vars=("F",)))
    split = combined(profile, GRAPH, SelectOptions(split_vars=("X1",)))
    assert split.layouts["X1"] == "bji" and split.backward["X1"] != "bji"
    assert [t.tensor for t in split.transposes] == ["X1"] == list(split.split_vars)
    assert "X1" in combined(profile, GRAPH).split_vars  # by default the ILP splits X1 itself
    # Two forward operators that disagree: a split cannot help, so it is not suggested.
    profile = _keep(profiles["ffn"], lambda row: row.covers not in forward or row.layout_of["X1"] == (
        "jbi" if row.covers == ("ffn_in",) else "bji"))
    for options in (NO_SPLIT, SelectOptions()):
        with pytest.raises(InfeasibleError, match="tensor X1 can take no layout") as error:
            combined(profile, GRAPH, options)
        assert "--split_vars" not in str(error.value) and "try profiling more layouts" in str(error.value)
    # A sequential order says so from its first ILP, which sees the whole layer.
    with pytest.raises(InfeasibleError, match=r"^bp_first, backward operators, looking ahead to the forward "
                                              r"operators: no configuration exists: tensor X1 .*try profiling more layouts"):
        bp_first(profile, GRAPH)


def test_a_conflict_only_the_whole_model_sees_is_named_too(profiles):
    # Each of ln1's rows pairs N1 and Rs1 one way, each of ln1_bwd's the other way: every layout of N1 and of
    # Rs1 alone has rows on both sides (presolve passes), but no pair of them does.
    pairs = {("ln1",): {("bji", "bj"), ("jbi", "jb")}, ("ln1_bwd",): {("bji", "jb"), ("jbi", "bj")}}
    profile = _keep(profiles["ffn"], lambda row: row.covers not in pairs
                    or (row.layout_of["N1"], row.layout_of["Rs1"]) in pairs[row.covers])
    with pytest.raises(InfeasibleError, match=r"tensors (N1|Rs1)\b.*conflict.*--split_vars (N1|Rs1)") as error:
        combined(profile, GRAPH, NO_SPLIT)
    assert "ln1 has rows for" in str(error.value) and "ln1_bwd has rows for" in str(error.value)


def test_user_visible_fixed_then_freed(tmp_path):
    from substation.config_selection.profiles import load_profile
    from substation.config_selection.synthetic import SyntheticSpec, write_synthetic_profile
    from substation.sizes import Size

    spec = SyntheticSpec(Size.from_heads(B=2, L=16, H=2, P=8, U=32), seed=5, algorithms=1, fused_combos=64,
                         sdpa=False, free_tensors=("X", "Y", "dX", "dY"), free_user_layouts=True)
    write_synthetic_profile(tmp_path, spec, GRAPH)
    profile = load_profile(tmp_path, GRAPH)
    fixed = combined(profile, GRAPH)
    assert all(fixed.layouts[t] == "bji" for t in USER_VISIBLE)
    free = combined(profile, GRAPH, SelectOptions(free_user_layouts=True))
    assert free.predicted_total_us <= fixed.predicted_total_us + 1e-9
    # Keep only ln1 rows reading X in a layout both of X's GEMMs also have rows for, but not 'bji'.
    readers = [{row.layout_of["X"] for row in profile.rows if row.covers == (op,)} for op in ("ln1", "qkv_proj",
                                                                                            "qkv_proj_wgrad")]
    other = sorted(set.intersection(*readers) - {"bji"})[0]
    moved = _keep(profile, lambda row: row.covers != ("ln1",) or row.layout_of["X"] == other)
    with pytest.raises(InfeasibleError, match=r"\bX\b.*bji.*user-visible.*--free-user-layouts"):
        combined(moved, GRAPH)
    assert combined(moved, GRAPH, SelectOptions(free_user_layouts=True)).layouts["X"] == other


def test_the_selection_graph_links_rows_to_operators_and_slots(profiles):
    from substation.config_selection.problem import SlotMap, build_problem, user_visible_fixes

    slots = SlotMap.of(GRAPH, ("Q",))
    problem = build_problem(profiles["attention"], GRAPH, [op.name for op in GRAPH.operators], slots,
                            user_visible_fixes(GRAPH, slots, False), {"Q": 1.0})
    graph = problem.to_networkx()
    rows = [n for n, kind in graph.nodes(data="kind") if kind == "row"]
    assert len(rows) == len(problem.rows) and {("op", op.name) for op in GRAPH.operators} <= set(graph)
    sdpa = next(n for n in rows if graph.nodes[n]["impl"] == "sdpa_flash" and "attn_scores" in graph.nodes[n]["label"])
    assert {v for _, v in graph.out_edges(sdpa) if v[0] == "op"} == {("op", "attn_scores"), ("op", "softmax"),
                                                                   ("op", "attn_context")}
    assert graph.edges[sdpa, ("slot", "S")]["layout"] is None, "SDPA hides S"
    assert ("slot", "Q@bwd") in graph and problem.split_pairs[0].tensor == "Q"
