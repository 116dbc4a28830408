"""What the optimizer writes into a layout configuration file: `configuration_dict` is the one place its content
is made from a `Selection`; `substation.config_file` writes it (pickle and JSON twin), reads it back and says
what its fields hold.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from pathlib import Path

from substation.config_file import FORMAT_VERSION, write_configuration_dict
from substation.config_selection.multisize import AtSize
from substation.config_selection.orders import row_deterministic
from substation.config_selection.selection import Selection
from substation.errors import SelectionError
from substation.graph import layer_graph
from substation.implementations import registry
from substation.version import __version__


def _operator_entries(selection: Selection) -> dict[str, dict[str, object]]:
    entries: dict[str, dict[str, object]] = {}
    for choice in selection.choices:
        row = choice.row
        for n, op in enumerate(row.covers):
            entries[op] = {"impl": row.impl, "options": row.options_dict, "layouts": dict(row.layouts),
                           "label": row.label, "predicted_us": row.median_us if n == 0 else 0.0,
                           "covers": list(row.covers)}
    return entries


def deterministic(selection: Selection) -> bool:
    """Whether every chosen row gives the same bits on every run (`row_deterministic`)."""
    implementations = registry(layer_graph())
    return all(row_deterministic(choice.row, implementations) for choice in selection.choices)


def _profile_entry(selection: Selection) -> dict[str, object]:
    return {"path": selection.profile_path, "sha256": selection.profile_sha256,
            "excluded_impls": list(selection.excluded_impls)}


def _size_entry(at: AtSize) -> dict[str, object]:
    selection = at.selection
    return {"size": selection.size.dims(), "weight": at.weight, "predicted_total_us": selection.predicted_total_us,
            "default_total_us": selection.default.total_us,
            "profile": _profile_entry(selection)}


def configuration_dict(selection: Selection, sizes: Sequence[AtSize] = ()) -> dict[str, object]:
    """The file content: plain builtins only, the same dict for the pickle and the JSON twin.

    `sizes`: the configuration at every size it was chosen for (`multisize.for_sizes`), `selection` first; by
    default its own size alone, weight 1. The rest of the file is `selection`'s: its size, its GEMM calls, its
    times."""
    if sizes and sizes[0].selection.size != selection.size:
        raise SelectionError(f"sizes[0] is of {sizes[0].selection.size.dims()}, not the selection's own "
                             f"{selection.size.dims()}: the configuration's size comes first")
    tensors: dict[str, object] = dict(selection.layouts)
    tensors.update({t: {"forward": selection.layouts[t], "backward": selection.backward[t]}
                    for t in selection.split_vars})
    return {
        "format_version": FORMAT_VERSION,
        "size": selection.size.dims(),
        "dtype": selection.size.dtype,
        "gpu": selection.gpu,
        "dropout": selection.profile_dropout,
        "graph_order": selection.graph_order,
        "split_vars": list(selection.split_vars),
        "free_user_layouts": selection.free_user_layouts,
        "deterministic": deterministic(selection),
        "tensors": tensors,
        "unmaterialized": list(selection.unmaterialized),
        "operators": _operator_entries(selection),
        "transposes": {t.tensor: {"forward": t.forward, "backward": t.backward, "us": t.us, "source": t.source}
                       for t in selection.transposes},
        "predicted_total_us": selection.predicted_total_us,
        "default_total_us": selection.default.total_us,
        "profile": _profile_entry(selection),
        "sizes": [_size_entry(at) for at in sizes or (AtSize(selection, 1.0),)],
        "solves": [{"solver": s.solver, "status": s.status, "optimal": s.optimal, "operators": s.operators,
                    "binaries": s.binaries, "continuous": s.continuous, "constraints": s.constraints,
                    "seconds": s.seconds} for s in selection.solves],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "substation_version": __version__,
    }


def write_configuration(selection: Selection, path: str | os.PathLike[str],
                        sizes: Sequence[AtSize] = ()) -> tuple[Path, Path]:
    """Write `path` (pickle) and its JSON twin from one `configuration_dict`; returns both paths."""
    return write_configuration_dict(configuration_dict(selection, sizes), path)
