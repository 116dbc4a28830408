"""scripts/retime_fastest.py: which rows leave a profile for `substation profile --ops` to time again."""
import csv
import gzip
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "retime_fastest.py"
FIELDS = ["key", "op", "covers", "impl", "status", "median_us"]
# (key, op, covers, impl, median_us): two cover groups of attn_context_dgrad_a, an SDPA row, another op.
ROWS = [("a1", "attn_context_dgrad_a", "five", "attention", 30.0),
        ("a2", "attn_context_dgrad_a", "five", "attention", 10.0),
        ("a3", "attn_context_dgrad_a", "five", "attention", 20.0),
        ("s1", "attn_context_dgrad_a", "six", "attention", 50.0),
        ("s2", "attn_context_dgrad_a", "six", "attention", 40.0),
        ("c1", "attn_context_dgrad_a", "five", "sdpa_cudnn", 1.0),
        ("l1", "ln1", "ln1", "kernel", 5.0)]


def script():
    spec = importlib.util.spec_from_file_location("retime_fastest", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile_text() -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(FIELDS)
    writer.writerows((key, op, covers, impl, "ok", f"{us:.3f}") for key, op, covers, impl, us in ROWS)
    return out.getvalue()


def test_fastest_rows_of_each_cover_group_and_only_of_the_named_impls():
    rows = list(csv.DictReader(io.StringIO(profile_text())))
    assert script().fastest_keys(rows, {"attn_context_dgrad_a"}, {"attention"}, 2) == {"a2", "a3", "s1", "s2"}
    assert script().fastest_keys(rows, {"ln1"}, {"kernel", "attention"}, 2) == {"l1"}


def test_unpacks_a_shipped_profile_and_keeps_every_other_row_byte_for_byte(tmp_path):
    with gzip.open(tmp_path / "kernels.csv.gz", "wt", newline="") as f:
        f.write(profile_text())
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--ops", "attn_context_dgrad_a", "--fastest", "1"],
                   check=True, capture_output=True)
    assert not (tmp_path / "kernels.csv.gz").exists()
    kept = (tmp_path / "kernels.csv").read_text().splitlines()
    want = [line for line in profile_text().splitlines() if line.split(",")[0] not in {"a2", "s2"}]
    assert kept == want


def test_an_unknown_operator_is_refused_before_the_profile_is_touched(tmp_path):
    with gzip.open(tmp_path / "kernels.csv.gz", "wt", newline="") as f:
        f.write(profile_text())
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--ops", "attn_scores", "lnl"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown operator 'lnl'" in done.stderr
    assert (tmp_path / "kernels.csv.gz").exists() and not (tmp_path / "kernels.csv").exists()
