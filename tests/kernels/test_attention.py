"""Fused attention forward kernel: feasibility, labels, rendering + nvcc for sm_90 (CPU), and on the GPU against
the float64 reference in random layouts and awkward L, fp16 and bf16, dropout off and on (masks bit-exact), with
and without a padding mask."""
import dataclasses
import math
import random

import pytest
import torch

from substation.accuracy import error_budget, relative_error
from substation.device import H100, DeviceSpec
from substation.dropout import keep_mask
from substation.graph import DROPOUT_SITES
from substation.kernels.attention import AttentionParams, make, reference, tensor_dims
from substation.kernels.base import InfeasibleVariantError
from substation.layouts import enumerate_layouts
from substation.records import parse_label
from substation.reference import OpArgs
from substation.sizes import TORCH_DTYPES as DTYPES
from substation.sizes import Size

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def size(B: int, H: int, L: int, P: int = 64) -> Size:
    return Size(B=B, L=L, H=H, P=P, I=H * P, U=4 * H * P)


def random_layouts(rng: random.Random) -> dict[str, str]:
    """Any order of every tensor's letters, p innermost for most (the layouts SDPA and the GEMMs meet)."""
    layouts = {}
    for name in ("Q", "K", "V", "M", "Z"):
        choices = enumerate_layouts(tensor_dims(name))
        inner = [c for c in choices if c[-1] == "p"]
        layouts[name] = rng.choice(inner if inner and rng.random() < 0.7 else choices)
    return layouts


def random_point(rng: random.Random, sz: Size, dtype: str) -> AttentionParams:
    return make(sz, dtype, random_layouts(rng), block_m=rng.choice([64, 128]), block_n=rng.choice([32, 64]))


BASE = dict(B=2, H=3, L=40)
CANONICAL = {"Q": "bhjp", "K": "bhkp", "V": "bhkp", "M": "bk", "Z": "bjhp"}


def test_feasibility_rules_are_named():
    sz = size(**BASE)
    with pytest.raises(InfeasibleVariantError, match="no tensor-core kernel"):
        make(sz, "float32", CANONICAL).check()
    with pytest.raises(InfeasibleVariantError, match="head size P=96"):
        make(size(**BASE, P=96), "float16", CANONICAL).check()
    with pytest.raises(InfeasibleVariantError, match="block_m=32 must be 64 or 128"):
        make(sz, "float16", CANONICAL, block_m=32).check()
    with pytest.raises(InfeasibleVariantError, match="block_n=128 must be 32 or 64"):
        make(sz, "float16", CANONICAL, block_n=128).check()
    with pytest.raises(InfeasibleVariantError, match="Q:bhjk must be an order of 'bhjp'"):
        make(sz, "float16", CANONICAL | {"Q": "bhjk"}).check()
    with pytest.raises(InfeasibleVariantError, match="LSE:hbj must be bhj"):
        dataclasses.replace(make(sz, "float16", CANONICAL),
                            layouts=tuple((CANONICAL | {"LSE": "hbj"}).items())).check()
    with pytest.raises(InfeasibleVariantError, match="layouts are given for"):
        dataclasses.replace(make(sz, "float16", CANONICAL), layouts=(("Q", "bhjp"),)).check()
    small = dataclasses.replace(H100, max_shared_bytes_per_block=48 * 1024)
    with pytest.raises(InfeasibleVariantError, match="shared memory"):
        make(size(**BASE, P=128), "float16", CANONICAL, block_m=128).check(small)


def test_labels_are_unique_and_parse_back():
    rng = random.Random(0)
    points = {random_point(rng, size(8, 16, 512), "float16") for _ in range(40)}
    assert len({p.label for p in points}) == len(points)
    for p in points:
        assert dataclasses.replace(parse_label(p.label), covers=p.candidate.covers) == p.candidate
        assert p.candidate.covers == ("attn_scores", "softmax", "attn_context")


@pytest.mark.parametrize("seed", range(4))
def test_renders_and_compiles_for_sm90(seed, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    rng = random.Random(seed)
    params = random_point(rng, size(rng.choice([2, 8]), rng.choice([3, 16]), rng.choice([33, 77, 128, 512]),
                                    rng.choice([64, 128])), rng.choice(["float16", "bfloat16"]))
    first, second = params.compile(), params.compile()
    assert not first.cached and second.cached and first.path == second.path
    assert first.path.read_bytes()[:4] == b"\x7fELF"


def stored(x: torch.Tensor, dims: str, layout: str) -> torch.Tensor:
    return x.permute([dims.index(d) for d in layout]).contiguous()


def logical(t: torch.Tensor, layout: str, dims: str) -> torch.Tensor:
    return t.permute([layout.index(d) for d in dims])


def run(params: AttentionParams, logical_inputs: dict, args: OpArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on the logical inputs stored in the point's layouts; Z (bjhp) and LSE, logical."""
    lay = dict(params.layouts)
    tensors = {n: stored(x, tensor_dims(n), lay[n]) for n, x in logical_inputs.items()}
    zlay = lay["Z"]
    tensors["Z"] = torch.full([params.extents[d] for d in zlay], math.nan, device="cuda",
                              dtype=DTYPES[params.dtype])
    tensors["LSE"] = torch.full((params.B, params.H, params.L), math.nan, device="cuda")
    params.launch(params.compile(DeviceSpec.of(0)), tensors, args)
    torch.cuda.synchronize()
    return logical(tensors["Z"], zlay, "bjhp"), tensors["LSE"]


def random_inputs(sz: Size, dtype: torch.dtype, padded: bool, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = {n: torch.randn(sz.B, sz.H, sz.L, sz.P, device="cuda", generator=gen).to(dtype) for n in "QKV"}
    M = (torch.rand(sz.B, sz.L, device="cuda", generator=gen) > 0.3) if padded else torch.ones(sz.B, sz.L, device="cuda")
    M = M.to(dtype)
    M[:, 0] = 1  # a row with every key masked is NaN in the reference
    return qkv | {"M": M}


FORWARD_CASES = [(L, dtype, p, padded) for L in (33, 77, 128, 512) for dtype in ("float16", "bfloat16")
                 for p in (0.0, 0.1) for padded in (False, True)]
MASK_CASES = [(33, 64, 64), (64, 64, 32), (128, 128, 64)]


def forward_point(L: int, dtype: str, p: float, padded: bool) -> AttentionParams:
    """The (seeded) random point a forward case runs."""
    return random_point(random.Random(f"{L}{dtype}{p}{padded}"), size(2 if L == 512 else 3, 4, L), dtype)


def mask_point(L: int, P: int, block_n: int) -> AttentionParams:
    return make(size(2, 3, L, P), "float16", {"Q": "jbhp", "K": "bhkp", "V": "kbhp", "M": "bk", "Z": "bhjp"},
                block_n=block_n)


def gpu_points() -> list[AttentionParams]:
    """Every point the GPU tests launch (to compile them all at once, in parallel, before the tests)."""
    return [forward_point(*case) for case in FORWARD_CASES] + [mask_point(*case) for case in MASK_CASES]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("L, dtype, p, padded", FORWARD_CASES)
def test_forward_matches_float64_reference(L, dtype, p, padded):
    params = forward_point(L, dtype, p, padded)
    sz, torch_dtype = size(params.B, params.H, L), DTYPES[dtype]
    inputs = random_inputs(sz, torch_dtype, padded, seed=L)
    args = OpArgs(scale=1 / math.sqrt(sz.P), attention_dropout=p, seed=2**33 + L, offset=7).with_device_rng("cuda")
    Z, LSE = run(params, inputs, args)
    Z_ref, LSE_ref = reference(args, *(inputs[n].double() for n in ("Q", "K", "V", "M")))
    Z_torch, _ = reference(args, *(inputs[n] for n in ("Q", "K", "V", "M")))  # PyTorch in the kernel's dtype
    budget = error_budget(relative_error(Z_torch, Z_ref), torch_dtype)
    assert relative_error(Z, Z_ref) <= budget, params.label
    assert (LSE.double() - LSE_ref).abs().max().item() <= 1e-3 * LSE_ref.abs().max().item() + 1e-4, params.label


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("L, P, block_n", MASK_CASES)
def test_dropout_mask_is_the_reference_mask(L, P, block_n):
    """V one-hot along p (V[k, p] = 1 iff p == k) makes Z[j, k] = A[j, k]: its zeros are the dropped (or masked)
    elements. L = 33 takes the per-element Philox path, the others the shared 4-key calls."""
    params = mask_point(L, P, block_n)
    sz = size(2, 3, L, P)
    inputs = random_inputs(sz, torch.float16, padded=True, seed=1)
    inputs["V"] = torch.eye(L, P, device="cuda", dtype=torch.float16).expand(2, 3, L, P).contiguous()
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=0.25, seed=2**40 + 7, offset=5).with_device_rng("cuda")
    Z, _ = run(params, inputs, args)
    kept = Z.permute(0, 2, 1, 3)[..., :L] != 0  # bhjk
    want = keep_mask((2, 3, L, L), 0.25, 2**40 + 7, 5, DROPOUT_SITES["attention"], device="cuda")
    assert torch.equal(kept, want & (inputs["M"] != 0)[:, None, None, :])
