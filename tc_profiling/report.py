"""The contraction profile at a glance: per operator, the best mapping against PyTorch on its default layouts."""
from __future__ import annotations

import pandas as pd

GEMM_IMPLS = ("cublas", "cublaslt")


def contraction_summary(rows: pd.DataFrame, dtype: str = "float16") -> pd.DataFrame:
    """One row per contraction: torch µs (canonical layouts), best and worst mapping µs, their ratios."""
    ok = rows[(rows.status == "ok") & (rows.dtype == dtype)]
    gemms = ok[ok.impl.isin(GEMM_IMPLS)]
    # Per layout assignment, its best implementation: the spread is across layouts, not algorithms.
    per_layout = gemms.groupby(["op", "layouts"], sort=False).median_us.min().reset_index()
    best = per_layout.loc[per_layout.groupby("op", sort=False).median_us.idxmin()].set_index("op")
    worst = per_layout.groupby("op", sort=False).median_us.max()
    baseline = ok[ok.impl == "torch"].set_index("op").median_us
    summary = pd.DataFrame({
        "pass": ok.drop_duplicates("op").set_index("op")["pass"],
        "layouts": per_layout.groupby("op", sort=False).size(),
        "torch_us": baseline,
        "best_us": best.median_us,
        "worst_us": worst,
        "best_layouts": best.layouts,
    })
    summary["torch/best"] = summary.torch_us / summary.best_us
    summary["worst/best"] = summary.worst_us / summary.best_us
    return summary.reset_index().rename(columns={"index": "op"})
