"""The predicted layer time of every graph order on each profile: the markdown table in layouts/README.md.

    python scripts/predicted_orders.py [PROFILE_DIR ...]      # default: every profile under layouts/profiles/h100

Each order runs as `substation optimize PROFILE_DIR --graph_order ORDER --exclude-impl torch` does (the options
the shipped configurations were made with; `--exclude-impl` here names others), without --split_vars: the ILP
inserts layout conversions where it finds them needed or worth their transpose, and each cell names them with
their µs and where that came from (a profiled transpose row, or the bandwidth estimate). The last column is the
default configuration (PyTorch's layouts, unfused, cheapest cuBLAS/PyTorch row) on the same profile.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from substation.config_selection import GRAPH_ORDERS, Profile, SelectOptions, Selection, load_profile, optimize
from substation.errors import SubstationError
from substation.graph import LayerGraph, layer_graph

SHIPPED = Path(__file__).resolve().parents[1] / "layouts" / "profiles" / "h100"
# PyTorch's matmul writes no float32 weight gradient under autocast: the shipped configurations leave it out.
SHIPPED_EXCLUDED = ("torch",)


def solve_orders(profile: Profile, graph: LayerGraph, exclude_impls: Sequence[str] = SHIPPED_EXCLUDED
                 ) -> dict[str, Selection]:
    """Every graph order's selection on one profile, with the shipped configurations' options."""
    options = SelectOptions(exclude_impls=tuple(exclude_impls))
    return {order: optimize(profile, graph, order, options) for order in GRAPH_ORDERS}


def _cell(selection: Selection, best_us: float) -> str:
    """The order's total (bold where it is the best of the row) and the conversions it inserted."""
    total = f"{selection.predicted_total_us:.1f}"
    if round(selection.predicted_total_us, 1) == round(best_us, 1):
        total = f"**{total}**"
    conversions = ", ".join(f"{t.tensor} `{t.forward}`→`{t.backward}` {t.us:.1f} ({t.source.split(':')[0]})"
                            for t in selection.transposes)
    return f"{total}; converts {conversions}" if conversions else total


def predicted_table(by_profile: Mapping[str, Mapping[str, Selection]]) -> str:
    """One line per profile: each order's predicted µs and conversions, then the default configuration's."""
    lines = ["| profile | " + " | ".join(GRAPH_ORDERS) + " | default (PyTorch layouts, unfused, cheapest cuBLAS/PyTorch "
             "row) |",
             "| --- |" + " --- |" * (len(GRAPH_ORDERS) + 1)]
    for name, selections in by_profile.items():
        best = min(s.predicted_total_us for s in selections.values())
        default = selections["combined"].default.total_us
        shown = ("none (an operator has no canonical unfused row)" if default is None
                 else f"{default:.1f} ({default / best:.2f}× slower)")
        lines.append(f"| {name} | " + " | ".join(_cell(selections[order], best) for order in GRAPH_ORDERS) +
                     f" | {shown} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile_dirs", nargs="*", type=Path, metavar="PROFILE_DIR",
                        help="profile directories (default: every one under layouts/profiles/h100)")
    parser.add_argument("--exclude-impl", dest="exclude_impls", nargs="*", default=list(SHIPPED_EXCLUDED),
                        metavar="IMPL", help="implementations never chosen (default: %(default)s)")
    args = parser.parse_args(argv)
    graph = layer_graph()
    try:
        by_profile = {path.name: solve_orders(load_profile(path, graph), graph, args.exclude_impls)
                      for path in args.profile_dirs or sorted(SHIPPED.iterdir())}
    except SubstationError as error:
        parser.error(str(error))
    print(predicted_table(by_profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
