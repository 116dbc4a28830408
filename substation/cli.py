"""The `substation` command. Bad input ends in one line on stderr and a non-zero exit, not a traceback."""
from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import json
import os
import sys

from pathlib import Path

from substation.errors import DeviceError, SubstationError
from substation.isolation import DEFAULT_TIMEOUT_S
from substation.sizes import DTYPES, PRESETS, get_size
from substation.version import __version__

DESCRIPTION = ("Substation: choose the layout of every tensor and the implementation of every operator of a BERT "
               "encoder layer from timings on your GPU (profile -> optimize), and inspect what moves the bytes "
               "(analyze, mappings).")

PROFILERS = ("contractions", "kernels")


def _analyze(args: argparse.Namespace) -> None:
    from substation.analysis import operator_costs, plot_shares, totals_by_kind

    size = get_size(args.size, args.dtype)
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise SubstationError(f"--plot {args.plot}: the folder {Path(args.plot).parent} does not exist")
    costs = operator_costs(size)
    totals = totals_by_kind(costs, args.matmul_tflops, args.copy_tbs)
    if args.format == "csv":
        costs.to_csv(sys.stdout, index=False)
    elif args.format == "json":
        json.dump({"size": size.dims(), "dtype": size.dtype,
                   "rates": {"matmul_tflops": args.matmul_tflops, "copy_tbs": args.copy_tbs},
                   "operators": costs.to_dict(orient="records"), "totals": totals.to_dict(orient="records")},
                  sys.stdout, indent=1)
        print()
    else:
        print(f"{args.size} ({size.dtype}): minimum data movement, every input read once, every output written once")
        print(costs.to_string(index=False))
        print(f"\nper kind, at {args.matmul_tflops:g} TFLOP/s matmul and {args.copy_tbs:g} TB/s copy:")
        print(totals.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    if args.plot:
        plot_shares(totals, args.plot, f"{args.size} ({size.dtype})")


def _gpus(spec: str) -> list[int]:
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("profiling needs an NVIDIA GPU, and torch sees none")
    count = torch.cuda.device_count()
    gpus = list(range(count)) if spec == "all" else [int(g) for g in spec.split(",")]
    if not gpus or any(not 0 <= g < count for g in gpus):
        raise DeviceError(f"--gpus {spec!r}: this machine has GPUs 0..{count - 1}")
    return gpus


def _profile(args: argparse.Namespace) -> None:
    gpus = _gpus(args.gpus)
    if importlib.util.find_spec("nvmath") is None:
        raise DeviceError("profiling needs the nvmath package: pip install -e '.[gpu]'")
    size = get_size(args.size)
    out = Path(args.out)
    for only in args.only or PROFILERS:
        if only == "contractions":
            _profile_contractions(size, out, gpus, args)
        else:
            _profile_kernels(size, out, gpus, args)


def _profile_contractions(size, out: Path, gpus: list[int], args: argparse.Namespace) -> None:
    from substation.records import load_records
    from substation.tc_profiling.profiler import plan, run
    from substation.tc_profiling.report import contraction_summary

    work = plan(size)
    print(f"{args.size}: {sum(work.feasible.values())} feasible contraction layouts in {len(work.groups)} "
          f"distinct GEMM calls; {sum(work.infeasible.values())} layouts no single call can execute "
          f"(`substation mappings --infeasible` lists them with the reason); "
          f"{sum(len(g.epilogues) for g in work.epilogues)} layouts of qkv_proj + qkv_bias as one call with "
          f"cuBLASLt's bias epilogue, in {len(work.epilogues)} distinct calls")
    rows = load_records(run(work, size, args.dtype, out, gpus, args.force, args.algorithms, args.runs,
                                   args.timeout))
    for dtype in args.dtype:
        print(f"\ncontractions ({dtype}):")
        print(contraction_summary(rows, dtype).to_string(index=False, float_format=lambda v: f"{v:.2f}"))


def _profile_kernels(size, out: Path, gpus: list[int], args: argparse.Namespace) -> None:
    from substation.kernels.profiler import plan, run
    from substation.kernels.report import kernel_summary
    from substation.records import load_records

    work = plan(size, args.dtype)
    coverage = ", ".join(f"{op} {n}/{total}" for op, (n, total) in work.coverage.items())
    print(f"{args.size}: {len(work.points)} kernel variants; layout combinations profiled/in the space: {coverage}")
    rows = load_records(run(work, size, args.dtype, out, gpus, args.force, args.runs, args.timeout))
    for dtype in args.dtype:
        print(f"\nkernels ({dtype}):")
        print(kernel_summary(rows, size.with_dtype(dtype)).to_string(index=False, float_format=lambda v: f"{v:.2f}"))


def _mappings(args: argparse.Namespace) -> None:
    from substation.graph import layer_graph
    from substation.tc_profiling.mapping import enumerate_mappings

    graph, size = layer_graph(), get_size(args.size)
    dims = {name: spec.dims for name, spec in graph.tensors.items()}
    ops = [graph.operator(name) for name in args.op] if args.op else [o for o in graph.operators if o.is_contraction]
    if args.epilogues:
        from substation.tc_profiling.epilogues import SPLITS

        lacking = [op.name for op in ops if op.name not in {split.contraction for split in SPLITS}]
        if args.op and lacking:
            raise SubstationError(f"--op {' '.join(lacking)}: no bias epilogue covers it; the epilogues cover "
                                  f"{', '.join(f'{s.contraction} + {s.operator}' for s in SPLITS)}")
    out = csv.writer(sys.stdout)
    out.writerow(["op", "layouts", "call_or_reason"])
    for op in ops:
        if not op.is_contraction:
            raise SubstationError(f"{op.name!r} is a fused operator, not a contraction")
        if args.epilogues:
            _epilogue_rows(out, op.name, size, args.infeasible, graph)
            continue
        for m in enumerate_mappings(op, size.extents, dims):
            if (m.call is None) == args.infeasible:
                layouts = " ".join(f"{t}:{lay}" for t, lay in m.layouts)
                detail = m.reason if m.call is None else json.dumps(m.call.options() | {"a": m.a_operand})
                out.writerow([op.name, layouts, detail])


def _epilogue_rows(out, op: str, size, infeasible: bool, graph) -> None:
    """The bias-epilogue covers of `op` (qkv_proj + qkv_bias): each layout assignment's call, or why none."""
    from substation.tc_profiling.epilogues import enumerate_epilogues

    for split, layouts, epilogue in enumerate_epilogues(size.extents, graph):
        if split.contraction != op or isinstance(epilogue, str) != infeasible:
            continue
        if isinstance(epilogue, str):
            out.writerow([f"{op}+{split.operator}", " ".join(f"{t}:{lay}" for t, lay in layouts.items()), epilogue])
        else:
            cand = epilogue.candidate({}, graph)
            out.writerow([f"{op}+{split.operator}", cand.layouts, json.dumps(epilogue.options())])


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="substation", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(commands.add_parser, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    analyze = command("analyze", help="flop and minimum bytes of every operator (CPU)",
                      description="Count the flop of every operator of one layer and the fewest bytes it must move "
                                  "(each input read once, each output written once); totals per kind at the given "
                                  "rates.")
    analyze.add_argument("--size", required=True, help=f"a size preset: {', '.join(PRESETS)}")
    analyze.add_argument("--dtype", default="float16", choices=DTYPES)
    analyze.add_argument("--format", default="table", choices=("table", "csv", "json"),
                         help="table: operators and totals per kind; csv: the operator rows; json: both")
    analyze.add_argument("--plot", metavar="PNG", help="also draw flop share vs byte share per kind")
    analyze.add_argument("--matmul-tflops", type=_positive, default=750.0, help="matmul rate (H100 fp16 measured)")
    analyze.add_argument("--copy-tbs", type=_positive, default=2.97, help="copy bandwidth in TB/s (H100 measured)")
    analyze.set_defaults(run=_analyze)

    profile = command("profile", help="time every layout of every operator on this GPU (GPU)",
                      description="Time every GEMM mapping of every contraction (cuBLASLt, cuBLAS, the bias epilogue) "
                                  "and every variant of every fused kernel and SDPA backend on this GPU, each in an "
                                  "isolated worker process; rows are appended one at a time, so a run resumes.")
    profile.add_argument("--size", required=True, help=f"a size preset: {', '.join(PRESETS)}")
    profile.add_argument("--out", required=True, help="profile directory (contractions.csv, kernels.csv)")
    profile.add_argument("--only", nargs="+", choices=PROFILERS, help="run only these profilers")
    profile.add_argument("--dtype", nargs="+", default=["float16"], choices=("float16", "bfloat16"))
    profile.add_argument("--gpus", default="0", help="'all', or a comma-separated list of GPU indices")
    profile.add_argument("--algorithms", type=int, default=4, help="cuBLASLt heuristic algorithms timed per call")
    profile.add_argument("--runs", type=int, default=25, help="timed runs per candidate (after 5 warm-up runs)")
    profile.add_argument("--force", action="store_true", help="start a new file where the old one is of "
                         "another size or GPU")
    profile.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT_S, help="seconds one candidate may "
                         "take before its worker process is killed and the candidate recorded as failed")
    profile.set_defaults(run=_profile)

    from substation.config_selection.cli import add_parser as add_optimize

    add_optimize(commands)

    mappings = command("mappings", help="the GEMM call of every contraction layout, or why none (CPU)",
                       description="List, as CSV, the strided-batched GEMM call of every layout assignment of the "
                                   "contractions, or why one call cannot execute it.")
    mappings.add_argument("--size", required=True, help=f"a size preset: {', '.join(PRESETS)}")
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
