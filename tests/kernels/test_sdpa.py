"""PyTorch SDPA (flash, memory-efficient, cuDNN) as a candidate of the attention subgraph: rows on the CPU,
numerics, layouts, dropout and CUDA graphs on the GPU."""
import math
import random

import pytest
import torch

from substation.errors import InputError, LayoutError
from substation.kernels import sdpa
from substation.kernels.profiler import plan
from substation.layouts import logical, stored
from substation.records import ProfileRow, parse_label
from substation.sizes import Size, get_size

SIZE = get_size("bert-large-b8-l512")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- CPU: the candidates and their rows --------------------------------------------------------------------

def test_enumeration_rule():
    found = sdpa.candidates(SIZE, sdpa.BACKENDS)
    by_backend = {b: [a for a in found if a.backend == b] for b in sdpa.BACKENDS}
    gemm_q = ["bhjp", "hbjp", "jbhp", "jhbp"]
    assert sdpa.profiled_layouts("Q", SIZE) == gemm_q
    for backend, atts in by_backend.items():
        # every (Q, K, V) combination of the 4 GEMM layouts each, plus Q, K, V sharing bjhp or hjbp (no GEMM
        # reads those, SDPA does); cuDNN writes Z like Q and must read dZ like Z, which out_proj's GEMMs cannot
        # write as hjbp: no cuDNN pair there
        assert len(sdpa.forward_candidates(atts)) == 64 + 2 - (backend == "cudnn")
        for att in atts:
            assert all(lay[-1] == "p" for lay in (att.q, att.k, att.v, att.z, att.dz))
            assert att.z == ("bjhp" if backend == "efficient" else att.q)
            assert backend != "cudnn" or att.dz == att.z, "cuDNN's backward is wrong for dZ laid out unlike Z"
        # dZ in Z's layout where a GEMM can read it, and (but for cuDNN) any other dZ layout where Q, K, V share one
        for att in atts:
            alike = att.k == att.v == att.q.replace("j", "k")
            assert att.dz == att.z or (alike and backend != "cudnn")
    assert sorted(sdpa.accepted_layouts("bhjp")) == sorted(["bhjp", "bjhp", "hbjp", "hjbp", "jbhp", "jhbp"])


def test_rows_have_the_synthetic_shape_and_labels_parse_back():
    att = sdpa.SdpaAttention("efficient", SIZE, "jbhp", "kbhp", "bhkp", "jhbp")
    fwd, bwd = att.forward_candidate(), att.backward_candidate()
    assert fwd.label == ('attn_scores/fwd sdpa_efficient{backend="efficient",mask=true} Q:jbhp K:kbhp V:bhkp M:bk '
                         '-> Z:bjhp')
    assert bwd.label == ('attn_context_dgrad_a/bwd sdpa_efficient{backend="efficient",mask=true} dZ:jhbp Q:jbhp '
                         'K:kbhp V:bhkp Z:bjhp M:bk -> dQ:bjhp dK:bkhp dV:bkhp')
    assert fwd.covers == sdpa.FORWARD_COVERS and bwd.covers == sdpa.BACKWARD_COVERS
    assert sdpa.SdpaAttention("cudnn", SIZE, "jbhp", "kbhp", "bhkp").backward_candidate().outputs == (
        ("dQ", "jbhp"), ("dK", "kbhp"), ("dV", "bhkp"))
    seen = sdpa.SdpaAttention("flash", SIZE, produced=(("dK", "bkhp"),))
    assert (seen.dq, seen.dk, seen.dv) == ("bhjp", "bkhp", "bhkp"), "observed layouts override the rules"
    flash = sdpa.SdpaAttention("flash", SIZE)
    assert "M" not in dict(flash.forward_candidate().inputs) and flash.options == {"backend": "flash", "mask": False}
    for att in sdpa.candidates(SIZE, sdpa.BACKENDS):
        for cand in (att.forward_candidate(), att.backward_candidate()):
            parsed = parse_label(cand.label)
            assert (parsed.op, parsed.pass_, parsed.impl, parsed.inputs, parsed.outputs, parsed.options) == (
                cand.op, cand.pass_, cand.impl, cand.inputs, cand.outputs, cand.options)
            row = ProfileRow.make(cand, SIZE, "NVIDIA H100 80GB HBM3 (sm_90)", {}, 25, 10.0, 9.0, dropout=0.1)
            assert row.candidate == cand


def test_infeasible_layouts_name_the_rule():
    with pytest.raises(LayoutError, match="Q layout 'bhpj' must be an order of 'bhjp' with p innermost"):
        sdpa.SdpaAttention("flash", SIZE, q="bhpj")
    with pytest.raises(LayoutError, match="dZ layout 'bjph' must be an order"):
        sdpa.SdpaAttention("cudnn", SIZE, dz="bjph")
    with pytest.raises(ValueError, match="backend='math'"):
        sdpa.SdpaAttention("math", SIZE)


def test_unmasked_backend_refuses_a_mask():
    size = Size.from_heads(B=1, L=8, H=1, P=8, U=8)
    att = sdpa.SdpaAttention("flash", size)
    x = torch.zeros(1, 1, 8, 8)
    with pytest.raises(InputError, match="takes no padding mask"):
        att.forward(x, x, x, torch.ones(1, 8), sdpa.op_args(size, 0.0))


def test_flash_attn_cute_rows_write_like_flash_and_name_no_mask():
    att = sdpa.SdpaAttention("fa4", SIZE, "jbhp", "kbhp", "kbhp", "bjhp")
    assert att.forward_candidate().label == ('attn_scores/fwd flash_attn_cute{backend="fa4",mask=false} Q:jbhp K:kbhp '
                                             'V:kbhp -> Z:jbhp')
    assert att.backward_candidate().label == ('attn_context_dgrad_a/bwd flash_attn_cute{backend="fa4",mask=false} '
                                              'dZ:bjhp Q:jbhp K:kbhp V:kbhp Z:jbhp -> dQ:jbhp dK:kbhp dV:kbhp')
    assert sdpa.backward_copies("fa4", att.z, att.dz) == 0


def test_flash_attn_cute_has_no_dropout(monkeypatch):
    size = Size.from_heads(B=1, L=8, H=1, P=8, U=8)
    x = torch.zeros(1, 1, 8, 8)
    with pytest.raises(InputError, match=r"flash_attn_cute \(flash-attn-4\) has no dropout: .* got 0.1"):
        sdpa.SdpaAttention("fa4", size).forward(x, x, x, None, sdpa.op_args(size, 0.1))
    for present in (True, False):
        monkeypatch.setattr(sdpa, "installed", lambda backend, present=present: present or backend != "fa4")
        assert sdpa.runs_at("fa4", 0.0) is present and not sdpa.runs_at("fa4", 0.1) and sdpa.runs_at("flash", 0.1)
        fa4_rows = [a for a in plan(SIZE, ["float16"], ops=["softmax"], dropout=0.0).attention if a.backend == "fa4"]
        assert len(fa4_rows) == (len(sdpa.candidates(SIZE, ["fa4"])) if present else 0)
        assert not [a for a in plan(SIZE, ["float16"], ops=["softmax"]).attention if a.backend == "fa4"]


def _fake_flash_attn_cute(monkeypatch):
    """A stand-in for flash-attn-4's functional interface (`flash_attn.cute.interface`), as documented: [B, L, H, P]
    operands of any strides, results written into the `out`/`lse` and `dq`/`dk`/`dv` it is given, computed here
    with torch on the CPU, so that our plumbing (views, layouts, buffers) is checked without a GPU."""
    import sys
    import types

    def attention(q, k, v, scale):
        scores = torch.einsum("bjhp,bkhp->bhjk", q, k) * scale
        return torch.einsum("bhjk,bkhp->bjhp", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)

    def forward(q, k, v, softmax_scale=None, return_lse=False, out=None, lse=None):
        assert q.shape == out.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and return_lse
        z, logsumexp = attention(q, k, v, softmax_scale)
        out.copy_(z)
        lse.copy_(logsumexp)
        return out, lse, None, None, None

    def backward(q, k, v, out, dout, lse, softmax_scale, causal, deterministic=False, dq=None, dk=None, dv=None):
        assert not causal and deterministic and torch.allclose(attention(q, k, v, softmax_scale)[0], out)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        grads = torch.autograd.grad(attention(*leaves, softmax_scale)[0], leaves, dout)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad)
        return dq, dk, dv

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = forward, backward
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)


@pytest.mark.parametrize("q, k, v, dz", [("bhjp", "bhkp", "bhkp", "bhjp"), ("jbhp", "kbhp", "hbkp", "bjhp")])
def test_flash_attn4_plumbing_writes_our_layouts(monkeypatch, q, k, v, dz):
    _fake_flash_attn_cute(monkeypatch)
    size = Size.from_heads(B=2, L=7, H=3, P=8, U=8)
    att = sdpa.SdpaAttention("fa4", size, q, k, v, dz)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 3, 7, 8, generator=gen, dtype=torch.float64) for _ in range(4)]  # [B, H, L, P]
    Q, K, V, dZ = (stored(x, dims, layout) for x, dims, layout in
                   zip(inputs, ("bhjp", "bhkp", "bhkp", "bhjp"), (q, k, v, dz)))
    args = sdpa.op_args(size, 0.0)
    Z, state = att.forward(Q, K, V, None, args)
    dQ, dK, dV = att.backward(dZ, Q, K, V, Z, None, state, args)
    want = sdpa.reference(*inputs[:3], None, inputs[3], args.scale)
    for got, layout, dims, expected in zip((Z, dQ, dK, dV), (att.z, att.dq, att.dk, att.dv),
                                           ("bhjp", "bhjp", "bhkp", "bhkp"), want):
        assert got.is_contiguous() and tuple(got.shape) == tuple(size.extents[d] for d in layout)
        torch.testing.assert_close(got.permute(*(layout.index(d) for d in dims)), expected)


def test_kernel_plan_includes_sdpa_unless_filtered():
    work = plan(SIZE, ["float16"], max_combos=2)
    assert len(work.attention) == len(sdpa.candidates(SIZE, sdpa.SDPA_BACKENDS))
    assert plan(SIZE, ["float16"], ops=["ln1"], max_combos=2).attention == ()
    assert plan(SIZE, ["float16"], ops=["softmax"], max_combos=2).attention


# -- GPU ---------------------------------------------------------------------------------------------------

SMALL = [Size.from_heads(B=2, L=77, H=3, P=64, U=64), Size.from_heads(B=3, L=40, H=2, P=64, U=64)]
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def backends():
    return sdpa.available_backends() if torch.cuda.is_available() else []


def _layout_draws(backend, count, seed):
    rng = random.Random(seed)
    qs, ks = sdpa.accepted_layouts("bhjp"), sdpa.accepted_layouts("bhkp")
    draws = [("bhjp", "bhkp", "bhkp"), ("bjhp", "bkhp", "bkhp")]
    draws += [(rng.choice(qs), rng.choice(ks), rng.choice(ks)) for _ in range(count)]
    out = []
    for q, k, v in draws:
        z = sdpa.z_layout(backend, q)
        out.append((q, k, v, z if backend == "cudnn" or rng.random() < 0.3 else rng.choice(qs)))
    return out


@pytest.mark.gpu
@needs_gpu
def test_gpu_offers_backends(backends):
    assert "efficient" in backends, f"the memory-efficient backend runs on every CUDA GPU; found {backends}"
    if torch.cuda.get_device_capability() >= (8, 0):
        assert "flash" in backends


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("size", SMALL, ids=lambda s: f"L{s.L}")
def test_forward_backward_vs_float64(backends, size, dtype):
    """Every backend, every layout drawn (GEMM-readable or not), dropout off: Z, dQ, dK, dV within 1e-2 (fp16)
    of the float64 reference, in the layouts the rows name (forward/backward raise otherwise)."""
    size = size.with_dtype(dtype)
    data = sdpa.AttentionData.make(size, seed=size.L, reference_dtype="float64")
    for backend in backends:
        for q, k, v, dz in _layout_draws(backend, 4, seed=size.L):
            att = sdpa.SdpaAttention(backend, size, q, k, v, dz)
            t = data.inputs(att)
            args = sdpa.op_args(size, 0.0)
            Z, state = att.forward(t["Q"], t["K"], t["V"], t["M"], args)
            grads = att.backward(t["dZ"], t["Q"], t["K"], t["V"], Z, t["M"], state, args)
            errors = data.errors(att, Z, grads)
            assert max(errors.values()) <= TOLERANCE[dtype], (att.label, errors)


def _kernel_names(work):
    from torch.profiler import ProfilerActivity, profile

    work()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.gpu
@needs_gpu
def test_no_hidden_copies(backends):
    """No copy kernel, except flash's and memory-efficient's copies of Z and dZ into [B, L, H, P] order
    (`sdpa.backward_copies`: timed with the backward row)."""
    size = SMALL[0].with_dtype("float16")
    data = sdpa.AttentionData.make(size)
    for backend in backends:
        for att in sdpa.candidates(size, [backend])[::3]:
            _, _, forward, backward = sdpa.runners(att, data, 0.1)
            copies = [n for n in _kernel_names(forward) + _kernel_names(backward) if "copy" in n.lower()]
            assert len(copies) == sdpa.backward_copies(backend, att.z, att.dz), (att.label, copies)


def _identity_values(size, dtype):
    """V with V[b, h, k, :] = e_k (L <= P): Z = A·V is then the dropped-out attention matrix A itself."""
    v = torch.zeros(size.B, size.H, size.L, size.P, dtype=dtype, device="cuda")
    v[..., torch.arange(size.L), torch.arange(size.L)] = 1
    return v


def _reference_with_mask(q, k, v, m, dz, keep, p, scale):
    """float64 attention with a given dropout keep mask [B, H, L, L]: Z and the gradients."""
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(m[:, None, None, :] == 0, -math.inf)
    a = torch.softmax(logits, -1) * keep / (1 - p)
    z = a @ v
    return (z.detach(), *torch.autograd.grad(z, (q, k, v), dz.double()))


def _check_dropout_pass(att, data, v, Z, grads, p):
    """Extract the mask from Z (V = identity), check the drop rate and that the backward used the same mask."""
    size = att.size
    a = logical(Z, att.z, sdpa.LOGICAL).double()[..., :size.L]
    m = data.m if att.masked else torch.ones_like(data.m)
    keys = (m[:, None, None, :] != 0).expand_as(a)
    keep = (a != 0).double()
    n = int(keys.sum())
    rate = 1 - float(keep[keys].sum()) / n
    # Not the binomial interval of independent draws: a backend may decide several elements from one random
    # number (cuDNN measured 0.114 at p=0.1, n=7680, 4 such sigmas off). A fifth of p still catches a wrong
    # probability (none, or 1 - p).
    assert abs(rate - p) <= 0.2 * p, (att.label, rate)
    want = _reference_with_mask(data.q, data.k, v, m, data.dz, keep, p, sdpa.scale_of(size))
    got = [Z, *grads]
    for name, x, layout, dims, w in zip(("Z", "dQ", "dK", "dV"), got, (att.z, att.dq, att.dk, att.dv),
                                        ("bhjp", "bhjp", "bhkp", "bhkp"), want):
        from substation.accuracy import relative_error

        err = relative_error(logical(x, layout, dims), w)
        assert err <= 1e-2, (att.label, name, err)
    return keep


@pytest.mark.gpu
@needs_gpu
def test_dropout_masks_agree_between_forward_and_backward(backends):
    """With dropout on, the backward uses the forward's mask (same state): checked against float64 math with the
    mask read back from Z; the drop rate is in its 99 % interval; a second forward draws another mask."""
    size, p = SMALL[1].with_dtype("float16"), 0.1
    data = sdpa.AttentionData.make(size, seed=7, reference_dtype="float64")
    v = _identity_values(size, torch.float16)
    args = sdpa.op_args(size, p)
    for backend in backends:
        att = sdpa.SdpaAttention(backend, size, "jbhp", "kbhp", "bkhp")
        t = data.inputs(att)
        V = stored(v, "bhkp", att.v)
        masks = []
        for _ in range(2):
            Z, state = att.forward(t["Q"], t["K"], V, t["M"], args)
            grads = att.backward(t["dZ"], t["Q"], t["K"], V, Z, t["M"], state, args)
            masks.append(_check_dropout_pass(att, data, v, Z, grads, p))
        assert not torch.equal(masks[0], masks[1]), f"{backend}: two forwards drew the same dropout mask"


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_capture_and_replay(backends):
    """Forward + backward captured in one CUDA graph: without dropout a replay equals the eager run bit for bit;
    with dropout every replay draws a fresh mask on which forward and backward agree."""
    size = SMALL[1].with_dtype("float16")
    data = sdpa.AttentionData.make(size, seed=3, reference_dtype="float64")
    v = _identity_values(size, torch.float16)
    for backend in backends:
        att = sdpa.SdpaAttention(backend, size, "bhjp", "bhkp", "kbhp")
        t = data.inputs(att)
        V = stored(v, "bhkp", att.v)
        for p in (0.0, 0.1):
            args = sdpa.op_args(size, p)

            def step():
                Z, state = att.forward(t["Q"], t["K"], V, t["M"], args)
                return (Z, *att.backward(t["dZ"], t["Q"], t["K"], V, Z, t["M"], state, args))

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                eager = [x.clone() for x in step()]
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = step()
            masks = []
            for _ in range(2):
                graph.replay()
                torch.cuda.synchronize()
                if p == 0:
                    assert all(torch.equal(a, b) for a, b in zip(outs, eager)), backend
                else:
                    masks.append(_check_dropout_pass(att, data, v, outs[0], outs[1:], p))
            if p:
                assert not torch.equal(masks[0], masks[1]), f"{backend}: replays drew the same mask"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not sdpa.installed("fa4"), reason="needs flash-attn-4")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_attn_cute_vs_float64_in_any_layouts(dtype):
    """FA4 (dropout 0) against the float64 reference, its outputs written into our buffers in the rows' layouts,
    at odd sizes; its deterministic backward gives the same gradients twice."""
    for size in SMALL:
        size = size.with_dtype(dtype)
        data = sdpa.AttentionData.make(size, reference_dtype="float64")
        for q, k, v, dz in (("bhjp", "bhkp", "bhkp", "bhjp"), ("jbhp", "kbhp", "hbkp", "bjhp")):
            att = sdpa.SdpaAttention("fa4", size, q, k, v, dz)
            fwd_error, bwd_error, forward, backward = sdpa.runners(att, data, 0.0)
            assert fwd_error < TOLERANCE[dtype] and bwd_error < TOLERANCE[dtype], (size, q, k, v, dz)
            first, second = backward(), backward()
            assert all(torch.equal(a, b) for a, b in zip(first, second))

