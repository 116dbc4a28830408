"""Time `optimize` on layer-shaped synthetic BERT-large profiles: every graph order, HiGHS and CBC.

    python -m substation.config_selection.benchmark [--out DIR] [--quick]

Writes the profiles (both CSVs) under DIR, then prints the markdown table README.md shows. Times are
wall-clock seconds of one `optimize` call (presolve, model build, solve, answer), not of loading the profile.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from substation.config_selection.ilp import SolverOptions
from substation.config_selection import GRAPH_ORDERS
from substation.config_selection.orders import SelectOptions, optimize
from substation.config_selection.profiles import CONTRACTIONS_CSV, KERNELS_CSV, load_profile
from substation.config_selection.synthetic import SyntheticSpec, write_synthetic_profile
from substation.errors import InfeasibleError
from substation.graph import LayerGraph, layer_graph
from substation.records import RecordWriter, read_rows
from substation.sizes import get_size

H100 = "NVIDIA H100 80GB HBM3 (sm_90)"


SHIPPED = Path(__file__).resolve().parents[1] / "layouts" / "profiles" / "h100" / "bert-large-b8-l512"


@dataclass(frozen=True)
class Case:
    """A synthetic profile; with `shipped`, the shipped H100 rows stand in for the synthetic ones they cover."""

    name: str
    spec: SyntheticSpec
    shipped: Path | None = None


def cases(quick: bool) -> list[Case]:
    size = get_size("bert-large-b8-l512")
    found = [Case("default synthetic (4 algorithms, 512 fused combos)", SyntheticSpec(size))]
    if not quick:
        found.append(Case("large synthetic (8 algorithms, 2000 fused combos)",
                          SyntheticSpec(size, algorithms=8, fused_combos=2000)))
        if (SHIPPED / "contractions.csv.gz").is_file():
            found.append(Case("shipped H100 rows (every contraction; softmax, softmax_bwd), synthetic rows for the "
                              "other fused operators and SDPA", SyntheticSpec(size, gpu=H100), SHIPPED))
    return found


def write_hybrid(directory: Path, case: Case, graph: LayerGraph) -> None:
    """The shipped profile's rows, then synthetic rows (on the shipped GPU's name) for operators it lacks."""
    shipped = {name: read_rows(case.shipped / (name + ".gz")) for name in (CONTRACTIONS_CSV, KERNELS_CSV)
               if (case.shipped / (name + ".gz")).is_file()}
    covered = {op for rows in shipped.values() for row in rows for op in row.covers.split()}
    synthetic = directory / "synthetic"
    write_synthetic_profile(synthetic, case.spec, graph, files=(KERNELS_CSV,))
    extra = [row for row in read_rows(synthetic / KERNELS_CSV) if not set(row.covers.split()) <= covered
             or len(row.covers.split()) > 1]  # keep SDPA: the shipped profile has no multi-operator rows
    with RecordWriter(directory / KERNELS_CSV) as writer:
        for row in [*shipped.get(KERNELS_CSV, []), *extra]:
            writer.write(row)
    with RecordWriter(directory / CONTRACTIONS_CSV) as writer:
        for row in shipped.get(CONTRACTIONS_CSV, []):
            writer.write(row)


def _row(profile_rows: int, order: str, split: Sequence[str], solver: str, outcome: str, binaries: str,
         constraints: str, seconds: float) -> str:
    return (f"| {profile_rows} | {order} | {'all 13 shared' if split else 'none'} | {solver} | {binaries} | "
            f"{constraints} | {seconds:.2f} | {outcome} |")


SOLVER_VARIANTS = {"highs": SolverOptions("highs"), "cbc": SolverOptions("cbc"),
                   "highs, probing on": SolverOptions("highs", highs_probing=True)}


def measure(case: Case, directory: Path, graph: LayerGraph) -> tuple[str, list[str]]:
    """How long loading took, and one table line per (split vars, order, solver)."""
    if case.shipped is None:
        write_synthetic_profile(directory, case.spec, graph)
    else:
        write_hybrid(directory, case, graph)
    start = time.perf_counter()
    profile = load_profile(directory, graph)
    loading = f"loading {len(profile.rows)} rows: {time.perf_counter() - start:.2f} s"
    lines = []
    for split in ((), graph.saved_for_backward()):
        for order in GRAPH_ORDERS:
            for solver, solver_options in SOLVER_VARIANTS.items():
                if "probing" in solver and (order != "combined" or split):
                    continue  # one comparison is enough to show why probing is off by default
                options = SelectOptions(split_vars=tuple(split), solver=solver_options)
                start = time.perf_counter()
                try:
                    selection = optimize(profile, graph, order, options)
                except InfeasibleError as err:
                    outcome = "infeasible: " + str(err).split(": ")[2][:60] + "…"
                    lines.append(_row(len(profile.rows), order, split, solver, outcome, "", "",
                                      time.perf_counter() - start))
                    continue
                seconds = time.perf_counter() - start
                solves = selection.solves
                outcome = (f"{selection.predicted_total_us:.1f} µs "
                           f"({'optimal' if selection.optimal else 'time limit'})")
                lines.append(_row(len(profile.rows), order, split, solver, outcome,
                                  " + ".join(str(s.binaries) for s in solves),
                                  " + ".join(str(s.constraints) for s in solves), seconds))
    return loading, lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the profiles (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="the default synthetic profile only")
    args = parser.parse_args(argv)
    graph = layer_graph()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for n, case in enumerate(cases(args.quick)):
            loading, lines = measure(case, root / f"case{n}", graph)
            print(f"\n{case.name}; {loading}")
            print("| profile rows | order | split vars | solver | binaries | constraints | seconds | predicted |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            print("\n".join(lines))


if __name__ == "__main__":
    main()
