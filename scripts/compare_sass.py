#!/usr/bin/env python3
"""Which kernels' machine code a change alters, without a GPU: every variant the profiler would time of the fused
kernel families (softmax, LayerNorm, elementwise) and of our attention (forward; backward apart and stacked), in
canonical layouts at each size, is rendered and compiled for sm_90 in this working tree and at a git revision, and
the SASS of each kernel compared (cuobjdump, addresses and encodings stripped).

A refactor of a template or of the Python that renders it is proved a no-op where the machine code is the same
byte for byte; where it differs, the opcode counts that changed are printed (the backward kernels are issue-bound,
so instruction counts are a first proxy for their time). Variants only one side has (new knobs) are counted apart.

    python scripts/compare_sass.py --base main [--families layernorm attention] [--sizes bert-large-b8-l512]

Needs nvcc and cuobjdump (CUDA's bin folder, or the copy Triton ships); no GPU.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = ("bert-large-b8-l512", "bert-large-b96-l128")
FAMILIES = ("softmax", "layernorm", "elementwise", "attention")
# An instruction line's opcode (its address comment, where not stripped, and its predicate skipped).
OPCODE = re.compile(r"^\s+(?:/\*[0-9a-f]{4,}\*/\s+)?(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?=[ .;])", re.M)


def cuobjdump() -> str:
    """cuobjdump from PATH, CUDA's bin folder or Triton's bundled tools."""
    found = shutil.which("cuobjdump") or next((str(p) for p in (
        Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump",
        *(Path(p) / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump" for p in sys.path)) if p.is_file()), None)
    if found is None:
        raise SystemExit("cuobjdump was not found (PATH, $CUDA_HOME/bin, or Triton's nvidia backend)")
    return found


def import_tree(root: Path) -> None:
    """Import `substation` from `root` with its stage folders as subpackages (as setup.py maps them), not from the
    installed (editable) copy, so that a revision's worktree renders its own templates."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    spec = importlib.util.spec_from_file_location("substation", root / "substation" / "__init__.py",
                                                  submodule_search_locations=[str(root / "substation"), str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["substation"] = module
    spec.loader.exec_module(module)


def points(families: list[str], sizes: list[str], dtype: str) -> list:
    """Every variant of `families` in canonical layouts at `sizes` (the attention's backward apart and stacked)."""
    from substation.graph import layer_graph
    from substation.kernels import attention
    from substation.kernels.registry import registry
    from substation.sizes import get_size

    graph, found = layer_graph(), []
    for name in sizes:
        size = get_size(name).with_dtype(dtype)
        for op, module in registry().items():
            if module.__name__.rsplit(".", 1)[-1] in families:
                operator = graph.operator(op)
                layouts = {t: graph.tensors[t].dims for t in operator.inputs + operator.outputs}
                found += module.variants(op, size, dtype, layouts)
        if "attention" in families:
            dims = {t: attention.tensor_dims(t) for t in
                    ("Q", "K", "V", "M", "Z", "dZ") + attention.BWD_OUTPUTS + attention.STACKED_OUTPUTS}
            found += attention.variants(size, dtype, {t: dims[t] for t in ("Q", "K", "V", "M", "Z")})
            inputs = {t: dims[t] for t in ("Q", "K", "V", "M", "Z", "dZ")}
            for outputs in (attention.BWD_OUTPUTS, attention.STACKED_OUTPUTS):
                found += attention.backward_variants(size, dtype, inputs | {t: dims[t] for t in outputs})
    return found


def dump(root: Path, out: Path, families: list[str], sizes: list[str], dtype: str, jobs: int) -> None:
    """Each point's SASS into `out`, keyed by its label, dtype and size (index.json: key -> file)."""
    import_tree(root)
    tool = cuobjdump()
    found = points(families, sizes, dtype)

    def one(item: tuple[int, object]) -> tuple[str, str]:
        number, params = item
        sass = subprocess.run([tool, "-sass", str(params.compile().path)], capture_output=True, text=True,
                              check=True).stdout
        sass = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", re.sub(r"/\*[0-9a-f]{4,}\*/", "", sass))
        (out / f"{number}.sass").write_text(sass)
        sizes_ = {f: getattr(params, f) for f in params.size_fields()}
        return f"{params.label} {params.dtype} {sizes_}", f"{number}.sass"

    with ThreadPoolExecutor(jobs) as pool:
        index = dict(pool.map(one, enumerate(found)))
    (out / "index.json").write_text(json.dumps(index, indent=0))


def opcodes(sass: str) -> collections.Counter:
    return collections.Counter(OPCODE.findall(sass))


def compare(base: Path, head: Path) -> int:
    """Prints what differs; the number of kernels whose machine code changed."""
    old, new = (json.loads((d / "index.json").read_text()) for d in (base, head))
    both = sorted(old.keys() & new.keys())
    changed = [k for k in both if (base / old[k]).read_text() != (head / new[k]).read_text()]
    print(f"{len(both)} variants on both sides: {len(both) - len(changed)} with the same machine code, "
          f"{len(changed)} changed; {len(new.keys() - old.keys())} only here, {len(old.keys() - new.keys())} only at "
          f"the base")
    for key in changed:
        a, b = opcodes((base / old[key]).read_text()), opcodes((head / new[key]).read_text())
        delta = {op: b[op] - a[op] for op in sorted(a.keys() | b.keys()) if a[op] != b[op]}
        print(f"  {key}\n    instructions {sum(a.values())} -> {sum(b.values())}: {delta}")
    return len(changed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare this working tree against")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help="presets or size specs")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="nvcc processes at once")
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)  # one side's dump, in its own process
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dump:
        dump(args.root, args.dump, args.families, args.sizes, args.dtype, args.jobs)
        return 0
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"],
                      capture_output=True).returncode:
        parser.error(f"--base {args.base}: not a commit of this repository")
    cuobjdump()  # its absence said before anything compiles
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        tree = scratch / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.base], check=True)
        try:
            # One kernel cache for both sides (its keys hold the rendered source), none of the user's.
            env = os.environ | {"SUBSTATION_CACHE": str(scratch / "cache")}
            for side, root in (("base", tree), ("head", ROOT)):
                (scratch / f"{side}-sass").mkdir()
                subprocess.run([sys.executable, __file__, "--dump", str(scratch / f"{side}-sass"), "--root", str(root),
                                "--families", *args.families, "--sizes", *args.sizes, "--dtype", args.dtype,
                                "--jobs", str(args.jobs)], check=True, env=env, cwd=scratch)
            compare(scratch / "base-sass", scratch / "head-sass")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
