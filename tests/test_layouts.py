"""Layout enumeration and configuration validation."""
import math

import pytest

from substation.errors import LayoutError
from substation.graph import layer_graph
from substation.layouts import (USER_VISIBLE, Configuration, check_layout, enumerate_layouts, layout_space,
                                permutation, tied_layouts)

GRAPH = layer_graph()


@pytest.mark.parametrize("name", list(GRAPH.tensors))
def test_every_order_of_the_dims_once_canonical_first(name):
    dims = GRAPH.tensors[name].dims
    layouts = enumerate_layouts(dims)
    assert len(layouts) == math.factorial(len(dims)) == len(set(layouts))
    assert layouts[0] == dims
    assert all(sorted(layout) == sorted(dims) for layout in layouts)


def test_layout_counts_of_named_tensors():
    counts = dict(layout_space())
    assert counts["QKV"] == 120 and counts["Wqkv"] == 24 and counts["S"] == 24 and counts["M"] == 2
    assert "dWqkv" not in counts and "X" not in counts, "tied and user-visible tensors have no choice"
    assert len(counts) == len(GRAPH.tensors) - len(tied_layouts(GRAPH)) - len(USER_VISIBLE)


@pytest.mark.parametrize("layout", ["bjx", "bj", "bjii", "", None])
def test_bad_layout_names_tensor_and_dims(layout):
    with pytest.raises(LayoutError, match=r"tensor 'X'.*\['b', 'i', 'j'\]"):
        check_layout("X", "bji", layout)


def test_permutation_turns_one_layout_into_another():
    assert permutation("bji", "jbi") == (1, 0, 2)
    assert permutation("bjthp", "tbhjp") == (2, 0, 3, 1, 4)


def test_default_and_random_configurations_are_valid_and_seeded():
    default = Configuration.default()
    assert default.layouts["QKV"] == "bjthp" and default.layout("X1", "backward") == "bji"
    a, b = Configuration.random(3), Configuration.random(3)
    assert a == b and a != Configuration.random(4)
    for name, base in tied_layouts(GRAPH).items():
        assert a.layouts[name] == a.layouts[base]


def _with(**changes) -> dict:
    layouts = dict(Configuration.default().layouts)
    layouts.update(changes)
    return layouts


def test_configuration_errors():
    with pytest.raises(LayoutError, match=r"missing \['A'\]"):
        Configuration({k: v for k, v in _with().items() if k != "A"})
    with pytest.raises(LayoutError, match=r"unknown \['Nope'\]"):
        Configuration(_with(Nope="bji"))
    with pytest.raises(LayoutError, match="tensor 'S'"):
        Configuration(_with(S="bhjj"))
    with pytest.raises(LayoutError, match="'dW1' must share the layout of 'W1'"):
        Configuration(_with(W1="iu"))
    with pytest.raises(LayoutError, match="user-visible"):
        Configuration(_with(X="jbi"))
    freed = Configuration(_with(X="jbi", dX="jbi"), free_user_layouts=True)
    assert freed.layouts["X"] == "jbi"


def test_split_variables():
    config = Configuration(_with(), backward={"X1": "jbi"})
    assert config.layout("X1") == "bji" and config.layout("X1", "backward") == "jbi"
    with pytest.raises(LayoutError, match="forward activation"):
        Configuration(_with(), backward={"W1": "iu"})
    with pytest.raises(LayoutError, match="not a tensor"):
        Configuration(_with(), backward={"Nope": "ab"})
