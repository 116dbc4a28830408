"""The `substation` command. Bad input ends in one line on stderr and a non-zero exit, not a traceback."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from substation.errors import DeviceError, SizeError, SubstationError
from substation.isolation import DEFAULT_TIMEOUT_S
from substation.sizes import DTYPES, SIZE_SPEC_HELP, Size, get_size, size_name
from substation.version import __version__

DESCRIPTION = ("Substation: choose the layout of every tensor and the implementation of every operator of a BERT "
               "encoder layer from timings on your GPU (profile -> optimize), and inspect what moves the bytes "
               "(analyze, mappings).")

PROFILERS = ("contractions", "kernels")


def _sizes(specs: list[str], dtype: str | None = None) -> dict[str, Size]:
    """`--size`'s specs by the name of their size, each size once (SizeError names a bad spec)."""
    sizes: dict[str, Size] = {}
    for spec in specs:
        size = get_size(spec, dtype)
        if size_name(size) in sizes:
            raise SizeError(f"--size names {size_name(size)} twice")
        sizes[size_name(size)] = size
    return sizes


def _one_size(specs: list[str], why: str) -> None:
    """Refuse several sizes where an option makes one result of one size."""
    if len(specs) > 1:
        raise SubstationError(f"{why}; give one --size with it ({len(specs)} given)")


def _analyze(args: argparse.Namespace) -> None:
    import pandas as pd

    from substation.analysis import operator_costs, plot_shares, totals_by_kind

    sizes = _sizes(args.size, args.dtype)
    if args.plot:
        _one_size(args.size, f"--plot {args.plot} draws one size's shares")
        if not Path(args.plot).resolve().parent.is_dir():
            raise SubstationError(f"--plot {args.plot}: the folder {Path(args.plot).parent} does not exist")
    rates = {"matmul_tflops": args.matmul_tflops, "copy_tbs": args.copy_tbs}
    costs = {name: operator_costs(size) for name, size in sizes.items()}
    totals = {name: totals_by_kind(costs[name], **rates) for name in sizes}
    if args.format == "csv":  # with several sizes, one table whose rows start with their size's name
        frames = [frame.assign(size=name)[["size", *frame.columns]] if len(sizes) > 1 else frame
                  for name, frame in costs.items()]
        pd.concat(frames).to_csv(sys.stdout, index=False)
    elif args.format == "json":  # with several sizes, a list of the one-size objects
        reports = [{"size": size.dims(), "dtype": size.dtype, "rates": rates,
                    "operators": costs[name].to_dict(orient="records"),
                    "totals": totals[name].to_dict(orient="records")} for name, size in sizes.items()]
        json.dump(reports[0] if len(reports) == 1 else reports, sys.stdout, indent=1)
        print()
    else:
        blocks = [f"{name} ({size.dtype}): minimum data movement, every input read once, every output written once\n"
                  f"{costs[name].to_string(index=False)}\n\n"
                  f"per kind, at {args.matmul_tflops:g} TFLOP/s matmul and {args.copy_tbs:g} TB/s copy:\n"
                  f"{totals[name].to_string(index=False, float_format=lambda v: f'{v:.1f}')}"
                  for name, size in sizes.items()]
        print("\n\n".join(blocks))
    if args.plot:
        ((name, size),) = sizes.items()
        plot_shares(totals[name], args.plot, f"{name} ({size.dtype})")


def _gpus(spec: str) -> list[int]:
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("profiling needs an NVIDIA GPU, and torch sees none")
    count = torch.cuda.device_count()
    gpus = list(range(count)) if spec == "all" else [int(g) for g in spec.split(",")]
    if not gpus or any(not 0 <= g < count for g in gpus):
        raise DeviceError(f"--gpus {spec!r}: this machine has GPUs 0..{count - 1}")
    return gpus


def _profile_root(out: str) -> Path:
    """`--out`: the folder of one profile directory per size. A folder that is itself a profile (one size's files
    straight in it, as before several sizes) is refused: rows there would not be resumed."""
    from substation.config_selection.profiles import PROFILE_FILES

    root = Path(out)
    held = [name for name in PROFILE_FILES if (root / name).is_file() or (root / f"{name}.gz").is_file()]
    if held:
        raise SubstationError(f"--out {out} is itself a profile ({', '.join(held)}); profile writes one directory "
                              f"per size under --out, {out}/<size name>/: move its files there to resume them")
    return root


def _profile(args: argparse.Namespace) -> None:
    from substation.records import profile_dir_name

    sizes, root = _sizes(args.size), _profile_root(args.out)
    _check_kernel_ops(args.ops)
    if args.compile_only:
        for name, size in sizes.items():
            if "kernels" in (args.only or PROFILERS):
                _compile_kernel_points(name, size, args)
            else:
                print(f"{name}: nothing to build (the contractions are library calls)")
        return
    gpus = _gpus(args.gpus)
    if importlib.util.find_spec("nvmath") is None:
        raise DeviceError("profiling needs the nvmath package: pip install -e '.[gpu]'")
    for name, size in sizes.items():
        out = root / profile_dir_name(name, args.dropout)  # as layouts/profiles/h100/<preset>
        reused = _reused_contractions(root / name, out)
        for only in args.only or PROFILERS:
            if only == "kernels":
                _profile_kernels(name, size, out, gpus, args)
            elif not reused:
                _profile_contractions(name, size, out, gpus, args)


def _compile_kernel_points(name: str, size: Size, args: argparse.Namespace) -> None:
    """`profile --compile-only`: every kernel the kernel profiler would time at `size` (our fused kernels, the fused
    attention, the GEMMs with our epilogues; the contractions are library calls, nothing to build) into the disk
    cache, for this machine's GPU or the H100 where there is none."""
    import time

    from substation.device import DeviceSpec
    from substation.jit import cache_dir, nvcc
    from substation.kernels.profiler import compile_all, plan

    spec = DeviceSpec.build_target()
    work = plan(size, args.dtype, ops=args.ops, dropout=args.dropout)
    kernels = [*work.attention_kernels, *work.points, *work.gemm_epilogues]
    start = time.perf_counter()
    fresh = sum(not built.cached for built in compile_all(kernels, spec))
    print(f"{name}: {len(kernels)} kernels for {spec.arch}: {fresh} compiled, {len(kernels) - fresh} from the cache, "
          f"in {time.perf_counter() - start:.0f} s ({cache_dir()}; {nvcc()[1]})")


def _reused_contractions(default_dir: Path, out: Path) -> bool:
    """At another dropout than the default (another directory), the size's default profile's GEMM rows serve (they
    have no dropout), whichever profilers run."""
    from substation.tc_profiling.profiler import reuse_rows

    copy = reuse_rows(default_dir, out) if default_dir != out else None
    if copy is not None:
        print(f"{out.name}: the GEMM rows of {default_dir} copied to {copy} (they do not depend on dropout)")
    return copy is not None


def _profile_contractions(name: str, size: Size, out: Path, gpus: list[int], args: argparse.Namespace) -> None:
    from substation.records import load_records
    from substation.tc_profiling.profiler import plan, run
    from substation.tc_profiling.report import contraction_summary

    work = plan(size)
    print(f"{name}: {sum(work.feasible.values())} feasible contraction layouts in {len(work.groups)} "
          f"distinct GEMM calls; {sum(work.infeasible.values())} layouts no single call can execute "
          f"(`substation mappings --infeasible` lists them with the reason); "
          f"{sum(len(g.epilogues) for g in work.epilogues)} layouts of qkv_proj + qkv_bias as one call with "
          f"cuBLASLt's bias epilogue, in {len(work.epilogues)} distinct calls")
    rows = load_records(run(work, size, args.dtype, out, gpus, args.force, args.algorithms, args.runs,
                                   args.timeout))
    for dtype in args.dtype:
        print(f"\ncontractions ({dtype}):")
        print(contraction_summary(rows, dtype).to_string(index=False, float_format=lambda v: f"{v:.2f}"))


def _profile_kernels(name: str, size: Size, out: Path, gpus: list[int], args: argparse.Namespace) -> None:
    from substation.kernels.profiler import plan, run
    from substation.kernels.report import attention_summary, kernel_summary
    from substation.records import load_records

    work = plan(size, args.dtype, ops=args.ops, dropout=args.dropout)
    coverage = ", ".join(f"{op} {n}/{total}" for op, (n, total) in work.coverage.items())
    print(f"{name}: {len(work.points)} kernel variants; layout combinations profiled/in the space: {coverage}")
    rows = load_records(run(work, size, args.dtype, out, gpus, args.force, args.runs, args.timeout, args.dropout))
    for dtype in args.dtype:
        print(f"\nkernels ({dtype}, dropout {args.dropout:g}):")
        print(kernel_summary(rows, size.with_dtype(dtype)).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        attention = attention_summary(rows, size.with_dtype(dtype))
        if len(attention):
            print(f"\nattention ({dtype}):")
            print(attention.to_string(index=False, float_format=lambda v: f"{v:.2f}"))


def _check_kernel_ops(names: list[str] | None) -> None:
    """`--ops` names operators the kernel profiler times: the fused operators and the attention's."""
    if not names:
        return
    from substation.graph import layer_graph
    from substation.kernels import sdpa
    from substation.kernels.gemm_epilogue import FUSIONS

    timed = [op.name for op in layer_graph().operators if not op.is_contraction]
    timed += [name for name in sdpa.FORWARD_COVERS + sdpa.BACKWARD_COVERS if name not in timed]
    unknown = sorted(set(names) - set(timed))
    if unknown:
        # a GEMM with our epilogue is profiled as the operator its epilogue absorbs
        absorbed = {fusion.covers[0]: fusion.covers[1] for fusion in FUSIONS}
        hints = "".join(f"; {name} with our epilogue is timed as --ops {absorbed[name]}"
                        for name in unknown if name in absorbed)
        raise SubstationError(f"--ops {' '.join(unknown)}: the kernel profiler times only {', '.join(timed)}{hints}")


def _mappings(args: argparse.Namespace) -> None:
    from substation.graph import layer_graph

    graph, sizes = layer_graph(), _sizes(args.size)
    ops = [graph.operator(name) for name in args.op] if args.op else [o for o in graph.operators if o.is_contraction]
    for op in ops:
        if not op.is_contraction:
            raise SubstationError(f"{op.name!r} is a fused operator, not a contraction")
    if args.epilogues:
        from substation.tc_profiling.epilogues import SPLITS

        lacking = [op.name for op in ops if op.name not in {split.contraction for split in SPLITS}]
        if args.op and lacking:
            raise SubstationError(f"--op {' '.join(lacking)}: no bias epilogue covers it; the epilogues cover "
                                  f"{', '.join(f'{s.contraction} + {s.operator}' for s in SPLITS)}")
    out = csv.writer(sys.stdout)
    out.writerow(["size"] * (len(sizes) > 1) + ["op", "layouts", "call_or_reason"])
    for name, size in sizes.items():  # with several sizes, each row starts with its size's name
        lead = [name] * (len(sizes) > 1)
        rows = _epilogue_rows if args.epilogues else _mapping_rows
        out.writerows(lead + row for op in ops for row in rows(op.name, size, args.infeasible, graph))


def _mapping_rows(op: str, size: Size, infeasible: bool, graph) -> Iterator[list[str]]:
    """The GEMM call of each layout assignment of contraction `op` (infeasible: why none, for those without)."""
    from substation.tc_profiling.mapping import enumerate_mappings

    dims = {name: spec.dims for name, spec in graph.tensors.items()}
    for m in enumerate_mappings(graph.operator(op), size.extents, dims):
        if (m.call is None) == infeasible:
            layouts = " ".join(f"{t}:{lay}" for t, lay in m.layouts)
            yield [op, layouts, m.reason if m.call is None else json.dumps(m.call.options() | {"a": m.a_operand})]


def positive_integer(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _configuration_paths(given: list[str], device_name: str) -> list[str]:
    """The configuration files named, the word "shipped" standing for every configuration shipped for this GPU
    (`substation.shipped.shipped_for`: what `inject(model)` may choose)."""
    from substation.shipped import SHIPPED, shipped_for

    paths = []
    for name in given:
        paths += [str(s.path) for s in shipped_for(device_name)] if name == SHIPPED else [name]
    return list(dict.fromkeys(paths))


def _compile(args: argparse.Namespace) -> None:
    import time

    from tqdm import tqdm

    from substation.config_file import configuration_sizes, load_configuration, to_configuration
    from substation.device import DeviceSpec
    from substation.jit import cache_dir
    from substation.lengths import padded_length
    from substation.runtime import build, choices_at_size, chosen_kernels, file_choices, padded_batch_choices

    spec = DeviceSpec.build_target()
    rows = []  # (configuration, size, what it binds there)
    for path in _configuration_paths(args.configurations, spec.name):
        data = load_configuration(path)
        config, choices = to_configuration(data), file_choices(data)
        own = [size for size, _ in configuration_sizes(data)]
        more = list(_sizes(args.size or []).values())
        if args.length_multiple:  # every padded length up to each size's L, at its B
            more += [dataclasses.replace(size, L=length) for size in own + more
                     for length in range(args.length_multiple, padded_length(size.L, args.length_multiple) + 1,
                                         args.length_multiple)]
            more = list({(size.B, size.L): size for size in more}.values())
        for size in more:
            if (size.H, size.P, size.U) != (own[0].H, own[0].P, own[0].U):
                raise SubstationError(f"{path} is a configuration for H={own[0].H}, P={own[0].P}, U={own[0].U}; "
                                      f"--size {size_name(size)} has H={size.H}, P={size.P}, U={size.U}")
        for size in own + [size for size in more if (size.B, size.L) not in {(s.B, s.L) for s in own}]:
            for dtype in args.dtype or [str(data["dtype"])]:
                at = size.with_dtype(dtype)
                with warnings.catch_warnings(record=True) as notes:  # a fallback at this size: one line each
                    warnings.simplefilter("always")
                    resized = choices if (size.B, size.L) == (own[0].B, own[0].L) else choices_at_size(
                        choices, config, at)
                for note in notes:
                    print(f"note: {size_name(at)}: {note.message}", file=sys.stderr)
                bound = chosen_kernels(resized, config, at, spec=spec)
                if args.length_multiple:  # such an Encoder runs the padded-batch variants (Encoder.padded_batches)
                    bound += chosen_kernels(padded_batch_choices(resized, config, at), config, at, spec=spec)
                rows.append((path, at, list(dict.fromkeys(bound))))
    kernels = [kernel for *_, bound in rows for kernel in bound]
    start = time.perf_counter()
    with tqdm(total=len(set(kernels)), desc="nvcc", leave=False, disable=None) as bar:  # all rows' kernels at once
        fresh = build(kernels, spec, bar.update)
    print(f"{len(fresh)} kernels for {spec.name} ({spec.arch}), {sum(fresh.values())} compiled, in "
          f"{time.perf_counter() - start:.1f} s, into {cache_dir()}")
    table = [("configuration", "size", "dtype", "kernels", "compiled")]
    table += [(str(path), size_name(at), at.dtype, str(len(bound)), str(sum(fresh[k] for k in bound)))
              for path, at, bound in rows]
    widths = [max(len(row[column]) for row in table) for column in range(5)]  # as wide as the longest cell
    for row in table:  # names to the left, counts to the right
        print(" ".join([*(cell.ljust(w) for cell, w in zip(row[:3], widths)),
                        *(cell.rjust(w) for cell, w in zip(row[3:], widths[3:]))]))


def _epilogue_rows(op: str, size: Size, infeasible: bool, graph) -> Iterator[list[str]]:
    """The bias-epilogue covers of `op` (qkv_proj + qkv_bias): each layout assignment's call, or why none."""
    from substation.tc_profiling.epilogues import enumerate_epilogues

    for split, layouts, epilogue in enumerate_epilogues(size.extents, graph):
        if split.contraction != op or isinstance(epilogue, str) != infeasible:
            continue
        if isinstance(epilogue, str):
            yield [f"{op}+{split.operator}", " ".join(f"{t}:{lay}" for t, lay in layouts.items()), epilogue]
        else:
            cand = epilogue.candidate({}, graph)
            yield [f"{op}+{split.operator}", cand.layouts, json.dumps(epilogue.options())]


def _add_sizes(parser: argparse.ArgumentParser, several: str) -> None:
    """`--size SIZE [SIZE ...]`, the same on every command; `several` says what several sizes give."""
    parser.add_argument("--size", required=True, nargs="+", metavar="SIZE",
                        help=f"one or more sizes, e.g. --size bert-large-b8-l512 bert-large-b8-l512:B=16,L=384 "
                             f"({several}); each {SIZE_SPEC_HELP}")


def build_parser() -> argparse.ArgumentParser:
    from substation.config_selection.cli import HelpFormatter, add_parser as add_optimize, positive_number, probability
    from substation.records import DEFAULT_DROPOUT

    positive = positive_number("a positive finite number")
    parser = argparse.ArgumentParser(prog="substation", description=DESCRIPTION,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(commands.add_parser, formatter_class=HelpFormatter)
    analyze = command("analyze", help="flop and minimum bytes of every operator (CPU)",
                      description="Count the flop of every operator of one layer and the fewest bytes it must move "
                                  "(each input read once, each output written once); totals per kind at the given "
                                  "rates.")
    _add_sizes(analyze, "several: a table per size, CSV rows led by their size's name, a JSON list; --plot "
                        "takes one")
    analyze.add_argument("--dtype", default="float16", choices=DTYPES)
    analyze.add_argument("--format", default="table", choices=("table", "csv", "json"),
                         help="table: operators and totals per kind; csv: the operator rows; json: both")
    analyze.add_argument("--plot", metavar="PNG", help="also draw flop share vs byte share per kind")
    analyze.add_argument("--matmul-tflops", type=positive, default=750.0, help="matmul rate (H100 fp16 measured)")
    analyze.add_argument("--copy-tbs", type=positive, default=2.97, help="copy bandwidth in TB/s (H100 measured)")
    analyze.set_defaults(run=_analyze)

    profile = command("profile", help="time every layout of every operator on this GPU (GPU)",
                      description="Time every GEMM mapping of every contraction (cuBLASLt, cuBLAS, the bias epilogue) "
                                  "and every variant of every fused kernel and SDPA backend on this GPU, each in an "
                                  "isolated worker process; rows are appended one at a time, so a run resumes.")
    _add_sizes(profile, "several: profiled in turn, each into its own directory under --out")
    profile.add_argument("--out", required=True, metavar="DIR", help="the profiles' folder: each size's "
                         "contractions.csv and kernels.csv go to DIR/<size name>/ (bert-large-b8-l512, "
                         "b16-l384-h16-p64-u4096), the directory `substation optimize` reads")
    profile.add_argument("--only", nargs="+", choices=PROFILERS, help="run only these profilers")
    profile.add_argument("--ops", nargs="+", metavar="OP",
                         help="kernel profiler: only these fused operators (and the attention backends and kernels "
                         "where one of the attention's operators is named, the GEMMs with our epilogues where an "
                         "operator they absorb is named); with the rows already in the profile "
                         "skipped, this adds new implementations' rows to an existing profile (a shipped "
                         "kernels.csv.gz is unpacked into kernels.csv first)")
    profile.add_argument("--dtype", nargs="+", default=["float16"], choices=("float16", "bfloat16"))
    profile.add_argument("--gpus", default="0", help="'all', or a comma-separated list of GPU indices")
    profile.add_argument("--algorithms", type=int, default=4, help="cuBLASLt heuristic algorithms timed per call")
    profile.add_argument("--runs", type=int, default=25, help="timed runs per candidate (after 5 warm-up runs)")
    profile.add_argument("--dropout", type=probability, default=DEFAULT_DROPOUT, help="the dropout probability the "
                         "kernel profiler runs every candidate with (the layer's attention and hidden dropout; "
                         "default %(default)s, BERT's). Another than the default goes to DIR/<size name>-dropout<P>/, "
                         "with a copy of DIR/<size name>/'s GEMM rows where that profile has them (they do not "
                         "depend on dropout)")
    profile.add_argument("--compile-only", action="store_true", help="build every kernel the kernel profiler would "
                         "time into the disk cache ($SUBSTATION_CACHE) and time nothing (nvcc, no GPU; for the H100 "
                         "where there is none): a cache carried to the GPU machine serves it where its nvcc is the "
                         "same build (the version is part of every cache key)")
    profile.add_argument("--force", action="store_true", help="start a new file where the old one is of "
                         "another size, GPU or dropout")
    profile.add_argument("--timeout", type=positive, default=DEFAULT_TIMEOUT_S, help="seconds one candidate may "
                         "take before its worker process is killed and the candidate recorded as failed")
    profile.set_defaults(run=_profile)

    add_optimize(commands)

    compile_ = command("compile", help="build the kernels of configurations into the disk cache (nvcc, no GPU)",
                       description="Build every kernel that configuration files bind (our fused kernels, the fused "
                                   "attention, the GEMMs with our epilogues) at their sizes and at --size's, into "
                                   "the disk cache ($SUBSTATION_CACHE, else ~/.cache/substation), one nvcc per core: "
                                   "an Encoder's first step then finds them there instead of spending minutes in "
                                   "nvcc. For this machine's GPU, or the H100 (sm_90) where there is none.")
    compile_.add_argument("configurations", nargs="+", metavar="CONFIG", help="layouts pickles or their JSON twins; "
                          "'shipped': every configuration shipped for this GPU (what inject(model) "
                          "chooses from)")
    compile_.add_argument("--size", nargs="+", metavar="SIZE", help=f"more sizes to build for (B and L; H, P and U "
                          f"must be the configuration's); each {SIZE_SPEC_HELP}")
    compile_.add_argument("--dtype", nargs="+", choices=("float16", "bfloat16"),
                          help="the dtypes to build for (default: the configuration's)")
    compile_.add_argument("--length-multiple", type=positive_integer, metavar="N",
                          help="also every length an Encoder with length_multiple=N runs: N, 2N, ... up to each "
                               "size's L, at its B, and at every size the variants it runs for padded batches "
                               "(Encoder's padded_batches, on with length_multiple)")
    compile_.set_defaults(run=_compile)

    mappings = command("mappings", help="the GEMM call of every contraction layout, or why none (CPU)",
                       description="List, as CSV, the strided-batched GEMM call of every layout assignment of the "
                                   "contractions, or why one call cannot execute it.")
    _add_sizes(mappings, "several: one CSV, each row led by its size's name")
    mappings.add_argument("--op", nargs="+", help="contractions to list (default: all)")
    mappings.add_argument("--infeasible", action="store_true", help="list the layouts no single call executes")
    mappings.add_argument("--epilogues", action="store_true", help="list the cuBLASLt bias-epilogue covers "
                          "(qkv_proj + qkv_bias) instead")
    mappings.set_defaults(run=_mappings)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except SubstationError as error:
        print(f"substation {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (`substation mappings ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt:  # rows are flushed one at a time: a profile resumes where it stopped
        print(f"substation {args.command}: interrupted; nothing half-written is left (a profile resumes where it "
              "stopped)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
