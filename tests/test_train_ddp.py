"""scripts/train_ddp.py on the CPU: torchrun with two gloo processes trains a tiny injected BertForMaskedLM, and its
gradients equal one process's on the global batch; its argument errors."""
import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "train_ddp.py"))
TINY = ["--size", "B=2,L=8,H=2,P=8,U=32", "--layers", "1", "--vocab", "64", "--device", "cpu", "--precision", "fp32"]


def test_two_processes_train_with_the_gradients_of_one(tmp_path):
    out = tmp_path / "rows.json"
    argv = [*TINY, "--gpus", "2", "--variants", "substation", "--steps", "2", "--warmup", "0", "--out", str(out)]
    assert SCRIPT["main"](argv) == 0
    (row,) = json.loads(out.read_text())
    assert (row["variant"], row["gpus"], row["size"]) == ("substation", 2, "b2-l8-h2-p8-u32")
    assert row["tokens_per_s"] == pytest.approx(2 * 16 / row["step_ms"] * 1e3)
    assert row["scaling_efficiency"] is None  # no 1-GPU row to scale from
    assert row["grad_max_rel_diff"] < 1e-5 and len(row["losses"]) == 2  # float32: rounding only


def test_efficiency_is_tokens_per_s_over_gpus_times_one_gpus():
    Row = SCRIPT["Row"]
    rows = [Row("s", "hf", "fp16_amp", 24, gpus, 1.0, tokens, None, None, None, [1.0])
            for gpus, tokens in ((1, 100.0), (2, 180.0))]
    assert [row.scaling_efficiency for row in SCRIPT["with_efficiency"](rows)] == [1.0, 0.9]


@pytest.mark.parametrize("argv, match", [
    (["--precision", "fp16_amp"], "AMP runs on CUDA"),
    (["--gpus", "0"], "each must be at least 1"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
])
def test_argument_errors(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"]([*TINY, "--out", str(tmp_path / "rows.json"), *argv])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
