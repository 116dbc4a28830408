#!/usr/bin/env python3
"""Runs a configuration's attention forward once, then its backward once per `--split` value (`split_queries`),
at one sequence length, timing nothing: a target for Nsight Compute, whose per-kernel figures need each kernel
launched once. With `--cache-control none` ncu leaves the caches as the kernel before left them, so each of the
backward's kernels (`_d`, `_dkdv`, `_dqsum`) sees in L2 what it would see in a step:

    ncu --cache-control none --replay-mode application --kernel-name regex:"dkdv|dqsum|_d$" \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \\
        python scripts/backward_once.py --length 256

(`layouts/h100-attention-dqsum-l2-nineteenth.txt` came from that command.) Inputs are random; the padding mask
keeps every key unless `--keep` is below 1 (each sequence then pads its last keys).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from substation.device import DeviceSpec
from substation.kernels.attention import configured_points
from substation.reference import OpArgs
from substation.sizes import TORCH_DTYPES

sys.path.insert(0, str(Path(__file__).parent))
from time_split_queries import bound_backward, prefix_mask, random_inputs  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="layouts/h100-bert-large-b8-l512.json")
    parser.add_argument("--length", type=int, default=256, help="L (the configuration's B, H and P)")
    parser.add_argument("--split", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    parser.add_argument("--keep", type=float, default=1.0, help="the share of each sequence's keys not padding")
    options = parser.parse_args(argv)
    if not 0 < options.keep <= 1:
        parser.error(f"--keep {options.keep}: a share in (0, 1]")
    if not torch.cuda.is_available():
        sys.exit("backward_once.py: needs a CUDA GPU")
    config = json.load(open(options.config, encoding="utf-8"))
    forward, backward = configured_points(config)
    forward, backward = (dataclasses.replace(p, L=options.length) for p in (forward, backward))
    dtype, spec, device = TORCH_DTYPES[config["dtype"]], DeviceSpec.of(0), torch.device("cuda")
    args = OpArgs(scale=1 / math.sqrt(backward.P), attention_dropout=config["dropout"], seed=5,
                  offset=1).with_device_rng(device)
    tensors = random_inputs(backward, prefix_mask(backward.B, options.length, options.keep, dtype), dtype)
    forward.launch(forward.compile(spec), {name: tensors[name] for name in forward.tensor_names}, args)
    stream = torch.cuda.current_stream().cuda_stream
    for split in options.split:
        point = dataclasses.replace(backward, split_queries=split)
        bound, pointers, workspace = bound_backward(point, point.compile(spec), tensors)
        bound(pointers, args, stream, workspace)
        torch.cuda.synchronize()
        print(f"split_queries={split}: {point.name}", flush=True)


if __name__ == "__main__":
    main()
