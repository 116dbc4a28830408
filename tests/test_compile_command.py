"""`substation compile`: the kernels a configuration binds, at its size and at others, in each dtype asked for, each
kernel built once, a line per size and dtype, and a note where a choice falls back at a size (CPU; nvcc itself
stands in by a recorder here: the real builds are `tests/test_runtime.py`'s and each kernel family's)."""
from pathlib import Path

import pytest

from substation import runtime
from substation.cli import main
from substation.device import H100
from substation.jit import Cubin
from substation.sizes import get_size

SHIPPED = Path(__file__).parents[1] / "layouts" / "h100-bert-large-b8-l512.pickle"


@pytest.fixture
def builds(monkeypatch):
    """Every compile the command asks for, as (B, L, dtype, kernel type, arch), the kernels themselves in `.kernels`;
    every other one 'from the cache'."""

    class Asked(list):
        pass

    asked = Asked()
    asked.kernels = []
    real = runtime.chosen_kernels

    class Recorded:
        def __init__(self, kernel, size):
            self.kernel, self.size = kernel, size

        def compile(self, spec):
            asked.append((self.size.B, self.size.L, self.size.dtype, type(self.kernel).__name__, spec.arch))
            asked.kernels.append(self.kernel)
            return Cubin(Path("kernel.cubin"), spec.arch, cached=len(asked) % 2 == 0)

    monkeypatch.setattr(runtime, "chosen_kernels", lambda choices, config, size, graph=None, spec=H100: [
        Recorded(kernel, size) for kernel in real(choices, config, size, graph, spec)])
    return asked


def test_compile_builds_each_size_and_dtype(builds, capsys):
    assert main(["compile", str(SHIPPED), "--size", "bert-large-b8-l512:B=4,L=77", "--dtype", "float16",
                 "bfloat16"]) == 0
    out, err = capsys.readouterr()
    header, *lines = out.splitlines()[1:]
    rows = [line.split() for line in lines]
    # one column each, whatever the lengths of the configuration's path and the sizes' names
    assert all(line.index(f" {r[1]} ") + 1 == header.index("size") and len(line) == len(header)
               for line, r in zip(lines, rows))
    assert [(r[1], r[2]) for r in rows] == [("bert-large-b8-l512", "float16"), ("bert-large-b8-l512", "bfloat16"),
                                            ("b4-l77-h16-p64-u4096", "float16"), ("b4-l77-h16-p64-u4096", "bfloat16")]
    per_row = [int(r[3]) for r in rows]
    assert sum(per_row) == len(builds) and all(n > 0 for n in per_row)
    assert sum(int(r[4]) for r in rows) == len(builds) - len(builds) // 2  # the odd-numbered builds were fresh
    assert {(b, l, dtype) for b, l, dtype, _, _ in builds} == {(8, 512, "float16"), (8, 512, "bfloat16"),
                                                             (4, 77, "float16"), (4, 77, "bfloat16")}
    assert {arch for *_, arch in builds} == {"sm_90"}
    # At 4 x 77 tokens the fused GEMM's TMA strides break: the operators run one by one there, and the command says so.
    kinds = {(b, kind) for b, _, _, kind, _ in builds}
    assert (8, "GemmEpilogueVariant") in kinds and (4, "GemmEpilogueVariant") not in kinds
    assert "note: b4-l77-h16-p64-u4096" in err and "cutlass_epilogue" in err


def test_compile_builds_every_padded_length_up_to_each_size(builds, capsys):
    """--length-multiple 128: what an Encoder with length_multiple=128 runs, L = 128, 256, 384 and the
    configuration's 512, at its B; a --size's lengths too, up to its own L padded. Such an Encoder runs padded
    batches: the attention backward's split variant is built where L takes three key tiles or more (128 keys a
    tile)."""
    assert main(["compile", str(SHIPPED), "--length-multiple", "128", "--size", "bert-large-b8-l512:B=2,L=200"]) == 0
    rows = [line.split()[1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["bert-large-b8-l512", "b2-l200-h16-p64-u4096", "b8-l128-h16-p64-u4096", "b8-l256-h16-p64-u4096",
                    "b8-l384-h16-p64-u4096", "b2-l128-h16-p64-u4096", "b2-l256-h16-p64-u4096"]
    assert {(b, l) for b, l, *_ in builds} == {(8, 128), (8, 256), (8, 384), (8, 512), (2, 200), (2, 128), (2, 256)}
    split = {(k.B, k.L) for k in builds.kernels if getattr(k, "split_queries", 0)}
    assert split == {(8, 384), (8, 512)}


@pytest.mark.parametrize("bad", ["0", "-64", "2.5"])
def test_compile_refuses_a_length_multiple_that_is_not_a_positive_integer(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", str(SHIPPED), "--length-multiple", bad])
    assert exit_info.value.code == 2 and "not a positive integer" in capsys.readouterr().err


def test_compile_refuses_a_size_of_other_heads(builds, capsys):
    assert main(["compile", str(SHIPPED), "--size", "bert-large-b8-l512:H=12"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "H=16, P=64, U=4096" in err


def test_build_compiles_each_kernel_once_and_says_which_were_fresh():
    calls = []

    class Kernel:
        def __init__(self, name, cached):
            self.name, self.cached = name, cached

        def compile(self, spec):
            calls.append(self.name)
            return Cubin(Path(f"{self.name}.cubin"), spec.arch, self.cached)

    a, b = Kernel("a", cached=False), Kernel("b", cached=True)
    ticks = []
    assert runtime.build([a, b, a], done=lambda: ticks.append(1)) == {a: True, b: False}
    assert sorted(calls) == ["a", "b"] and len(ticks) == 2


def test_profile_compile_only_builds_what_the_kernel_profiler_would_time(monkeypatch, capsys, tmp_path):
    """`profile --compile-only`: every point the kernel profiler plans (here ln1's variants and, as attn_scores is
    named, the fused attention's) goes to one parallel build for this machine's architecture (sm_90 here and on the
    H100), nothing is timed or written under --out, and the line says how many were fresh."""
    from substation.kernels import profiler

    built = []

    def recorded(points, spec):
        built.append((list(points), spec.arch))
        return [Cubin(Path("kernel.cubin"), spec.arch, cached=i % 3 == 0) for i, _ in enumerate(points)]

    monkeypatch.setattr(profiler, "compile_all", recorded)
    monkeypatch.setattr(profiler, "run", lambda *args, **kwargs: pytest.fail("--compile-only timed something"))
    out = tmp_path / "profiles"
    assert main(["profile", "--size", "bert-large-b8-l512:B=2,L=64", "--out", str(out), "--only", "kernels",
                 "--ops", "ln1", "attn_scores", "--compile-only"]) == 0
    ((points, arch),) = built
    want = profiler.plan(get_size("bert-large-b8-l512:B=2,L=64"), ["float16"], ops=["ln1", "attn_scores"])
    assert arch == "sm_90" and points == [*want.attention_kernels, *want.points, *want.gemm_epilogues]
    assert {p.op for p in want.points} == {"ln1"} and want.attention_kernels
    fresh = len(points) - len(range(0, len(points), 3))
    assert f"b2-l64-h16-p64-u4096: {len(points)} kernels for sm_90: {fresh} compiled" in capsys.readouterr().out
    assert not out.exists()
    assert main(["profile", "--size", "bert-large-b8-l512", "--out", str(out), "--only", "contractions",
                 "--compile-only"]) == 0
    assert len(built) == 1 and "nothing to build" in capsys.readouterr().out


def _module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROOT = Path(__file__).parents[1]


def test_the_gpu_test_modules_name_their_builds_for_the_build_script():
    """`scripts/build_gpu_test_kernels.py` imports each GPU test module it lists and builds its `gpu_builds()`: each
    names kernels (the fixtures compile the same lists, so the script builds what the tests would)."""
    script = _module(ROOT / "scripts" / "build_gpu_test_kernels.py")
    found = {name: list(script.test_module(name).gpu_builds()) for name in script.MODULES}
    assert all(kernels and all(callable(k.compile) for k in kernels) for kernels in found.values())
    assert {type(k).__name__ for k in found["tests/kernels/test_gemm_epilogue.py"]} == {"GemmEpilogueVariant"}
    assert {type(k).__name__ for k in found["tests/kernels/test_attention.py"]} == {"AttentionParams",
                                                                                  "AttentionBackwardParams"}


def test_kernels_round_trip_through_the_recorded_list_format():
    """Every kind of kernel the GPU suite compiles comes back from its JSON line equal (the build script's list)."""
    from substation.config_file import load_configuration, to_configuration
    from substation.kernels.bias_grad import BiasGradient
    from substation.kernels.convert import Conversion
    from substation.runtime import chosen_kernels, file_choices
    from substation.sizes import get_size

    script = _module(ROOT / "scripts" / "build_gpu_test_kernels.py")
    kernels = [k for name in script.MODULES for k in script.test_module(name).gpu_builds()]
    for name in ("h100-bert-large-b8-l512", "h100-bert-large-b96-l128"):  # our kernels of every other family
        data = load_configuration(ROOT / "layouts" / f"{name}.pickle")
        size = get_size(name.removeprefix("h100-"), "bfloat16")
        kernels += chosen_kernels(file_choices(data), to_configuration(data), size)
    kernels += [BiasGradient(96, 4096, 1, "float32", stride=4104, out_dtype="float16"),
                Conversion("float32", "float16", 5)]
    assert {type(k).__name__ for k in kernels} >= {"AttentionParams", "GemmEpilogueVariant", "BiasGradient",
                                                   "Conversion", "LayerNormParams"}
    for kernel in kernels:
        line = script.encode(kernel)
        assert "\n" not in line and script.decode(line) == kernel, line


def test_a_recording_run_lists_every_kernel_it_compiled(tmp_path, monkeypatch):
    """`tests/conftest.py`'s recorder (what `$SUBSTATION_RECORD_KERNELS` turns on) writes one line per kernel
    compiled, cached or not, and puts the classes' `compile` back; the build script reads the file back, counting
    lines that name no kernel any more."""
    import substation.kernels.convert as convert
    from substation.device import H100

    conftest, script = _module(ROOT / "tests" / "conftest.py"), _module(ROOT / "scripts" / "build_gpu_test_kernels.py")
    monkeypatch.setattr(convert, "compile_cubin", lambda source, label, arch: label)  # nvcc stands aside
    target, kernels = tmp_path / "kernels.jsonl", [convert.Conversion("float32", "float16", n) for n in (3, 1, 3)]
    original = convert.Conversion.compile
    with conftest.recording_kernels(target):
        assert [k.compile(H100) for k in kernels] == [k.name for k in kernels]
        assert len(target.read_text().splitlines()) == 2  # already there: a run stopped now leaves them
    assert convert.Conversion.compile is original
    assert len(target.read_text().splitlines()) == 2
    target.write_text(target.read_text() + '{"class": "substation.kernels.convert:Gone", "fields": {}}\n')
    listed, stale = script.recorded(target)
    assert sorted(k.count for k in listed) == [1, 3] and stale == 1


def test_the_recorded_gpu_kernel_list_names_kernels_that_exist():
    """`tests/gpu_kernels.jsonl` (what the GPU suite compiles, for the build script) names only kernel classes and
    fields that exist. A renamed knob fails here: record the list again on a GPU, or drop the lines named."""
    script = _module(ROOT / "scripts" / "build_gpu_test_kernels.py")
    lines = script.RECORDED.read_text().splitlines()
    stale = []
    for line in lines:
        try:
            script.decode(line)
        except (ImportError, AttributeError, TypeError, ValueError) as error:
            stale.append(f"{line[:100]}: {error}")
    assert len(lines) > 1000 and not stale, "\n".join(stale[:5])


def test_shipped_builds_every_configuration_shipped_for_the_gpu(builds, capsys):
    """'shipped' stands for what `inject(model, layouts="shipped")` chooses from on this GPU (without one: the
    H100's), each file once even when also named."""
    from substation.shipped import shipped_for

    want = [str(s.path) for s in shipped_for(H100.name)]
    assert main(["compile", "shipped", want[0]]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == want and len(want) >= 3
    assert all(Path(path).name.startswith("h100-") for path in want)
