"""Which kernel module implements each fused operator of the graph."""
from __future__ import annotations

import importlib
from types import ModuleType

from substation.errors import GraphError

# Every module lists its operators in OPS and offers variants(op, size, dtype, layouts) -> [KernelParams].
MODULES = ("softmax", "layernorm", "elementwise")


def registry() -> dict[str, ModuleType]:
    modules = [importlib.import_module(f"substation.kernels.{name}") for name in MODULES]
    return {op: module for module in modules for op in module.OPS}


def kernel_module(op: str) -> ModuleType:
    known = registry()
    if op not in known:
        raise GraphError(f"no kernel implements {op!r}; kernels exist for: {', '.join(known)}")
    return known[op]
