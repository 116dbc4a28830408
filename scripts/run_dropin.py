#!/usr/bin/env python3
"""What the drop-in costs on one GPU, in one run: a training step (forward and backward) of a stack of Encoders
- in float16, and with float32 parameters under torch.autocast (float16): the weight cast and the gradients'
  cast back included, since an optimizer changes the weights every step;
- at a shape each shipped configuration was not tuned for, beside the configuration tuned for that shape.
The stack is an EncoderStack: graphed, each step of all its layers replays from one pair of CUDA graphs.

    python scripts/run_dropin.py --layers 4 --json layouts/h100-run_dropin.json

Each row: configuration, shape (B, L), precision, graphed, step_ms (median of CUDA-event times after warm-up),
min_ms. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from substation import Encoder, EncoderStack
from substation.timing import time_steps

LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"
CONFIGS = {"b8-l512": (8, 512), "b96-l128": (96, 128)}  # the shipped configurations and their tuned shapes


def stack(config: str, layers: int, dtype: torch.dtype, cuda_graphs: bool) -> EncoderStack:
    """`layers` Encoders of a shipped configuration as one EncoderStack (graphed: one pair of graphs per step)."""
    path = LAYOUTS / f"h100-bert-large-{config}.pickle"
    return EncoderStack(Encoder.from_layouts(path, dtype=dtype, cuda_graphs=cuda_graphs) for _ in range(layers)).cuda()


def training_step(model: EncoderStack, x: torch.Tensor, amp: bool):
    """Forward and backward of the stack, the parameters marked changed first (as an optimizer's update marks
    them, without its work, which is the user's optimizer's and not the layer's): under autocast every step
    casts the weights again."""
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
            torch.autograd.graph.increment_version(p)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            y = model(x)
        y.backward(torch.ones_like(y))
    return step


def measure(config: str, shape: tuple[int, int], precision: str, graphed: bool, layers: int, steps: int) -> dict:
    amp = precision == "amp_fp16"
    model = stack(config, layers, torch.float32 if amp else torch.float16, graphed)
    x = torch.randn(*shape, model.layers[0].size.I, device="cuda", dtype=torch.float32 if amp else torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "tuned for another shape": that is what is measured here
        timing = time_steps(training_step(model, x, amp), warmup=10, runs=steps, flush_l2=False)
    del model
    torch.cuda.empty_cache()
    return dict(config=config, B=shape[0], L=shape[1], precision=precision, graphed=graphed, layers=layers,
                step_ms=timing.median_us / 1e3, min_ms=timing.min_us / 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="Encoders in the stack")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row")
    parser.add_argument("--json", metavar="OUT", help="also write the rows as a JSON list")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.steps < 1:
        parser.error("--layers and --steps must be >= 1")
    if not torch.cuda.is_available():
        print("run_dropin.py: needs a CUDA GPU, and torch sees none", file=sys.stderr)
        return 2
    rows = []
    for config, shape in CONFIGS.items():
        for precision in ("fp16", "amp_fp16"):
            for graphed in (False, True):
                rows.append(measure(config, shape, precision, graphed, args.layers, args.steps))
        for other, other_shape in CONFIGS.items():  # every configuration at the other's tuned shape
            if other != config:
                rows.append(measure(config, other_shape, "fp16", True, args.layers, args.steps))
    fp16 = {(r["config"], r["B"], r["L"], r["graphed"]): r["step_ms"] for r in rows if r["precision"] == "fp16"}
    print(f"{'config':>9} {'B':>3} {'L':>4} {'precision':>9} {'graphed':>7} {'step ms':>8} {'min ms':>8} {'/ fp16':>7}")
    for r in rows:
        ratio = r["step_ms"] / fp16[r["config"], r["B"], r["L"], r["graphed"]]
        print(f"{r['config']:>9} {r['B']:>3} {r['L']:>4} {r['precision']:>9} {str(r['graphed']):>7} "
              f"{r['step_ms']:8.3f} {r['min_ms']:8.3f} {ratio:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
