"""Every enumerated GEMM mapping, executed as the call would read memory, computes its contraction."""
import collections

import pytest
import torch

from substation.graph import layer_graph
from substation.sizes import Size, get_size
from substation.tc_profiling.mapping import enumerate_mappings, letter_groups, map_contraction

GRAPH = layer_graph()
DIMS = {name: spec.dims for name, spec in GRAPH.tensors.items()}
CONTRACTIONS = [op for op in GRAPH.operators if op.is_contraction]
# Distinct primes, so a wrong stride or extent cannot coincide with a right one.
SMALL = Size.from_heads(B=2, L=3, H=5, P=7, U=11).extents


def run_call(mapping, values: dict, out_numel: int) -> torch.Tensor:
    """Execute the call through as_strided views of flat buffers, exactly as cuBLAS addresses memory."""
    c = mapping.call
    a_buf, b_buf = values[mapping.a_operand].flatten(), values[mapping.b_operand].flatten()
    a = torch.as_strided(a_buf, (c.batch, c.m, c.k), (c.stride_a, c.lda, 1) if c.transa else (c.stride_a, 1, c.lda))
    b = torch.as_strided(b_buf, (c.batch, c.k, c.n), (c.stride_b, c.ldb, 1) if c.transb else (c.stride_b, 1, c.ldb))
    out = torch.full((out_numel,), float("nan"), dtype=torch.float64)
    torch.as_strided(out, (c.batch, c.m, c.n), (c.stride_c, 1, c.ldc)).copy_(a @ b)
    return out


@pytest.mark.parametrize("op", CONTRACTIONS, ids=lambda op: op.name)
def test_every_mapping_computes_its_contraction(op):
    gen = torch.Generator().manual_seed(0)
    feasible = 0
    for mapping in enumerate_mappings(op, SMALL, DIMS):
        if mapping.call is None:
            assert mapping.reason
            continue
        feasible += 1
        layouts = dict(mapping.layouts)
        values = {t: torch.randn([SMALL[d] for d in layouts[t]], generator=gen, dtype=torch.float64)
                  for t in op.inputs}
        (a, b), (c,) = op.inputs, op.outputs
        want = torch.einsum(f"{layouts[a]},{layouts[b]}->{layouts[c]}", values[a], values[b])
        got = run_call(mapping, values, want.numel()).view(want.shape)  # NaN where the call wrote nothing
        torch.testing.assert_close(got, want, msg=lambda m: f"{mapping}: {m}")
    assert feasible > 0


def test_mapping_counts_at_bert_large():
    ext = get_size("bert-large-b8-l512").extents
    counts = {op.name: collections.Counter(m.call is not None for m in enumerate_mappings(op, ext, DIMS))
              for op in CONTRACTIONS}
    assert counts["ffn_in"] == {True: 16, False: 56}
    assert counts["qkv_proj"][True] + counts["qkv_proj"][False] == 6 * 24 * 120
    assert sum(c[True] for c in counts.values()) == 1248


def test_pytorch_default_layouts_map_to_plain_gemms():
    ext = get_size("bert-large-b8-l512").extents
    ffn_in = GRAPH.operator("ffn_in")
    mapping = map_contraction(ffn_in, DIMS, ext)  # F = X1 · W1ᵀ, as torch.nn.Linear does it
    call = mapping.call
    assert (mapping.a_operand, call.transa, call.transb) == ("W1", True, False)
    assert (call.m, call.n, call.k, call.batch) == (4096, 4096, 1024, 1)
    scores = map_contraction(GRAPH.operator("attn_scores"), DIMS, ext).call
    assert (scores.batch, scores.m, scores.n, scores.k) == (8 * 16, 512, 512, 64)


def test_infeasible_layouts_say_why():
    ext = get_size("bert-large-b8-l512").extents
    op = GRAPH.operator("attn_scores")
    split_batch = map_contraction(op, {"Q": "bjhp", "K": "bhkp", "S": "bhjk"}, ext)
    assert split_batch.call is None and "BATCH letters 'bh' are not adjacent in Q:bjhp" in split_batch.reason
    batch_inner = map_contraction(op, {"Q": "jphb", "K": "kphb", "S": "jkhb"}, ext)
    assert "innermost letter 'b'" in batch_inner.reason
    reordered = map_contraction(op, {"Q": "bhjp", "K": "hbkp", "S": "bhjk"}, ext)
    assert "ordered 'bh' in one tensor but 'hb'" in reordered.reason


def test_letter_groups():
    assert letter_groups("bhjp,bhkp->bhjk") == {"batch": "bh", "m": "j", "n": "k", "k": "p"}
    assert letter_groups("bji,bju->iu") == {"batch": "", "m": "i", "n": "u", "k": "bj"}
