#!/usr/bin/env python3
"""Times the fused attention forward and backward kernels (`kernels/attention.py`, every variant) against PyTorch's
SDPA flash and cuDNN backends (forward, and forward + backward) on this GPU, at both BERT-large sizes, in the Q, K,
V, Z layouts the shipped configurations give SDPA (`jbhp`/`kbhp` at B8/L512, `bjhp`/`bkhp` at B96/L128), dropout
0.1 and 0. Each of our variants is first checked against the float32 reference (with Substation's dropout mask; the
padding mask all ones, read by our kernel, none given to SDPA), then timed (`substation.timing.Timer`: L2 flushed,
median of the runs); TFLOP/s count the two products' 4·B·H·L²·P flops (the backward's five products: 10·B·H·L²·P,
though it computes seven). The backward's variants are checked the same way (dQ, dK, dV against autograd through
the float32 reference; the error printed is the largest of the three), then timed on our forward's Z and LSE.
Then our fastest forward and backward run again with a padding mask keeping 75 % of each sequence's keys (checked
against the reference with that mask; TFLOP/s still count the whole L²), with each kernel's waves (blocks per SM
from the driver's occupancy calculator). The closing summary adds our fastest forward and fastest backward, timed
apart with the L2 flushed before each (as the profiler times them), and sets our fastest pair timed as one region
beside SDPA's forward + backward, timed so too (the L2 flushed before the forward only); and the masked share.
On Hopper (P = 64) the variants include the levels of the knob `wgmma` (sm_90a) that the profiler times;
`--wgmma` adds the others, checked and timed beside them.

    python scripts/time_attention.py [--dtype float16] [--wgmma] [--out results.json] \
        [--table layouts/h100-attention.txt]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from substation.accuracy import relative_error
from substation.device import DeviceSpec
from substation.kernels.attention import (backward_variants, reference, reference_backward, tensor_dims,
                                         timed_wgmma_levels, variants)
from substation.kernels.base import feasible
from substation.layouts import stored
from substation.reference import OpArgs
from substation.sizes import TORCH_DTYPES, Size, get_size
from substation.timing import Timer

LAYOUTS = {  # what the shipped configurations give SDPA
    "bert-large-b8-l512": {"Q": "jbhp", "K": "kbhp", "V": "kbhp", "M": "bk", "Z": "jbhp"},
    "bert-large-b96-l128": {"Q": "bjhp", "K": "bkhp", "V": "bkhp", "M": "bk", "Z": "bjhp"},
}
GRADIENT_LAYOUTS = {"dZ": "Z", "dQ": "Q", "dK": "K", "dV": "V"}  # each gradient in its tensor's layout
SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
DROPOUTS = (0.1, 0.0)
MASK_KEEP = 0.75  # the padded batch the masked rows time: this share of each sequence's keys kept


@dataclass(frozen=True)
class Measured:
    size: str
    dropout: float
    impl: str  # our kernel's label, or sdpa_<backend>
    pass_: str  # forward, backward (ours), forward+backward (SDPA's)
    median_us: float
    min_us: float
    tflops: float
    error: float | None  # ours: relative error vs the float32 reference
    waves: str = ""  # the masked rows: each kernel's grid, resident blocks per SM and waves, unmasked and masked


def as_bhlp(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The [B, H, L, P] view of a tensor stored in `layout` (j or k as its L)."""
    return t.permute([layout.index(d) for d in ("b", "h", "j" if "j" in layout else "k", "p")])


def timed_launch(params, cubin, tensors: dict[str, torch.Tensor], args: OpArgs, timer: Timer):
    """Our kernel's bound launch on `tensors`, timed: (timing, the bound kernel, its tensors' addresses, stream)."""
    bound = params.bind(cubin, 0)
    pointers = [tensors[name].data_ptr() for name in bound.names]
    stream = torch.cuda.current_stream().cuda_stream
    return timer(lambda: bound(pointers, args, stream)), bound, pointers, stream


def with_wgmma(points: list, wgmma: bool) -> list:
    """`points`, and with `wgmma` their mma.sync points again at each level of the Hopper knob the profiler does
    not time (`timed_wgmma_levels`), where feasible on this GPU."""
    if not wgmma or not points:
        return points
    kind = type(points[0])
    untimed = [level for level in kind.wgmma_levels if level not in timed_wgmma_levels(kind)]
    again = (dataclasses.replace(params, wgmma=level) for level in untimed for params in points if not params.wgmma)
    return points + feasible(again, DeviceSpec.of(0))


def measure(preset: str, dtype: str, timer: Timer, wgmma: bool) -> list[Measured]:
    size: Size = get_size(preset)
    layouts, torch_dtype = LAYOUTS[preset], TORCH_DTYPES[dtype]
    flop = 4 * size.B * size.H * size.L ** 2 * size.P
    points = with_wgmma(variants(size, dtype, layouts, DeviceSpec.of(0)), wgmma)
    backward_points = with_wgmma(backward_variants(size, dtype, backward_layouts(preset), DeviceSpec.of(0)), wgmma)
    with ThreadPoolExecutor(8) as pool:  # nvcc runs in subprocesses: compile every variant at once
        cubins = list(pool.map(lambda params: params.compile(DeviceSpec.of(0)), points + backward_points))
    cubins, backward_cubins = cubins[:len(points)], cubins[len(points):]
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
            t = timed_launch(params, cubin, tensors, args, timer)[0]
            found.append(Measured(preset, p, params.label, "forward", t.median_us, t.min_us, flop / t.median_us / 1e6,
                                  error))
        q, k, v = (as_bhlp(tensors[n], layouts[n]) for n in "QKV")
        for impl, backend in SDPA.items():
            def work() -> torch.Tensor:
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
            t = timer(work)
            found.append(Measured(preset, p, impl, "forward", t.median_us, t.min_us, flop / t.median_us / 1e6, None))
        backward, backward_tensors = measure_backward(preset, p, args, logical, tensors, timer, backward_points,
                                                      backward_cubins)
        built = {params.label: (params, cubin) for params, cubin in zip(points + backward_points,
                                                                        cubins + backward_cubins)}
        found += backward + [measure_together(preset, args, backward_tensors, found + backward, timer, built)]
        found += measure_masked(preset, args, logical, tensors, found, backward, timer, built)
    return found


def fastest(rows: list[Measured], pass_: str, dropout: float) -> Measured:
    """Our fastest checked variant of `pass_` at `dropout`."""
    return min((r for r in rows if r.pass_ == pass_ and r.dropout == dropout and r.error is not None),
               key=lambda r: r.median_us)


def measure_together(preset: str, args: OpArgs, tensors: dict[str, torch.Tensor], rows: list[Measured],
                     timer: Timer, built: dict[str, tuple]) -> Measured:
    """Our fastest forward and fastest backward timed as one region, as SDPA's forward + backward is: the L2 is
    flushed before the forward only, so the backward finds what the forward left there (the separate rows flush
    before each pass, as the profiler does)."""
    size: Size = get_size(preset)
    stream = torch.cuda.current_stream().cuda_stream
    calls = []
    for pass_ in ("forward", "backward"):
        params, cubin = built[fastest(rows, pass_, args.attention_dropout).impl]
        bound = params.bind(cubin, 0)
        calls.append((bound, [tensors[name].data_ptr() for name in bound.names]))
    t = timer(lambda: [bound(pointers, args, stream) for bound, pointers in calls])
    flop = 14 * size.B * size.H * size.L ** 2 * size.P
    return Measured(preset, args.attention_dropout, "ours", "forward+backward", t.median_us, t.min_us,
                    flop / t.median_us / 1e6, None)


def wave_counts(params, bound, live_tiles: int) -> str:
    """Each kernel of the point (`bound`): its grid, how many of its blocks an SM holds (the driver's occupancy),
    and the waves the grid takes; for `_dkdv`, whose blocks are key tiles, also the waves of the `live_tiles` of
    every (b, h) that hold an unmasked key (the others skip their walk)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    found = []
    for launch in bound.launches:
        part = launch.name[len(params.name) + 1:]  # the kernel's suffix (`dkdv`), none for the forward's
        per_sm = launch.resident_blocks()
        text = f"{part or 'forward'} {launch.blocks} blocks, {per_sm}/SM: {launch.blocks / (per_sm * sms):.2f} waves"
        if part == "dkdv":
            live = params.B * params.H * live_tiles
            text += f" ({live} live: {live / (per_sm * sms):.2f})"
        found.append(text)
    return "; ".join(found)


def backward_layouts(preset: str) -> dict[str, str]:
    """The backward's tensors in the shipped configuration's layouts: the forward's, each gradient in its tensor's."""
    return LAYOUTS[preset] | {g: LAYOUTS[preset][t] for g, t in GRADIENT_LAYOUTS.items()}


def measure_backward(preset: str, p: float, args: OpArgs, logical: dict[str, torch.Tensor],
                     tensors: dict[str, torch.Tensor], timer: Timer, points: list, cubins: list
                     ) -> tuple[list[Measured], dict[str, torch.Tensor]]:
    """Our backward variants `points` (built as `cubins`) on `tensors` (Z and LSE as our last forward variant left
    them), checked against autograd through the float32 reference, then SDPA's forward + backward (a fresh dZ each
    size); and the tensors with dZ, dQ, dK, dV."""
    size: Size = get_size(preset)
    dtype = tensors["Q"].dtype
    layouts = backward_layouts(preset)
    dZ = torch.randn(size.B, size.L, size.H, size.P, device="cuda").to(dtype)  # bjhp
    tensors = tensors | {"dZ": stored(dZ, "bjhp", layouts["dZ"])}
    for g in ("dQ", "dK", "dV"):
        tensors[g] = torch.empty(points[0].tensor_shape(layouts[g]), device="cuda", dtype=dtype)
    want = reference_backward(args, *(logical[n].float() for n in "QKV"), tensors["M"].float(), dZ.float())
    flop = 10 * size.B * size.H * size.L ** 2 * size.P
    found = []
    for params, cubin in zip(points, cubins):
        params.launch(cubin, tensors, args)
        error = max(relative_error(as_bhlp(tensors[g], layouts[g]), w) for g, w in zip(("dQ", "dK", "dV"), want))
        t, bound, pointers, stream = timed_launch(params, cubin, tensors, args, timer)
        found.append(Measured(preset, p, params.label, "backward", t.median_us, t.min_us, flop / t.median_us / 1e6,
                              error))
        # Each of its two kernels alone (on a workspace D the whole backward filled): where the time goes.
        workspace = torch.empty(params.workspace_shape(), device="cuda")
        bound(pointers, args, stream, workspace)
        values = (*pointers, workspace.data_ptr(), *bound.scalars(args))
        for (part, _, _), kernel in zip(params.launch_shapes(), bound.launches):
            t = timer(lambda: kernel(stream, *values))
            found.append(Measured(preset, p, params.label, "backward_" + part, t.median_us, t.min_us, 0.0, None))
    q, k, v = (as_bhlp(tensors[n], layouts[n]).detach().requires_grad_() for n in "QKV")
    grad = dZ.permute(0, 2, 1, 3)  # bhjp, as SDPA's output
    flop += 4 * size.B * size.H * size.L ** 2 * size.P
    for impl, backend in SDPA.items():
        def work() -> None:
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
            torch.autograd.grad(out, (q, k, v), grad)
        try:
            t = timer(work)
        except RuntimeError as err:  # a backend that refuses this case (dropout, layout) is left out, said why
            print(f"{preset} p={p} {impl} forward+backward: {err}".splitlines()[0])
            continue
        found.append(Measured(preset, p, impl, "forward+backward", t.median_us, t.min_us, flop / t.median_us / 1e6,
                              None))
    return found, tensors


def padding_mask(size: Size, dtype: torch.dtype) -> torch.Tensor:
    """[B, K] ones on each sequence's first ⌈KEEP·L⌉ keys, zeros on the rest: padding at the end, as batches of
    shorter sequences have it."""
    M = torch.zeros(size.B, size.L, device="cuda", dtype=dtype)
    M[:, :math.ceil(MASK_KEEP * size.L)] = 1
    return M


def measure_masked(preset: str, args: OpArgs, logical: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                   forward: list[Measured], backward: list[Measured], timer: Timer, built: dict[str, tuple]
                   ) -> list[Measured]:
    """The fastest forward and backward variant (of `built`, by label) again with a padding mask keeping MASK_KEEP
    of the keys (fully masked key tiles are skipped), checked against the float32 reference with that mask, with
    their kernels' waves."""
    size: Size = get_size(preset)
    dtype = tensors["Q"].dtype
    layouts = backward_layouts(preset)
    tensors = tensors | {"M": padding_mask(size, dtype)}
    Z_ref, _ = reference(args, *(logical[n].float() for n in "QKV"), tensors["M"].float())
    dZ = torch.randn(size.B, size.L, size.H, size.P, device="cuda").to(dtype)  # bjhp
    tensors["dZ"] = stored(dZ, "bjhp", layouts["dZ"])
    for g in ("dQ", "dK", "dV"):
        tensors[g] = torch.empty_like(tensors[g[1]])
    want = reference_backward(args, *(logical[n].float() for n in "QKV"), tensors["M"].float(), dZ.float())
    kept = math.ceil(MASK_KEEP * size.L)
    found = []
    for pass_, rows in (("forward", forward), ("backward", backward)):  # the forward first: the backward reads its Z
        unmasked = fastest(rows, pass_, args.attention_dropout)
        params, cubin = built[unmasked.impl]
        params.launch(cubin, tensors, args)
        if pass_ == "forward":
            error = relative_error(as_bhlp(tensors["Z"], layouts["Z"]).permute(0, 2, 1, 3), Z_ref)
        else:
            error = max(relative_error(as_bhlp(tensors[g], layouts[g]), w) for g, w in zip(("dQ", "dK", "dV"), want))
        t, bound = timed_launch(params, cubin, tensors, args, timer)[:2]
        found.append(Measured(preset, args.attention_dropout, params.label, f"{pass_}_mask{MASK_KEEP:.0%}",
                              t.median_us, t.min_us, unmasked.tflops * unmasked.median_us / t.median_us, error,
                              wave_counts(params, bound, math.ceil(kept / params.block_m))))
    return found


def summary(rows: list[Measured]) -> list[str]:
    """Per size and dropout: our fastest forward + fastest backward beside each SDPA backend's forward + backward."""
    lines = []
    for size, p in dict.fromkeys((r.size, r.dropout) for r in rows):
        mine = [r for r in rows if (r.size, r.dropout) == (size, p)]
        fwd = min((r for r in mine if r.pass_ == "forward" and r.error is not None), key=lambda r: r.median_us)
        bwd = min((r for r in mine if r.pass_ == "backward"), key=lambda r: r.median_us)
        parts = {r.pass_: r.median_us for r in mine
                 if r.impl == bwd.impl and r.pass_.startswith("backward_") and "_mask" not in r.pass_}
        together = "  ".join(f"{r.impl} {r.median_us:.1f}" for r in mine if r.pass_ == "forward+backward")
        lines.append(f"{size:22} {p:4.1f}  ours: forward {fwd.median_us:.1f} + backward {bwd.median_us:.1f} = "
                     f"{fwd.median_us + bwd.median_us:.1f} µs ({', '.join(f'{k[8:]} {v:.1f}' for k, v in parts.items())});"
                     f"  forward+backward in one timed region: {together} µs")
        masked = [r for r in mine if r.pass_.endswith(f"_mask{MASK_KEEP:.0%}")]
        if masked:
            total = sum(r.median_us for r in masked)
            lines.append(f"{'':22} {'':4}  with {MASK_KEEP:.0%} of the keys kept: "
                         + " + ".join(f"{r.pass_.split('_')[0]} {r.median_us:.1f}" for r in masked)
                         + f" = {total:.1f} µs, {total / (fwd.median_us + bwd.median_us):.0%} of unmasked")
            lines += [f"{'':22} {'':4}    {r.pass_.split('_')[0]}: {r.waves}" for r in masked]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--sizes", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--wgmma", action="store_true",
                        help="also every variant at the Hopper knob's levels the profiler does not time")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--table", type=Path, help="also write the printed table here (layouts/h100-attention.txt)")
    options = parser.parse_args()
    timer = Timer(warmup=5, runs=options.runs)
    rows = [row for preset in options.sizes for row in measure(preset, options.dtype, timer, options.wgmma)]
    device = torch.cuda.get_device_properties(0)
    lines = [f"# scripts/time_attention.py on one {device.name} (PyTorch {torch.__version__}), {options.dtype}, H=16, P=64, "
             f"padding mask all ones", "# (read by our kernels, none given to SDPA), L2 flushed, median/min of "
             f"{options.runs} runs after 5 warm-up; TFLOP/s = 4 (forward), 10 (backward), 14 (SDPA forward+backward) "
             f"* B*H*L^2*P / median.",
             f"{'size':22} {'p':>4} {'pass':>16} {'median µs':>10} {'min µs':>8} {'TFLOP/s':>8} {'rel err':>8}  impl"]
    for r in rows:
        error = "" if r.error is None else f"{r.error:.1e}"
        lines.append(f"{r.size:22} {r.dropout:4.1f} {r.pass_:>16} {r.median_us:10.1f} {r.min_us:8.1f} {r.tflops:8.1f} "
                     f"{error:>8}  {r.impl}")
    lines += ["", "# summary"] + summary(rows)
    print("\n".join(lines))
    if options.table:
        options.table.write_text("\n".join(lines) + "\n")
    if options.out:
        options.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
