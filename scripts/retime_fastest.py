#!/usr/bin/env python3
"""Make `substation profile --ops` time again the fastest rows of some of a kernel profile's operators, after a
change to their kernels' code that keeps every label (the profiler skips rows it already holds, by key).

For each named operator, the `--fastest` rows of each (covers, impl) group among the timed rows of `--impl` are
removed from DIR/<size>/kernels.csv (a shipped kernels.csv.gz is unpacked first, as the profiler does; gzip it
again to ship it). The rows left keep their older times: where a change makes a family faster, they can only
lose to the re-timed ones, so the optimizer's choice among the fastest stays exact.

    python scripts/retime_fastest.py layouts/profiles/h100/bert-large-b8-l512 --ops ln1 ln2 --fastest 24
    python -m substation profile --size bert-large-b8-l512 --out layouts/profiles/h100 --ops ln1 ln2
"""
from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

from substation.errors import SubstationError
from substation.graph import layer_graph
from substation.profiling import unpack


def fastest_keys(rows: list[dict[str, str]], ops: set[str], impls: set[str], fastest: int) -> set[str]:
    """The keys of the `fastest` timed rows of each (op, covers, impl) group of `ops` and `impls`."""
    groups: dict[tuple[str, str, str], list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        if row["op"] in ops and row["impl"] in impls and row["status"] == "ok":
            groups[row["op"], row["covers"], row["impl"]].append(row)
    return {row["key"] for group in groups.values()
            for row in sorted(group, key=lambda r: float(r["median_us"]))[:fastest]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="one size's profile folder, e.g. layouts/profiles/h100/<size>")
    parser.add_argument("--ops", nargs="+", required=True, help="the operators whose rows lead (a row's op)")
    parser.add_argument("--impl", nargs="+", default=["kernel", "attention"], help="implementations (default: ours)")
    parser.add_argument("--fastest", type=int, default=24, help="rows per (op, covers, impl) group (default: 24)")
    args = parser.parse_args()
    try:
        for op in args.ops:
            layer_graph().operator(op)
    except SubstationError as error:
        parser.error(str(error))
    path = args.directory / "kernels.csv"
    unpack(path)
    if not path.is_file():
        parser.error(f"no kernels.csv(.gz) in {args.directory}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, list(reader)
    drop = fastest_keys(rows, set(args.ops), set(args.impl), args.fastest)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(r for r in rows if r["key"] not in drop)
    print(f"{path}: removed {len(drop)} of {len(rows)} rows, for `substation profile --ops {' '.join(args.ops)}`")


if __name__ == "__main__":
    main()
