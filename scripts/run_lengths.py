#!/usr/bin/env python3
"""Train a stack of encoder layers on batches of varying length, as a user's data loader pads each batch to its
longest sequence: every variant on the same batches, from the first step, so that what a new length costs (a plan
and CUDA-graph capture, a recompilation) counts.

    python scripts/run_lengths.py --layouts layouts/h100-bert-large-b8-l512.pickle --size bert-large-b8-l512 \\
        --lengths 64 512 --steps 60 --json layouts/h100-run_lengths.json

Each step draws L uniformly from `--lengths` (seeded) and each sequence of the batch a length up to L (one of them
L), masked beyond it. Variants: `substation` (an EncoderStack of Encoders with cuda_graphs=True, as `inject` makes
one: every new L is a new plan and capture, and only `max_shapes` of them are kept), `substation_padded` (the same
with `length_multiple=--multiple`: each batch padded to a multiple of it, a few shapes), `eager_sdpa` (PyTorch's
layer with SDPA) and `compile_default` (`torch.compile` of the stack: it recompiles for new shapes, then marks L
dynamic). Reported per variant: the whole run's time on the host's clock, the median step of its second half (CUDA
events), and the distinct lengths it ran. `--json OUT` writes the rows.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from substation.benchmark import SUBSTATION_STACK, build_stack, padded_batch_mask, reference_state_dict
from substation.lengths import padded_length
from substation.sizes import SIZE_SPEC_HELP, TORCH_DTYPES, Size, get_size, size_name

log = logging.getLogger("run_lengths")
VARIANTS = ("substation", "substation_padded", "eager_sdpa", "compile_default")
DTYPES = ("float16", "bfloat16", "float64")  # float64: the CPU


def batches(size: Size, lengths: tuple[int, int], steps: int, dtype: torch.dtype, device: str, seed: int
            ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, mask, dY) of every step, the mask of a batch padded to its longest sequence (`padded_batch_mask`)."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(steps):
        mask = padded_batch_mask(generator, size.B, *lengths).to(dtype)
        x = torch.randn(*mask.shape, size.I, generator=generator).to(dtype)
        dy = torch.randn(*mask.shape, size.I, generator=generator).to(dtype)
        made.append((x.to(device), mask.to(device), dy.to(device)))
    return made


def build(variant: str, args: argparse.Namespace, size: Size, dtype: torch.dtype, state_dict) -> torch.nn.Module:
    if variant.startswith("substation"):
        multiple = args.multiple if variant == "substation_padded" else None
        return build_stack(SUBSTATION_STACK, args.layers, size, dtype, state_dict, args.layouts, args.device,
                           length_multiple=multiple)
    return build_stack(variant, args.layers, size, dtype, state_dict, args.layouts, args.device)


def train(stack: torch.nn.Module, steps: Sequence, device: str) -> tuple[float, list[float]]:
    """(the whole run's seconds on the host's clock, each step's ms: CUDA events on a GPU, else the host's)."""
    params = [p for p in stack.parameters() if p.requires_grad]
    gpu = device.startswith("cuda")
    times, events = [], []
    start = time.perf_counter()
    for x, mask, dy in steps:
        for p in params:
            p.grad = None
        begin = time.perf_counter()
        if gpu:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        stack(x, mask).backward(dy)
        if gpu:
            events[-1][1].record()
        else:
            times.append((time.perf_counter() - begin) * 1e3)
    if gpu:
        torch.cuda.synchronize()
        times = [first.elapsed_time(last) for first, last in events]
    return time.perf_counter() - start, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", help="the configuration the Substation variants run (default: PyTorch's layouts)")
    parser.add_argument("--size", required=True, help=f"H, P, U and the batch B: {SIZE_SPEC_HELP}")
    parser.add_argument("--lengths", type=int, nargs=2, metavar=("MIN", "MAX"), default=(64, 512))
    parser.add_argument("--multiple", type=int, default=64, help="substation_padded's length_multiple")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--dtype", choices=DTYPES, default="float16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    low, high = args.lengths
    if not 1 <= low <= high or args.steps < 2 or args.layers < 1 or args.multiple < 1:
        parser.error("need 1 <= MIN <= MAX, --steps >= 2, --layers >= 1 and --multiple >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU (give --device cpu --dtype float64 for a smoke run)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    size, dtype = get_size(args.size), TORCH_DTYPES[args.dtype]
    state_dict = reference_state_dict(size)
    steps = batches(size, (low, high), args.steps, dtype, args.device, args.seed)
    rows = []
    for variant in args.variants:
        log.info("%s: %d layers, %d steps", variant, args.layers, args.steps)
        stack = build(variant, args, size, dtype, state_dict)
        total_s, times = train(stack, steps, args.device)
        multiple = args.multiple if variant == "substation_padded" else 1
        shapes = sorted({padded_length(x.shape[1], multiple) for x, _, _ in steps})
        rows.append({"size": size_name(size), "variant": variant, "layers": args.layers, "steps": args.steps,
                     "lengths": [low, high], "total_s": total_s, "first_ms": times[0], "shapes": len(shapes),
                     "median_ms": statistics.median(times[len(times) // 2:])})
        log.info("%s: %.2f s in all, %.2f ms median step", variant, total_s, rows[-1]["median_ms"])
        if args.json:  # after each variant: a run cut short keeps the variants it finished
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        del stack
        gc.collect()  # an Encoder and its CUDA graphs reference each other: free the graphs' memory now
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{size_name(size)} {args.dtype}, {args.layers} layers, {args.steps} training steps of L in [{low}, {high}] "
          f"on {where}")
    print(f"{'variant':>18} {'total s':>8} {'median ms (2nd half)':>21} {'first ms':>9} {'shapes':>7}")
    for row in rows:
        print(f"{row['variant']:>18} {row['total_s']:8.2f} {row['median_ms']:21.2f} {row['first_ms']:9.1f} "
              f"{row['shapes']:7d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
