#!/usr/bin/env python3
"""Where the time of a graphed training step goes between its kernels (GPU): the whole step of one layer captured
in one CUDA graph (as `run_encoder.py` graphs it), replayed `--runs` times back to back (median and min, CUDA events,
no L2 flush between replays; the median SM clock beside them, `substation.timing.ClockLog`), then once under
torch.profiler's CUDA activity: every kernel, memset and copy of that replay with its start, its duration and the
gap before it, and the sums (the span, the memsets, the time in kernels and copies).

    python scripts/graph_timeline.py [--size bert-large-b8-l512] [--layouts layouts/h100-bert-large-b8-l512.pickle]
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from substation.benchmark import SUBSTATION_EAGER, build_variant, capture, make_inputs, reference_state_dict, train_step
from substation.sizes import get_size
from substation.timing import ClockLog, time_steps


def timeline(replay) -> list[tuple[str, float, float]]:
    """(name, start µs from the first, duration µs) of the GPU activities of one replay, in order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    found = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                   key=lambda e: e.time_range.start)
    first = found[0].time_range.start
    return [(e.name, e.time_range.start - first, e.time_range.end - e.time_range.start) for e in found]


def timeline_table(rows: list[tuple[str, float, float]]) -> list[str]:
    """The printed lines of a timeline: each activity with its start, the gap since every activity before it ended
    (negative where it overlaps one, as a dependent launch does) and its duration; then the sums."""
    lines = [f"{'start µs':>9} {'gap µs':>7} {'µs':>7}  activity"]
    previous_end = 0.0
    for name, start, duration in rows:
        lines.append(f"{start:9.1f} {start - previous_end:7.2f} {duration:7.2f}  {name[:90]}")
        previous_end = max(previous_end, start + duration)
    memsets = [duration for name, _, duration in rows if name.startswith("Memset")]
    busy = sum(duration for name, _, duration in rows if not name.startswith("Memset"))
    lines.append(f"span {previous_end:.1f} µs; {len(rows)} activities, {len(memsets)} memsets ({sum(memsets):.1f} µs); "
                 f"kernels and copies {busy:.1f} µs (overlapping ones count in full)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="bert-large-b8-l512")
    parser.add_argument("--layouts", default="layouts/h100-bert-large-b8-l512.pickle")
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_timeline.py: error: needs an NVIDIA GPU, and torch sees none", file=sys.stderr)
        return 2
    size = get_size(args.size)
    # The Encoder launching from Python, so that the whole step can be captured in one graph (its own graphs off).
    layer = build_variant(SUBSTATION_EAGER, size, torch.float16, reference_state_dict(size), args.layouts)
    x, mask, dy = make_inputs(size, torch.float16)
    graph, _ = capture(train_step(layer, x, mask, dy))
    with ClockLog(x.device.index or 0) as clocks:
        times = time_steps(graph.replay, runs=args.runs, flush_l2=False)
    clock = "" if clocks.median_mhz is None else f", SM clock {clocks.median_mhz:.0f} MHz"
    print(f"{args.size} ({args.layouts}) on {torch.cuda.get_device_name()}: graphed step median "
          f"{times.median_us:.1f} µs, min {times.min_us:.1f} ({args.runs} replays{clock})")
    print("\n".join(timeline_table(timeline(graph.replay))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
