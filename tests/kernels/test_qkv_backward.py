"""qkv_proj's backward from the attention's dQ, dK, dV (`kernels/qkv_backward.py`): which layouts it runs, the
calls it makes (CPU), and on the GPU its outputs against the float64 reference of its four operators.

Tolerance (GPU): max |got − want| / max |want| per output ≤ 5e-3 in float16, 3e-2 in bfloat16 (dX is rounded after
each of its three accumulating calls; the sums of 3 × H·P products per element stay far inside).
"""
import dataclasses

import pytest
import torch

from substation.errors import ConfigurationFileError
from substation.graph import layer_graph
from substation.kernels.qkv_backward import (COVER, IMPL, SlicedQkvBackward, assignments,
                                             profiled_groups, sliced_calls)
from substation.layouts import Configuration
from substation.protocol import Choice
from substation.sizes import Size
from substation.tc_profiling.mapping import map_contraction

GRAPH = layer_graph()
OPS = [GRAPH.operator(name) for name in COVER]
B8 = Size.from_heads(B=8, L=512, H=16, P=64, U=4096)
ODD = Size.from_heads(B=3, L=77, H=4, P=64, U=512)
# The layouts of the shipped configurations (cuDNN's attention writes dQ, dK, dV so).
SHIPPED = dict(dQ="bjhp", dK="bkhp", dV="bkhp", Wqkv="thpi", dWqkv="thpi", dbqkv="thp", X="bji", dR1="bji", dX="bji")
GPU_TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}


def test_each_slice_makes_the_stacked_call_over_a_third_of_k():
    calls = sliced_calls(SHIPPED, B8.extents)
    stacked = {op.name: map_contraction(op, {"dQKV": "bjthp", "Wqkv": "thpi", "dXa": "bji", "X": "bji",
                                             "dWqkv": "thpi"}, B8.extents)
               for op in OPS if op.is_contraction}
    for mapping in calls.dgrad:  # dX = Σ_t dQKV[t]·Wqkv[t]: each call sums over h, p only
        whole = stacked["qkv_proj_dgrad"].call
        assert (mapping.call.m, mapping.call.n, mapping.call.k) == (whole.m, whole.n, whole.k // 3)
        assert mapping.call.batch == 1 and mapping.a_operand == "Wqkv"
    for mapping in calls.wgrad:  # dWqkv[t] = dQKV[t]ᵀ·X: a third of the rows of the stacked call's result
        assert (mapping.call.m, mapping.call.n, mapping.call.k) == (B8.I, B8.H * B8.P, B8.B * B8.L)
    assert calls.bias_views == ((B8.B * B8.L, B8.H * B8.P, 1),) * 3
    assert calls.slice_elements == B8.H * B8.P * B8.I


@pytest.mark.parametrize("change, message", [
    (dict(Wqkv="hpti", dWqkv="hpti"), "Wqkv:hpti does not start with 't'"),
    (dict(dWqkv="tihp"), "dWqkv:tihp is not laid out as Wqkv:thpi"),
    (dict(dR1="jbi"), "dR1:jbi is not laid out as dX:bji"),
    (dict(dbqkv="tph"), "dbqkv:tph: the bias-gradient kernel writes each slice's sums as thp"),
    (dict(dK="kbhp"), "dK:kbhp in qkv_proj_dgrad: M letters are ordered 'jb' in one tensor but 'bj' in dX:bji"),
    (dict(dV="bhkp"), "dV:bhkp in qkv_proj_dgrad: M letters 'bj' are not adjacent"),
])
def test_layouts_it_cannot_run_say_why(change, message):
    found = sliced_calls(SHIPPED | change, B8.extents)
    assert isinstance(found, str) and found.startswith(message), found


def test_the_profiled_assignments_and_their_rows():
    found = assignments(B8)
    assert SHIPPED in found and len(found) == 8  # dQ with b before j (as X), h and p adjacent; 2 Wqkv orders each
    assert all(not isinstance(sliced_calls(layouts, ODD.extents), str) for layouts in found)
    groups = profiled_groups(B8)
    rows = [group.candidate for group in groups]
    # 4 assignments with h, p innermost take both bias gradients, 4 with b, j innermost the kernel; × 3 × 3 ranks
    assert len({row.label for row in rows}) == len(rows) == (4 * 2 + 4) * 3 * 3
    row = next(r for r, g in zip(rows, groups) if dict(g.layouts) == SHIPPED)
    assert row.covers == COVER and row.impl == IMPL and row.op == "qkv_bias_bwd"
    assert row.options_dict == {"bias_grad": "epilogue", "dgrad_algo": 0, "wgrad_algo": 0}
    assert dict(row.outputs) == {"dbqkv": "thp", "dWqkv": "thpi", "dX": "bji"}
    assert set(dict(row.inputs)) == {"dQ", "dK", "dV", "Wqkv", "X", "dR1"}


def _configuration(**layouts):
    return Configuration(dict(Configuration.default().layouts) | dict(dQ="bjhp", dK="bkhp", dV="bkhp") | layouts)


def test_check_takes_its_layouts_and_names_what_breaks():
    implementation = SlicedQkvBackward()
    config = _configuration()
    row = implementation.first_candidate(OPS, ODD, implementation.cover_layouts(OPS, config))
    choice = Choice(COVER, IMPL, row.options_dict)
    implementation.check(OPS, choice, config, ODD)
    assert implementation.at_size(OPS, choice, config, B8) == choice  # no call recorded: any size runs it
    for bad in ({"bias_grad": "atomic"}, {"dgrad_algo": -1}, {"wgrad_algo": "best"}):
        with pytest.raises(ConfigurationFileError, match="expected bias_grad one of"):
            implementation.check(OPS, Choice(COVER, IMPL, row.options_dict | bad), config, ODD)
    with pytest.raises(ConfigurationFileError, match="operators.qkv_bias_bwd: impl 'cublaslt_sliced' cannot run "
                                                     "these layouts: dQ:bhjp in qkv_proj_dgrad"):
        implementation.check(OPS, choice, _configuration(dQ="bhjp"), ODD)
    transposed = _configuration(dQ="hpbj", dK="hpbk", dV="hpbk")
    assert {c.options_dict["bias_grad"] for c in implementation.candidates(
        OPS, ODD, implementation.cover_layouts(OPS, transposed))} == {"kernel"}
    with pytest.raises(ConfigurationFileError, match="epilogue cannot reduce dQ, dK, dV laid out with b, j innermost"):
        implementation.check(OPS, Choice(COVER, IMPL, row.options_dict | {"bias_grad": "epilogue"}), transposed, ODD)


def test_substation_compile_builds_its_bias_kernels_where_it_takes_them():
    from substation.kernels.bias_grad import BiasGradient
    from substation.runtime import chosen_kernels, default_choices

    size = B8.with_dtype("bfloat16")
    implementation, config = SlicedQkvBackward(), _configuration()
    row = implementation.first_candidate(OPS, size, implementation.cover_layouts(OPS, config))
    built_by_kernel = [BiasGradient(B8.B * B8.L, B8.H * B8.P, 1, "bfloat16")] * 3
    for bias_grad, built in (("kernel", built_by_kernel), ("epilogue", [])):
        choice = Choice(COVER, IMPL, row.options_dict | {"bias_grad": bias_grad})
        assert implementation.builds(OPS, choice, config, size) == built
    choices = default_choices(config, size) | {name: choice for name in COVER}  # the epilogue's, from the loop
    assert not any(isinstance(k, BiasGradient) for k in chosen_kernels(choices, config, size))
    choices |= {name: Choice(COVER, IMPL, row.options_dict | {"bias_grad": "kernel"}) for name in COVER}
    assert [k for k in chosen_kernels(choices, config, size) if isinstance(k, BiasGradient)] == built_by_kernel


def test_the_kernel_profiler_plans_it_where_its_operators_are_named():
    from substation.kernels.profiler import plan, tasks

    work = plan(ODD, ["float16", "bfloat16"], ops=["residual_bwd"], attention=False)
    assert len(work.sliced) == 2 * 108 and not work.gemm_epilogues and {p.op for p in work.points} == {"residual_bwd"}
    assert sum(1 for task in tasks(work, ODD, ["float16", "bfloat16"]) if task.payload in work.sliced) == 2 * 108
    assert not plan(ODD, ["float16"], ops=["ln1"], attention=False).sliced


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("size", [ODD, Size.from_heads(B=2, L=33, H=2, P=128, U=256)], ids=["p64", "p128"])
def test_every_assignment_matches_float64(size, dtype):
    """Every layout assignment, both bias gradients, the heuristic's first three algorithms (alike for both calls)."""
    groups = [g for g in profiled_groups(size.with_dtype(dtype))
              if dict(g.options)["dgrad_algo"] == dict(g.options)["wgrad_algo"]]
    for group in groups:
        work, error = group.checked_runner(size.with_dtype(dtype))
        assert error <= GPU_TOLERANCE[dtype], (dict(group.layouts), error)
        work()  # a second run writes the same (every output is overwritten, dX from dR1 again)
        again, error_again = group.checked_runner(size.with_dtype(dtype))
        assert error_again == error


@pytest.mark.gpu
@needs_gpu
def test_rows_in_isolated_workers(tmp_path):
    """Two of the profiled variants through the kernel profiler: checked, timed, one ok row each."""
    from substation.kernels.profiler import plan, run
    from substation.records import read_rows

    work = plan(ODD, ["float16"], ops=["residual_bwd"], attention=False)
    small = dataclasses.replace(work, points=(), sliced=work.sliced[:2])
    rows = [r for r in read_rows(run(small, ODD, ["float16"], tmp_path, [0], force=False, runs=3)) if r.impl == IMPL]
    assert sorted(r.label for r in rows) == sorted(g.candidate.label for g in small.sliced)
    assert all(r.status == "ok" and r.median_us > 0 for r in rows), [(r.label, r.error) for r in rows]
