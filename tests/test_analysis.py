"""Flop and minimum bytes per operator, the totals per kind, and the `analyze` command."""
import json

import pytest

from substation.analysis import operator_costs, totals_by_kind
from substation.cli import main
from substation.sizes import get_size

SIZE = get_size("bert-large-b8-l512")


def test_forward_contraction_flop_of_bert_large():
    costs = operator_costs(SIZE)
    contractions = costs[costs.kind == "contraction"]
    forward = contractions[contractions["pass"] == "forward"].flop.sum()
    assert forward == 111_669_149_696  # 111.67 GFLOP
    assert contractions[contractions["pass"] == "backward"].flop.sum() == 2 * forward


def test_minimum_bytes_read_inputs_and_write_outputs_once():
    costs = operator_costs(SIZE).set_index("op")
    B, L, I, U = 8, 512, 1024, 4096
    assert costs.loc["qkv_proj", "bytes"] == 2 * (B * L * I + 3 * I * I + 3 * B * L * I)
    assert costs.loc["bias_gelu", "bytes"] == 2 * (2 * B * L * U + U)
    s = B * 16 * L * L
    assert costs.loc["softmax", "bytes"] == 2 * (3 * s + B * L)
    assert operator_costs(SIZE.with_dtype("float32")).bytes.sum() == 2 * costs.bytes.sum()


def test_totals_per_kind():
    totals = totals_by_kind(operator_costs(SIZE)).set_index("kind")
    assert list(totals.index) == ["contraction", "normalization", "elementwise", "total"]
    for column in ("flop_pct", "bytes_pct"):
        assert totals[column].drop("total").sum() == pytest.approx(100)
    assert totals.loc["contraction", "flop_pct"] > 99  # the paper's point: contractions are nearly all flop...
    assert totals.loc["contraction", "bytes_pct"] < 60  # ...but far from all data movement
    assert totals.loc["total", "flop_us"] == pytest.approx(totals.loc["total", "flop"] / 750e6)
    slower = totals_by_kind(operator_costs(SIZE), copy_tbs=1.0).set_index("kind")
    assert slower.loc["normalization", "bytes_us"] == pytest.approx(2.97 * totals.loc["normalization", "bytes_us"])


def test_analyze_table_csv_json_and_plot(capsys, tmp_path):
    assert main(["analyze", "--size", "bert-large-b8-l512", "--plot", str(tmp_path / "shares.png")]) == 0
    out = capsys.readouterr().out
    assert "qkv_proj" in out and "residual_bwd" in out and "normalization" in out
    assert (tmp_path / "shares.png").stat().st_size > 1000
    assert main(["analyze", "--size", "bert-large-b96-l128", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "op,pass,kind,flop,bytes" and len(lines) == 1 + 29
    assert main(["analyze", "--size", "bert-large-b8-l512", "--format", "json", "--dtype", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16" and len(report["operators"]) == 29 and report["totals"][-1]["kind"] == "total"


def test_unknown_preset_is_one_line(capsys):
    assert main(["analyze", "--size", "bert-tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "unknown size preset 'bert-tiny'; known presets: bert-large-b8-l512, bert-large-b96-l128" in err


def test_non_positive_rate_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--size", "bert-large-b8-l512", "--copy-tbs", "-1"])
    assert exit_info.value.code == 2
    assert "must be a positive finite number, got '-1'" in capsys.readouterr().err
