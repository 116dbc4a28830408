"""The kernel profiler's CPU side: registry, layout space, plan."""
import pytest

from substation.errors import GraphError
from substation.graph import layer_graph
from substation.kernels.profiler import plan
from substation.kernels.registry import kernel_module, registry
from substation.kernels.space import choices, gemm_layouts, layout_space
from substation.sizes import get_size

SIZE = get_size("bert-large-b8-l512")
GRAPH = layer_graph()


def test_unknown_kernel_lists_the_known_ones():
    with pytest.raises(GraphError, match="no kernel implements 'attn_scores'; kernels exist for: .*softmax"):
        kernel_module("attn_scores")
    assert set(registry()) <= {op.name for op in GRAPH.operators if not op.is_contraction}


def test_layout_space_rules():
    layouts = gemm_layouts(SIZE)
    assert set(layouts["S"]) == {"bhjk", "bhkj", "hbjk", "hbkj", "jbhk", "kbhj", "jhbk", "khbj"}
    assert choices("X", GRAPH, SIZE) == ("bji",), "user-visible tensors keep their layout"
    assert choices("Pr", GRAPH, SIZE) == layouts["S"], "Pr may be written in any layout S can have"
    assert choices("Rs1", GRAPH, SIZE) == ("bj",)
    space = layout_space(GRAPH.operator("softmax"), SIZE)
    assert space.total == 64 and all(c["Pr"] == c["S"] for c in space.combos)
    sampled = layout_space(GRAPH.operator("softmax_bwd"), SIZE, max_combos=20)
    assert (len(sampled.combos), sampled.total) == (20, 512) and sampled.coverage == 20 / 512
    assert sampled.combos[0] == {"dA": "bhjk", "Pr": "bhjk", "dS": "bhjk"}, "the canonical combination stays"


def test_plan_has_feasible_points_for_every_registered_operator():
    work = plan(SIZE, ["float16"], max_combos=8)
    assert {p.op for p in work.points} == set(registry())
    for params in work.points:
        params.check()
    assert len({p.label for p in work.points}) == len(work.points)
