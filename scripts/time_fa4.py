#!/usr/bin/env python3
"""flash-attn-4 (the CuTe DSL FlashAttention for Hopper and Blackwell) beside PyTorch's SDPA flash and cuDNN
backends and our fused attention, at both BERT-large sizes, float16, **dropout 0** (FA4 has no dropout), no padding
mask, every tensor [B, L, H, P]: each implementation's forward and backward checked against the float64 reference,
then timed as the profiler times its rows (`substation.timing.Timer`: L2 flushed, a spin kernel hiding the host's
cost, median of 25 after 5). Issue 18 item 7: whether FA4 is worth a place in the profile where attention dropout is
0. The libraries are called directly (autograd), and FA4 once more as the optimizer's candidate runs it
(`kernels/sdpa.py`, row "fa4 sdpa.py"). Needs `pip install flash-attn-4` (it brings quack-kernels and
nvidia-cutlass-dsl).

    python scripts/time_fa4.py > layouts/h100-fa4.txt
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from substation.kernels import sdpa
from substation.kernels.attention import checked_runner, make, make_backward
from substation.sizes import PRESETS
from substation.timing import Timer

SIZES = ("bert-large-b8-l512", "bert-large-b96-l128")
LAYOUTS = dict(Q="bjhp", K="bkhp", V="bkhp", M="bk", Z="bjhp")
GRADIENTS = dict(dZ="bjhp", dQ="bjhp", dK="bkhp", dV="bkhp")
# Our best profiled tiles at each size (layouts/profiles/h100, dropout 0.1).
OUR_FORWARD = {"bert-large-b8-l512": dict(block_m=128, block_n=64), "bert-large-b96-l128": dict(block_m=64, block_n=64)}
OUR_BACKWARD = dict(block_m=128, block_n=64, fuse_dq=1)
LIBRARY_LAYOUTS = ("bjhp", "bkhp", "bkhp", "bjhp")  # Q, K, V, dZ: [B, L, H, P], as the direct calls take them


def our_points(preset: str):
    size = PRESETS[preset]
    return (make(size, "float16", LAYOUTS, **OUR_FORWARD[preset]),
            make_backward(size, "float16", LAYOUTS | GRADIENTS, **OUR_BACKWARD))


def library_calls(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The forward of one library implementation on [B, L, H, P] leaves (returning [B, L, H, P])."""
    scale = 1 / math.sqrt(q.shape[-1])
    if name == "fa4":
        from flash_attn.cute import flash_attn_func

        def forward():
            out = flash_attn_func(q, k, v, softmax_scale=scale)
            return out[0] if isinstance(out, tuple) else out
        return forward
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def forward():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=scale).transpose(1, 2)
    return forward


def show(preset: str, name: str, fwd, bwd, error: tuple[float, float]) -> None:
    print(f"{preset}  {name:<11} forward {fwd.median_us:6.1f}  backward {bwd.median_us:6.1f}  "
          f"sum {fwd.median_us + bwd.median_us:6.1f}  err {error[0]:.1e}; {error[1]:.1e}", flush=True)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def main() -> None:
    timer = Timer()
    print(f"{torch.cuda.get_device_name(0)}, float16, dropout 0, no mask, [B, L, H, P]; median GPU time, µs "
          "(L2 flushed); err: max relative error vs float64 (forward; worst gradient)")
    for preset in SIZES:
        size = PRESETS[preset]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dz = (torch.randn(size.B, size.L, size.H, size.P, device="cuda", dtype=torch.float16,
                                   generator=gen) for _ in range(4))
        exact = [x.double().requires_grad_() for x in (q, k, v)]
        want = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in exact)).transpose(1, 2)
        want_grads = torch.autograd.grad(want, exact, dz.double())
        for name in ("fa4", "sdpa_flash", "sdpa_cudnn"):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            forward = library_calls(name, *leaves)
            out = forward()
            grads = torch.autograd.grad(out, leaves, dz, retain_graph=True)
            error = (relative(out, want), max(relative(g, w) for g, w in zip(grads, want_grads)))
            show(preset, name, timer(forward), timer(lambda: torch.autograd.grad(out, leaves, dz, retain_graph=True)),
                 error)
        # FA4 as the optimizer's candidate runs it (kernels/sdpa.py: our buffers, the deterministic backward).
        att = sdpa.SdpaAttention("fa4", size, *LIBRARY_LAYOUTS)
        fwd_err, bwd_err, fwd_run, bwd_run = sdpa.runners(att, sdpa.AttentionData.make(size, reference_dtype="float64"),
                                                          0.0)
        show(preset, "fa4 sdpa.py", timer(fwd_run), timer(bwd_run), (fwd_err, bwd_err))
        (fwd_run, fwd_err), (bwd_run, bwd_err) = (checked_runner(p, size, 0.0) for p in our_points(preset))
        show(preset, "ours", timer(fwd_run), timer(bwd_run), (fwd_err, bwd_err))


if __name__ == "__main__":
    main()
