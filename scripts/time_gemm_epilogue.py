#!/usr/bin/env python3
"""Times the GEMMs with our epilogues (`kernels/gemm_epilogue.py`, CUTLASS 3 Hopper kernels) against what the
shipped configurations run today, in the layouts those configurations chose, on this GPU:

- forward: ffn_in + bias_gelu as cuBLASLt's best heuristic algorithm (of 8, each timed) + our bias_gelu kernel
  (its first variant in the configuration's layouts: `runtime.default_choices`), against one CUTLASS GEMM with the
  `bias_gelu` epilogue (F and H1 written);
- backward: ffn_out_dgrad + bias_gelu_bwd likewise, against one GEMM with the `dgelu_bgrad` epilogue (dF and each
  tile's sums, which the bias-gradient kernel adds into db1: timed together) and one with the `dgelu` epilogue
  followed by the bias-gradient kernel over dF (`bias_grad=kernel` rows);
- the slope pair (`cutlass_gelu_slope`): the forward's `bias_gelu_slope` (H1 and GELU'(F + b1) written) and the
  backward's `slope_bgrad` (dF = acc · slope and the tiles' sums, with the bias-gradient kernel), pingpong shapes;
- the same GEMM call with the `plain` epilogue (D = acc) beside cuBLASLt: the yardstick of the mainloop.

Each over `SHAPES` (schedule, tile, cluster) and `EPILOGUE_TILES` (CUTLASS's automatic subtile or a given one);
the plain epilogue also over the scheduler's tile orders (`ORDERS`: swizzle and raster), the fused ones too with
`--orders`. `--rounds N` times every variant N times, in turn, so that a drift of the clocks during the
run falls on all of them alike.
Every fused variant is first checked against the float64 reference of the operators it covers (the profiler's
`checked_runner`), then timed (`substation.timing.time_steps`: L2 flushed, median of 100 runs after 20 warm-up).
Variants compile in parallel (nvcc, one process per core).

    python scripts/time_gemm_epilogue.py [--sizes bert-large-b8-l512 bert-large-b96-l128] [--output FILE]

For Nsight Compute, `--once` runs each variant one time (its check) and times nothing, and `--only` keeps the
variants whose label one of the given regular expressions matches (`re.search`):

    ncu -k regex:device_kernel --section SpeedOfLight --section WarpStateStats \\
        python scripts/time_gemm_epilogue.py --sizes bert-large-b96-l128 --once --only "pingpong .*1x2$"
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from substation.config_file import load_configuration, to_configuration
from substation.accuracy import relative_error
from substation.graph import layer_graph
from substation.implementations import registry
from substation.layouts import permutation
from substation.protocol import StepContext
from substation.reference import OpArgs, run_operator
from substation.runtime import default_choices
from substation.sizes import get_size
from substation.tc_profiling.cublaslt import LtMatmul, device_handle
from substation.timing import time_steps
from substation.kernels.gemm_epilogue import (FUSIONS, SLOPE_FUSIONS, EpilogueGroup, GemmEpilogue, GemmEpilogueVariant,
                                              GemmShape, checked_runner, fused_call, loaded)

SIZES = ("bert-large-b8-l512", "bert-large-b96-l128")
CONFIGURATION = "layouts/h100-{size}.json"
SHAPES = (  # (schedule, tile, cluster): the profiled ones; 128x128 cooperative and 64x256 pingpong never won
    ("cooperative", (128, 256, 64), (2, 1)),
    ("cooperative", (128, 256, 64), (1, 2)),
    ("pingpong", (128, 128, 64), (1, 2)),
)
EPILOGUE_TILES = {"cooperative": (None, (128, 64), (128, 128)), "pingpong": (None, (64, 64), (64, 128))}
# (swizzle, raster) of the persistent scheduler, swept for the plain epilogue at CUTLASS's automatic subtile:
# the mainloop's yardstick against cuBLASLt
ORDERS = ((1, "heuristic"), (2, "heuristic"), (4, "heuristic"), (1, "m"), (1, "n"))
DTYPE = torch.float16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=SIZES)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--once", action="store_true", help="run each variant once, time nothing (for ncu)")
    parser.add_argument("--only", nargs="+", metavar="REGEX", help="the variants whose label one of these matches")
    parser.add_argument("--orders", action="store_true",
                        help="time the fused variants over the scheduler's tile orders too, as the plain ones are")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every variant this many times, in turn, and report the median")
    parser.add_argument("--build-only", action="store_true",
                        help="compile the variants into the cache and stop (no GPU needed: build here, time there)")
    options = parser.parse_args()
    graph, device = layer_graph(), torch.device("cuda", 0)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    def chosen(variant: GemmEpilogueVariant) -> bool:
        return not options.only or any(re.search(pattern, variant.label) for pattern in options.only)

    shapes = [GemmShape(schedule, tile, cluster, epilogue_tile) for schedule, tile, cluster in SHAPES
              for epilogue_tile in EPILOGUE_TILES[schedule]]
    plans = []
    for name in options.sizes:
        size = dataclasses.replace(get_size(name), dtype="float16")
        config = to_configuration(load_configuration(CONFIGURATION.format(size=name), size))
        for fusion in FUSIONS + SLOPE_FUSIONS:
            ops = [graph.operator(op) for op in fusion.covers]
            found = fused_call(fusion, GemmEpilogue().cover_layouts(ops, config), size.extents)
            if isinstance(found, str):
                raise SystemExit(f"{name} {'+'.join(fusion.covers)}: no fused call in its layouts: {found}")
            plain = [variant for shape in shapes if shape.epilogue_tile is None for swizzle, raster in ORDERS
                     if not fusion.slope  # the plain yardstick: once a call
                     and chosen(variant := dataclasses.replace(found.variant(shape, DTYPE), epilogue="plain",
                                                               swizzle=swizzle, raster=raster))]
            schedules = {shape.schedule for shape in fusion.shapes}  # the slope pair's: pingpong only
            groups = [group for separate in ((False, True) if fusion.separate else (False,)) for shape in shapes
                      if shape.schedule in schedules for swizzle, raster in (ORDERS if options.orders else ORDERS[:1])
                      if chosen((group := EpilogueGroup(
                          dataclasses.replace(found.variant(shape, DTYPE, separate), swizzle=swizzle, raster=raster),
                          (found,), shape, size)).variant)]
            plans.append((name, size, config, found, plain, groups))
    kernels = list(dict.fromkeys([*(v for plan in plans for v in plan[-2]), *(g for plan in plans for g in plan[-1])]))
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        errors = list(pool.map(build_or_error, kernels))
    failed = {kernel: err for kernel, err in zip(kernels, errors) if err}
    for kernel, err in failed.items():  # a variant, or a group (its variant and its bias-gradient kernel)
        say(f"compile failed: {getattr(kernel, 'variant', kernel).label}: {str(err).splitlines()[0]}")
    if options.build_only:
        print(f"{len(kernels) - len(failed)} of {len(kernels)} variants built")
        return

    for name, size, config, found, plain, groups in plans:
        call, mapping, extents = found.call, found.mapping, size.extents
        gemm, fused = (graph.operator(c) for c in found.fusion.covers)
        say(f"\n== {name} {'+'.join(found.fusion.covers)}: m={call.m} n={call.n} k={call.k} transa={call.transa} "
            f"transb={call.transb} bias along {found.bias_along}, {call.flop / 1e9:.1f} GFLOP")
        torch.manual_seed(0)
        args = OpArgs(scale=1 / math.sqrt(size.P))
        inputs = {t: torch.randn([extents[d] for d in config.layout(t, gemm.pass_)], dtype=torch.float64)
                  for t in gemm.inputs}
        want = {t: v.to(device) for t, v in run_operator(gemm, inputs, config, args, extents).items()}
        gpu = {t: v.to(device, DTYPE) for t, v in inputs.items()}
        stream = torch.cuda.current_stream().cuda_stream
        # the call writes its product where the fused operator's result goes (H1, dF), which dH1 need not share
        (product,), stored = gemm.outputs, config.layouts[fused.outputs[0]]
        result = torch.empty([extents[d] for d in stored], dtype=DTYPE, device=device)
        want_product = want[product].permute(permutation(config.layouts[product], stored))
        a, b = gpu[mapping.a_operand].data_ptr(), gpu[mapping.b_operand].data_ptr()
        if options.once:
            for variant in plain:
                loaded(variant)(call, a, b, result.data_ptr(), stream)
            for group in groups:
                checked_runner(group, size)
            continue
        # today's pair: cuBLASLt's best of its heuristic's 8 + the configuration's kernel for the fused operator
        matmul = LtMatmul(device_handle(0), call, DTYPE)
        lt_us = min(time_steps(lambda: matmul(a, b, result.data_ptr(), algorithm, stream)).median_us
                    for algorithm in matmul.algorithms(8))
        kernel_choice = default_choices(config, size, graph)[fused.name]  # the configuration may fuse it away
        step = registry(graph).find(kernel_choice.impl, (fused.name,)).bind(
            [fused], kernel_choice, config, size, DTYPE, device)
        env = {**gpu, **{t: torch.randn([extents[d] for d in config.layout(t, fused.pass_)], device=device,
                                          dtype=DTYPE) for t in fused.inputs if t not in gpu}}
        ctx = StepContext(args.with_device_rng(device), extents, stream)
        kernel_us = time_steps(lambda: step(env, ctx)).median_us
        pair_us = lt_us + kernel_us
        say(f"cuBLASLt best of 8: {lt_us:8.2f} µs  ({call.flop / lt_us / 1e6:5.0f} TFLOP/s)   "
            f"+ {fused.name} kernel {kernel_us:6.2f} µs = {pair_us:8.2f} µs")

        runs = {}  # label: (run, error, what it is compared with)
        for variant in (v for v in plain if v not in failed):
            run = functools.partial(loaded(variant), call, a, b, result.data_ptr(), stream)
            run()
            runs[variant.label] = run, relative_error(result, want_product), lambda us: f"vs cuBLASLt {lt_us / us:6.1%}"
        for group in (g for g in groups if g not in failed):
            run, error = checked_runner(group, size)
            runs[group.variant.label + (" + bias kernel" if group.separate else "")] = run, error, (
                lambda us: f"vs pair {pair_us / us:6.1%} (saves {pair_us - us:6.2f} µs)")
        rounds: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(options.rounds):  # interleaved: a drift of the clocks falls on every variant alike
            for label, (run, _, _) in runs.items():
                rounds[label].append(time_steps(run).median_us)
        for label, (_, error, versus) in runs.items():
            us = statistics.median(rounds[label])
            spread = f" (rounds {min(rounds[label]):.2f}-{max(rounds[label]):.2f})" if options.rounds > 1 else ""
            say(f"{label:72s} {us:8.2f} µs ({call.flop / us / 1e6:5.0f} TFLOP/s) err {error:.1e}  "
                f"{versus(us)}{spread}")
    if options.output:
        options.output.write_text("\n".join(lines) + "\n")


def build_or_error(kernel: GemmEpilogueVariant | EpilogueGroup) -> Exception | None:
    try:
        kernel.compile()
    except Exception as err:  # reported per variant; the others still run
        return err
    return None


if __name__ == "__main__":
    main()
