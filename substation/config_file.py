"""Layout configuration files: `layouts/NAME.pickle` and its `.json` twin, one dict of builtins (docs/DESIGN.md).

The optimizer makes the dict (`config_selection.config_file.configuration_dict`); this core module writes it
twice (pickle, JSON) and reads either back through a restricted unpickler that refuses every global (so
only str, int, float, bool, None, list and dict come back), checking the format version, size, dtype and
every layout against the graph; `to_configuration` turns the result into a `Configuration`. The Encoder
reads configurations through this module and needs nothing of the optimizer.

Besides the size, dtype, GPU, layouts and choices, the dict holds `free_user_layouts`, `deterministic` (whether
every chosen row gives the same bits on every run: false only where `optimize --nondeterministic` took a row that
adds up by float atomics; absent in files written before it), `unmaterialized`
(tensors that live only inside a chosen multi-operator row; they carry their canonical layout), `transposes`
(split variables whose backward layout differs), `solves` (solver, status, model size, seconds), and per
operator `covers`. A row covering several operators appears under each of them; its whole `predicted_us` is
booked on the first one and 0.0 on the others, so the operators' times plus the transposes sum to
`predicted_total_us`.

`dropout` is the dropout probability the profile's kernels were timed at (absent in files written before it:
0.1); the choices hold at any dropout, but are the fastest only near it.

`sizes` lists the sizes the configuration was chosen for, each with its weight in the optimizer's objective (the
weighted sum of the layer's times), its predicted and default totals and its profile; the first is `size`, whose
GEMM calls and times the rest of the file records. Only B and L differ between them. Files written before
`sizes` existed have one size, weight 1 (`configuration_sizes`).
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from substation.errors import ConfigurationFileError, LayoutError, SizeError
from substation.graph import LayerGraph, layer_graph
from substation.layouts import Configuration, check_layout
from substation.records import FORMAT_1_DROPOUT
from substation.sizes import DTYPES, Size

FORMAT_VERSION = 1
_REQUIRED = ("format_version", "size", "dtype", "gpu", "graph_order", "split_vars", "tensors", "operators",
             "predicted_total_us", "default_total_us", "profile", "created", "substation_version")
_OPERATOR_FIELDS = ("impl", "options", "layouts", "label", "predicted_us")


def _write_atomically(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary beside it, renamed over it, removed if anything fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigurationFileError(f"{path}: cannot write the configuration ({err.strerror or err})") from None


def json_twin(path: str | os.PathLike[str]) -> Path:
    """`layouts/NAME.json` beside `layouts/NAME.pickle`."""
    return Path(path).with_suffix(".json")


def write_configuration_dict(data: Mapping[str, object], path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write `path` (pickle) and its JSON twin from one dict of builtins; returns both paths."""
    path = Path(path)
    if path.suffix != ".pickle":
        raise ConfigurationFileError(f"output {str(path)!r}: expected a path ending in .pickle (the .json twin "
                                     f"is written beside it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, pickle.dumps(dict(data), protocol=4))
    twin = json_twin(path)
    _write_atomically(twin, (json.dumps(data, indent=1, allow_nan=False) + "\n").encode())
    return path, twin


class _BuiltinsOnly(pickle.Unpickler):
    """Refuses every global: a configuration is str, int, float, bool, None, list and dict only."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a configuration holds builtins only")


def _fail(path: Path, field: str, expected: str, given: object) -> NoReturn:
    raise ConfigurationFileError(f"{path}: field {field}: expected {expected}, got {given!r}")


def _check_builtins(path: Path, value: object, field: str = "<top>") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                _fail(path, field, "string keys", key)
            _check_builtins(path, item, f"{key}" if field == "<top>" else f"{field}.{key}")
    elif isinstance(value, list):
        for n, item in enumerate(value):
            _check_builtins(path, item, f"{field}[{n}]")
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        _fail(path, field, "str, int, float, bool, None, list or dict", type(value).__name__)


def _read(path: Path) -> object:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigurationFileError(f"{path}: cannot read the configuration ({err.strerror or err})") from None
    try:
        if path.suffix == ".json":
            return json.loads(data)
        return _BuiltinsOnly(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, OverflowError, RecursionError) as err:
        what = "JSON" if path.suffix == ".json" else "pickle"
        raise ConfigurationFileError(f"{path}: not a configuration {what}: corrupt or truncated "
                                     f"({type(err).__name__}: {err})") from None


def _check_header(path: Path, data: Mapping[str, object], size: Size | None) -> Size:
    if data.get("format_version") != FORMAT_VERSION:
        _fail(path, "format_version", f"{FORMAT_VERSION} (the only version this reader supports)",
              data.get("format_version"))
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        _fail(path, missing[0], "a value (the field is missing)", None)
    dims = data["size"]
    if not isinstance(dims, dict) or sorted(dims) != sorted("BLHPIU"):
        _fail(path, "size", "{B, L, H, P, I, U}", dims)
    if data["dtype"] not in DTYPES:
        _fail(path, "dtype", f"one of {', '.join(DTYPES)}", data["dtype"])
    try:
        given = Size(**dims, dtype=data["dtype"])  # type: ignore[arg-type]
    except SizeError as err:
        raise ConfigurationFileError(f"{path}: field size: {err}") from None
    if size is not None and given.dims() != size.dims():
        _fail(path, "size", str(size.dims()), given.dims())
    if size is not None and given.dtype != size.dtype:
        _fail(path, "dtype", repr(size.dtype), given.dtype)
    for key in ("predicted_total_us",):
        if not _finite(data[key]):
            _fail(path, key, "a finite number", data[key])
    dropout = data.get("dropout")
    if dropout is not None and not (_finite(dropout) and 0 <= dropout < 1):
        _fail(path, "dropout", "a probability in [0, 1), or null", dropout)
    if "sizes" in data:
        _check_sizes(path, data["sizes"], given)
    return given


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_sizes(path: Path, sizes: object, given: Size) -> None:
    """`sizes`: the file's own size first, then others of its layer shape (other B and L), each once, weighted."""
    if not isinstance(sizes, list) or not sizes:
        _fail(path, "sizes", "a non-empty list of {size, weight, ...}", sizes)
    seen = []
    for n, entry in enumerate(sizes):
        field = f"sizes[{n}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), dict) or "weight" not in entry:
            _fail(path, field, "a dict with size {B, L, H, P, I, U} and weight", entry)
        try:
            size = Size(**entry["size"], dtype=given.dtype)
        except (SizeError, TypeError) as err:
            raise ConfigurationFileError(f"{path}: field {field}.size: {err}") from None
        if not _finite(entry["weight"]) or not entry["weight"] > 0:
            _fail(path, f"{field}.weight", "a positive finite number", entry["weight"])
        want = given.dims() if n == 0 else {**given.dims(), "B": size.B, "L": size.L}
        if size.dims() != want or size.dims() in seen:
            expected = "the file's size" if n == 0 else "a size of another B or L only, each once"
            _fail(path, f"{field}.size", f"{expected} ({given.dims()})", entry["size"])
        seen.append(size.dims())


def configuration_sizes(data: Mapping[str, object]) -> tuple[tuple[Size, float], ...]:
    """(size, weight) of every size a loaded configuration was chosen for, its own first (module docstring)."""
    dtype = str(data["dtype"])
    entries = data.get("sizes") or [{"size": data["size"], "weight": 1.0}]
    return tuple((Size(**entry["size"], dtype=dtype), float(entry["weight"])) for entry in entries)  # type: ignore


def configuration_dropout(data: Mapping[str, object]) -> float | None:
    """The dropout probability the kernels of a loaded configuration's profile were timed at (None: none was).
    Files written before the field came from profiles of format 1, all timed at FORMAT_1_DROPOUT."""
    return data["dropout"] if "dropout" in data else FORMAT_1_DROPOUT  # type: ignore[return-value]


def _check_tensors(path: Path, data: Mapping[str, object], graph: LayerGraph) -> None:
    tensors, split = data["tensors"], data["split_vars"]
    if not isinstance(tensors, dict) or sorted(tensors) != sorted(graph.tensors):
        given = sorted(tensors) if isinstance(tensors, dict) else tensors
        _fail(path, "tensors", f"a layout for each of {sorted(graph.tensors)}", given)
    if not isinstance(split, list) or any(not isinstance(t, str) or t not in graph.tensors for t in split):
        _fail(path, "split_vars", "a list of tensor names", split)
    for name, value in tensors.items():
        if name in split:
            if not isinstance(value, dict) or sorted(value) != ["backward", "forward"]:
                _fail(path, f"tensors.{name}", "{forward, backward} (a split variable)", value)
            layouts = {f"tensors.{name}.{k}": v for k, v in value.items()}
        else:
            layouts = {f"tensors.{name}": value}
        for field, layout in layouts.items():
            try:
                check_layout(name, graph.tensors[name].dims, layout)
            except LayoutError:
                _fail(path, field, f"an order of {graph.tensors[name].dims!r}", layout)


def _check_operators(path: Path, data: Mapping[str, object], graph: LayerGraph, config: Configuration) -> None:
    operators = data["operators"]
    if not isinstance(operators, dict) or sorted(operators) != sorted(op.name for op in graph.operators):
        given = sorted(operators) if isinstance(operators, dict) else operators
        _fail(path, "operators", f"an entry for each of {sorted(op.name for op in graph.operators)}", given)
    hidden = set(data.get("unmaterialized", []))
    for op in graph.operators:
        entry = operators[op.name]
        field = f"operators.{op.name}"
        if not isinstance(entry, dict) or any(key not in entry for key in _OPERATOR_FIELDS):
            _fail(path, field, f"a dict with {', '.join(_OPERATOR_FIELDS)}", entry)
        if not isinstance(entry["layouts"], dict):
            _fail(path, f"{field}.layouts", "a dict tensor -> layout", entry["layouts"])
        if not isinstance(entry["predicted_us"], (int, float)) or not entry["predicted_us"] >= 0:
            _fail(path, f"{field}.predicted_us", "a non-negative number", entry["predicted_us"])
        for tensor, layout in entry["layouts"].items():
            if tensor not in graph.tensors:
                _fail(path, f"{field}.layouts", "tensors of the graph", tensor)
            want = config.layout(tensor, op.pass_)
            if tensor in op.inputs + op.outputs and tensor not in hidden and layout != want:
                _fail(path, f"{field}.layouts.{tensor}", f"{want!r} (its layout in tensors.{tensor})", layout)


def load_configuration(path: str | os.PathLike[str], size: Size | None = None,
                       graph: LayerGraph | None = None) -> dict[str, object]:
    """A configuration file (pickle, or the `.json` twin), checked; `size` also pins size and dtype.

    ConfigurationFileError names the field, the expected and the given value: corrupt or truncated
    file, a global in the pickle, another format version, another size or dtype, a layout that is not
    an order of its tensor's dims, a broken tie or user-visible layout, an operator layout that
    disagrees with its tensor's.
    """
    path, graph = Path(path), graph or layer_graph()
    data = _read(path)
    _check_builtins(path, data)
    if not isinstance(data, dict):
        _fail(path, "<top>", "a dict", type(data).__name__)
    _check_header(path, data, size)
    _check_tensors(path, data, graph)
    try:
        config = to_configuration(data)
    except LayoutError as err:
        raise ConfigurationFileError(f"{path}: field tensors: {err}") from None
    _check_operators(path, data, graph, config)
    return data


def to_configuration(data: Mapping[str, object]) -> Configuration:
    """The `substation.layouts.Configuration` of a loaded configuration dict (LayoutError if it breaks a rule)."""
    tensors: Mapping[str, object] = data["tensors"]  # type: ignore[assignment]
    layouts = {name: value["forward"] if isinstance(value, dict) else value for name, value in tensors.items()}
    backward = {name: value["backward"] for name, value in tensors.items() if isinstance(value, dict)}
    return Configuration(layouts, backward, free_user_layouts=bool(data.get("free_user_layouts", False)))
