"""Sequences padded to a multiple of a length (an Encoder's `length_multiple`), so that training on batches of
varying length runs a few shapes, not one per length.

Every new (B, L) costs an Encoder a plan (kernels specialized to the shape, from the disk cache or nvcc) and, with
`cuda_graphs=True`, a capture of its graphs; only the `max_shapes` used last are kept. Batches padded to their
longest sequence (transformers' collators) bring a new L most steps. Padded to a multiple of 64, lengths up to 512
make 8 shapes.

The padding is exact: the new positions are keys no query attends to (the key-padding mask holds 0 there), their
own outputs are cut off, and their rows receive a zero gradient, so they add nothing to any parameter's gradient.
Only the dropout masks change: Substation's Philox stream numbers elements by position in the padded shape.
"""
from __future__ import annotations

import torch
from torch.nn import functional

from substation.errors import InputError

Tensor = torch.Tensor


def check_length_multiple(multiple: int | None) -> None:
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        raise ValueError(f"length_multiple={multiple!r} must be a positive integer, or None (no padding)")


def padded_length(length: int, multiple: int | None) -> int:
    """`length` rounded up to a multiple of `multiple` (None: as it is)."""
    return length if multiple is None else -(-length // multiple) * multiple


def pad_sequences(x: Tensor, mask: Tensor | None, multiple: int | None, ones: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """x [B, L, I] and its key-padding mask [B, L] (1 keeps; None: none) padded along L to the next multiple of
    `multiple`: x with zeros, the mask with 0. Unchanged where L is a multiple already. `ones`: the all-ones mask
    [B, L] to pad where there is none (a caller's cached one), else made here."""
    length = x.shape[1]
    extra = padded_length(length, multiple) - length
    if not extra:
        return x, mask
    if mask is None:
        mask = ones if ones is not None else torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
    return functional.pad(x, (0, 0, 0, extra)), functional.pad(mask, (0, extra))


def refuse_without_mask(multiple: int, length: int) -> InputError:
    """The error where padding is due and the configuration's attention takes no padding mask."""
    return InputError(f"length_multiple={multiple} pads sequences of length {length} to "
                      f"{padded_length(length, multiple)}, which masks the new positions, and this configuration's "
                      "attention takes no padding mask (it was optimized with --no-padding-mask): use a "
                      "configuration with a mask, or length_multiple=None")
