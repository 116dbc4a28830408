#!/usr/bin/env python3
"""Time Substation's Encoder against PyTorch on one GPU, in one run: a training step (forward + backward) and
the forward alone, ungraphed and graphed, of every variant (`substation.benchmark`).

    python scripts/run_encoder.py --layouts layouts/h100-bert-large-b8-l512.pickle --size bert-large-b8-l512
    python scripts/run_encoder.py --size B=2,L=128,H=16,P=64,U=4096 --variants eager_sdpa hf_bertlayer --steps 50

Progress goes to stderr; the table to stdout; `--json OUT` writes one object per row with the keys
size, variant, graphed, fwdbwd_ms, fwd_ms, min_ms, tflops. Bad arguments or no GPU: one line, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from substation.benchmark import (ALL_VARIANTS, SUBSTATION, SUBSTATION_VARIANTS, Result, benchmark, breakdown_table,
                                  format_table, plot_results, results_table)
from substation.errors import SubstationError
from substation.sizes import get_size, size_name

log = logging.getLogger("run_encoder")
DTYPES = ("float16", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run_encoder.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", metavar="FILE", help="a layout configuration (pickle or JSON twin) for the "
                        "substation variants (substation: cuda_graphs=True; substation_eager: cuda_graphs=False)")
    parser.add_argument("--size", required=True, help="a size preset, or B=..,L=..,H=..,P=..,U=..")
    parser.add_argument("--dtype", default="float16", choices=DTYPES)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per measurement (median and min)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before timing")
    parser.add_argument("--variants", nargs="+", choices=ALL_VARIANTS, default=list(ALL_VARIANTS),
                        help="what to time (default: all)")
    parser.add_argument("--mask", action="store_true", help="pass a padding mask (every other sequence pads its "
                        "last eighth); default: attention_mask=None")
    parser.add_argument("--no-graph", action="store_true", help="time ungraphed only")
    parser.add_argument("--no-flush-l2", action="store_true", help="keep the L2 cache warm between steps")
    parser.add_argument("--device-time", action="store_true", help="time the GPU's work alone (substation.timing."
                        "Timer: a spin kernel hides the host's cost) instead of steps as a user calls them")
    parser.add_argument("--json", metavar="OUT", help="also write the rows as a JSON list")
    parser.add_argument("--plot", metavar="PNG", help="also draw the step times as bars, as called and graphed")
    parser.add_argument("--breakdown", action="store_true", help="also time each operator of Substation's plan "
                        "(substation.runtime.breakdown) against the optimizer's prediction")
    parser.add_argument("--breakdown-json", metavar="OUT", help="with --breakdown: also write its rows (and the "
                        "totals) as a JSON list")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Argument errors end in parser.error (one line, exit code 2); returns (size name, Size)."""
    try:
        size = get_size(args.size)
    except SubstationError as error:
        parser.error(f"--size: {error}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    if set(SUBSTATION_VARIANTS) & set(args.variants) or args.breakdown:
        if args.layouts is None:
            parser.error(f"--layouts FILE is needed for the {' and '.join(SUBSTATION_VARIANTS)} variants and "
                         "--breakdown (or leave them out of --variants)")
        if not Path(args.layouts).is_file():
            parser.error(f"--layouts {args.layouts}: no such file")
    if args.breakdown and SUBSTATION not in args.variants:
        parser.error("--breakdown needs the substation variant in --variants")
    if args.breakdown_json and not args.breakdown:
        parser.error("--breakdown-json needs --breakdown")
    return size_name(size), size


def print_breakdown(encoder, x, mask, runs: int, json_path: str | None = None) -> None:
    try:
        from substation.runtime import breakdown

        rows = breakdown(encoder, x, runs=runs, attention_mask=mask)
    except Exception as error:  # a breakdown failure must not end the benchmark
        log.warning("breakdown failed: %s: %s", type(error).__name__, error)
        return
    table = breakdown_table(rows)
    print("per-operator breakdown of Substation's step (us; ratio = measured / predicted):")
    print(format_table(table, digits=1))
    print()
    if json_path:
        table.to_json(json_path, orient="records", indent=1)  # NaN (no prediction) becomes null
        log.info("wrote %s", json_path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    name, size = check_args(parser, args)
    import torch

    if not torch.cuda.is_available():
        print("run_encoder.py: error: needs an NVIDIA GPU, and torch sees none", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    dtype = getattr(torch, args.dtype)
    log.info("%s, %s, %s, torch %s: %d warm-up + %d timed steps per measurement", torch.cuda.get_device_name(),
             name, args.dtype, torch.__version__, args.warmup, args.steps)
    on_encoder = ((lambda enc, x, mask: print_breakdown(enc, x, mask, args.steps, args.breakdown_json))
                  if args.breakdown else None)
    results: list[Result] = benchmark(name, size, dtype, args.variants, args.layouts, args.warmup, args.steps,
                                      masked=args.mask, flush_l2=not args.no_flush_l2,
                                      modes=(False,) if args.no_graph else (False, True), on_encoder=on_encoder,
                                      device_time=args.device_time)
    how = "GPU time alone (host cost hidden)" if args.device_time else "as called, host cost included"
    print(f"{name} {args.dtype} on {torch.cuda.get_device_name()} (torch {torch.__version__}), training step "
          f"(dropout 0.1), median of {args.steps} steps, {how}; TFLOP/s counts the contractions' flop")
    print(format_table(results_table(results)))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_json() for r in results], indent=1) + "\n", encoding="utf-8")
        log.info("wrote %s", args.json)
    if args.plot:
        plot_results([r.as_json() for r in results], args.plot)
        log.info("wrote %s", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
