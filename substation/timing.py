"""One way to time GPU work, shared by both profilers and the benchmarks, and one way to measure what enqueueing
it costs the host (`host_us`).

Each run: write a buffer larger than the L2 cache (so inputs come from DRAM, not a warm cache), then
a spin kernel that keeps the GPU busy while the host enqueues start event, the work and the end event,
so that host-side launch cost (a binding's argument marshalling, Python) never shows up as GPU time;
the spin lasts at least four times the slowest host time of a warm-up call (the first excepted).
The events then bracket the work alone. Warm-up runs first; the median and min of the runs are kept.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

L2_FLUSH_BYTES = 128 << 20  # over twice the H100's 50 MB and the H200's 60 MB L2
SPIN_CYCLES = 200_000  # ~100 µs at 1.98 GHz: the least spin, longer than a lean launch takes to enqueue
SPIN_CYCLES_PER_S = 2.0e9  # an upper bound of the SM clock, so that a spin of n cycles lasts n / 2e9 s at least


@dataclass(frozen=True)
class Timing:
    runs: int
    median_us: float
    min_us: float
    each_us: tuple[float, ...] = ()  # every run's time, in order: a median hides steps that alternate or stall

    @classmethod
    def of(cls, times_us: list[float]) -> Timing:
        return cls(len(times_us), statistics.median(times_us), min(times_us), tuple(times_us))


class Timer:
    """Times callables that launch work on PyTorch's current CUDA stream."""

    def __init__(self, warmup: int = 5, runs: int = 25, flush_l2: bool = True) -> None:
        if runs < 1 or warmup < 0:
            raise ValueError(f"{runs=} must be >= 1 and {warmup=} >= 0")
        if not torch.cuda.is_available():
            raise RuntimeError("timing needs a CUDA GPU, and torch sees none")
        self.warmup, self.runs = warmup, runs
        self._flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None

    def __call__(self, work: Callable[[], object]) -> Timing:
        host_s = []
        for _ in range(self.warmup):
            start_s = time.perf_counter()
            work()
            host_s.append(time.perf_counter() - start_s)
        # The spin must outlast the host's enqueueing of start event, work and end event, however slow
        # the launcher is (one that checks its arguments can cost more than its kernel takes). The first
        # warm-up call may load a module or plan a GEMM: it does not count.
        steady = max(host_s[1:] or host_s or [0.0])
        spin = max(SPIN_CYCLES, int(4 * steady * SPIN_CYCLES_PER_S))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.runs)]
        for start, end in events:
            if self._flush is not None:
                self._flush.fill_(0)
            torch.cuda._sleep(spin)
            start.record()
            work()
            end.record()
        torch.cuda.synchronize()
        return Timing.of([start.elapsed_time(end) * 1e3 for start, end in events])


def time_steps(work: Callable[[], object], warmup: int = 20, runs: int = 100, flush_l2: bool = True) -> Timing:
    """CUDA-event time of `work` after `warmup` calls, `runs` calls back to back (L2 flushed before each)."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"{runs=} must be >= 1 and {warmup=} >= 0")
    for _ in range(warmup):
        work()
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        if flush is not None:
            flush.fill_(0)
        start.record()
        work()
        end.record()
    torch.cuda.synchronize()
    return Timing.of([start.elapsed_time(end) * 1e3 for start, end in events])


def host_us(work: Callable[[], object], calls: int = 100, rounds: int = 5, spin_s: float = 0.02) -> float:
    """What one call of `work` costs the CPU, in µs: the median over rounds of the mean of `calls` back-to-back
    calls, each round while a spin kernel of at least `spin_s` seconds keeps the GPU busy (so that no call waits for
    the GPU, and a full launch queue never blocks), the GPU drained in between."""
    work()
    results = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(spin_s * SPIN_CYCLES_PER_S))
        start = time.perf_counter()
        for _ in range(calls):
            work()
        results.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(results)


def sm_clocks(lines: Iterable[str]) -> list[float]:
    """The SM clocks (MHz) in `nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,nounits` output; lines that
    are not a number (a warning, a cut-off last line) are skipped."""
    found = []
    for line in lines:
        try:
            found.append(float(line.strip()))
        except ValueError:
            continue
    return found


class ClockLog:
    """The SM clock while a block runs, sampled by `nvidia-smi` every `interval_ms`: under a dense tensor-core step
    the H100's software power cap moves it between 1.5 and 1.98 GHz, and a step's time follows it
    (layouts/README.md, "The timeline run, and the clocks"), so a timing is only comparable beside its clock.
    Without nvidia-smi, or where it fails, `median_mhz` is None. `device_index` is nvidia-smi's, which is CUDA's
    unless CUDA_VISIBLE_DEVICES reorders or hides GPUs."""

    def __init__(self, device_index: int, interval_ms: int = 20) -> None:
        self.device_index, self.interval_ms = device_index, interval_ms
        self.samples: list[float] = []
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ClockLog:
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            self._process = subprocess.Popen(
                [smi, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", f"--id={self.device_index}",
                 f"--loop-ms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        output, _ = self._process.communicate()
        self.samples = sm_clocks(output.splitlines())

    @property
    def median_mhz(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None
