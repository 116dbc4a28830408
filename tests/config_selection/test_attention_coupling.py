"""Our fused attention rows (impl `attention`) in the optimizer, on the shipped H100 profile of BERT-large B8/L512
with the profiler's attention rows' times set per test: the ILP picks them where they are cheapest
and SDPA where not, forward and backward together (the backward reads the forward's LSE) in every graph order,
the objective staying exact; a configuration choosing them round-trips through the configuration file into an
Encoder (CPU)."""
import dataclasses

import pytest
import torch

from substation import Encoder
from substation.config_selection import configuration_dict, load_configuration, write_configuration
from substation.config_selection import problem as problem_module
from substation.config_selection.orders import SelectOptions, combined, optimize
from substation.graph import layer_graph
from substation.kernels.attention import ATOMIC_DQ, BWD_COVERS, COVERS, IMPL, STACKED_COVERS, profiled_points
from substation.runtime import file_choices

GRAPH = layer_graph()
PRESET = "bert-large-b8-l512"
# SDPA's backwards are not deterministic (float atomics): the selections that weigh them against ours allow them.
ANY_ROW = SelectOptions(nondeterministic=True)
SPLIT = SelectOptions(split_vars=("Q", "K", "V", "Pr", "A", "Z", "X1", "N1", "Rs1", "F", "H1", "N2", "Rs2"),
                      nondeterministic=True)


@pytest.fixture(scope="module")
def base(shipped):
    """The shipped profile, which holds the kernel profiler's rows of our attention (their times set per test)."""
    return shipped[PRESET]


def timed(profile, attention: tuple[float, float], sdpa: tuple[float, float] = (1.0, 1.0)):
    """The profile with our attention rows' times set to `attention` (forward, backward) times the best SDPA row of
    the pass (plus 0.01 µs per variant, so that one is cheapest), and the SDPA rows' times scaled by `sdpa`."""
    best = {p: min(r.median_us for r in profile.rows if r.impl.startswith("sdpa_") and r.pass_ == p)
            for p in ("forward", "backward")}
    rows, n = [], 0
    for row in profile.rows:
        factor = dict(zip(("forward", "backward"), attention if row.impl == IMPL else sdpa))[row.pass_]
        if row.impl == IMPL:
            row, n = dataclasses.replace(row, median_us=best[row.pass_] * factor + 0.01 * n), n + 1
        elif row.impl.startswith("sdpa_"):
            row = dataclasses.replace(row, median_us=row.median_us * factor)
        rows.append(row)
    return dataclasses.replace(profile, rows=tuple(rows))


def attention_impls(selection) -> set[tuple[str, str]]:
    """(pass, impl) of the rows chosen for the attention subgraph."""
    return {(c.row.pass_, c.row.impl) for c in selection.choices if set(c.row.covers) & set(COVERS + BWD_COVERS)}


def test_the_shipped_profile_holds_every_point_the_profiler_times(base):
    ours = [row for row in base.rows if row.impl == IMPL]
    points = profiled_points(base.size, base.size.dtype)
    assert sorted(row.label for row in ours) == sorted(p.candidate.label for p in points)
    assert len(ours) == 1848 and {row.covers for row in ours} == {COVERS, BWD_COVERS, STACKED_COVERS}


def test_atomic_dq_rows_are_chosen_only_where_nondeterminism_is_allowed(base):
    """fuse_dq=4's backward rows (float atomics), made the cheapest, are left out by default and chosen with
    nondeterministic=True; the configuration file says which."""
    profile = timed(base, (0.5, 0.5))
    rows = tuple(dataclasses.replace(row, median_us=row.median_us / 2)
                 if row.options_dict.get("fuse_dq") == ATOMIC_DQ else row for row in profile.rows)
    assert any(row.options_dict.get("fuse_dq") == ATOMIC_DQ for row in rows)
    profile = dataclasses.replace(profile, rows=rows)
    for allowed in (False, True):
        selection = combined(profile, GRAPH, SelectOptions(nondeterministic=allowed))
        backward = [c.row for c in selection.choices if c.row.impl == IMPL and c.row.pass_ == "backward"]
        assert len(backward) == 1 and (backward[0].options_dict.get("fuse_dq") == ATOMIC_DQ) == allowed
        assert configuration_dict(selection)["deterministic"] is not allowed


def test_cheapest_attention_rows_are_chosen_and_hide_the_subgraph(base):
    selection = combined(timed(base, (0.5, 0.5)), GRAPH)
    assert attention_impls(selection) == {("forward", IMPL), ("backward", IMPL)}
    assert {"S", "Pr", "A", "dA", "dS"} <= set(selection.unmaterialized)
    assert selection.predicted_total_us == pytest.approx(
        sum(c.row.median_us for c in selection.choices) + sum(t.us for t in selection.transposes))


def test_sdpa_is_chosen_where_the_attention_rows_cost_more(base):
    chosen = attention_impls(combined(timed(base, (3.0, 3.0)), GRAPH, ANY_ROW))
    assert IMPL not in {impl for _, impl in chosen} and len(chosen) == 2
    assert all(impl.startswith("sdpa_") for _, impl in chosen)


MIXED = ((0.2, 20.0), (20.0, 0.05))  # our forward cheap and backward dear; SDPA's the other way round


def test_without_the_coupling_the_cheapest_cover_mixes_implementations(base, monkeypatch):
    monkeypatch.setattr(problem_module, "coupling_key", lambda row, graph: None)
    chosen = attention_impls(combined(timed(base, *MIXED), GRAPH, ANY_ROW))
    assert ("forward", IMPL) in chosen and ("backward", IMPL) not in chosen


@pytest.mark.parametrize("order", ["combined", "bp_first", "fp_first"])
def test_forward_and_backward_attention_rows_come_together(base, order):
    selection = optimize(timed(base, *MIXED), GRAPH, order, SPLIT)
    fused = {(pass_, impl) for pass_, impl in attention_impls(selection) if impl == IMPL or impl.startswith("sdpa_")}
    assert len({impl for _, impl in fused}) <= 1 and len(fused) in (0, 2), fused
    assert selection.predicted_total_us == pytest.approx(
        sum(c.row.median_us for c in selection.choices) + sum(t.us for t in selection.transposes))


def test_coupling_constraints_name_attention(base):
    from substation.config_selection.problem import SlotMap, build_problem, user_visible_fixes

    slots = SlotMap.of(GRAPH)
    ops = [op.name for op in GRAPH.operators]
    problem = build_problem(timed(base, (0.5, 0.5)), GRAPH, ops, slots, user_visible_fixes(GRAPH, slots, False), {})
    keys = {c.key: c for c in problem.couplings}
    assert IMPL in keys and keys[IMPL].rhs == 0
    assert {problem.rows[i].impl for i in keys[IMPL].forward + keys[IMPL].backward} == {IMPL}
    assert {problem.rows[i].pass_ for i in keys[IMPL].forward} == {"forward"}
    assert {problem.rows[i].pass_ for i in keys[IMPL].backward} == {"backward"}


def test_a_configuration_choosing_them_round_trips_into_an_encoder(base, tmp_path):
    selection = combined(timed(base, (0.5, 0.5)), GRAPH)
    pickle_path, json_path = write_configuration(selection, tmp_path / "attention.pickle")
    rows = {c.row.covers: c.row for c in selection.choices if c.row.impl == IMPL}
    assert COVERS in rows and len(rows) == 2 and set(rows) - {COVERS} <= {BWD_COVERS, STACKED_COVERS}
    for path in (pickle_path, json_path):
        data = load_configuration(path, size=selection.size)
        choices = file_choices(data)
        for covers in rows:
            for op in covers:
                assert choices[op].impl == IMPL and choices[op].covers == covers
                assert choices[op].options == rows[covers].options_dict and choices[op].label == rows[covers].label
    encoder = Encoder.from_layouts(pickle_path, dtype=torch.float32)  # every choice checked by the registry
    assert {encoder.choices[op].impl for covers in rows for op in covers} == {IMPL}
