"""Profile rows: candidate labels and keys, the append-only writer, and the validating loader."""
import csv
import dataclasses
import math
import os
import subprocess
import sys

import pytest

from substation.errors import RecordError
from substation.records import (COLUMNS, FORMAT_1_COLUMNS, FORMAT_VERSION, Candidate, ProfileRow, RecordWriter,
                                candidate_key, load_records, parse_label, profile_dir_name, read_rows)
from substation.sizes import Size

SIZE = Size.from_heads(B=8, L=512, H=16, P=64, U=4096)
GPU = "NVIDIA H100 80GB HBM3 (sm_90)"
VERSIONS = {"torch": "2.13", "cuda": "12.8", "cublas": "12.8.4", "driver": "570.1", "substation": "0.1.0"}
QKV = Candidate.make("qkv_proj", "forward", "cublaslt", {"X": "bji", "Wqkv": "thpi"}, {"QKV": "bjthp"},
                     {"epilogue": "bias", "algo": 3})
SOFTMAX = Candidate.make("softmax_bwd", "backward", "kernel", {"dA": "bhjk", "Pr": "bhjk"}, {"dS": "bhjk"},
                         {"vec": 4, "warp_dims": ["k"], "block_dims": ["j", "h"]})
FUSED = Candidate.make("bias_gelu", "forward", "kernel", {"H1": "bju", "b1": "u"}, {"F": "bju"},
                       covers=("bias", "gelu"))


def _row(candidate=QKV, size=SIZE, **overrides) -> ProfileRow:
    timing = dict(runs=20, median_us=12.5, min_us=11.75) | overrides
    return ProfileRow.make(candidate, size, GPU, VERSIONS, **({"dropout": 0.1} | timing))


@pytest.mark.parametrize("candidate, label", [
    (QKV, 'qkv_proj/fwd cublaslt{algo=3,epilogue="bias"} X:bji Wqkv:thpi -> QKV:bjthp'),
    (Candidate.make("ln1", "forward", "kernel", {"X": "bji"}, {"Y": "bji"}), "ln1/fwd kernel X:bji -> Y:bji"),
    (Candidate.make("gen", "backward", "torch", {}, {"M": "bj"}), "gen/bwd torch -> M:bj"),
    (SOFTMAX, 'softmax_bwd/bwd kernel{block_dims=["j","h"],vec=4,warp_dims=["k"]} dA:bhjk Pr:bhjk -> dS:bhjk'),
    (Candidate.make("attn", "forward", "sdpa_flash", {"Q": "bhjp"}, {"A": "bhjp"},
                    {"note": 'a, b} -> c="d"', "pair": [1, "x,y", None, True, 2.5], "flag": False}),
     'attn/fwd sdpa_flash{flag=false,note="a, b} -> c=\\"d\\"",pair=[1,"x,y",null,true,2.5]} Q:bhjp -> A:bhjp'),
])
def test_label_round_trip(candidate, label):
    assert candidate.label == label
    parsed = parse_label(label)
    assert parsed == candidate and parsed.label == label and parsed.covers == (candidate.op,)


def test_options_sorted_lists_stored_as_tuples_and_written_as_json():
    assert SOFTMAX.options == (("block_dims", ("j", "h")), ("vec", 4), ("warp_dims", ("k",)))
    assert SOFTMAX.options_json == '{"block_dims":["j","h"],"vec":4,"warp_dims":["k"]}'
    assert hash(SOFTMAX) == hash(parse_label(SOFTMAX.label))


def test_layouts_column_sorted_by_tensor_name():
    assert QKV.layouts == "QKV:bjthp Wqkv:thpi X:bji"
    assert SOFTMAX.layouts == "Pr:bhjk dA:bhjk dS:bhjk"


def test_covers_defaults_to_op():
    assert QKV.covers == ("qkv_proj",) and FUSED.covers == ("bias", "gelu")
    assert _row(FUSED).covers == "bias gelu" and _row(FUSED).candidate == FUSED


@pytest.mark.parametrize("kwargs, match", [
    (dict(pass_="sideways"), "pass_='sideways', expected one of forward, backward"),
    (dict(impl="cublas x"), "impl='cublas x': expected an implementation name"),
    (dict(op="qkv proj"), "op='qkv proj'"),
    (dict(inputs=(("X", "bjj"),)), "input 'X': layout='bjj'"),
    (dict(outputs=()), "at least one output"),
    (dict(outputs=(("X", "bji"),)), "every tensor named once"),
    (dict(options=(("algo", {"a": 1}),)), "option algo=\\{'a': 1\\}"),
    (dict(options=(("algo", math.nan),)), "option algo=nan"),
    (dict(options=(("a-b", 1),)), "option names"),
    (dict(covers="bias gelu"), "expected a tuple of operator names"),
])
def test_bad_candidates(kwargs, match):
    with pytest.raises(RecordError, match=match):
        dataclasses.replace(QKV, **kwargs)


@pytest.mark.parametrize("text, expected", [
    ("qkv_proj X:bji -> QKV:bjthp", "'{op}/fwd' or '{op}/bwd'"),
    ("qkv_proj/fwd cublaslt{algo=} X:bji -> Y:bji", "a JSON value for option 'algo'"),
    ("qkv_proj/fwd cublaslt{algo=3 X:bji -> Y:bji", "',' or '}' after option 'algo'"),
    ("qkv_proj/fwd cublaslt{=3} X:bji -> Y:bji", "an option name followed by '='"),
    ("qkv_proj/fwd cublaslt{a=1,a=2} X:bji -> Y:bji", "option 'a' once"),
    ("qkv_proj/fwd cublaslt X:bji Y:bji", "one '->'"),
    ("qkv_proj/fwd cublaslt X:bji -> Y=bji", "NAME:letters tensor layouts around '->', not 'Y=bji'"),
    ("qkv_proj/fwd cublas2 X:bji -> Y:bji", "a space after the implementation"),
    ("qkv_proj/fwd 2gemm X:bji -> Y:bji", "an implementation name"),
])
def test_malformed_label_quotes_it_and_says_what_was_expected(text, expected):
    with pytest.raises(RecordError) as info:
        parse_label(text)
    assert repr(text) in str(info.value) and expected in str(info.value)


KEY_CHANGES = [
    (dataclasses.replace(QKV, op="out_proj"), SIZE, GPU),
    (dataclasses.replace(QKV, pass_="backward"), SIZE, GPU),
    (dataclasses.replace(QKV, inputs=(("X", "jbi"), ("Wqkv", "thpi"))), SIZE, GPU),
    (dataclasses.replace(QKV, impl="cublas"), SIZE, GPU),
    (dataclasses.replace(QKV, options=(("algo", 4), ("epilogue", "bias"))), SIZE, GPU),
    (dataclasses.replace(QKV, options=(("algo", "3"), ("epilogue", "bias"))), SIZE, GPU),
    *[(QKV, dataclasses.replace(SIZE, **change), GPU) for change in
      [dict(B=96), dict(L=128), dict(H=8, I=512), dict(P=128, I=2048), dict(H=32, P=32), dict(U=3072)]],
    (QKV, Size(B=8, L=512, H=16, P=64, I=1024, U=4096, dtype="bfloat16"), GPU),
    (QKV, SIZE, "NVIDIA H200 (sm_90)"),
]


def test_key_is_16_hex_digits_and_stable_across_processes():
    key = candidate_key(QKV, SIZE, GPU)
    assert key == "4e29c0c991c121fa", "the key of a fixed candidate must not change between releases"
    code = (f"from substation.records import candidate_key, parse_label; from substation.sizes import Size; "
            f"print(candidate_key(parse_label({QKV.label!r}), Size(**{SIZE.dims()!r}), {GPU!r}))")
    for seed in ("1", "2"):  # str hashes differ between these; the key must not
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env=os.environ | {"PYTHONHASHSEED": seed})
        assert other.stdout.strip() == key


def test_key_changes_with_every_field_it_covers():
    base = candidate_key(QKV, SIZE, GPU)
    keys = [candidate_key(*change) for change in KEY_CHANGES]
    assert base not in keys and len(set(keys)) == len(keys)


def test_key_ignores_covers_and_tensor_order():
    assert candidate_key(dataclasses.replace(QKV, covers=("qkv_proj", "bias")), SIZE, GPU) == \
        candidate_key(QKV, SIZE, GPU)
    swapped = dataclasses.replace(QKV, inputs=QKV.inputs[::-1])
    assert swapped.label != QKV.label and candidate_key(swapped, SIZE, GPU) == candidate_key(QKV, SIZE, GPU)


@pytest.mark.parametrize("overrides, column", [
    (dict(runs=0), "runs"), (dict(median_us=None), "median_us"), (dict(min_us=math.inf), "min_us"),
    (dict(min_us=13.0), "min_us"), (dict(status="done"), "status"), (dict(status="failed"), "error"),
    (dict(status="infeasible", error="  "), "error"),
])
def test_make_validates(overrides, column):
    with pytest.raises(RecordError, match=f"column '{column}'"):
        _row(**overrides)


def test_failed_and_infeasible_rows_need_no_times():
    row = _row(runs=0, median_us=None, min_us=None, status="failed", error="CUBLAS_STATUS_NOT_SUPPORTED")
    assert math.isnan(row.median_us) and row.to_cells()[COLUMNS.index("median_us")] == ""


def test_columns_follow_the_dataclass():
    assert COLUMNS[:4] == ("format_version", "key", "op", "pass") and COLUMNS[-2:] == ("status", "error")
    assert len(COLUMNS) == len(dataclasses.fields(ProfileRow)) and "pass_" not in COLUMNS


ROWS = [
    _row(),
    _row(SOFTMAX, runs=0, median_us=None, min_us=None, status="failed",
         error='CUBLAS_STATUS_NOT_SUPPORTED\nsecond line, with "quotes"'),
    _row(FUSED, runs=50, median_us=3.0, min_us=2.5),
]
ROW_LINES = [2, 3, 5]  # the failed row's error text spans two lines


def _write(path, rows=ROWS):
    with RecordWriter(path) as writer:
        for row in rows:
            writer.write(row)
    return path


def test_writer_and_loader_round_trip(tmp_path):
    path = _write(tmp_path / "deep" / "dir" / "profile.csv")
    assert read_rows(path) == ROWS
    frame = load_records(path)
    assert list(frame.columns) == list(COLUMNS)
    assert all(frame[c].dtype == "int64" for c in ("format_version", "B", "L", "H", "P", "I", "U", "runs"))
    assert frame["median_us"].dtype == frame["min_us"].dtype == "float64"
    assert frame["pass"].tolist() == ["forward", "backward", "forward"]
    assert frame["median_us"].tolist()[::2] == [12.5, 3.0] and frame["min_us"].isna().tolist() == [False, True, False]
    assert frame["error"][1] == ROWS[1].error and frame["covers"][2] == "bias gelu"
    assert frame["key"].tolist() == [row.key for row in ROWS] and (frame["format_version"] == FORMAT_VERSION).all()
    assert parse_label(frame["label"][0]) == QKV


def test_empty_profile_loads_as_empty_frame_with_dtypes(tmp_path):
    path = tmp_path / "profile.csv"
    RecordWriter(path).close()
    frame = load_records(path)
    assert frame.empty and list(frame.columns) == list(COLUMNS) and frame["runs"].dtype == "int64"


def test_resume_knows_keys_and_refuses_duplicates(tmp_path):
    path = _write(tmp_path / "profile.csv", ROWS[:2])
    with RecordWriter(path) as writer:
        assert writer.has(ROWS[0].key) and ROWS[1].key in writer and ROWS[2].key not in writer
        with pytest.raises(RecordError, match=f"{ROWS[0].key}.*already recorded"):
            writer.write(ROWS[0])
        writer.write(ROWS[2])
        assert ROWS[2].key in writer
    assert read_rows(path) == ROWS
    assert path.read_text().count("format_version") == 1, "the header is written once"


def test_writer_writes_header_into_existing_empty_file(tmp_path):
    path = tmp_path / "profile.csv"
    path.touch()
    _write(path, ROWS[:1])
    assert read_rows(path) == ROWS[:1]


def test_each_row_is_flushed_at_once(tmp_path):
    path = tmp_path / "profile.csv"
    writer = RecordWriter(path)
    writer.write(ROWS[0])
    assert read_rows(path) == ROWS[:1], "visible to another handle before close"
    writer.write(ROWS[1])
    assert read_rows(path) == ROWS[:2]
    writer.close()


@pytest.mark.parametrize("header, expected", [
    (["format_version", "key"], "missing columns ['op', 'pass'"),
    (list(COLUMNS) + ["extra"], "unknown columns ['extra']"),
    (["pass_" if c == "pass" else c for c in COLUMNS], "missing columns ['pass'], unknown columns ['pass_']"),
    (list(COLUMNS[::-1]), "out of order"),
])
def test_header_mismatch_refused_by_writer_and_loader(tmp_path, header, expected):
    path = tmp_path / "profile.csv"
    path.write_text(",".join(header) + "\n")
    for opener in (RecordWriter, load_records):
        with pytest.raises(RecordError) as info:
            opener(path)
        assert f"{path}:1:" in str(info.value) and expected in str(info.value)


def test_a_run_without_dropout_leaves_the_cell_empty(tmp_path):
    row = _row(dropout=None)
    assert math.isnan(row.dropout) and row.to_cells()[COLUMNS.index("dropout")] == ""
    assert math.isnan(read_rows(_write(tmp_path / "profile.csv", [row]))[0].dropout)
    assert _row(dropout=0).dropout == 0.0 and _row(dropout=0.25).key == _row().key  # one profile holds one dropout


def _format_1_file(path, rows):
    """A profile as format 1 wrote it: no dropout column, version 1 (the rows' dropout must be 0.1)."""
    with open(path, "w", newline="") as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(FORMAT_1_COLUMNS)
        for row in rows:
            cells = dict(zip(COLUMNS, row.to_cells())) | {"format_version": "1"}
            writer.writerow([cells[column] for column in FORMAT_1_COLUMNS])
    return path


def test_format_1_reads_at_its_dropout_and_is_rewritten_before_an_append(tmp_path):
    path = _format_1_file(tmp_path / "profile.csv", ROWS[:2])
    assert read_rows(path) == ROWS[:2], "read in the current format, at p = 0.1"
    with RecordWriter(path) as writer:
        assert ROWS[0].key in writer
        writer.write(ROWS[2])
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    assert read_rows(path) == ROWS


def test_profile_dir_name_marks_another_dropout_than_berts():
    assert profile_dir_name("bert-large-b8-l512", 0.1) == "bert-large-b8-l512"
    assert profile_dir_name("bert-large-b8-l512", 0.0) == "bert-large-b8-l512-dropout0"
    assert profile_dir_name("b16-l384-h16-p64-u4096", 0.05) == "b16-l384-h16-p64-u4096-dropout0.05"


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(RecordError, match="no such profile file") as info:
        load_records(tmp_path / "nope.csv")
    assert "nope.csv" in str(info.value)
    (tmp_path / "empty.csv").touch()
    with pytest.raises(RecordError, match="empty.csv: empty file, expected the header format_version,key"):
        load_records(tmp_path / "empty.csv")


def _corrupt(path, index, column, text):
    """Set one cell of data row `index` (0-based) through the csv module, keeping quoting right."""
    with open(path, newline="") as file:
        records = list(csv.reader(file))
    records[index + 1][COLUMNS.index(column)] = text
    with open(path, "w", newline="") as file:
        csv.writer(file, lineterminator="\n").writerows(records)


OTHER_LABEL = dataclasses.replace(QKV, impl="cublas").label
BAD_CELLS = [
    (2, "format_version", "3", "expected format version 2 (the header's), got '3'"),
    (2, "dropout", "1.5", "expected a probability in [0, 1), or an empty cell, got '1.5'"),
    (2, "dropout", "abc", "expected a number or an empty cell, got 'abc'"),
    (2, "key", "xyz", "expected 16 hex digits, got 'xyz'"),
    (2, "pass", "sideways", "expected one of forward, backward, got 'sideways'"),
    (2, "covers", "", "space-separated operator names"),
    (2, "layouts", "X=bji", "NAME:letters"),
    (2, "impl", "cublas x", "expected an implementation name, got 'cublas x'"),
    (2, "options", "[1, 2]", "expected a JSON object, got '[1, 2]'"),
    (2, "options", "{bad", "expected a JSON object"),
    (2, "label", "bias_gelu kernel", "expected '{op}/fwd' or '{op}/bwd'"),
    (0, "label", OTHER_LABEL, "agrees with the op, pass, impl, layouts and options columns"),
    (2, "B", "abc", "expected an integer, got 'abc'"),
    (2, "U", "0", "expected a positive integer, got '0'"),
    (2, "runs", "1.5", "expected an integer, got '1.5'"),
    (2, "dtype", "int8", "expected one of float16"),
    (2, "gpu", " ", "a GPU name"),
    (2, "versions", "torch 2.13", "a JSON object"),
    (2, "median_us", "abc", "expected a number or an empty cell, got 'abc'"),
    (2, "median_us", "", "expected a time in an ok row, got ''"),
    (2, "min_us", "-1", "non-negative number"),
    (2, "runs", "0", "at least 1 run in an ok row, got '0'"),
    (2, "status", "done", "expected one of ok, failed, infeasible, got 'done'"),
    (1, "error", "", "expected the reason in a failed row, got ''"),
    (2, "key", ROWS[0].key, f"repeats line {ROW_LINES[0]}"),
]


@pytest.mark.parametrize("index, column, text, expected", BAD_CELLS)
def test_bad_cell_names_file_line_and_column(tmp_path, index, column, text, expected):
    path = _write(tmp_path / "profile.csv")
    _corrupt(path, index, column, text)
    with pytest.raises(RecordError) as info:
        load_records(path)
    assert str(info.value).startswith(f"{path}:{ROW_LINES[index]}: column '{column}': ")
    assert expected in str(info.value)


def test_wrong_cell_count_and_partial_last_row(tmp_path):
    path = _write(tmp_path / "profile.csv")
    with open(path, "a") as file:
        file.write("1,0123456789abcdef,qkv_proj")  # what a crash in the middle of a write would leave
    with pytest.raises(RecordError, match=f"profile.csv:6: expected {len(COLUMNS)} cells, got 3"):
        load_records(path)
    with pytest.raises(RecordError, match="profile.csv:6:"):
        RecordWriter(path)


def test_blank_lines_are_skipped(tmp_path):
    path = _write(tmp_path / "profile.csv")
    with open(path, "a") as file:
        file.write("\n\n")
    assert read_rows(path) == ROWS
