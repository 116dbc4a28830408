#!/usr/bin/env python3
"""What autocast's conversions cost per layer and step of a graphed Encoder (`substation/graphed.py`): the weight
cast of one layer's twelve float32 parameters into float16, by our kernel (`kernels/convert.py`) and by PyTorch's
`_foreach_copy_`, beside a float16 device copy of as many elements (the yardstick); and what the gradients' way
back cost before the graphed backward handed out its gradient buffers in place (`GradientBuffers`): `--layers`
layers' float16 gradients (one flat buffer) by `.to(float32)`, and the float16 copy a step without autocast made. CUDA events, L2 flushed, median of `--runs` after warm-up; rate = bytes read and
written / median. Needs a CUDA GPU.

    python scripts/time_convert.py --size bert-large-b8-l512 --output layouts/h100-convert.txt
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from substation import Encoder
from substation.kernels.convert import Converter
from substation.sizes import get_size
from substation.timing import Timer


def rate(nbytes: int, us: float) -> str:
    return f"{nbytes / us / 1e6:5.2f} TB/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="bert-large-b8-l512", help="a preset or B=..,L=..,H=..,P=..,U=..")
    parser.add_argument("--layers", type=int, default=4, help="layers whose gradients one graphed stack casts back")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--output", metavar="TXT", help="also write the table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("time_convert.py: needs a CUDA GPU, and torch sees none", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    params = [p.detach() for p in Encoder(get_size(args.size), dtype=torch.float32).to(device).parameters()]
    copies = [torch.empty_like(p, dtype=torch.float16) for p in params]
    numel = sum(p.numel() for p in params)
    grads = torch.randn(args.layers * numel, device=device, dtype=torch.float16)
    flat16 = torch.empty(numel, device=device, dtype=torch.float16)
    weight_cast = Converter([p.numel() for p in params], torch.float32, torch.float16, device)
    timer = Timer(warmup=10, runs=args.runs)
    rows = [  # (what, bytes moved, work)
        ("weight cast, kernel", 6 * numel, lambda: weight_cast(copies, params)),
        ("weight cast, _foreach_copy_", 6 * numel, lambda: torch._foreach_copy_(copies, params)),
        ("weight cast yardstick: fp16 copy", 4 * numel, lambda: flat16.copy_(grads[:numel])),
        (f"gradient cast x{args.layers}, .to()", 6 * grads.numel(), lambda: grads.to(torch.float32)),
        (f"gradients x{args.layers}, fp16 clone", 4 * grads.numel(), lambda: grads.clone()),
    ]
    lines = [f"# scripts/time_convert.py --size {args.size} --layers {args.layers} on {torch.cuda.get_device_name()} "
             f"(PyTorch {torch.__version__}): {numel / 1e6:.2f} M parameters per layer; L2 flushed, median of "
             f"{args.runs}"]
    for what, nbytes, work in rows:
        timing = timer(work)
        lines.append(f"{what:<36} {nbytes / 1e6:8.1f} MB {timing.median_us:8.1f} µs  {rate(nbytes, timing.median_us)}")
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
