"""The layer as torch.library custom ops (`substation.layer_op`): opcheck, torch.compile of a stack of Encoders
against eager (output and every gradient), no graph break inside a layer, the handle table, the mask check's
cache (CPU reference path, float64); the compiled GPU path against eager (GPU)."""
import copy
import gc
from pathlib import Path

import pytest
import torch

from substation import Encoder, Size, layer_op
from substation.errors import InputError

SMALL = Size.from_heads(B=2, L=5, H=2, P=4, U=12, dtype="float64")
LAYOUTS = Path(__file__).parents[1] / "layouts" / "h100-bert-large-b8-l512.pickle"


class Stack(torch.nn.Module):
    """Encoders applied in turn, as a BERT encoder holds them."""

    def __init__(self, *layers: Encoder) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


def encoder(seed: int, size: Size = SMALL, dtype: torch.dtype = torch.float64, **kwargs) -> Encoder:
    torch.manual_seed(seed)
    layer = Encoder(size, dtype=dtype, attention_dropout=0.2, hidden_dropout=0.3, seed=seed, **kwargs)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerNorm weights and biases off 1 and 0
    return layer


def inputs(masked: bool, size: Size = SMALL, dtype: torch.dtype = torch.float64, device: str = "cpu"):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size.B, size.L, size.I, generator=gen, dtype=torch.float64).to(device, dtype)
    if not masked:
        return x, None
    mask = torch.ones(size.B, size.L, dtype=dtype, device=device)
    mask[1, size.L // 2:] = 0
    return x, mask


def op_arguments(layer: Encoder, masked: bool, dropout: bool) -> tuple:
    x, mask = inputs(masked)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    rng = layer.rng_state.clone() if dropout else None
    return (layer._handle, x.requires_grad_(), mask, params, rng, *((0.2, 0.3) if dropout else (0.0, 0.0)))


@pytest.mark.parametrize("dropout", [False, True], ids=["eval", "dropout"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_opcheck_forward_and_backward(masked, dropout):
    layer = encoder(0)
    args = op_arguments(layer, masked, dropout)
    torch.library.opcheck(torch.ops.substation.layer_forward.default, args)
    handle, x, mask, params, rng, p_attn, p_hidden = args
    _, *saved = torch.ops.substation.layer_forward(*args)
    dy = torch.randn_like(x)
    torch.library.opcheck(torch.ops.substation.layer_backward.default,
                          (handle, dy, x.detach(), mask, [p.detach() for p in params], saved, rng, p_attn, p_hidden))


def step(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None, dy: torch.Tensor):
    """Y, dX and every parameter gradient of one training step, each Encoder's dropout seeded alike."""
    for i, layer in enumerate(model.layers if isinstance(model, Stack) else model._orig_mod.layers):
        layer.manual_seed(10 + i)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = model(x, mask)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_compiled_stack_equals_eager(backend, masked):
    stack = Stack(encoder(1), encoder(2))
    x, mask = inputs(masked)
    dy = torch.randn_like(x)
    compiled = torch.compile(stack, backend=backend, fullgraph=True)
    want, got = step(stack, x, mask, dy), step(compiled, x, mask, dy)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"output {i}: {m}")


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_compiled_stack_pads_lengths_as_eager_does(masked):
    """length_multiple=4 takes L=5 to 8 inside each layer: traced in one graph, it computes what eager does."""
    stack = Stack(encoder(1, length_multiple=4), encoder(2, length_multiple=4))
    x, mask = inputs(masked)
    dy = torch.randn_like(x)
    compiled = torch.compile(stack, backend="aot_eager", fullgraph=True)
    want, got = step(stack, x, mask, dy), step(compiled, x, mask, dy)
    assert want[0].shape == x.shape
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"output {i}: {m}")


def test_compiled_steps_draw_new_masks_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend

    stack = Stack(encoder(3), encoder(4, cuda_graphs=True))  # cuda_graphs is not used under torch.compile
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(stack, backend=counter)
    x, _ = inputs(False)
    first, second = compiled(x), compiled(x)
    assert not torch.equal(first, second), "each step advances the dropout offset"
    assert counter.frame_count == 1 and [layer.offset for layer in stack.layers] == [2, 2]
    for layer in stack.layers:
        layer.offset = 0
    torch.testing.assert_close(compiled(x), first, rtol=0, atol=0)


def test_no_graph_break_inside_the_layers():
    stack = Stack(encoder(5), encoder(6))
    x, mask = inputs(True)
    explained = torch._dynamo.explain(stack)(x.requires_grad_(), mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = [node.target for graph in explained.graphs for node in graph.graph.nodes]
    assert ops.count(torch.ops.substation.layer_forward.default) == 2


def test_handles_are_weak_and_copies_get_their_own():
    layer = encoder(7)
    handle = layer._handle
    assert layer_op.lookup(handle) is layer
    twin = copy.copy(layer)  # as deepcopy and unpickling, through __setstate__
    assert twin._handle != handle and layer_op.lookup(twin._handle) is twin
    x, _ = inputs(False)
    layer.eval(), twin.eval()
    torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {handle} names no live Encoder"):
        layer_op.lookup(handle)


# ---- the mask's value check ------------------------------------------------------------------------------
def test_a_mask_is_checked_once_and_again_after_an_in_place_edit():
    layer = encoder(8)
    x, mask = inputs(True)
    layer(x, mask)
    mask.data[0] = 0  # `.data` bypasses the version counter: unseen, so a second call proves no second check
    layer(x, mask)
    mask[0, 0] = 0  # an in-place edit bumps the version: checked again, and rejected
    with pytest.raises(InputError, match=r"sequences \[0\]"):
        layer(x, mask)
    mask[0, 0] = 2
    with pytest.raises(InputError, match="only 0"):
        layer(x, mask)


def test_a_new_mask_is_checked_unless_switched_off():
    layer = encoder(9)
    x, mask = inputs(True)
    layer(x, mask)
    bad = mask.clone()
    bad[1] = 0
    with pytest.raises(InputError, match=r"sequences \[1\]"):
        layer(x, bad)
    layer.check_mask = False
    layer(x, bad)  # the caller vouches for its masks: no check, no wait


# ---- GPU --------------------------------------------------------------------------------------------------
def _gpu_stack(seed: int) -> Stack:
    """Two fp16 Encoders of the shipped B8/L512 configuration with random weights; no attention dropout (SDPA
    draws it from PyTorch's generator, which compiled and eager steps advance differently)."""
    layers = [Encoder.from_layouts(LAYOUTS, dtype=torch.float16, attention_dropout=0.0) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters()):
            value = torch.randn(p.shape, generator=gen)
            p.copy_(value * 0.02 if p.dim() > 1 else value * 0.3 + 0.5)
    return Stack(*layers).cuda()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_gpu_stack_matches_eager(mode):
    """At the file's size (B=8, L=512), steps compiled by inductor (and replayed from its CUDA graphs with
    reduce-overhead) against eager steps: Y, dX and every gradient to rounding (cuDNN's attention backward adds
    with atomics), with the same hidden-dropout masks; and steps draw new masks."""
    stack = _gpu_stack(11)
    x, mask = inputs(True, stack.layers[0].size, torch.float16, "cuda")
    dy = torch.randn_like(x)
    compiled = torch.compile(stack, mode=mode)
    for _ in range(3):  # compile, then run the compiled (or graphed) step again
        want, got = step(stack, x, mask, dy), step(compiled, x, mask, dy)
        for i, (a, b) in enumerate(zip(got, want)):
            assert _relative(a, b) <= 1e-3, f"output {i}"
    with torch.no_grad():
        first, second = compiled(x, mask).clone(), compiled(x, mask)
    assert _relative(first, second) > 1e-2, "each compiled step draws new hidden-dropout masks"
