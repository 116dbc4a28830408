"""The GELU slope pair (impl `cutlass_gelu_slope`: the forward stores GELU'(F + b1) in F's place, the backward
multiplies by it) in the optimizer, on the shipped H100 profile of BERT-large B8/L512 with rows of the pair made
from its `cutlass_epilogue` rows (same calls, times set per test): the ILP takes both rows of the pair or neither,
in every graph order, since no other backward of bias_gelu reads such an F; a configuration choosing them
round-trips into an Encoder (CPU)."""
import dataclasses

import pytest
import torch

from substation import Encoder
from substation.config_selection import load_configuration, write_configuration
from substation.config_selection import problem as problem_module
from substation.config_selection.orders import SelectOptions, combined, optimize
from substation.graph import layer_graph
from substation.kernels.gemm_epilogue import IMPL, SLOPE_FUSIONS, SLOPE_IMPL, separate_of, shape_of
from substation.runtime import file_choices

GRAPH = layer_graph()
PRESET = "bert-large-b8-l512"
FORWARD, BACKWARD = (fusion.covers for fusion in SLOPE_FUSIONS)
SPLIT = SelectOptions(split_vars=("X1", "F", "H1", "N2"))


@pytest.fixture(scope="module")
def base(shipped):
    return shipped[PRESET]


def with_pair(profile, forward: float, backward: float):
    """The profile plus a slope row for each of its `cutlass_epilogue` rows of the pair's shapes (the backward's
    with the bias gradient in the epilogue), timed `forward` / `backward` times the best `cutlass_epilogue` row of
    its cover (plus 0.01 µs a row, so that one is cheapest)."""
    ours = [row for row in profile.rows if row.impl == IMPL]
    best = {covers: min(r.median_us for r in ours if r.covers == covers) for covers in (FORWARD, BACKWARD)}
    shapes = {shape for fusion in SLOPE_FUSIONS for shape in fusion.shapes}
    pair = [row for row in ours if shape_of(row.options_dict) in shapes and not separate_of(row.options_dict)]
    assert {row.covers for row in pair} == {FORWARD, BACKWARD}
    factor = {FORWARD: forward, BACKWARD: backward}
    added = [dataclasses.replace(row, index=len(profile.rows) + n, impl=SLOPE_IMPL,
                                 label=row.label.replace(IMPL, SLOPE_IMPL, 1),
                                 median_us=best[row.covers] * factor[row.covers] + 0.01 * n)
             for n, row in enumerate(pair)]
    return dataclasses.replace(profile, rows=profile.rows + tuple(added))


def epilogue_impls(selection) -> dict[tuple[str, ...], str]:
    return {c.row.covers: c.row.impl for c in selection.choices if c.row.covers in (FORWARD, BACKWARD)}


def test_the_pair_is_chosen_where_both_its_rows_are_cheaper(base):
    selection = combined(with_pair(base, 0.9, 0.5), GRAPH)
    assert epilogue_impls(selection) == {FORWARD: SLOPE_IMPL, BACKWARD: SLOPE_IMPL}
    assert selection.predicted_total_us == pytest.approx(
        sum(c.row.median_us for c in selection.choices) + sum(t.us for t in selection.transposes))


MIXED = (0.5, 5.0)  # the pair's forward cheapest, its backward dearest: taking the forward alone would pay


def test_without_the_coupling_the_cheapest_cover_takes_the_forward_alone(base, monkeypatch):
    """What the coupling prevents: a forward storing the slope before a backward that reads F as F."""
    monkeypatch.setattr(problem_module, "coupling_key", lambda row, graph: None)
    chosen = epilogue_impls(combined(with_pair(base, *MIXED), GRAPH))
    assert chosen[FORWARD] == SLOPE_IMPL and chosen.get(BACKWARD) != SLOPE_IMPL


@pytest.mark.parametrize("order", ["combined", "bp_first", "fp_first"])
@pytest.mark.parametrize("times", [MIXED, (5.0, 0.5), (0.9, 0.5)], ids=["forward-cheap", "backward-cheap", "both"])
def test_both_rows_of_the_pair_or_neither(base, order, times):
    """In bp_first and fp_first the first pass picks for itself and the second pays for the other row."""
    selection = optimize(with_pair(base, *times), GRAPH, order, SPLIT)
    chosen = epilogue_impls(selection)
    assert (chosen.get(FORWARD) == SLOPE_IMPL) == (chosen.get(BACKWARD) == SLOPE_IMPL), chosen
    if order == "combined":  # one ILP over both passes: the pair only where it costs less in all
        assert (SLOPE_IMPL in chosen.values()) == (times == (0.9, 0.5))
    assert selection.predicted_total_us == pytest.approx(
        sum(c.row.median_us for c in selection.choices) + sum(t.us for t in selection.transposes))


def test_a_configuration_choosing_the_pair_round_trips_into_an_encoder(base, tmp_path):
    selection = combined(with_pair(base, 0.9, 0.5), GRAPH)
    pickle_path, json_path = write_configuration(selection, tmp_path / "slope.pickle")
    for path in (pickle_path, json_path):
        choices = file_choices(load_configuration(path, size=selection.size))
        assert {op: choices[op].impl for covers in (FORWARD, BACKWARD) for op in covers} == dict.fromkeys(
            FORWARD + BACKWARD, SLOPE_IMPL)
    encoder = Encoder.from_layouts(pickle_path, dtype=torch.float32)  # every choice checked by the registry
    assert encoder.choices["bias_gelu_bwd"].impl == SLOPE_IMPL
