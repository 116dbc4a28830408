"""The kernel profile's summaries (`substation profile` prints them) on the shipped H100 profile of B8/L512."""
from pathlib import Path

import pytest

from substation.kernels.report import attention_summary, kernel_summary
from substation.records import load_records
from substation.sizes import get_size

SIZE = get_size("bert-large-b8-l512")
SHIPPED = Path(__file__).parents[2] / "layouts" / "profiles" / "h100"
ROWS = load_records(SHIPPED / "bert-large-b8-l512" / "kernels.csv.gz")


def test_kernel_summary_is_each_operators_best_layout_against_pytorch():
    summary = kernel_summary(ROWS, SIZE).set_index("op")
    kernels = ROWS[(ROWS.impl == "kernel") & (ROWS.status == "ok")]
    for op, row in summary.iterrows():
        times = kernels[kernels.op == op].median_us
        assert row.variants == len(times) and row.best_us == times.min() and row.worst_us <= times.max()
        assert row["torch/best"] == pytest.approx(row.torch_us / row.best_us)
    assert summary.loc["ln1", "min_MB"] == pytest.approx(33.57, abs=0.01)


def test_attention_summary_ranks_every_implementation_of_each_pass():
    """Rows covering operators beyond the attention's (our stacked backward, with qkv_bias_bwd) are ranked apart."""
    summary = attention_summary(ROWS, SIZE)
    assert list(summary["pass"]) == ["forward"] * 4 + ["backward"] * 5
    assert set(summary.impl) == {"attention", "attention + qkv_bias_bwd", "sdpa_flash", "sdpa_cudnn",
                                 "sdpa_efficient"}
    stacked = ROWS.covers.str.contains("qkv_bias_bwd")
    for pass_, op, flop in (("forward", "attn_scores", 4), ("backward", "attn_context_dgrad_a", 10)):
        part = summary[summary["pass"] == pass_]
        assert list(part.best_us) == sorted(part.best_us)
        for _, row in part.iterrows():
            impl, _, beyond = row.impl.partition(" + ")
            times = ROWS[(ROWS.op == op) & (ROWS.impl == impl) & (ROWS.status == "ok")
                         & (stacked == bool(beyond))].median_us
            assert row.variants == len(times) and row.best_us == times.min()
            assert row["TFLOP/s"] == pytest.approx(flop * 8 * 16 * 512 ** 2 * 64 / row.best_us / 1e6)
