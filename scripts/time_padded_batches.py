#!/usr/bin/env python3
"""What `Encoder(padded_batches=True)` buys on this GPU: the shipped configuration's attention backward unsplit and
with `split_queries`, at several lengths of its batch, on a full batch, on batches padded as a data loader pads
them (each sequence's length uniform in 1..L, the first L: `substation.benchmark.padded_batch_mask`) and on one
keeping 3/4 of every sequence; then one whole layer's graphed training step on such a batch, `padded_batches`
False and True, twice each in turn.

Per kernel: each kernel's median duration by torch.profiler over back-to-back calls (`time_split_queries.py`'s
`kernel_medians`), with the live blocks of each key tile index `_d` counts and the first index it splits on the
H100's 264 wave slots (`first_split_tile`). Layer: `substation.benchmark.time_layer` (CUDA events, graphed, L2
not flushed, median of `--runs`).

    python scripts/time_padded_batches.py [--out layouts/h100-padded-batches-eighteenth.txt]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path

import torch

from substation import Encoder
from substation.benchmark import padded_batch_mask, time_layer
from substation.device import DeviceSpec
from substation.kernels.attention import configured_points, first_split_tile, live_blocks_per_tile
from substation.reference import OpArgs
from substation.sizes import TORCH_DTYPES, Size

sys.path.insert(0, str(Path(__file__).parent))
from time_split_queries import kernel_medians, random_inputs  # noqa: E402

ROOT = Path(__file__).parents[1]
H100_SLOTS = 264  # the shipped backward's `_dkdv`: two blocks an SM, 132 SMs


def masks(batch: int, length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Key-padding masks [batch, length] (1 keeps) by name."""
    kept = torch.zeros(batch, length)
    kept[:, :length * 3 // 4] = 1
    found = {"full": torch.ones(batch, length), "3/4 kept": kept}
    for name in ("loader A", "loader B"):
        found[name] = padded_batch_mask(generator, batch, length, length).float()
    return found


def kernels(config: dict, lengths: list[int], lines: list[str]) -> None:
    forward, backward = configured_points(config)
    dtype, spec = TORCH_DTYPES[config["dtype"]], DeviceSpec.of(0)
    args = OpArgs(scale=1 / math.sqrt(backward.P), attention_dropout=0.1, seed=5, offset=1).with_device_rng("cuda")
    generator = torch.Generator().manual_seed(0)
    lines.append(f"backward {backward.label}")
    for length in lengths:
        fwd, bwd = dataclasses.replace(forward, L=length), dataclasses.replace(backward, L=length)
        points = [dataclasses.replace(bwd, split_queries=split) for split in (0, 1)]
        cubins = {point: point.compile(spec) for point in (fwd, *points)}
        for name, mask in masks(bwd.B, length, generator).items():
            tensors = random_inputs(bwd, mask, dtype)
            fwd.launch(cubins[fwd], {n: tensors[n] for n in fwd.tensor_names}, args)
            live = live_blocks_per_tile(tensors["M"], bwd.block_m, bwd.H)
            found = [kernel_medians(point, cubins[point], tensors, args) for point in points]
            lines.append(f"L={length:4d} {name:9s} lengths {[int(n) for n in mask.sum(1).tolist()]} live blocks {live} "
                         f"first split tile {first_split_tile(live, H100_SLOTS)}")
            for label, medians in zip(("unsplit", "split"), found):
                parts = ", ".join(f"_{part} {us:.1f}" for part, us in medians.items())
                lines.append(f"    {label:8s} {sum(medians.values()):6.1f} us: {parts}")


def layers(path: Path, lengths: list[int], runs: int, lines: list[str]) -> None:
    warnings.simplefilter("ignore")  # each length but the configuration's says it was not tuned for it
    generator = torch.Generator().manual_seed(1)
    for length in lengths:
        mask = padded_batch_mask(generator, 8, length, length).to("cuda", torch.float16)
        x = torch.randn(8, length, 1024, device="cuda", dtype=torch.float16, requires_grad=True)
        dy = torch.randn(8, length, 1024, device="cuda", dtype=torch.float16)
        for _ in range(2):
            for padded in (False, True):
                encoder = Encoder.from_layouts(path, dtype=torch.float16, padded_batches=padded).cuda()
                step, _ = time_layer(encoder, x, mask, dy, graphed=True, warmup=10, runs=runs, flush_l2=False)
                lines.append(f"layer L={length} lengths {[int(n) for n in mask.sum(1).tolist()]} padded_batches="
                             f"{padded!s:5s}: step {step.median_us:.1f} us (min {step.min_us:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=Path, default=ROOT / "layouts" / "h100-bert-large-b8-l512.json")
    parser.add_argument("--lengths", type=int, nargs="+", default=[192, 256, 384, 512])
    parser.add_argument("--layer-lengths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, help="also write the printed lines here")
    options = parser.parse_args()
    config = json.loads(options.layouts.read_text())
    if Size(**config["size"]).B != 8:
        parser.error("the layer timing builds B8 batches: give a B8 configuration")
    lines = [f"# {torch.cuda.get_device_name(0)}, time_padded_batches.py --layouts {options.layouts.name} "
             f"--runs {options.runs}"]
    kernels(config, options.lengths, lines)
    layers(options.layouts.with_suffix(".pickle"), options.layer_lengths, options.runs, lines)
    print("\n".join(lines))
    if options.out:
        options.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
