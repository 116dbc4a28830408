"""The multi-tensor conversion kernel (a graphed step's weight cast under autocast, its backward's staged gradients):
its rules, block plan and rendering, an nvcc build (CPU), and on the GPU every conversion bit-equal to torch's
`.to()` on tensors of odd sizes, at an address no vector divides, with infs, NaNs and values that overflow the
16-bit type."""
import pytest
import torch

from substation.device import H100
from substation.kernels.convert import CONVERSIONS, PER_BLOCK, Conversion, Converter, blocks


def test_conversion_rules():
    with pytest.raises(ValueError, match="no conversion"):
        Conversion("float16", "bfloat16", 1)
    with pytest.raises(ValueError, match="one tensor or more"):
        Conversion("float32", "float16", 0)


def test_blocks_give_each_tensor_its_own_range():
    assert blocks([PER_BLOCK, 1, 0, PER_BLOCK + 1]) == [0, 1, 2, 2, 4]
    assert blocks([]) == [0]


@pytest.mark.parametrize("source, target", list(CONVERSIONS))
def test_rendering_takes_one_argument_group_per_tensor(source, target):
    source_code = Conversion(source, target, 3).render()
    for i in range(3):
        assert f"src{i}, dst{i}, n{i}, b - first{i}" in source_code
    assert CONVERSIONS[source, target] in source_code and "src3" not in source_code


def test_kernel_builds_with_nvcc():
    cubin = Conversion("float32", "bfloat16", 12).compile(H100)
    assert cubin.path.read_bytes()[:4] == b"\x7fELF" and b"convert_float32_bfloat16_12" in cubin.path.read_bytes()


# -- GPU ---------------------------------------------------------------------------------------------------------

def special_values(n: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random values over a wide range, with infs, NaNs and values the 16-bit types round to inf."""
    x = torch.randn(n, generator=generator, device="cuda") * torch.exp2(torch.randint(-30, 30, (n,), generator=generator,
                                                                                        device="cuda").float())
    x[::97] = float("inf")
    x[1::89] = float("-inf")
    x[2::83] = float("nan")
    x[3::79] = 7e4  # beyond float16's largest finite value
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("source, target", list(CONVERSIONS), ids=lambda d: str(d))
def test_conversion_matches_torch_bit_for_bit(source, target):
    source_dtype, target_dtype = getattr(torch, source), getattr(torch, target)
    generator = torch.Generator(device="cuda").manual_seed(5)
    # Whole blocks, a partial block, a few elements, none, and one starting 2 elements into its storage (no 16-byte
    # vectors there).
    numels = [3 * PER_BLOCK, PER_BLOCK + 13, 7, 0, 2 * PER_BLOCK + 5]
    sources = [special_values(n, source_dtype, generator) for n in numels[:-1]]
    sources.append(special_values(numels[-1] + 2, source_dtype, generator)[2:])
    targets = [torch.full((n,), 3.0, dtype=target_dtype, device="cuda") for n in numels]
    Converter(numels, source_dtype, target_dtype, torch.device("cuda"))(targets, sources)
    torch.cuda.synchronize()
    for got, source_tensor in zip(targets, sources):
        want = source_tensor.to(target_dtype)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.where(want.isnan(), 0, got), torch.where(want.isnan(), 0, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_converter_refuses_other_tensors():
    converter = Converter([8, 16], torch.float32, torch.float16, torch.device("cuda"))
    pairs = ([torch.empty(8, dtype=torch.float16, device="cuda"), torch.empty(16, dtype=torch.float16, device="cuda")],
             [torch.empty(8, device="cuda"), torch.empty(16, device="cuda")])
    converter(*pairs)
    with pytest.raises(ValueError, match="prepared for"):
        converter(pairs[0][:1], pairs[1][:1])
    with pytest.raises(ValueError, match="prepared for"):
        converter([t.float() for t in pairs[0]], pairs[1])
    with pytest.raises(ValueError, match="contiguous"):
        converter(pairs[0], [pairs[1][0], torch.empty(32, device="cuda")[::2]])
