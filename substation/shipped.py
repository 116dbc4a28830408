"""The configurations shipped with Substation, and the one to run for a layer on this GPU.

Each shipped configuration is `<gpu>-<preset>.json` (or `-nondet.json`, made with `optimize --nondeterministic`),
optimized from the profile of `<preset>` on that GPU (`layouts/README.md`). From a checkout they are read from
`layouts/`, from a built wheel from `substation/shipped/` (the same files, as package data). Files named otherwise
(the cuDNN-attention and no-mask variants of B8/L512) serve tests and comparisons, not users, and are not chosen here.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from substation.sizes import PRESETS

# Where a wheel installs them (setup.py's package data), then a checkout's folder.
FOLDERS = (Path(__file__).parent / "shipped", Path(__file__).parents[1] / "layouts")
NAME = re.compile(r"(?P<gpu>h\d00)-(?P<preset>.+?)(?P<nondet>-nondet)?\.json")
SHIPPED = "shipped"  # the word for these files: inject's and from_hf's `layouts`, `substation compile`'s CONFIG
FALLBACK_GPU = "h100"  # its profile carries over to the H200 within 1.5 % (layouts/README.md, "its own profile")


@dataclass(frozen=True)
class Shipped:
    """One shipped configuration file and what its name and contents say about it."""

    path: Path
    gpu: str  # the file name's prefix: the kind of GPU its profile was measured on
    preset: str
    deterministic: bool
    dims: tuple[int, int, int]  # H, P, U
    length: int  # the L it was tuned for


def gpu_kind(device_name: str | None) -> str:
    """The file prefix of a CUDA device's name ("NVIDIA H200" -> "h200"); `FALLBACK_GPU` where it names no H-series
    number (and for None: no CUDA device)."""
    found = re.search(r"\bH(\d00)\b", device_name or "")
    return f"h{found.group(1)}" if found else FALLBACK_GPU


@functools.cache
def shipped() -> tuple[Shipped, ...]:
    """Every shipped configuration, from the first folder of `FOLDERS` that holds any (read once a process)."""
    for folder in FOLDERS:
        found = []
        for path in sorted(folder.glob("h*.json")):
            name = NAME.fullmatch(path.name)
            if name is None or name["preset"] not in PRESETS:
                continue
            size = json.loads(path.read_text(encoding="utf-8"))["size"]
            found.append(Shipped(path, name["gpu"], name["preset"], name["nondet"] is None,
                                 (size["H"], size["P"], size["U"]), size["L"]))
        if found:
            return tuple(found)
    return ()


def shipped_for(device_name: str | None) -> list[Shipped]:
    """The shipped configurations profiled on the GPU kind `device_name` names (`gpu_kind`), for each preset that
    has one, else the H100's."""
    kind, found = gpu_kind(device_name), shipped()
    own = {s.preset for s in found if s.gpu == kind}
    return [s for s in found if s.gpu == kind or (s.gpu == FALLBACK_GPU and s.preset not in own)]


def shipped_configuration(heads: int, head_size: int, intermediate: int, length: int = 512,
                          device_name: str | None = None, nondeterministic: bool = False) -> Path | None:
    """The shipped configuration to run a layer of these dimensions with, or None where none has them.

    Among the files of these H, P, U: those of the GPU kind named by `device_name` (`gpu_kind`) where there are any,
    else the H100's; the one tuned for the length nearest `length` (a tie: the longer); with `nondeterministic`, the
    `-nondet` one of that length where there is one (its attention backward adds dQ by float atomics: gradients may
    differ in their last bits between runs), else the deterministic one."""
    dims = (heads, head_size, intermediate)
    candidates = [s for s in shipped_for(device_name) if s.dims == dims]
    if not candidates:
        return None
    nearest = min(candidates, key=lambda s: (abs(s.length - length), -s.length)).length
    at_length = [s for s in candidates if s.length == nearest]
    preferred = [s for s in at_length if s.deterministic != nondeterministic]
    return (preferred or [s for s in at_length if s.deterministic])[0].path
