"""The three graph orders on the shipped H100 profiles: each yields a configuration (bp_first and fp_first once
stranded their second pass there), combined is never worse, the printed layout conversions are the configuration's
split variables, and layouts/README.md shows what scripts/predicted_orders.py prints."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from substation import Encoder
from substation.config_selection import (GRAPH_ORDERS, configuration_dict, format_report, load_configuration,
                                         write_configuration)
from substation.graph import layer_graph

GRAPH = layer_graph()
ROOT = Path(__file__).parents[2]
PRESETS = ("bert-large-b8-l512", "bert-large-b96-l128")


def _script():
    spec = importlib.util.spec_from_file_location("predicted_orders", ROOT / "scripts" / "predicted_orders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture(scope="module")
def selections(shipped, script):
    """preset -> order -> Selection: each order solved once per shipped profile (about a second each)."""
    return {preset: script.solve_orders(shipped[preset], GRAPH) for preset in PRESETS}


@pytest.mark.parametrize("order", GRAPH_ORDERS)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_order_yields_a_configuration_the_encoder_takes(selections, tmp_path, preset, order):
    selection = selections[preset][order]
    assert selection.optimal and selection.graph_order == order
    covered = sorted(op for choice in selection.choices for op in choice.row.covers)
    assert covered == sorted(op.name for op in GRAPH.operators)
    path, _ = write_configuration(selection, tmp_path / f"{order}.pickle")
    data = load_configuration(path, size=selection.size)  # every layout, tie and operator checked
    assert data["predicted_total_us"] == pytest.approx(selection.predicted_total_us)
    Encoder.from_layouts(path, dtype=torch.float32)  # every choice checked against the implementations


@pytest.mark.parametrize("preset", PRESETS)
def test_combined_is_never_worse_than_the_sequential_orders(selections, preset):
    totals = {order: selection.predicted_total_us for order, selection in selections[preset].items()}
    assert totals["combined"] <= totals["bp_first"] + 1e-6
    assert totals["combined"] <= totals["fp_first"] + 1e-6


@pytest.mark.parametrize("order", GRAPH_ORDERS)
@pytest.mark.parametrize("preset", PRESETS)
def test_the_printed_conversions_are_the_configurations_split_vars(selections, preset, order):
    selection = selections[preset][order]
    report, data = format_report(selection), configuration_dict(selection)
    printed = re.findall(r"^layout conversion (\w+): (\w+) -> (\w+) for the backward, ([\d.]+) us \((\w+)",
                         report, re.M)
    assert [t for t, *_ in printed] == data["split_vars"] == list(data["transposes"])
    for tensor, forward, backward, us, source in printed:
        assert data["tensors"][tensor] == {"forward": forward, "backward": backward} and forward != backward
        assert data["transposes"][tensor]["us"] == pytest.approx(float(us), abs=0.005)
        assert data["transposes"][tensor]["source"].startswith(source)
    assert printed or "layout conversions: none" in report
    booked = sum(e["predicted_us"] for e in data["operators"].values())
    assert booked + sum(t["us"] for t in data["transposes"].values()) == pytest.approx(data["predicted_total_us"])


def test_one_pass_first_orders_convert_where_the_passes_conflict(selections):
    """An order that fixes one pass's layouts first converts a shared tensor where the other pass prefers another
    layout: conversions, not a dead end. fp_first at B8/L512 converts X1. bp_first converted N1 (B8/L512) and Q, K, V
    (B96/L128) until the tenth session's re-timing of the LayerNorm and attention rows; it now finds combined's
    optimum at both sizes. combined, which weighs both passes at once, converts nothing."""
    assert set(selections["bert-large-b8-l512"]["fp_first"].split_vars) == {"X1"}
    for preset in PRESETS:
        assert not selections[preset]["combined"].split_vars


def test_layouts_readme_shows_the_current_table(selections, script):
    table = script.predicted_table(selections)
    assert table in (ROOT / "layouts" / "README.md").read_text(encoding="utf-8"), \
        f"layouts/README.md is stale: rerun `python scripts/predicted_orders.py` and paste\n{table}"
