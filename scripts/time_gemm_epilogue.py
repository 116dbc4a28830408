#!/usr/bin/env python3
"""Times the GEMMs with our epilogues (`kernels/gemm_epilogue.py`, CUTLASS 3 Hopper kernels) against what the
shipped configurations run today, in the layouts those configurations chose, on this GPU:

- forward: ffn_in + bias_gelu as cuBLASLt's best heuristic algorithm (of 8, each timed) + our bias_gelu kernel
  (the configuration's variant), against one CUTLASS GEMM with the `bias_gelu` epilogue (F and H1 written);
- backward: ffn_out_dgrad + bias_gelu_bwd likewise, against one GEMM with the `dgelu_bgrad` epilogue (dF, db1);
- the same GEMM call with the `plain` epilogue (D = acc) beside cuBLASLt: the yardstick of the mainloop.

Every CUTLASS variant is first checked against the float64 reference of the operators it covers (the graph's own,
`substation.reference.run_operator`) on random inputs, then timed (`substation.timing.time_steps`: L2 flushed,
median of 100 runs after 20 warm-up). Variants compile in parallel (nvcc, one process per core).

    python scripts/time_gemm_epilogue.py [--sizes bert-large-b8-l512 bert-large-b96-l128] [--output FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from substation.config_file import load_configuration, to_configuration
from substation.graph import layer_graph
from substation.implementations import registry
from substation.protocol import Choice, StepContext
from substation.reference import OpArgs, run_operator
from substation.sizes import get_size
from substation.tc_profiling.cublaslt import LtMatmul, device_handle
from substation.timing import time_steps
from substation.kernels.gemm_epilogue import FUSIONS, GemmEpilogue, GemmEpilogueVariant, fused_call, loaded

SIZES = ("bert-large-b8-l512", "bert-large-b96-l128")
CONFIGURATION = "layouts/h100-{size}.json"
SHAPES = (  # (schedule, tile, cluster)
    ("cooperative", (128, 256, 64), (2, 1)),
    ("cooperative", (128, 256, 64), (1, 2)),
    ("cooperative", (128, 128, 64), (1, 2)),
    ("pingpong", (128, 128, 64), (1, 2)),
    ("pingpong", (128, 128, 64), (1, 1)),
    ("pingpong", (64, 256, 64), (2, 1)),
)
DTYPE = torch.float16


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=SIZES)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    graph, device = layer_graph(), torch.device("cuda", 0)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    plans = []
    for name in options.sizes:
        size = get_size(name)
        data = load_configuration(CONFIGURATION.format(size=name), size)
        config = to_configuration(data)
        for fusion in FUSIONS:
            ops = [graph.operator(op) for op in fusion.covers]
            found = fused_call(fusion, GemmEpilogue().cover_layouts(ops, config), size.extents)
            if isinstance(found, str):
                raise SystemExit(f"{name} {'+'.join(fusion.covers)}: no fused call in its layouts: {found}")
            variants = [dataclasses.replace(found.variant(shape, DTYPE), epilogue=kind)
                        for kind in ("plain", fusion.epilogue) for shape in SHAPES]
            plans.append((name, size, data, config, fusion.covers, found.mapping, variants))
    every = list(dict.fromkeys(v for plan in plans for v in plan[-1]))
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        failed = {v: err for v, err in zip(every, pool.map(compile_or_error, every)) if err}
    for variant, err in failed.items():
        say(f"compile failed: {variant.label}: {str(err).splitlines()[0]}")

    for name, size, data, config, covers, mapping, variants in plans:
        call, extents = mapping.call, size.extents
        gemm, fused = (graph.operator(c) for c in covers)
        say(f"\n== {name} {'+'.join(covers)}: m={call.m} n={call.n} k={call.k} transa={call.transa} "
            f"transb={call.transb} bias along {variants[0].bias_along}, {call.flop / 1e9:.1f} GFLOP")
        torch.manual_seed(0)
        args = OpArgs(scale=1 / math.sqrt(size.P))
        inputs = {t: torch.randn([extents[d] for d in config.layout(t, gemm.pass_)], dtype=torch.float64)
                  for t in gemm.inputs}
        extra = {t: torch.randn([extents[d] for d in config.layout(t, fused.pass_)], dtype=torch.float64)
                 for t in fused.inputs if t not in gemm.outputs}
        want = run_operator(gemm, inputs, config, args, extents)
        want |= run_operator(fused, {**want, **extra}, config, args, extents)
        gpu = {t: v.to(device, DTYPE) for t, v in {**inputs, **extra}.items()}
        want = {t: v.to(device) for t, v in want.items()}
        stream = torch.cuda.current_stream().cuda_stream

        # today's pair: cuBLASLt's best of its heuristic's 8 + the configuration's kernel for the fused operator
        matmul = LtMatmul(device_handle(0), call, DTYPE)
        result = torch.empty([extents[d] for d in config.layouts[gemm.outputs[0]]], dtype=DTYPE, device=device)
        a, b = gpu[mapping.a_operand].data_ptr(), gpu[mapping.b_operand].data_ptr()
        lt_times = []
        for algorithm in matmul.algorithms(8):
            lt_times.append((time_steps(lambda: matmul(a, b, result.data_ptr(), algorithm, stream)).median_us,
                             algorithm))
        lt_us, best = min(lt_times, key=lambda t: t[0])
        kernel_choice = Choice((fused.name,), data["operators"][fused.name]["impl"],
                               data["operators"][fused.name]["options"])
        step = registry(graph).find(kernel_choice.impl, (fused.name,)).bind(
            [fused], kernel_choice, config, size, DTYPE, device)
        env = {**gpu, gemm.outputs[0]: result}
        ctx = StepContext(args.with_device_rng(device), extents, stream)
        kernel_us = time_steps(lambda: step(env, ctx)).median_us
        say(f"cuBLASLt best of {len(lt_times)}: {lt_us:8.2f} µs  ({call.flop / lt_us / 1e6:5.0f} TFLOP/s)   "
            f"+ {fused.name} kernel {kernel_us:6.2f} µs = {lt_us + kernel_us:8.2f} µs")

        for variant in variants:
            if variant in failed:
                continue
            runner = loaded(variant)
            out = {t: torch.empty([extents[d] for d in config.layouts[t]], dtype=DTYPE, device=device)
                   for t in fused.outputs}
            d = out[fused.outputs[0]]
            workspace = torch.empty(max(runner.workspace_bytes(call), 1), dtype=torch.uint8, device=device)
            if variant.epilogue == "plain":
                run = lambda: runner(call, a, b, result.data_ptr(), stream)  # noqa: E731
                run()
                error = relative_error(result, want[gemm.outputs[0]])
            elif variant.epilogue == "bias_gelu":
                run = lambda: runner(call, a, b, d.data_ptr(), stream, aux=result.data_ptr(),  # noqa: E731
                                     bias=gpu["b1"].data_ptr())
                run()
                error = max(relative_error(d, want["H1"]), relative_error(result, want["F"]))
            else:
                run = lambda: runner(call, a, b, d.data_ptr(), stream, aux=gpu["F"].data_ptr(),  # noqa: E731
                                     bias=gpu["b1"].data_ptr(), bias_gradient=out["db1"].data_ptr(),
                                     workspace=workspace.data_ptr())
                run()
                error = max(relative_error(d, want["dF"]), relative_error(out["db1"], want["db1"]))
            us = time_steps(run).median_us
            versus = (f"vs cuBLASLt {lt_us / us:6.1%}" if variant.epilogue == "plain"
                      else f"vs pair {(lt_us + kernel_us) / us:6.1%} (saves {lt_us + kernel_us - us:6.2f} µs)")
            say(f"{variant.label:62s} {us:8.2f} µs ({call.flop / us / 1e6:5.0f} TFLOP/s) err {error:.1e}  {versus}")
    if options.output:
        options.output.write_text("\n".join(lines) + "\n")


def compile_or_error(variant: GemmEpilogueVariant) -> Exception | None:
    try:
        variant.compile()
    except Exception as err:  # reported per variant; the others still run
        return err
    return None


if __name__ == "__main__":
    main()
