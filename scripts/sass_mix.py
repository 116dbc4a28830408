#!/usr/bin/env python3
"""The instruction mix of our fused attention kernels' main loops, from their SASS: no GPU needed.

Each point is compiled (nvcc, the disk cache) and disassembled (`cuobjdump -sass`, found as `compare_sass.py`
finds it, which calls `nvdisasm`: both ship in the CUDA toolkit, or as the pip wheels `nvidia-cuda-cuobjdump` and
`nvidia-cuda-nvdisasm`, whose bin/ folder goes on PATH). A kernel's main loop is taken as its longest backward branch's span (the walk over the
other dim's tiles); the counts are per warp and per tile of that walk (static: the loop is straight-line code
apart from its few predicated branches). Instruction names are SASS opcodes without their modifiers, except
where the modifier tells the work apart (IMAD.WIDE: Philox's 32x32 -> 64-bit products; IMAD.MOV: register moves).

    python scripts/sass_mix.py [--size bert-large-b8-l512] > mix.txt
    python scripts/sass_mix.py --config layouts/h100-bert-large-b8-l512.json   # the kernels a configuration runs
    python scripts/sass_mix.py --config layouts/h100-bert-large-b8-l512.json --no-dropout   # what dropout costs

A kernel decides at run time whether dropout is on, so ptxas may keep two versions of the code after the branch:
the count is of the static listing, both versions included.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path

from substation.device import H100
from substation.jit import Cubin, compile_cubin
from substation.kernels.attention import AttentionParams, configured_points, make, make_backward
from substation.sizes import get_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_sass import cuobjdump  # noqa: E402  (the sibling script's finder: PATH, $CUDA_HOME, Triton's copy)

LAYOUTS = {"Q": "jbhp", "K": "kbhp", "V": "kbhp", "M": "bk", "Z": "jbhp"}  # B8/L512's, as time_attention.py
GRADIENTS = {"dZ": "jbhp", "dQ": "jbhp", "dK": "kbhp", "dV": "kbhp"}
KEPT_MODIFIERS = ("IMAD.WIDE", "IMAD.MOV", "HMMA", "LDSM", "MUFU")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+([^;]*);")
BRANCH = re.compile(r"BRA\s+0x([0-9a-f]+)")


def opcode(text: str) -> str:
    """The opcode of one SASS instruction (its predicate dropped), with the modifiers that tell work apart."""
    name = re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split()[0]
    kept = next((k for k in KEPT_MODIFIERS if name.startswith(k)), None)
    return kept or name.split(".")[0]


def main_loop(sass: str, suffix: str) -> collections.Counter:
    """The opcode counts of the longest backward branch's span in the kernel whose name ends with `suffix`."""
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        if not function.split("\n")[0].strip().endswith(suffix):
            continue
        code = [(int(address, 16), text) for address, text in INSTRUCTION.findall(function)]
        loops = [(int(m.group(1), 16), address) for address, text in code
                 if (m := BRANCH.search(text)) and int(m.group(1), 16) < address]
        if not loops:
            raise SystemExit(f"no loop in the kernel ending {suffix!r}")
        start, end = max(loops, key=lambda span: span[1] - span[0])
        return collections.Counter(opcode(text) for address, text in code if start <= address <= end)
    raise SystemExit(f"no kernel ending {suffix!r} in the cubin")


def points(size_name: str) -> list[tuple[str, object, str]]:
    """(what, point, kernel suffix): the shipped B8/L512 profile's fastest forward and backward, each at the
    compiler's registers and at its occupancy level, as `kernels/README.md` compares them."""
    size = get_size(size_name)
    fwd, bwd = dict(block_m=128, block_n=64), dict(block_m=128, block_n=32, fuse_dq=1)
    return [("forward 128x64", make(size, "float16", LAYOUTS, **fwd), ""),
            ("forward 128x64, 2 blocks", make(size, "float16", LAYOUTS, **fwd, min_blocks=2), ""),
            ("_dkdv 128x64 fused", make_backward(size, "float16", LAYOUTS | GRADIENTS, block_m=128, block_n=64,
                                                 fuse_dq=1), "_dkdv"),
            ("_dkdv 128x32 fused", make_backward(size, "float16", LAYOUTS | GRADIENTS, **bwd), "_dkdv"),
            ("_dkdv 128x32 fused, 2 blocks", make_backward(size, "float16", LAYOUTS | GRADIENTS, **bwd,
                                                           min_blocks=2), "_dkdv")]


def configured(path: Path) -> list[tuple[str, object, str]]:
    """(what, point, kernel suffix) of the attention a configuration's JSON twin runs: the forward's kernel and the
    backward's `_dkdv`."""
    return [("forward", point, "") if isinstance(point, AttentionParams) else ("_dkdv", point, "_dkdv")
            for point in configured_points(json.loads(path.read_text(encoding="utf-8")))]


DROPOUT_SWITCH = "  const bool dropout = threshold != 0ull;"  # the attention templates' one run-time decision


def without_dropout(source: str) -> str:
    """The kernel source with dropout compiled out: its run-time switch made the constant false."""
    if source.count(DROPOUT_SWITCH) != 1:
        sys.exit(f"the source does not decide dropout in one line {DROPOUT_SWITCH.strip()!r}")
    return source.replace(DROPOUT_SWITCH, "  const bool dropout = false;")


def build(point, dropout: bool) -> Cubin:
    """The point's cubin, or one of its source with dropout compiled out."""
    if dropout:
        return point.compile()
    return compile_cubin(without_dropout(point.render(H100)), f"{point.label} [{point.dtype}, no dropout]",
                         point.compile_arch(H100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="bert-large-b8-l512")
    parser.add_argument("--config", type=Path, help="a configuration's JSON twin: count the kernels it runs instead")
    parser.add_argument("--no-dropout", action="store_true", help="count each kernel with dropout compiled out")
    parser.add_argument("--top", type=int, default=14, help="opcodes listed per kernel (default: 14)")
    args = parser.parse_args()
    tool = cuobjdump()
    source = (f"--config {args.config}" if args.config else f"--size {args.size}") + (
        " --no-dropout" if args.no_dropout else "")
    print(f"# scripts/sass_mix.py {source}: per warp and tile of the main loop, static SASS (sm_90)")
    for what, point, suffix in (configured(args.config) if args.config else points(args.size)):
        done = subprocess.run([tool, "-sass", str(build(point, not args.no_dropout).path)], capture_output=True,
                              text=True)
        if done.returncode:  # e.g. no nvdisasm beside it
            sys.exit(f"{tool} failed: {done.stderr.strip()}")
        mix = main_loop(done.stdout, suffix)
        listed = ", ".join(f"{name} {count}" for name, count in mix.most_common(args.top))
        print(f"{what:30s} {sum(mix.values()):5d} instructions: {listed}")


if __name__ == "__main__":
    main()
