"""Our fused attention kernels as one registered implementation (impl `attention`, CPU): covers, candidates and the
rules that make them feasible or not, the profiler's bounded layout set, rows through the profile CSV, check and
at_size against configurations, and the profiler's tasks."""
import dataclasses
import pickle

import pytest

from substation.errors import ConfigurationFileError
from substation.graph import layer_graph
from substation.implementations import registry
from substation.kernels import attention
from substation.kernels.attention import (BWD_COVERS, COVERS, IMPL, STACKED_COVERS, FusedAttention,
                                          profiled_layouts, profiled_points)
from substation.kernels.profiler import plan, tasks
from substation.kernels.sdpa import Sdpa, accepted_layouts
from substation.layouts import Configuration
from substation.protocol import Choice, Infeasible
from substation.records import ProfileRow, RecordWriter, parse_label, read_rows
from substation.runtime import check_choices, choices_at_size
from substation.sizes import Size, get_size

GRAPH = layer_graph()
SIZE = get_size("bert-large-b8-l512")
FORWARD = [GRAPH.operator(name) for name in COVERS]
BACKWARD = [GRAPH.operator(name) for name in BWD_COVERS]
STACKED = [GRAPH.operator(name) for name in STACKED_COVERS]
CANONICAL = dict(Q="bhjp", K="bhkp", V="bhkp", M="bk", Z="bjhp", dZ="bjhp", dQ="bhjp", dK="bhkp", dV="bhkp")


def implementation() -> FusedAttention:
    return registry(GRAPH).find(IMPL, COVERS)


def test_registered_after_sdpa_coupled_with_every_cover():
    implementations = registry(GRAPH)
    assert implementations.covers(IMPL) == (COVERS, BWD_COVERS, STACKED_COVERS)
    assert implementations.coupled(IMPL)
    order = list(dict.fromkeys(type(found) for found in implementations._by_cover.values()))
    assert order.index(FusedAttention) == order.index(Sdpa) + 1
    assert implementations.find(IMPL, BWD_COVERS) is implementation()
    assert implementations.find(IMPL, STACKED_COVERS) is implementation()


@pytest.mark.parametrize("ops, variants", [(FORWARD, 20), (BACKWARD, 74)], ids=["forward", "backward"])
def test_candidates_are_every_tile_variant_of_any_layout(ops, variants):
    """The kernels take any order of every tensor's letters: canonical, p innermost or not, each with every tile
    variant (P = 64: 2 x 2 tiles forward, 2 x 2 x fuse_dq (apart, summed after the grid, by the last block or by
    float atomics: L = 512 takes several key tiles) backward, each at its occupancy levels: 3 at 64 rows, 2 at 128, less the ones
    whose four blocks' shared memory does not fit an SM: 64 x 64 fused), each with wgmma off and on (Hopper, P =
    64), rows naming graph tensors only (no LSE)."""
    for layouts in (CANONICAL, CANONICAL | dict(Q="pbhj", K="kphb", Z="hpbj", dZ="jbph", dQ="jpbh", M="kb")):
        found = list(implementation().candidates(ops, SIZE, layouts))
        assert len(found) == variants and len({c.label for c in found}) == variants
        names = FusedAttention.names(ops)
        for candidate in found:
            assert candidate.impl == IMPL and candidate.covers == tuple(op.name for op in ops)
            assert dict(candidate.inputs + candidate.outputs) == {n: layouts[n] for n in names}
            assert "LSE" not in candidate.layouts


def test_candidates_at_head_size_128_prune_the_backward():
    wide = dataclasses.replace(SIZE, P=128, I=SIZE.H * 128)
    assert len(list(implementation().candidates(FORWARD, wide, CANONICAL))) == 8  # 64 x 64: only one block fits
    backward = list(implementation().candidates(BACKWARD, wide, CANONICAL))
    assert len(backward) == 16 and {c.options_dict["block_n"] for c in backward} == {32}, "P + block_n <= 160"


@pytest.mark.parametrize("size, reason", [
    (Size.from_heads(B=2, L=24, H=2, P=16, U=64), "head size P=16 must be one of"),
    (SIZE.with_dtype("float32"), "no tensor-core kernel"),
])
@pytest.mark.parametrize("ops", [FORWARD, BACKWARD], ids=["forward", "backward"])
def test_infeasible_sizes_name_the_rule(ops, size, reason):
    (answer,) = implementation().candidates(ops, size, CANONICAL)
    assert isinstance(answer, Infeasible) and reason in answer.reason
    assert answer.impl == IMPL and answer.covers == tuple(op.name for op in ops)


def test_profiled_layouts_follow_the_stated_rule():
    """Q, K, V in one of the six p-innermost orders, Z in Q's layout or bjhp, M bk, dZ like Z, gradients like
    their tensors: 11 combinations, 220 forward and 814 backward points at P = 64 (B8/L512; half of each with wgmma),
    and the 814 once more writing a stacked dQKV (bjthp), all feasible and distinct."""
    combos = profiled_layouts()
    assert len(combos) == 11 and {c["Q"] for c in combos} == set(accepted_layouts("bhjp"))
    for c in combos:
        assert c["K"] == c["V"] == c["Q"].replace("j", "k") and c["Z"] in (c["Q"], "bjhp") and c["M"] == "bk"
        assert (c["dZ"], c["dQ"], c["dK"], c["dV"]) == (c["Z"], c["Q"], c["K"], c["V"])
    points = profiled_points(SIZE, "float16")
    kinds = [type(p).__name__ for p in points]
    assert (kinds.count("AttentionParams"), kinds.count("AttentionBackwardParams")) == (220, 1628)
    stacked = [p for p in points if isinstance(p, attention.AttentionBackwardParams) and p.stacked]
    assert len(stacked) == 814 and {dict(p.layouts)["dQKV"] for p in stacked} == {"bjthp"}
    assert {p.candidate.covers for p in stacked} == {STACKED_COVERS}
    assert len({p.label for p in points}) == len(points)
    for p in points:
        p.check()
    assert profiled_points(Size.from_heads(B=2, L=24, H=2, P=16, U=64), "float16") == []


def test_rows_round_trip_through_the_profile_csv(tmp_path):
    points = profiled_points(SIZE, "float16")[::20]
    path = tmp_path / "kernels.csv"
    with RecordWriter(path) as writer:
        for n, p in enumerate(points):
            writer.write(ProfileRow.make(p.candidate, SIZE, "Test GPU", {"substation": "0"}, 25, 10.0 + n, 9.0 + n,
                                             dropout=0.1))
    rows = read_rows(path)
    assert [row.label for row in rows] == [p.label for p in points]
    for row, p in zip(rows, points):
        assert dataclasses.replace(parse_label(row.label), covers=p.candidate.covers) == p.candidate
        assert row.impl == IMPL and tuple(row.covers.split()) == p.candidate.covers
        registry(GRAPH).find(row.impl, row.covers.split())  # the optimizer knows the row


def _config(**layouts: str) -> Configuration:
    return Configuration(dict(Configuration.default(GRAPH).layouts) | layouts)


def test_check_refuses_knobs_that_do_not_fit_and_names_the_field():
    config = _config()
    forward = Choice(COVERS, IMPL, {"block_m": 64, "block_n": 32})
    implementation().check(FORWARD, forward, config, SIZE)
    with pytest.raises(ConfigurationFileError, match=r"operators.attn_scores: impl 'attention' variant .* block_n=48"):
        implementation().check(FORWARD, Choice(COVERS, IMPL, {"block_m": 64, "block_n": 48}), config, SIZE)
    with pytest.raises(ConfigurationFileError, match="operators.attn_context_dgrad_a: .*unexpected keyword"):
        implementation().check(BACKWARD, Choice(BWD_COVERS, IMPL, {"tile": 3}), config, SIZE)


def test_the_stacked_row_writes_dqkv_and_its_bias_gradient():
    """The stacked row also covers qkv_bias_bwd: it writes dQKV and dbqkv, each in any order of its letters
    (dbqkv from the kernels' own partial sums, not from dQKV's layout); a dtype without tensor cores is Infeasible."""
    layouts = {n: lay for n, lay in CANONICAL.items() if n not in ("dQ", "dK", "dV")} | dict(dQKV="bjthp",
                                                                                            dbqkv="thp")
    found = list(implementation().candidates(STACKED, SIZE, layouts))
    assert len(found) == 74 and {c.covers for c in found} == {STACKED_COVERS}
    assert {c.label.split(" -> ")[1] for c in found} == {"dQKV:bjthp dbqkv:thp"}
    other = list(implementation().candidates(STACKED, SIZE, layouts | {"dQKV": "tbjhp", "dbqkv": "pht"}))
    assert {c.label.split(" -> ")[1] for c in other} == {"dQKV:tbjhp dbqkv:pht"} and len(other) == 74
    (refused,) = implementation().candidates(STACKED, SIZE.with_dtype("float32"), layouts)
    assert isinstance(refused, Infeasible) and "no tensor-core kernel" in refused.reason
    config = _config(dQKV="jbthp")
    choice = Choice(STACKED_COVERS, IMPL, {"block_m": 128, "block_n": 64, "fuse_dq": 1})
    implementation().check(STACKED, choice, config, SIZE)
    assert implementation().cover_layouts(STACKED, config) == layouts | dict(dQKV="jbthp")
    implementation().check(STACKED, choice, _config(dQKV="bjpth"), SIZE)


def test_builds_name_the_kernels_each_row_compiles():
    """Every row builds its one kernel source (the stacked row's sums dbqkv itself)."""
    config = _config(dQKV="bjthp")
    forward = implementation().builds(FORWARD, Choice(COVERS, IMPL, {"block_m": 64, "block_n": 64}), config, SIZE)
    assert [type(b).__name__ for b in forward] == ["AttentionParams"]
    backward = implementation().builds(BACKWARD, Choice(BWD_COVERS, IMPL, {}), config, SIZE)
    assert [type(b).__name__ for b in backward] == ["AttentionBackwardParams"]
    stacked = implementation().builds(STACKED, Choice(STACKED_COVERS, IMPL, {"fuse_dq": 1}), config, SIZE)
    assert [type(b).__name__ for b in stacked] == ["AttentionBackwardParams"] and stacked[0].stacked


def test_cover_layouts_read_the_backward_layouts_of_split_tensors():
    config = Configuration(dict(_config(Z="jbhp").layouts), backward={"Z": "bjhp", "Q": "hbjp"})
    assert implementation().cover_layouts(FORWARD, config) == dict(Q="bhjp", K="bhkp", V="bhkp", M="bk", Z="jbhp")
    assert implementation().cover_layouts(BACKWARD, config) == CANONICAL | {"Q": "hbjp"}


def test_at_size_keeps_a_fitting_choice_and_replaces_one_that_does_not():
    """Feasibility depends on P and the device, not on B and L: a choice moves to another batch and length as it
    is; one that does not fit (block_n = 64 at P = 128 spills registers) becomes the first variant that does."""
    config, other = _config(), dataclasses.replace(SIZE, B=3, L=77)
    choice = Choice(BWD_COVERS, IMPL, {"block_m": 128, "block_n": 64, "fuse_dq": 1}, "label", 12.0)
    assert implementation().at_size(BACKWARD, choice, config, other) is choice
    wide = dataclasses.replace(other, P=128, I=other.H * 128)
    moved = implementation().at_size(BACKWARD, choice, config, wide)
    first = attention.backward_variants(wide, wide.dtype, CANONICAL)[0]
    assert moved.options == first.options() and moved.label == first.label and moved.predicted_us is None


def test_padded_batches_split_the_fused_walk_where_it_has_several_key_tiles():
    """A backward with dQ fused, by partials or atomics, over at least three key tiles takes split_queries (its
    label says so; it was not profiled, so nothing predicts it). The forward, dQ apart or summed by the last block,
    one or two key tiles (L = 128, 256 with 128-key tiles) and a choice split already stay as they are."""
    config, base = _config(), {"block_m": 128, "block_n": 32, "min_blocks": 2}
    for ops, covers in ((BACKWARD, BWD_COVERS), (STACKED, STACKED_COVERS)):
        for fuse_dq in (1, attention.ATOMIC_DQ):
            choice = Choice(covers, IMPL, base | {"fuse_dq": fuse_dq}, "label", 12.0)
            split = implementation().for_padded_batches(ops, choice, config, SIZE)
            want = implementation().point(ops, SIZE, implementation().cover_layouts(ops, config),
                                          base | {"fuse_dq": fuse_dq, "split_queries": 1})
            assert split.options == want.options() and split.label == want.label and "split_queries=1" in split.label
            assert split.predicted_us is None and split.covers == covers
            for L, split_there in ((128, False), (256, False), (257, True), (384, True)):
                at = implementation().for_padded_batches(ops, choice, config, dataclasses.replace(SIZE, L=L))
                assert (at is not choice) == split_there, L
            assert implementation().for_padded_batches(ops, split, config, SIZE) is split
        for fuse_dq in (0, 2):
            choice = Choice(covers, IMPL, base | {"fuse_dq": fuse_dq}, "label", 12.0)
            assert implementation().for_padded_batches(ops, choice, config, SIZE) is choice
    forward = Choice(COVERS, IMPL, {"block_m": 64, "block_n": 64}, "label", 9.0)
    assert implementation().for_padded_batches(FORWARD, forward, config, SIZE) is forward


def _choices(config: Configuration, size: Size) -> dict[str, Choice]:
    from substation.runtime import default_choices

    choices = default_choices(config, size)
    for covers, options in ((COVERS, {"block_m": 64, "block_n": 64}),
                            (BWD_COVERS, {"block_m": 64, "block_n": 64, "fuse_dq": 0})):
        choices |= {op: Choice(covers, IMPL, options) for op in covers}
    return choices


def test_runtime_checks_and_resizes_a_configuration_choosing_it():
    config = _config()
    choices = _choices(config, SIZE)
    check_choices(choices, config, SIZE, GRAPH)
    resized = choices_at_size(choices, config, dataclasses.replace(SIZE, B=2, L=100), GRAPH)
    assert {resized[op].impl for op in COVERS + BWD_COVERS} == {IMPL}


def test_the_profiler_times_forward_and_backward_points_as_tasks():
    work = plan(SIZE, ["float16"], ops=["attn_scores"], max_combos=2)
    assert len(work.attention_kernels) == 1848 and not work.points
    found = tasks(work, SIZE, ["float16"])
    ours = [t for t in found if isinstance(t.payload, (attention.AttentionParams, attention.AttentionBackwardParams))]
    assert len(ours) == 1848
    for task in ours:
        ((candidate, size),) = task.candidates
        assert candidate == task.payload.candidate and size == SIZE and candidate.impl == IMPL
    assert {c.pass_ for t in ours for c, _ in t.candidates} == {"forward", "backward"}
    assert pickle.loads(pickle.dumps(ours)) == ours
    assert plan(SIZE, ["float16"], ops=["ln1"], max_combos=2).attention_kernels == ()
