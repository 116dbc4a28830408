"""On the GPU: every feasible mapping runs through cuBLASLt and legacy cuBLAS and computes its einsum."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from substation.graph import layer_graph  # noqa: E402
from substation.sizes import Size  # noqa: E402
from substation.tc_profiling.mapping import enumerate_mappings, map_contraction  # noqa: E402

GRAPH = layer_graph()
DIMS = {n: s.dims for n, s in GRAPH.tensors.items()}
# Not BERT-large, every extent distinct; multiples of 8 keep fp16 rows 16-byte aligned as cuBLASLt prefers.
SIZE = Size.from_heads(B=2, L=40, H=3, P=16, U=88)
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative Frobenius error vs float64, one output rounding


def _relative_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.fixture(scope="module")
def gemm():
    pytest.importorskip("nvmath")
    from substation.tc_profiling import cublas, cublaslt, gemm

    handle, legacy = cublaslt.Handle(), cublas.LegacyCublas()
    yield gemm, cublaslt, handle, legacy
    handle.close()
    legacy.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", [op for op in GRAPH.operators if op.is_contraction], ids=lambda op: op.name)
def test_every_mapping_on_the_gpu(gemm, op, dtype):
    module, lt, handle, legacy = gemm
    generator = torch.Generator(device="cuda").manual_seed(0)
    ext = SIZE.extents
    for mapping in enumerate_mappings(op, ext, DIMS):
        if mapping.call is None:
            continue
        tensors = module.operands(mapping, ext, dtype, generator)
        (a, la), (b, lb), (c, lc) = mapping.layouts
        want = torch.einsum(f"{la},{lb}->{lc}", tensors[a].double(), tensors[b].double())
        pointers = (tensors[mapping.a_operand].data_ptr(), tensors[mapping.b_operand].data_ptr(), tensors[c].data_ptr())
        matmul = lt.LtMatmul(handle, mapping.call, dtype)
        algorithms = matmul.algorithms(2)
        assert algorithms, f"no cuBLASLt algorithm for {mapping}"
        runs = [lambda algo=algo: matmul(*pointers, algo) for algo in algorithms]
        runs.append(legacy.prepare(mapping.call, dtype, *pointers))
        for run in runs:
            tensors[c].fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            assert _relative_error(tensors[c], want) < RTOL[dtype], mapping
        rebuilt = matmul.algorithm_from_options(algorithms[0].options())
        assert (rebuilt.data == algorithms[0].data).all(), "an algorithm rebuilt from its options is the same"
        matmul.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_bias_epilogue_on_the_gpu(gemm, dtype):
    """cuBLASLt's BIAS epilogue with a bias batch stride: every covered layout assignment gives qkv_proj + qkv_bias,
    Q, K, V as the contiguous slices of QKV along t."""
    from substation.tc_profiling.epilogues import broadcast, enumerate_epilogues

    module, lt, handle, _ = gemm
    generator = torch.Generator(device="cuda").manual_seed(2)
    ext = SIZE.extents
    checked = 0
    for split, _, epilogue in enumerate_epilogues(ext):
        if isinstance(epilogue, str):
            continue
        mapping = epilogue.mapping
        tensors = module.operands(mapping, ext, dtype, generator)
        bias = torch.randn([ext[d] for d in epilogue.bias_layout], generator=generator, device="cuda").to(dtype)
        (a, la), (b, lb), (c, lc) = mapping.layouts
        want = (torch.einsum(f"{la},{lb}->{lc}", tensors[a].double(), tensors[b].double())
                + broadcast(bias.double(), epilogue.bias_layout, lc))
        matmul = lt.LtMatmul(handle, mapping.call, dtype, "bias", epilogue.bias_batch_stride)
        matmul.set_epilogue_pointer(bias.data_ptr())
        algorithms = matmul.algorithms(2)
        assert algorithms, f"no cuBLASLt algorithm for {mapping}"
        for algo in algorithms:
            tensors[c].fill_(float("nan"))
            matmul(tensors[mapping.a_operand].data_ptr(), tensors[mapping.b_operand].data_ptr(), tensors[c].data_ptr(),
                   algo)
            torch.cuda.synchronize()
            for index, (name, _) in enumerate(epilogue.slices):
                assert _relative_error(tensors[c][index], want[index]) < RTOL[dtype], (mapping, name)
        matmul.close()
        checked += 1
    assert checked == 32


def test_gelu_epilogue_is_the_tanh_approximation(gemm):
    """cuBLASLt's GELU_BIAS computes tanh-GELU, not the layer's exact erf GELU, so it is not a candidate."""
    module, lt, handle, _ = gemm
    ffn_in = GRAPH.operator("ffn_in")
    mapping = map_contraction(ffn_in, DIMS, Size.from_heads(B=4, L=64, H=4, P=32, U=512).extents)
    generator = torch.Generator(device="cuda").manual_seed(1)
    ext = Size.from_heads(B=4, L=64, H=4, P=32, U=512).extents
    tensors = module.operands(mapping, ext, torch.float32, generator)
    bias = torch.randn(mapping.call.m, device="cuda", generator=generator)
    outputs = {}
    for epilogue in ("bias", "gelu_bias"):
        matmul = lt.LtMatmul(handle, mapping.call, torch.float32, epilogue)
        matmul.set_epilogue_pointer(bias.data_ptr())
        matmul(tensors[mapping.a_operand].data_ptr(), tensors[mapping.b_operand].data_ptr(),
               tensors["F"].data_ptr(), matmul.algorithms(1)[0])
        torch.cuda.synchronize()
        outputs[epilogue] = tensors["F"].clone()
        matmul.close()
    pre = (tensors["X1"].double() @ tensors["W1"].double().T) + bias.double()  # F + b1, bias along u
    assert _relative_error(outputs["bias"], pre) < 1e-5
    tanh_error = (outputs["gelu_bias"].double() - torch.nn.functional.gelu(pre, approximate="tanh")).abs().max()
    erf_error = (outputs["gelu_bias"].double() - torch.nn.functional.gelu(pre)).abs().max()
    assert tanh_error < 1e-4 < erf_error


def test_timer_measures_gpu_time():
    from substation.timing import Timer

    timing = Timer(warmup=2, runs=20)(lambda: torch.cuda._sleep(1_000_000))  # ~0.5 ms at ~2 GHz
    assert 100 < timing.min_us <= timing.median_us < 5000 and timing.runs == 20
