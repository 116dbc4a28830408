"""Counter-based dropout: the torch reference that Substation's CUDA kernels reproduce bit for bit.

A dropout mask is a pure function of (logical shape, p, seed, offset, site), never of a generator's
state, so the forward and the backward (and any kernel, in any layout) regenerate the same mask
without storing it. The random bits come from Philox-4x32 with 7 rounds (Salmon et al., SC'11), as Random123
defines `philox4x32_R(7, ...)`. Why 7 and not cuRAND's 10: Salmon et al. found Philox-4x32 to pass TestU01's
BigCrush from 7 rounds on and chose 10 as a safety margin; FlashAttention-2 draws its attention dropout from 7
(csrc/flash_attn/src/philox.cuh). Our attention regenerates the mask of every score in its forward and again in
its backward: 7 rounds instead of 10 took ~5 µs (2 %) off its forward + backward at both BERT-large sizes on the
H100 (`layouts/h100-philox-rounds-ab.json`).

Counter scheme (kernels must implement exactly this):

* The mask belongs to the *logical* tensor (canonical dims order, row-major). Element n of it, its
  row-major linear index, uses the Philox block j = n // 8, its output word (n % 8) // 2 and, of that
  32-bit word, the 16-bit half n % 2 (0 = the low half, bits 0..15; 1 = bits 16..31): one Philox call
  serves 8 consecutive elements.
* Block j's counter is (c0, c1, c2, c3) = (j & 0xFFFFFFFF, j >> 32, site, offset) and its key is
  (k0, k1) = (seed & 0xFFFFFFFF, seed >> 32). `site` tells apart the dropouts of one step (see
  `substation.graph.DROPOUT_SITES`); `offset` is advanced once per training step.
* The element is kept iff its 16-bit value >= threshold, threshold = min(round(p * 2**16), 2**16) with
  round half to even (Python's `round`; p * 2**16 is exact in a double): p = 0 keeps every element,
  p = 1 none, and otherwise P(drop) = threshold / 2**16, within 2**-17 of p (so p <= 2**-17 keeps
  every element and p >= 1 - 2**-17 drops every one).
* Kept elements are multiplied by scale = 1 / (1 - p), rounded once (inverted dropout); dropped ones
  become 0.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

Tensor = torch.Tensor

MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments: golden ratio, sqrt(3) - 1
PHILOX_ROUNDS = 7  # the stream's rounds (the module docstring says why 7)
_CPU_CHUNK, _DEVICE_CHUNK = 1 << 16, 1 << 22  # Philox blocks (8 elements each) per vectorized step in keep_mask

__all__ = ["PHILOX_ROUNDS", "dropout", "keep_mask", "mulhilo32", "philox4x32", "threshold"]


def mulhilo32(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """The high and low 32-bit words of the 64-bit product a * b of uint32 values.

    `a` is a Python int in [0, 2**32); `b` an int64 tensor of uint32 values. The full product overflows
    int64 (and torch has no uint64 arithmetic on every device), so `b` is split into 16-bit halves:
    every partial product and sum below stays under 2**49, and the hi/lo words are read off them.
    """
    t = a * (b & 0xFFFF)  # < 2**48
    s = a * (b >> 16) + (t >> 16)  # the product >> 16; < 2**48 + 2**32
    hi = s >> 16
    lo = ((s & 0xFFFF) << 16) | (t & 0xFFFF)
    return hi, lo


def philox4x32(counter: Tensor, key: tuple[int, int], rounds: int = PHILOX_ROUNDS) -> Tensor:
    """Philox-4x32 with `rounds` rounds, as Random123's `philox4x32_R(rounds, ...)` defines it (cuRAND's is 10).

    counter: int64 [..., 4] of uint32 values (c0, c1, c2, c3); key: (k0, k1), uint32 each.
    Returns int64 [..., 4] of uint32 values, on counter's device. Only int64 torch ops are used, so
    CPU and CUDA give identical bits.
    """
    if counter.dtype != torch.int64 or counter.shape[-1:] != (4,):
        raise ValueError(f"{counter.dtype=}, {counter.shape=}, expected int64 [..., 4]")
    k0, k1 = (int(k) for k in key)
    for name, k in (("key[0]", k0), ("key[1]", k1)):
        if not 0 <= k <= MASK32:
            raise ValueError(f"{name}={k} must lie in [0, 2**32)")
    c0, c1, c2, c3 = counter.unbind(-1)
    for r in range(rounds):
        if r > 0:  # the key is bumped between rounds, not before the first nor after the last
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = mulhilo32(PHILOX_M1, c2)
        # hi and lo words are already < 2**32, and xor of uint32 values stays uint32: no masking needed.
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def threshold(p: float) -> int:
    """The 16-bit value below which an element is dropped: min(round(p * 2**16), 2**16), half to even.

    p * 65536 is exact in a double, so Python's `round` (half to even) rounds it exactly once; the drop
    probability threshold / 2**16 is then within 2**-17 of p. p is checked by the callers (`_check_args`).
    """
    return min(round(p * 65536.0), 65536)


def _check_args(p: float, seed: int, offset: int, site: int) -> None:
    if not 0.0 <= p <= 1.0:  # also rejects NaN
        raise ValueError(f"p={p} must lie in [0, 1]")
    for name, value, bound in (("seed", seed, "2**64"), ("offset", offset, "2**32"), ("site", site, "2**32")):
        value = operator.index(value)  # TypeError for floats and other non-integers
        if not 0 <= value < (2**64 if name == "seed" else 2**32):
            raise ValueError(f"{name}={value} must lie in [0, {bound})")


def keep_mask(shape: Sequence[int], p: float, seed: int, offset: int, site: int,
              device: torch.device | str | None = None) -> Tensor:
    """The dropout keep mask of a logical tensor of `shape`: bool, True where the element survives.

    Element n (row-major) is kept iff the 16-bit half n % 2 (0 = low) of word (n % 8) // 2 of
    philox4x32((j & 0xFFFFFFFF, j >> 32, site, offset), (seed & 0xFFFFFFFF, seed >> 32)), j = n // 8,
    is >= `threshold(p)`. The module docstring gives the full scheme. p in [0, 1]; seed in [0, 2**64);
    offset, site in [0, 2**32).
    """
    _check_args(p, seed, offset, site)
    shape = tuple(operator.index(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape={shape} has a negative dim")
    numel = math.prod(shape)
    seed, offset, site = operator.index(seed), operator.index(offset), operator.index(site)
    key, cut = (seed & MASK32, seed >> 32), threshold(p)
    if cut in (0, 65536):  # p (rounded) 0 or 1: every element kept or dropped, no Philox call needed
        return torch.full(shape, cut == 0, dtype=torch.bool, device=device)
    blocks = (numel + 7) // 8
    keep = torch.empty(blocks, 4, 2, dtype=torch.bool, device=device)
    # Blocks go through Philox in chunks: run on all blocks at once, each of its ~260 elementwise ops
    # allocates (and page-faults) a fresh buffer of all blocks; cache-sized chunks make the CPU ~15x faster.
    chunk = _CPU_CHUNK if keep.device.type == "cpu" else _DEVICE_CHUNK
    for start in range(0, blocks, chunk):
        j = torch.arange(start, min(start + chunk, blocks), dtype=torch.int64, device=keep.device)
        counter = torch.stack((j & MASK32, j >> 32, torch.full_like(j, site), torch.full_like(j, offset)), dim=-1)
        words = philox4x32(counter, key)  # [blocks, 4]: word w serves elements 8j + 2w (low half), 8j + 2w + 1
        keep[start:start + len(j), :, 0] = (words & 0xFFFF) >= cut
        keep[start:start + len(j), :, 1] = (words >> 16) >= cut
    return keep.view(-1)[:numel].reshape(shape)


def dropout(x: Tensor, p: float, seed: int, offset: int, site: int) -> Tensor:
    """Inverted dropout of the logical tensor x: x * keep * (1 / (1 - p)), in x's dtype and on its device.

    x: any shape, in canonical dims order (the mask is indexed by its logical row-major positions).
    The mask is `keep_mask(x.shape, p, seed, offset, site)`, independent of x's values, dtype, device
    and strides, so the backward calls this same function on the output gradient. p == 0 returns x
    itself; p == 1 returns zeros (no division by 0).
    """
    _check_args(p, seed, offset, site)
    if p == 0.0:
        return x
    if p == 1.0:  # masked_fill, not zeros_like, keeps x in the autograd graph (with a zero gradient)
        return x.masked_fill(torch.ones((), dtype=torch.bool, device=x.device), 0)
    keep = keep_mask(x.shape, p, seed, offset, site, device=x.device)
    # A multiply by the rounded scale, not a division: CPU torch divides by a scalar as a multiply by
    # its reciprocal, so a division would differ between devices (and from the kernels) by an ulp.
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))
