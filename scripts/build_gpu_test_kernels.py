#!/usr/bin/env python3
"""Build the kernels the GPU tests compile up front into the disk cache, without a GPU, so that the whole GPU suite
on a freshly lent machine spends its minutes running tests rather than in nvcc.

The GPU test modules that build many kernels at once in a fixture (the fused attention's points, the GEMMs with our
epilogues, the Encoder's epilogue configuration) name them in a module-level `gpu_builds()`; this script imports
those modules, collects every build and compiles them in parallel for this machine's GPU, or the H100's sm_90 where
there is none. Kernels the tests build one at a time (Encoders at their sizes) are not covered: `substation
compile` builds a configuration's.

A cache built here serves another machine where nvcc is the same build (its version is part of every cache key):
cubins are device code; the CUTLASS GEMMs' shared libraries also hold host code linked here, and their keys name
the nvidia-cutlass version, not the directory its headers lie in on either machine.

    SUBSTATION_CACHE=.kcache python scripts/build_gpu_test_kernels.py [--jobs N]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from substation.device import DeviceSpec
from substation.jit import cache_dir, nvcc
from substation.kernels.base import KernelParams, passes

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("tests/kernels/test_attention.py", "tests/kernels/test_gemm_epilogue.py", "tests/test_encoder_gpu.py")


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
    builds = {path: [kernel for kernel in test_module(path).gpu_builds()
                     if not isinstance(kernel, KernelParams) or passes(kernel, spec)] for path in MODULES}
    start = time.perf_counter()
    for path, kernels in builds.items():
        with ThreadPoolExecutor(args.jobs) as pool:
            fresh = sum(not built.cached for built in pool.map(lambda kernel: kernel.compile(spec), kernels))
        print(f"{path}: {len(kernels)} kernels for {spec.arch}, {fresh} compiled "
              f"({time.perf_counter() - start:.0f} s so far)", flush=True)
    print(f"cache: {cache_dir()} ({nvcc()[1]})")


if __name__ == "__main__":
    main()
