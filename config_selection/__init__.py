"""Stage 2, selection: choose one layout per tensor and one implementation per operator (an ILP).

    profile = load_profile("profiles/h100/bert-large-b8-l512", layer_graph())
    selection = combined(profile, layer_graph())     # SelectOptions(split_vars=("X1",)): only X1 may be split
    write_configuration(selection, "layouts/my.pickle")        # + layouts/my.json
    config = to_configuration(load_configuration("layouts/my.pickle", size=profile.size))

See README.md in this folder for the ILP and measured solver times. The public names load on first use,
so `substation`'s command line can register `optimize` without importing pulp, pandas or networkx.
"""
from __future__ import annotations

import importlib

from substation.config_file import load_configuration, to_configuration

GRAPH_ORDERS = ("combined", "bp_first", "fp_first")
SOLVERS = ("highs", "cbc")

_EXPORTS = {
    "config_file": ("configuration_dict", "write_configuration"),
    "ilp": ("SolverOptions", "SolveStats"),
    "multisize": ("at_size", "combine_profiles", "for_sizes"),
    "orders": ("SELECTORS", "SelectOptions", "bp_first", "combined", "fp_first", "optimize"),
    "profiles": ("CandidateRow", "Profile", "load_profile"),
    "selection": ("DefaultConfiguration", "Selection", "default_configuration", "format_report", "selection_table"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = ["GRAPH_ORDERS", "SOLVERS", "load_configuration", "to_configuration", *sorted(_MODULE_OF)]


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
