"""Compile → cache: the JIT of Substation's CUDA kernels (rendering is the kernels' own, launching
`substation/launch.py`'s).

Sources are compiled by nvcc to a cubin for one architecture (the device's: `DeviceSpec.arch`, sm_90 on
the H100). The cubin is cached under `$SUBSTATION_CACHE` (default `~/.cache/substation`) keyed by the
rendered source, the compiler options, the architecture and nvcc's version, and written atomically (a
temporary file, then a rename), so concurrent compiles never see half a file; a cached file that is not a
whole ELF object is a miss. Compiling needs nvcc only (no GPU).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from substation.errors import SubstationError

log = logging.getLogger(__name__)
NVCC_OPTIONS = ("-O3", "-std=c++17", "--extra-device-vectorization")
ELF_MAGIC = b"\x7fELF"


class CompileError(SubstationError, RuntimeError):
    """nvcc rejected a rendered kernel; the message holds the label, options and the failing lines."""


class ToolchainError(SubstationError, RuntimeError):
    """nvcc is not on PATH (or $SUBSTATION_NVCC)."""


def cache_dir() -> Path:
    return Path(os.environ.get("SUBSTATION_CACHE", Path.home() / ".cache" / "substation"))


@functools.cache
def nvcc() -> tuple[str, str]:
    """The nvcc to use and its version line (part of every cache key)."""
    path = os.environ.get("SUBSTATION_NVCC") or shutil.which("nvcc")
    if path is None:
        raise ToolchainError("nvcc was not found on PATH (set $SUBSTATION_NVCC): kernels cannot be compiled")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    return path, version.strip().splitlines()[-1]


@dataclass(frozen=True)
class Cubin:
    """A compiled file: a cubin, or a shared library (`compile_library`)."""

    path: Path
    arch: str  # what it runs on: 'sm_90'
    cached: bool  # True when it came from the cache, not from a compile


def _failing_lines(source: str, log_text: str, context: int = 2) -> str:
    """The rendered source around every line nvcc complains about, numbered."""
    lines = source.splitlines()
    wanted = sorted({int(n) for n in re.findall(r"\((\d+)\): (?:error|warning)", log_text)})
    shown = []
    for number in wanted:
        for i in range(max(1, number - context), min(len(lines), number + context) + 1):
            marker = ">>" if i == number else "  "
            shown.append(f"{marker}{i:5d} | {lines[i - 1]}")
        shown.append("")
    return "\n".join(shown)


def _compiled(source: str, label: str, flags: tuple[str, ...], arch: str, suffix: str,
              key_flags: tuple[str, ...] | None = None) -> tuple[Path, bool]:
    """The file nvcc makes of `source` with `flags` (which name the output kind and architecture), from the cache
    or compiled (then cached), and whether it came from the cache. `key_flags` stand for `flags` in the cache key
    where a flag names something by where it lies on this machine (an include directory)."""
    compiler, version = nvcc()
    key = hashlib.sha256("\0".join([source, *(flags if key_flags is None else key_flags), arch, version]).encode()
                         ).hexdigest()[:24]
    path = cache_dir() / arch / f"{key}{suffix}"
    if path.is_file() and path.read_bytes()[:4] == ELF_MAGIC:
        return path, True
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="substation-") as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / f"kernel{suffix}"
        src.write_text(source, encoding="utf-8")
        command = [compiler, *flags, "-o", str(out), str(src)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            raise CompileError(f"nvcc failed for {label}\noptions: {' '.join(command[1:-3])}\n{done.stderr.strip()}\n"
                               f"{_failing_lines(source, done.stderr)}")
        # a name of its own: threads of one process may build the same kernel at once (a sweep's duplicates)
        handle, staged = tempfile.mkstemp(suffix=".tmp", prefix=f"{key}.", dir=path.parent)
        os.close(handle)
        shutil.copyfile(out, staged)
        os.replace(staged, path)  # atomic: readers see the old file, no file, or the whole new one
    log.debug("compiled %s -> %s", label, path)
    return path, False


def compile_cubin(source: str, label: str, arch: str, options: tuple[str, ...] = NVCC_OPTIONS) -> Cubin:
    """The cubin of `source` for `arch` ('sm_90'), from the cache or from nvcc (then cached)."""
    path, cached = _compiled(source, label, ("-cubin", f"-arch={arch}", *options), arch, ".cubin")
    return Cubin(path, arch, cached)


def compile_library(source: str, label: str, arch: str, include_dirs: Mapping[str, str] | None = None) -> Cubin:
    """A shared library of host and device code (`extern "C"` entry points that launch their kernels), for kernels
    whose arguments host code must build: CUTLASS's Hopper GEMMs take TMA descriptors that only the host API
    encodes. `arch` is the full target ('sm_90a': wgmma and TMA need the architecture-specific one). NDEBUG
    keeps device asserts out, which would otherwise serialize the wgmma pipeline. `include_dirs` maps each header
    directory to what it holds (a package and its version): the cache key names that, not the path, so a cache
    built on one machine serves another whose Python keeps the package elsewhere."""
    include_dirs = include_dirs or {}
    flags = ("-shared", "-Xcompiler", "-fPIC", f"-arch={arch}", "-O3", "-std=c++17", "-DNDEBUG",
             "--expt-relaxed-constexpr")
    path, cached = _compiled(source, label, flags + tuple(f"-I{d}" for d in include_dirs), arch, ".so",
                             flags + tuple(f"-I<{what}>" for what in include_dirs.values()))
    return Cubin(path, arch, cached)
