"""The README's Python examples run as written (on the CPU reference path), so they cannot rot."""
import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "the README shows at least one Python example"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
        if "y" in namespace:
            assert namespace["y"].shape == namespace["x"].shape
            assert namespace["x"].grad is not None and namespace["x"].grad.abs().sum() > 0
