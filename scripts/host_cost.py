"""What enqueueing one step of a plan costs the CPU, piece by piece (GPU): the library calls and launches a bound
step makes, and the PyTorch calls around them. Each piece is called many times in a row with nothing else in the
way; the GPU is kept busy first so that no piece waits for it. Prints one table (µs per call, median of rounds).

    python scripts/host_cost.py [--size bert-large-b8-l512] [--layouts layouts/h100-bert-large-b8-l512.pickle]
"""
from __future__ import annotations

import argparse

import torch

from substation import Encoder
from substation.sizes import get_size
from substation.timing import host_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="bert-large-b8-l512")
    parser.add_argument("--layouts", default="layouts/h100-bert-large-b8-l512.pickle")
    args = parser.parse_args()
    size = get_size(args.size)
    encoder = Encoder.from_layouts(args.layouts, dtype=torch.float16).cuda().train()
    x = torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16)
    plan, op_args, env, extents = encoder.prepared_step(x)
    ctx = plan.context(op_args, extents)
    rows = [("torch.empty(1 MiB)", host_us(lambda: torch.empty(1 << 19, dtype=torch.float16, device="cuda"))),
            ("torch.cuda.current_stream().cuda_stream", host_us(lambda: torch.cuda.current_stream().cuda_stream))]
    for step in plan.steps:
        outputs = step(env, ctx)
        env.update(outputs)
        rows.append((f"{step.name} ({step.choice.impl})", host_us(lambda step=step: step(env, ctx), calls=50)))
    y = torch.randn_like(x)

    def eager_step() -> None:
        x.requires_grad_(True)
        encoder(x).backward(y)

    encoder.cuda_graphs = False
    rows.append(("whole step as called, cuda_graphs=False", host_us(eager_step, calls=5, rounds=5, spin_s=0.05)))
    width = max(len(name) for name, _ in rows)
    print(f"{'piece':<{width}}  host µs per call")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.1f}")


if __name__ == "__main__":
    main()
