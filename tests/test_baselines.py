"""The PyTorch baselines against the reference Encoder: forward and every gradient in float64, dropout off."""
import pytest
import torch

from substation import Encoder, Size
from substation.baselines import COMPILED, EAGER, TorchBertLayer, make_baseline, padding_bias
from substation.errors import InputError

SIZE = Size.from_heads(B=3, L=7, H=2, P=4, U=20, dtype="float64")
TOL = dict(rtol=1e-10, atol=1e-10)


def reference_encoder(seed: int = 0) -> Encoder:
    """A float64 Encoder with random weights, biases and LayerNorm parameters (never zeros or ones)."""
    enc = Encoder(SIZE, dtype=torch.float64, attention_dropout=0.0, hidden_dropout=0.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3 + (0.5 if p.dim() == 1 else 0.0))
    return enc


def inputs(masked: bool, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SIZE.B, SIZE.L, SIZE.I, generator=gen, dtype=torch.float64)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.ones(SIZE.B, SIZE.L, dtype=torch.float64)
        mask[0, -3:] = 0
        mask[2, 1] = 0
    return x, mask, dy


def forward_backward(layer, x, mask, dy):
    xg = x.clone().requires_grad_()
    y = layer(xg, mask)
    y.backward(dy)
    return y.detach(), xg.grad


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("variant", EAGER)
def test_baseline_matches_encoder(variant, masked):
    if variant == "hf_bertlayer":
        pytest.importorskip("transformers")
    enc = reference_encoder()
    layer = make_baseline(variant, SIZE, torch.float64, state_dict=enc.state_dict(),
                          attention_dropout=0.0, hidden_dropout=0.0)
    assert layer.state_dict().keys() == enc.state_dict().keys()
    x, mask, dy = inputs(masked)
    y_ref, dx_ref = forward_backward(enc, x, mask, dy)
    y, dx = forward_backward(layer, x, mask, dy)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(dx, dx_ref, **TOL)
    grads_ref = enc.grad_state_dict()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, grads_ref[name], **TOL, msg=lambda m: f"{variant} {name}: {m}")


@pytest.mark.parametrize("variant", EAGER)
def test_training_mode_applies_dropout(variant):
    if variant == "hf_bertlayer":
        pytest.importorskip("transformers")
    layer = make_baseline(variant, SIZE, torch.float64, state_dict=reference_encoder().state_dict())
    x, mask, _ = inputs(True)
    torch.manual_seed(0)
    first = layer(x, mask)
    assert not torch.equal(first, layer(x, mask)), "dropout draws new masks each step"
    torch.manual_seed(0)
    torch.testing.assert_close(layer(x, mask), first, rtol=0, atol=0)
    layer.eval()
    torch.testing.assert_close(layer(x, mask), layer(x, mask), rtol=0, atol=0)


def test_padding_bias_is_hf_additive_mask():
    x = torch.zeros(2, 3, 4, dtype=torch.float16)
    bias = padding_bias(torch.tensor([[1, 1, 0], [1, 0, 1]]), x)
    assert bias.shape == (2, 1, 1, 3) and bias.dtype == torch.float16
    assert bias[0, 0, 0].tolist() == [0.0, 0.0, torch.finfo(torch.float16).min]
    assert padding_bias(None, x) is None
    with pytest.raises(InputError, match=r"attention_mask.shape=\(2, 4\)"):
        padding_bias(torch.ones(2, 4), x)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="variant='eager'"):
        make_baseline("eager", SIZE)
    with pytest.raises(ValueError, match="attention='flash'"):
        TorchBertLayer(SIZE, attention="flash")
    with pytest.raises(ValueError, match="hidden_dropout=1.0"):
        TorchBertLayer(SIZE, hidden_dropout=1.0)
    with pytest.raises(InputError, match=r"x.shape=\(3, 7, 9\)"):
        TorchBertLayer(SIZE, torch.float64)(torch.zeros(3, 7, 9, dtype=torch.float64))


def test_compiled_variants_wrap_the_sdpa_layer():
    enc = reference_encoder()
    for variant in COMPILED:
        layer = make_baseline(variant, SIZE, torch.float64, state_dict=enc.state_dict())
        inner = layer._orig_mod  # not compiled until called: this test stays fast
        assert isinstance(inner, TorchBertLayer) and inner.attention_impl == "sdpa"
        torch.testing.assert_close(inner.state_dict()["output.dense.weight"], enc.state_dict()["output.dense.weight"])
