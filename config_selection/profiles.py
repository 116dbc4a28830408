"""Load a profile directory (`contractions.csv`, `kernels.csv`) into the candidates the optimizer chooses from.

Both profilers write the same rows (`substation.records`). Here they are read with `load_records`,
checked against each other (one size, one dtype, one GPU) and against the graph (every operator
has at least one measured candidate; every row names known operators and tensors in valid
layouts), and the `ok` rows become `CandidateRow`s. Rows whose op is `transpose_<T>` are not graph
operators: they time the transpose of tensor T that a split variable pays (see `Profile.transposes`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pandas as pd

from substation.errors import ConfigurationFileError, LayoutError, RecordError, SelectionError
from substation.graph import LayerGraph
from substation.implementations import registry
from substation.layouts import check_layout
from substation.records import load_records
from substation.sizes import Size

log = logging.getLogger(__name__)

CONTRACTIONS_CSV = "contractions.csv"
KERNELS_CSV = "kernels.csv"
PROFILE_FILES = (CONTRACTIONS_CSV, KERNELS_CSV)
TRANSPOSE_PREFIX = "transpose_"
DEFAULT_DTYPE = "float16"  # picked when a profile holds several dtypes (the profilers time fp16 and bf16)
_SIZE_COLUMNS = ["B", "L", "H", "P", "I", "U"]


@dataclass(frozen=True)
class CandidateRow:
    """One measured (`ok`) profile row: an implementation of the operators in `covers`.

    `layouts` holds (tensor, letters) for every tensor the row reads or writes, sorted by name, e.g.
    (("QKV", "bjthp"), ("Wqkv", "thpi"), ("X", "bji")). Tensors that only live inside a multi-operator
    cover (S, Pr, A under SDPA) are not named: the row does not materialize them.
    """

    index: int  # position in Profile.rows
    op: str
    pass_: str
    covers: tuple[str, ...]  # graph operators, in graph order
    layouts: tuple[tuple[str, str], ...]
    impl: str
    options: str  # the JSON object of the `options` column
    label: str
    median_us: float
    source: str  # the profile file the row came from

    @cached_property
    def layout_of(self) -> Mapping[str, str]:
        """Tensor name -> layout letters, for the tensors the row names."""
        return dict(self.layouts)

    @property
    def options_dict(self) -> dict[str, object]:
        return json.loads(self.options)


@dataclass(frozen=True)
class Profile:
    """The candidates of one profile directory, all of one size, dtype and GPU."""

    path: str
    files: tuple[str, ...]  # the profile files read, by name (`contractions.csv`, `kernels.csv.gz`, ...)
    sha256: str  # over the files read: name, NUL, bytes (as stored, compressed or not), in PROFILE_FILES order
    size: Size
    gpu: str
    dropout: float | None  # the kernel rows' dropout probability; None where no row was timed with dropout
    rows: tuple[CandidateRow, ...]  # ok rows covering graph operators
    transposes: Mapping[str, CandidateRow] = field(default_factory=dict)  # tensor -> cheapest transpose row

    @cached_property
    def best_us(self) -> Mapping[tuple[str, ...], float]:
        """For each `covers` tuple, the cheapest row's median: an operator's own unconstrained best."""
        best: dict[tuple[str, ...], float] = {}
        for row in self.rows:
            best[row.covers] = min(best.get(row.covers, math.inf), row.median_us)
        return best


def profile_files(directory: Path) -> list[str]:
    """The profile files of a directory, by name: each of PROFILE_FILES as `.csv` or, as shipped, `.csv.gz`."""
    present = []
    for name in PROFILE_FILES:
        found = [n for n in (name, name + ".gz") if (directory / n).is_file()]
        if len(found) > 1:
            raise RecordError(f"{directory}: both {found[0]} and {found[1]}; keep one")
        present += found
    if not present:
        where = "no such directory" if not directory.is_dir() else "found neither" + _size_directories(directory)
        raise RecordError(f"{directory}: no profile: expected {CONTRACTIONS_CSV} and/or {KERNELS_CSV} there "
                          f"(or .csv.gz; {where})")
    return present


def _size_directories(directory: Path) -> str:
    """Where `directory` is the folder `substation profile --out` fills (one profile per size): the advice to name
    those profiles instead."""
    sizes = sorted(sub.name for sub in directory.iterdir() if sub.is_dir() and any(
        (sub / name).is_file() or (sub / f"{name}.gz").is_file() for name in PROFILE_FILES))
    return f"; it holds one profile per size: name one or several of {directory}/{{{','.join(sizes)}}}" if sizes else ""


def _read_frames(directory: Path) -> tuple[list[str], pd.DataFrame, str]:
    """The rows of every profile file present, with a `source` column, and the files' hash."""
    present = profile_files(directory)
    digest = hashlib.sha256()
    frames = []
    for name in present:
        path = directory / name
        digest.update(name.encode() + b"\0" + path.read_bytes())
        frames.append(load_records(path).assign(source=name))
    frame = pd.concat(frames, ignore_index=True)
    if frame.empty:
        raise RecordError(f"{directory}: the profile files {present} hold no rows")
    return present, frame, digest.hexdigest()


def _one_problem(directory: Path, frame: pd.DataFrame, dtype: str | None) -> tuple[pd.DataFrame, Size, str]:
    """Keep rows of `dtype` (default: the only one, or DEFAULT_DTYPE among several); one size and GPU must remain."""
    dtypes = sorted(frame["dtype"].unique())
    if dtype is None and len(dtypes) > 1:
        if DEFAULT_DTYPE not in dtypes:
            raise RecordError(f"{directory}: the profile holds rows of several dtypes {dtypes}; pick one (--dtype)")
        log.info("%s holds rows of dtypes %s; using %s (--dtype picks another)", directory, dtypes, DEFAULT_DTYPE)
        dtype = DEFAULT_DTYPE
    dtype = dtype or dtypes[0]
    if dtype not in dtypes:
        raise RecordError(f"{directory}: no rows of dtype={dtype!r}; the profile holds {dtypes}")
    frame = frame[frame["dtype"] == dtype]
    for what, columns in (("size", _SIZE_COLUMNS), ("GPU", ["gpu"])):
        groups = frame.groupby(columns, sort=True).source.agg(lambda s: sorted(set(s)))
        if len(groups) > 1:
            found = "; ".join(f"{dict(zip(columns, key if isinstance(key, tuple) else (key,)))} in {files}"
                              for key, files in groups.items())
            raise RecordError(f"{directory}: rows of more than one {what}: {found}; a profile holds one problem")
    first = frame.iloc[0]
    size = Size(**{c: int(first[c]) for c in _SIZE_COLUMNS}, dtype=dtype)
    return frame, size, str(first.gpu)


def _one_dropout(directory: Path, frame: pd.DataFrame) -> float | None:
    """The dropout probability the profile was timed at: one for all its rows that were timed with dropout (the
    contraction profiler's rows have none); None where none was."""
    timed = frame.dropna(subset=["dropout"])
    groups = timed.groupby("dropout", sort=True).source.agg(lambda s: sorted(set(s)))
    if len(groups) > 1:
        found = "; ".join(f"dropout {p:g} in {files}" for p, files in groups.items())
        raise RecordError(f"{directory}: rows of more than one dropout probability: {found}; a profile holds one "
                          f"(`substation profile --dropout` writes each to a directory of its own)")
    return float(groups.index[0]) if len(groups) else None


def _check_row(graph: LayerGraph, order: Mapping[str, int],
               record: Mapping[str, object]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The row's covers (sorted by `order`, the graph position) and layouts; RecordError naming file and label."""
    where = f"{record['source']}: row {record['label']!r}"
    covers = str(record["covers"]).split()
    unknown = [name for name in covers if name not in order]
    if unknown:
        raise RecordError(f"{where}: column 'covers': unknown operators {unknown}; "
                          f"known operators: {', '.join(order)}")
    try:
        registry(graph).find(str(record["impl"]), covers)
    except ConfigurationFileError as err:  # the registry's message names the impl, its covers and the known ones
        raise RecordError(f"{where}: column 'impl': {str(err).split(': ', 1)[1]}") from None
    passes = {graph.operator(name).pass_ for name in covers}
    if passes != {record["pass"]}:
        raise RecordError(f"{where}: column 'pass': {record['pass']!r}, but it covers {covers} of pass "
                          f"{sorted(passes)}")
    layouts = tuple(tuple(token.split(":")) for token in str(record["layouts"]).split())
    for tensor, letters in layouts:
        if tensor not in graph.tensors:
            raise RecordError(f"{where}: column 'layouts': unknown tensor {tensor!r}")
        try:
            check_layout(tensor, graph.tensors[tensor].dims, letters)
        except LayoutError as err:
            raise RecordError(f"{where}: column 'layouts': {err}") from None
    return tuple(sorted(covers, key=order.__getitem__)), layouts  # type: ignore[return-value]


def _candidate(index: int, record: Mapping[str, object], covers: tuple[str, ...],
               layouts: tuple[tuple[str, str], ...]) -> CandidateRow:
    median_us = float(record["median_us"])  # type: ignore[arg-type]
    return CandidateRow(index, str(record["op"]), str(record["pass"]), covers, layouts, str(record["impl"]),
                        str(record["options"]), str(record["label"]), median_us, str(record["source"]))


def _check_coverage(directory: Path, graph: LayerGraph, frame: pd.DataFrame, rows: list[CandidateRow]) -> None:
    """SelectionError naming operators without rows, and those whose rows all failed or were infeasible."""
    covered = {name for row in rows for name in row.covers}
    missing = [op.name for op in graph.operators if op.name not in covered]
    if not missing:
        return
    attempted = {name: frame[frame.covers.str.split().apply(lambda c, n=name: n in c)] for name in missing}
    none = [name for name in missing if attempted[name].empty]
    counts = {name: ", ".join(f"{int(n)} {status}" for status, n in rows.status.value_counts().items())
              for name, rows in attempted.items()}
    failed = [f"{name} ({counts[name]}, e.g. {attempted[name].error.iloc[0]!r})"
              for name in missing if not attempted[name].empty]
    parts = ([f"no rows for {', '.join(none)}"] if none else []) + (
        [f"every row failed or was infeasible for {'; '.join(failed)}"] if failed else [])
    raise SelectionError(f"{directory}: operators without a measured candidate: {'; '.join(parts)}. "
                         f"Profile them (substation profile) before optimizing")


def _transposes(graph: LayerGraph, frame: pd.DataFrame) -> dict[str, CandidateRow]:
    """The cheapest ok `transpose_<T>` row of each tensor T."""
    best: dict[str, CandidateRow] = {}
    for record in frame.to_dict(orient="records"):
        tensor = record["op"][len(TRANSPOSE_PREFIX):]
        if tensor not in graph.tensors:
            raise RecordError(f"{record['source']}: row {record['label']!r}: column 'op': {record['op']!r} names "
                              f"no tensor of the graph (transpose rows are 'transpose_<TENSOR>')")
        row = _candidate(-1, record, (record["op"],), ())
        if tensor not in best or row.median_us < best[tensor].median_us:
            best[tensor] = row
    return best


def load_profile(directory: str | Path, graph: LayerGraph, dtype: str | None = None) -> Profile:
    """The ok candidates of a profile directory; RecordError / SelectionError name what does not fit.

    Either CSV (`.csv`, or `.csv.gz` as shipped under layouts/profiles) may be absent, not both. Rows of
    `dtype` are kept; without it, of the only dtype present, or of float16 among several (the profilers
    time float16 and bfloat16 into one file). They must share one size, GPU and dropout probability (the
    contraction rows have none), and every graph operator needs at least one ok row.
    """
    directory = Path(directory)
    files, frame, sha256 = _read_frames(directory)
    frame, size, gpu = _one_problem(directory, frame, dtype)
    dropout = _one_dropout(directory, frame)
    status = {name: int(n) for name, n in frame.status.value_counts().items()}
    log.info("%s: %d rows %s (%s, %s, dropout %s)", directory, len(frame), status, size.dims(), gpu, dropout)
    ok = frame[frame.status == "ok"]
    is_transpose = ok.op.str.startswith(TRANSPOSE_PREFIX)
    rows: list[CandidateRow] = []
    order = {op.name: i for i, op in enumerate(graph.operators)}
    for record in ok[~is_transpose].to_dict(orient="records"):
        rows.append(_candidate(len(rows), record, *_check_row(graph, order, record)))
    _check_coverage(directory, graph, frame[~frame.op.str.startswith(TRANSPOSE_PREFIX)], rows)
    return Profile(str(directory), tuple(files), sha256, size, gpu, dropout, tuple(rows),
                   _transposes(graph, ok[is_transpose]))
