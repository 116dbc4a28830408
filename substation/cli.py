"""The `substation` command. Bad input ends in one line on stderr and a non-zero exit, not a traceback."""
from __future__ import annotations

import argparse
import json
import sys

from substation.errors import SubstationError
from substation.sizes import DTYPES, PRESETS, get_size


def _analyze(args: argparse.Namespace) -> None:
    from substation.analysis import operator_costs, plot_shares, totals_by_kind

    size = get_size(args.size, args.dtype)
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


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="substation", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="flop and minimum bytes of every operator (CPU)")
    analyze.add_argument("--size", required=True, help=f"a size preset: {', '.join(PRESETS)}")
    analyze.add_argument("--dtype", default="float16", choices=DTYPES)
    analyze.add_argument("--format", default="table", choices=("table", "csv", "json"),
                         help="table: operators and totals per kind; csv: the operator rows; json: both")
    analyze.add_argument("--plot", metavar="PNG", help="also draw flop share vs byte share per kind")
    analyze.add_argument("--matmul-tflops", type=_positive, default=750.0, help="matmul rate (H100 fp16 measured)")
    analyze.add_argument("--copy-tbs", type=_positive, default=2.97, help="copy bandwidth in TB/s (H100 measured)")
    analyze.set_defaults(run=_analyze)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except SubstationError as error:
        print(f"substation {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
