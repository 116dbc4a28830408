"""Fused attention forward and backward kernels: feasibility, labels, rendering + nvcc for sm_90 (wgmma points for
sm_90a) (CPU), and on the GPU against the float64 reference (the backward: every gradient, by autograd through the
reference with the same dropout mask) in random layouts and awkward L, fp16 and bf16, dropout off and on (masks
bit-exact), with and without a padding mask, both passes also by wgmma; the backward's two runs bit-equal. The
dropout keep-bit lookup both share also runs on the CPU (its device code compiled as host C++, 32 threads as the
lanes) against substation.dropout's mask."""
import dataclasses
import itertools
import json
import math
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from substation.accuracy import error_budget, relative_error
from substation.device import H100, DeviceSpec
from substation.dropout import keep_mask
from substation.graph import DROPOUT_SITES
from substation.kernels.attention import (ATOMIC_DQ, BWD_COVERS, AttentionBackwardParams, AttentionParams,
                                          BoundBackward, backward_variants, configured_points, make, make_backward,
                                          reference, reference_backward, reference_bias, occupancy_levels,
                                          first_split_tile, live_blocks_per_tile, split_makespan,
                                          stacked_gradients, tensor_dims, variants)
import substation.launch as launch
from substation.jit import Cubin
from substation.kernels import base
from substation.errors import SubstationError
from substation.kernels.base import InfeasibleVariantError, feasible, runnable_variant
from substation.layouts import enumerate_layouts, stored
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


def replaced(params, **changes):
    """`params` with `changes`, at min_blocks 1 where its blocks would then not fit an SM."""
    changed = dataclasses.replace(params, **changes)
    return changed if feasible([changed]) else dataclasses.replace(changed, min_blocks=1)


def random_point(rng: random.Random, sz: Size, dtype: str) -> AttentionParams:
    point = make(sz, dtype, random_layouts(rng), block_m=rng.choice([64, 128]), block_n=rng.choice([32, 64]))
    return replaced(point, min_blocks=rng.choice(occupancy_levels(point.block_m)))


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


def test_min_blocks_asks_for_what_an_sm_holds():
    """min_blocks caps the registers through the launch bounds; it is refused where its warps or its shared memory
    do not fit an SM, and named in a label only where it asks for more than the compiler's choice."""
    sz = size(**BASE)
    assert occupancy_levels(64) == (1, 3, 4) and occupancy_levels(128) == (1, 2)
    with pytest.raises(InfeasibleVariantError, match="min_blocks=3 must be >= 1 and put at most 16 warps"):
        make(sz, "float16", CANONICAL, block_m=128, min_blocks=3).check()
    with pytest.raises(InfeasibleVariantError, match="min_blocks=0"):
        make_backward(sz, "float16", BWD_CANONICAL, min_blocks=0).check()
    small = dataclasses.replace(H100, max_shared_bytes_per_block=48 * 1024)  # 24 KiB a block: two fit, four do not
    make(sz, "float16", CANONICAL, block_m=64, block_n=32, min_blocks=1).check(small)
    with pytest.raises(InfeasibleVariantError, match="min_blocks=4 blocks of 24576 bytes of shared memory exceed"):
        make(sz, "float16", CANONICAL, block_m=64, block_n=32, min_blocks=4).check(small)
    plain, capped = (make_backward(sz, "float16", BWD_CANONICAL, block_m=64, min_blocks=m) for m in (1, 4))
    assert "min_blocks" not in plain.label and "min_blocks=4" in capped.label
    assert dict(parse_label(capped.label).options)["min_blocks"] == 4
    assert "__launch_bounds__(THREADS, MIN_BLOCKS)" in capped.render() and "#define MIN_BLOCKS 4" in capped.render()


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
    params = random_point(rng, size(rng.choice([2, 8]), rng.choice([3, 16]), rng.choice([33, 77, 100, 128, 512]),
                                    rng.choice([64, 128])), rng.choice(["float16", "bfloat16"]))
    first, second = params.compile(), params.compile()
    assert not first.cached and second.cached and first.path == second.path
    assert first.path.read_bytes()[:4] == b"\x7fELF"


# wgmma points (L, block_m, block_n, dtype, wgmma): one or two warpgroups, key tiles of 32 and 64, both dtypes, both
# products, L a multiple of neither tile, of both, and several query tiles.
WGMMA_BUILDS = [(77, 64, 32, "float16", 1), (77, 128, 64, "bfloat16", 2), (128, 128, 32, "float16", 2),
                (128, 64, 64, "bfloat16", 1), (512, 64, 64, "float16", 2), (512, 128, 32, "bfloat16", 1)]


@pytest.mark.parametrize("L, block_m, block_n, dtype, wgmma", WGMMA_BUILDS)
def test_wgmma_renders_and_compiles_for_sm90a(L, block_m, block_n, dtype, wgmma, tmp_path, monkeypatch):
    """wgmma is sm_90a's: a wgmma point on the H100 compiles for it (nvcc -arch=sm_90a), in any layout."""
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    point = make(size(2, 3, L), dtype, random_layouts(random.Random(L + block_m + block_n)), block_m=block_m,
                 block_n=block_n, wgmma=wgmma)
    assert point.compile_arch(H100) == "sm_90a"
    source = point.render()
    assert "wgmma_ss(" in source and ("wgmma_rs(" in source) == (wgmma == 2)
    assert ("mma16816(o[" in source) == (wgmma == 1) and "mma16816(s[" not in source
    cubin = point.compile()
    assert cubin.arch == "sm_90a" and cubin.path.parent.name == "sm_90a"
    assert cubin.path.read_bytes()[:4] == b"\x7fELF"


def assert_profiled_with_and_without_wgmma(profiled: list, top: int) -> None:
    """`profiled` holds the same tile points with wgmma off and at level `top`, and no other level."""
    tiles = {level: sorted(dataclasses.replace(p, wgmma=0).label for p in profiled if p.wgmma == level)
             for level in {0, top, *(p.wgmma for p in profiled)}}
    assert set(tiles) == {0, top} and tiles[0] and tiles[0] == tiles[top]


def test_wgmma_off_renders_and_labels_as_before():
    """wgmma=0 is the knob's absence: the label, kernel name, source (no wgmma code, mma.sync for both products) and
    architecture of the point without it; the profiled variants on Hopper are each tile point with wgmma off and
    at level 2."""
    for block_m, block_n in [(64, 32), (128, 64)]:
        plain = make(size(2, 3, 77), "float16", CANONICAL, block_m=block_m, block_n=block_n)
        off = make(size(2, 3, 77), "float16", CANONICAL, block_m=block_m, block_n=block_n, wgmma=0)
        assert off.wgmma == 0 and "wgmma" not in off.label and off.label == plain.label and off.name == plain.name
        source = off.render()
        assert source == plain.render() and "wgmma" not in source and "__align__(128)" in source
        assert "mma16816(s[n]" in source and "mma16816(o[" in source and off.compile_arch(H100) == "sm_90"
    assert_profiled_with_and_without_wgmma(variants(size(8, 16, 512), "float16", CANONICAL), 2)


@pytest.mark.parametrize("backward", [False, True])
def test_a_wgmma_cubin_binds_on_its_device_only(backward, monkeypatch):
    """An sm_90a cubin binds on an sm_90 device (the arch-specific target runs there), on no other."""
    monkeypatch.setattr(base, "kernel_function", lambda *args: 1)
    monkeypatch.setattr(launch, "_launch_kernel", lambda: None)
    point = (make_backward(size(**BASE), "float16", BWD_CANONICAL, wgmma=1) if backward
             else make(size(**BASE), "float16", CANONICAL, wgmma=2))
    cubin = Cubin(Path("unused.cubin"), "sm_90a", cached=True)
    monkeypatch.setattr(DeviceSpec, "of", classmethod(lambda cls, device: H100))
    assert point.bind(cubin, 0).names == point.tensor_names
    ampere = dataclasses.replace(H100, name="A100", major=8, minor=0)
    monkeypatch.setattr(DeviceSpec, "of", classmethod(lambda cls, device: ampere))
    with pytest.raises(ValueError, match=r"compiled for sm_90a, but device 0 \(A100\) is sm_80"):
        point.bind(cubin, 0)


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
    # Keys masked at random, and sequences padded at the end, so that the key tiles past them are skipped. (Not
    # down to one key: with dropout, that key's dK is then a sum of rounding residues dP − D, D taken from the
    # rounded Z as FlashAttention does, beyond PyTorch's error in the dtype relative to the other sequences'.)
    if padded:
        lengths = torch.tensor([sz.L, math.ceil(sz.L / 3), math.ceil(sz.L / 2)][:sz.B], device="cuda")
        M = (torch.rand(sz.B, sz.L, device="cuda", generator=gen) > 0.3) & (torch.arange(sz.L, device="cuda") < lengths[:, None])
    else:
        M = torch.ones(sz.B, sz.L, device="cuda")
    M = M.to(dtype)
    M[:, 0] = 1  # a row with every key masked is NaN in the reference
    return qkv | {"M": M}


FORWARD_CASES = [(L, dtype, p, padded) for L in (33, 77, 100, 128, 512) for dtype in ("float16", "bfloat16")
                 for p in (0.0, 0.1) for padded in (False, True)]
MASK_CASES = [(33, 64, 64), (36, 64, 32), (64, 64, 32), (100, 128, 64), (128, 128, 64)]


def forward_point(L: int, dtype: str, p: float, padded: bool) -> AttentionParams:
    """The (seeded) random point a forward case runs."""
    return random_point(random.Random(f"{L}{dtype}{p}{padded}"), size(2 if L == 512 else 3, 4, L), dtype)


def mask_point(L: int, P: int, block_n: int) -> AttentionParams:
    return make(size(2, 3, L, P), "float16", {"Q": "jbhp", "K": "bhkp", "V": "kbhp", "M": "bk", "Z": "bhjp"},
                block_n=block_n)


WGMMA = (0, 1, 2)  # the forward's products by mma.sync, S by wgmma, both (P = 64, every forward and mask case)


def gpu_points() -> list[AttentionParams]:
    """Every point the GPU tests launch (to compile them all at once, in parallel, before the tests)."""
    points = [forward_point(*case) for case in FORWARD_CASES] + [mask_point(*case) for case in MASK_CASES]
    return points + [replaced(x, wgmma=w) for x in points if x.P == 64 for w in WGMMA if w]


def needs_wgmma(wgmma: int) -> None:
    """Skip a wgmma case on a GPU other than Hopper's (wgmma is sm_90a's)."""
    if wgmma and DeviceSpec.of(0).arch != "sm_90":
        pytest.skip(f"wgmma={wgmma} needs an sm_90 GPU, not {DeviceSpec.of(0).arch}")


def skip_wgmma_unless_64(wgmma: int, P: int) -> None:
    """Skip a wgmma case at P other than 64 (wgmma's operands are rows of 128 bytes) or off Hopper."""
    if wgmma and P != 64:
        pytest.skip("wgmma needs P = 64")
    needs_wgmma(wgmma)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wgmma", WGMMA)
@pytest.mark.parametrize("L, dtype, p, padded", FORWARD_CASES)
def test_forward_matches_float64_reference(L, dtype, p, padded, wgmma):
    needs_wgmma(wgmma)
    params = replaced(forward_point(L, dtype, p, padded), wgmma=wgmma)
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
@pytest.mark.parametrize("wgmma", WGMMA)
@pytest.mark.parametrize("L, P, block_n", MASK_CASES)
def test_dropout_mask_is_the_reference_mask(L, P, block_n, wgmma):
    """V one-hot along p (V[k, p] = 1 iff p == k) makes Z[j, k] = A[j, k]: its zeros are the dropped (or masked)
    elements. L = 33, 36 and 100 (not multiples of 8: rows straddle Philox blocks) take the per-row fallback
    (keep_run), 64 and 128 the one-call-per-8-keys path. With wgmma, a misplaced accumulator element shows here."""
    skip_wgmma_unless_64(wgmma, P)
    params = replaced(mask_point(L, P, block_n), wgmma=wgmma)
    sz = size(2, 3, L, P)
    inputs = random_inputs(sz, torch.float16, padded=True, seed=1)
    inputs["V"] = torch.eye(L, P, device="cuda", dtype=torch.float16).expand(2, 3, L, P).contiguous()
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=0.25, seed=2**40 + 7, offset=5).with_device_rng("cuda")
    Z, _ = run(params, inputs, args)
    kept = Z.permute(0, 2, 1, 3)[..., :L] != 0  # bhjk
    want = keep_mask((2, 3, L, L), 0.25, 2**40 + 7, 5, DROPOUT_SITES["attention"], device="cuda")
    assert torch.equal(kept, want & (inputs["M"] != 0)[:, None, None, :])


# ------------------------------------------------------------------------------------------ keep bits, on the CPU
HOST_PRELUDE = r"""// attention_keep.cuh.j2 as host C++: 32 threads are the lanes of one warp, a shuffle is two barriers.
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
struct uint4 { uint32_t x, y, z, w; };
static inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
static inline uint32_t __umulhi(uint32_t a, uint32_t b) { return (uint32_t)(((uint64_t)a * b) >> 32); }
static thread_local int emu_lane;
static thread_local long emu_calls;  // Philox calls made by this lane
static unsigned emu_slots[32];
static std::barrier<> emu_barrier(32);
static unsigned __shfl_sync(unsigned, unsigned v, int src) {
  emu_slots[emu_lane] = v;
  emu_barrier.arrive_and_wait();
  const unsigned got = emu_slots[src & 31];
  emu_barrier.arrive_and_wait();
  return got;
}
static unsigned __shfl_xor_sync(unsigned mask, unsigned v, int m) { return __shfl_sync(mask, v, emu_lane ^ m); }
static uint4 philox_impl(uint4 c, uint32_t k0, uint32_t k1);
static inline uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) { ++emu_calls; return philox_impl(c, k0, k1); }
"""

HOST_MAIN = r"""
// Every 16x16 square of HEADS heads through keep_tile_qk and keep_tile_kq, as the kernels call them; writes the
// [HEADS, R, R] keep matrices (query-major, 1 = kept) of both, then each one's Philox calls over all lanes.
int main() {
  const int R = (L + 15) / 16 * 16;
  std::vector<unsigned char> qk((size_t)HEADS * R * R), kq((size_t)HEADS * R * R);
  long calls[2] = {0, 0};
  std::vector<std::thread> lanes;
  std::vector<long> lane_calls(64);
  for (int lane = 0; lane < 32; ++lane)
    lanes.emplace_back([&, lane] {
      emu_lane = lane;
      const int g = lane / 4, t = lane % 4;
      for (int which = 0; which < 2; ++which) {
        emu_calls = 0;
        for (int hd = 0; hd < HEADS; ++hd)
          for (int r0 = 0; r0 < R; r0 += 16)
            for (int c0 = 0; c0 < R; c0 += 16) {
              const unsigned long long head = (unsigned long long)hd * L * L;
              const unsigned out = which == 0 ? keep_tile_qk(head, r0, c0, lane, SEED, OFFSET, SITE, THRESHOLD)
                                              : keep_tile_kq(head, r0, c0, lane, SEED, OFFSET, SITE, THRESHOLD);
              for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 2; ++i)
                  for (int e = 0; e < 2; ++e) {
                    const int row = r0 + g + 8 * i, col = c0 + 8 * h + 2 * t + e;  // qk: (j, k); kq: (k, j)
                    const int j = which == 0 ? row : col, k = which == 0 ? col : row;
                    (which == 0 ? qk : kq)[((size_t)hd * R + j) * R + k] = keep_at(out, h, i, e);
                  }
            }
        lane_calls[32 * which + lane] = emu_calls;
      }
    });
  for (auto& th : lanes) th.join();
  for (int x = 0; x < 64; ++x) calls[x / 32] += lane_calls[x];
  fwrite(qk.data(), 1, qk.size(), stdout);
  fwrite(kq.data(), 1, kq.size(), stdout);
  fprintf(stdout, "%ld %ld", calls[0], calls[1]);
  return 0;
}
"""


def host_keep_tiles(L: int, heads: int, p: float, seed: int, offset: int, site: int, workdir, keep_blocks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """keep_tile_qk's and keep_tile_kq's bits over every 16x16 square of `heads` heads (bool [heads, R, R], R = L
    rounded up to 16, query-major) and each one's Philox calls: the templates' device code compiled as host C++,
    told the attention tensor has `keep_blocks` Philox blocks (which picks the width of its index)."""
    import subprocess

    from substation.dropout import threshold
    from substation.kernels.base import environment

    common = environment().get_template("common.cuh.j2").render(dtype="float32")
    common = common[common.index("// Philox-4x32"):]
    definition = "__device__ __forceinline__ uint4 philox4x32("
    assert definition in common
    common = common.replace(definition, "static uint4 philox_impl(")
    keep = environment().get_template("attention_keep.cuh.j2").render()
    defines = dict(L=L, HEADS=heads, KEEP_BLOCKS=f"{keep_blocks}ull", SEED=f"{seed}ull", OFFSET=f"{offset}u",
                   SITE=f"{site}u", THRESHOLD=f"{threshold(p)}ull")
    source = HOST_PRELUDE + "".join(f"#define {k} {v}\n" for k, v in defines.items()) + common + keep + HOST_MAIN
    src, exe = workdir / f"keep{L}.cpp", workdir / f"keep{L}"
    src.write_text(source)
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, check=True, timeout=120).stdout
    R = (L + 15) // 16 * 16
    n = heads * R * R
    bits = torch.frombuffer(bytearray(out[:2 * n]), dtype=torch.uint8).bool().view(2, heads, R, R)
    qk_calls, kq_calls = map(int, out[2 * n:].split())
    return bits[0], bits[1], (qk_calls, kq_calls)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")
@pytest.mark.parametrize("L, p", [(33, 0.25), (36, 0.25), (40, 0.25), (64, 0.25), (100, 0.25), (128, 0.25),
                                  (64, 2**-16), (64, 0.9), (64, 1.0), (48, 1 - 2**-16)])
@pytest.mark.parametrize("index_bits", [32, 64])
def test_keep_tiles_match_keep_mask_on_the_cpu(L, p, index_bits, tmp_path):
    """The attention kernels' keep-bit lookup (attention_keep.cuh.j2: lane mappings, shuffles, the packed
    comparison of 16-bit halves, the per-row fallback where L is not a multiple of 8) run on the CPU, 32 threads as
    the lanes: both tile orientations give substation.dropout's mask bit for bit on [0, L)² (past L the kernels
    give P = 0, so the bits there are free). Where L is a multiple of 8 one Philox call per 8 elements: in
    keep_tile_qk every lane makes one per 16x16 square (squares past L included: no branch), in keep_tile_kq one
    per 8 keys of a row of [0, L)²; otherwise at most two per 8 keys of a row of [0, L)² and none past it. The
    thresholds' extremes too: 1 (p = 2⁻¹⁶), 2¹⁶ − 1 and 2¹⁶ (p = 1, every element dropped). With the Philox block
    index in 32 bits (a tensor of fewer than 2³² blocks, as here) and in 64 (the lookup told of a larger one)."""
    heads, seed, offset, site = 3, 2**40 + 7, 5, DROPOUT_SITES["attention"]
    blocks = heads * L * L // 8 if index_bits == 32 else 2**33
    qk, kq, calls = host_keep_tiles(L, heads, p, seed, offset, site, tmp_path, blocks)
    want = keep_mask((heads, L, L), p, seed, offset, site)
    assert torch.equal(qk[:, :L, :L], want)
    assert torch.equal(kq[:, :L, :L], want)
    groups = heads * L * math.ceil(L / 8)  # runs of 8 keys of a row (the last one cut short at L)
    R = (L + 15) // 16 * 16
    if L % 8 == 0:
        assert calls == (heads * R * R // 8, groups)
    else:
        assert all(groups <= made <= 2 * groups for made in calls)


ADDRESS_MAIN = r"""
// For every lane, both operand patterns, every row tile row0 (a multiple of 8) and every chunk shift chunk0 whose
// bits are not the pattern's lane chunk's: tile_at's address against swz's element index (as bytes). Prints the
// count of cases and of mismatches.
int main() {
  long cases = 0, wrong = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int pattern = 0; pattern < 2; ++pattern) {
      const int lane_row = pattern == 0 ? (lane & 7) : (lane & 15), lane_chunk = pattern == 0 ? lane >> 3 : lane >> 4;
      const int chunk_step = pattern == 0 ? 4 : 2;  // lane chunks 0..3 (b_rows) or 0..1 (a_rows)
      const uint32_t offset = pattern == 0 ? b_rows_offset(lane) : a_rows_offset(lane);
      for (int row0 = 0; row0 < 128; row0 += 8)
        for (int chunk0 = 0; chunk0 < P / 8; chunk0 += chunk_step) {
          const uint32_t tile = 4096u * (unsigned)(row0 % 3);  // any tile address
          const uint32_t want = tile + 2u * (uint32_t)swz(row0 + lane_row, 8 * (chunk0 + lane_chunk));
          ++cases;
          wrong += tile_at(tile, offset, row0, chunk0) != want;
        }
    }
  printf("%ld %ld", cases, wrong);
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("P", [64, 128])
def test_tile_at_is_the_swizzled_address_on_the_cpu(P, tmp_path):
    """The main loops' ldmatrix addresses (attention_common.cuh.j2: a lane's offset computed once, a row tile added
    and a chunk xored in) equal the swizzled tile's element index swz(row, col), for every lane of both operand
    patterns and every row and chunk shift the kernels use, at P = 64 and 128: the device code compiled as host C++."""
    import subprocess

    from substation.kernels.base import environment

    common = environment().get_template("attention_common.cuh.j2").render(dtype="float16", MMA="f16",
                                                                          M_STRIDE_B=1, M_STRIDE_K=1, KEEP_BLOCKS=1)
    start, end = common.index("__device__ __forceinline__ int swz("), common.index("// Whether key k (< L)")
    prelude = ("#include <cstdint>\n#include <cstdio>\n#define __device__\n#define __forceinline__ inline\n"
               f"#define P {P}\ntypedef uint16_t elem_t;\n")
    src, exe = tmp_path / "address.cpp", tmp_path / "address"
    src.write_text(prelude + common[start:end] + ADDRESS_MAIN)
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(src)], check=True)
    cases, wrong = map(int, subprocess.run([str(exe)], capture_output=True, check=True, timeout=60).stdout.split())
    assert cases == 32 * 16 * (P // 8 // 4 + P // 8 // 2) and wrong == 0


# ---------------------------------------------------------------------------------------------------------- backward
BWD_NAMES = ("Q", "K", "V", "M", "Z", "dZ", "dQ", "dK", "dV")
BWD_CANONICAL = CANONICAL | {"dZ": "bjhp", "dQ": "bhjp", "dK": "bhkp", "dV": "bhkp"}


def random_backward_layouts(rng: random.Random) -> dict[str, str]:
    """Any order of every tensor's letters, p innermost for most."""
    layouts = {}
    for name in BWD_NAMES:
        choices = enumerate_layouts(tensor_dims(name))
        inner = [c for c in choices if c[-1] == "p"]
        layouts[name] = rng.choice(inner if inner and rng.random() < 0.7 else choices)
    return layouts


def random_backward_point(rng: random.Random, sz: Size, dtype: str) -> AttentionBackwardParams:
    knobs = rng.choice([(64, 32), (64, 64), (128, 32), (128, 64)] if sz.P == 64 else [(64, 32), (128, 32)])
    last_block = [2, 4] if math.ceil(sz.L / knobs[0]) > 1 else []  # fuse_dq=2, 4 where several key tiles cover L
    point = make_backward(sz, dtype, random_backward_layouts(rng), block_m=knobs[0], block_n=knobs[1],
                          fuse_dq=rng.choice([0, 1] + last_block))
    return replaced(point, min_blocks=rng.choice(occupancy_levels(point.block_m)))


def test_backward_feasibility_rules_are_named():
    sz = size(**BASE)
    with pytest.raises(InfeasibleVariantError, match="no tensor-core kernel"):
        make_backward(sz, "float32", BWD_CANONICAL).check()
    with pytest.raises(InfeasibleVariantError, match="head size P=96"):
        make_backward(size(**BASE, P=96), "float16", BWD_CANONICAL).check()
    with pytest.raises(InfeasibleVariantError, match="block_m=32 must be 64 or 128"):
        make_backward(sz, "float16", BWD_CANONICAL, block_m=32).check()
    with pytest.raises(InfeasibleVariantError, match="block_n=128 must be 32 or 64"):
        make_backward(sz, "float16", BWD_CANONICAL, block_n=128).check()
    with pytest.raises(InfeasibleVariantError, match="fuse_dq=3 must be 0, 1, 2 or 4"):
        make_backward(sz, "float16", BWD_CANONICAL, fuse_dq=3).check()
    for fuse_dq in (2, 4):
        with pytest.raises(InfeasibleVariantError, match=f"fuse_dq={fuse_dq} sums the dQ partials of several key"):
            make_backward(sz, "float16", BWD_CANONICAL, fuse_dq=fuse_dq).check()  # L = 40: one key tile of 64
        make_backward(size(2, 3, 65), "float16", BWD_CANONICAL, fuse_dq=fuse_dq).check()
    with pytest.raises(InfeasibleVariantError, match="registers would spill"):
        make_backward(size(**BASE, P=128), "float16", BWD_CANONICAL, block_n=64).check()
    with pytest.raises(InfeasibleVariantError, match="dK:bhkj must be an order of 'bhkp'"):
        make_backward(sz, "float16", BWD_CANONICAL | {"dK": "bhkj"}).check()
    with pytest.raises(InfeasibleVariantError, match="layouts are given for"):
        make_backward(sz, "float16", {n: l for n, l in BWD_CANONICAL.items() if n != "Z"}).check()
    small = dataclasses.replace(H100, max_shared_bytes_per_block=48 * 1024)
    with pytest.raises(InfeasibleVariantError, match="shared memory"):
        make_backward(size(**BASE, P=128), "float16", BWD_CANONICAL, block_m=128, block_n=32).check(small)
    make_backward(size(**BASE, P=128), "bfloat16", BWD_CANONICAL, block_m=128, block_n=32).check()


def test_backward_labels_are_unique_and_parse_back():
    rng = random.Random(1)
    points = {random_backward_point(rng, size(8, 16, 512), "float16") for _ in range(40)}
    assert len({p.label for p in points}) == len(points)
    for p in points:
        assert dataclasses.replace(parse_label(p.label), covers=p.candidate.covers) == p.candidate
        assert p.candidate.covers == BWD_COVERS
        assert p.candidate.pass_ == "backward"


@pytest.mark.parametrize("seed", range(4))
def test_backward_renders_and_compiles_for_sm90(seed, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    rng = random.Random(100 + seed)
    params = random_backward_point(rng, size(rng.choice([2, 8]), rng.choice([3, 16]),
                                             rng.choice([33, 77, 100, 200, 512]),
                                             rng.choice([64, 128])), rng.choice(["float16", "bfloat16"]))
    first, second = params.compile(), params.compile()
    assert not first.cached and second.cached and first.path == second.path
    assert first.path.read_bytes()[:4] == b"\x7fELF"


# wgmma backward points (L, block_m, block_n, dtype, fuse_dq, stacked): one or two warpgroups, query tiles of 32 and 64,
# both dtypes, every fuse_dq (one key tile covering L, so D worked out inside, at L = 77 and 128 with block_m = 128),
# apart and stacked, L a multiple of neither tile, of both, and several key tiles.
BWD_WGMMA_BUILDS = [(77, 64, 32, "float16", 0, False), (77, 128, 64, "bfloat16", 1, True),
                    (128, 128, 32, "float16", 1, False), (128, 64, 64, "bfloat16", 2, True),
                    (512, 64, 64, "float16", 2, False), (512, 128, 32, "bfloat16", 1, True),
                    (512, 128, 64, "float16", 0, True), (77, 64, 32, "bfloat16", 1, False),
                    (200, 128, 32, "float16", 4, True), (512, 64, 32, "bfloat16", 4, False)]


def dkdv_source(point: AttentionBackwardParams) -> str:
    """The `_dkdv` kernel of a backward point's rendered source (the last but `_dbsum`)."""
    return point.render().split("_dkdv(BWD_ARGS)")[1].split("_dbsum(BWD_ARGS)")[0]


# The shipped configurations, whose attention points the ptxas test builds in their layouts.
SHIPPED = sorted((Path(__file__).parents[2] / "layouts").glob("h100-bert-*.json"))


def shipped_attention(path: Path) -> list:
    """The points of our attention a shipped configuration runs at its size (none where it takes SDPA's)."""
    return configured_points(json.loads(path.read_text(encoding="utf-8")))


def ptxas_report(point, workdir: Path) -> str:
    """What ptxas says (`--resource-usage`) of the point's build: registers, spills, and the warpgroup syncs it
    injects."""
    import subprocess

    from substation.jit import NVCC_OPTIONS, nvcc

    src = workdir / "kernel.cu"
    src.write_text(point.render())
    done = subprocess.run([nvcc()[0], "-cubin", f"-arch={point.compile_arch(H100)}", *NVCC_OPTIONS,
                           "--resource-usage", "-o", str(workdir / "kernel.cubin"), str(src)],
                          capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_the_shipped_wgmma_kernels_keep_their_chains_whole(path, tmp_path):
    """ptxas neither spills in the shipped configurations' wgmma kernels nor injects a warpgroup arrive or wait
    (C7519, C7517: where a register is written between one product's wgmmas and the next's, so that the products
    wait for each other)."""
    points = [point for point in shipped_attention(path) if point.wgmma]
    if not points:
        pytest.skip(f"{path.name} runs no wgmma attention")
    for point in points:
        point.check()
        report = ptxas_report(point, tmp_path)
        assert "C7519" not in report and "C7517" not in report, (point.label, report)
        spills = re.findall(r"(\d+) bytes spill stores", report)
        assert spills and not any(int(n) for n in spills), (point.label, report)


@pytest.mark.parametrize("L, block_m, block_n, dtype, fuse_dq, stacked", BWD_WGMMA_BUILDS)
def test_backward_wgmma_renders_and_compiles_for_sm90a(L, block_m, block_n, dtype, fuse_dq, stacked, tmp_path,
                                                       monkeypatch):
    """`_dkdv`'s four products by wgmma (the fused dQ product stays mma.sync's): every mode compiles for sm_90a, in
    any layout."""
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    rng = random.Random(L + block_m + block_n + fuse_dq)
    layouts = random_backward_layouts(rng)
    if stacked:
        layouts = ({n: lay for n, lay in layouts.items() if n not in ("dQ", "dK", "dV")}
                   | {"dQKV": "".join(rng.sample("bjthp", 5)), "dbqkv": "".join(rng.sample("thp", 3))})
    point = make_backward(size(2, 3, L), dtype, layouts, block_m=block_m, block_n=block_n, fuse_dq=fuse_dq, wgmma=1)
    assert point.compile_arch(H100) == "sm_90a" and point.stacked == stacked
    source = dkdv_source(point)
    assert source.count("wgmma_ss(") == source.count("wgmma_ss_first(") == 2 and source.count("wgmma_rs(") == 2
    assert "__align__(1024)" in source
    assert not any(f"mma16816({acc}[" in source for acc in ("s", "dp", "dv", "dk"))
    assert ("mma16816(dqp[" in source) == bool(fuse_dq) and ("key_ds_s" in source) == (stacked and point.d_inside)
    cubin = point.compile()
    assert cubin.arch == "sm_90a" and cubin.path.parent.name == "sm_90a"
    assert cubin.path.read_bytes()[:4] == b"\x7fELF"


def test_backward_wgmma_off_renders_and_labels_as_before():
    """wgmma=0 is the knob's absence: the label, kernel names, source (no wgmma code, mma.sync for every product)
    and architecture of the point without it, in every mode; the profiled variants on Hopper are each tile point
    with wgmma off and on."""
    for layouts, fuse_dq in itertools.product([BWD_CANONICAL, STACKED_CANONICAL], [0, 1, 2]):
        plain = make_backward(size(2, 3, 200), "float16", layouts, block_m=64, block_n=32, fuse_dq=fuse_dq)
        off = make_backward(size(2, 3, 200), "float16", layouts, block_m=64, block_n=32, fuse_dq=fuse_dq, wgmma=0)
        assert off.wgmma == 0 and "wgmma" not in off.label and off.label == plain.label and off.name == plain.name
        source = off.render()
        assert source == plain.render() and "wgmma" not in source and "__align__(1024)" not in source
        assert "mma16816(dv[2 * np]" in source and off.compile_arch(H100) == "sm_90"
    assert_profiled_with_and_without_wgmma(backward_variants(size(8, 16, 512), "float16", BWD_CANONICAL), 1)


@pytest.mark.parametrize("L", [100, 128])
def test_both_keep_paths_compile_for_sm90(L, tmp_path, monkeypatch):
    """The forward (keep_tile_qk) and the unfused backward (keep_tile_qk in _dq, keep_tile_kq in _dkdv) with L a
    multiple of 8 (one Philox call per 8 keys) and L = 4 mod 8 (the per-row fallback, keep_run)."""
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    points = [make(size(2, 3, L), "float16", CANONICAL), make_backward(size(2, 3, L), "bfloat16", BWD_CANONICAL)]
    with ThreadPoolExecutor(2) as pool:
        for cubin in pool.map(lambda q: q.compile(), points):
            assert cubin.path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("L, fused, launches", [(128, 0, ("dq", "dkdv")), (128, 1, ("dkdv",)),
                                                (200, 1, ("d", "dkdv", "dqsum")), (200, 2, ("d", "dkdv")),
                                                (200, 4, ("d", "dkdv", "dqsum"))])
@pytest.mark.parametrize("stacked", [False, True])
def test_backward_launches_and_workspace(L, fused, launches, stacked):
    """Unfused: _dq then _dkdv, the workspace D alone; fused where one key tile of block_m = 128 covers L: _dkdv
    alone, no D (it works D out); fused over several key tiles: _d, _dkdv, _dqsum over partials of every key tile;
    summed by the last block: _d (which zeroes the counts) and _dkdv, the partials then a count per (b, h); added
    up by atomics: _d (which zeroes the one float32 accumulator), _dkdv and _dqsum over that one slice.
    Stacked: then _dbsum, over dbqkv's partial sums (one per t, b, row tile, h, p) at the workspace's end, but where
    _dqsum runs: the last of its blocks of each head adds up that head's (_d zeroes a count per head)."""
    params = make_backward(size(2, 3, L), "float16", STACKED_CANONICAL if stacked else BWD_CANONICAL,
                           block_m=128, block_n=32, fuse_dq=fused)
    params.check()
    source = params.render()
    assert ("_d(BWD_ARGS)" in source) == ("d" in launches) and ("const z_cur" in source) == params.d_inside
    assert ("key_ds_s" in source) == (stacked and params.d_inside)
    bias_in_dqsum = stacked and "dqsum" in launches
    dbsum = ("dbsum",) * (stacked and not bias_in_dqsum)
    assert tuple(part for part, _, _ in params.launch_shapes()) == launches + dbsum
    assert ("red.relaxed.gpu.global.add" in source) == (fused == 4)
    assert params.d_inside == (launches == ("dkdv",))
    d = math.ceil(2 * 3 * L / 64) * 64
    row_tiles = math.ceil(L / 128)
    bias = 3 * 2 * row_tiles * 3 * 64 * stacked
    counts = 64 if fused == 2 or bias_in_dqsum else 0  # 2 x 3 counts (or 3, one per head), rounded up to 64
    slices = 1 if fused == 4 else row_tiles
    dq = 0 if row_tiles == 1 or not fused else slices * 2 * 3 * L * 64 + counts
    assert params.workspace_shape() == ((0 if params.d_inside else d) + dq + bias,)
    context = params.render_context()
    assert context["BIAS_OFFSET"] == params.workspace_shape()[0] - bias
    assert context["COUNT_OFFSET"] == context["BIAS_OFFSET"] - counts


STACKED_CANONICAL = ({n: lay for n, lay in BWD_CANONICAL.items() if n not in ("dQ", "dK", "dV")}
                     | {"dQKV": "bjthp", "dbqkv": "thp"})


# Per pass: its point builder, canonical layouts, top wgmma level, extra knobs where P = 128 needs them, and tile
# points (layouts, knobs) that take the top level.
WGMMA_PASSES = {
    "forward": (make, CANONICAL, 2, {}, [(CANONICAL, dict(block_m=64, wgmma=1)), (CANONICAL, dict(block_m=128))]),
    "backward": (make_backward, BWD_CANONICAL, 1, dict(block_n=32),
                 [(BWD_CANONICAL, dict(block_m=64, fuse_dq=0)), (STACKED_CANONICAL, dict(block_m=128, fuse_dq=2)),
                  (BWD_CANONICAL, dict(block_m=128, fuse_dq=1))]),
}


@pytest.mark.parametrize("pass_", list(WGMMA_PASSES))
def test_wgmma_feasibility_and_labels(pass_):
    """The knob's levels, P = 64, a tensor-core dtype and a Hopper GPU are required and named; its points label,
    parse back and run a warpgroup's worth of warps per 64 rows."""
    build, canonical, top, wide_knobs, points = WGMMA_PASSES[pass_]
    sz = size(2, 3, 200)
    levels = "0, 1 or 2" if top == 2 else "0 or 1"
    with pytest.raises(InfeasibleVariantError, match=f"wgmma={top + 1} must be {levels}"):
        build(sz, "float16", canonical, wgmma=top + 1).check()
    with pytest.raises(InfeasibleVariantError, match=f"wgmma={top} needs P=64 .* not P=128"):
        build(size(2, 3, 200, P=128), "bfloat16", canonical, wgmma=top, **wide_knobs).check()
    with pytest.raises(InfeasibleVariantError, match="no tensor-core kernel"):
        build(sz, "float32", canonical, wgmma=1).check()
    ampere = dataclasses.replace(H100, name="A100", major=8, minor=0)
    with pytest.raises(InfeasibleVariantError, match=r"wgmma=1 is Hopper's \(sm_90a\), not A100's \(sm_80\)"):
        build(sz, "float16", canonical, wgmma=1).check(ampere)
    build(sz, "float16", canonical, wgmma=0).check(ampere)
    for layouts, knobs in points:
        point = build(sz, "bfloat16", layouts, **({"wgmma": top} | knobs))
        point.check()
        assert f"wgmma={point.wgmma}" in point.label and point.threads == point.block_m // 16 * 32
        assert dataclasses.replace(parse_label(point.label), covers=point.candidate.covers) == point.candidate
        assert dict(parse_label(point.label).options)["wgmma"] == point.wgmma


def test_a_stacked_point_writes_the_slices_of_dqkv():
    """dQ, dK, dV are dQKV[0], [1], [2] in any order of dQKV's letters: the kernels take dQKV's strides (its j the
    rows of every slice) and the bound launch hands them the slices' addresses in dQKV's place, dbqkv's after them;
    `_dbsum` writes dbqkv by its strides, in any order of t, h, p."""
    sz = size(2, 3, 40)
    point = make_backward(sz, "float16", STACKED_CANONICAL | {"dQKV": "hjbtp", "dbqkv": "pth"}, fuse_dq=1)
    point.check()
    assert point.stacked and point.slice_offsets() == (0, 64, 128)
    context = point.render_context()
    slices = {t["name"]: t for t in context["TENSORS"] if t["name"] in ("dQ", "dK", "dV")}
    assert all((t["stride_b"], t["stride_row"], t["stride_h"], t["stride_p"], t["vector"]) ==
               (3 * 64, 2 * 3 * 64, 40 * 2 * 3 * 64, 1, True) for t in slices.values())
    assert context["DB"] == {"p": 9, "t": 3, "h": 1}
    seen = []
    bound = BoundBackward(point.tensor_names, [lambda stream, *values: seen.append(values)], lambda args: (0.5,),
                          (16,), 0, slice_bytes=(0, 128, 256))
    pointers = [0x1000 * (i + 1) for i in range(len(point.tensor_names))]
    bound(pointers, OpArgs(scale=0.5), 7, workspace=torch.zeros(16))
    (values,) = seen
    *inputs, dqkv, dbqkv = pointers
    assert values[:len(pointers) + 2] == (*inputs, dqkv, dqkv + 128, dqkv + 256, dbqkv)
    assert values[-1] == 0.5


@pytest.mark.parametrize("L, fused", [(128, 1), (128, 0), (200, 1)])
def test_stacked_point_sums_dq_where_it_writes_it(L, fused):
    """Where one key tile covers L (fused), dQ leaves `_dkdv` from registers, so its dbqkv sums come from each
    key's Σ_j dS in shared memory (block_m floats more) weighting the K tile; elsewhere from dQ's staged tile
    (`_dq`) or `_dqsum`: no extra shared memory. dbqkv's sums: `_dbsum`, or with `_dqsum` the last of each head's
    `_dqsum` blocks (counted)."""
    apart = make_backward(size(2, 3, L), "float16", BWD_CANONICAL, block_m=128, block_n=32, fuse_dq=fused)
    stacked = make_backward(size(2, 3, L), "float16", STACKED_CANONICAL, block_m=128, block_n=32, fuse_dq=fused)
    assert stacked.shared_bytes - apart.shared_bytes == (128 * 4 if stacked.d_inside else 0)
    source = stacked.render()
    assert ("key_ds_s" in source) == stacked.d_inside and "_dbsum(" not in apart.render()
    assert ("_dbsum(" in source) != stacked.bias_in_dqsum and ("count_done(" in source) == stacked.bias_in_dqsum
    assert stacked.bias_in_dqsum == (L == 200)


def kernel_arguments(source: str) -> int:
    """How many arguments BWD_ARGS declares in a rendered backward source."""
    lines = source.split("#define BWD_ARGS")[1].splitlines()
    end = next(i for i, line in enumerate(lines) if not line.rstrip().endswith("\\"))
    return "".join(lines[:end + 1]).count(",") + 1


@pytest.mark.parametrize("layouts", [BWD_CANONICAL, STACKED_CANONICAL], ids=["apart", "stacked"])
@pytest.mark.parametrize("fuse_dq", [0, 1, 2, 4])
def test_bound_backward_launches_take_every_argument_the_kernels_declare(layouts, fuse_dq, monkeypatch):
    """Each launch packs as many arguments as BWD_ARGS declares (a stacked dQKV is three slices' addresses)."""
    monkeypatch.setattr(base, "kernel_function", lambda *args: 1)
    monkeypatch.setattr(launch, "_launch_kernel", lambda: None)
    monkeypatch.setattr(DeviceSpec, "of", classmethod(lambda cls, device: H100))
    point = make_backward(size(2, 3, 200), "float16", layouts, fuse_dq=fuse_dq)
    bound = point.bind(Cubin(Path("unused.cubin"), "sm_90", cached=True), 0)
    assert {len(packed.signature) for packed in bound.launches} == {kernel_arguments(point.render())}


@pytest.mark.parametrize("seed", range(2))
def test_stacked_backward_renders_and_compiles_for_sm90(seed, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    rng = random.Random(300 + seed)
    params = stacked_point(rng, size(2, 3, rng.choice([77, 200]), 64), "bfloat16")
    assert params.compile().path.read_bytes()[:4] == b"\x7fELF"


def stacked_point(rng: random.Random, sz: Size, dtype: str) -> AttentionBackwardParams:
    """A random backward point writing a stacked dQKV and its dbqkv, each in a random order of its letters."""
    point = random_backward_point(rng, sz, dtype)
    layouts = {n: lay for n, lay in point.layouts if n not in ("dQ", "dK", "dV", "LSE")}
    return make_backward(sz, dtype, layouts | {"dQKV": "".join(rng.sample("bjthp", 5)),
                                               "dbqkv": "".join(rng.sample("thp", 3))},
                         block_m=point.block_m, block_n=point.block_n, fuse_dq=point.fuse_dq,
                         min_blocks=point.min_blocks)


BACKWARD_CASES = [(L, P, dtype, p, padded) for L in (33, 77, 100, 128, 200, 512) for P in (64, 128)
                  for dtype in ("float16", "bfloat16") for p in (0.0, 0.1) for padded in (False, True)]
# _dkdv's products by mma.sync and by wgmma (P = 64 only): a case with its wgmma setting.
BACKWARD_WGMMA_CASES = [(*case, wgmma) for case in BACKWARD_CASES for wgmma in (0, 1) if not wgmma or case[1] == 64]


def backward_points(L: int, P: int, dtype: str, p: float, padded: bool
                    ) -> tuple[AttentionParams, AttentionBackwardParams]:
    """The (seeded) random forward and backward points a backward case runs: Q, K, V, M, Z in the same layouts."""
    rng = random.Random(f"bwd{L}{P}{dtype}{p}{padded}")
    bwd = random_backward_point(rng, size(2 if L == 512 else 3, 4, L, P), dtype)
    lay = dict(bwd.layouts)
    fwd = make(size(bwd.B, bwd.H, L, P), dtype, {n: lay[n] for n in ("Q", "K", "V", "M", "Z")},
               block_m=rng.choice([64, 128]), block_n=rng.choice([32, 64]))
    return fwd, bwd


def gpu_builds() -> set:
    """Every point the GPU tests launch (`scripts/build_gpu_test_kernels.py` builds them ahead, without a GPU)."""
    points = set(gpu_points()) | {x for case in BACKWARD_CASES for x in backward_points(*case)}
    points |= {replaced(x, fuse_dq=f) for x in points if isinstance(x, AttentionBackwardParams)
               for f in (0, 1, 2, ATOMIC_DQ) if f < 2 or x.row_tiles > 1}
    points |= {stacked_point(random.Random(f"stacked{case}"), size(3, 2, case[0], case[1]), case[2])
               for case in STACKED_CASES} | {one_tile_point(case) for case in ONE_TILE_CASES}
    points |= {x for case in LAST_BLOCK_CASES for x in last_block_points(case)}
    points |= {replaced(x, fuse_dq=ATOMIC_DQ) for case in LAST_BLOCK_CASES for x in last_block_points(case)}
    points |= {x for case in SPLIT_CASES for x in split_points(case)}
    return points | {replaced(x, wgmma=1) for x in points if isinstance(x, AttentionBackwardParams) and x.P == 64}


@pytest.fixture(scope="module", autouse=True)
def compile_gpu_points():
    """On a GPU, compile every point the GPU tests launch at once, in parallel (nvcc runs in subprocesses), into
    the cache the tests then read."""
    if torch.cuda.is_available():
        spec = DeviceSpec.of(0)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda q: q.compile(spec), feasible(gpu_builds(), spec)))


def compiled(params) -> object:
    return params.compile(DeviceSpec.of(0))


def launch_backward(fwd: AttentionParams, bwd: AttentionBackwardParams, inputs: dict, dZ: torch.Tensor,
                    args: OpArgs, workspace: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Our forward, then our backward (in `workspace` where given), on the logical inputs stored in the points'
    layouts (their outputs NaN until written): every tensor of the backward by name, as stored."""
    lay = dict(bwd.layouts)
    tensors = {n: stored(x, tensor_dims(n), lay[n]) for n, x in inputs.items()}
    tensors["dZ"] = stored(dZ, "bjhp", lay["dZ"])
    dtype = DTYPES[bwd.dtype]
    tensors["Z"] = torch.full([bwd.extents[d] for d in lay["Z"]], math.nan, device="cuda", dtype=dtype)
    tensors["LSE"] = torch.full((bwd.B, bwd.H, bwd.L), math.nan, device="cuda")
    fwd.launch(compiled(fwd), {n: tensors[n] for n in fwd.tensor_names}, args)
    for n in ("dQ", "dK", "dV", "dQKV", "dbqkv"):
        if n in lay:
            tensors[n] = torch.full([bwd.extents[d] for d in lay[n]], math.nan, device="cuda", dtype=dtype)
    bwd.launch(compiled(bwd), {n: tensors[n] for n in bwd.tensor_names}, args, workspace)
    return tensors


def run_backward(fwd: AttentionParams, bwd: AttentionBackwardParams, inputs: dict, dZ: torch.Tensor, args: OpArgs
                 ) -> tuple[torch.Tensor, ...]:
    """`launch_backward`'s logical dQ, dK, dV."""
    tensors, lay = launch_backward(fwd, bwd, inputs, dZ, args), dict(bwd.layouts)
    torch.cuda.synchronize()
    return tuple(logical(tensors[n], lay[n], tensor_dims(n)) for n in ("dQ", "dK", "dV"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("L, P, dtype, p, padded, wgmma", BACKWARD_WGMMA_CASES)
def test_backward_matches_float64_reference(L, P, dtype, p, padded, wgmma):
    needs_wgmma(wgmma)
    fwd, bwd = backward_points(L, P, dtype, p, padded)
    bwd = replaced(bwd, wgmma=wgmma)
    sz, torch_dtype = size(bwd.B, bwd.H, L, P), DTYPES[dtype]
    inputs = random_inputs(sz, torch_dtype, padded, seed=L + P)
    gen = torch.Generator(device="cuda").manual_seed(L)
    dZ = torch.randn(sz.B, L, sz.H, P, device="cuda", generator=gen).to(torch_dtype)  # bjhp
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=p, seed=2**35 + L, offset=3).with_device_rng("cuda")
    grads = run_backward(fwd, bwd, inputs, dZ, args)
    want = reference_backward(args, *(inputs[n].double() for n in ("Q", "K", "V", "M")), dZ.double())
    torch_grads = reference_backward(args, *(inputs[n] for n in ("Q", "K", "V", "M")), dZ)  # PyTorch in the dtype
    for name, got, ref, theirs in zip(("dQ", "dK", "dV"), grads, want, torch_grads):
        budget = error_budget(relative_error(theirs, ref), torch_dtype)
        assert relative_error(got, ref) <= budget, (name, relative_error(got, ref), budget, bwd.label)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["dQ", "dQKV"])
def test_a_misaligned_gradient_is_refused(name):
    """With p innermost a gradient moves in 16-byte accesses: one starting 2 bytes off is refused by name, the
    stacked dQKV (whose slices the kernels write) too."""
    layouts = BWD_CANONICAL if name == "dQ" else STACKED_CANONICAL
    point = make_backward(size(2, 3, 40), "float16", layouts)
    tensors = {n: torch.ones(point.tensor_shape(lay), device="cuda",
                             dtype=torch.float32 if n == "LSE" else torch.float16) for n, lay in point.layouts}
    point.check_tensors(tensors)
    shape = point.tensor_shape(dict(point.layouts)[name])
    tensors[name] = torch.ones(math.prod(shape) + 1, device="cuda", dtype=torch.float16)[1:].view(shape)
    with pytest.raises(ValueError, match=f"name='{name}' starts at .*aligned to 16 bytes"):
        point.check_tensors(tensors)


STACKED_CASES = [(77, 64, "float16", 0.1, True), (128, 64, "bfloat16", 0.1, True), (200, 128, "float16", 0.0, False),
                 (512, 64, "bfloat16", 0.1, True)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wgmma", [0, 1])
@pytest.mark.parametrize("case", STACKED_CASES)
def test_stacked_backward_writes_the_same_gradients_into_dqkv(case, wgmma):
    """The stacked point writes the bits the point writing dQ, dK, dV apart writes (the same kernels, other
    strides), into every slice of dQKV, and dbqkv = Σ_bj dQKV matches the float64 reference, the same bits in a
    second run (its partial sums are added in a fixed order); by mma.sync and by wgmma (P = 64)."""
    L, P, dtype, _, _ = case
    skip_wgmma_unless_64(wgmma, P)
    check_stacked(replaced(stacked_point(random.Random(f"stacked{case}"), size(3, 2, L, P), dtype), wgmma=wgmma),
                  case)


ONE_TILE_CASES = [(100, 64, "float16", 0.1, True), (128, 128, "bfloat16", 0.0, False)]


def one_tile_point(case: tuple) -> AttentionBackwardParams:
    """A stacked point whose one key tile covers L (fused: `_dkdv` works D out and writes dQ itself); at P = 64
    with two blocks an SM (registers capped at 128: B96/L128's fastest backward spills a few)."""
    L, P, dtype, _, _ = case
    return make_backward(size(3, 2, L, P), dtype, STACKED_CANONICAL | {"dQKV": "hjtbp", "dbqkv": "pth"},
                         block_m=128, block_n=64 if P == 64 else 32, fuse_dq=1, min_blocks=2 if P == 64 else 1)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wgmma", [0, 1])
@pytest.mark.parametrize("case", ONE_TILE_CASES)
def test_stacked_backward_with_one_key_tile_sums_dq_from_registers(case, wgmma):
    """Where one key tile covers L, dQ leaves `_dkdv` from registers and its dbqkv sums are K's column sums
    weighted by each key's Σ_j dS: the same checks as every stacked point's."""
    skip_wgmma_unless_64(wgmma, case[1])
    stacked = replaced(one_tile_point(case), wgmma=wgmma)
    assert stacked.d_inside
    check_stacked(stacked, case)


def check_stacked(stacked: AttentionBackwardParams, case: tuple) -> None:
    """`stacked`'s slices bit-identical to its twin's writing dQ, dK, dV apart (both by wgmma where it is), dbqkv
    within budget of the float64 reference and the same bits in a second run."""
    L, P, dtype, p, padded = case
    lay = dict(stacked.layouts)
    apart = make_backward(size(3, 2, L, P), dtype, {n: l for n, l in lay.items() if n not in ("dQKV", "dbqkv", "LSE")}
                          | {"dQ": "bhjp", "dK": "khbp", "dV": "bkhp"}, block_m=stacked.block_m,
                          block_n=stacked.block_n, fuse_dq=stacked.fuse_dq, wgmma=stacked.wgmma)
    fwd = make(size(3, 2, L, P), dtype, {n: lay[n] for n in ("Q", "K", "V", "M", "Z")})
    inputs = random_inputs(size(3, 2, L, P), DTYPES[dtype], padded, seed=L)
    dZ = torch.randn(3, L, 2, P, device="cuda").to(DTYPES[dtype])
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=p, seed=5, offset=9).with_device_rng("cuda")
    want = run_backward(fwd, apart, inputs, dZ, args)
    got = run_stacked(fwd, stacked, inputs, dZ, args)
    for name, a, b in zip(("dQ", "dK", "dV"), (got[n] for n in ("dQ", "dK", "dV")), want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (name, stacked.label)
    exact = reference_backward(args, *(inputs[n].double() for n in ("Q", "K", "V", "M")), dZ.double())
    budget = error_budget(relative_error(reference_bias(want).double(), reference_bias(exact)), DTYPES[dtype])
    assert relative_error(got["dbqkv"], reference_bias(exact)) <= max(budget, 2e-3), stacked.label
    again = run_stacked(fwd, stacked, inputs, dZ, args)["dbqkv"]
    assert torch.equal(again.view(torch.int16), got["dbqkv"].view(torch.int16)), stacked.label


LAST_BLOCK_CASES = [(200, 64, "float16", 0.1, True, 64), (512, 64, "bfloat16", 0.1, True, 128),
                    (512, 128, "float16", 0.0, False, 64), (77, 64, "float16", 0.1, True, 64)]


def last_block_points(case: tuple) -> tuple[AttentionBackwardParams, ...]:
    """A case's fuse_dq=1 point, the same at fuse_dq=2, and fuse_dq=2 writing a stacked dQKV (B = 3, H = 2)."""
    L, P, dtype, _, _, block_m = case
    summed = make_backward(size(3, 2, L, P), dtype, BWD_CANONICAL, block_m=block_m, block_n=32, fuse_dq=1)
    stacked = make_backward(size(3, 2, L, P), dtype, STACKED_CANONICAL, block_m=block_m, block_n=32, fuse_dq=2)
    return summed, replaced(summed, fuse_dq=2), stacked


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wgmma", [0, 1])
@pytest.mark.parametrize("case", LAST_BLOCK_CASES)
def test_last_block_sums_dq_bit_for_bit_as_dqsum(case, wgmma):
    """fuse_dq=2's last block of each (b, h) adds the key tiles' float32 partials of dQ in the order `_dqsum` adds
    fuse_dq=1's, so dQ, dK and dV are the same bits (padded batches: tiles of masked keys only store zeros and are
    counted too); stacked, dQKV is too, and dbqkv holds to the float64 reference and repeats bit for bit. Run
    twice, so the counts the first call leaves behind are zeroed by `_d` before the second. By mma.sync and by
    wgmma (P = 64)."""
    L, P, dtype, p, padded, _ = case
    skip_wgmma_unless_64(wgmma, P)
    sz = size(3, 2, L, P)
    summed, last_block, stacked = (replaced(x, wgmma=wgmma) for x in last_block_points(case))
    assert last_block.row_tiles > 1 and [part for part, _, _ in last_block.launch_shapes()] == ["d", "dkdv"]
    fwd = make(sz, dtype, {n: BWD_CANONICAL[n] for n in ("Q", "K", "V", "M", "Z")})
    inputs = random_inputs(sz, DTYPES[dtype], padded, seed=L + 1)  # padded: 2 of 3 sequences end in dead tiles
    dZ = torch.randn(3, L, 2, P, device="cuda").to(DTYPES[dtype])
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=p, seed=5, offset=9).with_device_rng("cuda")
    want = run_backward(fwd, summed, inputs, dZ, args)
    for _ in range(2):
        got = run_backward(fwd, last_block, inputs, dZ, args)
        for name, a, b in zip(("dQ", "dK", "dV"), got, want):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (name, last_block.label)
    check_stacked(stacked, case[:5])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wgmma", [0, 1])
@pytest.mark.parametrize("case", LAST_BLOCK_CASES)
def test_dqsum_last_blocks_sum_dbqkv_bit_for_bit_as_dbsum(case, wgmma):
    """Stacked with `_dqsum` (fuse_dq=1), the last of each head's `_dqsum` blocks adds up dbqkv's partials with
    every load at once (`sum_head_bias`), in the order `_dbsum` adds them after fuse_dq=2's backward (whose dQ is
    fuse_dq=1's bits): dQKV and dbqkv are the same bits, in two runs. By mma.sync and by wgmma (P = 64)."""
    L, P, dtype, p, padded, _ = case
    skip_wgmma_unless_64(wgmma, P)
    sz = size(3, 2, L, P)
    dbsum = replaced(last_block_points(case)[2], wgmma=wgmma)
    in_dqsum = replaced(dbsum, fuse_dq=1)
    assert in_dqsum.bias_in_dqsum and [part for part, _, _ in dbsum.launch_shapes()] == ["d", "dkdv", "dbsum"]
    lay = dict(dbsum.layouts)
    fwd = make(sz, dtype, {n: lay[n] for n in ("Q", "K", "V", "M", "Z")})
    inputs = random_inputs(sz, DTYPES[dtype], padded, seed=L + 3)
    dZ = torch.randn(3, L, 2, P, device="cuda").to(DTYPES[dtype])
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=p, seed=3, offset=11).with_device_rng("cuda")
    want = run_stacked(fwd, dbsum, inputs, dZ, args)
    for _ in range(2):
        got = run_stacked(fwd, in_dqsum, inputs, dZ, args)
        for name in ("dQ", "dK", "dV", "dbqkv"):
            assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), (name, in_dqsum.label)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wgmma", [0, 1])
@pytest.mark.parametrize("case", LAST_BLOCK_CASES)
def test_atomic_dq_adds_up_what_dqsum_does(case, wgmma):
    """fuse_dq=4 adds the key tiles' parts of dQ by float atomics into one accumulator: dK and dV are fuse_dq=1's
    bits, dQ differs from fuse_dq=1's at most by the order of its float32 sums (checked against the float64
    reference too), stacked dQKV and dbqkv alike. Run twice, so that the accumulator the first call leaves behind is
    zeroed by `_d` before the second (else dQ would come out doubled). Another order of float32 sums moves a rounded
    value by at most one unit in its last place: eps of the dtype relative to the largest (dbqkv, a sum of them: 4
    eps). By mma.sync and by wgmma (P = 64)."""
    L, P, dtype, p, padded, _ = case
    skip_wgmma_unless_64(wgmma, P)
    sz = size(3, 2, L, P)
    summed, _, stacked_summed = (replaced(x, wgmma=wgmma) for x in last_block_points(case))
    atomic, stacked = replaced(summed, fuse_dq=ATOMIC_DQ), replaced(stacked_summed, fuse_dq=ATOMIC_DQ)
    assert [part for part, _, _ in atomic.launch_shapes()] == ["d", "dkdv", "dqsum"] and atomic.dq_slices == 1
    fwd = make(sz, dtype, {n: BWD_CANONICAL[n] for n in ("Q", "K", "V", "M", "Z")})
    inputs = random_inputs(sz, DTYPES[dtype], padded, seed=L + 2)
    dZ = torch.randn(3, L, 2, P, device="cuda").to(DTYPES[dtype])
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=p, seed=7, offset=5).with_device_rng("cuda")
    want = run_backward(fwd, summed, inputs, dZ, args)
    exact = reference_backward(args, *(inputs[n].double() for n in ("Q", "K", "V", "M")), dZ.double())
    ordered_error, eps = relative_error(want[0], exact[0]), torch.finfo(DTYPES[dtype]).eps
    for _ in range(2):
        got = run_backward(fwd, atomic, inputs, dZ, args)
        for name, a, b in zip(("dK", "dV"), got[1:], want[1:]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (name, atomic.label)
        assert relative_error(got[0], want[0]) <= eps, (relative_error(got[0], want[0]), atomic.label)
        assert relative_error(got[0], exact[0]) <= ordered_error + eps, atomic.label
    stacked_want = run_stacked(fwd, stacked_summed, inputs, dZ, args)
    for _ in range(2):
        got = run_stacked(fwd, stacked, inputs, dZ, args)
        for name in ("dQ", "dK", "dV", "dbqkv"):
            bound = 4 * eps if name == "dbqkv" else eps
            assert relative_error(got[name], stacked_want[name]) <= bound, (name, stacked.label)


@pytest.mark.gpu
@needs_gpu
def test_stacked_dbqkv_holds_where_the_key_weights_pass_float16s_range():
    """Where one key tile covers L, dQ's sums are K's column sums weighted by scale·Σ_j dS[j, k], packed into
    float16 operands. Here those weights reach past 65504 while every gradient and dbqkv stay in range (a near-
    uniform softmax, large V, dZ's rows alike: Σ_j dS[j, k] = scale·(Σ_j dZ_j)·(V_k − V̄) / L): dbqkv still matches
    the float64 reference (the kernel scales each warp's weights by a power of two)."""
    B, H, L, P = 2, 2, 128, 64
    point = make_backward(size(B, H, L, P), "float16", STACKED_CANONICAL, block_m=128, block_n=64, fuse_dq=1)
    assert point.d_inside
    gen = torch.Generator(device="cuda").manual_seed(7)
    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).half()
    inputs = {"Q": randn(B, H, L, P, scale=1e-3), "K": randn(B, H, L, P, scale=1e-2),
              "V": randn(B, H, L, P, scale=2e3), "M": torch.ones(B, L, device="cuda", dtype=torch.float16)}
    dZ = (randn(B, 1, H, P, scale=40.0).float() + randn(B, L, H, P, scale=1.0).float()).half()  # bjhp
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=0.0, seed=5, offset=9).with_device_rng("cuda")
    Q, K, V, dZ64 = (x.double() for x in (inputs["Q"], inputs["K"], inputs["V"], dZ))
    A = torch.softmax(args.scale * torch.einsum("bhjp,bhkp->bhjk", Q, K), dim=-1)
    dA = torch.einsum("bjhp,bhkp->bhjk", dZ64, V)
    dS = A * (dA - (dA * A).sum(dim=-1, keepdim=True))
    assert (args.scale * dS.sum(dim=2)).abs().max() > 65504  # the case this test is for
    exact = reference_backward(args, Q, K, V, inputs["M"].double(), dZ64)
    fwd = make(size(B, H, L, P), "float16", {n: STACKED_CANONICAL[n] for n in ("Q", "K", "V", "M", "Z")})
    got = run_stacked(fwd, point, inputs, dZ, args)
    want = reference_bias(exact)
    assert want.abs().max() < 65504 and all(g.abs().max() < 65504 for g in exact)
    for name, g, w in zip(("dQ", "dK", "dV", "dbqkv"), (got[n] for n in ("dQ", "dK", "dV", "dbqkv")), (*exact, want)):
        assert relative_error(g, w) <= 1e-2, (name, relative_error(g, w))


def run_stacked(fwd: AttentionParams, bwd: AttentionBackwardParams, inputs: dict, dZ: torch.Tensor, args: OpArgs
                ) -> dict[str, torch.Tensor]:
    """`launch_backward` on a stacked point: logical dQ, dK, dV and dbqkv."""
    tensors, lay = launch_backward(fwd, bwd, inputs, dZ, args), dict(bwd.layouts)
    torch.cuda.synchronize()
    return stacked_gradients(tensors["dQKV"], lay["dQKV"], tensors["dbqkv"], lay["dbqkv"])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", [(77, 64, "float16", 0.1, True), (512, 128, "bfloat16", 0.1, False)])
@pytest.mark.parametrize("fuse_dq", [0, 1])
@pytest.mark.parametrize("wgmma", [0, 1])
def test_backward_is_deterministic(case, fuse_dq, wgmma):
    skip_wgmma_unless_64(wgmma, case[1])
    fwd, bwd = backward_points(*case)
    bwd = replaced(bwd, fuse_dq=fuse_dq, wgmma=wgmma)
    L, P, dtype = case[:3]
    sz = size(bwd.B, bwd.H, L, P)
    inputs = random_inputs(sz, DTYPES[dtype], case[4], seed=5)
    dZ = torch.randn(sz.B, L, sz.H, P, device="cuda").to(DTYPES[dtype])
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=case[3], seed=99, offset=1).with_device_rng("cuda")
    first, second = run_backward(fwd, bwd, inputs, dZ, args), run_backward(fwd, bwd, inputs, dZ, args)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_variant_too_large_for_the_gpu_gives_way_to_one_that_fits():
    """A configuration made on a larger GPU: binding takes the first variant that fits, with a warning, or says
    that none does."""
    small = dataclasses.replace(H100, max_shared_bytes_per_block=48 * 1024)
    big = make(size(**BASE, P=128), "float16", CANONICAL, block_m=128)
    fits = make(size(**BASE, P=128), "float16", CANONICAL, block_m=64, block_n=32)
    assert runnable_variant(fits, small, lambda: pytest.fail("no fallback needed"), "attn_scores", SubstationError) is fits
    with pytest.warns(UserWarning, match=r"attn_scores: .*shared memory.*; running attn_scores/fwd attention\{block_m=64"):
        assert runnable_variant(big, small, lambda: [fits], "attn_scores", SubstationError) is fits
    with pytest.raises(SubstationError, match=r"cannot run on .* nor can any other variant in these layouts"):
        runnable_variant(big, small, lambda: [], "attn_scores", SubstationError)


# (B, H, L, P, dtype, dropout, keys kept: "random" (random_inputs' padded mask) or a share at each sequence's start,
# fuse_dq, stacked, block_m). The small batches fit one wave, where `_d` splits every tile; B8/H16/L512 has 512 key
# tiles, which the H100's 264 slots take in two waves unsplit (no split), and with a quarter padding splits the last
# live key tile index (256 whole blocks, then 256 halves).
SPLIT_CASES = [(3, 2, 200, 64, "float16", 0.1, "random", 1, False, 64),
               (3, 2, 512, 64, "bfloat16", 0.1, "random", ATOMIC_DQ, True, 128),
               (2, 3, 300, 128, "float16", 0.0, 1.0, 1, True, 64),
               (8, 16, 512, 64, "float16", 0.1, 1.0, 1, True, 128),
               (8, 16, 512, 64, "float16", 0.1, 0.75, 1, True, 128)]


def split_points(case: tuple) -> tuple[AttentionBackwardParams, ...]:
    """A split case's unsplit and split backward points, by mma.sync and (P = 64) by wgmma."""
    B, H, L, P, dtype, _, _, fuse_dq, stacked, block_m = case
    point = make_backward(size(B, H, L, P), dtype, STACKED_CANONICAL if stacked else BWD_CANONICAL, block_m=block_m,
                          block_n=32, fuse_dq=fuse_dq, min_blocks=2 if block_m == 128 and P == 64 else 1)
    points = (point, replaced(point, split_queries=1))
    return points + tuple(replaced(x, wgmma=1) for x in points if P == 64)


def test_split_queries_is_a_knob_of_the_fused_walk_over_several_key_tiles():
    """split_queries=1 doubles `_dkdv`'s grid and adds the decision, a count per key tile, each sequence's live key
    tiles and the float32 dK and dV of each tile's first half to the workspace's end; it takes fuse_dq 1 or 4 over
    several key tiles, nothing else, and shows in the label only where it is on. Its kernels take the wave slots as
    one more argument."""
    point = make_backward(size(2, 3, 200), "float16", STACKED_CANONICAL, block_m=64, block_n=32, fuse_dq=1)
    split = replaced(point, split_queries=1)
    split.check()
    assert "split_queries" not in point.label and "split_queries=1" in split.label
    tiles = 2 * 3 * 4
    assert dict((part, grid) for part, grid, _ in split.launch_shapes())["dkdv"] == 2 * tiles == 2 * point.grid
    words, partials = 64, 2 * tiles * 64 * 64
    assert split.workspace_shape()[0] == point.workspace_shape()[0] + words + partials
    assert split.render_context()["SPLIT_OFFSET"] == point.workspace_shape()[0]
    assert ", int slots" in split.render() and ", int slots" not in point.render()
    # `_d` stores each sequence's live key tiles with its decision; `_dqsum` reads that word, scanning no mask
    assert "live_tiles_of(D)[b] = last_key_s[b] / BM + 1;" in split.render()
    dqsum = split.render().split("_dqsum(BWD_ARGS) {")[1].split("\nextern ")[0]
    assert "live_tiles_of(D)[b]" in dqsum and "live_key_tiles(" not in dqsum
    for bad in (replaced(point, fuse_dq=2, split_queries=1), replaced(point, fuse_dq=0, split_queries=1),
                make_backward(size(2, 3, 128), "float16", BWD_CANONICAL, block_m=128, fuse_dq=1, split_queries=1)):
        with pytest.raises(InfeasibleVariantError, match="split_queries=1 splits the fused walk"):
            bad.check()
    with pytest.raises(InfeasibleVariantError, match="split_queries=2 must be 0 or 1"):
        replaced(point, split_queries=2).check()


@pytest.mark.parametrize("whole, halves, slots, end", [(512, 0, 264, 20), (0, 768, 264, 18), (384, 256, 264, 22),
                                                      (256, 256, 264, 16), (128, 512, 264, 18), (264, 0, 264, 10),
                                                      (0, 0, 264, 0), (10, 600, 100, 42)])
def test_split_makespan_counts_waves_of_whole_blocks_then_halves(whole, halves, slots, end):
    """In tenths of a whole block (a half takes 6): 512 whole blocks on 264 slots end in 2 waves; 768 halves in 3 of
    0.6; 256 whole blocks leave 8 slots, which take 2 halves each by 1.2, and the other 256 halves run on the
    whole blocks' slots from 1.0 to 1.6; 10 whole blocks on 100 slots leave 90 taking 600 halves: 7 each by 4.2."""
    assert split_makespan(whole, halves, slots) == end


@pytest.mark.parametrize("live, slots, first", [([128] * 4, 264, 4), ([128] * 3 + [0], 264, 2),
                                                ([128] * 2 + [0] * 2, 264, 4), ([128] + [0] * 3, 264, 0),
                                                ([6, 6], 264, 0), ([300, 300], 264, 1), ([200, 100], 264, 1)])
def test_first_split_tile_ends_the_grid_soonest(live, slots, first):
    """B8/L512 on the H100 (128 live blocks per key tile index): a full batch splits nothing, three live tiles of
    four split the third, two fit one wave whole (no split), one splits all; a small batch splits all; 600 blocks
    in two tile indices split the second (300 whole, then 600 halves end at 2.8 against 3 either way), and so
    do 200 + 100 (1.6 against 2 unsplit and 1.8 all split)."""
    assert first_split_tile(live, slots) == first


def test_split_kernels_bind_with_their_wave_slots(monkeypatch):
    """The bound split backward passes the slots of this device (blocks an SM holds x SMs) after the scalars."""
    monkeypatch.setattr(base, "kernel_function", lambda *args: 1)
    monkeypatch.setattr(launch, "_launch_kernel", lambda: None)
    monkeypatch.setattr(launch.PackedLaunch, "resident_blocks", lambda self: 2)
    monkeypatch.setattr(DeviceSpec, "of", classmethod(lambda cls, device: H100))
    point = make_backward(size(2, 3, 200), "float16", BWD_CANONICAL, fuse_dq=1, split_queries=1)
    bound = point.bind(Cubin(Path("unused.cubin"), "sm_90", cached=True), 0)
    assert {len(packed.signature) for packed in bound.launches} == {kernel_arguments(point.render())}
    args = OpArgs(scale=0.125, attention_dropout=0.0)
    assert bound.scalars(args) == (*point.scalars(args), 2 * H100.sm_count)


@pytest.mark.parametrize("stacked", [False, True])
def test_split_wgmma_kernels_keep_their_chains_whole(stacked, tmp_path):
    """The split backward of B8/L512's shipped tiles, by wgmma, neither spills nor makes ptxas serialize its
    wgmmas (C7519, C7517), split decision and query range being warp-uniform."""
    point = make_backward(size(8, 16, 512), "float16", STACKED_CANONICAL if stacked else BWD_CANONICAL, block_m=128,
                          block_n=32, fuse_dq=1, min_blocks=2, wgmma=1, split_queries=1)
    report = ptxas_report(point, tmp_path)
    assert "C7519" not in report and "C7517" not in report, report
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills and not any(int(n) for n in spills), report


def split_inputs(case: tuple) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A split case's logical inputs (its padding mask) and dZ: bjhp."""
    B, H, L, P, dtype, _, kept, *_ = case
    sz = size(B, H, L, P)
    inputs = random_inputs(sz, DTYPES[dtype], kept == "random", seed=L + B)
    if kept != "random":
        inputs["M"] = (torch.arange(L, device="cuda") < math.ceil(kept * L)).to(DTYPES[dtype]).expand(B, L)
    gen = torch.Generator(device="cuda").manual_seed(B * L)
    return inputs, torch.randn(B, L, H, P, device="cuda", generator=gen).to(DTYPES[dtype])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wgmma", [0, 1])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_backward_matches_float64_reference(case, wgmma):
    """The split backward's dQ, dK, dV (stacked: and dbqkv) against the float64 reference, within the budget of
    PyTorch's error in the dtype; `_d`'s decision as `first_split_tile` makes it from the live blocks of each key
    tile index (`live_blocks_per_tile`) and this device's slots; splitting none, the same bits as the point without the
    knob; either way the same bits in a second run (fuse_dq=1: no float atomics), so the halves' sums do not depend
    on which came first."""
    B, H, L, P, dtype, p, _, fuse_dq, stacked, _ = case
    skip_wgmma_unless_64(wgmma, P)
    plain, split = (x for x in split_points(case) if x.wgmma == wgmma)
    inputs, dZ = split_inputs(case)
    lay = dict(split.layouts)
    fwd = make(size(B, H, L, P), dtype, {n: lay[n] for n in ("Q", "K", "V", "M", "Z")})
    args = OpArgs(scale=1 / math.sqrt(P), attention_dropout=p, seed=2**34 + L, offset=7).with_device_rng("cuda")

    def run(point: AttentionBackwardParams, workspace: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        tensors = launch_backward(fwd, point, inputs, dZ, args, workspace)
        torch.cuda.synchronize()
        if stacked:
            return stacked_gradients(tensors["dQKV"], lay["dQKV"], tensors["dbqkv"], lay["dbqkv"])
        return {n: logical(tensors[n], lay[n], tensor_dims(n)) for n in ("dQ", "dK", "dV")}

    workspace = torch.empty(split.workspace_shape(), device="cuda")
    got = run(split, workspace)
    decided = workspace[split.render_context()["SPLIT_OFFSET"]].view(torch.int32).item()
    live = live_blocks_per_tile(inputs["M"], split.block_m, H)
    dkdv = next(x for x in split.bind(compiled(split), 0).launches if x.name.endswith("_dkdv"))
    assert decided == first_split_tile(live, dkdv.resident_blocks() * DeviceSpec.of(0).sm_count), split.label
    exact = reference_backward(args, *(inputs[n].double() for n in ("Q", "K", "V", "M")), dZ.double())
    theirs = reference_backward(args, *(inputs[n] for n in ("Q", "K", "V", "M")), dZ)  # PyTorch in the dtype
    for name, ref, torch_grad in zip(("dQ", "dK", "dV"), exact, theirs):
        budget = error_budget(relative_error(torch_grad, ref), DTYPES[dtype])
        assert relative_error(got[name], ref) <= budget, (name, relative_error(got[name], ref), budget, split.label)
    if stacked:
        budget = error_budget(relative_error(reference_bias(theirs).double(), reference_bias(exact)), DTYPES[dtype])
        assert relative_error(got["dbqkv"], reference_bias(exact)) <= max(budget, 2e-3), split.label
    again = run(split)
    unsplit = run(plain) if decided == split.row_tiles else None
    for name in got:
        if fuse_dq == 1:
            assert torch.equal(again[name].view(torch.int16), got[name].view(torch.int16)), (name, split.label)
        if unsplit is not None:
            assert torch.equal(unsplit[name].view(torch.int16), got[name].view(torch.int16)), (name, split.label)


def test_live_blocks_count_each_sequences_tiles_up_to_its_last_unmasked_key():
    """Padding at the end drops the tiles past it; a masked key inside a sequence drops nothing; a sequence with
    every key masked still counts its first tile (the forward walks one)."""
    M = torch.ones(4, 300)
    M[0, 200:] = 0  # last unmasked key 199: tiles 0..3 of 64
    M[1, 5] = 0  # all 5 tiles
    M[2, :] = 0  # none unmasked: tile 0
    M[3, 64:] = 0  # key 63: tile 0
    assert live_blocks_per_tile(M, 64, 3) == [12, 6, 6, 6, 3]
