"""The JIT's disk cache (CPU: nvcc only)."""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from substation import jit
from substation.jit import compile_library

SOURCE = '#include "answer.h"\nextern "C" int answer() { return ANSWER; }\n'


def test_library_cache_key_names_the_headers_not_their_directory(tmp_path, monkeypatch):
    """A cache built where a package's headers lie in one directory serves a machine that keeps them in another
    (the GPU machine's Python is not this one's); another version of them is another kernel."""
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path / "cache"))
    for place in ("here", "there"):
        (tmp_path / place).mkdir()
        (tmp_path / place / "answer.h").write_text("#define ANSWER 42\n")
    first = compile_library(SOURCE, "answer", "sm_90", {str(tmp_path / "here"): "answers 1.0"})
    moved = compile_library(SOURCE, "answer", "sm_90", {str(tmp_path / "there"): "answers 1.0"})
    newer = compile_library(SOURCE, "answer", "sm_90", {str(tmp_path / "there"): "answers 1.1"})
    assert not first.cached and moved.cached and moved.path == first.path
    assert not newer.cached and newer.path != first.path
    assert ctypes.CDLL(str(first.path)).answer() == 42


def test_threads_building_one_kernel_at_once_all_get_it(tmp_path, monkeypatch):
    """Two threads compiling the same source into an empty cache both finish: each stages its copy under a name of
    its own before moving it into place (both copies are written before either moves, here by a barrier)."""
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path / "cache"))
    (tmp_path / "answer.h").write_text("#define ANSWER 7\n")
    barrier, replace = threading.Barrier(2, timeout=120), os.replace

    def replace_after_both_staged(src, dst):
        barrier.wait()
        replace(src, dst)

    monkeypatch.setattr(jit.os, "replace", replace_after_both_staged)
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: compile_library(SOURCE, "answer", "sm_90", {str(tmp_path): "answers 1.0"}),
                              range(2)))
    assert built[0].path == built[1].path and ctypes.CDLL(str(built[0].path)).answer() == 7
    assert [p.name for p in built[0].path.parent.iterdir()] == [built[0].path.name]  # no staged file left behind
