"""softmax / softmax_bwd kernels: feasibility, rendering + nvcc for sm_90 (CPU), and on the GPU against the
float64 reference in random layouts and awkward sizes, forward and backward, with and without dropout."""
import math
import random

import pytest
import torch

from substation.device import DeviceSpec
from substation.graph import layer_graph
from substation.kernels.base import InfeasibleVariantError, widest_vector
from substation.kernels.softmax import SoftmaxParams
from substation.layouts import enumerate_layouts, logical, stored
from substation.reference import OpArgs, softmax, softmax_bwd

from substation.sizes import TORCH_DTYPES as DTYPES
from substation.accuracy import error_budget, relative_error

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GRAPH = layer_graph()


def random_point(rng: random.Random, backward: bool, B: int, H: int, L: int, dtype: str) -> SoftmaxParams:
    op = GRAPH.operator("softmax_bwd" if backward else "softmax")
    layouts = tuple((n, rng.choice(enumerate_layouts(GRAPH.tensors[n].dims))) for n in op.inputs + op.outputs)
    tile = rng.choice("bhj")
    extent = {"b": B, "h": H, "j": L}[tile]
    rows = rng.choice([r for r in (1, 2, 4, 7, 8, 16, 32) if extent % r == 0])
    for vec in (8, 4, 2, 1):
        params = SoftmaxParams(op=op.name, dtype=dtype, layouts=layouts, B=B, H=H, L=L, tile=tile, rows=rows,
                               vec=vec, threads=rng.choice([64, 128, 256]))
        try:
            params.check()
            return params
        except InfeasibleVariantError:
            continue
    raise AssertionError("vec=1 is always feasible")


def test_feasibility_rules_are_named():
    base = dict(op="softmax", dtype="float16", layouts=(("S", "bhjk"), ("M", "bk"), ("Pr", "bhjk"), ("A", "bhjk")),
                B=2, H=3, L=40)
    with pytest.raises(InfeasibleVariantError, match="rows=16 must divide the extent 40"):
        SoftmaxParams(**base, tile="j", rows=16).check()
    with pytest.raises(InfeasibleVariantError, match="vec=8 must divide 4"):
        SoftmaxParams(**(base | {"layouts": (("S", "bhkj"), ("M", "bk"), ("Pr", "bhjk"), ("A", "bhjk"))}),
                      tile="j", rows=4, vec=8).check()
    with pytest.raises(InfeasibleVariantError, match="move at most 16 bytes"):
        SoftmaxParams(**(base | {"dtype": "float32"}), tile="j", rows=8, vec=8).check()
    with pytest.raises(InfeasibleVariantError, match="shared memory"):
        SoftmaxParams(**(base | {"L": 4096}), tile="j", rows=64).check()
    with pytest.raises(InfeasibleVariantError, match="layouts are given for"):
        SoftmaxParams(**(base | {"layouts": (("S", "bhjk"),)}), tile="j", rows=8).check()


def test_labels_are_unique_and_parse_back():
    from substation.records import parse_label

    rng = random.Random(0)
    points = {random_point(rng, bool(i % 2), 8, 16, 512, "float16") for i in range(40)}
    labels = {p.label for p in points}
    assert len(labels) == len(points)
    for p in points:
        assert parse_label(p.label) == p.candidate


@pytest.mark.parametrize("seed", range(4))
def test_renders_and_compiles_for_sm90(seed, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    rng = random.Random(seed)
    params = random_point(rng, seed % 2 == 1, rng.choice([2, 8]), rng.choice([3, 16]), rng.choice([77, 128, 512]),
                          rng.choice(["float16", "bfloat16", "float32"]))
    first, second = params.compile(), params.compile()
    assert not first.cached and second.cached and first.path == second.path
    assert first.path.read_bytes()[:4] == b"\x7fELF"


# Row lengths that take each keep-bit path: a multiple of 8 (lane pairs share a Philox call; 264 has an odd
# number of 128-element groups), 4 mod 8 and odd (each lane's run of 4 from the one or two blocks it touches).
MASK_LENGTHS = (128, 264, 36, 77)


def mask_point(op: str, L: int, dtype: str = "float16") -> SoftmaxParams:
    """Canonical layouts, B = 2 tiled by 2 rows: the widest vector feasible at L."""
    layouts = tuple((n, GRAPH.tensors[n].dims) for n in GRAPH.operator(op).inputs + GRAPH.operator(op).outputs)
    return widest_vector(lambda vec: SoftmaxParams(op=op, dtype=dtype, layouts=layouts, B=2, H=3, L=L, tile="b",
                                                   rows=2, vec=vec, threads=64))


@pytest.mark.parametrize("L", MASK_LENGTHS)
def test_every_keep_path_compiles_for_sm90(L, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    for op in ("softmax", "softmax_bwd"):
        params = mask_point(op, L)
        source = params.render()
        assert ("pair_nibble(byte, g, lane)" in source) == (L % 8 == 0)
        assert ("keep_run<4>(row + k0" in source) == (L % 8 != 0)
        assert params.compile().path.read_bytes()[:4] == b"\x7fELF"


def _run(params: SoftmaxParams, inputs: dict, p: float, seed: int = 11, offset: int = 3) -> dict:
    ext = params.extents
    outs = {n: torch.empty([ext[d] for d in lay], device="cuda", dtype=DTYPES[params.dtype])
            for n, lay in params.layouts if n not in inputs}
    args = OpArgs(scale=1 / math.sqrt(64), attention_dropout=p, seed=seed, offset=offset).with_device_rng("cuda")
    params.launch(params.compile(DeviceSpec.of(0)), inputs | outs, args)
    torch.cuda.synchronize()
    return outs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_float64_reference(seed, p):
    rng = random.Random(100 + seed)
    dtype = ["float16", "bfloat16", "float32"][seed % 3]
    B, H, L = [(2, 3, 77), (8, 16, 512), (3, 2, 128), (1, 5, 40), (96, 16, 128), (2, 2, 33)][seed]
    fwd, bwd = (random_point(rng, b, B, H, L, dtype) for b in (False, True))
    torch_dtype, scale = DTYPES[dtype], 1 / math.sqrt(64)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    S = torch.randn(B, H, L, L, device="cuda", generator=gen, dtype=torch.float64) * 3
    M = (torch.rand(B, L, device="cuda", generator=gen) > 0.3).double()
    M[:, 0] = 1
    dA = torch.randn(B, H, L, L, device="cuda", generator=gen, dtype=torch.float64)
    args = OpArgs(scale=scale, attention_dropout=p, seed=11, offset=3).with_device_rng("cuda")
    lay = dict(fwd.layouts)
    S_in, M_in = (stored(x.to(torch_dtype), d, lay[n]) for x, d, n in ((S, "bhjk", "S"), (M, "bk", "M")))
    out = _run(fwd, {"S": S_in, "M": M_in}, p)
    Pr_ref, A_ref = softmax(args, logical(S_in, lay["S"], "bhjk").double(), M)
    # PyTorch in the same dtype, for the error budget
    logits = (logical(S_in, lay["S"], "bhjk") * scale).masked_fill(M[:, None, None, :] == 0, -math.inf)
    torch_err = relative_error(torch.softmax(logits, -1), Pr_ref)
    budget = error_budget(torch_err, torch_dtype)
    assert relative_error(logical(out["Pr"], lay["Pr"], "bhjk"), Pr_ref) <= budget
    assert relative_error(logical(out["A"], lay["A"], "bhjk"), A_ref) <= budget / (1 - p)
    blay = dict(bwd.layouts)
    Pr_in = stored(Pr_ref.to(torch_dtype), "bhjk", blay["Pr"])
    dA_in = stored(dA.to(torch_dtype), "bhjk", blay["dA"])
    dS = _run(bwd, {"dA": dA_in, "Pr": Pr_in}, p)["dS"]
    (dS_ref,) = softmax_bwd(args, logical(dA_in, blay["dA"], "bhjk").double(), logical(Pr_in, blay["Pr"], "bhjk").double())
    pr_t, da_t = logical(Pr_in, blay["Pr"], "bhjk"), logical(dA_in, blay["dA"], "bhjk")
    torch_dS = torch._softmax_backward_data(da_t * (A_ref != 0 if p else 1) / (1 - p), pr_t, -1, torch_dtype) * scale
    budget = error_budget(relative_error(torch_dS, dS_ref), torch_dtype)
    assert relative_error(logical(dS, blay["dS"], "bhjk"), dS_ref) <= budget


@pytest.mark.gpu
@needs_gpu
def test_dropout_mask_is_the_reference_mask_and_replays_in_a_cuda_graph():
    params = SoftmaxParams(op="softmax", dtype="float16", layouts=(("S", "bhjk"), ("M", "bk"), ("Pr", "bhjk"),
                                                                   ("A", "bhjk")), B=4, H=4, L=128, rows=8, vec=8)
    from substation.dropout import keep_mask

    S = torch.randn(4, 4, 128, 128, device="cuda", dtype=torch.float16)
    M = torch.ones(4, 128, device="cuda", dtype=torch.float16)
    out = _run(params, {"S": S, "M": M}, 0.25, seed=2**40 + 7, offset=5)
    want = keep_mask((4, 4, 128, 128), 0.25, 2**40 + 7, 5, 0, device="cuda")
    assert torch.equal(out["A"] != 0, want)
    rate = 1 - want.float().mean().item()
    assert abs(rate - 0.25) < 3 * math.sqrt(0.25 * 0.75 / want.numel())
    cubin = params.compile(DeviceSpec.of(0))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        args = OpArgs(scale=0.125, attention_dropout=0.25, seed=2**40 + 7, offset=5).with_device_rng("cuda")
        params.launch(cubin, {"S": S, "M": M} | out, args)  # loads the module outside the capture
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            params.launch(cubin, {"S": S, "M": M} | out, args)
    first = out["A"].clone()
    out["A"].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["A"], first)
    # The kernel reads (seed, offset) from device memory: advancing it there makes the same graph draw the
    # next step's mask, as a fresh launch at that offset does.
    args.rng[1] += 1
    graph.replay()
    fresh = {name: torch.empty_like(value) for name, value in out.items()}
    params.launch(cubin, {"S": S, "M": M} | fresh,
                  OpArgs(scale=0.125, attention_dropout=0.25, seed=2**40 + 7, offset=6).with_device_rng("cuda"))
    torch.cuda.synchronize()
    assert torch.equal(out["A"], fresh["A"]) and not torch.equal(out["A"], first)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("L", MASK_LENGTHS)
def test_dropout_mask_is_bit_exact_at_every_row_length(L):
    """Forward: A is nonzero exactly where the reference keeps; backward: dS matches the float64 reference, which
    a single wrongly kept or dropped element would break."""
    from substation.dropout import keep_mask

    p, seed, offset = 0.3, 2**40 + 9, 4
    fwd, bwd = mask_point("softmax", L, "float32"), mask_point("softmax_bwd", L, "float32")
    gen = torch.Generator(device="cuda").manual_seed(L)
    S = torch.randn(2, 3, L, L, device="cuda", generator=gen)
    M = torch.ones(2, L, device="cuda")
    out = _run(fwd, {"S": S, "M": M}, p, seed=seed, offset=offset)
    want = keep_mask((2, 3, L, L), p, seed, offset, 0, device="cuda")
    assert torch.equal(out["A"] != 0, want)
    dA = torch.randn(2, 3, L, L, device="cuda", generator=gen)
    dS = _run(bwd, {"dA": dA, "Pr": out["Pr"]}, p, seed=seed, offset=offset)["dS"]
    args = OpArgs(scale=1 / math.sqrt(64), attention_dropout=p, seed=seed, offset=offset)
    (dS_ref,) = softmax_bwd(args, dA.double(), out["Pr"].double())
    torch.testing.assert_close(dS.double(), dS_ref, rtol=1e-4, atol=1e-6)
