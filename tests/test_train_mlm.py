"""scripts/train_mlm.py on the CPU: a tiny BertForMaskedLM trained two steps as transformers runs it and injected,
its rows and plot; its data; its argument errors."""
import json
import math
import statistics
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "train_mlm.py"))
TINY = ["--size", "B=2,L=8,H=2,P=8,U=32", "--layers", "1", "--vocab", "64", "--device", "cpu", "--precisions", "fp32"]
KEYS = ["size", "variant", "precision", "layers", "step_ms", "tokens_per_s", "peak_mem_gb", "losses", "min_length",
        "round", "eval_batch", "eval_ms", "eval_loss", "eval_peak_gb", "hold_loss", "peak_reserved_gb",
        "eval_peak_reserved_gb", "step_times_ms", "capture_ahead"]


def test_a_tiny_model_trains_as_transformers_runs_it_and_injected(tmp_path):
    out, plot = tmp_path / "rows.json", tmp_path / "losses.png"
    argv = [*TINY, "--steps", "2", "--warmup", "0", "--variants", "hf", "substation", "--out", str(out),
            "--plot", str(plot)]
    assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    assert [(row["variant"], row["precision"]) for row in rows] == [("hf", "fp32"), ("substation", "fp32")]
    for row in rows:
        assert list(row) == KEYS
        assert row["size"] == "b2-l8-h2-p8-u32" and row["layers"] == 1
        assert row["peak_mem_gb"] is None and row["peak_reserved_gb"] is None
        assert row["eval_batch"] is None and row["eval_ms"] is None
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(16 / row["step_ms"] * 1e3)
        assert len(row["losses"]) == 2 and all(math.isfinite(loss) for loss in row["losses"])
        assert len(row["step_times_ms"]) == 2
        assert row["step_ms"] == pytest.approx(statistics.median(row["step_times_ms"]))
    # the same weights and batches: the first losses differ by their dropout masks only
    assert rows[0]["losses"][0] == pytest.approx(rows[1]["losses"][0], rel=0.01)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inject_as_called_with_its_defaults_and_with_the_old_ones_trains_the_same(tmp_path):
    """`substation_defaults` (inject(model): padded to 64, graphs where there is a GPU, a warning that no shipped
    configuration fits) and `substation_untuned` (none of that) start from the same loss as HF."""
    out = tmp_path / "rows.json"
    argv = [*TINY, "--steps", "1", "--warmup", "0", "--variants", "hf", "substation_defaults", "substation_untuned",
            "--out", str(out)]
    with pytest.warns(UserWarning, match="no shipped configuration has H=2, P=8, U=32"):
        assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    assert [row["variant"] for row in rows] == ["hf", "substation_defaults", "substation_untuned"]
    assert rows[1]["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.01)
    assert rows[2]["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.01)


def test_evaluation_after_training_gives_the_same_loss_injected_as_transformers(tmp_path, capsys):
    """--eval-batch: each trained model evaluated in eval mode (no dropout) on the same batches of another batch size;
    after the same two training steps from the same weights, HF and the injected model agree on the mean loss up
    to what their different dropout masks in training made of the weights."""
    out = tmp_path / "rows.json"
    argv = [*TINY, "--steps", "2", "--warmup", "0", "--variants", "hf", "substation", "--eval-batch", "3",
            "--eval-steps", "2", "--lr", "1e-6", "--out", str(out)]
    assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    for row in rows:
        assert row["eval_batch"] == 3 and row["eval_ms"] > 0 and row["eval_peak_gb"] is None
        assert math.isfinite(row["eval_loss"]) and row["eval_loss"] != row["losses"][-1]
    assert rows[1]["eval_loss"] == pytest.approx(rows[0]["eval_loss"], rel=1e-4)
    assert "evaluation after training:" in capsys.readouterr().out


def test_the_unchecked_variant_trains_as_the_defaults_do_on_padded_batches(tmp_path):
    """`substation_unchecked` (inject(model, check_mask=False)) on batches of varying length, each with its padding
    mask: it trains as `substation_defaults`, whose Encoders check each new mask's values (the same first loss but for
    the dropout masks)."""
    out = tmp_path / "rows.json"
    argv = [*TINY, "--steps", "2", "--warmup", "0", "--min-length", "3", "--variants", "substation_defaults",
            "substation_unchecked", "--out", str(out)]
    with pytest.warns(UserWarning, match="no shipped configuration"):
        assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    assert [row["variant"] for row in rows] == ["substation_defaults", "substation_unchecked"]
    assert rows[1]["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.01)


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


def test_batches_of_varying_length_train_as_transformers_runs_them_and_injected_padded(tmp_path):
    out = tmp_path / "rows.json"
    argv = [*TINY, "--steps", "2", "--warmup", "1", "--variants", "hf", "substation", "--min-length", "3",
            "--length-multiple", "4", "--out", str(out)]
    assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    assert [row["min_length"] for row in rows] == [3, 3]
    assert all(len(row["losses"]) == 3 and all(math.isfinite(loss) for loss in row["losses"]) for row in rows)
    assert rows[0]["losses"][0] == pytest.approx(rows[1]["losses"][0], rel=0.01)  # dropout masks apart


def test_batches_of_varying_length_are_padded_to_their_longest_sequence():
    size = SCRIPT["get_size"]("B=4,L=16,H=2,P=8,U=32")
    for inputs, labels, mask in SCRIPT["varying_batches"](6, size, 5, 50, 0, torch.device("cpu")):
        length = inputs.shape[1]
        assert 5 <= length <= 16 and inputs.shape == labels.shape == mask.shape == (4, length)
        assert mask[0].all() and (mask[:, 1:] <= mask[:, :-1]).all()  # the first is the longest; padding at the end
        assert (inputs[mask == 0] == SCRIPT["PAD_ID"]).all() and (labels[mask == 0] == -100).all()
        assert (inputs[mask == 1] != SCRIPT["PAD_ID"]).all() and (labels[0] != -100).any()


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
    (["--min-length", "0"], "--min-length 0: must be at least 1"),
    (["--min-length", "9"], "--min-length 9: above a size's L (8)"),
    (["--length-multiple", "0"], "--length-multiple 0: must be at least 1"),
    (["--rounds", "0"], "--rounds 0: must be at least 1"),
    (["--eval-batch", "0"], "--eval-batch 0: must be at least 1"),
    (["--capture-ahead"], "--capture-ahead: CUDA graphs are captured on a GPU, not on cpu"),
])
def test_argument_errors(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"]([*TINY, "--out", str(tmp_path / "rows.json"), *argv])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_rounds_run_the_variants_in_turn_and_say_which(tmp_path):
    """--rounds 2: hf, substation_unsplit, hf, substation_unsplit, each row with its round, the same batches and
    weights each time (the first losses differ by their dropout masks only)."""
    out = tmp_path / "rows.json"
    argv = [*TINY, "--steps", "1", "--warmup", "0", "--variants", "hf", "substation_unsplit", "--rounds", "2",
            "--out", str(out)]
    assert SCRIPT["main"](argv) == 0
    rows = json.loads(out.read_text())
    assert [(row["variant"], row["round"]) for row in rows] == [("hf", 1), ("substation_unsplit", 1), ("hf", 2),
                                                               ("substation_unsplit", 2)]
    assert all(row["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.01) for row in rows)


def test_the_nondeterministic_variant_takes_its_configuration_where_one_is_shipped():
    shipped = SCRIPT["shipped_layouts"]
    assert shipped("bert-large-b8-l512", nondeterministic=True).name == "h100-bert-large-b8-l512-nondet.json"
    assert shipped("bert-large-b96-l128", nondeterministic=True).name == "h100-bert-large-b96-l128.json"
    assert shipped("bert-large-b8-l512", device_name="NVIDIA H200").name == "h200-bert-large-b8-l512.json"
    assert shipped("b2-l16-h2-p8-u64", nondeterministic=True) is None
