"""Sequences padded to a multiple of a length (`length_multiple`, substation.lengths) on the CPU, float64 (the
reference path): a padded layer, stack and injected model compute what they compute unpadded, forward and every
gradient, with and without a padding mask; the padded shape is what runs; the argument's errors."""
import copy

import pytest
import torch

from substation import Encoder, Size
from substation.errors import InputError
from substation.lengths import pad_sequences, padded_length
from substation.stack import EncoderStack

SIZE = Size.from_heads(B=2, L=5, H=2, P=4, U=16)
B, L, MULTIPLE = 3, 13, 8  # 13 -> 16


def encoder(seed: int = 0, **kwargs) -> Encoder:
    torch.manual_seed(seed)
    made = Encoder(SIZE, dtype=torch.float64, seed=seed, attention_dropout=0.0, hidden_dropout=0.0, **kwargs)
    with torch.no_grad():
        for p in made.parameters():
            p.normal_(0.0, 0.3)  # biases and LayerNorm weights too, so that every gradient is tested
    return made


def inputs(masked: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(B, L, SIZE.I, generator=generator, dtype=torch.float64)
    dy = torch.randn(B, L, SIZE.I, generator=generator, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.ones(B, L, dtype=torch.float64)
        mask[1, 9:] = 0
        mask[2, 2:] = 0
    return x, mask, dy


def run(module: torch.nn.Module, x, mask, dy) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    y = module(x, mask)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()]


def assert_same(got, want) -> None:
    (y, dx, grads), (want_y, want_dx, want_grads) = got, want
    assert y.shape == want_y.shape
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


def test_padded_lengths_and_bad_multiples():
    assert [padded_length(n, 8) for n in (1, 8, 13, 16)] == [8, 8, 16, 16]
    assert padded_length(13, None) == 13
    for bad in (0, -8, 2.5, True, "64"):
        with pytest.raises(ValueError, match="length_multiple"):
            Encoder(SIZE, dtype=torch.float64, length_multiple=bad)


def test_padding_appends_masked_zero_positions():
    x, mask, _ = inputs(masked=True)
    padded_x, padded_mask = pad_sequences(x, mask, MULTIPLE)
    assert padded_x.shape == (B, 16, SIZE.I) and padded_mask.shape == (B, 16)
    assert torch.equal(padded_x[:, :L], x) and not padded_x[:, L:].any()
    assert torch.equal(padded_mask[:, :L], mask) and not padded_mask[:, L:].any()
    unmasked_x, ones = pad_sequences(x, None, MULTIPLE)
    assert torch.equal(ones[:, :L], torch.ones(B, L, dtype=x.dtype)) and not ones[:, L:].any()
    short = x[:, :8]
    same_x, no_mask = pad_sequences(short, None, MULTIPLE)
    assert same_x is short and no_mask is None  # a multiple already: as it is


@pytest.mark.parametrize("masked", [True, False])
def test_a_padded_layer_computes_what_it_does_unpadded(masked, monkeypatch):
    x, mask, dy = inputs(masked)
    want = run(encoder(), x, mask, dy)
    padded = encoder(length_multiple=MULTIPLE)
    lengths = []
    eager_forward = Encoder.eager_forward
    monkeypatch.setattr(Encoder, "eager_forward", lambda self, x, mask: lengths.append(x.shape[1]) or
                        eager_forward(self, x, mask))
    assert_same(run(padded, x, mask, dy), want)
    assert lengths == [16]
    assert repr(padded).endswith("length_multiple=8)") and "length_multiple" not in repr(encoder())


def test_a_padded_stack_computes_what_it_does_unpadded():
    x, mask, dy = inputs(masked=True)
    want = run(EncoderStack([encoder(0), encoder(1)]), x, mask, dy)
    assert_same(run(EncoderStack([encoder(0, length_multiple=MULTIPLE), encoder(1, length_multiple=MULTIPLE)]),
                    x, mask, dy), want)


def test_a_stack_shares_one_length_multiple():
    x, mask, _ = inputs(masked=True)
    with pytest.raises(InputError, match="share one length_multiple"):
        EncoderStack([encoder(0, length_multiple=8), encoder(1, length_multiple=16)])(x, mask)


def test_padding_is_refused_where_the_attention_takes_no_mask(monkeypatch):
    x, _, _ = inputs(masked=False)
    padded = encoder(length_multiple=MULTIPLE)
    plan = padded.plan(B, 16, x.device, x.dtype)
    monkeypatch.setattr(type(plan), "takes_mask", property(lambda self: False))
    with pytest.raises(InputError, match="takes no padding mask"):
        padded(x)
    padded(x[:, :8])  # nothing to pad: runs


def test_an_injected_model_pads_its_batches_and_computes_what_it_did():
    transformers = pytest.importorskip("transformers")
    from substation import inject

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                     num_hidden_layers=2, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    reference = transformers.BertForMaskedLM(config).double()
    ids = torch.randint(2, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    for stack in (True, False):
        injected = inject(copy.deepcopy(reference), stack=stack, length_multiple=4)
        assert all(e.length_multiple == 4 for e in injected.modules() if isinstance(e, Encoder))
        got, want = injected(input_ids=ids, attention_mask=mask), reference(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(got.logits, want.logits)
