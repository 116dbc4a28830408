"""qkv_proj_dgrad + residual_bwd as one cuBLASLt call (`kernels/residual_dgrad.py`): its layouts and rows (CPU), and
on the GPU its dX against the float64 reference of both operators.

Tolerance (GPU): max |got − want| / max |want| ≤ 5e-3 in float16, 3e-2 in bfloat16 (fp32 accumulation over 3·H·P
products, dR1 added in fp32, one rounding)."""
import pytest
import torch

from substation.errors import ConfigurationFileError
from substation.graph import layer_graph
from substation.kernels.residual_dgrad import (COVER, IMPL, RANKS, ResidualDgrad, assignments,
                                               profiled_groups, residual_mapping)
from substation.layouts import Configuration
from substation.protocol import Choice
from substation.sizes import Size
from substation.tc_profiling.mapping import map_contraction

GRAPH = layer_graph()
OPS = [GRAPH.operator(name) for name in COVER]
B8 = Size.from_heads(B=8, L=512, H=16, P=64, U=4096)
ODD = Size.from_heads(B=3, L=77, H=4, P=64, U=512)
SHIPPED = {"dQKV": "bjthp", "Wqkv": "thpi", "dR1": "bji", "dX": "bji"}
GPU_TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}


def test_the_call_is_the_dgrad_call_writing_dx():
    mapping = residual_mapping(SHIPPED, B8.extents)
    plain = map_contraction(OPS[0], {"dQKV": "bjthp", "Wqkv": "thpi", "dXa": "bji"}, B8.extents)
    assert mapping.call == plain.call and mapping.a_operand == plain.a_operand
    assert residual_mapping(SHIPPED | {"dR1": "jbi"}, B8.extents).startswith("dR1:jbi is not laid out as dX:bji")
    assert "not adjacent" in residual_mapping(SHIPPED | {"dQKV": "btjhp"}, B8.extents)


def test_rows_name_both_operators_and_a_rank():
    found = assignments(B8)
    assert SHIPPED in found and all(layouts["dX"] == layouts["dR1"] == "bji" for layouts in found)
    groups = profiled_groups(B8)
    assert len(groups) == len(found) * len(RANKS) and len({g.candidate.label for g in groups}) == len(groups)
    row = next(g.candidate for g in groups if dict(g.layouts) == SHIPPED and g.rank == 0)
    assert row.covers == COVER and row.impl == IMPL and dict(row.outputs) == {"dX": "bji"}
    assert dict(row.inputs) == {"dQKV": "bjthp", "Wqkv": "thpi", "dR1": "bji"} and row.options_dict == {"algo": 0}


def test_check_takes_its_layouts_at_any_size_and_names_what_breaks():
    implementation = ResidualDgrad()
    config = Configuration.default()  # dQKV bjthp, Wqkv thpi, dR1 and dX bji
    row = implementation.first_candidate(OPS, ODD, implementation.cover_layouts(OPS, config))
    choice = Choice(COVER, IMPL, row.options_dict)
    implementation.check(OPS, choice, config, ODD)
    assert implementation.at_size(OPS, choice, config, B8) == choice  # a rank, no call: it runs at any size
    with pytest.raises(ConfigurationFileError, match="operators.qkv_proj_dgrad: impl 'cublaslt_residual' cannot run "
                                                     "these layouts: dR1:jbi is not laid out as dX:bji"):
        implementation.check(OPS, choice, Configuration(dict(config.layouts) | {"dR1": "jbi"}), ODD)
    for bad in ({"algo": -1}, {"algo": "best"}, {}):
        with pytest.raises(ConfigurationFileError, match="expected algo, a cuBLASLt heuristic rank"):
            implementation.check(OPS, Choice(COVER, IMPL, bad), config, ODD)


def test_the_kernel_profiler_plans_it_with_residual_bwd():
    from substation.kernels.profiler import plan

    work = plan(ODD, ["float16"], ops=["residual_bwd"], attention=False)
    assert len(work.residual) == len(profiled_groups(ODD)) and work.sliced
    assert not plan(ODD, ["float16"], ops=["ln1"], attention=False).residual


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("size", [ODD, Size.from_heads(B=2, L=33, H=2, P=128, U=256)], ids=["p64", "p128"])
def test_every_assignment_matches_float64(size, dtype):
    """Every profiled layout assignment at ranks 0 and 3 (the heuristic's last offer where it has fewer)."""
    for group in profiled_groups(size.with_dtype(dtype)):
        if group.rank in (0, RANKS[-1]):
            work, error = group.checked_runner(size.with_dtype(dtype))
            assert error <= GPU_TOLERANCE[dtype], (dict(group.layouts), group.rank, error)
