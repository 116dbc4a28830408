"""The README's Python examples run as written, so they cannot rot: on the CPU reference path, and those
that move the layer to a GPU (`.cuda()`) where there is one."""
import re
from pathlib import Path

import torch

README = Path(__file__).parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "the README shows at least one Python example"
    for block in blocks:
        if ".cuda()" in block and not torch.cuda.is_available():
            continue
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
        if "y" in namespace:
            assert namespace["y"].shape == namespace["x"].shape
            assert namespace["x"].grad is not None and namespace["x"].grad.abs().sum() > 0


def test_every_mention_of_the_design_document_resolves():
    root = README.parent
    assert (root / "docs" / "DESIGN.md").is_file()
    files = [p for p in root.rglob("*") if p.suffix in (".py", ".md") and p != Path(__file__) and not any(
        part.startswith(".") or part in ("build", "docs") for part in p.relative_to(root).parts)]
    bare = [str(p.relative_to(root)) for p in files if re.search(r"(?<!docs/)\bDESIGN\.md", p.read_text("utf-8"))]
    assert not bare, f"these files name the design document without its folder: {bare}"
