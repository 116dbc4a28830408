#!/usr/bin/env python3
"""Per-kernel GPU times of our fused attention backward writing dQ, dK, dV apart and writing them stacked into one
dQKV with its bias gradient dbqkv (`kernels/attention.py`, the stacked row), at both BERT-large sizes, float16,
dropout 0.1: what summing dbqkv inside the backward costs each kernel, and the `_dbsum` launch (none where `_dqsum`
runs: its last blocks sum dbqkv). Each point runs on
random inputs through the profiler's checked runner (its error against the float64 reference printed), 20 warm-up
calls, then 50 calls under torch.profiler; the median device time of each kernel is printed. `--config` times the
points of our attention that configurations run instead (forward and backward, each at its configuration's size):
where a pass's time goes among its kernels (`_d`, `_dkdv`, `_dqsum`, ...), and A/B runs of template changes;
with `--backward` (`--forward`), each configuration's backward (forward) once per set of knobs given, in the
configuration's layouts.

    python scripts/time_stacked_backward.py > layouts/h100-stacked-backward.txt
    python scripts/time_stacked_backward.py --config layouts/h100-bert-large-b8-l512.json [...]
    python scripts/time_stacked_backward.py --config layouts/h100-bert-large-b8-l512.json --backward fuse_dq=1 fuse_dq=4
    python scripts/time_stacked_backward.py --config layouts/h100-bert-large-b8-l512.json --forward wgmma=1 wgmma=2
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from substation.kernels.attention import AttentionBackwardParams, checked_runner, configured_points, make_backward
from substation.sizes import PRESETS, Size

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


def knob_sets(texts: list[str], flag: str = "--backward") -> list[dict[str, int]]:
    """`flag`'s sets of knobs: "fuse_dq=4,min_blocks=1" -> {"fuse_dq": 4, "min_blocks": 1}."""
    found = []
    for text in texts:
        try:
            found.append({name: int(value) for name, value in (part.split("=") for part in text.split(","))})
        except ValueError:
            raise SystemExit(f"{flag} {text!r}: expected NAME=INT[,NAME=INT...]") from None
    return found


def points(config: dict, backward: list[dict[str, int]], forward: list[dict[str, int]] = ()) -> list:
    """The configuration's attention points, its backward once per set of knobs in `backward` and its forward once
    per set in `forward` (each as configured where none is given), each checked."""
    found = []
    for params in configured_points(config):
        sets = backward if isinstance(params, AttentionBackwardParams) else forward
        found += [dataclasses.replace(params, **knobs) for knobs in sets] if sets else [params]
    for params in found:
        params.check()
    return found


def time_configured(paths: list[str], backward: list[dict[str, int]], forward: list[dict[str, int]]) -> None:
    """Each configuration's attention points (its dtype, dropout 0.1): their kernels' medians and their sum."""
    print(f"{torch.cuda.get_device_name(0)}, dropout 0.1; median device time per kernel, us")
    for path in paths:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
        for params in points(config, backward, forward):
            run, error = checked_runner(params, Size(**config["size"]), 0.1)
            medians = kernel_medians(run)
            print(path, params.op, params.options(), f"err={error:.1e}", medians,
                  f"sum={sum(medians.values()):.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", nargs="+", help="configurations (JSON twins) whose attention points to time")
    parser.add_argument("--backward", nargs="+", default=[], metavar="KNOBS",
                        help="with --config: time each backward once per set of knobs, e.g. fuse_dq=1 fuse_dq=4")
    parser.add_argument("--forward", nargs="+", default=[], metavar="KNOBS",
                        help="with --config: time each forward once per set of knobs, e.g. wgmma=1 wgmma=2")
    args = parser.parse_args()
    if args.config:
        time_configured(args.config, knob_sets(args.backward), knob_sets(args.forward, "--forward"))
        return
    print(f"{torch.cuda.get_device_name(0)}, float16, dropout 0.1; median device time per kernel, us")
    for preset in ("bert-large-b96-l128", "bert-large-b8-l512"):
        size = PRESETS[preset]
        for knobs in KNOBS:
            for kind, outputs in OUTPUTS.items():
                run, error = checked_runner(make_backward(size, "float16", INPUTS | outputs, **knobs), size, 0.1)
                print(preset, knobs, kind, f"err={error:.1e}", kernel_medians(run), flush=True)


if __name__ == "__main__":
    main()
