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
