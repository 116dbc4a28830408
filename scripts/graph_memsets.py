#!/usr/bin/env python3
"""What a memset node costs inside a CUDA graph, and which of a configuration's cuBLASLt calls add one.

`scripts/graph_timeline.py` found, in the graphed B96/L128 step, a 4-byte memset before five cuBLASLt GEMMs (the
algorithms cuBLASLt picks there need 4 bytes of workspace, which it zeroes before each call), each followed by a gap
of 2-4 us. This script separates the causes on one GPU, each graph replayed `--runs` times (CUDA events, median):

1. node kinds: `--reps` copies of one elementwise kernel of ~20 us, and the same with, between them, a 4-byte
   `cudaMemsetAsync` (a memset node), a 4-byte fill kernel (a kernel node), or both;
2. the configuration's cuBLASLt calls (`--layouts`): each recorded algorithm's workspace bytes, its time per call
   in a graph of `--reps` calls and as called, and, where it needs workspace, the fastest of cuBLASLt's heuristic
   algorithms that need none, timed the same way.

    python scripts/graph_memsets.py --layouts layouts/h100-bert-large-b96-l128.pickle [--runs 50] [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from substation.config_file import load_configuration
from substation.runtime import file_choices
from substation.tc_profiling import cublaslt
from substation.tc_profiling.mapping import GemmCall


def median_us(work: Callable[[], None], runs: int) -> float:
    """Median over `runs` of one call of `work`, CUDA events, after three calls of warm-up."""
    for _ in range(3):
        work()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graphed(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`body` captured once (after one eager call, which loads what it needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        body()
    torch.cuda.synchronize()
    return graph


def memset4(ptr: int) -> None:
    """A 4-byte cudaMemsetAsync on PyTorch's current stream: a memset node under capture."""
    from cuda.bindings import runtime

    (err,) = runtime.cudaMemsetAsync(ptr, 0, 4, torch.cuda.current_stream().cuda_stream)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemsetAsync: {err}")


def node_kinds(reps: int, runs: int) -> None:
    big = torch.zeros(16 << 20, device="cuda")  # 64 MB read and written: ~45 us
    small = torch.zeros(1, device="cuda")
    between = {
        "nothing": lambda: None,
        "4-byte memset node": lambda: memset4(small.data_ptr()),
        "4-byte fill kernel": lambda: small.zero_(),
        "memset node + fill kernel": lambda: (memset4(small.data_ptr()), small.zero_()),
    }
    base = None
    print(f"node kinds: {reps} x (elementwise kernel on 64 MB, X) in one graph, µs per X (median of {runs} replays)")
    for name, extra in between.items():
        def body(extra=extra):
            for _ in range(reps):
                big.add_(1.0)
                extra()
        per_rep = median_us(graphed(body).replay, runs) / reps
        base = per_rep if base is None else base
        print(f"  {name:28s} {per_rep:8.2f} µs per rep, X costs {per_rep - base:6.2f}")


def cublaslt_calls(data: dict) -> list[tuple[str, GemmCall, dict[str, int]]]:
    """(operator, call, options) of each cuBLASLt GEMM (plain or with the bias epilogue) that a loaded configuration
    binds with a recorded algorithm: the options hold the algorithm's and `bias_batch_stride` where there is one."""
    found = []
    for op, choice in file_choices(data).items():
        o = choice.options
        if choice.impl in ("cublaslt", "cublaslt_bias") and "algo_id" in o and op == choice.covers[0]:
            call = GemmCall(o["transa"] == "T", o["transb"] == "T", *(int(o[k]) for k in
                            ("m", "n", "k", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c", "batch")))
            found.append((op, call, {k: int(v) for k, v in o.items()
                                     if k in cublaslt.ALGO_CONFIG or k == "bias_batch_stride"}))
    return found


def gemm_calls(path: str, reps: int, runs: int) -> None:
    data = load_configuration(path)
    dtype = getattr(torch, data["dtype"])
    handle = cublaslt.device_handle(torch.cuda.current_device())
    print(f"\n{path}: cuBLASLt calls, µs per call in a graph of {reps} and as called (median of {runs})")
    print(f"  {'operator':16s} {'workspace B':>11s} {'graphed':>8s} {'called':>8s}   no-workspace alternative: "
          "graphed, called, its options")
    for op, call, options in cublaslt_calls(data):
        bias_stride = options.pop("bias_batch_stride", None)
        matmul = cublaslt.LtMatmul(handle, call, dtype, "none" if bias_stride is None else "bias", bias_stride or 0)
        bias = torch.randn(call.m * call.batch, device="cuda").to(dtype)
        if bias_stride is not None:
            matmul.set_epilogue_pointer(bias.data_ptr())
        a = torch.randn(call.stride_a * (call.batch - 1) + call.lda * (call.m if call.transa else call.k),
                        device="cuda").to(dtype)
        b = torch.randn(call.stride_b * (call.batch - 1) + call.ldb * (call.k if call.transb else call.n),
                        device="cuda").to(dtype)
        c = torch.empty(call.stride_c * (call.batch - 1) + call.ldc * call.n, device="cuda", dtype=dtype)

        def times(algorithm: cublaslt.Algorithm) -> tuple[float, float]:
            def one():
                matmul(a.data_ptr(), b.data_ptr(), c.data_ptr(), algorithm)

            def body():
                for _ in range(reps):
                    one()
            return median_us(graphed(body).replay, runs) / reps, median_us(one, runs)

        recorded = matmul.algorithm_from_options(options)
        workspace = matmul.check(recorded)
        g, e = times(recorded)
        line = f"  {op:16s} {workspace:11d} {g:8.2f} {e:8.2f}"
        if workspace:
            free = [(times(alg), alg) for alg in matmul.algorithms(16, max_workspace=0)]
            if free:
                (fg, fe), alg = min(free, key=lambda t: t[0][0])
                line += f"   {fg:8.2f} {fe:8.2f}  {alg.options()}"
            else:
                line += "   (cuBLASLt offers none)"
        print(line, flush=True)
        matmul.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="*", default=[], help="configurations whose cuBLASLt calls to time")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    node_kinds(args.reps, args.runs)
    for path in args.layouts:
        gemm_calls(path, args.reps, args.runs)


if __name__ == "__main__":
    main()
