"""The package's layering, read from the source: every import (function-level ones included) points down the
pipeline (core <- implementations <- optimizer <- runtime), and no modules import each other in a cycle."""
import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).parents[1]
# Folder -> the package it is installed as (setup.py's package_dir).
PACKAGES = {"substation": "substation", "tc_profiling": "substation.tc_profiling", "kernels": "substation.kernels",
            "config_selection": "substation.config_selection"}
LAYERS = ("core", "implementations", "optimizer", "runtime", "interface")
CORE = {"errors", "sizes", "graph", "layouts", "records", "reference", "dropout", "analysis", "protocol", "config_file",
        "version", "device", "launch", "jit", "timing", "torch_ops", "accuracy", "profiling", "isolation",
        "shipped"}
RUNTIME = {"runtime", "encoder", "graphed", "layer_op", "baselines", "benchmark", "mixed_precision", "stack",
           "lengths"}
# The front door, the command line and the transformers adapter: on top.
INTERFACE = {"substation", "substation.cli", "substation.__main__", "substation.inject"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def layer(module: str) -> str:
    if module in INTERFACE:
        return "interface"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ("tc_profiling", "kernels") or module == "substation.implementations":
        return "implementations"
    if len(parts) >= 2 and parts[1] == "config_selection":
        return "optimizer"
    if parts[-1] in RUNTIME:
        return "runtime"
    if parts[-1] in CORE:
        return "core"
    raise AssertionError(f"{module} belongs to no layer: add it to tests/test_layering.py")


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path, known: set[str]) -> set[str]:
    """The package's modules that a file imports anywhere in its body (not under `if TYPE_CHECKING:`)."""
    found, todo = set(), [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if _type_checking(node):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
    return {name for name in found if name in known}


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    for module, path in known.items():
        graph.add_node(module)
        graph.add_edges_from((module, target) for target in imports(path, set(known)) if target != module)
    return graph


def test_every_module_has_a_layer():
    for module in modules():
        assert layer(module) in LAYERS


def test_no_import_cycles():
    cycles = [sorted(component) for component in nx.strongly_connected_components(import_graph())
              if len(component) > 1]
    assert not cycles, f"modules importing each other: {cycles}"


def test_imports_point_down_the_pipeline():
    upward = [(a, b) for a, b in import_graph().edges if LAYERS.index(layer(b)) > LAYERS.index(layer(a))]
    assert not upward, "imports from a lower layer into a higher one: " + ", ".join(f"{a} -> {b}" for a, b in upward)


@pytest.mark.parametrize("module,expected", [("substation.graph", "core"), ("substation.kernels.sdpa", "implementations"),
                                             ("substation.config_selection.ilp", "optimizer"),
                                             ("substation.encoder", "runtime")])
def test_layers_are_read_as_intended(module, expected):
    assert layer(module) == expected


def test_the_import_reader_sees_function_level_imports(tmp_path):
    """A test that cannot fail is a defect: the reader must catch an import hidden inside a function."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from substation.runtime import bind_plan\n")
    assert imports(source, {"substation.runtime"}) == {"substation.runtime"}
