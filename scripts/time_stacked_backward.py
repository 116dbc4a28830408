#!/usr/bin/env python3
"""Per-kernel GPU times of our fused attention backward writing dQ, dK, dV apart and writing them stacked into one
dQKV with its bias gradient dbqkv (`kernels/attention.py`, the stacked row), at both BERT-large sizes, float16,
dropout 0.1: what summing dbqkv inside the backward costs each kernel, and the `_dbsum` launch (none where `_dqsum`
runs: its last blocks sum dbqkv). Each point runs on
random inputs through the profiler's checked runner (its error against the float64 reference printed), 20 warm-up
calls, then 50 calls under torch.profiler; the median device time of each kernel is printed.

    python scripts/time_stacked_backward.py > layouts/h100-stacked-backward.txt
"""
from __future__ import annotations

import collections

import torch
from torch.profiler import ProfilerActivity, profile

from substation.kernels.attention import checked_runner, make_backward
from substation.sizes import PRESETS

INPUTS = dict(Q="bhjp", K="bhkp", V="bhkp", M="bk", Z="bhjp", dZ="bhjp")
OUTPUTS = {  # apart; stacked in the graph's dQKV layout (the qkv_proj GEMMs'); stacked per (b, h, t) contiguously
    "apart": dict(dQ="bhjp", dK="bhkp", dV="bhkp"),
    "stacked": dict(dQKV="bjthp", dbqkv="thp"),
    "stacked-bhtjp": dict(dQKV="bhtjp", dbqkv="thp"),
}
KNOBS = (dict(block_m=128, block_n=64, fuse_dq=1), dict(block_m=128, block_n=64, fuse_dq=0))


def kernel_medians(run, calls: int = 50) -> dict[str, float]:
    """The median device time (µs) of each kernel `run` launches, by its name's last part (`_dkdv` -> dkdv)."""
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            times[event.name.split("_")[-1]].append(event.device_time)
    return {name: round(sorted(t)[len(t) // 2], 1) for name, t in times.items()}


def main() -> None:
    print(f"{torch.cuda.get_device_name(0)}, float16, dropout 0.1; median device time per kernel, us")
    for preset in ("bert-large-b96-l128", "bert-large-b8-l512"):
        size = PRESETS[preset]
        for knobs in KNOBS:
            for kind, outputs in OUTPUTS.items():
                run, error = checked_runner(make_backward(size, "float16", INPUTS | outputs, **knobs), size, 0.1)
                print(preset, knobs, kind, f"err={error:.1e}", kernel_medians(run), flush=True)


if __name__ == "__main__":
    main()
