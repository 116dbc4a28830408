#!/usr/bin/env python3
"""Times the fused attention forward kernel (`kernels/attention.py`, every variant) against PyTorch's SDPA flash and
cuDNN backends on this GPU, at both BERT-large sizes, in the Q, K, V, Z layouts the shipped configurations give
SDPA (`jbhp`/`kbhp` at B8/L512, `bjhp`/`bkhp` at B96/L128), dropout 0.1 and 0. Each of our variants is first
checked against the float32 reference (with Substation's dropout mask; the padding mask all ones, read by our
kernel, none given to SDPA), then timed (`substation.timing.Timer`: L2 flushed, median of the runs); TFLOP/s count
the two products' 4·B·H·L²·P flops.

    python scripts/time_attention.py [--dtype float16] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from substation.accuracy import relative_error
from substation.device import DeviceSpec
from substation.kernels.attention import reference, tensor_dims, variants
from substation.reference import OpArgs
from substation.sizes import TORCH_DTYPES, Size, get_size
from substation.timing import Timer

LAYOUTS = {  # what the shipped configurations give SDPA
    "bert-large-b8-l512": {"Q": "jbhp", "K": "kbhp", "V": "kbhp", "M": "bk", "Z": "jbhp"},
    "bert-large-b96-l128": {"Q": "bjhp", "K": "bkhp", "V": "bkhp", "M": "bk", "Z": "bjhp"},
}
SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
DROPOUTS = (0.1, 0.0)


@dataclass(frozen=True)
class Measured:
    size: str
    dropout: float
    impl: str  # our kernel's label, or sdpa_<backend>
    median_us: float
    min_us: float
    tflops: float
    error: float | None  # ours: relative error vs the float32 reference


def stored(x: torch.Tensor, dims: str, layout: str) -> torch.Tensor:
    return x.permute([dims.index(d) for d in layout]).contiguous()


def as_bhlp(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The [B, H, L, P] view of a tensor stored in `layout` (j or k as its L)."""
    return t.permute([layout.index(d) for d in ("b", "h", "j" if "j" in layout else "k", "p")])


def measure(preset: str, dtype: str, timer: Timer) -> list[Measured]:
    size: Size = get_size(preset)
    layouts, torch_dtype = LAYOUTS[preset], TORCH_DTYPES[dtype]
    flop = 4 * size.B * size.H * size.L ** 2 * size.P
    points = variants(size, dtype, layouts, DeviceSpec.of(0))
    with ThreadPoolExecutor(8) as pool:  # nvcc runs in subprocesses: compile every variant at once
        cubins = list(pool.map(lambda params: params.compile(DeviceSpec.of(0)), points))
    logical = {n: torch.randn(size.B, size.H, size.L, size.P, device="cuda").to(torch_dtype) for n in "QKV"}
    M = torch.ones(size.B, size.L, device="cuda", dtype=torch_dtype)
    tensors = {n: stored(logical[n], tensor_dims(n), layouts[n]) for n in "QKV"} | {"M": M}
    tensors["Z"] = torch.empty(points[0].tensor_shape(layouts["Z"]), device="cuda", dtype=torch_dtype)
    tensors["LSE"] = torch.empty(size.B, size.H, size.L, device="cuda")
    found = []
    for p in DROPOUTS:
        args = OpArgs(scale=1 / math.sqrt(size.P), attention_dropout=p, seed=1234, offset=1).with_device_rng("cuda")
        Z_ref, _ = reference(args, *(logical[n].float() for n in "QKV"), M.float())
        for params, cubin in zip(points, cubins):
            params.launch(cubin, tensors, args)
            error = relative_error(as_bhlp(tensors["Z"], layouts["Z"]).permute(0, 2, 1, 3), Z_ref)  # bjhp
            bound = params.bind(cubin, 0)
            pointers = [tensors[name].data_ptr() for name in bound.names]
            stream = torch.cuda.current_stream().cuda_stream
            t = timer(lambda: bound(pointers, args, stream))
            found.append(Measured(preset, p, params.label, t.median_us, t.min_us, flop / t.median_us / 1e6, error))
        q, k, v = (as_bhlp(tensors[n], layouts[n]) for n in "QKV")
        for impl, backend in SDPA.items():
            def work() -> torch.Tensor:
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
            t = timer(work)
            found.append(Measured(preset, p, impl, t.median_us, t.min_us, flop / t.median_us / 1e6, None))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--sizes", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    options = parser.parse_args()
    timer = Timer(warmup=5, runs=options.runs)
    rows = [row for preset in options.sizes for row in measure(preset, options.dtype, timer)]
    print(f"{'size':22} {'p':>4} {'median µs':>10} {'min µs':>8} {'TFLOP/s':>8} {'rel err':>8}  impl")
    for r in rows:
        error = "" if r.error is None else f"{r.error:.1e}"
        print(f"{r.size:22} {r.dropout:4.1f} {r.median_us:10.1f} {r.min_us:8.1f} {r.tflops:8.1f} {error:>8}  {r.impl}")
    if options.out:
        options.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
