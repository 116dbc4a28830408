"""Which kernel module implements each fused operator of the graph."""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

from substation.errors import GraphError
from substation.graph import layer_graph
from substation.kernels.base import KernelParams
from substation.sizes import Size

# Every module lists its operators in OPS, their parameter classes in PARAMS (op -> KernelParams subclass),
# and offers variants(op, size, dtype, layouts) -> [KernelParams].
MODULES = ("softmax", "layernorm", "elementwise")


def registry() -> dict[str, ModuleType]:
    modules = [importlib.import_module(f"substation.kernels.{name}") for name in MODULES]
    return {op: module for module in modules for op in module.OPS}


def kernel_module(op: str) -> ModuleType:
    known = registry()
    if op not in known:
        raise GraphError(f"no kernel implements {op!r}; kernels exist for: {', '.join(known)}")
    return known[op]


def kernel_params(op: str, size: Size, dtype: str, layouts: Mapping[str, str], options: Mapping[str, object]) -> KernelParams:
    """The parameter point a profile row or configuration names (its options are the knobs), checked.

    InfeasibleError names the broken rule (a configuration made for another size breaks one); TypeError
    names an unknown knob.
    """
    operator = layer_graph().operator(op)
    ordered = {name: layouts[name] for name in operator.inputs + operator.outputs}
    params = kernel_module(op).PARAMS[op].at_size(op, size, dtype, ordered, **options)
    params.check()
    return params
