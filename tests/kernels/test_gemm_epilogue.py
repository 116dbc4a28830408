"""GEMMs with our epilogues (CUTLASS 3 Hopper kernels): variant rules and rendering (CPU), one nvcc build of a
shared library (CPU, needs nvcc and the nvidia-cutlass headers), and on the GPU every epilogue in every operand
layout and bias direction against a float64 reference, on a problem no tile divides, batched, in fp16 and bf16,
with a bit-identical bias gradient on a second run (the cross-tile reduction has a fixed order).

Tolerances (largest error over the largest reference magnitude): fp16 2e-3, bf16 1.6e-2 (a few units of the
last place of the stored result; the bias gradient is summed in float32 and rounded once)."""
import dataclasses
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from substation.config_file import load_configuration, to_configuration
from substation.errors import ConfigurationFileError
from substation.graph import layer_graph
from substation.implementations import registry
from substation.kernels.bias_grad import BiasGradient, BiasGradientLaunch
from substation.kernels.gemm_epilogue import (EPILOGUES, FUSIONS, IMPL, SEPARATE, SHAPES, SLOPE_FUSIONS, SLOPE_IMPL,
                                              FusedCall, GemmEpilogue, GemmEpilogueVariant, GemmGeluSlope, GemmShape,
                                              fused_call, loaded, partial_sums, profiled_groups, separate_of, shape_of)
from substation.layouts import Configuration
from substation.protocol import Choice, Infeasible
from substation.runtime import check_choices, choices_at_size, default_choices
from substation.sizes import Size, get_size
from substation.tc_profiling.mapping import GemmCall

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
PINGPONG = GemmShape("pingpong", (128, 128, 64), (1, 1))
COOPERATIVE = GemmShape("cooperative", (128, 256, 64), (2, 1))


def variant(epilogue: str, layouts: str, along: str, dtype=torch.float16, shape=PINGPONG) -> GemmEpilogueVariant:
    return GemmEpilogueVariant(epilogue, layouts[0], layouts[1], along, shape.tile, shape.cluster, shape.schedule,
                               dtype, shape.epilogue_tile, raster=shape.raster)


# -- CPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    (dict(epilogue="relu"), "epilogue"),
    (dict(transa="C"), "transa"),
    (dict(bias_along="k"), "bias_along"),
    (dict(schedule="stream-k"), "schedule"),
    (dict(schedule="cooperative", tile=(64, 128, 64)), "multiple of 128"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(epilogue_tile=(128, 64)), "epilogue tile"),  # a pingpong warpgroup's subtile has 64 rows
    (dict(epilogue_tile=(64, 24)), "epilogue tile"),
    (dict(epilogue_tile=(64, 256)), "epilogue tile"),  # wider than the tile
    (dict(swizzle=3), "swizzle"),  # CUTLASS rounds it to a power of two: say so rather than time a duplicate
    (dict(raster="k"), "raster"),
])
def test_variant_rules(bad, message):
    good = dict(epilogue="bias_gelu", transa="N", transb="T", bias_along="m", tile=(128, 128, 64), cluster=(1, 1),
                schedule="pingpong", dtype=torch.float16)
    with pytest.raises(ValueError, match=message):
        GemmEpilogueVariant(**(good | bad))


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("layouts", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("along", ["m", "n"])
def test_rendering_follows_the_call(epilogue, layouts, along):
    source = variant(epilogue, layouts, along, torch.bfloat16).render()
    assert "using Element = cutlass::bfloat16_t;" in source
    assert f"LayoutA = cutlass::layout::{'ColumnMajor' if layouts[0] == 'N' else 'RowMajor'};" in source
    assert f"LayoutB = cutlass::layout::{'ColumnMajor' if layouts[1] == 'N' else 'RowMajor'};" in source
    assert ("KernelTmaWarpSpecializedPingpong" in source) and "Cooperative;" not in source
    if epilogue == "plain":
        assert "fusion::LinearCombination" in source and "ErfGelu," not in source
    else:
        broadcast = "Sm90ColBroadcast" if along == "m" else "Sm90RowBroadcast"
        assert f"using BiasLoad = {broadcast}" in source
        assert ("Sm90AuxStore" in source) == epilogue.startswith("bias_gelu")
        assert ("Sm90AuxLoad" in source) != epilogue.startswith("bias_gelu")
        reduction = "Sm90ColReduction" if along == "m" else "Sm90RowReduction"
        # non-atomic partial sums of each tile (FinalReduction false): bias_grad.py's kernel adds them in a fixed order
        assert f"using BiasGradient = {reduction}<plus, plus, plus" in source and "kAlign, false, false, false>" in source
        assert ("Sm90EVT<BiasGradient<CtaTile>" in source) == epilogue.endswith("_bgrad")  # dgelu: a kernel's job


def test_epilogue_tile_is_cutlass_choice_unless_given():
    assert "EpilogueTileAuto" in variant("dgelu", "TT", "n").render()
    given = dataclasses.replace(variant("dgelu", "TT", "n"), epilogue_tile=(64, 128)).render()
    assert "EpilogueTileAuto" not in given and "Shape<_64, _128>, float, float," in given


def test_tile_order_is_cutlass_default_unless_given():
    default = variant("plain", "TN", "m")
    assert "args.scheduler" not in default.render() and "swizzle" not in default.label
    given = dataclasses.replace(default, swizzle=4, raster="n")
    assert "args.scheduler.max_swizzle_size = 4;" in given.render()
    assert "RasterOrderOptions::AlongN;" in given.render() and given.label.endswith(" swizzle 4 n")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape.schedule}-{shape.cluster}-{shape.raster}")
def test_a_row_names_its_tile_order_only_where_it_is_not_cutlass_default(shape):
    """Rows of CUTLASS's own raster keep the labels and keys they were profiled with; a row along m says so, and
    the kernel it binds runs along m."""
    size, _, config = shipped(SIZES[0])
    fusion = FUSIONS[0]
    found = fused_call(fusion, GemmEpilogue().cover_layouts(ops_of(fusion), config), size.extents)
    options = found.candidate(shape).options_dict
    assert ("raster" in options) == (shape.raster != "heuristic") and shape_of(options) == shape
    rendered = found.variant(shape_of(options), torch.float16).render()
    assert ("RasterOrderOptions::AlongM;" in rendered) == (shape.raster == "m")


def test_library_builds_with_nvcc():
    """The heaviest epilogue through the JIT: nvcc builds the shared library and it exports the entry points."""
    library = variant("dgelu_bgrad", "TN", "n").compile()
    symbols = library.path.read_bytes()
    assert library.path.suffix == ".so" and b"substation_gemm_workspace" in symbols and b"substation_gemm\0" in symbols


GRAPH = layer_graph()
SIZES = ("bert-large-b8-l512", "bert-large-b96-l128")
LAYOUTS = Path(__file__).parents[2] / "layouts"


def shipped(name: str) -> tuple[Size, dict, Configuration]:
    size = get_size(name)
    data = load_configuration(LAYOUTS / f"h100-{name}.json", size)
    return size, data, to_configuration(data)


def ops_of(fusion):
    return [GRAPH.operator(name) for name in fusion.covers]


@pytest.mark.parametrize("name", SIZES)
def test_profiled_groups_hold_the_shipped_layouts_and_share_one_call(name):
    size, data, config = shipped(name)
    groups = profiled_groups(size)
    assert {g.shape for g in groups} == set(SHAPES)
    assert {g.variant.epilogue for g in groups} == {"bias_gelu", "dgelu_bgrad", "dgelu", "bias_gelu_slope",
                                                    "slope_bgrad"}
    assert all(g.separate == (g.variant.epilogue == "dgelu") for g in groups)
    slope = [g for g in groups if g.calls[0].fusion.impl == SLOPE_IMPL]
    assert {g.variant.epilogue for g in slope} == {"bias_gelu_slope", "slope_bgrad"}
    assert {g.shape for g in slope} == {s for s in SHAPES if s.schedule == "pingpong"}
    # The bias-gradient kernel after each GEMM: over dF apart, over the epilogue's partials, or none (forward).
    for g in groups:
        reduction = g.calls[0].reduction(g.shape, size.extents, torch.float16, g.separate)
        assert (reduction is None) == g.variant.epilogue.startswith("bias_gelu")
        assert g.variant.writes_partials == (reduction is not None and not g.separate)
        if g.variant.writes_partials:
            assert reduction.stride % g.variant.tile[0 if g.variant.bias_along == "m" else 1] == 0
    for group in groups:
        assert len({fc.call for fc in group.calls}) == 1 and len(group.candidates) == len(group.calls)
        fusion = group.calls[0].fusion
        assert all(c.impl == fusion.impl and c.covers == fusion.covers for c in group.candidates)
    labels = {c.label for g in groups for c in g.candidates}
    for fusion in FUSIONS:
        ops = ops_of(fusion)
        layouts = GemmEpilogue().cover_layouts(ops, config)
        found = list(GemmEpilogue().candidates(ops, size, layouts))
        assert len(found) == len(SHAPES) * (2 if fusion.separate else 1) and {c.label for c in found} <= labels
        gemm = data["operators"][fusion.covers[0]]["options"]  # the call cuBLASLt runs today: the same call
        assert all(c.options_dict[k] == gemm[k] for c in found for k in ("transa", "transb", "m", "n", "k", "ldc"))


@pytest.mark.parametrize("fusion", FUSIONS, ids=lambda f: f.epilogue)
def test_check_takes_its_rows_and_names_what_breaks(fusion):
    size, _, config = shipped(SIZES[0])
    ops, implementation = ops_of(fusion), registry(GRAPH).find(IMPL, fusion.covers)
    candidate = next(iter(implementation.candidates(ops, size, implementation.cover_layouts(ops, config))))
    choice = Choice(fusion.covers, IMPL, candidate.options_dict)
    implementation.check(ops, choice, config, size)
    assert implementation.variant(ops, choice, config, size).epilogue == fusion.epilogue
    with pytest.raises(ConfigurationFileError, match="another size"):
        implementation.check(ops, choice, config, Size.from_heads(B=4, L=512, H=16, P=64, U=4096))
    with pytest.raises(ConfigurationFileError, match="name no kernel"):
        implementation.check(ops, Choice(fusion.covers, IMPL, candidate.options_dict | {"schedule": "x"}), config, size)
    layouts = dict(implementation.cover_layouts(ops, config))
    moved = layouts | {"F": "ubj" if layouts["F"] == "bju" else "bju"}  # F apart from the tensors laid out with it
    (infeasible,) = implementation.candidates(ops, size, moved)
    assert isinstance(infeasible, Infeasible) and "is not laid out as" in infeasible.reason


def test_a_row_with_its_bias_gradient_apart_runs_dgelu_and_the_kernel():
    """The backward fusion's rows with option bias_grad=kernel: the GEMM without the reduction, and the bias-gradient
    kernel over dF's layout built beside it; the option survives another size; the forward has no such rows."""
    size, _, config = shipped(SIZES[0])
    forward, backward = FUSIONS
    implementation = GemmEpilogue()
    ops = ops_of(backward)
    rows = list(implementation.candidates(ops, size, implementation.cover_layouts(ops, config)))
    apart = [c for c in rows if separate_of(c.options_dict)]
    assert len(apart) == len(SHAPES) == len(rows) - len(apart)
    choice = Choice(backward.covers, IMPL, apart[0].options_dict, apart[0].label)
    gemm, reduction = implementation.builds(ops, choice, config, size)
    assert gemm.epilogue == "dgelu" and isinstance(reduction, BiasGradient)
    tokens_first = config.layouts["dF"] == "bju"  # else ubj: summed over the tokens after u
    assert (reduction.outer, reduction.bias, reduction.inner) == ((8 * 512, 4096, 1) if tokens_first else
                                                                  (1, 4096, 8 * 512))
    other = Size.from_heads(B=4, L=256, H=16, P=64, U=4096)
    assert separate_of(implementation.at_size(ops, choice, config, other).options)
    with pytest.raises(ConfigurationFileError, match="name no kernel"):
        forward_ops = ops_of(forward)
        first = next(iter(implementation.candidates(forward_ops, size, implementation.cover_layouts(forward_ops, config))))
        implementation.check(forward_ops, Choice(forward.covers, IMPL, first.options_dict | SEPARATE), config, size)


def test_the_slope_pair_has_rows_of_its_own_impl_and_its_kernels():
    """`cutlass_gelu_slope`: the same calls as `cutlass_epilogue`'s, pingpong shapes, the bias gradient always in
    the epilogue; coupled, so that the optimizer takes its forward and backward rows together; its kernels store
    GELU'(F + b1) beside H1 and multiply by it."""
    size, _, config = shipped(SIZES[0])
    implementation = registry(GRAPH).find(SLOPE_IMPL, SLOPE_FUSIONS[0].covers)
    assert isinstance(implementation, GemmGeluSlope) and registry(GRAPH).coupled(SLOPE_IMPL)
    assert not registry(GRAPH).coupled(IMPL)
    for fusion, plain_fusion in zip(SLOPE_FUSIONS, FUSIONS):
        ops = ops_of(fusion)
        rows = list(implementation.candidates(ops, size, implementation.cover_layouts(ops, config)))
        assert len(rows) == len(fusion.shapes) == 2 and all(r.impl == SLOPE_IMPL for r in rows)
        plain = {r.label.replace(IMPL, SLOPE_IMPL, 1) for r in GemmEpilogue().candidates(
            ops, size, GemmEpilogue().cover_layouts(ops, config))}
        assert {r.label for r in rows} <= plain  # the same calls and shapes, another impl
        choice = Choice(fusion.covers, SLOPE_IMPL, rows[0].options_dict)
        built = implementation.builds(ops, choice, config, size)
        assert built[0].epilogue == fusion.epilogue and len(built) == (2 if fusion.epilogue == "slope_bgrad" else 1)
        rendered = built[0].render()
        if fusion.epilogue == "bias_gelu_slope":
            epilogue = rendered.split("struct Epilogue")[1]
            assert "Sm90AuxStoreOf<ErfGeluSlope" in epilogue and "ErfGeluGrad<" not in epilogue
        else:
            assert "Sm90Compute<multiplies" in rendered and "Sm90Compute<ErfGeluGrad" not in rendered
        assert plain_fusion.covers == fusion.covers


def test_the_slope_pair_falls_back_together_at_a_size_where_one_of_its_calls_cannot_run(monkeypatch):
    """At another size the pair keeps its kernels; where one of its covers has no call there, both covers run
    their operators one by one: a forward storing the slope before a backward reading F as F would be wrong."""
    size, _, config = shipped(SIZES[0])
    implementation = GemmGeluSlope()
    choices = default_choices(config, size)
    for fusion in SLOPE_FUSIONS:
        ops = ops_of(fusion)
        row = next(iter(implementation.candidates(ops, size, implementation.cover_layouts(ops, config))))
        choices |= {op.name: Choice(fusion.covers, SLOPE_IMPL, row.options_dict, row.label) for op in ops}
    paired = [name for fusion in SLOPE_FUSIONS for name in fusion.covers]
    other = Size.from_heads(B=4, L=256, H=16, P=64, U=4096)
    assert {choices_at_size(choices, config, other)[name].impl for name in paired} == {SLOPE_IMPL}
    at_size = GemmGeluSlope.at_size

    def backward_refused(self, ops, choice, config, size):
        if ops[0].pass_ == "backward":
            raise ConfigurationFileError("no call at this size")
        return at_size(self, ops, choice, config, size)

    monkeypatch.setattr(GemmGeluSlope, "at_size", backward_refused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resized = choices_at_size(choices, config, other)
    assert {resized[name].covers for name in paired} == {(name,) for name in paired}
    assert SLOPE_IMPL not in {resized[name].impl for name in paired}
    assert any("only as a pair" in str(w.message) for w in caught)


def test_a_configuration_with_half_the_slope_pair_is_refused():
    """A forward storing GELU' where F belongs before a backward reading F as F would be silently wrong."""
    size, _, config = shipped(SIZES[0])
    implementation, (forward, _) = GemmGeluSlope(), SLOPE_FUSIONS
    ops = ops_of(forward)
    row = next(iter(implementation.candidates(ops, size, implementation.cover_layouts(ops, config))))
    choices = default_choices(config, size) | {op.name: Choice(forward.covers, SLOPE_IMPL, row.options_dict)
                                               for op in ops}
    with pytest.raises(ConfigurationFileError, match="for the forward only"):
        check_choices(choices, config, size)


@pytest.mark.parametrize("along, shape, rows, stride", [("m", COOPERATIVE, 2 * 1, 256), ("n", COOPERATIVE, 2 * 2, 256),
                                                        ("m", PINGPONG, 2 * 2, 256), ("n", PINGPONG, 2 * 2, 256)])
def test_partial_sums_follow_cutlass_buffer(along, shape, rows, stride):
    """dgelu_bgrad's partials: one float32 row per (batch, tile of the summed letter), the bias letter's extent
    rounded up to its tile; the sum reads the bias's extent of each row and writes db in the GEMM's dtype."""
    call = GemmCall(False, False, M, N, K, M, K, M, M * K, K * N, M * N, BATCH)
    sums = partial_sums(variant("dgelu_bgrad", "NN", along, torch.bfloat16, shape), call)
    assert (sums.outer, sums.bias, sums.inner, sums.stride) == (rows, M if along == "m" else N, 1, stride)
    assert (sums.dtype, sums.out_dtype) == ("float32", "bfloat16")
    source = sums.render()
    assert "#define ROW 256" in source and "typedef __nv_bfloat16 out_t;" in source


def test_a_row_summing_in_the_epilogue_builds_the_sum_of_its_partials():
    size, _, config = shipped(SIZES[0])
    implementation, ops = GemmEpilogue(), ops_of(FUSIONS[1])
    inside = [c for c in implementation.candidates(ops, size, implementation.cover_layouts(ops, config))
              if not separate_of(c.options_dict)]
    for row in inside:
        gemm, reduction = implementation.builds(ops, Choice(FUSIONS[1].covers, IMPL, row.options_dict), config, size)
        across = 4096 // gemm.tile[1 if gemm.bias_along == "m" else 0]  # tokens and u are both 4096 at B8/L512
        assert gemm.epilogue == "dgelu_bgrad" and (reduction.outer, reduction.bias, reduction.stride) == (across, 4096,
                                                                                                         4096)


def test_a_choice_keeps_its_kernel_at_another_size():
    """At another B and L the call of the same layouts there, with the tile shape the configuration recorded."""
    size, _, config = shipped(SIZES[0])
    fusion, implementation = FUSIONS[0], GemmEpilogue()
    ops = ops_of(fusion)
    recorded = list(implementation.candidates(ops, size, implementation.cover_layouts(ops, config)))[-1]
    choice = Choice(fusion.covers, IMPL, recorded.options_dict, recorded.label)
    other = Size.from_heads(B=4, L=256, H=16, P=64, U=4096)
    moved = implementation.at_size(ops, choice, config, other)
    implementation.check(ops, moved, config, other)
    kept = ("schedule", "tile", "cluster", "raster", "transa", "transb")  # the last shape runs along m
    assert {k: moved.options[k] for k in kept} == {k: choice.options[k] for k in kept} != {}
    assert 4 * 256 in (moved.options["m"], moved.options["n"]) and moved.options != choice.options


def test_unaligned_token_counts_have_no_call_and_the_encoder_falls_back():
    """A token-contiguous result with 3 × 77 tokens breaks TMA's 16-byte strides: no fused call there, and a
    configuration choosing the fusion runs the operators one by one at that size (with a warning)."""
    size, _, config = shipped(SIZES[0])
    fusion = FUSIONS[0]
    ops = ops_of(fusion)
    odd = Size.from_heads(B=3, L=77, H=16, P=64, U=4096)
    reason = fused_call(fusion, GemmEpilogue().cover_layouts(ops, config), odd.extents)
    assert isinstance(reason, str) and "16-byte" in reason
    found = fused_call(fusion, GemmEpilogue().cover_layouts(ops, config), size.extents)
    assert isinstance(found, FusedCall)
    choices = default_choices(config, size) | {op.name: Choice(fusion.covers, IMPL, found.candidate(SHAPES[0]).options_dict)
                                               for op in ops}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resized = choices_at_size(choices, config, odd)
    assert {resized[op.name].covers for op in ops} == {(op.name,) for op in ops}
    assert any("cutlass_epilogue" in str(w.message) or "16-byte" in str(w.message) for w in caught)


# -- GPU ---------------------------------------------------------------------------------------------------------

GPU_CASES = [  # (epilogue, layouts, bias direction, dtype, shape)
    ("plain", "NN", "m", torch.float16, PINGPONG),
    ("plain", "TT", "m", torch.float16, COOPERATIVE),
    ("bias_gelu", "NN", "m", torch.float16, PINGPONG),
    ("bias_gelu", "TN", "n", torch.float16, PINGPONG),
    ("bias_gelu", "NT", "m", torch.float16, PINGPONG),
    ("bias_gelu", "TT", "n", torch.float16, COOPERATIVE),
    ("bias_gelu", "TN", "n", torch.bfloat16, PINGPONG),
    ("dgelu_bgrad", "NN", "m", torch.float16, PINGPONG),
    ("dgelu_bgrad", "TN", "n", torch.float16, PINGPONG),
    ("dgelu_bgrad", "NT", "n", torch.float16, PINGPONG),
    ("dgelu_bgrad", "TT", "m", torch.float16, COOPERATIVE),
    ("dgelu_bgrad", "TN", "n", torch.bfloat16, PINGPONG),
    ("dgelu", "TN", "n", torch.float16, PINGPONG),
    ("dgelu", "NT", "m", torch.bfloat16, COOPERATIVE),
    ("bias_gelu_slope", "NN", "m", torch.float16, PINGPONG),
    ("bias_gelu_slope", "TN", "n", torch.bfloat16, PINGPONG),
    ("slope_bgrad", "TN", "n", torch.float16, PINGPONG),
    ("slope_bgrad", "NT", "m", torch.bfloat16, COOPERATIVE),
]
M, N, K, BATCH = 200, 136, 72, 2  # multiples of 8 (TMA's 16 bytes), of no tile


def gpu_builds() -> list[GemmEpilogueVariant]:
    """Every GPU case's variant (`scripts/build_gpu_test_kernels.py` builds them ahead, without a GPU)."""
    return [variant(e, lay, along, dtype, shape) for e, lay, along, dtype, shape in GPU_CASES]


@pytest.fixture(scope="module")
def compiled():
    """Every case's library, built in parallel (one nvcc per core)."""
    variants = gpu_builds()
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda v: v.compile(), variants))
    return variants


def column_major(rows: int, cols: int, ld: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage for BATCH column-major rows × cols matrices with leading dimension ld, and its (batch, rows, cols)
    view."""
    storage = torch.randn(BATCH, cols, ld, dtype=dtype, device=device)
    return storage, storage[:, :, :rows].transpose(1, 2)


def gelu_grad(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", range(len(GPU_CASES)), ids=lambda i: "-".join(map(str, GPU_CASES[i][:4])))
def test_epilogue_matches_float64(compiled, case):
    epilogue, layouts, along, dtype, _ = GPU_CASES[case]
    torch.manual_seed(case)
    device = torch.device("cuda")
    a_rows, a_cols = (M, K) if layouts[0] == "N" else (K, M)
    b_rows, b_cols = (K, N) if layouts[1] == "N" else (N, K)
    a, a_view = column_major(a_rows, a_cols, a_rows + 8, dtype, device)  # padded leading dimensions
    b, b_view = column_major(b_rows, b_cols, b_rows + 16, dtype, device)
    d, d_view = column_major(M, N, M + 8, dtype, device)
    call = GemmCall(layouts[0] == "T", layouts[1] == "T", M, N, K, a_rows + 8, b_rows + 16, M + 8, a.stride(0),
                    b.stride(0), d.stride(0), BATCH)
    op_a = a_view.double() if layouts[0] == "N" else a_view.double().transpose(1, 2)
    op_b = b_view.double() if layouts[1] == "N" else b_view.double().transpose(1, 2)
    acc = op_a @ op_b  # (batch, m, n)
    bias = torch.randn(M if along == "m" else N, dtype=dtype, device=device)
    spread = bias.double()[:, None] if along == "m" else bias.double()[None, :]
    runner, stream = loaded(compiled[case]), torch.cuda.current_stream().cuda_stream
    if epilogue == "plain":
        runner(call, a.data_ptr(), b.data_ptr(), d.data_ptr(), stream)
        assert error(d_view, acc) < TOLERANCE[dtype]
    elif epilogue == "bias_gelu":
        aux, aux_view = column_major(M, N, M + 8, dtype, device)
        runner(call, a.data_ptr(), b.data_ptr(), d.data_ptr(), stream, aux=aux.data_ptr(), bias=bias.data_ptr())
        assert error(aux_view, acc) < TOLERANCE[dtype]  # F: the product alone
        assert error(d_view, torch.nn.functional.gelu(acc + spread)) < TOLERANCE[dtype]
    elif epilogue == "bias_gelu_slope":
        aux, aux_view = column_major(M, N, M + 8, dtype, device)
        runner(call, a.data_ptr(), b.data_ptr(), d.data_ptr(), stream, aux=aux.data_ptr(), bias=bias.data_ptr())
        assert error(aux_view, gelu_grad(acc + spread)) < TOLERANCE[dtype]  # the slope, for slope_bgrad
        assert error(d_view, torch.nn.functional.gelu(acc + spread)) < TOLERANCE[dtype]
    elif epilogue == "dgelu":
        aux, aux_view = column_major(M, N, M + 8, dtype, device)
        runner(call, a.data_ptr(), b.data_ptr(), d.data_ptr(), stream, aux=aux.data_ptr(), bias=bias.data_ptr())
        assert error(d_view, acc * gelu_grad(aux_view.double() + spread)) < TOLERANCE[dtype]
    else:
        aux, aux_view = column_major(M, N, M + 8, dtype, device)
        workspace = torch.empty(max(1, runner.workspace_bytes(call)), dtype=torch.uint8, device=device)
        sums = BiasGradientLaunch(partial_sums(compiled[case], call), device)
        partials = torch.empty(sums.kernels.outer * sums.kernels.stride, dtype=torch.float32, device=device)
        gradients = [torch.full_like(bias, float("nan")) for _ in range(2)]
        for gradient in gradients:
            partials.fill_(float("nan"))  # a partial the GEMM did not write would reach the sum
            runner(call, a.data_ptr(), b.data_ptr(), d.data_ptr(), stream, aux=aux.data_ptr(), bias=bias.data_ptr(),
                   bias_gradient=partials.data_ptr(), workspace=workspace.data_ptr())
            sums(partials.data_ptr(), gradient.data_ptr(), stream)
        slope = aux_view.double() if epilogue == "slope_bgrad" else gelu_grad(aux_view.double() + spread)
        want = acc * slope
        assert error(d_view, want) < TOLERANCE[dtype]
        assert error(gradients[0], want.sum((0, 2) if along == "m" else (0, 1))) < TOLERANCE[dtype]
        assert torch.equal(gradients[0], gradients[1])  # the same bits: no float atomics across tiles
