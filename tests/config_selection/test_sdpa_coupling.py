"""SDPA rows come in pairs: a forward row of backend X needs the backward row of backend X (its logsumexp and
dropout RNG state), in every graph order; rows that take no padding mask are left out unless allowed. PyTorch's SDPA
backwards add dQ up by float atomics, so these selections allow rows that are not deterministic."""
import dataclasses
import json

import pytest

from substation.config_selection import problem as problem_module
from substation.config_selection.orders import SelectOptions, combined, optimize
from substation.config_selection.profiles import load_profile
from substation.config_selection.synthetic import SyntheticSpec, write_synthetic_profile
from substation.graph import layer_graph
from substation.sizes import Size

GRAPH = layer_graph()
SMALL = Size.from_heads(B=2, L=16, H=2, P=8, U=32)
# flash's forward and efficient's backward are cheap, their partners expensive: without the coupling the
# cheapest cover mixes flash's forward with efficient's backward.
MIXED = SyntheticSpec(SMALL, seed=5, algorithms=1, fused_combos=8, sdpa_combos=8, free_tensors=("Q", "dQ"),
                      sdpa_backends=("flash", "efficient"),
                      sdpa_factors=(("flash", 0.05, 20.0), ("efficient", 20.0, 0.05)))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixed")
    write_synthetic_profile(directory, MIXED, GRAPH)
    return load_profile(directory, GRAPH)


ANY_ROW = SelectOptions(nondeterministic=True)


def _sdpa(selection):
    return {(c.row.pass_, c.row.impl) for c in selection.choices if c.row.impl.startswith("sdpa_")}


def test_without_the_coupling_the_cheapest_cover_mixes_backends(mixed, monkeypatch):
    monkeypatch.setattr(problem_module, "coupling_key", lambda row, graph: None)
    assert _sdpa(combined(mixed, GRAPH, ANY_ROW)) == {("forward", "sdpa_flash"), ("backward", "sdpa_efficient")}


@pytest.mark.parametrize("order", ["combined", "bp_first", "fp_first"])
def test_forward_and_backward_sdpa_rows_share_their_backend(mixed, order):
    options = SelectOptions(split_vars=("Q", "K", "V", "Pr", "A", "Z", "X1", "N1", "Rs1", "F", "H1", "N2", "Rs2"),
                            nondeterministic=True)
    selection = optimize(mixed, GRAPH, order, options)
    chosen = _sdpa(selection)
    assert len({impl for _, impl in chosen}) <= 1 and len(chosen) in (0, 2), chosen
    assert selection.predicted_total_us == pytest.approx(
        sum(c.row.median_us for c in selection.choices) + sum(t.us for t in selection.transposes))


def test_coupling_constraints_in_the_problem(mixed):
    from substation.config_selection.problem import SlotMap, build_problem, user_visible_fixes

    slots = SlotMap.of(GRAPH)
    ops = [op.name for op in GRAPH.operators]
    problem = build_problem(mixed, GRAPH, ops, slots, user_visible_fixes(GRAPH, slots, False), {})
    keys = {c.key: c for c in problem.couplings}
    assert set(keys) == {"sdpa_flash", "sdpa_efficient"} and all(c.rhs == 0 for c in keys.values())
    for coupling in keys.values():
        assert {problem.rows[i].pass_ for i in coupling.forward} == {"forward"}
        assert {problem.rows[i].pass_ for i in coupling.backward} == {"backward"}
    backward = [op.name for op in GRAPH.pass_operators("backward")]
    second = build_problem(mixed, GRAPH, backward, slots, {}, {}, earlier_keys=frozenset({"sdpa_flash"}))
    rhs = {c.key: c.rhs for c in second.couplings}
    assert rhs == {"sdpa_flash": -1, "sdpa_efficient": 0}, "the earlier pass's backend must be completed, no other"


def test_rows_without_padding_mask_need_no_padding_mask(tmp_path):
    write_synthetic_profile(tmp_path, MIXED, GRAPH)
    profile = load_profile(tmp_path, GRAPH)
    unmasked = []
    for row in profile.rows:  # flash rows that take no mask, as the real profiler writes them
        if row.impl == "sdpa_flash":
            options = row.options_dict | {"mask": False}
            row = dataclasses.replace(row, options=json.dumps(options),
                                      layouts=tuple(p for p in row.layouts if p[0] != "M"))
        unmasked.append(row)
    profile = dataclasses.replace(profile, rows=tuple(unmasked))
    assert "sdpa_flash" not in {impl for _, impl in _sdpa(combined(profile, GRAPH, ANY_ROW))}
    allowed = _sdpa(combined(profile, GRAPH, SelectOptions(padding_mask=False, nondeterministic=True)))
    assert len({impl for _, impl in allowed}) <= 1


def test_a_profile_at_dropout_0_may_take_flash_attn4(tmp_path):
    """flash-attn-4's rows (no dropout, no mask) exist only in a profile taken at dropout 0; there the ILP weighs
    them like any pair, and the configuration records the dropout it holds for."""
    from substation.config_selection import configuration_dict

    spec = dataclasses.replace(MIXED, dropout=0.0, sdpa_backends=("efficient", "fa4"),
                               sdpa_factors=(("fa4", 0.05, 0.05),))
    write_synthetic_profile(tmp_path, spec, GRAPH)
    profile = load_profile(tmp_path, GRAPH)
    assert profile.dropout == 0.0
    chosen = {(c.row.pass_, c.row.impl) for c in combined(profile, GRAPH, SelectOptions(padding_mask=False)).choices}
    assert {("forward", "flash_attn_cute"), ("backward", "flash_attn_cute")} <= chosen
    masked = combined(profile, GRAPH)  # a layer called with a padding mask: FA4 takes none
    assert "flash_attn_cute" not in {c.row.impl for c in masked.choices}
    assert configuration_dict(masked)["dropout"] == 0.0



def test_the_shipped_profile_takes_flash_for_a_layer_without_padding(shipped):
    """Without a padding mask flash's rows (which read no M) compete: at B8/L512, our attention left out, its pair,
    in the [B, L, H, P] layouts it reads without copies, beats cuDNN's; with ours in, the layer without a mask costs
    no more than the one with (ours has been the faster since 2026-11-27's twelfth session)."""
    profile, ours = shipped["bert-large-b8-l512"], "attention"
    selection = combined(profile, GRAPH, SelectOptions(padding_mask=False, exclude_impls=("torch", ours),
                                                       nondeterministic=True))
    assert _sdpa(selection) == {("forward", "sdpa_flash"), ("backward", "sdpa_flash")}
    assert selection.layouts["Z"] == selection.layouts["Q"] == "bjhp"
    assert selection.predicted_total_us < combined(profile, GRAPH,
                                                   SelectOptions(exclude_impls=("torch", ours),
                                                                 nondeterministic=True)).predicted_total_us
    unmasked, masked = (combined(profile, GRAPH, SelectOptions(padding_mask=mask, exclude_impls=("torch",),
                                                               nondeterministic=True))
                        for mask in (False, True))
    assert unmasked.predicted_total_us <= masked.predicted_total_us + 1e-6


def test_only_a_mask_free_attention_leaves_a_slot_free(shipped):
    """The rule that lets a row leave an input to the others must not hide a tensor a row really reads: in the
    shipped profiles it applies to exactly the M of flash's rows, which take no mask."""
    from substation.config_selection.problem import SlotMap, build_problem, user_visible_fixes

    slots = SlotMap.of(GRAPH)
    for profile in shipped.values():
        problem = build_problem(profile, GRAPH, [op.name for op in GRAPH.operators], slots,
                                user_visible_fixes(GRAPH, slots, False), {})
        free = {(row.impl, link.tensor) for row in problem.rows for link in problem.links
                if link.op in row.covers and problem.ignores(row, link)}
        assert free == {("sdpa_flash", "M")}
