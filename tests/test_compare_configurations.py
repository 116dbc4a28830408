"""scripts/compare_configurations.py: its table's arithmetic and argument errors on the CPU; on a GPU, a shipped
configuration against its JSON twin (the same choices) in turn."""
import json
import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "compare_configurations.py"))
SHIPPED = ROOT / "layouts" / "h100-bert-large-b96-l128.pickle"


def test_rows_are_medians_over_rounds_against_the_first_configuration():
    a, b = Path("a.pickle"), Path("b.json")
    medians = {("layer", a): [2.0, 4.0, 3.0], ("layer", b): [1.5, 1.4, 9.0], ("stack", a): [10.0], ("stack", b): [12.5]}
    clocks = {("layer", a): [1980.0, 1900.0, 1800.0]}
    rows = SCRIPT["summarize"]("bert-large-b8-l512", medians, clocks, [a, b])
    assert [(row["measure"], row["configuration"]) for row in rows] == [("layer", "a.pickle"), ("layer", "b.json"),
                                                                       ("stack", "a.pickle"), ("stack", "b.json")]
    assert [row["median_ms"] for row in rows] == [3.0, 1.5, 10.0, 12.5]
    assert [row["ratio"] for row in rows] == [1.0, 0.5, 1.0, 1.25]
    assert [row["sm_mhz"] for row in rows] == [1900.0, None, None, None]


def test_a_configuration_named_twice_is_refused(capsys):
    assert SCRIPT["main"](["--size", "bert-large-b8-l512", str(SHIPPED), str(SHIPPED)]) == 2
    assert "name each configuration once" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_configuration_and_its_twin_time_alike(tmp_path):
    """Two graphed layers and two stacks replayed in turn after all were built: each graph's layer stays alive."""
    out = tmp_path / "rows.json"
    argv = ["--size", "bert-large-b96-l128", str(SHIPPED), str(SHIPPED.with_suffix(".json")), "--layers", "2",
            "--rounds", "2", "--steps", "3", "--warmup", "1", "--json", str(out)]
    assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    assert [(row["measure"], Path(row["configuration"]).suffix) for row in rows] == [
        ("layer, graphed", ".pickle"), ("layer, graphed", ".json"), ("2 layers, as called", ".pickle"),
        ("2 layers, as called", ".json")]
    assert all(len(row["rounds_ms"]) == 2 and row["median_ms"] > 0 and 0.5 < row["ratio"] < 2 for row in rows)
