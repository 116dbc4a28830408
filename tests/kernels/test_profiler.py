"""The kernel profiler: registry, layout space, plan and its isolated tasks (CPU); a small profile on the GPU."""
import csv
import dataclasses
import gzip
import pickle
from pathlib import Path

import pytest
import torch

from substation.device import H100, DeviceSpec
from substation.errors import GraphError
from substation.graph import layer_graph
from substation.kernels import gemm_epilogue, profiler, sdpa
from substation.kernels.base import KernelParams
from substation.kernels.profiler import TorchBaseline, plan, run, tasks
from substation.kernels.registry import kernel_module, registry
from substation.kernels.space import choices, gemm_layouts, profiled_layout_space
from substation.records import read_rows
from substation.sizes import get_size

SIZE = get_size("bert-large-b8-l512")
GRAPH = layer_graph()


def test_unknown_kernel_lists_the_known_ones():
    with pytest.raises(GraphError, match="no kernel implements 'attn_scores'; kernels exist for: .*softmax"):
        kernel_module("attn_scores")
    assert set(registry()) <= {op.name for op in GRAPH.operators if not op.is_contraction}


def test_layout_space_rules():
    layouts = gemm_layouts(SIZE)
    assert set(layouts["S"]) == {"bhjk", "bhkj", "hbjk", "hbkj", "jbhk", "kbhj", "jhbk", "khbj"}
    assert choices("X", GRAPH, SIZE) == ("bji",), "user-visible tensors keep their layout"
    assert choices("Pr", GRAPH, SIZE) == layouts["S"], "Pr may be written in any layout S can have"
    assert choices("Rs1", GRAPH, SIZE) == ("bj",)
    space = profiled_layout_space(GRAPH.operator("softmax"), SIZE)
    assert space.total == 64 and all(c["Pr"] == c["S"] for c in space.combos)
    sampled = profiled_layout_space(GRAPH.operator("softmax_bwd"), SIZE, max_combos=20)
    assert (len(sampled.combos), sampled.total) == (20, 512) and sampled.coverage == 20 / 512
    assert sampled.combos[0] == {"dA": "bhjk", "Pr": "bhjk", "dS": "bhjk"}, "the canonical combination stays"


def test_plan_has_feasible_points_for_every_registered_operator():
    work = plan(SIZE, ["float16"], max_combos=8)
    assert {p.op for p in work.points} == set(registry())
    for params in work.points:
        params.check()
    assert len({p.label for p in work.points}) == len(work.points)


def test_tasks_name_their_rows_and_pickle():
    work = plan(SIZE, ["float16"], ops=["softmax", "attn_scores"], max_combos=2)
    found = tasks(work, SIZE, ["float16"])
    fused = [op for op in GRAPH.operators if not op.is_contraction]
    assert len(found) == len(fused) + len(work.attention) + len(work.attention_kernels) + len(work.points)
    assert [type(t.payload) for t in found[len(fused) - 1:len(fused) + 1]] == [TorchBaseline, sdpa.SdpaAttention]
    assert isinstance(found[-1].payload, KernelParams) and found[-1].candidates == (
        (found[-1].payload.candidate, SIZE.with_dtype("float16")),)
    att = found[len(fused)]
    assert [c.pass_ for c, _ in att.candidates] == ["forward", "backward"]
    assert pickle.loads(pickle.dumps(found)) == found


def test_gemm_epilogue_tasks_name_every_row_they_write():
    """Naming an operator a GEMM epilogue absorbs plans its groups: one task each, writing one row per layout
    assignment of its call; other operators plan none."""
    work = plan(SIZE, ["float16"], ops=["bias_gelu_bwd"], attention=False)
    assert work.gemm_epilogues and not plan(SIZE, ["float16"], ops=["ln1"], attention=False).gemm_epilogues
    found = [t for t in tasks(work, SIZE, ["float16"]) if t.payload in work.gemm_epilogues]
    assert len(found) == len(work.gemm_epilogues)
    assert all(t.candidates == tuple((c, SIZE.with_dtype("float16")) for c in t.payload.candidates) for t in found)
    assert pickle.loads(pickle.dumps(found)) == found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_small_profile_in_isolated_workers(tmp_path):
    work = plan(SIZE, ["float16"], ops=["softmax", "attn_scores"], max_combos=2)
    # Our fused attention's rows have the test below: left out here, the run would build every variant of SIZE.
    small = dataclasses.replace(work, points=work.points[:3], attention=work.attention[:2], attention_kernels=())
    path = run(small, SIZE, ["float16"], tmp_path, [0], force=False, runs=3)
    rows = read_rows(path)
    by_impl = {impl: [r for r in rows if r.impl == impl] for impl in {r.impl for r in rows}}
    assert len(by_impl["torch"]) == sum(not op.is_contraction for op in GRAPH.operators)
    assert len(by_impl["kernel"]) == 3 and len(rows) >= len(by_impl["torch"]) + 3 + 2
    assert all(r.status == "ok" for r in by_impl["torch"] + by_impl["kernel"]), [
        (r.label, r.error) for r in rows if r.status != "ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_attention_rows_in_isolated_workers(tmp_path):
    """Our fused attention's forward and backward points (a stacked one too, with its bias gradient), each checked
    against the float64 reference (dropout on, the same masks) and timed into an ok row naming its covers."""
    from substation.kernels.attention import BWD_COVERS, COVERS, IMPL, STACKED_COVERS, AttentionBackwardParams

    work = plan(SIZE, ["float16"], ops=["attn_scores"], max_combos=2)
    backward = [p for p in work.attention_kernels if isinstance(p, AttentionBackwardParams)]
    apart, stacked = [p for p in backward if not p.stacked], [p for p in backward if p.stacked]
    chosen = (work.attention_kernels[:2] + tuple(apart[:1]) + tuple(p for p in apart if p.fuse_dq)[-1:]
              + tuple(stacked[-1:]))
    small = dataclasses.replace(work, points=(), attention=(), attention_kernels=chosen)
    rows = [r for r in read_rows(run(small, SIZE, ["float16"], tmp_path, [0], force=False, runs=3))
            if r.impl == IMPL]
    assert len(rows) == 5 and all(r.status == "ok" for r in rows), [(r.label, r.error) for r in rows]
    assert [tuple(r.covers.split()) for r in rows] == [COVERS, COVERS, BWD_COVERS, BWD_COVERS, STACKED_COVERS]
    assert [r.label for r in rows] == [p.label for p in chosen]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemm_epilogue_rows_in_isolated_workers(tmp_path):
    """One group per epilogue (kernels the epilogue tests build too; the slope pair's too), checked against the
    float64 reference and timed: an ok row, with one timing, for every layout assignment of its call, naming both
    operators."""
    work = plan(SIZE, ["float16"], ops=["bias_gelu"], attention=False)
    chosen = tuple({g.variant.epilogue: g for g in work.gemm_epilogues if g.shape[0] == "pingpong"}.values())
    assert {g.calls[0].fusion.impl for g in chosen} == {gemm_epilogue.IMPL, gemm_epilogue.SLOPE_IMPL}
    small = dataclasses.replace(work, points=(), gemm_epilogues=chosen)
    rows = [r for r in read_rows(run(small, SIZE, ["float16"], tmp_path, [0], force=False, runs=3))
            if r.impl in (gemm_epilogue.IMPL, gemm_epilogue.SLOPE_IMPL)]
    assert len(rows) == sum(len(g.calls) for g in chosen) and all(r.status == "ok" for r in rows), [
        (r.label, r.error) for r in rows if r.status != "ok"]
    assert {r.covers for r in rows} == {"ffn_in bias_gelu", "ffn_out_dgrad bias_gelu_bwd"}
    assert all(len({r.median_us for r in rows if r.label in {c.label for c in g.candidates}}) == 1 for g in chosen)


def resumed_twice(work, dropped_row, tmp_path, monkeypatch):
    """What a profile run compiles into the shipped B8/L512 kernel profile as it is, then without the first row
    `dropped_row(line)` picks (no GPU: the workers are stubbed), and that row's label."""
    shipped = Path(__file__).parents[2] / "layouts" / "profiles" / "h100" / "bert-large-b8-l512" / "kernels.csv.gz"
    lines = gzip.decompress(shipped.read_bytes()).decode().splitlines(keepends=True)
    compiled = []
    monkeypatch.setattr(profiler, "gpu_name", lambda device: read_rows(shipped)[0].gpu)
    monkeypatch.setattr(profiler, "versions", lambda: {})
    monkeypatch.setattr(profiler, "compile_all", lambda points, spec: compiled.append(list(points)))
    monkeypatch.setattr(profiler, "run_isolated", lambda *args, **kwargs: None)
    monkeypatch.setattr(DeviceSpec, "of", staticmethod(lambda device: H100))
    (tmp_path / "kernels.csv").write_text("".join(lines))
    run(work, SIZE, ["float16"], tmp_path, [0], force=False)
    dropped = next(line for line in lines if dropped_row(line))
    (tmp_path / "kernels.csv").write_text("".join(line for line in lines if line != dropped))
    run(work, SIZE, ["float16"], tmp_path, [0], force=False)
    return compiled, dict(zip(*csv.reader([lines[0], dropped])))["label"]


def test_a_resumed_profile_compiles_only_the_points_it_has_yet_to_time(tmp_path, monkeypatch):
    """The shipped profile holds every ln1 point: a rerun compiles nothing; with one row removed, that point."""
    work = plan(SIZE, ["float16"], ops=["ln1"], attention=False)
    compiled, label = resumed_twice(work, lambda line: ",ln1,forward," in line and "registers" in line, tmp_path,
                                    monkeypatch)
    assert compiled[0] == [] and [p.label for p in compiled[1]] == [label]


def test_a_resumed_profile_compiles_only_the_epilogue_groups_it_has_yet_to_time(tmp_path, monkeypatch):
    """The same for the GEMMs with our epilogues: with one row removed, the kernel of its group. (The shipped H100
    profile holds no rows of the slope pair, which came after it: left out here.)"""
    work = plan(SIZE, ["float16"], ops=["bias_gelu"], attention=False)
    work = dataclasses.replace(work, points=(), gemm_epilogues=tuple(
        group for group in work.gemm_epilogues if group.calls[0].fusion.impl == gemm_epilogue.IMPL))
    compiled, label = resumed_twice(work, lambda line: ",cutlass_epilogue," in line, tmp_path, monkeypatch)
    labels = lambda group: [c.label for c in group.candidates]  # noqa: E731
    assert compiled[0] == [] and [labels(g) for g in compiled[1]] == [
        labels(g) for g in work.gemm_epilogues if label in labels(g)]
