#!/usr/bin/env python3
"""How the waves of our attention kernels fill the SMs (GPU): each block's SM, start and end by `%globaltimer`, for
the forward and the backward's `_dkdv` of each configuration given, at its size (float16 inputs, dropout 0.1, the
profiler's checked runner, 10 calls; the last call's blocks): block durations, starts and ends (ns from the first
start, quantiles), each SM's summed block time and last end. A timer object is put at the start of each kernel's
rendered source (its destructor records thread 0's end), so the kernels timed are the configured ones plus it.

    python scripts/block_timelines.py layouts/h100-bert-large-b8-l512.json [...] > timelines.txt
"""
import collections
import ctypes
import json
import sys

import torch

from substation import launch
from substation.kernels import attention as A
from substation.kernels.attention import checked_runner, configured_points
from substation.sizes import Size

TIMER = r'''
__device__ unsigned long long substation_dbg[16384][3];
struct SubstationBlockTimer {
  unsigned long long t0;
  __device__ SubstationBlockTimer() { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)); }
  __device__ ~SubstationBlockTimer() {
    if (threadIdx.x == 0) {
      unsigned long long t1; unsigned sm;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      substation_dbg[blockIdx.x][0] = sm; substation_dbg[blockIdx.x][1] = t0; substation_dbg[blockIdx.x][2] = t1;
    }
  }
};
'''

RECORDS = 16384  # blocks recorded at most: B96/L128's forward has 3072


def instrument(source: str, kernel_marker: str) -> str:
    """`source` with the timer declared before the kernel named by `kernel_marker` and made at its start."""
    at = source.index(kernel_marker)
    start = source.rindex('extern "C"', 0, at)
    body = source.index("{\n", at) + 2
    return source[:start] + TIMER + source[start:body] + "  SubstationBlockTimer substation_timer;\n" + source[body:]


def time_blocks() -> None:
    """Render every attention point (the forward, and the backward's `_dkdv`) with the timer."""
    for cls in (A.AttentionBackwardParams, A.AttentionParams):
        def render(self, *args, _original=cls.render, **kwargs):
            source = _original(self, *args, **kwargs)
            return instrument(source, "_dkdv(BWD_ARGS)" if isinstance(self, A.AttentionBackwardParams)
                              else self.name + "(")
        cls.render = render


def records(path: str) -> list[tuple[int, int, int]]:
    """(SM, start, end) of each block of the last launch of the module at `path` (its timer array, copied back)."""
    driver = launch.driver()
    driver.cuModuleGetGlobal_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_void_p, ctypes.c_char_p]
    driver.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    module = launch._module(path, torch.cuda.current_device())  # the module the runner launched from
    address, size = ctypes.c_uint64(), ctypes.c_size_t()
    assert driver.cuModuleGetGlobal_v2(ctypes.byref(address), ctypes.byref(size), ctypes.c_void_p(module),
                                       b"substation_dbg") == 0
    host = (ctypes.c_uint64 * (RECORDS * 3))()
    assert driver.cuMemcpyDtoH_v2(ctypes.cast(host, ctypes.c_void_p), address.value, size.value) == 0
    blocks = max(i for i in range(RECORDS) if host[3 * i + 1]) + 1
    return [tuple(host[3 * i:3 * i + 3]) for i in range(blocks)]


def quantiles(values: list[int], at: tuple[float, ...]) -> list[int]:
    ordered = sorted(values)
    return [ordered[int(q * (len(ordered) - 1))] for q in at]


def report(label: str, rows: list[tuple[int, int, int]]) -> None:
    t0 = min(r[1] for r in rows)
    durations, starts, ends = [r[2] - r[1] for r in rows], [r[1] - t0 for r in rows], [r[2] - t0 for r in rows]
    print(label, f"{len(rows)} blocks, last end {max(ends)} ns")
    print("  duration ns quantiles (0, .1, .5, .9, 1):", quantiles(durations, (0, .1, .5, .9, 1)))
    print("  start quantiles:", quantiles(starts, (0, .25, .5, .52, .6, .75, .9, 1)))
    print("  end quantiles:", quantiles(ends, (0, .25, .5, .75, .9, .95, .99, 1)))
    per_sm = collections.defaultdict(list)
    for row in rows:
        per_sm[row[0]].append(row)
    busy = sorted(sum(r[2] - r[1] for r in v) for v in per_sm.values())
    last = sorted(max(r[2] for r in v) - t0 for v in per_sm.values())
    print("  SMs", len(per_sm), "block-ns per SM (min, median, max):", busy[0], busy[len(busy) // 2], busy[-1],
          "; SM's last end (min, median, max):", last[0], last[len(last) // 2], last[-1])
    later = [s for s in starts if s > 1000]
    if later:
        print("  blocks starting after 1 us:", len(later), "their start quantiles:",
              quantiles(later, (0, .1, .5, .9, 1)))


def main() -> None:
    time_blocks()
    for path in sys.argv[1:]:
        config = json.loads(open(path, encoding="utf-8").read())
        size = Size(**config["size"])
        for point in configured_points(config):
            run, _ = checked_runner(point, size, 0.1)
            for _ in range(10):
                run()
            torch.cuda.synchronize()
            report(f"{path} {point.op} {point.options()}", records(str(point.compile().path)))


if __name__ == "__main__":
    main()
