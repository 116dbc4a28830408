"""Isolated profiling (substation.isolation): toy tasks in spawned workers that succeed, raise, exit, hang or report
a CUDA error that kills the context; each costs at most its own failed row, and a resumed run skips what is recorded.

The spawned workers import this file by name to unpickle `ToyRunner` (pytest imports it by path only), so the
tests put its folder on sys.path first (the `toy` fixture). Each worker start costs seconds (spawn, import torch):
the tests keep them few."""
import functools
import importlib
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

from substation.isolation import IsolationError, Task, exit_reason, is_fatal_cuda_error, run_isolated
from substation.records import Candidate, ProfileRow, read_rows
from substation.sizes import get_size

SIZE = get_size("bert-large-b8-l512")
GPU = "toy gpu"
VERSIONS = {"substation": "test"}
TIMEOUT_S = 1.5


def toy_candidate(name: str) -> Candidate:
    return Candidate.make("ffn_in", "forward", "torch", {"X1": "bji", "W1": "ui"}, {"F": "bju"}, {"name": name})


def _illegal_address() -> None:
    """Launch a kernel that writes to an unmapped address (through Substation's own launcher): the CUDA context is
    unusable afterwards."""
    from substation.device import DeviceSpec
    from substation.jit import compile_cubin
    from substation.launch import PackedLaunch, kernel_function

    device = torch.cuda.current_device()
    source = r'extern "C" __global__ void poke(int* p) { *p = 1; }'
    cubin = compile_cubin(source, "poke", DeviceSpec.of(device).arch)
    poke = PackedLaunch(kernel_function(cubin.path, "poke", device, 0), "poke", device, 1, 1, 0, ("pointer",))
    poke(torch.cuda.current_stream().cuda_stream, 0xDEAD_0000_0000)
    torch.cuda.synchronize()


def _timed_matmul() -> float:
    from substation.timing import Timer

    x = torch.randn(256, 256, device="cuda")
    return Timer(runs=20)(lambda: x @ x).median_us


class ToyRunner:
    """Runs a payload of (action, name) steps, each a candidate: skips recorded ones, starts each, then acts."""

    def __init__(self, device: int, gpu: str = GPU) -> None:
        if device == 7:
            raise ValueError("toy: no device 7")
        self.device, self.gpu = device, gpu

    def __call__(self, payload, channel) -> None:
        for action, name in payload:
            cand = toy_candidate(name)
            if channel.recorded(cand, SIZE):
                continue
            channel.start([(cand, SIZE)])
            median_us = self.act(action, name)
            versions = {"pid": str(os.getpid()), "device": str(self.device)}
            channel.write([ProfileRow.make(cand, SIZE, self.gpu, versions, 1, median_us, median_us, dropout=0.1)])

    def act(self, action: str, name: str) -> float:
        if action == "raise":
            raise ValueError(f"toy: bad {name}")
        if action == "fatal":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if action == "exit":
            os._exit(3)
        if action == "sleep":
            time.sleep(60)
        if action == "gpu_fault":
            _illegal_address()
        if action == "gpu_hang":
            torch.cuda._sleep(1 << 50)
            torch.cuda.synchronize()
        return _timed_matmul() if action == "gpu_ok" else 1.0


@pytest.fixture
def toy(monkeypatch):
    """This file as a module that spawned workers can import by name."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return importlib.import_module("test_isolation")


def task(action: str, name: str) -> Task:
    return Task(((action, name),), ((toy_candidate(name), SIZE),))


def rows_by_name(path: Path) -> dict[str, ProfileRow]:
    rows = read_rows(path)
    return {row.candidate.options_dict["name"]: row for row in rows}


def test_fatal_cuda_errors_are_recognized_in_every_spelling():
    for text in ("RuntimeError: CUDA error: an illegal memory access was encountered",
                 "CUDADriverError: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered",
                 "CUDARuntimeError: cudaErrorLaunchFailure: unspecified launch failure",
                 "cudaErrorMisalignedAddress: misaligned address", "device-side assert triggered"):
        assert is_fatal_cuda_error(text), text
    for text in ("CUBLAS_STATUS_NOT_SUPPORTED", "RuntimeError: CUDA out of memory", "ValueError: bad layout"):
        assert not is_fatal_cuda_error(text), text
    assert (exit_reason(-6), exit_reason(3), exit_reason(-11)) == ("signal SIGABRT", "exit code 3", "signal SIGSEGV")


def test_tasks_pickle():
    one = task("ok", "a")
    assert pickle.loads(pickle.dumps(one)) == one and one.label == toy_candidate("a").label


def test_failures_cost_one_row_each_and_a_resumed_run_skips_them(toy, tmp_path):
    path = tmp_path / "toy.csv"
    setup = toy.ToyRunner
    tasks = [toy.task("ok", "a"), toy.task("raise", "b"), toy.task("ok", "c"), toy.task("fatal", "h"),
             toy.task("ok", "d"), Task((("ok", "g1"), ("exit", "g2"), ("ok", "g3"))), toy.task("sleep", "e"),
             toy.task("ok", "f")]
    start_s = time.monotonic()
    run_isolated(setup, tasks, path, {0: GPU}, VERSIONS, 0.1, timeout=TIMEOUT_S)
    rows = rows_by_name(path)
    assert {name: row.status for name, row in rows.items()} == {
        "a": "ok", "b": "failed", "c": "ok", "h": "failed", "d": "ok", "g1": "ok", "g2": "failed", "g3": "ok",
        "e": "failed", "f": "ok"}
    assert rows["b"].error == "ValueError: toy: bad b"
    assert rows["h"].error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert rows["g2"].error == "worker died (exit code 3)"
    assert rows["e"].error == f"timeout after {TIMEOUT_S:g} s"
    assert rows["b"].versions == '{"substation":"test"}', "the parent stamps the failed rows it writes"
    pid = {name: row.versions for name, row in rows.items() if row.status == "ok"}
    assert pid["a"] == pid["c"], "an exception fails one candidate; the worker goes on"
    assert pid["d"] == pid["g1"] != pid["a"], "after a fatal CUDA error a fresh worker runs the next task"
    assert pid["g3"] != pid["g1"], "the rest of a task cut short by a dead worker runs in a fresh one"
    assert pid["f"] != pid["g3"], "a fresh worker follows a timeout"
    assert time.monotonic() - start_s < 60, "the sleeping task was killed at its timeout"

    run_isolated(setup, [*tasks, toy.task("ok", "i")], path, {0: GPU}, VERSIONS, 0.1, timeout=TIMEOUT_S)
    again = rows_by_name(path)
    assert set(again) == set(rows) | {"i"} and all(again[name] == row for name, row in rows.items())


def test_every_gpu_runs_its_share_into_one_file(toy, tmp_path):
    path = tmp_path / "toy.csv"
    run_isolated(toy.ToyRunner, [toy.task("ok", str(n)) for n in range(4)], path, {0: GPU, 1: GPU}, VERSIONS, 0.1)
    devices = [row.versions for row in read_rows(path)]
    assert len(devices) == 4 and sum('"device":"1"' in d for d in devices) == 2


def test_a_worker_that_cannot_set_up_is_an_error(toy, tmp_path):
    with pytest.raises(IsolationError, match="the worker on GPU 7 did not start: ValueError: toy: no device 7"):
        run_isolated(toy.ToyRunner, [toy.task("ok", "a")], tmp_path / "toy.csv", {7: GPU}, VERSIONS, 0.1)


def test_timeouts_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="timeout=0"):
        run_isolated(ToyRunner, [], tmp_path / "toy.csv", {0: GPU}, VERSIONS, 0.1, timeout=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_faulting_or_hanging_kernel_costs_one_row_on_the_gpu(toy, tmp_path):
    from substation.profiling import gpu_name

    path, gpu = tmp_path / "toy.csv", gpu_name(0)
    tasks = [toy.task("gpu_ok", "a"), toy.task("gpu_fault", "b"), toy.task("gpu_ok", "c"), toy.task("gpu_hang", "d"),
             toy.task("gpu_ok", "e")]
    run_isolated(functools.partial(toy.ToyRunner, gpu=gpu), tasks, path, {0: gpu}, VERSIONS, 0.1, timeout=5)
    rows = rows_by_name(path)
    assert {name: row.status for name, row in rows.items()} == {
        "a": "ok", "b": "failed", "c": "ok", "d": "failed", "e": "ok"}
    assert is_fatal_cuda_error(rows["b"].error) and "illegal" in rows["b"].error, rows["b"].error
    assert rows["d"].error == "timeout after 5 s"
    assert rows["c"].versions != rows["a"].versions, "the fault's worker exited; a fresh one timed c"
