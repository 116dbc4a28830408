"""qkv_bias, qkv_bias_bwd, bias_gelu, bias_gelu_bwd, residual_bwd kernels: feasibility, labels, rendering + nvcc
for sm_90 (CPU), and on the GPU against the float64 reference in random layouts and awkward sizes, with
deterministic bias gradients and CUDA-graph replay."""
import random

import pytest
import torch

from substation.device import DeviceSpec
from substation.errors import GraphError
from substation.graph import layer_graph
from substation.kernels.base import InfeasibleVariantError
from substation.kernels.elementwise import OPS, PARAMS, SPECS, ElementwiseParams, make_params, variants
from substation.kernels.space import profiled_layout_space
from substation.layouts import enumerate_layouts, logical, stored
from substation.reference import FUSED, OpArgs
from substation.sizes import TORCH_DTYPES as DTYPES
from substation.sizes import Size, get_size
from substation.accuracy import error_budget, relative_error

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GRAPH = layer_graph()
AWKWARD = Size.from_heads(B=3, L=77, H=2, P=24, U=200)
BERT = get_size("bert-large-b8-l512")
ARGS = OpArgs(scale=0.125)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def random_point(rng: random.Random, op: str, size: Size, dtype: str, layouts: dict | None = None
                 ) -> ElementwiseParams:
    """A feasible point with random layouts (unless given) and random knobs, its tile dims mostly tensors'
    innermost dims and its tile extents mostly large, with the widest feasible vector from a random start."""
    operator = GRAPH.operator(op)
    layouts = layouts or {n: rng.choice(enumerate_layouts(GRAPH.tensors[n].dims)) for n in operator.inputs + operator.outputs}
    ext = make_params(op, size, dtype, layouts).extents
    dims = [d for d in SPECS[op].space if d != "t"]
    inner = [lay.replace("k", "j").replace("t", "")[-1] for lay in layouts.values()]
    for _ in range(1000):
        x = rng.choice(inner if rng.random() < 0.7 else dims)
        y = rng.choice([d for d in (inner if rng.random() < 0.7 else dims) if d != x] or [d for d in dims if d != x])
        tx = rng.choice(_divisors(ext[x], 256)[-3:])
        ty = rng.choice(_divisors(ext[y], max(1, 4096 // tx))[-3:])
        loop = rng.choice([""] + [d for d in SPECS[op].space if d not in (x, y)])
        steps = rng.choice(_divisors(ext[loop], 8)[1:] or [1]) if loop else 1
        threads = rng.choice([64, 128, 256])
        for vec in [v for v in (8, 4, 2, 1) if v <= rng.choice((8, 4, 2, 1))]:
            params = make_params(op, size, dtype, layouts, tile=x + y, tx=tx, ty=ty, loop=loop if steps > 1 else "",
                                 steps=steps, vec=vec, threads=threads)
            try:
                params.check()
                return params
            except InfeasibleVariantError:
                continue
    raise AssertionError(f"no feasible point found for {op} {layouts}")


def test_feasibility_rules_are_named():
    layouts = {"dH1": "bju", "F": "bju", "b1": "u", "dF": "bju", "db1": "u"}
    point = lambda **kw: make_params("bias_gelu_bwd", AWKWARD, kw.pop("dtype", "float16"),  # noqa: E731
                                     kw.pop("layouts", layouts), **kw)
    with pytest.raises(InfeasibleVariantError, match="tx=64 must divide the extent 200 of tile dim 'u'"):
        point(tile="uj", tx=64, ty=7).check()
    with pytest.raises(InfeasibleVariantError, match="tile='ut' must be two distinct dims"):
        point(tile="ut", tx=8, ty=1).check()
    with pytest.raises(InfeasibleVariantError, match="move at most 16 bytes"):
        point(dtype="float32", tile="uj", tx=40, ty=7, vec=8).check()
    with pytest.raises(InfeasibleVariantError, match="vec=8 must divide tx=20"):
        point(tile="uj", tx=20, ty=7, vec=8).check()
    with pytest.raises(InfeasibleVariantError, match="vec=8 must divide ty=7, the swept extent of dF"):
        point(layouts=layouts | {"dF": "ubj"}, tile="uj", tx=40, ty=7, vec=8).check()
    with pytest.raises(InfeasibleVariantError, match="threads=100 must be a multiple of 32"):
        point(tile="uj", tx=40, ty=7, threads=100).check()
    with pytest.raises(InfeasibleVariantError, match="loop='' must be '' exactly when steps == 1"):
        point(tile="uj", tx=40, ty=7, steps=7).check()
    with pytest.raises(InfeasibleVariantError, match="loop='j' must be a dim .* outside the tile"):
        point(tile="uj", tx=40, ty=7, loop="j", steps=7).check()
    with pytest.raises(InfeasibleVariantError, match="register budget"):
        make_params("qkv_bias_bwd", Size.from_heads(B=1, L=8, H=32, P=64, U=1), "float16",
                    {"dQ": "bhjp", "dK": "bhkp", "dV": "bhkp", "dQKV": "bjthp", "dbqkv": "thp"},
                    tile="ph", tx=64, ty=32, threads=32).check()
    with pytest.raises(InfeasibleVariantError, match="shared memory exceed"):
        make_params("bias_gelu", Size.from_heads(B=1, L=512, H=1, P=1, U=4096), "float32",
                    {"F": "bju", "b1": "u", "H1": "ubj"}, tile="uj", tx=256, ty=256, vec=4).check()
    with pytest.raises(InfeasibleVariantError, match="not an order of its dims"):
        point(layouts=layouts | {"F": "bjh"}, tile="uj", tx=40, ty=7).check()
    with pytest.raises(InfeasibleVariantError, match="QkvBiasParams implements"):
        PARAMS["qkv_bias"](op="bias_gelu", dtype="float16", layouts=tuple(layouts.items())).check()
    with pytest.raises(GraphError, match="no elementwise kernel implements 'softmax'; known: .*qkv_bias"):
        make_params("softmax", AWKWARD, "float16", {})


def test_labels_are_unique_and_parse_back():
    from substation.records import parse_label

    rng = random.Random(0)
    points = {random_point(rng, op, BERT, "float16") for op in OPS for _ in range(12)}
    assert len({p.label for p in points}) == len(points)
    assert len({p.name for p in points}) == len(points)
    for p in points:
        assert parse_label(p.label) == p.candidate


def test_profiler_variants_are_feasible_and_distinct():
    for op in OPS:
        for layouts in profiled_layout_space(GRAPH.operator(op), BERT, max_combos=12).combos:
            found = variants(op, BERT, "float16", layouts)
            assert found, f"{op}: no variant for {layouts}"
            for params in found:
                params.check()
            assert len({p.label for p in found}) == len(found)


def test_reduction_layout():
    """The bias gradient's partial sums: one row per block position along b and j, one column per element."""
    point = make_params("qkv_bias_bwd", BERT, "float16", {"dQ": "bhjp", "dK": "bhkp", "dV": "bhkp",
                                                          "dQKV": "bjthp", "dbqkv": "thp"},
                        tile="pj", tx=64, ty=32, loop="b", steps=4, vec=8)
    point.check()
    assert point.workspace_shape() == (2 * 16, 3 * 16 * 64)
    assert point.shared_bytes == 64 * 32 * 4, "all layouts share p innermost: only the float32 sums use shared memory"
    transposing = make_params("bias_gelu", BERT, "float16", {"F": "bju", "b1": "u", "H1": "ubj"},
                              tile="uj", tx=64, ty=64, vec=8)
    assert transposing.shared_bytes == 64 * 64 * 2
    assert transposing.workspace_shape() is None, "no bias gradient, no partial sums"


def test_check_tensors_names_the_tensor():
    params = make_params("residual_bwd", AWKWARD, "float32", {"dXa": "bji", "dR1": "bji", "dX": "bji"},
                         tile="ij", tx=48, ty=7, vec=4)
    good = torch.zeros(3, 77, 48)
    with pytest.raises(ValueError, match="tensor 'dX' is missing"):
        params.check_tensors({"dXa": good, "dR1": good})
    with pytest.raises(ValueError, match=r"name='dXa'.*shape \(3, 77, 48\)"):
        params.check_tensors({"dXa": good.transpose(0, 1), "dR1": good, "dX": good})


COMPILED = [(op, dtype) for op in OPS for dtype in ("float16", "bfloat16", "float32")]


@pytest.mark.parametrize("op,dtype", COMPILED)
def test_renders_and_compiles_for_sm90(op, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    rng = random.Random(COMPILED.index((op, dtype)))
    params = random_point(rng, op, rng.choice([AWKWARD, BERT]), dtype)
    first, second = params.compile(), params.compile()
    assert not first.cached and second.cached and first.path == second.path
    assert first.path.read_bytes()[:4] == b"\x7fELF"


# -- GPU ------------------------------------------------------------------------------------------------

GPU_SIZES = [AWKWARD, BERT, Size.from_heads(B=2, L=33, H=3, P=8, U=96), get_size("bert-large-b96-l128")]


def _setup(params: ElementwiseParams, seed: int) -> tuple[dict, dict]:
    """Random logical inputs (rounded to the dtype) and every tensor stored in its layout (outputs NaN)."""
    operator, ext, layouts = GRAPH.operator(params.op), params.extents | {"k": params.extents["j"]}, dict(params.layouts)
    dtype, gen = DTYPES[params.dtype], torch.Generator(device="cuda").manual_seed(seed)
    inputs = {n: torch.randn([ext[d] for d in GRAPH.tensors[n].dims], device="cuda", generator=gen,
                             dtype=torch.float64).mul(2).to(dtype) for n in operator.inputs}
    tensors = {n: stored(x, GRAPH.tensors[n].dims, layouts[n]) for n, x in inputs.items()}
    tensors |= {n: torch.full([ext[d] for d in layouts[n]], float("nan"), device="cuda", dtype=dtype)
                for n in operator.outputs}
    return inputs, tensors


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("op", OPS)
def test_kernel_matches_float64_reference(op, seed):
    rng = random.Random(1000 * OPS.index(op) + seed)
    dtype, size = ("float16", "bfloat16", "float32", "float16")[seed], GPU_SIZES[seed]
    params = random_point(rng, op, size, dtype)
    inputs, tensors = _setup(params, seed)
    params.launch(params.compile(DeviceSpec.of(0)), tensors, ARGS)
    torch.cuda.synchronize()
    operator, layouts = GRAPH.operator(op), dict(params.layouts)
    want = FUSED[op](ARGS, *(inputs[n].double() for n in operator.inputs))
    torch_got = FUSED[op](ARGS, *(inputs[n] for n in operator.inputs))  # PyTorch's ops in the same dtype
    for name, w, t in zip(operator.outputs, want, torch_got):
        budget = error_budget(relative_error(t, w), DTYPES[dtype])
        got = logical(tensors[name], layouts[name], GRAPH.tensors[name].dims)
        assert relative_error(got, w) <= budget, f"{name} of {params.label} [{dtype}]"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("op", ["qkv_bias_bwd", "bias_gelu_bwd"])
def test_bias_gradients_are_deterministic(op):
    rng = random.Random(7)
    for dtype, size in (("float16", BERT), ("bfloat16", AWKWARD)):
        params = random_point(rng, op, size, dtype)
        _, tensors = _setup(params, 3)
        cubin, gradient = params.compile(DeviceSpec.of(0)), SPECS[op].reduce[1]
        params.launch(cubin, tensors, ARGS)
        first = tensors[gradient].clone()
        for _ in range(3):  # a NaN-filled workspace: every partial sum must be written
            workspace = torch.full(params.workspace_shape(), float("nan"), device="cuda")
            params.launch(cubin, tensors, ARGS, workspace)
            torch.cuda.synchronize()
            assert torch.equal(tensors[gradient], first), params.label
        with pytest.raises(ValueError, match=r"workspace.shape=.*expected a contiguous float32 tensor of shape"):
            params.launch(cubin, tensors, ARGS, torch.zeros(3, device="cuda"))


@pytest.mark.gpu
@needs_gpu
def test_a_workspace_for_an_operator_without_partial_sums_is_refused():
    params = random_point(random.Random(3), "bias_gelu", AWKWARD, "float16")
    _, tensors = _setup(params, 3)
    assert params.workspace_shape() is None
    with pytest.raises(ValueError, match="bias_gelu: takes no workspace"):
        params.launch(params.compile(DeviceSpec.of(0)), tensors, ARGS, torch.zeros(3, device="cuda"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("op", OPS)
def test_cuda_graph_replay_reproduces(op):
    params = random_point(random.Random(11), op, AWKWARD, "float16")
    _, tensors = _setup(params, 5)
    outputs = GRAPH.operator(op).outputs
    params.check_tensors(tensors)
    bound = params.bind(params.compile(DeviceSpec.of(0)), 0)  # as the runtime does: once, outside the capture
    pointers = [tensors[name].data_ptr() for name in bound.names]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bound(pointers, ARGS, stream.cuda_stream)
        stream.synchronize()
        want = {n: tensors[n].clone() for n in outputs}
        with torch.cuda.graph(graph, stream=stream):
            bound(pointers, ARGS, stream.cuda_stream)
    for n in outputs:
        tensors[n].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for n in outputs:
        assert torch.equal(tensors[n], want[n]), n
