"""scripts/train_mlm.py on the CPU: a tiny BertForMaskedLM trained two steps as transformers runs it and injected,
its rows and plot; its data; its argument errors."""
import json
import math
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "train_mlm.py"))
TINY = ["--size", "B=2,L=8,H=2,P=8,U=32", "--layers", "1", "--vocab", "64", "--device", "cpu", "--precisions", "fp32"]
KEYS = ["size", "variant", "precision", "layers", "step_ms", "tokens_per_s", "peak_mem_gb", "losses"]


def test_a_tiny_model_trains_as_transformers_runs_it_and_injected(tmp_path):
    out, plot = tmp_path / "rows.json", tmp_path / "losses.png"
    argv = [*TINY, "--steps", "2", "--warmup", "0", "--variants", "hf", "substation", "--out", str(out),
            "--plot", str(plot)]
    assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    assert [(row["variant"], row["precision"]) for row in rows] == [("hf", "fp32"), ("substation", "fp32")]
    for row in rows:
        assert list(row) == KEYS
        assert row["size"] == "b2-l8-h2-p8-u32" and row["layers"] == 1 and row["peak_mem_gb"] is None
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(16 / row["step_ms"] * 1e3)
        assert len(row["losses"]) == 2 and all(math.isfinite(loss) for loss in row["losses"])
    # the same weights and batches: the first losses differ by their dropout masks only
    assert rows[0]["losses"][0] == pytest.approx(rows[1]["losses"][0], rel=0.01)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_runs_more_steps_under_the_profiler_and_writes_their_table(tmp_path):
    out, profiles = tmp_path / "rows.json", tmp_path / "profiles"
    argv = [*TINY, "--steps", "2", "--warmup", "1", "--variants", "substation", "--out", str(out),
            "--profile", str(profiles)]
    assert SCRIPT["main"](argv) == 0
    (row,) = json.loads(out.read_text())
    assert len(row["losses"]) == 1 + 2 + SCRIPT["PROFILED_STEPS"]  # the profiled steps are not timed but trained
    table = (profiles / "b2-l8-h2-p8-u32-fp32-substation.txt").read_text()
    assert table.startswith(f"{SCRIPT['PROFILED_STEPS']} steps under the profiler: ")
    assert "aten::" in table and "Self CPU time total" in table


def test_optimizer_is_adamw_fused_on_a_gpu_and_as_named_elsewhere():
    params = [torch.nn.Parameter(torch.randn(3))]
    cpu = torch.device("cpu")
    assert not SCRIPT["make_optimizer"]("fused", params, 1e-3, cpu).defaults["fused"]  # CUDA's kernels only
    assert SCRIPT["make_optimizer"]("foreach", params, 1e-3, cpu).defaults["foreach"]
    if torch.cuda.is_available():
        gpu = [torch.nn.Parameter(torch.randn(3, device="cuda"))]
        assert SCRIPT["make_optimizer"]("fused", gpu, 1e-3, torch.device("cuda")).defaults["fused"]


def test_the_data_is_runs_of_ids_masked_as_bert_masks():
    generator = torch.Generator().manual_seed(0)
    ids = SCRIPT["token_stream"](generator, 4, 128, 50)
    assert ids.min() >= SCRIPT["FIRST_ID"] and ids.max() < 50
    follows = (ids[:, 1:] - ids[:, :-1]) % (50 - SCRIPT["FIRST_ID"]) == 1
    assert 0.8 < follows.float().mean() < 1  # runs of consecutive ids, a new one now and then
    inputs, labels = SCRIPT["mask_tokens"](generator, ids, 50)
    predicted = labels != -100
    assert (predicted.sum(1) == round(0.15 * 128)).all() and (labels[predicted] == ids[predicted]).all()
    assert (inputs[~predicted] == ids[~predicted]).all() and (inputs[predicted] == SCRIPT["MASK_ID"]).any()


@pytest.mark.parametrize("argv, match", [
    (["--precisions", "fp16_amp"], "AMP runs on a CUDA device"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--size", "bert-huge"], "unknown size preset 'bert-huge'"),
    (["--variants", "deepspeed"], "invalid choice"),
    (["--optimizer", "sgd"], "invalid choice"),
])
def test_argument_errors(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"]([*TINY, "--out", str(tmp_path / "rows.json"), *argv])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
