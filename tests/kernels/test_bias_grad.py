"""The bias-gradient kernel (kernels/bias_grad.py): how a layout becomes [O, U, I] and how it is cut into chunks
(CPU), its nvcc build (CPU, needs nvcc), and on the GPU its sums against float64 in every arrangement: u innermost
(16-byte loads, several chunks), u outermost and in the middle (16-byte or scalar loads along I), odd extents, fp16
and bf16, the same bits on a second run.

Tolerance: the sums run in float32 over at most a few thousand terms and are rounded once to the gradient's dtype,
so the largest error over the largest reference magnitude stays within 2 units of that dtype's last place: fp16
2e-3, bf16 1.6e-2."""
import pytest
import torch

from substation.device import H100, DeviceSpec
from substation.kernels.bias_grad import THREADS, WAVES, BiasGradient, BiasGradientLaunch

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
BERT = {"b": 8, "j": 512, "u": 4096}


@pytest.mark.parametrize("layout, shape", [("ubj", (1, 4096, 4096)), ("buj", (8, 4096, 512)),
                                           ("bju", (4096, 4096, 1)), ("jub", (512, 4096, 8))])
def test_a_layout_is_what_lies_before_after_the_bias_letter(layout, shape):
    kernels = BiasGradient.of(layout, "u", BERT, "float16")
    assert (kernels.outer, kernels.bias, kernels.inner) == shape


def test_chunks_fill_the_gpu_without_empty_ones():
    innermost = BiasGradient.of("bju", "u", BERT, "float16")
    assert innermost.vec == 8 and innermost.tx == 32 and innermost.blocks_per_chunk == 16
    assert innermost.chunks == -(-WAVES * H100.sm_count // 16) and innermost.workspace_floats == innermost.chunks * 4096
    assert (innermost.chunks - 1) * innermost.chunk_rows < innermost.outer <= innermost.chunks * innermost.chunk_rows
    outermost = BiasGradient.of("ubj", "u", BERT, "float16")  # 4096 blocks already: one chunk, db written directly
    assert outermost.chunks == 1 and outermost.workspace_floats == 0
    few_rows = BiasGradient(outer=3, bias=24, inner=1, dtype="bfloat16")
    assert few_rows.tx == 4 and few_rows.chunks == 1  # 3 rows fit one block's THREADS // tx rows
    assert THREADS % few_rows.tx == 0
    small_gpu = BiasGradient.of("bju", "u", BERT, "float16", DeviceSpec("small", 9, 0, 16, 0))
    assert small_gpu.chunks < innermost.chunks


@pytest.mark.parametrize("bad, message", [(dict(outer=0), "positive"), (dict(dtype="int8"), "dtype"),
                                          (dict(out_dtype="float64"), "dtype"), (dict(stride=16), "row stride"),
                                          (dict(inner=1, stride=4), "row stride")])
def test_bad_shapes_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        BiasGradient(**(dict(outer=2, bias=8, inner=4, dtype="float16") | bad))
    with pytest.raises(ValueError, match="not in the layout"):
        BiasGradient.of("bj", "u", BERT, "float16")


def test_padded_float32_rows_sum_into_another_dtype():
    """The GEMM epilogue's partial sums: float32 rows 256 apart, 200 of each summed, db in bfloat16; 16-byte loads
    (4 float32, which divides both 200 and 256)."""
    kernels = BiasGradient(outer=6, bias=200, inner=1, dtype="float32", stride=256, out_dtype="bfloat16")
    assert kernels.vec == 4 and kernels.name.endswith("_to_bfloat16") and "_s256_" in kernels.name
    source = kernels.render()
    assert "#define ROW 256" in source and "typedef __nv_bfloat16 out_t;" in source and "typedef float elem_t;" in source


def test_both_arrangements_build_with_nvcc():
    for layout in ("bju", "buj"):
        kernels = BiasGradient.of(layout, "u", {"b": 3, "j": 77, "u": 40}, "bfloat16")
        source = kernels.render()
        assert f"{kernels.name}_partial" in source and (f"{kernels.name}_sum" in source) == (kernels.chunks > 1)
        assert kernels.compile().path.read_bytes()[:4] == b"\x7fELF"


# -- GPU ---------------------------------------------------------------------------------------------------------

CASES = [  # (layout, extents, dtype)
    ("bju", {"b": 6, "j": 200, "u": 1024}, torch.float16),  # u innermost, several chunks
    ("bju", {"b": 3, "j": 77, "u": 40}, torch.bfloat16),  # u innermost, 8 along u, one chunk
    ("jbu", {"b": 2, "j": 9, "u": 36}, torch.float16),  # 36 = 4 · 9: 4-element loads
    ("ubj", {"b": 8, "j": 64, "u": 520}, torch.bfloat16),  # u outermost: rows of 512 contiguous tokens
    ("buj", {"b": 5, "j": 77, "u": 64}, torch.float16),  # u in the middle, rows of 77: scalar loads
    ("jub", {"b": 16, "j": 33, "u": 96}, torch.float16),  # rows of 16: 16-byte loads
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{CASES[i][2]}")
def test_sums_match_float64_and_repeat_bit_for_bit(case):
    layout, extents, dtype = CASES[case]
    torch.manual_seed(case)
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn([extents[d] for d in layout], dtype=dtype, device=device) + 0.25  # sums far from zero
    launch = BiasGradientLaunch(BiasGradient.of(layout, "u", extents, str(dtype).removeprefix("torch."),
                                                DeviceSpec.of(device.index)), device)
    want = x.double().sum([i for i, d in enumerate(layout) if d != "u"])
    got = [torch.full((extents["u"],), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    for gradient in got:
        launch(x.data_ptr(), gradient.data_ptr(), torch.cuda.current_stream(device).cuda_stream)
    torch.cuda.synchronize(device)
    assert float((got[0].double() - want).abs().max() / want.abs().max()) < TOLERANCE[dtype]
    assert torch.equal(got[0], got[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_padded_float32_partials_sum_into_the_gradient_dtype(out_dtype):
    """What follows a dgelu_bgrad GEMM: rows of 200 sums 256 apart (the padding NaN: it must not be read)."""
    torch.manual_seed(7)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = torch.full((37, 256), float("nan"), dtype=torch.float32, device=device)
    rows[:, :200] = torch.randn(37, 200, device=device) + 0.25
    launch = BiasGradientLaunch(BiasGradient(37, 200, 1, "float32", DeviceSpec.of(device.index).sm_count, stride=256,
                                             out_dtype=str(out_dtype).removeprefix("torch.")), device)
    got = [torch.full((200,), float("nan"), dtype=out_dtype, device=device) for _ in range(2)]
    for gradient in got:
        launch(rows.data_ptr(), gradient.data_ptr(), torch.cuda.current_stream(device).cuda_stream)
    torch.cuda.synchronize(device)
    want = rows[:, :200].double().sum(0)
    assert float((got[0].double() - want).abs().max() / want.abs().max()) < TOLERANCE[out_dtype]
    assert torch.equal(got[0], got[1])
