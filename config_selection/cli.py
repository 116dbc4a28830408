"""`substation optimize PROFILE_DIR [PROFILE_DIR ...] [--weights W ...] --graph_order ... -o layouts/NAME.pickle`:
the optimizer's subcommand.

`add_parser(subcommands)` registers it on `substation.cli`'s subparsers; bad input raises a SubstationError
subclass, which `substation.cli.main` prints as one line (exit status 2).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from substation.config_selection import GRAPH_ORDERS, SOLVERS
from substation.errors import ConfigurationFileError, SelectionError
from substation.sizes import DTYPES


def number_in(what: str, inside: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a number for which `inside` holds, else `must be {what}` (argparse names the option)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not inside(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


def positive_number(what: str) -> Callable[[str], float]:
    """An argparse type: a positive finite number, else `must be {what}`."""
    return number_in(what, lambda value: 0 < value < math.inf)


probability = number_in("a probability in [0, 1)", lambda value: 0 <= value < 1)  # as dropout takes


def _check_arguments(args: argparse.Namespace, graph) -> None:
    """What needs no profile: the output path, the weights and the split variables, each refused in one line."""
    from substation.config_selection.orders import check_split_vars  # pulp: only once optimize runs

    output = Path(args.output)
    if output.suffix != ".pickle":
        raise ConfigurationFileError(f"-o {args.output}: expected a path ending in .pickle (the .json twin is "
                                     "written beside it)")
    for path in (output, output.with_suffix(".json")):
        if path.is_dir():
            raise ConfigurationFileError(f"-o {args.output}: {path} is a directory; name a file")
    if args.weights is not None and len(args.weights) != len(args.profile_dirs):
        raise SelectionError(f"--weights gives {len(args.weights)} weights for {len(args.profile_dirs)} profile "
                             "directories: give one per PROFILE_DIR")
    repeated = sorted({t for t in args.split_vars or () if args.split_vars.count(t) > 1})
    if repeated:
        raise SelectionError(f"--split_vars names {', '.join(repeated)} more than once")
    check_split_vars(graph, args.split_vars)


def run_optimize(args: argparse.Namespace) -> None:
    """Load the profiles (several: combined over their sizes), solve with the chosen graph order, print the table,
    write the pickle and JSON twin."""
    from substation.config_selection.config_file import deterministic, write_configuration
    from substation.config_selection.ilp import SolverOptions
    from substation.config_selection.multisize import combine_profiles, for_sizes, format_sizes
    from substation.config_selection.orders import SelectOptions, optimize
    from substation.config_selection.profiles import load_profile
    from substation.config_selection.selection import format_report
    from substation.graph import layer_graph

    graph = layer_graph()
    _check_arguments(args, graph)  # before the profile loads: seconds on the shipped ones
    profiles = [load_profile(directory, graph, dtype=args.dtype) for directory in args.profile_dirs]
    combined = combine_profiles(profiles, args.weights or [1.0] * len(profiles), graph)
    split_vars = None if args.split_vars is None else tuple(args.split_vars)
    options = SelectOptions(split_vars=split_vars, free_user_layouts=args.free_user_layouts,
                            solver=SolverOptions(solver=args.solver, time_limit_s=args.time_limit),
                            padding_mask=not args.no_padding_mask, exclude_impls=tuple(args.exclude_impls or ()),
                            nondeterministic=args.nondeterministic)
    sizes = for_sizes(optimize(combined.profile, graph, args.graph_order, options), combined, graph)
    print(format_report(sizes[0].selection))
    if len(sizes) > 1:
        print(format_sizes(sizes, combined.dropped))
    if not deterministic(sizes[0].selection):
        print("not deterministic: a chosen row adds up by float atomics (--nondeterministic), so gradients may "
              "differ in their last bits from run to run")
    pickle_path, json_path = write_configuration(sizes[0].selection, args.output, sizes)
    print(f"wrote {pickle_path} and {json_path}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help where there is one to show: not for flags (False) or options without one (None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_parser(subcommands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `optimize` on the `substation` command's subparsers (its `run` default is `run_optimize`)."""
    parser = subcommands.add_parser(
        "optimize", formatter_class=HelpFormatter, help="choose a layout per tensor and an implementation per operator from a profile (CPU)",
        description="Solve the selection ILP over a profile directory (contractions.csv and/or kernels.csv), or "
                    "over several of one layer at different batch sizes and lengths for one configuration that "
                    "minimizes the weighted sum of the layer's times, and write the configuration as a pickle and "
                    "its .json twin.")
    parser.add_argument("profile_dirs", metavar="PROFILE_DIR", nargs="+",
                        help="a directory with contractions.csv and/or kernels.csv (`substation profile --out DIR` "
                             "writes DIR/<size name>/); several: the same H, P, U, dtype and GPU at other B and L, "
                             "the first being the configuration's own size (its GEMM calls)")
    parser.add_argument("--weights", nargs="+", type=positive_number("a positive finite number"), metavar="W",
                        help="one weight per PROFILE_DIR in the weighted sum, e.g. the share of steps at each "
                             "size; none given: 1 each")
    parser.add_argument("--graph_order", "--graph-order", dest="graph_order", choices=GRAPH_ORDERS, default="combined",
                        help="combined: one ILP; bp_first / fp_first: one pass first, its shared layouts fixed, then "
                             "the other")
    parser.add_argument("--split_vars", "--split-vars", dest="split_vars", nargs="+", default=None, metavar="T",
                        help="only these forward activations may take another layout in the backward (a transpose "
                             "is paid); without it any may, where the ILP finds a conversion pays or is needed")
    parser.add_argument("--solver", choices=SOLVERS, default="highs", help="HiGHS (highspy, default) or CBC")
    parser.add_argument("--time-limit", "--time_limit", dest="time_limit", default=60.0, metavar="S",
                        type=positive_number("a positive number of seconds"),
                        help="wall-clock limit of all ILPs of the run, in seconds (default 60); a time-limited "
                             "answer is reported as not proven optimal")
    parser.add_argument("--free-user-layouts", "--free_user_layouts", dest="free_user_layouts", action="store_true",
                        help="let X, Y, dX, dY take any layout (default: PyTorch's [B, L, I])")
    parser.add_argument("--no-padding-mask", "--no_padding_mask", dest="no_padding_mask", action="store_true",
                        help="the layer is never called with a padding mask: also consider rows that take none "
                             "(SDPA flash, with --nondeterministic; flash-attn-4); the configuration then refuses a "
                             "mask")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="also consider rows whose gradients may differ in their last bits from run to run "
                             "(float atomics: our attention backward's fuse_dq=4, PyTorch's SDPA backwards); such a "
                             "configuration's backward then raises under torch.use_deterministic_algorithms(True) "
                             "(SDPA's: takes PyTorch's slower deterministic path)")
    parser.add_argument("--exclude-impl", "--exclude_impl", dest="exclude_impls", nargs="+", metavar="IMPL",
                        help="leave these implementations' rows out, e.g. torch: PyTorch's matmul writes no float32 "
                             "weight gradient for float32 weights under autocast, so an ILP tie it wins costs a cast "
                             "there")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the rows of this dtype (default: the profile's only dtype, or float16 among several)")
    parser.add_argument("-o", "--output", required=True, metavar="PICKLE",
                        help="layouts/NAME.pickle; NAME.json is written beside it")
    parser.set_defaults(run=run_optimize)
    return parser
