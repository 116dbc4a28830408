"""The benchmark harness and its scripts: sizes, flop, tables, JSON, ncu parsing, argument errors (CPU);
graph capture and timing of a step (GPU)."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from substation import Size
from substation.benchmark import (JSON_KEYS, SUBSTATION, SUBSTATION_EAGER, Result, breakdown_table, format_table,
                                  forward_flop, make_inputs, results_table, step_flop, tflops, train_step)
from substation.sizes import get_size, size_name
from substation.runtime import OperatorTime

SCRIPTS = Path(__file__).parents[1] / "scripts"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- flop ----------------------------------------------------------------------------------------------
def test_flop_counts_the_contractions():
    size = get_size("bert-large-b8-l512")
    B, L, H, P, I, U = size.B, size.L, size.H, size.P, size.I, size.U
    want = 2 * B * L * I * 3 * I + 2 * 2 * B * H * L * L * P + 2 * B * L * I * I + 2 * 2 * B * L * I * U
    assert forward_flop(size) == want
    assert step_flop(size) == 3 * want
    assert tflops(10**12, 1000.0) == pytest.approx(1.0) and tflops(1, None) is None


def test_graph_timeline_table_names_gaps_overlaps_and_memsets():
    """scripts/graph_timeline.py's table: each activity's gap since every earlier one ended (negative where a
    dependent launch overlaps its predecessor), and the sums: span, memsets apart from kernels and copies."""
    rows = [("memcpy32_post", 0.0, 1.0), ("Memset (Unknown)", 2.5, 0.75), ("gemm", 6.0, 40.0),
            ("ln_bwd", 46.5, 12.0), ("ln_bwd_colsum", 47.5, 12.5), ("attn", 60.25, 5.0)]
    lines = load_script("graph_timeline").timeline_table(rows)
    gaps = [float(line.split()[1]) for line in lines[1:-1]]
    assert gaps == [0.0, 1.5, 2.75, 0.5, -11.0, 0.25]
    assert lines[-1] == ("span 65.2 µs; 6 activities, 1 memsets (0.8 µs); kernels and copies 70.5 µs (overlapping "
                         "ones count in full)")


# ---- tables and JSON ------------------------------------------------------------------------------------
RESULTS = [
    Result("s", SUBSTATION, False, 1.0, 0.4, 0.9, 300.0),
    Result("s", SUBSTATION, True, 0.8, 0.3, 0.75, 375.0, 1980.0),
    Result("s", "eager_sdpa", False, 1.6, 0.6, 1.5, 187.5),
    Result("s", "eager_sdpa", True, 1.2, 0.5, 1.1, 250.0),
    Result("s", "compile_max_autotune", False, error="BackendCompilerFailed: boom"),
]


def test_results_table_speedup_pairs_same_graphing():
    table = results_table(RESULTS)
    assert list(table.variant) == [r.variant for r in RESULTS]
    speedup = dict(zip(zip(table.variant, table.graphed), table.substation_speedup))
    assert speedup[("eager_sdpa", "no")] == pytest.approx(1.6)
    assert speedup[("eager_sdpa", "yes")] == pytest.approx(1.5)
    assert speedup[(SUBSTATION, "yes")] == pytest.approx(1.0)
    assert table.note.iloc[-1] == "BackendCompilerFailed: boom"
    text = format_table(table)
    assert "1.600" in text and "BackendCompilerFailed: boom" in text
    last = text.splitlines()[-1].split()
    assert last[:3] == ["compile_max_autotune", "no", "-"]


def test_results_table_without_substation_has_no_speedup():
    table = results_table(RESULTS[2:])
    assert table.substation_speedup.isna().all()
    assert "-" in format_table(table)


def test_json_rows_have_exactly_the_keys():
    rows = json.loads(json.dumps([r.as_json() for r in RESULTS]))
    assert all(tuple(row) == JSON_KEYS for row in rows)
    assert rows[1] == {"size": "s", "variant": SUBSTATION, "graphed": True, "fwdbwd_ms": 0.8, "fwd_ms": 0.3,
                       "min_ms": 0.75, "tflops": 375.0, "sm_mhz": 1980.0}
    assert rows[0]["sm_mhz"] is None  # no clock log (no nvidia-smi)
    assert rows[-1]["fwdbwd_ms"] is None


def test_breakdown_table_ratios_and_totals():
    rows = [OperatorTime("qkv_proj", "forward", "cublaslt", "qkv_proj/fwd cublaslt", 100.0, 110.0, 109.0, 20.0),
            OperatorTime("softmax", "forward", "kernel", "softmax/fwd kernel", 20.0, 30.0, 29.0, 35.0),
            OperatorTime("dqkv", "backward", "cublas", "dqkv/bwd cublas", None, 50.0, 49.0, 25.0)]
    table = breakdown_table(rows)
    assert list(table.op) == ["qkv_proj", "softmax", "dqkv", "total forward", "total backward", "total"]
    assert table.ratio.iloc[0] == pytest.approx(1.1) and table.ratio.iloc[1] == pytest.approx(1.5)
    assert math.isnan(table.ratio.iloc[2])
    total = table.iloc[-1]
    assert total.measured_us == pytest.approx(190.0) and total.predicted_us == pytest.approx(120.0)
    assert math.isnan(table.predicted_us.iloc[4])  # the backward has no prediction at all
    assert total.host_us == pytest.approx(80.0) and table.host_us.iloc[3] == pytest.approx(55.0)
    text = format_table(table, digits=1)
    assert "190.0" in text and "1.5" in text
    written = json.loads(table.to_json(orient="records"))  # as run_encoder.py --breakdown-json writes it
    assert written[2]["predicted_us"] is None and written[-1]["measured_us"] == pytest.approx(190.0)


# ---- the step, on the CPU -------------------------------------------------------------------------------
def test_train_step_does_not_accumulate_gradients():
    from substation.baselines import make_baseline

    size = Size.from_heads(B=2, L=5, H=2, P=4, U=12)
    layer = make_baseline("eager_manual", size, torch.float64, "cpu", attention_dropout=0.0, hidden_dropout=0.0)
    x, mask, dy = make_inputs(size, torch.float64, "cpu", masked=True)
    assert mask[1, -1] == 0 and mask[0].all()
    step = train_step(layer, x, mask, dy)
    step()
    first = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    step()
    for a, b in zip(first, [p.grad for p in layer.parameters()] + [x.grad]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- the scripts' arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, match", [
    (["--variants", "eager_sdpa"], "--size"),
    (["--size", "bert-huge", "--variants", "eager_sdpa"], "unknown size preset 'bert-huge'"),
    (["--size", "bert-large-b8-l512"], "--layouts FILE is needed"),
    (["--size", "bert-large-b8-l512", "--layouts", "nonexistent.pickle"], "no such file"),
    (["--size", "bert-large-b8-l512", "--variants", "eager_sdpa", "--steps", "0"], "--steps 0"),
    (["--size", "bert-large-b8-l512", "--variants", "eager_foo"], "invalid choice"),
    (["--size", "bert-large-b8-l512", "--variants", "eager_sdpa", "--dtype", "float32"], "invalid choice"),
    (["--size", "bert-large-b8-l512", "--variants", "eager_sdpa", "--breakdown-json", "b.json"], "needs --breakdown"),
])
def test_run_encoder_argument_errors(argv, match, capsys):
    script = load_script("run_encoder")
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("name, extra", [("run_encoder", ["--variants", "eager_sdpa"]),
                                         ("measure_bytes", ["--variants", "eager_sdpa"]), ("graph_timeline", []),
                                         ("graph_pools", ["--out", "pools.json"])])
def test_scripts_without_gpu_say_so_in_one_line(name, extra, capsys):
    script = load_script(name)
    assert script.main(["--size", "B=2,L=8,H=2,P=4,U=16", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{name}.py: error: needs an NVIDIA GPU, and torch sees none"]


def test_measure_bytes_argument_errors(capsys):
    script = load_script("measure_bytes")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--size", "bert-large-b8-l512"])
    assert exit_info.value.code == 2
    assert "--layouts FILE is needed" in capsys.readouterr().err


# ---- ncu's CSV ------------------------------------------------------------------------------------------
# Captured from ncu 2025.3 (CUDA 13.0) on an H100: the first GEMM and the philox kernel of eager SDPA's step.
NCU_SAMPLE = '''==PROF== Connected to process 535 (/usr/bin/python3.12)
==PROF== Disconnected from process 535
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","535","python3.12","127.0.0.1","nvjet_sm90_hsh_128x256_64x4_2x1_v_bz_coopA_bias_TNN","1","7","(384, 1, 1)","(2, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","10,515,712"
"0","535","python3.12","127.0.0.1","nvjet_sm90_hsh_128x256_64x4_2x1_v_bz_coopA_bias_TNN","1","7","(384, 1, 1)","(2, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","72,448"
"0","535","python3.12","127.0.0.1","nvjet_sm90_hsh_128x256_64x4_2x1_v_bz_coopA_bias_TNN","1","7","(384, 1, 1)","(2, 64, 1)","0","9.0","Command line profiler metrics","lts__t_sectors_op_read.sum","sector","1,938,443"
"0","535","python3.12","127.0.0.1","nvjet_sm90_hsh_128x256_64x4_2x1_v_bz_coopA_bias_TNN","1","7","(384, 1, 1)","(2, 64, 1)","0","9.0","Command line profiler metrics","lts__t_sectors_op_write.sum","sector","393,590"
"3","535","python3.12","127.0.0.1","philox::unpack_cudnn(at::PhiloxCudaState, long *, long *)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,816"
"3","535","python3.12","127.0.0.1","philox::unpack_cudnn(at::PhiloxCudaState, long *, long *)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"3","535","python3.12","127.0.0.1","philox::unpack_cudnn(at::PhiloxCudaState, long *, long *)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sectors_op_read.sum","sector","972"
"3","535","python3.12","127.0.0.1","philox::unpack_cudnn(at::PhiloxCudaState, long *, long *)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sectors_op_write.sum","sector","52"
'''


def test_parse_ncu_csv_one_row_per_kernel():
    script = load_script("measure_bytes")
    kernels = script.parse_ncu_csv(NCU_SAMPLE)
    assert list(kernels.id) == [0, 3]
    assert kernels.kernel.iloc[1] == "philox::unpack_cudnn(at::PhiloxCudaState, long *, long *)"
    assert list(kernels.dram_read_bytes) == [10515712, 2816]
    assert list(kernels.dram_write_bytes) == [72448, 0]
    assert list(kernels.l2_read_bytes) == [1938443 * 32, 972 * 32]  # sectors of 32 bytes
    assert list(kernels.l2_write_bytes) == [393590 * 32, 52 * 32]
    summary = script.summarize(kernels)
    assert summary["kernels"] == 2
    assert summary["dram_bytes"] == 10515712 + 2816 + 72448
    assert summary["per_kernel"] == [
        {"kernel": "nvjet_sm90_hsh_128x256_64x4_2x1_v_bz_coopA_bias_TNN", "dram_bytes": 10515712 + 72448},
        {"kernel": "philox::unpack_cudnn(at::PhiloxCudaState, long *, long *)", "dram_bytes": 2816}]
    assert summary["l2_bytes"] == (1938443 + 972 + 393590 + 52) * 32


def test_parse_ncu_csv_units_and_missing_metrics():
    script = load_script("measure_bytes")
    text = "\n".join(line for line in NCU_SAMPLE.splitlines() if "lts__" not in line)
    text = text.replace('"byte","10,515,712"', '"Mbyte","10.5"').replace('"byte","2,816"', '"Kbyte","2.8"')
    kernels = script.parse_ncu_csv(text)
    assert list(kernels.dram_read_bytes) == pytest.approx([10.5e6, 2800])
    summary = script.summarize(kernels)
    assert summary["l2_bytes"] is None and summary["dram_bytes"] == pytest.approx(10.5e6 + 2800 + 72448)


@pytest.mark.parametrize("text, match", [
    ("==PROF== ERR_NVGPUCTRPERM - no permission\n", "no CSV header"),
    ('"ID","Kernel Name","Metric Value"\n"0","k","1"\n', "lacks"),
    (NCU_SAMPLE.replace('"byte","72,448"', '"percent","7"'), "'percent' of dram__bytes_write.sum"),
    (NCU_SAMPLE.replace('"byte","2,816"', '"byte","n/a"'), "'n/a' is not a number"),
])
def test_parse_ncu_csv_errors(text, match):
    script = load_script("measure_bytes")
    with pytest.raises(script.NcuParseError, match=match):
        script.parse_ncu_csv(text)


def test_bytes_table_and_minimum():
    script = load_script("measure_bytes")
    size = get_size("bert-large-b8-l512")
    minimum = script.minimum_bytes(size)
    assert minimum == 1820434432  # `substation analyze`'s total, forward and backward (README)
    rows = [{"size": "s", "variant": "substation", "kernels": 20, "dram_read_bytes": 1.2e9, "dram_write_bytes": 0.6e9,
             "dram_bytes": 1.8e9, "min_bytes": minimum},
            {"size": "s", "variant": "eager_sdpa", "kernels": 60, "dram_read_bytes": 2e9, "dram_write_bytes": 1e9,
             "dram_bytes": 3e9, "l2_bytes": 4e9, "min_bytes": minimum},
            {"size": "s", "variant": "hf_bertlayer", "kernels": None, "dram_bytes": None, "min_bytes": minimum,
             "error": "RuntimeError: ncu exited with 1"}]
    table = script.bytes_table(rows)
    assert table.vs_eager_sdpa.iloc[0] == pytest.approx(0.6)
    assert table.total_MB.iloc[1] == pytest.approx(3000.0)
    assert table.x_min.iloc[1] == pytest.approx(3e9 / minimum)
    assert table.L2_MB.iloc[1] == pytest.approx(4000.0) and math.isnan(table.L2_MB.iloc[0])
    assert table.note.iloc[2] == "RuntimeError: ncu exited with 1"
    assert "-" in format_table(table)


# ---- GPU: graph capture and timing ----------------------------------------------------------------------
@gpu
@needs_cuda
def test_graph_replay_gives_the_eager_gradients():
    from substation.baselines import make_baseline
    from substation.benchmark import capture

    size = Size.from_heads(B=2, L=64, H=4, P=16, U=256)
    layer = make_baseline("eager_manual", size, torch.float32, "cuda", attention_dropout=0.0, hidden_dropout=0.0)
    x, mask, dy = make_inputs(size, torch.float32, "cuda", masked=True)
    step = train_step(layer, x, mask, dy)
    graph, y_static = capture(step)
    params = list(layer.parameters())
    owned = [y_static, x.grad] + [p.grad for p in params]  # the graph's output and gradients
    for seed in (5, 6):  # new data in the static inputs: the replay must see it
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, generator=gen))
            dy.copy_(torch.randn(dy.shape, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in owned]
        y = step()  # eager: sets .grad to None and allocates new gradients; the graph keeps its own
        want = [y.detach(), x.grad] + [p.grad for p in params]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@gpu
@needs_cuda
def test_graphed_dropout_draws_new_masks_each_replay():
    from substation.baselines import make_baseline
    from substation.benchmark import capture

    size = Size.from_heads(B=2, L=32, H=2, P=16, U=64)
    layer = make_baseline("eager_sdpa", size, torch.float16, "cuda").train()
    x, mask, dy = make_inputs(size, torch.float16, "cuda")
    graph, y = capture(train_step(layer, x, mask, dy))
    graph.replay()
    first = y.detach().clone()
    graph.replay()
    assert not torch.equal(first, y), "each replay advances the dropout generator"


def test_substation_variants_need_a_layouts_file():
    from substation.benchmark import build_variant

    size = Size.from_heads(B=2, L=5, H=2, P=4, U=12)
    for variant in (SUBSTATION, SUBSTATION_EAGER):
        with pytest.raises(ValueError, match=f"the {variant} variant needs a layouts file"):
            build_variant(variant, size, torch.float16, {})


@gpu
@needs_cuda
def test_substation_variants_run_with_and_without_their_own_graphs():
    """The shipped B8/L512 file as `substation` (cuda_graphs=True) and `substation_eager` (False): every row
    timed; graphed, both are the same step."""
    from substation.benchmark import benchmark, build_variant, reference_state_dict

    size = get_size("bert-large-b8-l512")
    layouts = str(Path(__file__).parents[1] / "layouts" / "h100-bert-large-b8-l512.pickle")
    state = reference_state_dict(size)
    for variant in (SUBSTATION, SUBSTATION_EAGER):
        assert build_variant(variant, size, torch.float16, state, layouts).cuda_graphs == (variant == SUBSTATION)
    results = benchmark(size_name(size), size, torch.float16, [SUBSTATION, SUBSTATION_EAGER], layouts=layouts,
                        warmup=2, runs=5)
    assert {(r.variant, r.graphed) for r in results if r.error is None and r.fwdbwd_ms > 0} == {
        (variant, graphed) for variant in (SUBSTATION, SUBSTATION_EAGER) for graphed in (False, True)}


@gpu
@needs_cuda
def test_benchmark_times_every_mode(tmp_path):
    from substation.benchmark import benchmark

    size = get_size("B=2,L=64,H=4,P=16,U=256")
    results = benchmark(size_name(size), size, torch.float16, ["eager_sdpa", SUBSTATION], layouts=None, warmup=2,
                        runs=5)
    by_key = {(r.variant, r.graphed): r for r in results}
    assert set(by_key) == {("eager_sdpa", False), ("eager_sdpa", True), (SUBSTATION, False), (SUBSTATION, True)}
    for graphed in (False, True):
        r = by_key[("eager_sdpa", graphed)]
        assert r.error is None and 0 < r.min_ms <= r.fwdbwd_ms and r.fwd_ms > 0 and r.tflops > 0
        assert by_key[(SUBSTATION, graphed)].error  # no layouts file: a row with the reason


def test_shipped_h100_rows_cover_every_variant_at_both_sizes():
    """layouts/h100-run_encoder.json: every variant, graphed and not, at both shipped sizes, in JSON_KEYS."""
    from substation.benchmark import ALL_VARIANTS

    rows = json.loads((Path(__file__).parents[1] / "layouts" / "h100-run_encoder.json").read_text())
    assert all(tuple(row) == JSON_KEYS[:-1] for row in rows)  # written before the SM clock was logged (sm_mhz)
    found = {(row["size"], row["variant"], row["graphed"]) for row in rows}
    want = {(size, variant, graphed) for size in ("bert-large-b8-l512", "bert-large-b96-l128")
            for variant in ALL_VARIANTS for graphed in (False, True)}
    assert found == want and len(rows) == len(want)
    assert all(0 < row["fwd_ms"] < row["fwdbwd_ms"] and row["min_ms"] <= row["fwdbwd_ms"] for row in rows)


def test_the_shipped_rows_plot(tmp_path):
    """scripts/plot_results.py draws the shipped rows; rows without a time are left out, none at all is an error."""
    script = load_script("plot_results")
    out = tmp_path / "speed.png"
    assert script.main([str(Path(__file__).parents[1] / "layouts" / "h100-run_encoder.json"), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from substation.benchmark import plot_results

    with pytest.raises(ValueError, match="no timed rows"):
        plot_results([dict(size="s", variant="v", graphed=False, fwdbwd_ms=None)], str(tmp_path / "none.png"))
