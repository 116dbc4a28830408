#!/usr/bin/env python3
"""Build the kernels the GPU tests compile up front into the disk cache, without a GPU, so that the whole GPU suite
on a freshly lent machine spends its minutes running tests rather than in nvcc.

The GPU test modules that build many kernels at once in a fixture (the fused attention's points, the GEMMs with our
epilogues, the Encoder's epilogue configuration) name them in a module-level `gpu_builds()`; this script imports
those modules, collects every build and compiles them in parallel for this machine's GPU, or the H100's sm_90 where
there is none. It also builds every kernel listed in `tests/gpu_kernels.jsonl`: what a whole GPU suite run compiled,
written by that run when `$SUBSTATION_RECORD_KERNELS` names the file (`tests/conftest.py`), one JSON line per kernel
(its class and fields). Most of the suite's kernels are built one at a time by its tests (hundreds: on a fresh
machine a suite run spends over ten minutes in nvcc without them). A line whose class or fields no longer exist (a
renamed knob) is skipped and counted: record again.

A cache built here serves another machine where nvcc is the same build (its version is part of every cache key):
cubins are device code; the CUTLASS GEMMs' shared libraries also hold host code linked here, and their keys name
the nvidia-cutlass version, not the directory its headers lie in on either machine.

    SUBSTATION_CACHE=.kcache python scripts/build_gpu_test_kernels.py [--jobs N]
    SUBSTATION_RECORD_KERNELS=tests/gpu_kernels.jsonl python -m pytest -m gpu tests   # on a GPU: record the list
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import torch

from substation.device import DeviceSpec
from substation.jit import cache_dir, nvcc
from substation.kernels.base import KernelParams, passes

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("tests/kernels/test_attention.py", "tests/kernels/test_gemm_epilogue.py", "tests/test_encoder_gpu.py")
RECORDED = ROOT / "tests" / "gpu_kernels.jsonl"


def encode(kernel) -> str:
    """A kernel (a frozen dataclass with a `compile`) as one JSON line: its class and fields, tuples as lists and
    torch dtypes by name."""
    def plain(value):
        if isinstance(value, torch.dtype):
            return {"torch_dtype": str(value).removeprefix("torch.")}
        if isinstance(value, tuple):
            return [plain(item) for item in value]
        return value

    cls = type(kernel)
    values = {f.name: plain(getattr(kernel, f.name)) for f in fields(kernel)}
    return json.dumps({"class": f"{cls.__module__}:{cls.__qualname__}", "fields": values}, sort_keys=True)


def decode(line: str):
    """The kernel `encode` wrote."""
    def typed(value):
        if isinstance(value, dict) and set(value) == {"torch_dtype"}:
            return getattr(torch, value["torch_dtype"])
        if isinstance(value, list):
            return tuple(typed(item) for item in value)
        return value

    entry = json.loads(line)
    module, name = entry["class"].split(":")
    return getattr(importlib.import_module(module), name)(**{k: typed(v) for k, v in entry["fields"].items()})


def recorded(path: Path = RECORDED) -> tuple[list, int]:
    """The kernels listed in `path` (none where it does not exist), and how many of its lines name none any more."""
    kernels, stale = [], 0
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            kernels.append(decode(line))
        except (ImportError, AttributeError, TypeError, ValueError):
            stale += 1
    return kernels, stale


def test_module(path: str):
    """A test module by its file, imported as pytest's importlib mode does (no package needed)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="nvcc processes at once")
    args = parser.parse_args()
    spec = DeviceSpec.build_target()
    # Kernel points the build target cannot run (the attention's wgmma points off Hopper) its tests skip too.

    def runnable(kernel) -> bool:
        return not isinstance(kernel, KernelParams) or passes(kernel, spec)

    builds = {path: [kernel for kernel in test_module(path).gpu_builds() if runnable(kernel)] for path in MODULES}
    listed, stale = recorded()
    named = {kernel for kernels in builds.values() for kernel in kernels}
    builds[RECORDED.relative_to(ROOT).as_posix()] = [k for k in dict.fromkeys(listed) if k not in named and runnable(k)]
    start = time.perf_counter()
    for path, kernels in builds.items():
        with ThreadPoolExecutor(args.jobs) as pool:
            fresh = sum(not built.cached for built in pool.map(lambda kernel: kernel.compile(spec), kernels))
        print(f"{path}: {len(kernels)} kernels for {spec.arch}, {fresh} compiled "
              f"({time.perf_counter() - start:.0f} s so far)", flush=True)
    if stale:
        print(f"{RECORDED.name}: {stale} lines name a kernel class or field that no longer exists: record it again")
    print(f"cache: {cache_dir()} ({nvcc()[1]})")


if __name__ == "__main__":
    main()
