#!/usr/bin/env python3
"""Time configurations of one size against each other on this GPU, in one run, in turn (GPU): one layer's training
step captured whole in a CUDA graph, and a stack of layers' step as a user calls it (an `EncoderStack`, as `inject`
builds). Each round times every configuration once per measure, so that clock and thermal drift falls on all of
them alike; the table gives the median over rounds and each configuration's ratio to the first one. It answers
whether profiling this GPU pays, e.g. the H100's shipped configuration against one optimized from an H200 profile:

    python scripts/compare_configurations.py --size bert-large-b8-l512 layouts/h100-bert-large-b8-l512-nondet.pickle \\
        layouts/h200-bert-large-b8-l512-nondet.pickle --layers 24 --rounds 5 --json OUT.json

Every configuration must be of --size's dimensions; all run the same weights and inputs (dropout 0.1).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from substation.benchmark import (SUBSTATION_STACK, build_stack, capture, make_inputs, reference_state_dict,
                                  substation_encoder, train_step)
from substation.errors import SubstationError
from substation.sizes import TORCH_DTYPES, Size, get_size
from substation.timing import ClockLog, time_steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compare_configurations.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("configurations", nargs="+", type=Path, help="layouts pickles or JSON twins; the first is "
                        "the one the others' ratios are against")
    parser.add_argument("--size", required=True, help="a size preset, or B=..,L=..,H=..,P=..,U=..")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--layers", type=int, default=24, help="layers in the stack (0: time one layer only)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each timing every configuration once")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each timing")
    parser.add_argument("--mask", action="store_true", help="pass a padding mask (every other sequence pads its "
                        "last eighth)")
    parser.add_argument("--json", type=Path, help="also write the rows as a JSON list")
    return parser


def steps(configuration: Path, args: argparse.Namespace, size: Size, state: dict[str, torch.Tensor], x: torch.Tensor,
          mask: torch.Tensor | None, dy: torch.Tensor) -> tuple[dict[str, Callable[[], object]], list[torch.nn.Module]]:
    """(measure -> a callable running one training step of it with this configuration, the modules they run: a
    graph reads its layer's weights by address, so the caller keeps the layer alive while it replays)."""
    dtype = TORCH_DTYPES[size.dtype]
    layer = substation_encoder(str(configuration), size, dtype, state, cuda_graphs=False)
    graph, _ = capture(train_step(layer, x, mask, dy))
    found, modules = {"layer, graphed": graph.replay}, [layer]
    if args.layers:
        stack = build_stack(SUBSTATION_STACK, args.layers, size, dtype, state, str(configuration))
        found[f"{args.layers} layers, as called"] = train_step(stack, x, mask, dy)
        modules.append(stack)
    return found, modules


def summarize(size: str, medians: dict[tuple[str, Path], list[float]], clocks: dict[tuple[str, Path], list[float]],
              configurations: list[Path]) -> list[dict[str, object]]:
    """One row per (measure, configuration), measures in their order and configurations in the command's: the median
    over rounds of the rounds' medians (ms), and its ratio to the first configuration's for the same measure."""
    rows = []
    for measure in dict.fromkeys(measure for measure, _ in medians):
        first = statistics.median(medians[(measure, configurations[0])])
        for path in configurations:
            times = medians[(measure, path)]
            rows.append(dict(size=size, measure=measure, configuration=str(path), median_ms=statistics.median(times),
                             rounds_ms=times, ratio=statistics.median(times) / first,
                             sm_mhz=statistics.median(clocks[(measure, path)]) if clocks.get((measure, path)) else None))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(set(args.configurations)) < len(args.configurations):
        print("compare_configurations.py: name each configuration once", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("compare_configurations.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        size = get_size(args.size, args.dtype)
        state = reference_state_dict(size)
        x, mask, dy = make_inputs(size, TORCH_DTYPES[size.dtype], masked=args.mask)
        built = {path: steps(path, args, size, state, x, mask, dy) for path in args.configurations}
    except SubstationError as error:
        print(f"compare_configurations.py: {error}", file=sys.stderr)
        return 2
    medians: dict[tuple[str, Path], list[float]] = {}
    clocks: dict[tuple[str, Path], list[float]] = {}
    for round_index in range(args.rounds):
        for path, (measures, _) in built.items():
            for measure, step in measures.items():
                with ClockLog(x.device.index or 0) as clock:
                    timing = time_steps(step, args.warmup, args.steps)
                medians.setdefault((measure, path), []).append(timing.median_us / 1e3)
                if clock.median_mhz is not None:
                    clocks.setdefault((measure, path), []).append(clock.median_mhz)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = summarize(args.size, medians, clocks, args.configurations)
    print(f"{args.size} {args.dtype} on {torch.cuda.get_device_name()}, training step, dropout 0.1, median over "
          f"{args.rounds} rounds of the median of {args.steps} steps (L2 flushed before each), in turn")
    width = max(len(row["configuration"]) for row in rows)
    for row in rows:
        mhz = "?" if row["sm_mhz"] is None else f"{row['sm_mhz']:.0f}"
        print(f"{row['measure']:20s} {row['configuration']:{width}s} {row['median_ms']:8.3f} ms  x{row['ratio']:.3f}  "
              f"rounds {' '.join(f'{t:.3f}' for t in row['rounds_ms'])}  SM {mhz} MHz")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
