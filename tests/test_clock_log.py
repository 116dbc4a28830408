"""The SM clock log beside every benchmark timing (`substation.timing.ClockLog`, CPU): its parsing of nvidia-smi's
output, the subprocess it runs (a stand-in `nvidia-smi` script on PATH that prints clocks the way the real one does
and then keeps running, as `-lms` does, until it is stopped), and no clock where there is no nvidia-smi."""
import os
import stat
import time

import pytest

from substation.timing import ClockLog, sm_clocks


def test_clocks_are_parsed_and_noise_skipped():
    assert sm_clocks(["1980", " 1575 ", "", "[N/A]", "WARNING: something", "15"]) == [1980.0, 1575.0, 15.0]


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` that writes its arguments to a file, prints three clocks and then waits to be stopped."""
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\nprintf '1980\\n1575\\n1530\\n'\n"
                      "exec sleep 30\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_the_log_samples_while_the_block_runs(fake_smi):
    start = time.perf_counter()
    with ClockLog(3, interval_ms=50) as clocks:
        time.sleep(0.3)  # the script has printed by then
    assert time.perf_counter() - start < 10  # stopped, not waited for
    assert clocks.samples == [1980.0, 1575.0, 1530.0] and clocks.median_mhz == 1575.0
    args = (fake_smi / "args").read_text().split()
    assert "--query-gpu=clocks.sm" in args and "--id=3" in args and "--loop-ms=50" in args


def test_no_nvidia_smi_no_clock(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: nothing to run
    with ClockLog(0) as clocks:
        pass
    assert clocks.samples == [] and clocks.median_mhz is None
