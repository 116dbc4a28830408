"""Profile rows: one CSV row per timed candidate, written by both profilers and read by the optimizer.

A `Candidate` says what is timed (operator, pass, implementation, options, tensor layouts); a
`ProfileRow` adds the problem size, the run's dropout probability, GPU, versions and timing. The
dataclass field order of `ProfileRow` is the CSV column order (`COLUMNS`). `RecordWriter` appends and
flushes one row at a time, so an interrupted run loses at most the row in flight and a rerun skips keys
already present (a format-1 file, without the dropout column, is rewritten in the current format first).
`load_records` validates every row and returns a DataFrame; errors name file, line and column.
"""
from __future__ import annotations

import csv
import dataclasses
import gzip
import hashlib
import io
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NoReturn

import pandas as pd

from substation.errors import RecordError
from substation.sizes import DTYPES, Size

FORMAT_VERSION = 2
# Format 1 had no dropout column: every profile of it was timed at p = 0.1, which its rows read as.
FORMAT_1_DROPOUT = 0.1
DEFAULT_DROPOUT = 0.1  # BERT's attention and hidden dropout: what a profile is taken at unless told otherwise
PASSES = ("forward", "backward")
STATUSES = ("ok", "failed", "infeasible")

_PASS_ABBREV = {"forward": "fwd", "backward": "bwd"}
_PASS_OF_ABBREV = {abbrev: name for name, abbrev in _PASS_ABBREV.items()}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TENSOR = re.compile(r"([A-Za-z_][A-Za-z0-9_]*):([a-z]+)")
_KEY = re.compile(r"[0-9a-f]{16}")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DIMS = ("B", "L", "H", "P", "I", "U")

OptionValue = str | int | float | bool | None | tuple[str | int | float | bool | None, ...]


def _canonical_json(value: object) -> str:
    """Compact JSON with sorted keys: the one spelling used in labels, the options column and keys."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _is_scalar(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (bool, int, str))


def _option_value(name: str, value: object) -> OptionValue:
    """A JSON scalar, or a list of them stored as a tuple so candidates stay hashable."""
    if isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value):
        return tuple(value)
    if _is_scalar(value):
        return value  # type: ignore[return-value]
    raise RecordError(f"option {name}={value!r}: expected a JSON scalar (finite number, string, bool, null) "
                      f"or a list of them")


def _normalize_options(options: Mapping[str, object] | Iterable[tuple[str, object]]) -> tuple:
    pairs = list(options.items() if isinstance(options, Mapping) else options)
    names = [name for name, _ in pairs]
    bad = [name for name in names if not isinstance(name, str) or not _NAME.fullmatch(name)]
    if bad or len(set(names)) != len(names):
        raise RecordError(f"option names {names!r}: expected distinct identifiers")
    return tuple(sorted((name, _option_value(name, value)) for name, value in pairs))


def _normalize_tensors(role: str, tensors: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple:
    pairs = tuple((name, letters) for name, letters in (tensors.items() if isinstance(tensors, Mapping)
                                                        else tensors))
    for name, letters in pairs:
        if not (isinstance(name, str) and isinstance(letters, str) and _TENSOR.fullmatch(f"{name}:{letters}")
                and len(set(letters)) == len(letters)):
            raise RecordError(f"{role} {name!r}: layout={letters!r}, expected a tensor name and distinct "
                              f"lower-case dim letters such as ('X', 'bji')")
    return pairs


@dataclass(frozen=True)
class Candidate:
    """What is timed: one implementation of `op` in one pass, with its tensors' layouts and options.

    `inputs`/`outputs` are ordered (tensor, layout letters) pairs, e.g. (("X", "bji"), ("Wqkv", "thpi"));
    `options` is sorted by name (list values are stored as tuples); `covers` names the graph operators
    the row implements and defaults to (op,). Lists and dicts are accepted and normalized.
    """

    op: str
    pass_: str
    impl: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, OptionValue], ...] = ()
    covers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not _NAME.fullmatch(self.op):
            raise RecordError(f"op={self.op!r}: expected an operator name (letters, digits, '_')")
        if self.pass_ not in PASSES:
            raise RecordError(f"op {self.op!r}: pass_={self.pass_!r}, expected one of {', '.join(PASSES)}")
        if not isinstance(self.impl, str) or not _NAME.fullmatch(self.impl):
            raise RecordError(f"op {self.op!r}: impl={self.impl!r}: expected an implementation name (letters, digits, "
                              "'_'; which ones run is the registry's to say, substation.implementations)")
        object.__setattr__(self, "inputs", _normalize_tensors("input", self.inputs))
        object.__setattr__(self, "outputs", _normalize_tensors("output", self.outputs))
        object.__setattr__(self, "options", _normalize_options(self.options))
        if isinstance(self.covers, str):
            raise RecordError(f"op {self.op!r}: covers={self.covers!r}, expected a tuple of operator names")
        object.__setattr__(self, "covers", tuple(self.covers) or (self.op,))
        names = [name for name, _ in self.inputs + self.outputs]
        if not self.outputs or len(set(names)) != len(names):
            raise RecordError(f"op {self.op!r}: inputs={self.inputs}, outputs={self.outputs}, expected at least "
                              f"one output and every tensor named once")
        if not all(isinstance(name, str) and _NAME.fullmatch(name) for name in self.covers):
            raise RecordError(f"op {self.op!r}: covers={self.covers!r}, expected operator names")

    @classmethod
    def make(cls, op: str, pass_: str, impl: str, inputs: Mapping[str, str], outputs: Mapping[str, str],
             options: Mapping[str, object] | None = None, covers: Iterable[str] = ()) -> Candidate:
        """Build from dicts: tensor name -> layout letters (in argument order), option name -> value."""
        return cls(op, pass_, impl, tuple(inputs.items()), tuple(outputs.items()), tuple((options or {}).items()),
                   covers)  # type: ignore[arg-type]  # __post_init__ makes it a tuple, refusing a bare str

    @property
    def options_dict(self) -> dict[str, object]:
        """The options as JSON-ready builtins (tuples back to lists)."""
        return {name: list(value) if isinstance(value, tuple) else value for name, value in self.options}

    @property
    def options_json(self) -> str:
        """The `options` column: a compact JSON object with sorted keys."""
        return _canonical_json(self.options_dict)

    @property
    def layouts(self) -> str:
        """The `layouts` column: `NAME:letters` for every input and output, sorted by name."""
        return " ".join(f"{name}:{letters}" for name, letters in sorted(self.inputs + self.outputs))

    @property
    def label(self) -> str:
        """`op/fwd impl{k=v,...} IN:lay ... -> OUT:lay ...`, values as compact JSON; `parse_label` inverts it."""
        options = ",".join(f"{name}={_canonical_json(value)}" for name, value in self.options_dict.items())
        tensors = [*(f"{n}:{l}" for n, l in self.inputs), "->", *(f"{n}:{l}" for n, l in self.outputs)]
        return " ".join([f"{self.op}/{_PASS_ABBREV[self.pass_]}", self.impl + (f"{{{options}}}" if options else ""),
                         *tensors])


def _bad_label(text: str, expected: str) -> NoReturn:
    raise RecordError(f"label {text!r}: expected {expected}; labels look like "
                      f"'qkv_proj/fwd cublaslt{{algo=3}} X:bji Wqkv:thpi -> QKV:bjthp'")


def _parse_options(text: str, pos: int) -> tuple[dict[str, object], int]:
    """Parse `{k=v,...}` starting at `pos`; values are JSON, so strings and lists may hold commas."""
    options: dict[str, object] = {}
    if not text.startswith("{", pos):
        return options, pos
    decoder, pos = json.JSONDecoder(), pos + 1
    while True:
        name = _NAME.match(text, pos)
        if name is None or not text.startswith("=", name.end()):
            _bad_label(text, f"an option name followed by '=' at character {pos}")
        try:
            value, pos = decoder.raw_decode(text, name.end() + 1)
        except json.JSONDecodeError:
            _bad_label(text, f"a JSON value for option {name.group()!r} at character {name.end() + 1}")
        if name.group() in options:
            _bad_label(text, f"option {name.group()!r} once")
        options[name.group()] = value
        if text.startswith("}", pos):
            return options, pos + 1
        if not text.startswith(",", pos):
            _bad_label(text, f"',' or '}}' after option {name.group()!r} at character {pos}")
        pos += 1


def _parse_tensors(text: str, tokens: list[str]) -> tuple[tuple[str, str], ...]:
    matches = [_TENSOR.fullmatch(token) for token in tokens]
    bad = [token for token, match in zip(tokens, matches) if match is None]
    if bad:
        _bad_label(text, f"NAME:letters tensor layouts around '->', not {bad[0]!r}")
    return tuple((match.group(1), match.group(2)) for match in matches)  # type: ignore[union-attr]


def parse_label(text: str) -> Candidate:
    """The Candidate a `Candidate.label` was made from (with covers = (op,)); RecordError if malformed."""
    head = re.match(r"([A-Za-z_][A-Za-z0-9_]*)/(fwd|bwd) ([a-z_]+)", text) if isinstance(text, str) else None
    if head is None:
        _bad_label(text, "'{op}/fwd' or '{op}/bwd', a space and an implementation name")
    options, pos = _parse_options(text, head.end())
    if not text.startswith(" ", pos):
        _bad_label(text, f"a space after the implementation and its options at character {pos}")
    tokens = text[pos:].split()
    if tokens.count("->") != 1:
        _bad_label(text, "input layouts, one '->', then output layouts")
    arrow = tokens.index("->")
    try:
        return Candidate(head.group(1), _PASS_OF_ABBREV[head.group(2)], head.group(3),
                         _parse_tensors(text, tokens[:arrow]), _parse_tensors(text, tokens[arrow + 1:]),
                         tuple(options.items()))
    except RecordError as err:
        raise RecordError(f"label {text!r}: {err}") from None


def profile_dir_name(size_name: str, dropout: float) -> str:
    """A size's profile directory at `dropout`: the size's name at the default, else `<name>-dropout<p>`."""
    return size_name if dropout == DEFAULT_DROPOUT else f"{size_name}-dropout{dropout:g}"


def candidate_key(candidate: Candidate, size: Size, gpu: str) -> str:
    """Stable 16-hex-digit key of (op, pass, layouts, impl, options, sizes, dtype, gpu).

    Left out on purpose: `covers` (a description, not a different measurement), the input/output
    split and argument order (the sorted layouts column; argument swaps belong in options), and
    versions (stamped on each row instead, so delete or move a profile to re-time after an upgrade).
    """
    identity = {"op": candidate.op, "pass": candidate.pass_, "layouts": candidate.layouts, "impl": candidate.impl,
                "options": candidate.options_dict, "sizes": size.dims(), "dtype": size.dtype, "gpu": gpu}
    return hashlib.sha256(_canonical_json(identity).encode("ascii")).hexdigest()[:16]


def _cell(value: object) -> str:
    """The CSV text of one value: NaN is an empty cell, floats round-trip through repr."""
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)


def _check(column: str, ok: object, expected: str, value: object) -> None:
    if not ok:
        raise RecordError(f"column {column!r}: expected {expected}, got {_cell(value)!r}")


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ProfileRow:
    """One timed candidate. Field order is the CSV column order; `pass_` is written as column `pass`."""

    format_version: int
    key: str
    op: str
    pass_: str
    covers: str
    layouts: str
    impl: str
    options: str
    label: str
    B: int
    L: int
    H: int
    P: int
    I: int
    U: int
    dtype: str
    dropout: float  # the profiling run's dropout probability; NaN (an empty cell): a run without dropout (GEMMs)
    gpu: str
    versions: str
    runs: int
    median_us: float
    min_us: float
    status: str
    error: str

    def __post_init__(self) -> None:
        _check("format_version", self.format_version == FORMAT_VERSION,
               f"{FORMAT_VERSION}, the only format version this reader supports", self.format_version)
        _check("key", isinstance(self.key, str) and _KEY.fullmatch(self.key), "16 hex digits", self.key)
        self._check_candidate_columns()
        for dim in _DIMS:
            _check(dim, _is_int(getattr(self, dim)) and getattr(self, dim) > 0, "a positive integer",
                   getattr(self, dim))
        _check("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}", self.dtype)
        _check("dropout", isinstance(self.dropout, float) and (math.isnan(self.dropout) or 0 <= self.dropout < 1),
               "a probability in [0, 1), or an empty cell", self.dropout)
        _check("gpu", isinstance(self.gpu, str) and self.gpu.strip(), "a GPU name", self.gpu)
        _check("versions", _is_json_object(self.versions), "a JSON object", self.versions)
        self._check_timing()

    def _check_candidate_columns(self) -> None:
        _check("op", isinstance(self.op, str) and _NAME.fullmatch(self.op), "an operator name", self.op)
        _check("pass", self.pass_ in PASSES, f"one of {', '.join(PASSES)}", self.pass_)
        _check("covers", isinstance(self.covers, str) and self.covers.split()
               and all(_NAME.fullmatch(name) for name in self.covers.split()),
               "space-separated operator names", self.covers)
        _check("layouts", isinstance(self.layouts, str) and self.layouts.split()
               and all(_TENSOR.fullmatch(token) for token in self.layouts.split()),
               "space-separated NAME:letters tokens such as 'X:bji'", self.layouts)
        _check("impl", isinstance(self.impl, str) and _NAME.fullmatch(self.impl), "an implementation name", self.impl)
        _check("options", _is_json_object(self.options), "a JSON object", self.options)
        try:
            candidate = parse_label(self.label)
        except RecordError as err:
            raise RecordError(f"column 'label': {err}") from None
        _check("label", (candidate.op, candidate.pass_, candidate.impl, candidate.layouts, candidate.options_json)
               == (self.op, self.pass_, self.impl, self.layouts, _canonical_json(json.loads(self.options))),
               "a label that agrees with the op, pass, impl, layouts and options columns", self.label)

    def _check_timing(self) -> None:
        _check("runs", _is_int(self.runs) and self.runs >= 0, "a non-negative integer", self.runs)
        for column in ("median_us", "min_us"):
            value = getattr(self, column)
            _check(column, isinstance(value, float) and (math.isnan(value) or 0 <= value < math.inf),
                   "a non-negative number or an empty cell", value)
        _check("status", self.status in STATUSES, f"one of {', '.join(STATUSES)}", self.status)
        _check("error", isinstance(self.error, str), "a text", self.error)
        if self.status == "ok":
            _check("runs", self.runs >= 1, "at least 1 run in an ok row", self.runs)
            _check("median_us", not math.isnan(self.median_us), "a time in an ok row", self.median_us)
            _check("min_us", not math.isnan(self.min_us), "a time in an ok row", self.min_us)
            _check("min_us", self.min_us <= self.median_us, f"at most median_us={self.median_us!r}", self.min_us)
        else:
            _check("error", self.error.strip(), f"the reason in a {self.status} row", self.error)

    @classmethod
    def make(cls, candidate: Candidate, size: Size, gpu: str, versions: Mapping[str, str], runs: int,
             median_us: float | None, min_us: float | None, status: str = "ok", error: str = "", *,
             dropout: float | None) -> ProfileRow:
        """A row for `candidate` on `size` and `gpu`, timed by a run at dropout probability `dropout` (None: the
        contraction profiler's, which has no dropout); times in microseconds, None when not measured."""
        return cls(format_version=FORMAT_VERSION, key=candidate_key(candidate, size, gpu), op=candidate.op,
                   pass_=candidate.pass_, covers=" ".join(candidate.covers), layouts=candidate.layouts,
                   impl=candidate.impl, options=candidate.options_json, label=candidate.label, **size.dims(),
                   dtype=size.dtype, dropout=math.nan if dropout is None else float(dropout), gpu=gpu,
                   versions=_canonical_json(dict(versions)), runs=runs,
                   median_us=math.nan if median_us is None else float(median_us),
                   min_us=math.nan if min_us is None else float(min_us), status=status, error=error)

    @property
    def candidate(self) -> Candidate:
        """The timed Candidate, rebuilt from the label and the covers column."""
        return dataclasses.replace(parse_label(self.label), covers=tuple(self.covers.split()))

    @property
    def size(self) -> Size:
        return Size(**{dim: getattr(self, dim) for dim in _DIMS}, dtype=self.dtype)

    def to_dict(self) -> dict[str, object]:
        """Column name -> value, in column order (`pass`, not `pass_`)."""
        return {column: getattr(self, field) for column, field in _FIELDS.items()}

    def to_cells(self) -> list[str]:
        """The row as CSV cell texts, in column order."""
        return [_cell(value) for value in self.to_dict().values()]


# Column name -> dataclass field; `pass` is a keyword, so the field is `pass_`.
_FIELDS = {("pass" if f.name == "pass_" else f.name): f.name for f in dataclasses.fields(ProfileRow)}
COLUMNS: tuple[str, ...] = tuple(_FIELDS)
_INT_COLUMNS = ("format_version", *_DIMS, "runs")
_FLOAT_COLUMNS = ("dropout", "median_us", "min_us")
FORMAT_1_COLUMNS: tuple[str, ...] = tuple(column for column in COLUMNS if column != "dropout")


def _parse_int(text: str) -> int:
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(f"expected an integer, got {text!r}")
    return int(text)


def _parse_float(text: str) -> float:
    if not text.strip():
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number or an empty cell, got {text!r}") from None


def _parse_version(text: str, expected: int) -> int:
    # Checked before the other cells: a newer format may spell them differently.
    version = _parse_int(text)
    if version != expected:
        raise ValueError(f"expected format version {expected} (the header's), got {text!r}")
    return version


def _convert(column: str, text: str, version: int) -> object:
    if column == "format_version":
        return _parse_version(text, version)
    if column in _INT_COLUMNS:
        return _parse_int(text)
    return _parse_float(text) if column in _FLOAT_COLUMNS else text


def _check_header(path: Path, header: list[str]) -> int:
    """The format version of a header that is exactly COLUMNS (or format 1's, FORMAT_1_COLUMNS); RecordError
    naming what is missing, unknown or out of order otherwise."""
    if header == list(COLUMNS):
        return FORMAT_VERSION
    if header == list(FORMAT_1_COLUMNS):
        return 1
    missing = [column for column in COLUMNS if column not in header]
    unknown = [column for column in header if column not in COLUMNS]
    if missing or unknown:
        detail = f"missing columns {missing}, unknown columns {unknown}"
    else:
        detail = f"columns out of order or repeated: got {header}"
    raise RecordError(f"{path}:1: header does not match profile format {FORMAT_VERSION}: {detail}; "
                      f"expected {','.join(COLUMNS)}")


def _parse_row(path: Path, line: int, cells: list[str], version: int) -> ProfileRow:
    """A row in the current format, whichever format (`version`) its file is in."""
    columns = COLUMNS if version == FORMAT_VERSION else FORMAT_1_COLUMNS
    if len(cells) != len(columns):
        raise RecordError(f"{path}:{line}: expected {len(columns)} cells, got {len(cells)}")
    values: dict[str, object] = {"dropout": FORMAT_1_DROPOUT}
    for column, text in zip(columns, cells):
        try:
            values[_FIELDS[column]] = _convert(column, text, version)
        except ValueError as err:
            raise RecordError(f"{path}:{line}: column {column!r}: {err}") from None
    values["format_version"] = FORMAT_VERSION
    try:
        return ProfileRow(**values)  # type: ignore[arg-type]
    except RecordError as err:
        raise RecordError(f"{path}:{line}: {err}") from None


def read_rows(path: str | os.PathLike[str]) -> list[ProfileRow]:
    """Every row of a profile file (`.csv`, or `.csv.gz`), validated; RecordError names file, line
    (header = 1) and column. A format-1 file's rows come back in the current format, at FORMAT_1_DROPOUT."""
    return _read(path)[1]


def _read(path: str | os.PathLike[str]) -> tuple[int, list[ProfileRow]]:
    """The file's format version and its rows (in the current format)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open  # shipped profiles are committed compressed
    try:
        file = opener(path, "rt", newline="", encoding="utf-8")
    except FileNotFoundError:
        raise RecordError(f"{path}: no such profile file") from None
    try:
        with file:
            return _read_records(path, csv.reader(file))
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as err:  # gzip.BadGzipFile is an OSError
        raise RecordError(f"{path}: not a readable profile (corrupt or truncated{' gzip' if opener is gzip.open else ''}"
                          f" file: {type(err).__name__}: {err}); profile again, or restore the file") from None


def _read_records(path: Path, reader) -> tuple[int, list[ProfileRow]]:
    header = next(reader, None)
    if header is None:
        raise RecordError(f"{path}: empty file, expected the header {','.join(COLUMNS)}")
    version = _check_header(path, header)
    rows: list[ProfileRow] = []
    first_line: dict[str, int] = {}
    line = reader.line_num + 1  # a quoted cell may span lines: a record starts after the previous one
    for cells in reader:
        if cells:  # blank lines (an editor's trailing newline) carry no row
            row = _parse_row(path, line, cells, version)
            if row.key in first_line:
                raise RecordError(f"{path}:{line}: column 'key': {row.key!r} repeats line {first_line[row.key]}")
            first_line[row.key] = line
            rows.append(row)
        line = reader.line_num + 1
    return version, rows


def load_records(path: str | os.PathLike[str]) -> pd.DataFrame:
    """A profile file as a DataFrame with the CSV's columns; ints are int64, times float64 (NaN when empty)."""
    frame = pd.DataFrame([row.to_dict() for row in read_rows(path)], columns=list(COLUMNS))
    dtypes = {column: "int64" for column in _INT_COLUMNS} | {column: "float64" for column in _FLOAT_COLUMNS}
    return frame.astype({column: dtypes.get(column, "str") for column in COLUMNS})


def _rewrite(path: Path, rows: list[ProfileRow]) -> None:
    """The file again, its rows in the current format: a temporary file, then a rename (never half a file)."""
    staged = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(staged, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(row.to_cells() for row in rows)
    os.replace(staged, path)


class RecordWriter:
    """Appends rows to a profile CSV, one flushed write per row; `key in writer` tells a resumed run what to skip.

    One writer per file: rows from several processes must go through one of them.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        version, rows = (FORMAT_VERSION, []) if is_new else _read(self.path)
        if version != FORMAT_VERSION:
            _rewrite(self.path, rows)  # rows of two formats never share a file
        self._keys = {row.key for row in rows}
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        if is_new:
            self._append(list(COLUMNS))

    def _append(self, cells: list[str]) -> None:
        # One write per row, flushed and synced: a crash cannot leave half a row behind a whole one.
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow(cells)
        self._file.write(buffer.getvalue())
        self._file.flush()
        os.fsync(self._file.fileno())

    def has(self, key: str) -> bool:
        """Whether a row with this key is already in the file."""
        return key in self._keys

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def write(self, row: ProfileRow) -> None:
        """Append one row and flush it; RecordError if its key is already in the file."""
        if not isinstance(row, ProfileRow):
            raise TypeError(f"row={row!r}, expected a ProfileRow")
        if row.key in self._keys:
            raise RecordError(f"{self.path}: key {row.key} ({row.label}) is already recorded; "
                              f"check `key in writer` before timing")
        self._append(row.to_cells())
        self._keys.add(row.key)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
