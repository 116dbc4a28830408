"""With `$SUBSTATION_RECORD_KERNELS` naming a file, a test run writes there every kernel it compiled (cached or not),
one JSON line each (`scripts/build_gpu_test_kernels.py`'s `encode`), so that the build script can build them all
ahead, without a GPU, for a later run on a fresh machine. Each kernel is appended as it is first compiled, so a run
stopped by a time limit leaves what it reached; a run that ends sorts the file. Kernels that profiling tests build
in their worker processes are not seen. Off (nothing patched) unless the variable is set."""
import contextlib
import importlib.util
import os
import threading
from pathlib import Path

import pytest

BUILD_SCRIPT = Path(__file__).parents[1] / "scripts" / "build_gpu_test_kernels.py"


def build_script():
    spec = importlib.util.spec_from_file_location("build_gpu_test_kernels", BUILD_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def kernel_classes() -> tuple[type, ...]:
    """The classes whose `compile` builds one kernel (a compound, like a GEMM with its bias-gradient kernel, compiles
    through these)."""
    from substation.kernels.base import KernelParams
    from substation.kernels.bias_grad import BiasGradient
    from substation.kernels.convert import Conversion
    from substation.kernels.gemm_epilogue import GemmEpilogueVariant

    return KernelParams, BiasGradient, Conversion, GemmEpilogueVariant


def recording(compile_method, note):
    def compile(self, *args, **kwargs):
        note(self)
        return compile_method(self, *args, **kwargs)
    return compile


@contextlib.contextmanager
def recording_kernels(target: Path):
    """Within: every kernel compiled is appended to `target` (emptied first) the first time; at the end the file is
    sorted."""
    encode, lines, lock = build_script().encode, set(), threading.Lock()  # fixtures compile on threads
    target.write_text("", encoding="utf-8")

    def note(kernel) -> None:
        line = encode(kernel)
        with lock:
            if line not in lines:
                lines.add(line)
                with target.open("a", encoding="utf-8") as out:
                    out.write(f"{line}\n")

    originals = {cls: cls.__dict__["compile"] for cls in kernel_classes()}
    for cls, method in originals.items():
        cls.compile = recording(method, note)
    try:
        yield
    finally:
        for cls, method in originals.items():
            cls.compile = method
        target.write_text("".join(f"{line}\n" for line in sorted(lines)), encoding="utf-8")


@pytest.fixture(scope="session", autouse=True)
def record_compiled_kernels():
    target = os.environ.get("SUBSTATION_RECORD_KERNELS")
    if not target:
        yield
        return
    target = Path(target)
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # under pytest-xdist: a file per worker, to merge (sort -u)
    with recording_kernels(target.with_name(f"{target.stem}-{worker}{target.suffix}") if worker else target):
        yield
