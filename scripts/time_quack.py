#!/usr/bin/env python3
"""quack-kernels' GEMMs with an exact-GELU epilogue beside cuBLAS on the FFN's calls (GPU; issue 19's candidate
list): ffn_in + b1 + GELU_erf (`quack.gemm_interface.gemm_act`, writing the pre-activation and H1) and ffn_out's
data gradient times GELU'(F) (`gemm_dact`), each checked against float64 and timed as the profiler times a row
(`substation.timing.Timer`: L2 flushed, a spin kernel hiding the host, median), beside the plain product by
`torch.mm` (cuBLAS) and PyTorch's unfused pair in the same run.

    python scripts/time_quack.py [--sizes bert-large-b8-l512 bert-large-b96-l128] [--runs 50] [--tuned] [--output FILE]

quack (CuTe DSL; `pip install quack-kernels`, which brings nvidia-cutlass-dsl) compiles each kernel at its first
call, which takes seconds: the first call is not timed. Its GEMMs run with its heuristic tile choice
(`tuned=False`) unless `--tuned` asks for its autotuner, which compiles and times dozens of kernels per call (about a
minute per size on an H200).

quack fingerprints the globals its epilogue functions reach, except in code installed under a `site-packages` (or
`dist-packages`) folder; installed anywhere else (`pip install --target /tmp/x`), it reaches cutlass-dsl's module
state and refuses every call with a TypeError ("has no fail-closed semantic key").

Our CUTLASS GEMMs with the same epilogues are timed by `scripts/time_gemm_epilogue.py` and the profile; this script
places quack against the same cuBLAS yardstick.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F

from substation.sizes import get_size
from substation.timing import Timer

SIZES = ("bert-large-b8-l512", "bert-large-b96-l128")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of the float64 reference."""
    return float((got.double() - want).abs().max() / want.abs().max())


def gelu_grad(z: torch.Tensor) -> torch.Tensor:
    """GELU'(z) = Phi(z) + z phi(z), exactly (float64 in, float64 out)."""
    return 0.5 * (1 + torch.erf(z / 2 ** 0.5)) + z * torch.exp(-z * z / 2) / (2 * torch.pi) ** 0.5


def rows_for(size_name: str, timer: Timer, show, tuned: bool) -> None:
    from quack.gemm_interface import gemm_act, gemm_dact

    size = get_size(size_name)
    tokens, hidden, inner = size.B * size.L, size.I, size.U
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).half()

    x1, w1, b1 = randn(tokens, hidden), randn(inner, hidden, scale=hidden ** -0.5), randn(inner, scale=0.5)
    dg, w2 = randn(tokens, hidden), randn(hidden, inner, scale=inner ** -0.5)  # ffn_out's weight: (I, U), as HF's

    def forward():
        return gemm_act(x1, w1.t(), bias=b1, activation="gelu_erf", store_preact=True, tuned=tuned)

    pre, post = forward()
    z64 = x1.double() @ w1.double().t() + b1.double()
    show(f"{size_name:20s} ffn_in+bias_gelu   quack gemm_act: F err {relative_error(pre, z64):.1e}, "
         f"H1 err {relative_error(post, F.gelu(z64)):.1e}")

    def backward():
        return gemm_dact(dg, w2, pre, activation="gelu_erf", tuned=tuned)

    dx = backward()[0]
    show(f"{size_name:20s} ffn_out_dgrad+dgelu quack gemm_dact: dF err "
         f"{relative_error(dx, (dg.double() @ w2.double()) * gelu_grad(pre.double())):.1e}")

    timed = {
        "ffn_in+bias_gelu": (lambda: torch.mm(x1, w1.t()),
                             [("quack gemm_act (F, H1)", forward),
                              ("torch addmm + F.gelu (PyTorch's pair)", lambda: F.gelu(torch.addmm(b1, x1, w1.t())))]),
        "ffn_out_dgrad+dgelu": (lambda: torch.mm(dg, w2), [("quack gemm_dact (dF; no db1)", backward)]),
    }
    for op, (plain, candidates) in timed.items():
        plain_us = timer(plain).median_us
        show(f"{size_name:20s} {op:20s} {'torch.mm (cuBLAS), the product only':38s} {plain_us:8.1f} us")
        for name, work in candidates:
            us = timer(work).median_us
            show(f"{size_name:20s} {op:20s} {name:38s} {us:8.1f} us  {us / plain_us:.2f}x the plain product")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="time_quack.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--runs", type=int, default=50, help="timed runs per candidate (median)")
    parser.add_argument("--tuned", action="store_true", help="let quack autotune each call (minutes)")
    parser.add_argument("--output", type=Path, help="also write every printed line to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("time_quack.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    if importlib.util.find_spec("quack") is None:
        print("time_quack.py: quack-kernels is not installed: pip install quack-kernels", file=sys.stderr)
        return 2
    printed = []

    def show(line: str) -> None:
        print(line, flush=True)
        printed.append(line)
        if args.output:
            args.output.write_text("\n".join(printed) + "\n")

    tiles = "autotuned" if args.tuned else "heuristic"
    show(f"{torch.cuda.get_device_name()}, float16; quack-kernels {version('quack-kernels')}, nvidia-cutlass-dsl "
         f"{version('nvidia-cutlass-dsl')}, torch {torch.__version__}; {tiles} tiles; median of {args.runs} runs, "
         "L2 flushed; err: max |difference| / max |float64 reference|")
    timer = Timer(runs=args.runs)
    for size_name in args.sizes:
        rows_for(size_name, timer, show, args.tuned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
