"""Float32 parameters under torch.autocast (CPU autocast, bfloat16): the layer runs in autocast's dtype from the
cached weight copy, against the float64 layer, and gradients reach the float32 parameters."""
import copy
import warnings

import pytest
import torch

from substation import Encoder, Size
from substation.accuracy import norm_relative_error
from substation.mixed_precision import WeightCache, autocast_dtype

SIZE = Size.from_heads(B=2, L=9, H=2, P=8, U=24, dtype="float32")
# bfloat16 keeps 8 bits: a layer of a few roundings per element agrees with float64 to about 1 %, as a whole tensor.
BF16_TOL = 3e-2


def randomized(seed: int) -> Encoder:
    encoder = Encoder(SIZE, dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in encoder.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (0.5 if p.dim() == 1 else 0.0))
    return encoder


def step(encoder: Encoder, x: torch.Tensor, mask: torch.Tensor, dy: torch.Tensor, amp: bool):
    x = x.clone().requires_grad_()
    encoder.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference path's "correct, and slow"
        y = encoder(x, attention_mask=mask)
    y.backward(dy.to(y.dtype))
    return y, x.grad, {name: p.grad for name, p in encoder.named_parameters()}


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SIZE.B, SIZE.L, SIZE.I, generator=gen)
    mask = torch.ones(SIZE.B, SIZE.L)
    mask[1, -4:] = 0
    return x, mask, torch.randn(SIZE.B, SIZE.L, SIZE.I, generator=gen)


def test_autocast_runs_bfloat16_and_gives_float32_gradients(data):
    x, mask, dy = data
    encoder = randomized(0)
    want_y, want_dx, want_grads = step(copy.deepcopy(encoder).double(), x.double(), mask.double(), dy.double(),
                                       amp=False)
    y, dx, grads = step(encoder, x, mask, dy, amp=True)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert norm_relative_error(y, want_y) < BF16_TOL
    assert norm_relative_error(dx, want_dx) < BF16_TOL
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        assert norm_relative_error(grad, want_grads[name]) < BF16_TOL, name


def test_without_autocast_float32_stays_float32(data):
    x, mask, dy = data
    y, dx, grads = step(randomized(0), x, mask, dy, amp=False)
    assert y.dtype == dx.dtype == torch.float32


def test_the_weight_copy_is_made_once_per_change_of_the_parameters():
    params = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    cache = WeightCache()
    first, again = cache.cast(params, torch.bfloat16), cache.cast(params, torch.bfloat16)
    assert first[0].data_ptr() == again[0].data_ptr()  # no new copy while nothing changed
    assert first[0].grad_fn is not again[0].grad_fn  # each forward its own autograd history
    with torch.no_grad():
        params[0].mul_(2)  # an optimizer step: the version counter moves
    fresh = cache.cast(params, torch.bfloat16)
    torch.testing.assert_close(fresh[0].float(), params[0].detach().bfloat16().float(), rtol=0, atol=0)
    (fresh[0].float().sum() * 3).backward()
    assert params[0].grad.dtype == torch.float32 and torch.all(params[0].grad == 3)
    assert params[1].grad is None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_the_step_after_an_optimizer_step_runs_the_updated_weights(data, fused):
    """Fused AdamW updates the parameters without moving their version counters (PyTorch 2.11-2.13): the copy is
    made again after any optimizer's step all the same, or the layer would keep running its first weights."""
    x, mask, dy = data
    encoder = randomized(0)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=0.1, fused=fused or None, foreach=None if fused else False)
    step(encoder, x, mask, dy, amp=True)
    optimizer.step()
    y, _, _ = step(encoder, x, mask, dy, amp=True)
    want, _, _ = step(copy.deepcopy(encoder), x, mask, dy, amp=True)  # a fresh copy of the updated weights
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_weights_edited_through_data_run_after_refresh_weights(data):
    x, mask, dy = data
    encoder = randomized(0)
    before, _, _ = step(encoder, x, mask, dy, amp=True)
    encoder.W1.data.mul_(2)  # moves no version counter: the cached copy is stale until refreshed
    stale, _, _ = step(encoder, x, mask, dy, amp=True)
    torch.testing.assert_close(stale, before, rtol=0, atol=0)
    encoder.refresh_weights()
    y, _, _ = step(encoder, x, mask, dy, amp=True)
    torch.testing.assert_close(y, step(copy.deepcopy(encoder), x, mask, dy, amp=True)[0], rtol=0, atol=0)
    assert not torch.equal(y, before)


def test_an_infinite_gradient_stays_infinite_for_the_grad_scaler(data):
    x, mask, dy = data
    dy = dy.clone()
    dy[0, 0, 0] = float("inf")
    _, _, grads = step(randomized(0), x, mask, dy, amp=True)
    assert not all(torch.isfinite(g).all() for g in grads.values())


def test_autocast_leaves_float64_and_half_parameters_alone():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype("cpu", torch.float32) == torch.bfloat16
        assert autocast_dtype("cpu", torch.float64) is None
        assert autocast_dtype("cpu", torch.float16) is None
    assert autocast_dtype("cpu", torch.float32) is None


def test_integer_inputs_are_refused_under_autocast():
    encoder = randomized(0)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="any floating dtype"):
        encoder(torch.ones(SIZE.B, SIZE.L, SIZE.I, dtype=torch.int64))
