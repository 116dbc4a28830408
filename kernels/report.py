"""The kernel profile at a glance: per fused operator, the best variant against PyTorch and the bandwidth; per
attention pass, every implementation's best row and its tensor-core rate."""
from __future__ import annotations

import pandas as pd

from substation.analysis import H100_COPY_TBS, operator_costs
from substation.kernels.sdpa import BACKWARD_COVERS, FORWARD_COVERS
from substation.sizes import Size


def kernel_summary(rows: pd.DataFrame, size: Size, copy_tbs: float = H100_COPY_TBS) -> pd.DataFrame:
    """One row per fused operator: best and worst kernel µs, PyTorch µs, minimum MB, the best's bandwidth."""
    ok = rows[(rows.status == "ok") & (rows.dtype == size.dtype)]
    kernels = ok[ok.impl == "kernel"]
    per_layout = kernels.groupby(["op", "layouts"], sort=False).median_us.min().reset_index()
    by_op = per_layout.groupby("op", sort=False).median_us
    summary = pd.DataFrame({"variants": kernels.groupby("op", sort=False).size(), "best_us": by_op.min(),
                            "worst_us": by_op.max(), "torch_us": ok[ok.impl == "torch"].set_index("op").median_us})
    summary = summary.dropna(subset=["best_us"])
    moved = operator_costs(size).set_index("op").bytes
    summary["min_MB"] = moved.reindex(summary.index) / 1e6
    summary["best_TB/s"] = summary.min_MB / summary.best_us  # MB per µs = TB/s
    summary["of_copy_rate"] = summary["best_TB/s"] / copy_tbs
    summary["torch/best"] = summary.torch_us / summary.best_us
    summary["worst/best"] = summary.worst_us / summary.best_us
    return summary.reset_index().rename(columns={"index": "op"})


# The op an attention row is named after: its pass, and its products' flop over B·H·L²·P.
ATTENTION_PASSES = {"attn_scores": ("forward", 4), "attn_context_dgrad_a": ("backward", 10)}
SUBGRAPH = frozenset(FORWARD_COVERS + BACKWARD_COVERS)  # the attention's operators


def attention_summary(rows: pd.DataFrame, size: Size) -> pd.DataFrame:
    """One row per attention pass and implementation (SDPA's backends, our fused kernels; rows that also cover
    operators outside the attention subgraph apart, named `impl + op ...`): variants, best µs and its TFLOP/s (the
    products' 4·B·H·L²·P flop forward, 10·B·H·L²·P backward, whatever else the row covers)."""
    ok = rows[(rows.status == "ok") & (rows.dtype == size.dtype) & rows.op.isin(list(ATTENTION_PASSES))]
    beyond = ok.covers.str.split().map(lambda covers: "".join(f" + {op}" for op in covers if op not in SUBGRAPH))
    ok = ok.assign(impl=ok.impl + beyond)
    summary = ok.groupby(["op", "impl"], sort=False).median_us.agg(variants="size", best_us="min").reset_index()
    pass_, flop = zip(*(ATTENTION_PASSES[op] for op in summary.op))
    summary.insert(0, "pass", pass_)
    summary["TFLOP/s"] = [f * size.B * size.H * size.L ** 2 * size.P / us / 1e6 for f, us in zip(flop, summary.best_us)]
    return summary.drop(columns="op").sort_values(["pass", "best_us"], ascending=[False, True], ignore_index=True)
