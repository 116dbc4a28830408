"""One configuration for several sizes: profiles combined over B and L, the weighted objective, each size's
predicted total, and the configuration file's `sizes`."""
import argparse
import dataclasses
import json
import re

import pytest

from substation.config_file import configuration_sizes, load_configuration
from substation.config_selection.cli import add_parser
from substation.config_selection.multisize import (at_size, call_impls, combine_profiles, for_sizes, row_key,
                                                   weighted_total_us)
from substation.config_selection.orders import combined
from substation.config_selection.profiles import load_profile
from substation.config_selection.selection import transpose_cost
from substation.config_selection.synthetic import SyntheticSpec, write_synthetic_profile
from substation.errors import ConfigurationFileError, RecordError, SelectionError
from substation.graph import layer_graph
from substation.sizes import Size

GRAPH = layer_graph()
B8, B96 = "bert-large-b8-l512", "bert-large-b96-l128"


def _at_both(selection, both):
    """(time at B8/L512, time at B96/L128) of a selection's configuration."""
    return tuple(at.selection.predicted_total_us for at in for_sizes(selection, both, GRAPH))


@pytest.fixture(scope="module")
def both(shipped):
    return combine_profiles([shipped[B8], shipped[B96]], (1.0, 1.0), GRAPH)


def test_one_configuration_for_both_shipped_sizes(shipped, both):
    selection = combined(both.profile, GRAPH)
    sizes = for_sizes(selection, both, GRAPH)
    # The ILP's objective is the weighted sum of the configuration's totals at each size.
    assert weighted_total_us(sizes) == pytest.approx(selection.predicted_total_us)
    primary = sizes[0].selection
    assert primary.size == shipped[B8].size and sizes[1].selection.size == shipped[B96].size
    assert {c.row for c in primary.choices} <= set(shipped[B8].rows)  # B8/L512's GEMM calls and algorithms
    assert primary.layouts == sizes[1].selection.layouts == selection.layouts
    # No configuration made for one size alone, priced at both, beats it: those that can be priced at both are
    # the best single-size ones among the candidates measured at both sizes.
    calls, common = call_impls(GRAPH), {row_key(row, call_impls(GRAPH)) for row in both.profile.rows}
    for preset in (B8, B96):
        alone = dataclasses.replace(shipped[preset], rows=tuple(row for row in shipped[preset].rows
                                                                  if row_key(row, calls) in common))
        single = _at_both(combined(alone, GRAPH), both)
        assert weighted_total_us(sizes) <= sum(single) + 1e-6, (preset, single)
    assert both.dropped > 0  # kernel variants timed at one of the sizes only


def test_gemm_epilogue_rows_combine_across_sizes_by_their_layouts(both):
    """A GEMM with our epilogue records its call at the profiled size, like cuBLASLt: its rows at both sizes meet
    by covers and layouts, so the configuration can take it for both."""
    fused = [row for row in both.profile.rows if row.impl == "cutlass_epilogue"]
    assert {row.covers for row in fused} == {("ffn_in", "bias_gelu"), ("ffn_out_dgrad", "bias_gelu_bwd")}


def test_weights_matter(shipped):
    def choose(weights):
        mix = combine_profiles([shipped[B8], shipped[B96]], weights, GRAPH)
        return _at_both(combined(mix.profile, GRAPH), mix)

    b8_first, b96_first = choose((1.0, 0.01)), choose((0.01, 1.0))
    assert b8_first[0] < b96_first[0] and b96_first[1] < b8_first[1]


def test_a_configuration_is_priced_only_where_its_choices_were_timed(shipped, both):
    selection = combined(both.profile, GRAPH)
    lacking = dataclasses.replace(shipped[B96], rows=tuple(row for row in shipped[B96].rows if row.impl != "kernel"))
    with pytest.raises(SelectionError, match=f"{shipped[B96].path} has no row for the configuration's .*kernel"):
        at_size(selection, lacking, GRAPH)


def test_layout_conversions_are_priced_at_each_size(profiles):
    small = profiles["layer"]  # on which the ILP converts some tensors for the backward
    big = dataclasses.replace(small, path="big", size=Size.from_heads(B=8, L=64, H=2, P=8, U=32),
                              rows=tuple(dataclasses.replace(row, median_us=3 * row.median_us) for row in small.rows))
    both = combine_profiles([small, big], (1.0, 2.0), GRAPH)
    selection = combined(both.profile, GRAPH)
    sizes = for_sizes(selection, both, GRAPH)
    assert selection.transposes and weighted_total_us(sizes) == pytest.approx(selection.predicted_total_us)
    for at, profile in zip(sizes, (small, big)):
        assert [t.us for t in at.selection.transposes] == [transpose_cost(profile, GRAPH, t.tensor)[0]
                                                           for t in selection.transposes]


def test_profiles_of_two_dropouts_do_not_combine(tmp_path):
    small = SyntheticSpec(Size.from_heads(B=2, L=16, H=2, P=8, U=32), algorithms=1, fused_combos=4, sdpa=False,
                          free_tensors=())
    profiles = []
    for n, (size, dropout) in enumerate(((small.size, 0.1), (dataclasses.replace(small.size, B=4), 0.0))):
        write_synthetic_profile(tmp_path / str(n), dataclasses.replace(small, size=size, dropout=dropout), GRAPH)
        profiles.append(load_profile(tmp_path / str(n), GRAPH))
    with pytest.raises(SelectionError, match=r"timed at dropout 0.0, .* at 0.1: the sizes of one configuration are "
                                             r"weighed at one dropout"):
        combine_profiles(profiles, (1, 1), GRAPH)


@pytest.mark.parametrize("other, weights, match", [
    (Size.from_heads(B=2, L=16, H=4, P=4, U=32), (1, 1), "one configuration serves one layer shape"),
    (Size.from_heads(B=2, L=16, H=2, P=8, U=32), (1, 1), "several profiles of size b2-l16-h2-p8-u32"),
    (Size.from_heads(B=4, L=8, H=2, P=8, U=32), (1,), "1 weights for 2 profiles"),
    (Size.from_heads(B=4, L=8, H=2, P=8, U=32), (1, 0), "each must be a positive finite number"),
])
def test_profiles_that_do_not_combine(tmp_path, other, weights, match):
    small = SyntheticSpec(Size.from_heads(B=2, L=16, H=2, P=8, U=32), algorithms=1, fused_combos=4, sdpa=False,
                          free_tensors=())
    profiles = []
    for n, size in enumerate((small.size, other)):
        write_synthetic_profile(tmp_path / str(n), dataclasses.replace(small, size=size), GRAPH)
        profiles.append(load_profile(tmp_path / str(n), GRAPH))
    with pytest.raises(SelectionError, match=match):
        combine_profiles(profiles, weights, GRAPH)


# ---- `substation optimize DIR1 DIR2 --weights ...` and the file's sizes ------------------------------------
SMALL = SyntheticSpec(Size.from_heads(B=2, L=16, H=2, P=8, U=32), seed=0, algorithms=2, fused_combos=16, sdpa=True,
                      sdpa_combos=4, free_tensors=("X1", "F", "H1", "Q", "dQ"))


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory):
    """Synthetic profiles of one layer shape at B=2, L=16 and B=4, L=8, in `profile --out`'s layout."""
    root = tmp_path_factory.mktemp("profiles")
    dirs = []
    for size in (SMALL.size, Size.from_heads(B=4, L=8, H=2, P=8, U=32)):
        dirs.append(root / f"b{size.B}-l{size.L}")
        write_synthetic_profile(dirs[-1], dataclasses.replace(SMALL, size=size), GRAPH)
    return dirs


def _optimize(*argv):
    parser = argparse.ArgumentParser(prog="substation")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["optimize", *map(str, argv)])
    args.run(args)


def test_optimize_over_two_sizes_writes_them_with_their_weights(two_sizes, tmp_path, capsys):
    out = tmp_path / "mixed.pickle"
    _optimize(*two_sizes, "--weights", "3", "1", "-o", out)
    printed = capsys.readouterr().out
    assert f"at b2-l16-h2-p8-u32 (weight 3, {two_sizes[0]}): predicted" in printed
    assert "weighted total over 2 sizes:" in printed
    data = load_configuration(out)
    assert data == load_configuration(out.with_suffix(".json"))
    assert data["size"] == SMALL.size.dims() and data["profile"]["path"] == str(two_sizes[0])
    assert [(entry["size"]["B"], entry["weight"]) for entry in data["sizes"]] == [(2, 3.0), (4, 1.0)]
    assert data["sizes"][0]["predicted_total_us"] == pytest.approx(data["predicted_total_us"])
    weighted = sum(entry["weight"] * entry["predicted_total_us"] for entry in data["sizes"])
    assert f"weighted total over 2 sizes: {weighted:.2f} us" in printed
    assert [(size.B, size.L, weight) for size, weight in configuration_sizes(data)] == [(2, 16, 3.0), (4, 8, 1.0)]


def test_one_profile_records_its_own_size(two_sizes, tmp_path):
    out = tmp_path / "one.pickle"
    _optimize(two_sizes[1], "-o", out)
    data = load_configuration(out)
    assert [(entry["size"]["B"], entry["weight"]) for entry in data["sizes"]] == [(4, 1.0)]
    del data["sizes"]  # as written before the field existed
    assert configuration_sizes(data) == ((Size(**data["size"]), 1.0),)


def test_the_folder_of_the_sizes_profiles_is_named_not_read(two_sizes, tmp_path):
    with pytest.raises(RecordError, match=r"it holds one profile per size: name one or several of .*/\{b2-l16,b4-l8\}"):
        _optimize(two_sizes[0].parent, "-o", tmp_path / "x.pickle")


def test_weights_must_match_the_profiles(two_sizes, tmp_path, capsys):
    with pytest.raises(SelectionError, match="--weights gives 1 weights for 2 profile directories"):
        _optimize(*two_sizes, "--weights", "1", "-o", tmp_path / "x.pickle")
    with pytest.raises(SystemExit):
        _optimize(*two_sizes, "--weights", "1", "0", "-o", tmp_path / "x.pickle")
    assert "argument --weights: must be a positive finite number, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("field, value, match", [
    ("sizes", [], "field sizes: expected a non-empty list"),
    ("sizes[0].size", {"B": 4, "L": 8, "H": 2, "P": 8, "I": 16, "U": 32},
     "field sizes[0].size: expected the file's size"),
    ("sizes[1].size", {"B": 4, "L": 8, "H": 4, "P": 4, "I": 16, "U": 32}, "field sizes[1].size: expected a size of "
                                                                          "another B or L only"),
    ("sizes[1].size", {"B": 2, "L": 16, "H": 2, "P": 8, "I": 16, "U": 32}, "each once"),
    ("sizes[1].size", {"B": 0, "L": 16, "H": 2, "P": 8, "I": 16, "U": 32}, "B=0 must be a positive integer"),
    ("sizes[1].weight", -1.0, "field sizes[1].weight: expected a positive finite number"),
])
def test_a_bad_sizes_field_is_named(two_sizes, tmp_path, field, value, match):
    out = tmp_path / "mixed.pickle"
    _optimize(*two_sizes, "-o", out)
    data = json.loads(out.with_suffix(".json").read_text())
    if field == "sizes":
        data["sizes"] = value
    else:
        index, key = int(field[6]), field.split(".")[1]
        data["sizes"][index][key] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigurationFileError, match=re.escape(match)):
        load_configuration(bad)
