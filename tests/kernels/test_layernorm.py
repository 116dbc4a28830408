"""ln1 / ln2 / ln2_bwd / ln1_bwd kernels: feasibility, labels, rendering + nvcc for sm_90 (CPU), and on the GPU
against the float64 reference in random layouts and awkward sizes, forward and every backward output, with and
without dropout; deterministic gradient reductions, the reference dropout mask, CUDA-graph replay."""
import dataclasses
import math
import random
import re

import pytest
import torch

from substation.graph import layer_graph
from substation.device import H100, DeviceSpec
from substation.kernels.base import InfeasibleVariantError
from substation.kernels.layernorm import OPS, LayerNormParams, variants
from substation.layouts import enumerate_layouts, logical, stored
from substation.reference import FUSED, OpArgs
from substation.sizes import Size, get_size
from substation.sizes import TORCH_DTYPES as DTYPES
from substation.accuracy import error_budget, relative_error

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GRAPH = layer_graph()
DEVICE = "cuda"  # of the GPU tests' tensors


def canonical(op: str) -> tuple[tuple[str, str], ...]:
    operator = GRAPH.operator(op)
    return tuple((n, GRAPH.tensors[n].dims) for n in operator.inputs + operator.outputs)


def random_point(rng: random.Random, op: str, B: int, L: int, I: int, dtype: str,
                 staging: str = "shared") -> LayerNormParams:
    """Random layouts of every tensor (i innermost in the row-tiled ones for register staging), then random tile,
    rows and threads, the widest feasible vector; shared staging where register staging fits no point."""
    operator = GRAPH.operator(op)
    names = operator.inputs + operator.outputs
    i_innermost = lambda dims: [lay for lay in enumerate_layouts(dims) if len(dims) < 3 or lay[-1] == "i"]  # noqa: E731
    choices = i_innermost if staging == "registers" else enumerate_layouts
    layouts = tuple((n, rng.choice(choices(GRAPH.tensors[n].dims))) for n in names)
    tiles = rng.sample("bj", 2)
    for tile in tiles:
        extent = {"b": B, "j": L}[tile]
        rows_options = [r for r in (1, 2, 4, 7, 8, 16, 32) if extent % r == 0]
        threads = rng.choice([64, 128, 256]) if I <= 2048 else 256
        # register staging: warps per row and rows in flight (drawn only there, so that shared points stay as they were)
        team, inflight = (rng.choice([1, 2, 4]), rng.choice([1, 2, 3])) if staging == "registers" else (1, 1)
        for rows in rng.sample(rows_options, len(rows_options)):
            row_tiles = rng.choice([1, 1, 2, 3, 5])
            for vec in (8, 4, 2, 1):
                params = LayerNormParams(op=op, dtype=dtype, layouts=layouts, B=B, L=L, I=I, tile=tile, rows=rows,
                                         vec=vec, threads=threads, row_tiles=min(row_tiles, B * L // rows),
                                         staging=staging, team=min(team, threads // 32), inflight=min(inflight, rows))
                try:
                    params.check()
                    return params
                except InfeasibleVariantError:
                    continue
    if staging == "registers":
        return random_point(rng, op, B, L, I, dtype)
    raise AssertionError("rows=1, vec=1 is always feasible")


def test_feasibility_rules_are_named():
    base = dict(op="ln1", dtype="float16", layouts=canonical("ln1"), B=2, L=40, I=1024)
    with pytest.raises(InfeasibleVariantError, match="rows=16 must divide the extent 40"):
        LayerNormParams(**base, tile="j", rows=16).check()
    with pytest.raises(InfeasibleVariantError, match="tile='i' must be one of the row dims"):
        LayerNormParams(**base, tile="i", rows=8).check()
    transposed = dict(canonical("ln1")) | {"X": "bij"}
    with pytest.raises(InfeasibleVariantError, match="vec=8 must divide 4, the swept extent of X:bij"):
        LayerNormParams(**(base | {"layouts": tuple(transposed.items())}), tile="j", rows=4, vec=8).check()
    with pytest.raises(InfeasibleVariantError, match="vec=2 must divide 77, the swept extent of O:bji"):
        LayerNormParams(**(base | {"I": 77}), tile="j", rows=8, vec=2).check()
    with pytest.raises(InfeasibleVariantError, match="move at most 16 bytes"):
        LayerNormParams(**(base | {"dtype": "float32"}), tile="j", rows=8, vec=8).check()
    with pytest.raises(InfeasibleVariantError, match="threads=100 must be a multiple of 32"):
        LayerNormParams(**base, tile="j", rows=8, threads=100).check()
    with pytest.raises(InfeasibleVariantError, match="row_tiles=11 must lie in \\[1, 10\\], the number of row tiles"):
        LayerNormParams(**base, tile="j", rows=8, row_tiles=11).check()
    with pytest.raises(InfeasibleVariantError, match="I=8192 needs 256 float32 values of its rows per lane"):
        LayerNormParams(**(base | {"I": 8192}), tile="j", rows=1).check()
    with pytest.raises(InfeasibleVariantError, match="threads=64 leaves 192 float32 column sums"):
        LayerNormParams(**(base | {"op": "ln2_bwd", "layouts": canonical("ln2_bwd"), "I": 4096}), tile="j", rows=1,
                        threads=64).check()
    with pytest.raises(InfeasibleVariantError, match="shared memory"):
        LayerNormParams(**(base | {"op": "ln1_bwd", "layouts": canonical("ln1_bwd"), "I": 8192}),
                        tile="j", rows=8).check()
    with pytest.raises(InfeasibleVariantError, match="layouts are given for"):
        LayerNormParams(**(base | {"layouts": canonical("ln2")}), tile="j", rows=8).check()
    with pytest.raises(InfeasibleVariantError, match="layout 'bj' of X is not an order of its dims"):
        LayerNormParams(**(base | {"layouts": tuple((dict(canonical("ln1")) | {"X": "bj"}).items())}),
                        tile="j", rows=8).check()
    with pytest.raises(InfeasibleVariantError, match="dtype 'float64' has no kernel"):
        LayerNormParams(**(base | {"dtype": "float64"}), tile="j", rows=8).check()
    with pytest.raises(InfeasibleVariantError, match="staging='registers' needs i innermost in every row-tiled tensor, "
                                                     "but X is 'bij'"):
        LayerNormParams(**(base | {"layouts": tuple(transposed.items())}), tile="j", rows=4, vec=4,
                        staging="registers").check()
    with pytest.raises(InfeasibleVariantError, match="staging='registers' needs vec=4 or 8"):
        LayerNormParams(**base, tile="j", rows=4, vec=2, staging="registers").check()
    with pytest.raises(InfeasibleVariantError, match="staging='global' must be one of"):
        LayerNormParams(**base, tile="j", rows=4, staging="global").check()
    registers = base | {"tile": "j", "rows": 4, "vec": 8, "staging": "registers"}
    with pytest.raises(InfeasibleVariantError, match="team=2, inflight=1, stages=1 need staging='registers'"):
        LayerNormParams(**(registers | {"staging": "shared"}), team=2).check()
    with pytest.raises(InfeasibleVariantError, match="team=1, inflight=1, stages=2 need staging='registers'"):
        LayerNormParams(**(registers | {"staging": "shared"}), stages=2).check()
    with pytest.raises(InfeasibleVariantError, match="stages=0 must be a positive integer"):
        LayerNormParams(**registers, stages=0).check()
    with pytest.raises(InfeasibleVariantError, match="stages=2 copies rows in 16-byte pieces \\(cp.async.cg\\), so it "
                                                     "needs vec=8 in float16, not vec=4"):
        LayerNormParams(**(registers | {"vec": 4}), stages=2).check()
    with pytest.raises(InfeasibleVariantError, match="team=3 must divide the block's 8 warps"):
        LayerNormParams(**registers, team=3).check()
    with pytest.raises(InfeasibleVariantError, match="16 teams of 2 warps exceed the 15 named barriers"):
        LayerNormParams(**registers, threads=1024, team=2).check()
    with pytest.raises(InfeasibleVariantError, match="inflight=5 must lie in \\[1, rows=4\\]"):
        LayerNormParams(**registers, inflight=5).check()
    with pytest.raises(InfeasibleVariantError, match="needs 256 float32 values of its rows per lane in registers "
                                                     "\\(team=1, inflight=8\\)"):
        LayerNormParams(**(registers | {"rows": 8}), inflight=8).check()
    LayerNormParams(**(registers | {"rows": 8}), team=4, inflight=8).check()  # 8 columns a thread: 64 values
    backward = base | {"op": "ln1_bwd", "layouts": canonical("ln1_bwd"), "tile": "j", "rows": 4, "vec": 8}
    with pytest.raises(InfeasibleVariantError, match="colsum='atomic' must be one of \\['kernel', 'grid'\\]"):
        LayerNormParams(**backward, colsum="atomic").check()
    with pytest.raises(InfeasibleVariantError, match="colsum='grid' is for a backward's column sums"):
        LayerNormParams(**registers, colsum="grid").check()
    with pytest.raises(InfeasibleVariantError, match="its 20 blocks must be at most one per SM \\(16 on small\\)"):
        LayerNormParams(**backward, colsum="grid").check(DeviceSpec("small", 9, 0, 16, 227 * 1024))
    LayerNormParams(**backward, colsum="grid").check()  # 20 blocks on the H100's 132 SMs


def test_grid_colsum_is_one_kernel_whose_shared_memory_holds_the_warps_sums():
    """colsum="grid": the column sums after a grid-wide barrier in the main kernel (a cooperative launch), no
    `_colsum` kernel in the source; its shared memory at least the double sums of its warps for 32 columns."""
    base = dict(op="ln2_bwd", dtype="float16", layouts=canonical("ln2_bwd"), B=2, L=40, I=96, rows=8, vec=8)
    apart, grid = LayerNormParams(**base), LayerNormParams(**base, colsum="grid")
    source = grid.render()
    assert "this_grid().sync()" in source and "_colsum(" not in source and f" {grid.name}(" in source
    assert "this_grid" not in apart.render() and "_colsum (a dependent launch)" not in source
    assert grid.shared_bytes == max(apart.shared_bytes, 256 * 8)
    assert "colsum" not in apart.candidate.options_dict and grid.candidate.options_dict["colsum"] == "grid"


def test_backward_variants_of_one_block_per_sm_come_with_grid_colsum():
    size = get_size("bert-large-b8-l512")
    for op in ("ln1_bwd", "ln2_bwd"):
        found = variants(op, size, "float16", dict(canonical(op)))
        grid = [p for p in found if p.colsum == "grid"]
        assert grid and all(p.grid <= H100.sm_count for p in grid)
        twins = {dataclasses.replace(p, colsum="kernel") for p in grid}
        assert twins == {p for p in found if p.colsum == "kernel" and p.grid <= H100.sm_count}
    assert not any(p.colsum == "grid" for p in variants("ln1", size, "float16", dict(canonical("ln1"))))


@pytest.mark.parametrize("staging", ["shared", "registers"])
def test_grid_colsum_compiles_for_sm90(staging, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    for op in ("ln1_bwd", "ln2_bwd"):
        params = LayerNormParams(op=op, dtype="bfloat16", layouts=canonical(op), B=3, L=77, I=1024, rows=7, vec=8,
                                 threads=256, row_tiles=3, staging=staging, colsum="grid")
        params.check()
        assert params.compile().path.read_bytes()[:4] == b"\x7fELF"


def test_shared_memory_holds_tiles_stats_and_keep_bits():
    fwd = LayerNormParams(op="ln2", dtype="float16", layouts=canonical("ln2"), B=8, L=512, I=1024, rows=8)
    assert fwd.shared_bytes == 2 * 8 * 1026 * 2
    bwd = LayerNormParams(op="ln1_bwd", dtype="float32", layouts=canonical("ln1_bwd"), B=8, L=512, I=130, rows=8)
    assert bwd.stats_offset >= 3 * 8 * 131 * 4 and bwd.stats_offset % 16 == 0
    assert bwd.keep_offset >= bwd.stats_offset + 3 * 8 * 4
    assert bwd.shared_bytes == bwd.keep_offset + 8 * 32 * 2 <= H100.max_shared_bytes_per_block
    assert bwd.workspace_shape() == (8 * 512 // 8, 3, 130)
    assert fwd.workspace_shape() is None
    registers = dict(op="ln1_bwd", dtype="float16", layouts=canonical("ln1_bwd"), B=8, L=512, I=1024, rows=8,
                     threads=256, vec=8, staging="registers")
    assert LayerNormParams(**registers).shared_bytes == 8 * 3 * 1024 * 4  # each one-warp team's sums
    assert not LayerNormParams(**registers).sums_in_registers
    forward = registers | {"op": "ln2", "layouts": canonical("ln2")}
    assert LayerNormParams(**forward).shared_bytes == 0  # parameters through the read-only cache
    # two teams of four warps: the column sums in registers (3·8 a thread), then [2][3][I] at the end, and each
    # team's two exchange slots of 2 rows · 2 means · 4 warps
    teams = LayerNormParams(**registers, team=4, inflight=2)
    assert teams.sums_in_registers and teams.groups == 1
    assert teams.shared_bytes == 2 * 3 * 1024 * 4 + 2 * 2 * (2 * 2) * 4 * 4
    assert LayerNormParams(**forward, team=4, inflight=2).shared_bytes == 2 * 2 * 2 * 4 * 4
    # a pipeline of 3 stages after them: per thread 3 stages · 2 rows · 3 inputs (dO, dR1, N1) · 1 group of 16 bytes
    piped = LayerNormParams(**registers, team=4, inflight=2, stages=3)
    assert piped.stage_offset == teams.shared_bytes and piped.batches == 2
    assert piped.shared_bytes == teams.shared_bytes + 3 * 2 * 3 * 256 * 16
    assert LayerNormParams(**forward, team=4, inflight=2, stages=2).shared_bytes == 2 * 2 * 2 * 4 * 4 + 2 * 2 * 2 * 256 * 16


def test_labels_are_unique_and_parse_back():
    from substation.records import parse_label

    rng = random.Random(0)
    points = {random_point(rng, OPS[i % 4], 8, 512, 1024, "float16", ("shared", "registers")[i % 2])
              for i in range(60)}
    labels = {p.label for p in points}
    assert len(labels) == len(points)
    for p in points:
        assert parse_label(p.label) == p.candidate
        # staging, team and inflight appear only where they are not the default, so that labels profiled before
        # these knobs stay valid
        knobs = ({"tile", "rows", "vec", "threads", "row_tiles"} | ({"staging"} if p.registers else set())
                 | {k for k in ("team", "inflight") if getattr(p, k) != 1})
        assert p.candidate.options_dict.keys() == knobs
    assert any(p.registers for p in points) and any(p.team > 1 for p in points) and any(p.inflight > 1 for p in points)
    assert len({p.name for p in points}) == len(points)


def test_variants_are_feasible_for_bert_large():
    for preset in ("bert-large-b8-l512", "bert-large-b96-l128"):
        size = get_size(preset)
        for op in OPS:
            found = variants(op, size, "float16", dict(canonical(op)))
            assert found and all(p.op == op for p in found)
            assert any(p.registers for p in found)  # every canonical layout has i innermost
            assert {p.team for p in found if p.registers} == {1, 2, 4}  # one warp a row, half and full teams
            assert len(set(found)) == len(found)
            assert (found[-1].rows, found[-1].threads, found[-1].staging) == (1, 32, "shared")  # fits any B and L
            for p in found:
                p.check()


def test_backward_renders_both_kernels_in_one_source():
    params = LayerNormParams(op="ln2_bwd", dtype="bfloat16", layouts=canonical("ln2_bwd"), B=2, L=40, I=96, rows=8)
    source = params.render()
    assert f" {params.name}(" in source and f" {params.colsum_name}(" in source
    forward = LayerNormParams(op="ln1", dtype="bfloat16", layouts=canonical("ln1"), B=2, L=40, I=96, rows=8).render()
    assert "_colsum" not in forward


def test_launch_names_a_bad_tensor():
    params = LayerNormParams(op="ln1", dtype="float32", layouts=canonical("ln1"), B=2, L=4, I=8, rows=4, vec=4)
    tensors = {n: torch.zeros([params.extents[d] for d in lay]) for n, lay in params.layouts}
    tensors["X"] = torch.zeros(2, 8, 4)
    with pytest.raises(ValueError, match="name='X'.*expected a contiguous float32 tensor of shape \\(2, 4, 8\\)"):
        params.launch(None, tensors, OpArgs(scale=1.0))
    del tensors["X"]
    with pytest.raises(ValueError, match="tensor 'X' is missing"):
        params.launch(None, tensors, OpArgs(scale=1.0))
    tensors["X"] = torch.zeros(2 * 4 * 8 + 1)[1:].view(2, 4, 8)
    with pytest.raises(ValueError, match="name='X' starts at .*, which vec=4 accesses need aligned to 16 bytes"):
        params.launch(None, tensors, OpArgs(scale=1.0))
    tensors["X"] = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="name='O' is on cpu; the kernel needs CUDA tensors"):
        params.launch(None, tensors, OpArgs(scale=1.0))


@pytest.mark.parametrize("seed", range(8))
def test_renders_and_compiles_for_sm90(seed, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    rng = random.Random(seed)
    op, dtype = OPS[seed % 4], ["float16", "bfloat16", "float32"][seed % 3]
    B, L, I = rng.choice([(2, 77, 96), (8, 512, 1024), (3, 40, 130), (96, 128, 1024)])
    params = random_point(rng, op, B, L, I, dtype)
    first, second = params.compile(), params.compile()
    assert not first.cached and second.cached and first.path == second.path
    assert first.path.read_bytes()[:4] == b"\x7fELF"


# Row lengths and lane widths that take each keep-bit path: I a multiple of 8 with 8-element lanes (one call a
# lane) or 4-element lanes (lane pairs of a one-warp row share a call; 264 has an odd number of 128-element
# groups), and I = 4 mod 8 or odd, or 4-element lanes of a team of several warps (each lane's run from the one or
# two blocks it touches). Register staging also with teams of 2 and 4 warps and rows in flight.
MASK_SIZES = (256, 264, 100, 77)
MASK_LANES = (("shared", "float32", 1, 1, 1), ("registers", "float32", 4, 1, 1), ("registers", "float16", 8, 1, 1),
              ("registers", "float32", 4, 2, 2), ("registers", "bfloat16", 8, 4, 3))


def mask_points(I: int, staging: str, dtype: str, vec: int, team: int = 1, inflight: int = 1
                ) -> tuple[LayerNormParams, LayerNormParams] | None:
    """ln2 and ln2_bwd in canonical layouts (B=2, L=8, 4-row tiles), or None where the point is infeasible."""
    points = tuple(LayerNormParams(op=op, dtype=dtype, layouts=canonical(op), B=2, L=8, I=I, rows=4, vec=vec,
                                   threads=128, staging=staging, team=team, inflight=inflight)
                   for op in ("ln2", "ln2_bwd"))
    try:
        for params in points:
            params.check()
    except InfeasibleVariantError:
        return None
    return points


@pytest.mark.parametrize("I", MASK_SIZES)
@pytest.mark.parametrize("staging, dtype, vec, team, inflight", MASK_LANES)
def test_every_keep_path_compiles_for_sm90(I, staging, dtype, vec, team, inflight, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    points = mask_points(I, staging, dtype, vec, team, inflight)
    if points is None:
        pytest.skip(f"{I=}, {staging=}, {vec=} is infeasible")
    for params in points:
        source, width = params.render(), params.lane_width
        paired = I % 8 == 0 and width == 4 and team == 1
        assert ("pair_nibble(byte, g, lane)" in source) == paired
        assert bool(re.search(r"keep_bits\(keep_group\(row(\[q\])? \+ k0\)", source)) == (I % 8 == 0 and width == 8)
        assert ("keep_run<W>(row" in source) == (I % 8 != 0 or (width == 4 and not paired))
        assert (f"#define TEAM {team}\n" in source) == (staging == "registers")  # the team barrier is #if TEAM > 1
        assert params.compile().path.read_bytes()[:4] == b"\x7fELF"


# Register-staged points at odd sizes (L = 77: rows of 7 or 11, so that a team's last batch runs past its tile),
# I = 1024 and 768 (teams of 3 warps: one 8-element vector a thread), and pipelines of 2 and 3 stages over blocks of
# several batches (some of them partly or wholly past their tile): (I, team, inflight, threads, rows, row_tiles,
# stages).
TEAM_POINTS = [(1024, 1, 1, 128, 7, 1, 1), (1024, 1, 2, 64, 7, 3, 1), (1024, 4, 1, 128, 7, 2, 1),
               (1024, 4, 2, 256, 7, 1, 1), (1024, 4, 4, 256, 11, 2, 1), (1024, 2, 2, 128, 11, 5, 1),
               (768, 3, 1, 96, 7, 1, 1), (768, 3, 2, 192, 11, 3, 1), (768, 1, 3, 256, 7, 2, 1),
               (1024, 4, 2, 256, 7, 5, 2), (1024, 4, 1, 512, 11, 4, 3), (768, 3, 2, 192, 11, 3, 2),
               (1024, 2, 2, 128, 11, 5, 3)]


@pytest.mark.parametrize("I, team, inflight, threads, rows, row_tiles, stages", TEAM_POINTS)
def test_register_teams_compile_for_sm90(I, team, inflight, threads, rows, row_tiles, stages, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    for op in OPS:
        params = LayerNormParams(op=op, dtype="float16", layouts=canonical(op), B=3, L=77, I=I, rows=rows, vec=8,
                                 threads=threads, row_tiles=row_tiles, staging="registers", team=team,
                                 inflight=inflight, stages=stages)
        assert params.compile().path.read_bytes()[:4] == b"\x7fELF"


# ---------------------------------------------------------------------------------------------- GPU


def _run(params: LayerNormParams, inputs: dict, args: OpArgs) -> dict:
    """Launch on inputs stored in their layouts; the outputs in theirs (fresh, filled with NaN)."""
    ext = params.extents
    outs = {n: torch.full([ext[d] for d in lay], math.nan, device=DEVICE, dtype=DTYPES[params.dtype])
            for n, lay in params.layouts if n not in inputs}
    params.launch(params.compile(DeviceSpec.of(0)), inputs | outs, args)
    torch.cuda.synchronize()
    return outs


def _forward_inputs(op: str, B: int, L: int, I: int, gen: torch.Generator) -> dict:
    x, bias, res, gamma, beta = GRAPH.operator(op).inputs
    randn = lambda *shape: torch.randn(*shape, device=DEVICE, generator=gen, dtype=torch.float64)  # noqa: E731
    return {x: randn(B, L, I) * 2, bias: randn(I) * 0.5, res: randn(B, L, I) + 0.25, gamma: 1 + 0.3 * randn(I),
            beta: 0.3 * randn(I)}


def _backward_inputs(op: str, B: int, L: int, I: int, gen: torch.Generator, eps: float) -> dict:
    randn = lambda *shape: torch.randn(*shape, device=DEVICE, generator=gen, dtype=torch.float64)  # noqa: E731
    operator = GRAPH.operator(op)
    r = randn(B, L, I) * 2 + 0.5
    mean = r.mean(-1, keepdim=True)
    rstd = torch.rsqrt((r - mean).square().mean(-1, keepdim=True) + eps)
    values = {operator.inputs[-3]: (r - mean) * rstd, operator.inputs[-2]: rstd.squeeze(-1),
              operator.inputs[-1]: 1 + 0.3 * randn(I)}
    for name in operator.inputs[:-3]:  # dY, or dX1f and dR2
        values[name] = randn(B, L, I)
    return values


def _torch_forward(args: OpArgs, op: str, x, bias, res, gamma, beta) -> tuple[torch.Tensor, ...]:
    """PyTorch's ops for the operator in the low dtype (its own layer_norm; Substation's dropout mask)."""
    r = args.drop(x + bias, GRAPH.operator(op).dropout_site) + res
    shape, eps = (r.shape[-1],), args.layer_norm_eps
    _, _, rstd = torch.ops.aten.native_layer_norm(r, list(shape), None, None, eps)
    return (torch.nn.functional.layer_norm(r, shape, gamma, beta, eps),
            torch.nn.functional.layer_norm(r, shape, None, None, eps), rstd.reshape(r.shape[:-1]).to(r.dtype))


def _check(params: LayerNormParams, outs: dict, want: tuple, torch_got: tuple) -> None:
    """Every output within twice PyTorch's error in the same dtype (plus the floor) of the float64 reference."""
    torch_dtype, layouts = DTYPES[params.dtype], dict(params.layouts)
    for name, ref, theirs in zip(GRAPH.operator(params.op).outputs, want, torch_got):
        got = logical(outs[name], layouts[name], GRAPH.tensors[name].dims)
        error, budget = relative_error(got, ref), error_budget(relative_error(theirs, ref), torch_dtype)
        assert error <= budget, f"{params.label} [{params.dtype}] {name}: error {error:.3g} > budget {budget:.3g}"


SIZES = [(3, 77, 96), (2, 40, 1024), (8, 512, 1024), (1, 6, 130), (96, 128, 1024), (2, 7, 4096)]
STAGING = ("shared", "registers")  # of seeds 0-5 and 6-11: every size with each (shared where registers don't fit)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("seed", range(12))
def test_forward_matches_float64_reference(seed, p):
    rng, k = random.Random(300 + seed), seed + seed // 6  # every size in two dtypes and both operators
    op, dtype = ("ln1", "ln2")[k % 2], ["float16", "bfloat16", "float32"][k % 3]
    B, L, I = SIZES[seed % len(SIZES)]
    params = random_point(rng, op, B, L, I, dtype, STAGING[seed // 6])
    torch_dtype = DTYPES[dtype]
    args = OpArgs(scale=0.125, hidden_dropout=p, layer_norm_eps=(1e-12, 1e-5)[seed // 6 % 2], seed=11 + seed,
                  offset=3).with_device_rng("cuda")
    values = _forward_inputs(op, B, L, I, torch.Generator(device=DEVICE).manual_seed(seed))
    low = {n: v.to(torch_dtype) for n, v in values.items()}
    layouts = dict(params.layouts)
    inputs = {n: stored(v, GRAPH.tensors[n].dims, layouts[n]) for n, v in low.items()}
    outs = _run(params, inputs, args)
    names = GRAPH.operator(op).inputs
    want = FUSED[op](args, *(low[n].double() for n in names))
    _check(params, outs, want, _torch_forward(args, op, *(low[n] for n in names)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("seed", range(12))
def test_backward_matches_float64_reference_and_is_deterministic(seed, p):
    rng, k = random.Random(400 + seed), seed + seed // 6
    op, dtype = ("ln2_bwd", "ln1_bwd")[k % 2], ["float16", "bfloat16", "float32"][k % 3]
    B, L, I = SIZES[seed % len(SIZES)]
    params = random_point(rng, op, B, L, I, dtype, STAGING[seed // 6])
    torch_dtype = DTYPES[dtype]
    args = OpArgs(scale=0.125, hidden_dropout=p, seed=11 + seed, offset=3).with_device_rng("cuda")
    values = _backward_inputs(op, B, L, I, torch.Generator(device=DEVICE).manual_seed(seed), args.layer_norm_eps)
    low = {n: v.to(torch_dtype) for n, v in values.items()}
    layouts = dict(params.layouts)
    inputs = {n: stored(v, GRAPH.tensors[n].dims, layouts[n]) for n, v in low.items()}
    outs = _run(params, inputs, args)
    names = GRAPH.operator(op).inputs
    want = FUSED[op](args, *(low[n].double() for n in names))
    _check(params, outs, want, FUSED[op](args, *(low[n] for n in names)))  # PyTorch's ops in the low dtype
    again = _run(params, inputs, args)
    for name in outs:
        assert torch.equal(outs[name], again[name]), f"{params.label}: {name} differs between two runs"


@pytest.mark.gpu
@needs_gpu
def test_dropout_mask_is_the_reference_mask_forward_and_backward():
    from substation.dropout import keep_mask

    B, L, I, p, seed, offset = 4, 16, 256, 0.25, 2**40 + 7, 5
    args = OpArgs(scale=0.125, hidden_dropout=p, seed=seed, offset=offset).with_device_rng("cuda")
    want = keep_mask((B, L, I), p, seed, offset, 2, device=DEVICE)  # ln2's site, ffn_output
    fwd = LayerNormParams(op="ln2", dtype="float32", layouts=tuple((dict(canonical("ln2")) | {
        "G": "jib", "X1": "ibj", "N2": "ijb", "Rs2": "jb"}).items()), B=B, L=L, I=I, tile="b", rows=2, vec=2)
    ones, zeros = (torch.full((I,), v, device=DEVICE) for v in (1.0, 0.0))
    inputs = {"G": torch.ones(L, I, B, device=DEVICE), "b2": zeros, "X1": torch.zeros(I, B, L, device=DEVICE),
              "g2": ones, "be2": zeros}
    N2 = logical(_run(fwd, inputs, args)["N2"], "ijb", "bji")
    assert torch.equal(N2 > 0, want)  # kept elements are 1/(1-p) > the row's mean, dropped ones 0 < it
    rate = 1 - want.float().mean().item()
    assert abs(rate - p) < 3 * math.sqrt(p * (1 - p) / want.numel())
    bwd = LayerNormParams(op="ln2_bwd", dtype="float32", layouts=tuple((dict(canonical("ln2_bwd")) | {
        "dY": "ibj", "dG": "jib"}).items()), B=B, L=L, I=I, tile="j", rows=4, vec=4)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    inputs = {"dY": torch.randn(I, B, L, device=DEVICE, generator=gen), "N2": torch.randn(B, L, I, device=DEVICE,
              generator=gen), "Rs2": torch.rand(B, L, device=DEVICE, generator=gen) + 0.5, "g2": ones}
    outs = _run(bwd, inputs, args)
    dG, dR2 = logical(outs["dG"], "jib", "bji"), outs["dR2"]
    live = dR2 != 0
    assert live.float().mean() > 0.99
    assert torch.equal((dG != 0) & live, want & live)
    assert torch.equal(dG[want], (dR2[want] * (1 / (1 - p))))


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replay_reproduces_forward_and_backward():
    B, L, I = 4, 64, 256
    args = OpArgs(scale=0.125, hidden_dropout=0.1, seed=2**33 + 1, offset=9).with_device_rng("cuda")
    fwd = LayerNormParams(op="ln1", dtype="float16", layouts=canonical("ln1"), B=B, L=L, I=I, rows=8, vec=8)
    bwd = LayerNormParams(op="ln1_bwd", dtype="float16", layouts=canonical("ln1_bwd"), B=B, L=L, I=I, rows=8, vec=8)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    low = {n: v.half() for n, v in _forward_inputs("ln1", B, L, I, gen).items()}
    grads = {n: torch.randn(B, L, I, device=DEVICE, generator=gen).half() for n in ("dX1f", "dR2")}
    ext = fwd.extents
    outs = {n: torch.empty([ext[d] for d in lay], device=DEVICE, dtype=torch.float16)
            for n, lay in fwd.layouts + bwd.layouts if n not in low and n not in grads}
    tensors = low | grads | outs
    for params in (fwd, bwd):
        params.check_tensors(tensors)
    # As the runtime does: bound once, outside the capture; the backward's workspace allocated in it.
    bound = [params.bind(params.compile(DeviceSpec.of(0)), 0) for params in (fwd, bwd)]
    pointers = [[tensors[name].data_ptr() for name in b.names] for b in bound]

    def step() -> None:
        for b, p in zip(bound, pointers):
            b(p, args, torch.cuda.current_stream().cuda_stream)

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        stream.synchronize()
        first = {n: t.clone() for n, t in outs.items()}
        with torch.cuda.graph(graph, stream=stream):
            step()
    for t in outs.values():
        t.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    for name, t in outs.items():
        assert torch.equal(t, first[name]), f"{name} differs after graph replay"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("I, team, inflight, threads, rows, row_tiles, stages", TEAM_POINTS)
def test_register_teams_match_float64_reference(I, team, inflight, threads, rows, row_tiles, stages, dtype, p):
    """Every operator at B=3, L=77 in canonical layouts: forward and every gradient within budget of the float64
    reference (same dropout mask), the backward bit-identical between two runs."""
    B, L = 3, 77
    torch_dtype = DTYPES[dtype]
    for op in OPS:
        params = LayerNormParams(op=op, dtype=dtype, layouts=canonical(op), B=B, L=L, I=I, rows=rows, vec=8,
                                 threads=threads, row_tiles=row_tiles, staging="registers", team=team,
                                 inflight=inflight, stages=stages)
        args = OpArgs(scale=0.125, hidden_dropout=p, seed=5 + team, offset=7).with_device_rng("cuda")
        gen = torch.Generator(device=DEVICE).manual_seed(I + team)
        values = (_backward_inputs(op, B, L, I, gen, args.layer_norm_eps) if params.backward
                  else _forward_inputs(op, B, L, I, gen))
        inputs = {n: v.to(torch_dtype) for n, v in values.items()}
        outs = _run(params, inputs, args)
        names = GRAPH.operator(op).inputs
        want = FUSED[op](args, *(inputs[n].double() for n in names))
        theirs = (FUSED[op](args, *(inputs[n] for n in names)) if params.backward
                  else _torch_forward(args, op, *(inputs[n] for n in names)))
        _check(params, outs, want, theirs)
        if params.backward:
            again = _run(params, inputs, args)
            for name in outs:
                assert torch.equal(outs[name], again[name]), f"{params.label}: {name} differs between two runs"


GRID_COLSUM_CASES = [("ln1_bwd", 8, 512, 1024, "float16"), ("ln2_bwd", 3, 100, 768, "bfloat16"),
                     ("ln1_bwd", 2, 40, 96, "float32")]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("op, B, L, I, dtype", GRID_COLSUM_CASES)
def test_grid_colsum_matches_float64_and_the_two_kernel_variant(op, B, L, I, dtype):
    """Every variant with colsum="grid" (one cooperative kernel) among the operator's variants at this size: dR and
    dB bit-identical to its two-kernel twin's, the column sums within budget of the float64 reference and the same
    bits in a second run, and the same again replayed from a CUDA graph."""
    torch_dtype = DTYPES[dtype]
    args = OpArgs(scale=0.125, hidden_dropout=0.1, seed=21, offset=4).with_device_rng("cuda")
    values = _backward_inputs(op, B, L, I, torch.Generator(device=DEVICE).manual_seed(B + L), args.layer_norm_eps)
    inputs = {n: v.to(torch_dtype) for n, v in values.items()}
    names = GRAPH.operator(op).inputs
    want = FUSED[op](args, *(inputs[n].double() for n in names))
    theirs = FUSED[op](args, *(inputs[n] for n in names))
    size = Size.from_heads(B=B, L=L, H=1, P=I, U=4 * I).with_dtype(dtype)
    grid = [p for p in variants(op, size, dtype, dict(canonical(op))) if p.colsum == "grid"]
    assert grid
    for params in grid:
        outs = _run(params, inputs, args)
        _check(params, outs, want, theirs)
        twin = _run(dataclasses.replace(params, colsum="kernel"), inputs, args)
        for name in GRAPH.operator(op).outputs[:2]:
            assert torch.equal(outs[name], twin[name]), f"{params.label}: {name} differs from the two-kernel twin's"
        again = _run(params, inputs, args)
        for name in outs:
            assert torch.equal(outs[name], again[name]), f"{params.label}: {name} differs between two runs"
    params = grid[-1]
    bound = params.bind(params.compile(DeviceSpec.of(0)), 0)
    tensors = inputs | {n: torch.full_like(t, math.nan) for n, t in _run(params, inputs, args).items()}
    pointers = [tensors[name].data_ptr() for name in bound.names]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        bound(pointers, args, stream.cuda_stream)
    graph.replay()
    torch.cuda.synchronize()
    for name in again:
        assert torch.equal(tensors[name], again[name]), f"{params.label}: {name} differs when replayed"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("I", MASK_SIZES)
@pytest.mark.parametrize("staging, dtype, vec, team, inflight", MASK_LANES)
def test_dropout_mask_is_bit_exact_at_every_lane_width(I, staging, dtype, vec, team, inflight):
    """Forward: with x = 1 and no residual, N2 > 0 exactly where the reference keeps; backward: dG is nonzero
    exactly where it keeps (where dR2 is)."""
    from substation.dropout import keep_mask

    points = mask_points(I, staging, dtype, vec, team, inflight)
    if points is None:
        pytest.skip(f"{I=}, {staging=}, {vec=} is infeasible")
    fwd, bwd = points
    B, L, p, seed, offset = 2, 8, 0.25, 2**40 + 7, 5
    args = OpArgs(scale=0.125, hidden_dropout=p, seed=seed, offset=offset).with_device_rng("cuda")
    want = keep_mask((B, L, I), p, seed, offset, 2, device=DEVICE)  # ln2's site, ffn_output
    torch_dtype = DTYPES[dtype]
    ones, zeros = (torch.full((I,), v, device=DEVICE, dtype=torch_dtype) for v in (1.0, 0.0))
    inputs = {"G": torch.ones(B, L, I, device=DEVICE, dtype=torch_dtype), "b2": zeros,
              "X1": torch.zeros(B, L, I, device=DEVICE, dtype=torch_dtype), "g2": ones, "be2": zeros}
    assert torch.equal(_run(fwd, inputs, args)["N2"] > 0, want)
    gen = torch.Generator(device=DEVICE).manual_seed(I)
    inputs = {"dY": torch.randn(B, L, I, device=DEVICE, generator=gen).to(torch_dtype),
              "N2": torch.randn(B, L, I, device=DEVICE, generator=gen).to(torch_dtype),
              "Rs2": (torch.rand(B, L, device=DEVICE, generator=gen) + 0.5).to(torch_dtype), "g2": ones}
    outs = _run(bwd, inputs, args)
    live = outs["dR2"] != 0
    assert live.float().mean() > 0.99
    assert torch.equal((outs["dG"] != 0) & live, want & live)
