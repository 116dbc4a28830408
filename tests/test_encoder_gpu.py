"""The compiled Encoder on the GPU against the float64 reference: forward, dX and every parameter gradient.

Tolerance, float16 and bfloat16 alike: relative error ‖got − want‖₂ / ‖want‖₂ ≤ 1e-2 for every tensor, as
docs/DESIGN.md states for the layer, and no element off by more than 3e-2 of its tensor's largest magnitude
(bfloat16 rounds Y alone by up to 4e-3 of it); dropout off, and dropout on with the same seed (the kernels
regenerate the reference's Philox masks bit for bit).
"""
import copy
import dataclasses
import functools
import json
import warnings
from pathlib import Path

import pytest
import torch

from substation import Encoder, Size
from substation.errors import InputError
from substation.layouts import Configuration
from substation.protocol import COMPILED_DTYPES
from substation.stack import EncoderStack
from substation.accuracy import norm_relative_error

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = [pytest.mark.gpu, needs_gpu]
LAYOUTS = Path(__file__).parents[1] / "layouts"
SHIPPED = sorted(LAYOUTS.glob("h[0-9]00-bert-*.pickle"))  # the H100 and H200 configurations
DEFAULT = LAYOUTS / "h100-bert-large-b8-l512.pickle"  # the shipped configuration with a padding mask, at B8/L512
NONDET = LAYOUTS / "h100-bert-large-b8-l512-nondet.pickle"  # the same with dQ added up by float atomics
CUDNN_B8 = LAYOUTS / "h100-bert-large-b8-l512-cudnn.pickle"  # its predecessor: cuDNN's attention, whose backward adds
# with atomics
ODD = Size.from_heads(B=3, L=77, H=12, P=64, U=3072)
TOLERANCE = 1e-2  # norm-wise
KEY_BIAS, QUERY_BIAS = "attention.self.key.bias", "attention.self.query.bias"
ELEMENT_TOLERANCE = 3e-2  # max |got − want| / max |want|


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Random weights (BERT-like scale), biases and LayerNorm parameters: never zeros, never ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            value = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(value * 0.02 if p.dim() > 1 else value * 0.3 + 0.5)


def step(encoder: Encoder, x: torch.Tensor, mask: torch.Tensor | None, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().to(encoder.dtype).requires_grad_()
    encoder.zero_grad(set_to_none=True)
    y = encoder(x, mask)
    y.backward(dy.to(y.dtype))
    return {"Y": y.detach(), "dX": x.grad} | encoder.grad_state_dict()


def compare(encoder: Encoder, seed: int = 0, masked: bool = True, train: bool = False,
            shape: tuple[int, int] | None = None, lengths: list[int] | None = None) -> dict[str, tuple[float, float]]:
    """Errors of every output of one step (inputs of `shape` (B, L), default the Encoder's size) vs the float64
    reference Encoder with the same weights. The mask keeps random keys (and key 0), or with `lengths` the first
    lengths[b] keys of sequence b, as padding does."""
    size = dataclasses.replace(encoder.size, **dict(zip("BL", shape))) if shape else encoder.size
    encoder.manual_seed(encoder.seed)  # both draw the dropout masks of offset 0
    reference = Encoder(size, dtype=torch.float64, device="cuda", attention_dropout=encoder.attention_dropout,
                        hidden_dropout=encoder.hidden_dropout, seed=encoder.seed)
    randomize_(reference, seed)
    encoder.load_state_dict(reference.state_dict())
    encoder.train(train), reference.train(train)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=torch.float64)
    dy = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=torch.float64)
    mask = None
    if lengths is not None:
        mask = (torch.arange(size.L, device="cuda") < torch.tensor(lengths, device="cuda")[:, None]).double()
    elif masked:
        mask = (torch.rand(size.B, size.L, device="cuda", generator=gen) > 0.25).double()
        mask[:, 0] = 1
    want, got = step(reference, x, mask, dy), step(encoder, x, mask, dy)
    return errors(got, want)


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """(norm-wise, max-wise) relative error of every tensor. The key bias's gradient is 0 in exact arithmetic
    (softmax ignores a constant added to every score of a query): its rounding is measured against the query
    bias's gradient instead of against ~0."""
    found = {}
    for name in want:
        diff, scale = got[name].double() - want[name].double(), want[QUERY_BIAS if name == KEY_BIAS else name].double()
        found[name] = ((diff.norm() / scale.norm()).item(), (diff.abs().max() / scale.abs().max()).item())
    return found


def assert_close(errors: dict[str, tuple[float, float]]) -> None:
    bad = {k: f"{norm:.2e} (norm), {peak:.2e} (max)" for k, (norm, peak) in errors.items()
           if not (norm <= TOLERANCE and peak <= ELEMENT_TOLERANCE)}
    assert not bad, f"relative error above {TOLERANCE} (norm) or {ELEMENT_TOLERANCE} (max): {bad}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("train", [False, True], ids=["no_dropout", "dropout"])
def test_shipped_configuration_matches_reference(path, train):
    encoder = Encoder.from_layouts(path, dtype=torch.float16).cuda()
    plan = encoder.plan(encoder.size.B, encoder.size.L, torch.device("cuda"))
    assert plan.compiled
    if any(step.choice.impl.startswith("sdpa_") for step in plan.steps):
        encoder.attention_dropout = 0.0  # SDPA draws its masks from PyTorch's generator, not the reference's
    assert_close(compare(encoder, seed=1, train=train, masked=plan.takes_mask))


def test_a_nondeterministic_configuration_obeys_torchs_determinism_setting():
    """The shipped configuration made with --nondeterministic (our attention backward adding dQ by float atomics)
    (matching the reference: see above) raises in its backward under torch.use_deterministic_algorithms(True), as
    PyTorch's own ops without a deterministic implementation do."""
    encoder = Encoder.from_layouts(LAYOUTS / "h100-bert-large-b8-l512-nondet.pickle", dtype=torch.float16).cuda()
    x = torch.randn(encoder.size.B, encoder.size.L, encoder.size.I, device="cuda", dtype=torch.float16)
    y = encoder(x.requires_grad_())
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match=r"\(attention fuse_dq=4\) is not deterministic"):
            y.backward(torch.randn_like(y))
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sdpa_backends_run_the_attention(dtype):
    """Each SDPA backend the GPU offers (and flash-attn-4 where installed), as the chosen implementation of both
    attention subgraphs, in a configuration whose Q, K, V, Z and gradients are laid out as every backend reads and
    writes them."""
    from substation.kernels.sdpa import BACKWARD_COVERS, FORWARD_COVERS, IMPLS, MASKED, available_backends, installed
    from substation.protocol import Choice
    from substation.runtime import default_choices

    size = dataclasses.replace(ODD, H=4, I=256, U=512)
    layouts = dict(Configuration.default().layouts)
    layouts.update(Q="bjhp", K="bkhp", V="bkhp", dQ="bjhp", dK="bkhp", dV="bkhp", Z="bjhp", dZ="bjhp")
    config = Configuration(layouts)
    for backend in available_backends(COMPILED_DTYPES[dtype]) + (["fa4"] if installed("fa4") else []):
        choices = default_choices(config, size.with_dtype(COMPILED_DTYPES[dtype]))
        options = {"backend": backend, "mask": MASKED[backend]}
        for covers in (FORWARD_COVERS, BACKWARD_COVERS):
            choices |= {op: Choice(covers, IMPLS[backend], options) for op in covers}
        encoder = Encoder(size, dtype=dtype, device="cuda", config=config, choices=choices, attention_dropout=0.0)
        errors = compare(encoder, seed=4, masked=MASKED[backend], train=True)
        assert_close(errors)


# Our fused attention (impl `attention`): layouts (one the profiler times, the canonical ones, one with p nowhere
# innermost) and the knobs of both rows.
FUSED_ATTENTION = [
    (dict(Q="jbhp", K="kbhp", V="kbhp", Z="jbhp", dZ="jbhp", dQ="jbhp", dK="kbhp", dV="kbhp"),
     {"block_m": 64, "block_n": 64}, {"block_m": 64, "block_n": 64, "fuse_dq": 0}),
    (dict(Q="bhjp", K="bhkp", V="bhkp", Z="bjhp", dZ="bjhp", dQ="bhjp", dK="bhkp", dV="bhkp"),
     {"block_m": 128, "block_n": 32}, {"block_m": 128, "block_n": 32, "fuse_dq": 1}),
    (dict(Q="bhpj", K="pbhk", V="khbp", Z="hpbj", dZ="bjhp", dQ="jbhp", dK="bhkp", dV="kbph"),
     {"block_m": 64, "block_n": 32}, {"block_m": 64, "block_n": 64, "fuse_dq": 1}),
    # The stacked backward (covering qkv_bias_bwd too: dQ, dK, dV written into dQKV, dbqkv from it).
    (dict(Q="bjhp", K="bkhp", V="bkhp", Z="bjhp", dZ="bjhp", dQKV="jbthp"),
     {"block_m": 64, "block_n": 64}, {"block_m": 64, "block_n": 32, "fuse_dq": 1}),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(FUSED_ATTENTION)))
@pytest.mark.parametrize("shape", [None, (2, 50)], ids=["tuned", "other_shape"])
def test_fused_attention_runs_the_attention(dtype, case, shape):
    """Our attention kernels as the chosen implementation of both attention subgraphs (the last case's backward
    the stacked row, which also covers qkv_bias_bwd): forward and every gradient match the float64 reference
    Encoder with dropout on (the kernels draw the reference's Philox masks) and a padding mask, at the
    configuration's size and at another (its choices re-planned, `at_size`)."""
    from substation.kernels.attention import BWD_COVERS, COVERS, IMPL, STACKED_COVERS
    from substation.protocol import Choice
    from substation.runtime import default_choices

    layouts, forward, backward = FUSED_ATTENTION[case]
    size = dataclasses.replace(ODD, H=4, I=256, U=512)
    config = Configuration(dict(Configuration.default().layouts) | layouts)
    choices = default_choices(config, size.with_dtype(COMPILED_DTYPES[dtype]))
    for covers, options in ((COVERS, forward), (STACKED_COVERS if "dQKV" in layouts else BWD_COVERS, backward)):
        choices |= {op: Choice(covers, IMPL, options) for op in covers}
    encoder = Encoder(size, dtype=dtype, device="cuda", config=config, choices=choices, seed=11)
    plan = encoder.plan(*(shape or (size.B, size.L)), torch.device("cuda"))
    assert {step.choice.impl for step in plan.steps if set(step.choice.covers) & set(COVERS + BWD_COVERS)} == {IMPL}
    assert plan.takes_mask and "attention_kernel_lse" in plan.saved
    assert_close(compare(encoder, seed=case, masked=True, train=True, shape=shape))


def epilogue_plan():
    """A configuration running ffn_in + bias_gelu and ffn_out_dgrad + bias_gelu_bwd as GEMMs with our epilogues
    (each cover's first candidate), its size, the same choices with the backward's bias gradient as a kernel of
    its own (that cover's first such candidate), the slope pair's (`cutlass_gelu_slope`), and all those kernels
    for both dtypes."""
    from substation.graph import layer_graph
    from substation.implementations import registry
    from substation.kernels.gemm_epilogue import FUSIONS, IMPL, SLOPE_FUSIONS, GemmEpilogue, GemmGeluSlope, separate_of
    from substation.protocol import Choice

    graph, implementation, slope_pair = layer_graph(), GemmEpilogue(), GemmGeluSlope()
    size = Size.from_heads(B=2, L=64, H=4, P=64, U=512)
    config = Configuration(dict(Configuration.default().layouts) | dict(F="ubj", H1="ubj", dF="ubj"))
    choices, apart = {}, {}
    for fusion in FUSIONS:
        ops = [graph.operator(name) for name in fusion.covers]
        first = implementation.first_candidate(ops, size, implementation.cover_layouts(ops, config))
        choices |= {op.name: Choice(fusion.covers, IMPL, first.options_dict) for op in ops}
        if fusion.separate:
            row = next(c for c in implementation.candidates(ops, size, implementation.cover_layouts(ops, config))
                       if separate_of(c.options_dict))
            apart |= {op.name: Choice(fusion.covers, IMPL, row.options_dict) for op in ops}
    apart = choices | apart
    slope = {}
    for fusion in SLOPE_FUSIONS:
        ops = [graph.operator(name) for name in fusion.covers]
        first = slope_pair.first_candidate(ops, size, slope_pair.cover_layouts(ops, config))
        slope |= {op.name: Choice(fusion.covers, slope_pair.impl, first.options_dict) for op in ops}
    kernels = [kernel for chosen in (choices, apart, slope) for c in {c.covers: c for c in chosen.values()}.values()
               for dtype in ("float16", "bfloat16")
               for kernel in registry(graph).find(c.impl, c.covers).builds([graph.operator(n) for n in c.covers], c,
                                                                           config, size.with_dtype(dtype))]
    return size, config, {"epilogue": choices, "kernel": apart, "slope": slope}, set(kernels)


def gpu_builds() -> set:
    """The kernels `epilogue_choices` builds (`scripts/build_gpu_test_kernels.py` builds them ahead, without a
    GPU)."""
    return epilogue_plan()[3]


@pytest.fixture(scope="module")
def epilogue_choices():
    """`epilogue_plan`'s configuration, size and choices, its kernels built in parallel (one nvcc per core)."""
    from concurrent.futures import ThreadPoolExecutor

    size, config, chosen, kernels = epilogue_plan()
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda kernel: kernel.compile(), kernels))
    return size, config, chosen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [None, (2, 50)], ids=["tuned", "unaligned"])
@pytest.mark.parametrize("bias_grad", ["epilogue", "kernel", "slope"])
def test_gemm_epilogues_run_the_ffn(epilogue_choices, dtype, shape, bias_grad):
    """The GEMMs with our epilogues as the chosen implementation of both FFN covers, db1 summed in the epilogue or
    by the bias-gradient kernel, or the slope pair (the forward stores GELU'(F + b1) for the backward): forward and
    every gradient match the float64 reference Encoder (dropout on, padding mask); at 100 tokens, which TMA cannot
    stride, the Encoder runs the operators one by one instead, and says so."""
    from substation.runtime import default_choices

    size, config, fused = epilogue_choices
    fused = fused[bias_grad]
    choices = default_choices(config, size.with_dtype(COMPILED_DTYPES[dtype])) | fused
    encoder = Encoder(size, dtype=dtype, device="cuda", config=config, choices=choices, seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = encoder.plan(*(shape or (size.B, size.L)), torch.device("cuda"))
    impls = {step.choice.impl for step in plan.steps if "bias_gelu" in step.choice.covers}
    assert impls == ({"cutlass_gelu_slope" if bias_grad == "slope" else "cutlass_epilogue"} if shape is None
                     else {"kernel"})
    assert (shape is not None) == any("16-byte" in str(w.message) for w in caught)
    assert_close(compare(encoder, seed=3, masked=True, train=True, shape=shape))


def plan_with(row, config: Configuration, dtype: torch.dtype, cuda_graphs: bool):
    """An Encoder at a small odd size that runs profile row `row` for its cover (the default choices elsewhere),
    compared with the float64 reference Encoder (dropout on, padding mask; float32 weights under autocast fp16): its
    plan, the row's step in it checked to be one."""
    from substation.protocol import Choice
    from substation.runtime import default_choices

    size = dataclasses.replace(ODD, H=4, I=256, U=512)
    compute = torch.float16 if dtype == torch.float32 else dtype
    choices = default_choices(config, size.with_dtype(COMPILED_DTYPES[compute])) | {
        name: Choice(row.covers, row.impl, row.options_dict) for name in row.covers}
    encoder = Encoder(size, dtype=dtype, device="cuda", config=config, choices=choices, seed=7, cuda_graphs=cuda_graphs)
    with torch.autocast("cuda", dtype=torch.float16, enabled=dtype == torch.float32):
        assert_close(compare(encoder, seed=4, masked=True, train=True))
        plan = encoder.plan(size.B, size.L, torch.device("cuda"), compute)
    assert sum(step.choice.impl == row.impl for step in plan.steps) == 1
    return plan


def cover_rows(implementation, config: Configuration) -> list:
    """The implementation's rows for its cover in the configuration's layouts, at the size `plan_with` runs."""
    from substation.graph import layer_graph

    size = dataclasses.replace(ODD, H=4, I=256, U=512)
    (cover,) = implementation.covers(layer_graph())
    ops = [layer_graph().operator(name) for name in cover]
    return list(implementation.candidates(ops, size, implementation.cover_layouts(ops, config)))


AMP_DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                                     ids=["float16", "bfloat16", "autocast"])


@AMP_DTYPES
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("bias_grad", ["epilogue", "kernel"])
def test_the_sliced_qkv_backward_runs_in_the_encoder(dtype, cuda_graphs, bias_grad):
    """qkv_proj's backward straight from dQ, dK, dV (no dQKV, no residual_bwd) as the chosen implementation at an odd
    length, its bias gradient in cuBLASLt's epilogue or our kernel: forward and every gradient match the float64
    reference; under autocast the kernel variant writes dWqkv in float32 itself."""
    from substation.kernels.qkv_backward import SlicedQkvBackward

    config = Configuration(dict(Configuration.default().layouts) | dict(dQ="bjhp", dK="bkhp", dV="bkhp"))
    row = next(c for c in cover_rows(SlicedQkvBackward(), config) if c.options_dict["bias_grad"] == bias_grad)
    plan = plan_with(row, config, dtype, cuda_graphs)
    assert not {"qkv_bias_bwd", "residual_bwd"} & {step.name for step in plan.steps}
    sliced = next(step for step in plan.steps if step.choice.impl == row.impl)
    assert sliced.writes_into("dWqkv", torch.float32) == (bias_grad == "kernel")


@AMP_DTYPES
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphed"])
def test_the_residual_in_the_dgrad_call_runs_in_the_encoder(dtype, cuda_graphs):
    """qkv_proj_dgrad + residual_bwd as one cuBLASLt call (dR1 read as C) at an odd length: forward and every
    gradient match the float64 reference, and no residual_bwd step is left."""
    from substation.kernels.residual_dgrad import ResidualDgrad

    row = cover_rows(ResidualDgrad(), Configuration.default())[0]
    plan = plan_with(row, Configuration.default(), dtype, cuda_graphs)
    assert "residual_bwd" not in {step.name for step in plan.steps}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_configurations_at_an_odd_size(dtype, seed):
    config = Configuration.random(seed, split=("X1",) if seed == 2 else ())
    encoder = Encoder(ODD, dtype=dtype, device="cuda", config=config, seed=seed + 5)
    assert_close(compare(encoder, seed=seed, train=seed == 1))


def test_cuda_graph_replays_a_training_step():
    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float16).cuda().eval()
    randomize_(encoder, 3)
    size = encoder.size
    x = torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(x)
    eager = step(encoder, x.detach(), None, dy)
    for p in encoder.parameters():
        p.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA graphs require
        encoder(x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    for p in encoder.parameters():
        p.grad = None
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = encoder(x)
        y.backward(dy)
    graph.replay()
    torch.cuda.synchronize()
    replayed = {"Y": y, "dX": x.grad} | encoder.grad_state_dict()
    assert torch.equal(replayed.pop("Y"), eager["Y"])
    # The backward is bitwise reproducible only without SDPA: cuDNN's and flash's attention backward add
    # dQ's partial sums with atomics, in whatever order the blocks run.
    for name, value in replayed.items():
        assert norm_relative_error(value, eager[name]) <= 1e-3, name


def test_saved_activations_fit_in_pytorchs_budget():
    """What the forward keeps for the backward, vs what PyTorch's eager layer keeps (SDPA-free, manual
    attention, as HF's eager BertLayer): at most as many bytes."""
    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float16).cuda().train()
    size = encoder.size
    x = torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16, requires_grad=True)
    encoder(x)  # bind and warm up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = encoder(x)
    ours = torch.cuda.memory_allocated() - before
    del y
    linear = lambda n, m: torch.nn.Linear(n, m, device="cuda", dtype=torch.float16)  # noqa: E731
    qkv, out, ffn_in, ffn_out = linear(size.I, 3 * size.I), linear(size.I, size.I), linear(size.I, size.U), linear(size.U, size.I)
    ln1, ln2 = (torch.nn.LayerNorm(size.I, device="cuda", dtype=torch.float16) for _ in range(2))

    def pytorch_layer(x):
        q, k, v = qkv(x).view(size.B, size.L, 3, size.H, size.P).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.dropout((q @ k.transpose(-1, -2) / size.P ** 0.5).softmax(-1), 0.1)
        z = (a @ v).transpose(1, 2).reshape(size.B, size.L, size.I)
        x1 = ln1(torch.nn.functional.dropout(out(z), 0.1) + x)
        return ln2(torch.nn.functional.dropout(ffn_out(torch.nn.functional.gelu(ffn_in(x1))), 0.1) + x1)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = pytorch_layer(x)
    theirs = torch.cuda.memory_allocated() - before
    del y
    assert ours <= theirs, f"saved activations: {ours / 2**20:.1f} MiB vs PyTorch's {theirs / 2**20:.1f} MiB"


def test_input_checks_on_the_gpu():
    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float16).cuda()
    size = encoder.size
    with pytest.raises(Exception, match="x is on cpu"):
        encoder(torch.randn(size.B, size.L, size.I, dtype=torch.float16))
    with pytest.raises(TypeError, match="x.dtype=torch.float32"):
        encoder(torch.randn(size.B, size.L, size.I, device="cuda"))
    with pytest.raises(InputError, match=r"expected \[B, L, I\] with I=1024"):
        encoder(torch.randn(size.B, size.L, 768, device="cuda", dtype=torch.float16))
    with pytest.warns(UserWarning, match="tuned for B=8, L=512; B=2, L=512 runs"):  # another batch runs
        assert encoder(torch.randn(2, size.L, size.I, device="cuda", dtype=torch.float16)).shape == (2, size.L, size.I)


def test_graph_replays_draw_the_next_dropout_masks():
    """A captured training step reads (seed, offset) from device memory and advances it: replay r draws the
    masks of offset k + r - 1 (k: the eager steps before capture), as the reference does at that offset."""
    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float16).cuda().train()
    encoder.attention_dropout = 0.0  # SDPA's masks come from PyTorch's generator, not the reference's stream
    reference = Encoder(encoder.size, dtype=torch.float64, device="cuda", attention_dropout=0.0)
    randomize_(reference, 5)
    encoder.load_state_dict(reference.state_dict())
    size = encoder.size
    x = torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            encoder(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = encoder(x)
    outputs = []
    for _ in range(2):
        graph.replay()
        outputs.append(y.clone())
    torch.cuda.synchronize()
    assert not torch.equal(outputs[0], outputs[1])
    for replay, got in enumerate(outputs):
        reference.offset = 2 + replay
        with torch.no_grad():
            want = reference(x.double())
        assert norm_relative_error(got, want) <= TOLERANCE, f"replay {replay}"


def _twins(seed: int, **kwargs) -> tuple[Encoder, Encoder]:
    """The shipped B8/L512 configuration twice, with the same weights: eager, and with cuda_graphs=True."""
    eager = Encoder.from_layouts(DEFAULT, dtype=torch.float16, **kwargs).cuda()
    graphed = Encoder.from_layouts(DEFAULT, dtype=torch.float16, cuda_graphs=True, **kwargs).cuda()
    randomize_(eager, seed)
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


def _agree(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    # cuDNN's attention backward adds with atomics, so gradients (and, after an update, weights and outputs)
    # agree to rounding; a different dropout mask would be off by ~10 %.
    for name, (norm, _) in errors(got, want).items():
        assert norm <= 1e-3, name


@pytest.mark.parametrize("train", [False, True], ids=["eval", "dropout"])
def test_cuda_graphs_replay_what_eager_steps_compute(train):
    """Steps replayed from the Encoder's own graphs equal eager steps: outputs, dX, every gradient, the
    hidden-dropout masks of each step (the offset advances on the GPU), and an optimizer's in-place update."""
    eager, graphed = _twins(6, attention_dropout=0.0)  # SDPA's own dropout is PyTorch's generator's
    eager.train(train), graphed.train(train)
    size = eager.size
    gen = torch.Generator(device="cuda").manual_seed(6)
    for _ in range(3):
        x = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=torch.float16)
        dy = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=torch.float16)
        want, got = step(eager, x, None, dy), step(graphed, x, None, dy)
        _agree(got, want)
        with torch.no_grad():
            for a, b in zip(eager.parameters(), graphed.parameters()):
                a.sub_(1e-4 * a.grad)
                b.sub_(1e-4 * b.grad)
    assert len(graphed._graphs) == 1, "captured once, replayed after"


def test_cuda_graphs_fall_back_while_a_backward_is_pending():
    """Two forwards before one backward: the second cannot overwrite the first's saved tensors in the graph's
    pool, so it runs eagerly; the summed gradients equal the eager Encoder's."""
    eager, graphed = _twins(7)
    eager.eval(), graphed.eval()
    size = eager.size
    x1, x2 = (torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16) for _ in range(2))
    results = []
    for encoder in (eager, graphed):
        encoder.zero_grad(set_to_none=True)
        encoder(x1).float().square().mean().backward()  # captures and replays once
        encoder.zero_grad(set_to_none=True)
        loss = encoder(x1).float().square().mean() + encoder(x2).float().square().mean()
        loss.backward()
        results.append(encoder.grad_state_dict())
    for name in results[0]:
        assert norm_relative_error(results[1][name], results[0][name]) <= 1e-3, name


def test_cuda_graphs_encoder_refuses_an_outer_capture_until_switched_off():
    """Its warm-up steps replay its own graphs, so an outer capture would meet a cold eager path: a clear error;
    with cuda_graphs switched off the same module captures and replays what an eager step computes."""
    eager, graphed = _twins(8)
    eager.eval(), graphed.eval()
    size = eager.size
    x = torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        graphed(x)
        with pytest.raises(InputError, match="cuda_graphs"), torch.cuda.graph(torch.cuda.CUDAGraph()):
            graphed(x)
        graphed.cuda_graphs = False
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graphed(x)
        torch.cuda.current_stream().wait_stream(side)
        outer = torch.cuda.CUDAGraph()
        with torch.cuda.graph(outer):
            y = graphed(x)
        outer.replay()
        assert norm_relative_error(y, eager(x)) <= 1e-3


def test_a_checked_mask_costs_no_wait():
    """A mask's values are checked at its first step (one wait for the GPU); later training steps with the same
    mask wait for nothing (`set_sync_debug_mode("error")` raises on any synchronizing call)."""
    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float16).cuda().train()
    size = encoder.size
    x = torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16, requires_grad=True)
    mask = torch.ones(size.B, size.L, device="cuda", dtype=torch.float16)
    mask[1, -size.L // 8:] = 0
    encoder(x, mask).sum().backward()  # checks the mask; binds and warms up
    torch.cuda.set_sync_debug_mode("error")
    try:
        encoder(x, mask).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mask[1, 0] = 2  # edited in place: checked again
    with pytest.raises(InputError, match="only 0"):
        encoder(x, mask)


@pytest.mark.parametrize("path", [DEFAULT, NONDET], ids=lambda p: p.stem)
def test_padded_batches_split_the_attention_backward_and_match_the_reference(path):
    """padded_batches=True binds the shipped B8/L512 attention backward with split_queries; on a batch whose
    sequences end between 64 and 512 keys (a quarter of its key tiles padding only, so `_d` splits) with dropout,
    forward and every gradient match the float64 reference, eager and from CUDA graphs."""
    lengths = [512, 384, 130, 300, 64, 450, 256, 200]
    for cuda_graphs in (False, True):
        encoder = Encoder.from_layouts(path, dtype=torch.float16, padded_batches=True, cuda_graphs=cuda_graphs).cuda()
        plan = encoder.plan(encoder.size.B, encoder.size.L, torch.device("cuda"))
        split = [step for step in plan.steps if getattr(getattr(step, "params", None), "split_queries", 0)]
        assert [step.choice.covers[0] for step in split] == ["attn_context_dgrad_a"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the nondeterministic configuration's float atomics say so
            assert_close(compare(encoder, seed=4, train=True, lengths=lengths))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_configurations_run_shapes_they_were_not_tuned_for(path):
    """Another batch and length, an odd one included (the LayerNorm kernels' one-row variant: 77 leaves a
    remainder of every other), with dropout; a warning once per shape, not per step; plans kept for
    `max_shapes`; nothing falls back to PyTorch's ops."""
    encoder = Encoder.from_layouts(path, dtype=torch.float16, max_shapes=2).cuda()
    encoder.attention_dropout = 0.0  # SDPA draws its masks from PyTorch's generator, not the reference's
    # A configuration made with --no-padding-mask has an attention reading no M (its JSON twin says which).
    masked = "M" in json.loads(path.with_suffix(".json").read_text())["operators"]["attn_scores"]["layouts"]
    for shape in ((2, 77), (16, 384)):
        with pytest.warns(UserWarning, match=f"tuned for B={encoder.size.B}, L={encoder.size.L}; B={shape[0]}"):
            assert_close(compare(encoder, seed=2, masked=masked, train=True, shape=shape))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_close(compare(encoder, seed=3, masked=masked, train=True, shape=shape))
        assert not [w for w in caught if "tuned for" in str(w.message)]
    kinds = {step.choice.impl for step in encoder.plan(2, 77, torch.device("cuda"), torch.float16).steps}
    assert "torch" not in kinds, kinds
    encoder.plan(encoder.size.B, encoder.size.L, torch.device("cuda"))
    assert [key[2:] for key in encoder._plans] == [(2, 77), (encoder.size.B, encoder.size.L)]  # (16, 384) out


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphed"])
def test_autocast_trains_float32_weights_with_a_grad_scaler(cuda_graphs):
    """Float32 parameters under autocast fp16 run the compiled plan on the cached fp16 weights, as accurate as
    the fp16 Encoder; GradScaler steps; after an optimizer step the next forward reads the new weights (as a
    float16 Encoder loaded with them computes, to the bit)."""
    path = DEFAULT
    amp = Encoder.from_layouts(path, dtype=torch.float32, cuda_graphs=cuda_graphs).cuda().eval()
    with torch.autocast("cuda", dtype=torch.float16):
        errors_amp = compare(amp, seed=5)
    assert_close(errors_amp)
    assert all(p.grad.dtype == torch.float32 for p in amp.parameters())
    size = amp.size
    optimizer = torch.optim.SGD(amp.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(size.B, size.L, size.I, device="cuda")
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = amp(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    half = Encoder.from_layouts(path, dtype=torch.float16).cuda().eval()
    half.load_state_dict(amp.state_dict())
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        got = amp(x)
    with torch.no_grad():
        want = half(x.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cuda_graphs_capture_while_another_thread_calls_cuda():
    """A user's process has other threads making CUDA calls a global capture forbids (a DataLoader's pin-memory
    thread allocating pinned memory, DDP's NCCL watchdog querying events): the Encoder's own capture holds, and
    its replays compute what eager steps do."""
    import threading

    eager, graphed = _twins(9)
    eager.eval(), graphed.eval()
    size = eager.size
    stop, errors_seen = threading.Event(), []

    def busy() -> None:
        stream, count = torch.cuda.Stream(), 0
        try:
            while not stop.is_set():
                count += 1
                torch.empty(4096 + count, dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc: a new size each time
                event = torch.cuda.Event()
                event.record(stream)
                event.query()
        except Exception as err:  # noqa: BLE001  reported below
            errors_seen.append(err)

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        x = torch.randn(size.B, size.L, size.I, device="cuda", dtype=torch.float16)
        dy = torch.randn_like(x)
        for _ in range(2):  # captures, then replays
            _agree(step(graphed, x, None, dy), step(eager, x, None, dy))
    finally:
        stop.set()
        thread.join()
    assert not errors_seen, errors_seen


@pytest.mark.parametrize("path", [DEFAULT, CUDNN_B8], ids=["our-attention", "cudnn-attention"])
@pytest.mark.parametrize("amp", [False, True], ids=["float16", "autocast"])
def test_a_graphed_stack_replays_what_its_encoders_compute_in_turn(amp, path):
    """Three Encoders as one EncoderStack replayed from one pair of graphs, against the same three launched in turn:
    Y, dX and every gradient of three training steps (hidden dropout drawn on the GPU), an optimizer's update between
    them; float16, and float32 weights under autocast (cast and cast back inside the graphs). cuDNN's attention
    backward adds with atomics, and three layers of backward amplify that: the stack must agree with the eager
    Encoders as closely as a second eager run agrees with the first (a wrong mask or input is off by ~10 %). With our
    deterministic attention instead of cuDNN's the second run agrees exactly: the 1e-3 floor is what is left.
    Every stack takes the same update, from the eager gradients: under autocast the graphs' wgrad GEMMs write
    float32 gradients from their accumulators while the eager Encoders round them to float16 first (as autocast
    does for nn.Linear), and updates that differ by that rounding alone moved the stacks apart by 3e-3 in layer 0's
    dWqkv a step later (its query and key parts are small and ill-conditioned: 4e-2 from float64 either way)."""
    dtype = torch.float32 if amp else torch.float16
    eager = [Encoder.from_layouts(path, dtype=dtype, attention_dropout=0.0, seed=i).cuda() for i in range(3)]
    for index, encoder in enumerate(eager):
        randomize_(encoder, 20 + index)
    again, graphed = copy.deepcopy(eager), copy.deepcopy(eager)  # the same weights and dropout states
    for encoder in graphed:
        encoder.cuda_graphs = True
    stack = EncoderStack(graphed)
    size, gen = eager[0].size, torch.Generator(device="cuda").manual_seed(11)

    def in_turn(encoders):
        return functools.partial(functools.reduce, lambda y, encoder: encoder(y), encoders)

    for _ in range(3):
        x = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=dtype)
        dy = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=torch.float16)
        results = []
        for encoders, run in ((eager, in_turn(eager)), (again, in_turn(again)), (graphed, stack)):
            for encoder in encoders:
                encoder.zero_grad(set_to_none=True)
            h = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                y = run(h)
            y.backward(dy.to(y.dtype))
            results.append([y.detach(), h.grad] + [p.grad for encoder in encoders for p in encoder.parameters()])
        want, floor, got = results
        names = ["Y", "dX"] + [f"{i}.{name}.grad" for i, encoder in enumerate(eager)
                               for name, _ in encoder.named_parameters()]
        assert [g.dtype for g in got] == [w.dtype for w in want]
        errors = {name: (norm_relative_error(g, w), norm_relative_error(f, w))
                  for name, g, f, w in zip(names, got, floor, want)}
        wrong = {name: e for name, e in errors.items() if e[0] > max(1e-3, 4 * e[1])}
        assert not wrong, f"(graphed vs eager, second eager vs eager): {wrong}"
        with torch.no_grad():
            for twins in zip(*((p for encoder in encoders for p in encoder.parameters())
                               for encoders in (eager, again, graphed))):
                for p in twins:
                    p.sub_(1e-4 * twins[0].grad)
    assert len(stack._graphs) == 1, "captured once, replayed after"


@pytest.mark.parametrize("autocast", [None, torch.float16, torch.bfloat16], ids=["float16", "amp-fp16", "amp-bf16"])
def test_graphed_gradients_are_handed_out_in_place_and_never_overwritten_while_held(autocast):
    """The graphed backward hands out the parameters' gradients where it wrote them, no copy (under autocast the
    weight gradients float32 from the GEMMs themselves); a gradient still held -- accumulated over micro-batches,
    kept by zero_grad(set_to_none=False), or referenced by the user -- is never overwritten by the next replay: the
    other buffer serves, and with both held the first one's are copied aside and back around the replay. Each step's
    gradients equal an eager Encoder's: float32 GEMM outputs against 16-bit ones rounded, within 2e-3 (fp16) or 1e-2
    (bf16: 8 bits of mantissa); dY of unit scale keeps float16 gradients out of its subnormal range, where the eager
    Encoder's would lose digits the graphed one keeps."""
    amp = autocast is not None
    dtype = torch.float32 if amp else torch.float16
    tolerance = 1e-2 if autocast == torch.bfloat16 else 2e-3
    eager = Encoder.from_layouts(DEFAULT, dtype=dtype).cuda().eval()
    randomize_(eager, 31)
    graphed = copy.deepcopy(eager)
    graphed.cuda_graphs = True
    size, gen = eager.size, torch.Generator(device="cuda").manual_seed(31)
    xs = [torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=dtype) for _ in range(3)]
    dy = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=autocast or dtype)

    def run(x: torch.Tensor) -> None:
        for encoder in (eager, graphed):
            with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=amp), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # an fp16 profile's GEMM algorithms in bf16
                y = encoder(x)
            y.backward(dy)

    def agree() -> list[torch.Tensor]:
        for (name, want), got in zip(eager.named_parameters(), graphed.parameters()):
            assert got.grad.dtype == dtype and norm_relative_error(got.grad, want.grad) <= tolerance, name
        return [p.grad for p in graphed.parameters()]

    def zero_grad(set_to_none: bool = True) -> None:
        eager.zero_grad(set_to_none=set_to_none)
        graphed.zero_grad(set_to_none=set_to_none)

    zero_grad()
    run(xs[0])
    run(xs[1])  # accumulated: the first micro-batch's gradients are held as .grad
    held = agree()
    buffers = graphed._graphs._gradients
    places = {flat.untyped_storage().data_ptr() for flat in buffers.flats}
    assert all(g.untyped_storage().data_ptr() in places for g in held), "handed out where the graph wrote them"
    if amp:  # every weight gradient comes from a GEMM writing float32, not a 16-bit result moved there
        step = next(iter(graphed._graphs._steps.values()))
        staged = {step._grad_names()[i][1] for i in step.staged}
        assert not staged & {"dWqkv", "dWo", "dW1", "dW2"}, staged
    for _ in range(2):  # .grad kept and zeroed in place
        zero_grad(set_to_none=False)
        run(xs[2])
        agree()
    zero_grad()
    run(xs[0])
    first = agree()
    first_values = [g.clone() for g in first]
    zero_grad()
    run(xs[1])  # the first step's gradients are held by `first`
    second = agree()
    second_values = [g.clone() for g in second]
    zero_grad()
    with pytest.warns(UserWarning, match="both gradient buffers"):
        run(xs[2])
    agree()
    for got, want in zip(first + second, first_values + second_values):
        assert torch.equal(got, want), "a held gradient was overwritten"


def eager_and_graphed_layers(seed: int, **graphed_attributes) -> tuple[list[Encoder], list[Encoder]]:
    """Two float16 Encoders of the default configuration without dropout (so that graphed and launched steps draw
    no masks to compare), randomized, and copies of them with cuda_graphs and `graphed_attributes` set."""
    eager = [Encoder.from_layouts(DEFAULT, dtype=torch.float16, attention_dropout=0.0, hidden_dropout=0.0,
                                  seed=i).cuda() for i in range(2)]
    for index, encoder in enumerate(eager):
        randomize_(encoder, seed + index)
    graphed = copy.deepcopy(eager)
    for encoder in graphed:
        encoder.cuda_graphs = True
        for name, value in graphed_attributes.items():
            setattr(encoder, name, value)
    return eager, graphed


def test_a_graphed_stack_padding_lengths_computes_what_it_does_unpadded_and_captures_once():
    """Two Encoders as a graphed stack with length_multiple=64 (no dropout: the padded shape numbers Philox's
    elements otherwise) against the same two unpadded and launched: Y, dX and every gradient at lengths 50 and 60,
    with a padding mask, and one pair of graphs for both lengths."""
    eager, graphed = eager_and_graphed_layers(30, length_multiple=64)
    stack, gen = EncoderStack(graphed), torch.Generator(device="cuda").manual_seed(12)
    for length in (50, 60):
        x = torch.randn(2, length, eager[0].size.I, device="cuda", generator=gen, dtype=torch.float16)
        dy = torch.randn(x.shape, device="cuda", generator=gen, dtype=torch.float16)
        mask = torch.ones(2, length, device="cuda", dtype=torch.float16)
        mask[1, length // 2:] = 0
        results = []
        in_turn = lambda h: eager[1](eager[0](h, mask), mask)  # noqa: E731
        for encoders, run in ((eager, in_turn), (graphed, lambda h: stack(h, mask))):
            for encoder in encoders:
                encoder.zero_grad(set_to_none=True)
            h = x.clone().requires_grad_()
            y = run(h)
            y.backward(dy)
            results.append([y.detach(), h.grad] + [p.grad for encoder in encoders for p in encoder.parameters()])
        want, got = results
        assert got[0].shape == want[0].shape
        for index, (g, w) in enumerate(zip(got, want)):
            assert norm_relative_error(g, w) <= TOLERANCE, (length, index)
    assert len(stack._graphs) == 1, "lengths 50 and 60 both run as 64: captured once"


def test_a_stack_captured_ahead_replays_those_shapes_without_capturing_again():
    """EncoderStack.capture(B, lengths) captures each padded length's training graphs, longest first, into one pool
    and replays nothing (no gradient appears, no forward is counted); training steps at those lengths then replay
    them, capture nothing more, and compute what the Encoders launched in turn do."""
    eager, graphed = eager_and_graphed_layers(90, length_multiple=64)
    stack, gen = EncoderStack(graphed), torch.Generator(device="cuda").manual_seed(17)
    assert stack.capture(2, [50, 130, 64]) == [192, 64]
    steps = dict(stack._graphs._steps)
    assert [key[2:4] for key in steps] == [(2, 192), (2, 64)]
    assert len({step.pool for step in steps.values()}) == 1 and next(iter(steps.values())).pool.forwards == 0
    assert all(p.grad is None for encoder in graphed for p in encoder.parameters())
    for length in (130, 50):
        x = torch.randn(2, length, eager[0].size.I, device="cuda", generator=gen, dtype=torch.float16)
        results = []
        for encoders, run in ((eager, lambda h: eager[1](eager[0](h))), (graphed, stack)):
            for encoder in encoders:
                encoder.zero_grad(set_to_none=True)
            h = x.clone().requires_grad_()
            y = run(h)
            y.backward(torch.ones_like(y))
            results.append([y.detach(), h.grad] + [p.grad for encoder in encoders for p in encoder.parameters()])
        for index, (got, want) in enumerate(zip(*results[::-1])):
            assert norm_relative_error(got, want) <= TOLERANCE, (length, index)
    assert all(stack._graphs._steps[key] is step for key, step in steps.items()), "nothing captured again"
    assert [step.generation for step in steps.values()] == [1, 2], "each shape's forward replayed"


def test_a_graphed_stack_out_of_memory_for_a_new_shape_drops_the_kept_shapes_graphs():
    """The training shapes share one pool, whose memory comes back only with the last of their graphs. With the
    process's memory capped a little above what it holds, a much larger new shape's capture runs out of memory, drops
    the kept shapes' graphs one by one, and still does not fit: the allocator's error is raised, no graphs are left,
    and once memory allows the shape is captured and computes what two Encoders launched in turn do."""
    eager, graphed = eager_and_graphed_layers(40)
    stack, gen = EncoderStack(graphed), torch.Generator(device="cuda").manual_seed(13)

    def train_step(run, encoders, batch, length):
        x = torch.randn(batch, length, eager[0].size.I, device="cuda", generator=gen.manual_seed(length),
                        dtype=torch.float16, requires_grad=True)
        for encoder in encoders:
            encoder.zero_grad(set_to_none=True)
        y = run(x)
        y.backward(torch.ones_like(y))
        return [y.detach(), x.grad] + [p.grad for encoder in encoders for p in encoder.parameters()]

    for length in (64, 128):
        train_step(stack, graphed, 4, length)
    assert len(stack._graphs) == 2
    # The new shape's step keeps over 1 GB of tensors for its backward, more than the whole process holds now, so
    # no drop can make room. (A shape a few times the kept ones' size fitted after one drop: a shared pool's free
    # blocks take much of a new shape's capture, and what else a drop lets go is hard to bound.)
    larger = (16, 1024)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (64 << 20)) / total)  # x fits
    try:
        with pytest.raises(torch.OutOfMemoryError):
            train_step(stack, graphed, *larger)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert len(stack._graphs) == 0, "every kept shape was dropped before giving up"
    want = train_step(lambda h: eager[1](eager[0](h)), eager, *larger)
    got = train_step(stack, graphed, *larger)
    assert len(stack._graphs) == 1
    for index, (g, w) in enumerate(zip(got, want)):
        assert norm_relative_error(g, w) <= TOLERANCE, index


def test_evaluation_replays_forward_only_graphs_kept_apart_from_the_training_graphs():
    """A graphed stack evaluated under no_grad or inference_mode replays forward-only graphs: what its Encoders
    launched in turn compute, with no backward captured, no gradient buffers, and a memory pool of about one layer's
    tensors (not the chain's saved tensors: well under the training graphs' pool at the same shape). The training
    shapes share one pool: a shorter shape's capture after a longer one's adds little to it. Evaluating more shapes
    than max_shapes leaves the training shapes' graphs in place, and training after inference_mode works."""
    eager, graphed = eager_and_graphed_layers(50)
    for encoder in eager + graphed:
        encoder.eval()
    stack, gen = EncoderStack(graphed, max_shapes=3), torch.Generator(device="cuda").manual_seed(14)
    batch, width = 8, eager[0].size.I

    def evaluate(length: int, context=torch.no_grad) -> torch.Tensor:
        x = torch.randn(batch, length, width, device="cuda", generator=gen.manual_seed(length), dtype=torch.float16)
        with context():
            got, want = stack(x), eager[1](eager[0](x))
        assert norm_relative_error(got, want) <= TOLERANCE, length
        assert not got.requires_grad
        return got

    def train(length: int) -> list[torch.Tensor]:
        x = torch.randn(batch, length, width, device="cuda", generator=gen.manual_seed(length), dtype=torch.float16)
        results = []
        for encoders, run in ((eager, lambda h: eager[1](eager[0](h))), (graphed, stack)):
            for encoder in encoders:
                encoder.zero_grad(set_to_none=True)
            h = x.clone().requires_grad_()
            run(h).backward(torch.ones_like(x))
            results.append([h.grad] + [p.grad for encoder in encoders for p in encoder.parameters()])
        for index, (got, want) in enumerate(zip(*results[::-1])):
            assert norm_relative_error(got, want) <= TOLERANCE, (length, index)

    def pool_bytes(steps) -> int:
        """What the caching allocator holds for the pool of `steps`' graphs (one kind's: they share it), counted
        apart from everything else the process holds (eager runs, cuBLAS workspaces, gradient buffers)."""
        handle = next(iter(steps.values())).pool.handle
        return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                   if tuple(segment["segment_pool_id"]) == tuple(handle))

    evaluate(256)
    forward_only = pool_bytes(stack._graphs.forward_only)
    assert stack._graphs._gradients is None and len(stack._graphs) == 0
    train(256)
    training = pool_bytes(stack._graphs._steps)
    assert 0 < forward_only < 0.75 * training, (forward_only, training)
    train(192)
    shorter = pool_bytes(stack._graphs._steps) - training
    assert shorter < 0.35 * training, (shorter, training)  # per-shape pools: ~0.75
    for graphed_step in stack._graphs.forward_only.values():
        assert graphed_step.gradients is None and not hasattr(graphed_step, "backward_graphs")
        assert all(not link.env for link in graphed_step.links)
    assert all(not link.env for graphed_step in stack._graphs._steps.values() for link in graphed_step.links)
    with pytest.warns(UserWarning, match="max_shapes=3"):
        for length in (64, 128, 192, 320):
            evaluate(length)
    assert [key[3] for key in stack._graphs.forward_only] == [128, 192, 320]
    assert [key[3] for key in stack._graphs._steps] == [256, 192], "evaluating pushed out no training shape"
    replayed = evaluate(320)
    assert torch.equal(evaluate(320, torch.inference_mode), replayed)
    assert len(stack._graphs.forward_only) == 3, "inference_mode replays the no_grad graph"
    train(256)
    train(192)


def test_graphs_of_every_shape_share_one_low_precision_copy_of_the_weights(monkeypatch):
    """Float32 parameters under autocast: the graphs of every shape, training and forward-only, read one float16 copy
    of each layer's weights, which each training forward graph casts the current parameters into. Two forwards at
    different lengths before one backward (the second forward's cast rewrites what the first one's backward reads),
    an evaluation, and steps after the weights were replaced in place compute what the Encoders launched in turn do.
    Forward-only replays cast a layer's weights only where they changed since the copy was made."""
    eager = [Encoder.from_layouts(DEFAULT, dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
                                  seed=i).cuda() for i in range(2)]
    for index, encoder in enumerate(eager):
        randomize_(encoder, 60 + index)
    graphed = copy.deepcopy(eager)
    for encoder in graphed:
        encoder.cuda_graphs = True
    stack, gen = EncoderStack(graphed), torch.Generator(device="cuda").manual_seed(15)
    width = eager[0].size.I

    def check(lengths: tuple[int, ...]) -> None:
        xs = [torch.randn(4, length, width, device="cuda", generator=gen) for length in lengths]
        results = []
        for encoders, run in ((eager, lambda h: eager[1](eager[0](h))), (graphed, stack)):
            for encoder in encoders:
                encoder.zero_grad(set_to_none=True)
            hs = [x.clone().requires_grad_() for x in xs]
            with torch.autocast("cuda", dtype=torch.float16):
                ys = [run(h) for h in hs]
            sum(y.float().square().mean() for y in ys).backward()
            results.append([y.detach() for y in ys] + [h.grad for h in hs]
                           + [p.grad for encoder in encoders for p in encoder.parameters()])
        for index, (got, want) in enumerate(zip(*results[::-1])):
            assert norm_relative_error(got, want) <= TOLERANCE, (lengths, index)

    def evaluate(length: int) -> None:
        x = torch.randn(4, length, width, device="cuda", generator=gen)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            assert norm_relative_error(stack(x), eager[1](eager[0](x))) <= TOLERANCE, length

    check((128, 192))
    evaluate(256)
    for index, encoders in enumerate(zip(eager, graphed)):
        for encoder in encoders:
            randomize_(encoder, 70 + index)  # in place: the graphs must cast the new values
    check((192,))
    evaluate(256)
    check((128,))
    steps = list(stack._graphs._steps.values()) + list(stack._graphs.forward_only.values())
    assert len(steps) == 3
    for index in range(2):
        copies = {id(graphed_step.links[index].params) for graphed_step in steps}
        assert len(copies) == 1 and steps[0].links[index].params[0].dtype == torch.float16, index

    from substation.kernels.convert import Converter

    casts, cast = [], Converter.__call__
    monkeypatch.setattr(Converter, "__call__", lambda self, *args: (casts.append(self), cast(self, *args))[1])
    evaluate(256)
    assert len(casts) == 2, "after a training replay, whose cast is unseen, each layer's copy is made again"
    evaluate(256)
    assert len(casts) == 2, "the weights did not change: no cast"
    with torch.no_grad():
        for encoder in (eager[1], graphed[1]):
            encoder.W1.mul_(1.5)
    evaluate(256)
    assert len(casts) == 3, "layer 1's weights changed, layer 0's did not"


def test_a_step_replays_while_the_last_steps_loss_is_still_held():
    """A training loop at a script's top level keeps the last step's loss, and with it its autograd graph, until the
    next forward has returned: once its backward has run, that graph no longer holds the graphs' saved tensors, so
    the next step replays (it ran eagerly before) and computes what the Encoders launched in turn do."""
    eager, graphed = eager_and_graphed_layers(80)
    stack, gen = EncoderStack(graphed), torch.Generator(device="cuda").manual_seed(16)
    size = eager[0].size
    losses = {}
    for step_index in range(3):
        x = torch.randn(size.B, size.L, size.I, device="cuda", generator=gen, dtype=torch.float16)
        results = []
        for name, encoders, run in (("eager", eager, lambda h: eager[1](eager[0](h))), ("graphed", graphed, stack)):
            for encoder in encoders:
                encoder.zero_grad(set_to_none=True)
            h = x.clone().requires_grad_()
            losses[name] = run(h).float().square().mean()  # the last step's loss is dropped only after this forward
            losses[name].backward()
            results.append([h.grad] + [p.grad for encoder in encoders for p in encoder.parameters()])
        for index, (got, want) in enumerate(zip(*results[::-1])):
            assert norm_relative_error(got, want) <= TOLERANCE, (step_index, index)
    (graphed_step,) = stack._graphs._steps.values()
    assert graphed_step.generation == 3, "every step replayed the forward graph"
