"""The reference Encoder against HF BertLayer and against a plain PyTorch layer, forward and every gradient."""
import math

import pytest
import torch

from substation import Encoder, Size
from substation.dropout import dropout
from substation.errors import DeviceError, InputError
from substation.graph import DROPOUT_SITES
from substation.layouts import Configuration

SMALL = Size.from_heads(B=3, L=7, H=2, P=4, U=20, dtype="float64")
CONFIGS = {
    "default": Configuration.default(),
    **{f"random{seed}": Configuration.random(seed) for seed in range(3)},
    "split": Configuration.random(7, split=("X1", "H1", "Pr", "Q")),
}
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: agreement to rounding


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Random weights, biases and LayerNorm parameters: never zeros, never ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3 + (0.5 if p.dim() == 1 else 0.0))


def inputs(size: Size, seed: int, masked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size.B, size.L, size.I, generator=gen, dtype=torch.float64)
    if not masked:
        return x, None
    mask = torch.ones(size.B, size.L, dtype=torch.float64)
    mask[0, -3:] = 0
    mask[2, 1] = 0
    return x, mask


@pytest.fixture(scope="module")
def hf_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = transformers.BertConfig(hidden_size=SMALL.I, num_attention_heads=SMALL.H, intermediate_size=SMALL.U,
                                  attn_implementation="eager")
    layer = BertLayer(cfg).to(torch.float64).eval()
    randomize_(layer, 0)
    return layer


def hf_forward_backward(layer, x, mask, dy):
    x = x.clone().requires_grad_()
    extended = None if mask is None else (1 - mask)[:, None, None, :] * torch.finfo(torch.float64).min
    out = layer(x, attention_mask=extended)
    y = out[0] if isinstance(out, tuple) else out
    layer.zero_grad()
    y.backward(dy)
    return y.detach(), x.grad, {k: p.grad.clone() for k, p in layer.named_parameters()}


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_matches_hf_bert_layer(hf_layer, config_name, masked):
    enc = Encoder.from_hf(hf_layer, config=CONFIGS[config_name]).eval()
    x, mask = inputs(SMALL, 1, masked)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y_ref, dx_ref, grads_ref = hf_forward_backward(hf_layer, x, mask, dy)
    xg = x.clone().requires_grad_()
    y = enc(xg, attention_mask=mask)
    y.backward(dy)
    torch.testing.assert_close(y.detach(), y_ref, **TOL)
    torch.testing.assert_close(xg.grad, dx_ref, **TOL)
    grads = enc.grad_state_dict()
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_state_dict_round_trips_hf_names(hf_layer):
    enc = Encoder.from_hf(hf_layer, config=CONFIGS["random1"])
    state = enc.state_dict()
    assert state.keys() == hf_layer.state_dict().keys()
    for key, value in hf_layer.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    other = Encoder(SMALL, dtype=torch.float64, config=CONFIGS["random2"])
    other.load_state_dict(state)
    for key, value in other.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)


def plain_layer(params: dict, x, mask, size: Size, p_attn: float, p_hidden: float, seed: int, offset: int):
    """BERT layer in plain PyTorch ops (autograd does the backward), with Substation's dropout masks."""
    B, L, H, P = x.shape[0], x.shape[1], size.H, size.P

    def drop(t, p, site):
        return dropout(t, p, seed, offset, DROPOUT_SITES[site]) if p > 0 else t

    q, k, v = ((x @ params[f"attention.self.{n}.weight"].T + params[f"attention.self.{n}.bias"])
               .view(B, L, H, P).transpose(1, 2) for n in ("query", "key", "value"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(P)
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :] == 0, -math.inf)
    probs = drop(torch.softmax(scores, -1), p_attn, "attention")
    ctx = (probs @ v).transpose(1, 2).reshape(B, L, H * P)
    attn = drop(ctx @ params["attention.output.dense.weight"].T + params["attention.output.dense.bias"],
                p_hidden, "attention_output")
    x1 = torch.nn.functional.layer_norm(attn + x, (size.I,), params["attention.output.LayerNorm.weight"],
                                        params["attention.output.LayerNorm.bias"], eps=1e-12)
    h = torch.nn.functional.gelu(x1 @ params["intermediate.dense.weight"].T + params["intermediate.dense.bias"])
    out = drop(h @ params["output.dense.weight"].T + params["output.dense.bias"], p_hidden, "ffn_output")
    return torch.nn.functional.layer_norm(out + x1, (size.I,), params["output.LayerNorm.weight"],
                                          params["output.LayerNorm.bias"], eps=1e-12)


@pytest.mark.parametrize("config_name", ["default", "random0", "split"])
def test_training_dropout_matches_plain_pytorch(config_name):
    enc = Encoder(SMALL, dtype=torch.float64, config=CONFIGS[config_name], attention_dropout=0.2,
                  hidden_dropout=0.3, seed=1234)
    randomize_(enc, 3)
    x, mask = inputs(SMALL, 4, masked=True)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    params = {k: v.clone().requires_grad_() for k, v in enc.state_dict().items()}
    for step in range(2):  # the second step uses the next dropout offset
        xr = x.clone().requires_grad_()
        y_ref = plain_layer(params, xr, mask, SMALL, 0.2, 0.3, seed=1234, offset=step)
        y_ref.backward(dy)
        xg = x.clone().requires_grad_()
        y = enc(xg, attention_mask=mask)
        enc.zero_grad()
        y.backward(dy)
        torch.testing.assert_close(y.detach(), y_ref.detach(), **TOL)
        torch.testing.assert_close(xg.grad, xr.grad, **TOL)
        grads = enc.grad_state_dict()
        for key, param in params.items():
            torch.testing.assert_close(grads[key], param.grad, **TOL, msg=lambda m: f"{key}: {m}")
            param.grad = None
    assert enc.offset == 2


def test_dropout_is_reproducible_and_advances():
    enc = Encoder(SMALL, dtype=torch.float64, seed=9, attention_dropout=0.1, hidden_dropout=0.1)
    randomize_(enc, 1)
    x, _ = inputs(SMALL, 2, masked=False)
    first, second = enc(x), enc(x)
    assert not torch.equal(first, second), "each training step draws new masks"
    enc.manual_seed(9)
    torch.testing.assert_close(enc(x), first, rtol=0, atol=0)
    enc.eval()
    torch.testing.assert_close(enc(x), enc(x), rtol=0, atol=0)


def test_float32_close_to_float64():
    enc64 = Encoder(SMALL, dtype=torch.float64).eval()
    randomize_(enc64, 6)
    enc32 = Encoder(SMALL, dtype=torch.float32, config=CONFIGS["random2"]).eval()
    enc32.load_state_dict(enc64.state_dict())
    x, mask = inputs(SMALL, 7, masked=True)
    torch.testing.assert_close(enc32(x.float(), mask), enc64(x, mask).float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make_input, error, match", [
    (lambda: (torch.randn(3, 7, 9, dtype=torch.float64), None), InputError, r"x.shape=\(3, 7, 9\)"),
    (lambda: (torch.randn(21, 8, dtype=torch.float64), None), InputError, r"expected \[B, L, I\]"),
    (lambda: (torch.randn(3, 7, 8, dtype=torch.float32), None), TypeError, "x.dtype=torch.float32"),
    (lambda: ([[0.0]], None), TypeError, "must be a torch.Tensor"),
    (lambda: (torch.randn(3, 7, 8, dtype=torch.float64), torch.ones(3, 6)), InputError, r"attention_mask.shape"),
    (lambda: (torch.randn(3, 7, 8, dtype=torch.float64), torch.full((3, 7), 2.0)), InputError, "only 0"),
    (lambda: (torch.randn(3, 7, 8, dtype=torch.float64), torch.ones(3, 7, dtype=torch.complex64)), TypeError,
     "real or bool"),
    (lambda: (torch.randn(3, 7, 8, dtype=torch.float64), torch.ones(3, 7).index_fill_(0, torch.tensor([1]), 0)),
     InputError, r"sequences \[1\]"),
])
def test_bad_inputs_are_named(make_input, error, match):
    enc = Encoder(SMALL, dtype=torch.float64)
    x, mask = make_input()
    with pytest.raises(error, match=match):
        enc(x, attention_mask=mask)


def test_empty_batches_are_refused():
    enc = Encoder(SMALL, dtype=torch.float64)
    with pytest.raises(InputError, match="empty batch or sequence"):
        enc(torch.randn(0, 7, 8, dtype=torch.float64))


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="dtype"):
        Encoder(SMALL, dtype=torch.int32)
    with pytest.raises(ValueError, match="attention_dropout"):
        Encoder(SMALL, attention_dropout=1.5)


def test_input_on_another_device_is_named():
    enc = Encoder(SMALL, dtype=torch.float64)
    with pytest.raises(DeviceError, match="x is on meta but the Encoder's parameters are on cpu"):
        enc(torch.empty(3, 7, 8, dtype=torch.float64, device="meta"))



@pytest.mark.filterwarnings("ignore:an Encoder in torch.bfloat16 on cpu runs the torch reference")
def test_a_step_under_inference_mode_leaves_nothing_a_training_step_cannot_use():
    """Evaluation under torch.inference_mode (as transformers' pipelines run) computes what no_grad does, and what
    the layer keeps from it (under autocast, the low-precision copy of its float32 weights) serves the training
    step that follows: an inference tensor could not be saved for its backward."""
    size = Size.from_heads(B=3, L=7, H=2, P=4, U=20, dtype="float32")
    encoder = Encoder(size, dtype=torch.float32).eval()
    randomize_(encoder, 4)
    x = torch.randn(size.B, size.L, size.I, generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            want = encoder(x)
        encoder.refresh_weights()
        with torch.inference_mode():
            got = encoder(x)
        assert torch.equal(got, want)
        x.requires_grad_()
        encoder(x).float().square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in encoder.parameters())
