"""The JIT's disk cache (CPU: nvcc only)."""
from __future__ import annotations

import ctypes

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
