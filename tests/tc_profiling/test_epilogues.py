"""The bias epilogue's rows: every layout assignment, executed as cuBLASLt addresses memory, computes qkv_proj
followed by qkv_bias (float64, small prime sizes)."""
import collections

import torch

from substation.graph import layer_graph
from substation.sizes import Size, get_size
from substation.tc_profiling.epilogues import IMPL, SPLITS, broadcast, enumerate_epilogues
from tests.tc_profiling.test_mapping import SMALL, run_call

GRAPH = layer_graph()


def run_with_bias(epilogue, values, out_numel):
    """The call, then cuBLASLt's BIAS epilogue: row r of batch i gets bias[i·bias_batch_stride + r]."""
    call = epilogue.call
    out = run_call(epilogue.mapping, values, out_numel)
    view = torch.as_strided(out, (call.batch, call.m, call.n), (call.stride_c, 1, call.ldc))
    bias = values[epilogue.split.bias].flatten()
    view += torch.as_strided(bias, (call.batch, call.m, 1), (epilogue.bias_batch_stride, 1, 0))
    return out


def test_every_epilogue_computes_the_contraction_and_the_split():
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for split, layouts, epilogue in enumerate_epilogues(SMALL):
        if isinstance(epilogue, str):
            assert epilogue
            continue
        op = GRAPH.operator(split.contraction)
        (a, b), (c,) = op.inputs, op.outputs
        values = {t: torch.randn([SMALL[d] for d in layouts[t]], generator=gen, dtype=torch.float64) for t in (a, b)}
        values[split.bias] = torch.randn([SMALL[d] for d in epilogue.bias_layout], generator=gen, dtype=torch.float64)
        want = (torch.einsum(f"{layouts[a]},{layouts[b]}->{layouts[c]}", values[a], values[b])
                + broadcast(values[split.bias], epilogue.bias_layout, layouts[c]))
        got = run_with_bias(epilogue, values, want.numel()).view(want.shape)
        for index, (name, layout) in enumerate(epilogue.slices):
            assert sorted(layout) == sorted(GRAPH.tensors[name].dims)
            torch.testing.assert_close(got[index], want[index], msg=lambda m: f"{epilogue.mapping} {name}: {m}")
            assert got[index].is_contiguous()
        checked += 1
    assert checked > 0


def test_epilogue_rows_at_bert_large():
    """Results `t` + (bj or jb) + (hp or ph), each with the Wqkv and X layouts one call reads: 32 rows, 8 calls;
    every other assignment says why not."""
    found = collections.Counter()
    calls = set()
    for _, _, epilogue in enumerate_epilogues(get_size("bert-large-b8-l512").extents):
        found[isinstance(epilogue, str)] += 1
        if not isinstance(epilogue, str):
            calls.add((epilogue.call, epilogue.bias_batch_stride))
            assert epilogue.result_layout[0] == "t" and epilogue.bias_layout in ("thp", "tph")
    assert found == {False: 32, True: 6 * 24 * 24 - 32} and len(calls) == 8


def test_epilogue_candidates_cover_both_operators():
    split = SPLITS[0]
    epilogue = next(e for _, _, e in enumerate_epilogues(Size.from_heads(B=2, L=3, H=5, P=7, U=11).extents)
                    if not isinstance(e, str))
    cand = epilogue.candidate({"algo": 0})
    assert cand.impl == IMPL and cand.covers == (split.contraction, split.operator)
    assert {n for n, _ in cand.inputs} == {"X", "Wqkv", "bqkv"} and {n for n, _ in cand.outputs} == {"Q", "K", "V"}


def test_the_cli_lists_the_epilogue_covers_and_why_the_others_are_none(capsys):
    from substation.cli import main

    assert main(["mappings", "--size", "bert-large-b8-l512", "--epilogues"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 32 and all(line.startswith("qkv_proj+qkv_bias,") for line in lines[1:])
    assert '"bias_batch_stride": 1024' in lines[1].replace('""', '"')
    assert main(["mappings", "--size", "bert-large-b8-l512", "--epilogues", "--infeasible"]) == 0
    reasons = capsys.readouterr().out.splitlines()[1:]
    assert len(reasons) == 6 * 24 * 24 - 32 and all(line.count(',') >= 2 for line in reasons)
    assert any("are not adjacent in" in line for line in reasons)
