"""EncoderStack on the CPU (float64, the reference path): the Encoders applied in turn, forward and backward; its
construction errors and copies. The graphed stack is checked against this on a GPU (test_encoder_gpu.py)."""
import copy

import pytest
import torch

from substation import Encoder, Size
from substation.errors import InputError
from substation.stack import EncoderStack

SIZE = Size.from_heads(B=2, L=5, H=2, P=4, U=16)


def encoders(count: int) -> list[Encoder]:
    made = []
    for index in range(count):
        torch.manual_seed(index)
        encoder = Encoder(SIZE, dtype=torch.float64, seed=index)
        with torch.no_grad():
            for p in encoder.parameters():
                p.normal_(0.0, 0.3)  # biases and LayerNorm weights too, so that every gradient is tested
        made.append(encoder)
    return made


def test_a_stack_applies_its_encoders_in_turn():
    layers = encoders(3)
    stack = EncoderStack(copy.deepcopy(layers))  # the same weights and dropout states
    x = torch.randn(SIZE.B, SIZE.L, SIZE.I, dtype=torch.float64)
    mask = torch.ones(SIZE.B, SIZE.L, dtype=torch.float64)
    mask[1, 3:] = 0
    dy = torch.randn_like(x)
    want_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = want_x
    for layer in layers:
        want = layer(want, mask)
    got = stack(got_x, mask)
    want.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=0, atol=0)
    for (name, a), b in zip(stack.named_parameters(), (p for layer in layers for p in layer.parameters())):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
    assert all(layer.offset == 1 for layer in stack.layers), "each layer drew its own step's masks"


def test_a_stack_takes_encoders_only():
    with pytest.raises(TypeError, match="one or more Encoders"):
        EncoderStack([])
    with pytest.raises(TypeError, match="one or more Encoders"):
        EncoderStack([torch.nn.Linear(2, 2)])


def test_a_copy_keeps_the_weights_and_none_of_the_graphs():
    stack = EncoderStack(encoders(2))
    twin = copy.deepcopy(stack)
    assert twin._graphs is not stack._graphs and len(twin._graphs) == 0
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), stack.parameters()))
    assert list(twin.state_dict()) == list(stack.state_dict())


def test_under_autocast_a_stack_runs_in_autocasts_dtype_as_its_encoders_do():
    layers = [encoder.float() for encoder in encoders(2)]
    stack = EncoderStack(copy.deepcopy(layers))
    x = torch.randn(SIZE.B, SIZE.L, SIZE.I)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layers[1](layers[0](x))
        got = stack(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_stack_of_mixed_dtypes_is_refused():
    layers = encoders(2)
    layers[1].float()
    with pytest.raises(InputError, match="layer 1 holds torch.float32 parameters on cpu, layer 0 torch.float64"):
        EncoderStack(layers)(torch.randn(SIZE.B, SIZE.L, SIZE.I, dtype=torch.float64))


def test_capturing_ahead_refuses_what_it_cannot_capture():
    """EncoderStack.capture needs positive sizes, Encoders with cuda_graphs, on a GPU; substation.capture_shapes a
    model with an injected stack."""
    from substation import capture_shapes
    from substation.errors import DeviceError, UnsupportedError

    stack = EncoderStack(encoders(2))
    with pytest.raises(InputError, match="cuda_graphs=True"):
        stack.capture(2, [5])
    for layer in stack.layers:
        layer.cuda_graphs = True
    with pytest.raises(DeviceError, match="on a GPU"):
        stack.capture(2, [5])
    for batch_size, lengths in ((0, [5]), (2.0, [5]), (True, [5]), (2, []), (2, [5, 0]), (2, [4.5])):
        with pytest.raises(InputError, match="batch_size" if lengths == [5] else "lengths"):
            stack.capture(batch_size, lengths)
    with pytest.raises(UnsupportedError, match="substation.inject"):
        capture_shapes(torch.nn.Linear(2, 2), 2, [5])
