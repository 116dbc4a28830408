#!/usr/bin/env python3
"""DRAM bytes and kernels of one training step, under Nsight Compute, beside the layer's minimum bytes.

    python scripts/measure_bytes.py --layouts layouts/h100-bert-large-b8-l512.pickle --size bert-large-b8-l512
    python scripts/measure_bytes.py --size B=2,L=128,H=16,P=64,U=4096 --variants eager_sdpa

For each variant this script starts itself again as a driver under `ncu --profile-from-start off`: the driver
warms the step up, then brackets exactly one step (y = layer(x); y.backward(dy), training mode) with
cudaProfilerStart/Stop, so only that step's kernels are profiled. ncu reads, per kernel, the DRAM bytes read
and written (`dram__bytes_read.sum`, `dram__bytes_write.sum`) and the L2 sectors the SMs read and wrote
(`lts__t_sectors_op_read.sum`, `lts__t_sectors_op_write.sum`, 32 bytes each). By default ncu leaves the
caches alone (`--cache-control none`): the step runs as it does unprofiled, a kernel reading what the previous
one left in L2 counts no DRAM read, and a dirty line counts as a DRAM write in the kernel that evicts it, so
the step's total is its DRAM traffic (less what is still dirty in L2 at its end, at most the L2's 50 MB).
`--cache-control all` flushes the caches before each kernel: reads are then each kernel's cold reads, but the
write-back of a kernel's output happens in the flush, uncounted, so DRAM writes undercount (eager SDPA at
bert-large-b8-l512: 79 MB written to DRAM against 656 MB written to L2).
The minimum is `substation analyze`'s: every operator's inputs read once and outputs written once, forward
and backward. `--json` also lists each launch of the step (`per_kernel`: its name and DRAM bytes, in order).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

# ncu metric -> column (in bytes)
METRICS = {"dram__bytes_read.sum": "dram_read_bytes", "dram__bytes_write.sum": "dram_write_bytes",
           "lts__t_sectors_op_read.sum": "l2_read_bytes", "lts__t_sectors_op_write.sum": "l2_write_bytes"}
DRAM_METRICS = tuple(METRICS)[:2]
DRAM_METRICS_COLUMNS = tuple(METRICS[m] for m in DRAM_METRICS)
UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
         "kibyte": 1 << 10, "mibyte": 1 << 20, "gibyte": 1 << 30, "sector": 32}
VARIANTS = ("substation", "eager_sdpa")
JSON_KEYS = ("size", "variant", "kernels", "dram_read_bytes", "dram_write_bytes", "dram_bytes", "l2_read_bytes",
             "l2_write_bytes", "l2_bytes", "min_bytes", "per_kernel")


class NcuParseError(ValueError):
    """ncu's output holds no metric table, or a row of it is malformed (the message quotes it)."""


def parse_ncu_csv(text: str) -> pd.DataFrame:
    """ncu `--csv` output (page details: one row per kernel and metric) -> one row per kernel launch, in order:
    id, kernel and a column per metric of `METRICS` in bytes (NaN where ncu gave none). Lines before the CSV
    header (==PROF== messages, the program's own output) are skipped; values may carry units (byte, Kbyte,
    Mbyte, ..., sector) and thousands commas."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise NcuParseError("no CSV header (\"ID\",...) in ncu's output: was any kernel profiled? "
                            f"first lines: {lines[:3]}")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    need = {"ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not need <= set(reader.fieldnames or ()):
        raise NcuParseError(f"ncu's CSV header {reader.fieldnames} lacks {sorted(need - set(reader.fieldnames or ()))}")
    kernels: dict[int, dict[str, object]] = {}
    for n, row in enumerate(reader, start=start + 2):
        if row["ID"] is None or not row["ID"].strip().isdigit():
            continue  # a trailing ==PROF== or program line
        metric = row["Metric Name"]
        if metric not in METRICS:
            continue
        unit = (row["Metric Unit"] or "byte").strip().lower()
        if unit not in UNITS:
            raise NcuParseError(f"line {n}: unit {row['Metric Unit']!r} of {metric} is not a byte unit")
        try:
            value = float(row["Metric Value"].replace(",", "")) * UNITS[unit]
        except ValueError:
            raise NcuParseError(f"line {n}: {metric} = {row['Metric Value']!r} is not a number") from None
        kernel = kernels.setdefault(int(row["ID"]), {"id": int(row["ID"]), "kernel": row["Kernel Name"]})
        kernel[METRICS[metric]] = value
    return pd.DataFrame(list(kernels.values()), columns=["id", "kernel", *METRICS.values()])


def summarize(kernels: pd.DataFrame) -> dict[str, object]:
    """kernels, and per metric the step's total bytes (None where ncu measured none), with read + write sums; and
    `per_kernel`, each launch's name and DRAM bytes in order: which launches a kernel-count target could lose."""
    dram = kernels[list(DRAM_METRICS_COLUMNS)].sum(axis=1, min_count=1)
    out: dict[str, object] = {"kernels": len(kernels), "per_kernel": [
        {"kernel": name, "dram_bytes": None if pd.isna(b) else float(b)} for name, b in zip(kernels.kernel, dram)]}
    for column in METRICS.values():
        out[column] = float(kernels[column].sum()) if kernels[column].notna().any() else None
    for level in ("dram", "l2"):
        read, write = out[f"{level}_read_bytes"], out[f"{level}_write_bytes"]
        out[f"{level}_bytes"] = None if read is None or write is None else read + write
    return out


def minimum_bytes(size) -> int:
    """Every operator's inputs read once and outputs written once, forward and backward (`substation analyze`)."""
    from substation.analysis import operator_costs

    return int(operator_costs(size).bytes.sum())


def bytes_table(rows: list[dict[str, object]], reference: str = "eager_sdpa") -> pd.DataFrame:
    """MB read, written and in all per variant, the minimum, and each total over the minimum and the reference's."""
    ref = next((r["dram_bytes"] for r in rows if r["variant"] == reference and r.get("dram_bytes")), None)
    mb = lambda r, key: None if r.get(key) is None else r[key] / 1e6  # noqa: E731
    out = []
    for r in rows:
        total = r.get("dram_bytes")
        out.append({"variant": r["variant"], "kernels": r.get("kernels"), "read_MB": mb(r, "dram_read_bytes"),
                    "write_MB": mb(r, "dram_write_bytes"), "total_MB": mb(r, "dram_bytes"),
                    "L2_MB": mb(r, "l2_bytes"), "min_MB": r["min_bytes"] / 1e6,
                    "x_min": None if total is None else total / r["min_bytes"],
                    f"vs_{reference}": None if total is None or not ref else total / ref,
                    "note": r.get("error") or ""})
    return pd.DataFrame(out)


# ---- the driver that runs under ncu ---------------------------------------------------------------------
def drive(args: argparse.Namespace) -> None:
    """Warm one step of the variant up, then run exactly one between cudaProfilerStart and Stop."""
    import torch

    from substation.benchmark import build_variant, make_inputs, reference_state_dict, train_step
    from substation.sizes import get_size

    size = get_size(args.size)
    dtype = getattr(torch, args.dtype)
    layer = build_variant(args.driver, size, dtype, reference_state_dict(size), args.layouts)
    x, mask, dy = make_inputs(size, dtype)
    step = train_step(layer, x, mask, dy)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    with torch.cuda.nvtx.range("substation_step"):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def measure(variant: str, args: argparse.Namespace, ncu: str, metrics: tuple[str, ...] = tuple(METRICS)
            ) -> pd.DataFrame:
    """Run the driver for `variant` under ncu; its per-kernel rows. Raises RuntimeError with ncu's last words."""
    with tempfile.TemporaryDirectory() as tmp:
        log_file = Path(tmp) / "ncu.csv"
        driver = [sys.executable, str(Path(__file__).resolve()), "--driver", variant, "--size", args.size,
                  "--dtype", args.dtype] + (["--layouts", args.layouts] if args.layouts else [])
        cmd = [ncu, "--profile-from-start", "off", "--metrics", ",".join(metrics), "--csv", "--print-units", "base",
               "--cache-control", args.cache_control, "--target-processes", "all", "--log-file", str(log_file),
               *driver]
        print(f"measure_bytes.py: {variant}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = log_file.read_text(encoding="utf-8", errors="replace") if log_file.exists() else ""
        if args.keep_csv:
            Path(args.keep_csv).mkdir(parents=True, exist_ok=True)
            (Path(args.keep_csv) / f"ncu-{variant}.csv").write_text(text, encoding="utf-8")
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or text.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"ncu exited with {proc.returncode}: {tail}")
        return parse_ncu_csv(text if '"ID",' in text else proc.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="measure_bytes.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", metavar="FILE", help="a layout configuration, for the substation variant")
    parser.add_argument("--size", required=True, help="a size preset, or B=..,L=..,H=..,P=..,U=..")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS + ("eager_manual", "hf_bertlayer"),
                        default=list(VARIANTS))
    parser.add_argument("--cache-control", default="none", choices=("none", "all"),
                        help="ncu's: leave the caches as the step leaves them (none) or flush them before each "
                        "kernel (all; DRAM writes then undercount)")
    parser.add_argument("--ncu", default=None, help="the ncu binary (default: ncu on PATH)")
    parser.add_argument("--json", metavar="OUT", help="also write the rows as a JSON list")
    parser.add_argument("--keep-csv", metavar="DIR", help="keep ncu's raw CSV output, one file per variant")
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from substation.benchmark import format_table
    from substation.errors import SubstationError
    from substation.sizes import get_size, size_name

    try:
        size = get_size(args.size)
    except SubstationError as error:
        parser.error(f"--size: {error}")
    if "substation" in (args.variants if args.driver is None else [args.driver]):
        if not args.layouts or not Path(args.layouts).is_file():
            parser.error(f"--layouts FILE is needed for the substation variant (got {args.layouts!r})")
    import torch

    if not torch.cuda.is_available():
        print("measure_bytes.py: error: needs an NVIDIA GPU, and torch sees none", file=sys.stderr)
        return 2
    if args.driver:
        drive(args)
        return 0
    ncu = args.ncu or shutil.which("ncu")
    if ncu is None:
        print("measure_bytes.py: error: Nsight Compute's ncu is not on PATH (--ncu names it)", file=sys.stderr)
        return 2
    min_bytes = minimum_bytes(size.with_dtype(args.dtype))
    rows: list[dict[str, object]] = []
    for variant in args.variants:
        row: dict[str, object] = {key: None for key in JSON_KEYS} | {"size": size_name(size), "variant": variant,
                                                                      "min_bytes": min_bytes}
        try:
            try:
                kernels = measure(variant, args, ncu)
            except RuntimeError as error:  # an ncu that lacks the L2 metrics: DRAM alone
                print(f"measure_bytes.py: {variant}: {error}; again with the DRAM metrics alone", file=sys.stderr)
                kernels = measure(variant, args, ncu, DRAM_METRICS)
            row |= summarize(kernels)
        except Exception as error:  # one variant's failure is a row with the reason
            row["error"] = f"{type(error).__name__}: {error}"[:300]
            print(f"measure_bytes.py: {variant}: {row['error']}", file=sys.stderr)
        rows.append(row)
    print(f"{size_name(size)} {args.dtype} on {torch.cuda.get_device_name()}: DRAM bytes of one training step (ncu, "
          f"--cache-control {args.cache_control}; L2 = bytes the SMs read and wrote in L2); min = every operator's "
          "inputs read once, outputs written once")
    print(format_table(bytes_table(rows), digits=2))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: r.get(k) for k in JSON_KEYS} for r in rows], indent=1) + "\n",
                                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
