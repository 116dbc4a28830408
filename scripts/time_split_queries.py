#!/usr/bin/env python3
"""Times the attention backward's query split (`split_queries`) in the shipped configurations on this GPU: each
configuration's forward, then its backward unsplit and split, on a full batch and on a padded one keeping
`--keep` of every sequence's keys (the padding at the sequence's end, so the key tiles past it hold padding only).
Every run is checked first: the split's dQ, dK, dV against autograd through the float32 reference (within twice
the unsplit kernel's error), and the split decision `_d` took against `first_split_tile`'s rule; the largest
difference from the unsplit kernel's outputs (dbqkv too, where stacked) is printed. Timings are
`substation.timing.Timer`'s (L2 flushed before each call, median and minimum of `--runs`); the masked share is the
padded batch's forward + backward over the full batch's, each with the split variant. Then each backward kernel's
median duration by the profiler (back-to-back calls), unsplit and split, keeping all, 75, 50 and 25 % of the keys.

    python scripts/time_split_queries.py [--runs 50] [--table layouts/h100-split-queries-seventeenth.txt]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import statistics
from pathlib import Path

import torch

from substation.accuracy import relative_error
from substation.device import DeviceSpec
from substation.kernels.attention import (configured_points, first_split_tile, live_blocks_per_tile,
                                         reference_backward, stacked_gradients, tensor_dims)
from substation.layouts import permutation, to_layout
from substation.reference import OpArgs
from substation.sizes import TORCH_DTYPES, Size
from substation.timing import Timer

CONFIGS = ["layouts/h100-bert-large-b8-l512.json", "layouts/h100-bert-large-b8-l512-nondet.json"]


def gradients(bwd, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backward's outputs as logical dQ: bhjp, dK, dV: bhkp (and dbqkv: thp where it writes a stacked dQKV)."""
    lay = dict(bwd.layouts)
    if bwd.stacked:
        return stacked_gradients(tensors["dQKV"], lay["dQKV"], tensors["dbqkv"], lay["dbqkv"])
    return {n: tensors[n].permute(permutation(lay[n], tensor_dims(n))) for n in ("dQ", "dK", "dV")}


def measure(path: str, keep: float, timer: Timer, lines: list[str]) -> None:
    config = json.loads(Path(path).read_text())
    fwd, bwd = configured_points(config)
    size, dtype = Size(**config["size"]), TORCH_DTYPES[config["dtype"]]
    spec, lay = DeviceSpec.of(0), dict(bwd.layouts)
    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = {n: torch.randn(size.B, size.H, size.L, size.P, device="cuda", generator=gen).to(dtype) for n in "QKV"}
    dZ = torch.randn(size.B, size.L, size.H, size.P, device="cuda", generator=gen).to(dtype)  # bjhp
    args = OpArgs(scale=1 / math.sqrt(size.P), attention_dropout=0.1, seed=2**33 + 5, offset=11
                  ).with_device_rng("cuda")
    points = {split: dataclasses.replace(bwd, split_queries=split) for split in (0, 1)}
    cubins = {p: p.compile(spec) for p in (fwd, *points.values())}
    lines.append(f"{Path(path).stem}  forward {fwd.label}")
    lines.append(f"  backward {bwd.label}")
    totals = {}
    for kept in (size.L, math.ceil(keep * size.L)):
        M = torch.zeros(size.B, size.L, device="cuda", dtype=dtype)
        M[:, :kept] = 1
        tensors = {n: to_layout(inputs[n], "bhkp" if n != "Q" else "bhjp", lay[n]) for n in "QKV"} | {"M": M}
        tensors["dZ"] = to_layout(dZ, "bjhp", lay["dZ"])
        tensors["Z"] = torch.empty(fwd.tensor_shape(lay["Z"]), device="cuda", dtype=dtype)
        tensors["LSE"] = torch.empty(size.B, size.H, size.L, device="cuda")
        forward = fwd.bind(cubins[fwd], 0)
        stream = torch.cuda.current_stream().cuda_stream
        fwd_pointers = [tensors[n].data_ptr() for n in forward.names]
        forward(fwd_pointers, args, stream)
        want = reference_backward(args, *(inputs[n].float() for n in "QKV"), M.float(), dZ.float())
        t_fwd = timer(lambda: forward(fwd_pointers, args, stream))
        got, times = {}, {}
        for split, point in points.items():
            outputs = {n: torch.full(point.tensor_shape(lay[n]), math.nan, device="cuda", dtype=dtype)
                       for n in ("dQ", "dK", "dV", "dQKV", "dbqkv") if n in lay}
            run = tensors | outputs
            bound = point.bind(cubins[point], 0)
            workspace = torch.empty(point.workspace_shape(), device="cuda")
            pointers = [run[n].data_ptr() for n in bound.names]
            bound(pointers, args, stream, workspace)
            torch.cuda.synchronize()
            got[split] = gradients(point, run)
            if split:
                decided = workspace[point.render_context()["SPLIT_OFFSET"]].view(torch.int32).item()
                dkdv = next(launch for launch in bound.launches if launch.name.endswith("_dkdv"))
                slots = dkdv.resident_blocks() * spec.sm_count
                live = live_blocks_per_tile(M, point.block_m, size.H)
                if decided != first_split_tile(live, slots):
                    raise AssertionError(f"{kept} keys: _d split from key tile {decided}, the rule says "
                                         f"{first_split_tile(live, slots)}")
            times[split] = timer(lambda: bound(pointers, args, stream, workspace))
        errors = {n: relative_error(got[1][n], g) for n, g in zip(("dQ", "dK", "dV"), want)}
        against = max(relative_error(got[1][n], got[0][n]) for n in got[0])
        worst = max(relative_error(got[0][n], g) for n, g in zip(("dQ", "dK", "dV"), want))
        if max(errors.values()) > 2 * worst + 1e-3:
            raise AssertionError(f"split gradients off the reference: {errors} (unsplit {worst:.2e})")
        totals[kept] = t_fwd.median_us + times[1].median_us
        lines.append(f"  keys kept {kept:4d}/{size.L}: split from key tile {decided} of {bwd.row_tiles} "
                     f"(slots {slots}); forward {t_fwd.median_us:6.1f} µs; backward unsplit "
                     f"{times[0].median_us:6.1f} (min {times[0].min_us:.1f}), split {times[1].median_us:6.1f} "
                     f"(min {times[1].min_us:.1f}); error vs float32 "
                     f"{max(errors.values()):.2e} (unsplit {worst:.2e}), split vs unsplit {against:.2e}")
    masked, full = totals[min(totals)], totals[size.L]
    lines.append(f"  masked forward + backward {masked:.1f} / {full:.1f} µs = {masked / full:.1%} of the full batch")
    lines.append("  the backward's kernels (profiler, median of 30 calls, L2 not flushed), unsplit | split:")
    for share in (1.0, 0.75, 0.5, 0.25):
        tensors["M"] = prefix_mask(size.B, size.L, share, dtype).to("cuda")
        forward(fwd_pointers, args, stream)
        found = [kernel_medians(point, cubins[point], tensors, args) for point in points.values()]
        lines.append(f"    keys kept {share:4.0%}: " + " | ".join(
            ", ".join(f"_{part} {us:.1f}" for part, us in medians.items()) for medians in found))


def prefix_mask(batch: int, length: int, keep: float, dtype: torch.dtype) -> torch.Tensor:
    """[batch, length] key-padding mask (1 keeps) in which each sequence keeps its first ceil(keep · length) keys,
    at least one."""
    kept = max(1, math.ceil(keep * length))
    return (torch.arange(length) < kept).to(dtype).expand(batch, length).contiguous()


def random_inputs(bwd, mask: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random Q, K, V, Z, dZ in the backward point's layouts, the mask, and room for the forward's LSE (float32)."""
    lay = dict(bwd.layouts)
    tensors = {n: torch.randn(bwd.tensor_shape(lay[n]), device="cuda").to(dtype) for n in ("Q", "K", "V", "Z", "dZ")}
    return tensors | {"M": mask.to("cuda", dtype), "LSE": torch.empty(bwd.B, bwd.H, bwd.L, device="cuda")}


def bound_backward(point, cubin, tensors: dict[str, torch.Tensor]):
    """The backward bound on `tensors` and fresh output buffers: (bound, its pointers, its workspace)."""
    lay = dict(point.layouts)
    run = tensors | {n: torch.empty(point.tensor_shape(lay[n]), device="cuda", dtype=tensors["Q"].dtype)
                     for n in ("dQ", "dK", "dV", "dQKV", "dbqkv") if n in lay}
    bound = point.bind(cubin, 0)
    return bound, [run[n].data_ptr() for n in bound.names], torch.empty(point.workspace_shape(), device="cuda")


def kernel_medians(point, cubin, tensors: dict[str, torch.Tensor], args: OpArgs, calls: int = 30) -> dict[str, float]:
    """Each kernel's median duration (µs) over `calls` back-to-back calls of the bound backward, by its suffix."""
    bound, pointers, workspace = bound_backward(point, cubin, tensors)
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(5):
        bound(pointers, args, stream, workspace)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            bound(pointers, args, stream, workspace)
        torch.cuda.synchronize()
    durations = collections.defaultdict(list)
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith(point.name):
            durations[event.name[len(point.name) + 1:]].append(event.device_time)
    return {part: statistics.median(us) for part, us in durations.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--keep", type=float, default=0.75, help="share of each sequence's keys the padded batch keeps")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--table", type=Path, help="also write the printed lines here")
    options = parser.parse_args()
    timer = Timer(warmup=10, runs=options.runs)
    lines = [f"# {torch.cuda.get_device_name(0)}, time_split_queries.py --runs {options.runs} --keep {options.keep}"
             " (L2 flushed, median of the runs)"]
    for path in options.configs:
        measure(path, options.keep, timer, lines)
    print("\n".join(lines))
    if options.table:
        options.table.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
