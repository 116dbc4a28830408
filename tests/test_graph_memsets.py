"""scripts/graph_memsets.py on the CPU: the cuBLASLt calls it times are those the shipped configurations bind, each
the call of its operator's layouts at the configuration's size, with the recorded algorithm's options."""
import runpy
from pathlib import Path

from substation.config_file import load_configuration
from substation.tc_profiling.cublaslt import ALGO_CONFIG

ROOT = Path(__file__).parents[1]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "graph_memsets.py"))


def test_calls_are_the_configurations_cublaslt_gemms():
    data = load_configuration(ROOT / "layouts" / "h100-bert-large-b96-l128.pickle")
    calls = {op: (call, options) for op, call, options in SCRIPT["cublaslt_calls"](data)}
    bound = {op for op, entry in data["operators"].items()
             if entry["impl"] in ("cublaslt", "cublaslt_bias") and op == entry.get("covers", [op])[0]}
    assert set(calls) == bound and "out_proj" in calls and "qkv_proj" in calls
    tokens = 96 * 128
    out_proj, options = calls["out_proj"]
    assert (out_proj.m * out_proj.n, out_proj.k, out_proj.batch) == (1024 * tokens, 1024, 1)
    assert set(ALGO_CONFIG) <= set(options) and "bias_batch_stride" not in options
    qkv, options = calls["qkv_proj"]
    assert qkv.batch == 3 and options["bias_batch_stride"] == 1024
    assert calls["ffn_out_wgrad"][0].k == tokens
