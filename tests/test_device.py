"""DeviceSpec: the H100 stand-in, reading a device's properties, and what the kernels take from a spec
(feasibility, LayerNorm's block target, the architecture they compile for and bind to)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from substation.device import H100, DeviceSpec
from substation.graph import layer_graph
from substation.kernels.base import InfeasibleVariantError
from substation.kernels.layernorm import LayerNormParams, variants
from substation.kernels.softmax import SoftmaxParams
from substation.sizes import get_size

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# A smaller GPU than the H100: fewer SMs, less shared memory per block, another architecture.
SMALL = DeviceSpec(name="Small GPU", major=8, minor=6, sm_count=66, max_shared_bytes_per_block=99 * 1024)


def canonical(op: str) -> tuple[tuple[str, str], ...]:
    operator = layer_graph().operator(op)
    return tuple((n, layer_graph().tensors[n].dims) for n in operator.inputs + operator.outputs)


def test_h100_is_what_the_shipped_profiles_ran_on():
    assert H100.arch == "sm_90"
    assert (H100.sm_count, H100.max_shared_bytes_per_block) == (132, 227 * 1024)
    assert DeviceSpec(name="B200", major=10, minor=0, sm_count=148, max_shared_bytes_per_block=1).arch == "sm_100"
    with pytest.raises(dataclasses.FrozenInstanceError):
        H100.sm_count = 1


def test_from_properties_reads_torchs_names():
    properties = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                                 shared_memory_per_block_optin=232448, total_memory=80 * 2**30)
    assert DeviceSpec.from_properties(properties) == H100


def test_of_names_a_bad_device():
    with pytest.raises(TypeError, match="device='cuda:0' must be a CUDA device index"):
        DeviceSpec.of("cuda:0")


def test_shared_memory_limit_comes_from_the_spec():
    # 2 tiles of 64 rows x 1026 halves: 262 656 bytes > 227 KiB; 16 rows (65 664 bytes) fit the H100, not SMALL's 99 KiB
    base = dict(op="softmax", dtype="float16", layouts=canonical("softmax"), B=1, H=1, L=1024, tile="j", vec=8)
    with pytest.raises(InfeasibleVariantError, match="262656 bytes of shared memory exceed 232448, the most a block may "
                                              "use on NVIDIA H100 80GB HBM3"):
        SoftmaxParams(**base, rows=64).check()
    SoftmaxParams(**base, rows=16).check()
    SoftmaxParams(**base, rows=16).check(SMALL)
    with pytest.raises(InfeasibleVariantError, match="exceed 101376, the most a block may use on Small GPU"):
        SoftmaxParams(**base, rows=32).check(SMALL)


def test_layernorm_backward_aims_at_two_blocks_per_sm():
    size = get_size("bert-large-b8-l512")  # 4096 rows: 512 tiles of 8 rows
    many_tiles = lambda spec: {p.row_tiles for p in variants("ln2_bwd", size, "float16",  # noqa: E731
                                                                dict(canonical("ln2_bwd")), spec)
                               if p.staging == "shared" and p.rows == 8} - {1}
    assert many_tiles(H100) == {2}  # 512 tiles over 264 blocks
    assert many_tiles(SMALL) == {4}  # over 132 blocks
    assert variants("ln2_bwd", size, "float16", dict(canonical("ln2_bwd"))) == variants(
        "ln2_bwd", size, "float16", dict(canonical("ln2_bwd")), H100)


def test_compiles_for_the_specs_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    params = LayerNormParams(op="ln1", dtype="float16", layouts=canonical("ln1"), B=2, L=8, I=64, rows=4, vec=8)
    h100, small = params.compile(), params.compile(SMALL)
    assert (h100.arch, small.arch) == ("sm_90", "sm_86")
    assert h100.path != small.path and small.path.read_bytes()[:4] == b"\x7fELF"


def test_bind_refuses_a_cubin_for_another_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    params = LayerNormParams(op="ln1", dtype="float16", layouts=canonical("ln1"), B=2, L=8, I=64, rows=4, vec=8)
    cubin = params.compile()
    monkeypatch.setattr(DeviceSpec, "of", classmethod(lambda cls, device: SMALL))
    with pytest.raises(ValueError, match=r"compiled for sm_90, but device 0 \(Small GPU\) is sm_86: "
                                         r"compile\(DeviceSpec.of\(0\)\)"):
        params.bind(cubin, 0)


def test_bind_checks_feasibility_on_the_device(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    params = SoftmaxParams(op="softmax", dtype="float16", layouts=canonical("softmax"), B=1, H=1, L=1024, tile="j",
                           rows=32, vec=8)
    cubin = params.compile(dataclasses.replace(SMALL, max_shared_bytes_per_block=H100.max_shared_bytes_per_block))
    monkeypatch.setattr(DeviceSpec, "of", classmethod(lambda cls, device: SMALL))
    with pytest.raises(InfeasibleVariantError, match="the most a block may use on Small GPU"):
        params.bind(cubin, 0)


@pytest.mark.gpu
@needs_gpu
def test_of_reads_the_device():
    spec = DeviceSpec.of(0)
    properties = torch.cuda.get_device_properties(0)
    assert (spec.major, spec.minor) == torch.cuda.get_device_capability(0)
    assert spec.name == torch.cuda.get_device_name(0)
    assert spec.sm_count == properties.multi_processor_count > 0
    assert spec.max_shared_bytes_per_block >= 48 * 1024
    assert DeviceSpec.of(0) is spec  # read once
    if spec.name.startswith("NVIDIA H100 80GB HBM3"):
        assert spec == H100
