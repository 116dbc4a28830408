#!/usr/bin/env python3
"""Time a stack of encoder layers, as users train them, in one run (GPU): a training step (forward + backward)
of N layers of each variant, as called from Python, host cost included.

    python scripts/run_stack.py --layouts layouts/h100-bert-large-b8-l512.pickle --size bert-large-b8-l512 --layers 24

Variants: `substation` (Encoders with cuda_graphs=True, each replaying its own graphs), `substation_stack` (the same
as one EncoderStack, as `inject` makes one: a step of all layers from one pair of graphs; not yet run on a GPU,
2026-11-27), `substation_eager` (cuda_graphs=False), `substation_compile` (`torch.compile` of the stack of
Encoders: each layer one custom op of the graph), `eager_sdpa` (PyTorch's layer with SDPA) and `compile_default`
(`torch.compile` of that stack). Every layer of every variant holds the same weights. Prints one table; `--json
OUT` writes its rows.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
from pathlib import Path

import torch

from substation.benchmark import build_stack, make_inputs, reference_state_dict, train_step
from substation.sizes import get_size, size_name
from substation.timing import time_steps

log = logging.getLogger("run_stack")
VARIANTS = ("substation", "substation_stack", "substation_eager", "substation_compile", "eager_sdpa", "compile_default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", required=True, help="the configuration the Substation variants run")
    parser.add_argument("--size", required=True, help="a size preset, or B=..,L=..,H=..,P=..,U=..")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    size = get_size(args.size)
    name = size_name(size)
    dtype, state_dict = torch.float16, reference_state_dict(size)
    x, mask, dy = make_inputs(size, dtype)
    rows = []
    for variant in args.variants:
        log.info("%s: %d layers", variant, args.layers)
        stack = build_stack(variant, args.layers, size, dtype, state_dict, args.layouts)
        timing = time_steps(train_step(stack, x, mask, dy), args.warmup, args.steps, flush_l2=False)
        rows.append({"size": name, "variant": variant, "layers": args.layers, "step_ms": timing.median_us / 1e3,
                     "min_ms": timing.min_us / 1e3, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30})
        log.info("%s: %.3f ms per step", variant, rows[-1]["step_ms"])
        del stack
        gc.collect()  # an Encoder and its CUDA graphs reference each other: free the graphs' memory now
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fastest = min(row["step_ms"] for row in rows if row["variant"].startswith("substation"))
    print(f"{name} float16, {args.layers} layers, training step as called (median of {args.steps}) on "
          f"{torch.cuda.get_device_name()}")
    print(f"{'variant':>20} {'step ms':>9} {'min ms':>8} {'ms/layer':>9} {'peak GB':>8} {'vs best substation':>18}")
    for row in rows:
        print(f"{row['variant']:>20} {row['step_ms']:9.2f} {row['min_ms']:8.2f} {row['step_ms'] / args.layers:9.3f} "
              f"{row['peak_mem_gb']:8.1f} {row['step_ms'] / fastest:17.2f}×")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
