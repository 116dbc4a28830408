#!/usr/bin/env python3
"""Times the LayerNorm kernels (ln1, ln2, ln2_bwd, ln1_bwd) of the shipped configurations on this GPU: every
variant `kernels.layernorm.variants` offers for the layouts the configuration chose, beside the variant it chose.
Each variant is first checked against the float32 reference on the same inputs (dropout 0.1, as the profiler
does), then timed (`substation.timing.Timer`: L2 flushed, median of the runs), and reported in µs and as a share
of the copy rate over the operator's minimum bytes (`substation analyze`'s: every input read once, every output
written once). Beside each operator, a yardstick timed the same way in the same run: a plain device copy
(`dst.copy_(src)`) moving the same minimum bytes (half read, half written), so that each variant's time is also
a share of what a copy of its bytes reaches on this GPU at this size (launch and ramp included).

    python scripts/time_layernorm.py [--sizes bert-large-b8-l512 bert-large-b96-l128] [--dtype float16] [--output FILE]
    ncu --kernel-name regex:^ln python scripts/time_layernorm.py --no-timing   # each kernel launched once

`--no-timing` only checks each variant (one launch each: what ncu should see, with no flush kernel between).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from substation.analysis import H100_COPY_TBS, operator_cost
from substation.device import DeviceSpec
from substation.graph import layer_graph
from substation.kernels import gpu_check
from substation.kernels.layernorm import OPS, LayerNormParams, variants
from substation.kernels.profiler import check_error, compile_all
from substation.kernels.registry import kernel_params
from substation.records import DEFAULT_DROPOUT
from substation.sizes import Size, get_size
from substation.timing import Timer

SIZES = ("bert-large-b8-l512", "bert-large-b96-l128")
CONFIGURATION = "layouts/h100-{size}.json"  # the shipped H100 configuration of each size, named after the preset


@dataclass(frozen=True)
class Measured:
    size: str
    params: LayerNormParams
    shipped: bool
    error: float
    median_us: float | None  # None under --no-timing
    min_bytes: int
    copy_us: float | None  # the yardstick: a device copy of min_bytes (None under --no-timing)

    @property
    def of_copy_rate(self) -> float | None:
        return None if self.median_us is None else copy_rate_share(self.min_bytes, self.median_us)

    @property
    def of_yardstick(self) -> float | None:
        return None if self.median_us is None else self.copy_us / self.median_us

    def line(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.params.options().items())
        timed = ("untimed" if self.median_us is None else
                 f"{self.median_us:7.2f} µs {self.of_copy_rate:6.1%} copy rate {self.of_yardstick:6.1%} yardstick")
        return f"{self.size:20s} {self.params.op:8s} {timed}  err {self.error:.1e}  {'shipped ' if self.shipped else ''}{options}"


def copy_rate_share(min_bytes: int, us: float) -> float:
    return min_bytes / (us * 1e-6) / (H100_COPY_TBS * 1e12)


def yardstick_us(min_bytes: int, timer: Timer) -> float:
    """A plain device copy moving `min_bytes` (half read, half written), timed as the kernels are."""
    src = torch.randn(min_bytes // 4, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src)).median_us


def shipped_choice(size_name: str, op: str, configuration: str) -> tuple[dict[str, str], dict[str, object]]:
    """The layouts of the operator's tensors (inputs, then outputs) and the kernel options the configuration chose."""
    chosen = json.loads(Path(configuration.format(size=size_name)).read_text())["operators"][op]
    if chosen["impl"] != "kernel":
        raise ValueError(f"{op=}: the configuration of {size_name} chose impl {chosen['impl']!r}, expected 'kernel'")
    operator = layer_graph().operator(op)
    return {name: chosen["layouts"][name] for name in operator.inputs + operator.outputs}, chosen["options"]


def points(size_name: str, size: Size, spec: DeviceSpec, configuration: str) -> list[tuple[LayerNormParams, bool]]:
    """(variant, chosen by the configuration) for every LayerNorm operator: the chosen one first."""
    found = []
    for op in OPS:
        layouts, options = shipped_choice(size_name, op, configuration)
        chosen = kernel_params(op, size, size.dtype, layouts, options)
        found += [(chosen, True)] + [(p, False) for p in variants(op, size, size.dtype, layouts, spec) if p != chosen]
    return found


def min_bytes(op: str, size: Size) -> int:
    return operator_cost(layer_graph().operator(op), size, layer_graph()).bytes


def measure(size_name: str, size: Size, params: LayerNormParams, shipped: bool, timer: Timer | None,
            copy_us: float | None) -> Measured:
    work, error = gpu_check.checked_runner(params, size, DEFAULT_DROPOUT)
    check_error(error, params.dtype)
    median = timer(work).median_us if timer else None
    return Measured(size_name, params, shipped, error, median, min_bytes(params.op, size), copy_us)


def summary(results: list[Measured]) -> list[str]:
    """Per size and operator: the yardstick, the shipped variant, and the fastest variant of each staging (µs, share
    of the copy rate, share of the yardstick)."""
    lines = ["| size | op | min MB | copy of the same bytes µs (% copy rate) | shipped µs (% copy, % yardstick) "
             "| best shared µs | best registers µs (% copy, % yardstick) | registers knobs |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for size_name in dict.fromkeys(m.size for m in results):
        for op in OPS:
            mine = [m for m in results if m.size == size_name and m.params.op == op and m.median_us is not None]
            if not mine:
                continue
            shipped = next(m for m in mine if m.shipped)
            best = {staging: min((m for m in mine if m.params.staging == staging), key=lambda m: m.median_us,
                                 default=None) for staging in ("shared", "registers")}
            reg, shared = best["registers"], best["shared"]
            knobs = {k: v for k, v in reg.params.options().items() if k not in ("tile", "vec", "staging")} if reg else {}
            lines.append(f"| {size_name} | {op} | {shipped.min_bytes / 1e6:.2f} | {shipped.copy_us:.1f} "
                         f"({copy_rate_share(shipped.min_bytes, shipped.copy_us):.0%}) | {shipped.median_us:.1f} "
                         f"({shipped.of_copy_rate:.0%}, {shipped.of_yardstick:.0%}) | "
                         + (f"{shared.median_us:.1f} | " if shared else "– | ")
                         + (f"{reg.median_us:.1f} ({reg.of_copy_rate:.0%}, {reg.of_yardstick:.0%}) | {knobs} |" if reg
                            else "– | – |"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help="presets with a shipped configuration")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--runs", type=int, default=50, help="timed runs per variant (median)")
    parser.add_argument("--no-timing", action="store_true", help="check each variant only (one launch: for ncu)")
    parser.add_argument("--skip-shared", action="store_true",
                        help="only the shipped variant and the register-staged ones")
    parser.add_argument("--output", type=Path, help="also write everything printed (lines and table) to this file")
    parser.add_argument("--configuration", default=CONFIGURATION,
                        help="the configuration file whose choices are the shipped variants, {size} standing for the "
                             "preset (default: %(default)s; layouts/h200-{size}.json for the H200's)")
    args = parser.parse_args()
    spec = DeviceSpec.of(torch.cuda.current_device())
    timer = None if args.no_timing else Timer(runs=args.runs)
    printed = []

    def show(line: str) -> None:
        print(line, flush=True)
        printed.append(line)

    show(f"{torch.cuda.get_device_name()}, {args.dtype}, dropout {DEFAULT_DROPOUT}, copy rate {H100_COPY_TBS} TB/s")
    results = []
    for size_name in args.sizes:
        size = get_size(size_name, args.dtype)
        found = [(p, shipped) for p, shipped in points(size_name, size, spec, args.configuration)
                 if shipped or p.registers or not args.skip_shared]
        compile_all([p for p, _ in found], spec)
        copies = {}
        for params, shipped in found:
            if timer and params.op not in copies:
                nbytes = min_bytes(params.op, size)
                copies[params.op] = yardstick_us(nbytes, timer)
                show(f"{size_name:20s} {params.op:8s} copy of the same bytes ({nbytes / 1e6:.2f} MB): "
                     f"{copies[params.op]:.2f} µs ({copy_rate_share(nbytes, copies[params.op]):.1%} of "
                     f"{H100_COPY_TBS} TB/s)")
            results.append(measure(size_name, size, params, shipped, timer, copies.get(params.op)))
            show(results[-1].line())
    if timer:
        for line in ["", *summary(results)]:
            show(line)
    if args.output:
        args.output.write_text("\n".join(printed) + "\n")


if __name__ == "__main__":
    main()
