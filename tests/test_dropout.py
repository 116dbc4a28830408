"""Counter-based dropout: Philox-4x32 known answers (7 and 10 rounds), the counter scheme, mask statistics and
scaling."""
import math
import random

import pytest
import torch

from substation.dropout import PHILOX_ROUNDS, dropout, keep_mask, mulhilo32, philox4x32, threshold

MASK32 = 0xFFFFFFFF


def philox_python(counter: tuple[int, ...], key: tuple[int, int], rounds: int = PHILOX_ROUNDS) -> tuple[int, ...]:
    """Philox-4x32 in Python big ints, straight from Random123's philox.h."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r > 0:
            k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


# Random123's kat_vectors for philox4x32 with 7 rounds (the stream's) and 10 (cuRAND's).
KAT = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (MASK32,) * 4, (MASK32, MASK32), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("rounds, counter, key, expected", KAT)
def test_philox_known_answers(rounds, counter, key, expected):
    out = philox4x32(torch.tensor([counter], dtype=torch.int64), key, rounds)
    assert out.tolist() == [list(expected)]
    assert philox_python(counter, key, rounds) == expected


def test_stream_is_philox_with_seven_rounds():
    """keep_mask against Random123's 7-round known answer for counter 0 and key 0 (seed, offset, site all 0):
    the stream's rounds are pinned by the spec's vectors, not by the module's own constant."""
    words = KAT[0][3]
    want = [((words[e // 2] >> (16 * (e % 2))) & 0xFFFF) >= 32768 for e in range(8)]
    assert keep_mask((8,), 0.5, seed=0, offset=0, site=0).tolist() == want


def test_philox_matches_python_on_random_counters():
    rng = random.Random(0)
    counters = [tuple(rng.getrandbits(32) for _ in range(4)) for _ in range(64)]
    key = (rng.getrandbits(32), rng.getrandbits(32))
    out = philox4x32(torch.tensor(counters, dtype=torch.int64).view(8, 8, 4), key)
    assert out.shape == (8, 8, 4)
    assert [tuple(w) for w in out.view(-1, 4).tolist()] == [philox_python(c, key) for c in counters]


def test_mulhilo_matches_big_ints():
    rng = random.Random(1)
    extremes = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, MASK32]
    bs = extremes + [rng.getrandbits(32) for _ in range(1000)]
    for a in extremes + [0xD2511F53, 0xCD9E8D57] + [rng.getrandbits(32) for _ in range(20)]:
        hi, lo = mulhilo32(a, torch.tensor(bs, dtype=torch.int64))
        assert hi.tolist() == [(a * b) >> 32 for b in bs], f"{a=:#x}"
        assert lo.tolist() == [(a * b) & MASK32 for b in bs], f"{a=:#x}"


def reference_keep(n: int, p: float, seed: int, offset: int, site: int) -> list[bool]:
    """The spec in Python big ints: element e uses block e // 8, word (e % 8) // 2, 16-bit half e % 2 (0 = low)."""
    cut = min(round(p * 65536), 65536)
    keep = []
    for e in range(n):
        word = philox_python((e // 8, 0, site, offset), (seed & MASK32, seed >> 32))[(e % 8) // 2]
        keep.append((word >> (16 * (e % 2))) & 0xFFFF >= cut)
    return keep


@pytest.mark.parametrize("shape", [(3, 7), (5, 8), (2, 2, 9), (1,), (0, 3)])  # partial and whole last blocks
@pytest.mark.parametrize("p", [0.1, 0.5, 0.73])
def test_keep_mask_counter_scheme(shape, p):
    seed, offset, site = 0x0123456789ABCDEF, 17, 2
    want = torch.tensor(reference_keep(math.prod(shape), p, seed, offset, site), dtype=torch.bool).view(shape)
    assert torch.equal(keep_mask(shape, p, seed, offset, site), want)


def test_keep_mask_low_half_first():
    """Element 8j + 2w of a block is word w's low 16 bits, element 8j + 2w + 1 its high 16 bits."""
    seed, offset, site = 2**63 + 5, 3, 1
    words = philox_python((0, 0, site, offset), (seed & MASK32, seed >> 32))
    want = [((words[e // 2] >> (16 * (e % 2))) & 0xFFFF) >= 32768 for e in range(8)]
    assert keep_mask((8,), 0.5, seed, offset, site).tolist() == want


def test_keep_mask_depends_on_linear_index_only():
    n = 8 * (1 << 16) * 2 + 10  # crosses keep_mask's CPU chunks, ends in a partial block
    flat = keep_mask((n,), 0.3, 5, 6, 1)
    assert torch.equal(keep_mask((2, n // 2), 0.3, 5, 6, 1).reshape(-1), flat)
    assert torch.equal(keep_mask((1000,), 0.3, 5, 6, 1), flat[:1000])


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3, 0.5, 0.9])
def test_keep_rate_within_binomial_interval(p):
    n = 1_000_003
    kept = int(keep_mask((n,), p, seed=42, offset=3, site=1).sum())
    half_width = 2.576 * math.sqrt(n * p * (1 - p))  # 99% normal approximation
    assert abs(kept - n * (1 - p)) <= half_width, f"{kept=}, expected {n * (1 - p):.0f} ± {half_width:.0f}"


def binomial_interval(n: int, q: float, mass: float) -> tuple[int, int]:
    """The central interval of Binomial(n, q) holding at least `mass`, from its exact pmf (in log space) over
    ±10 standard deviations (the mass beyond is below 1e-22)."""
    tail, sd = (1 - mass) / 2, math.sqrt(n * q * (1 - q))
    ks = range(max(0, int(n * q - 10 * sd)), min(n, int(n * q + 10 * sd) + 1) + 1)
    cdf, low, high = 0.0, None, None
    for k in ks:
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(q)
                        + (n - k) * math.log1p(-q))
        if low is None and cdf > tail:
            low = k
        if high is None and cdf >= 1 - tail:
            high = k
    return low, high


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seed, offset, site", [(42, 3, 1), (2**63 + 5, 0, 0)])
def test_drop_rate_within_binomial_999_interval(p, seed, offset, site):
    """P(drop) is threshold / 2**16, within 2**-17 of p: a large mask's drop count lies in that binomial's
    central 99.9 % interval."""
    n = 2_000_003  # ends in a partial Philox block
    q = threshold(p) / 65536
    assert abs(q - p) <= 2**-17
    dropped = n - int(keep_mask((n,), p, seed, offset, site).sum())
    low, high = binomial_interval(n, q, 0.999)
    assert low <= dropped <= high, f"{dropped=} outside [{low}, {high}] for {p=}"


@pytest.mark.parametrize("p, kept", [(0.0, True), (1.0, False), (2**-18, True), (1 - 2**-18, False)])
def test_threshold_extremes_keep_or_drop_all(p, kept):
    """p = 0 (and any p <= 2**-17) keeps every element; p = 1 (and any p >= 1 - 2**-17) drops every one."""
    mask = keep_mask((3, 1001), p, 7, 1, 2)
    assert bool(mask.all()) if kept else not mask.any()


@pytest.mark.parametrize("p, want", [(0.0, 0), (0.1, 6554), (0.5, 32768), (1.0, 65536), (2**-17, 0),
                                     (3 * 2**-17, 2), (1 - 2**-17, 65536), (1 - 3 * 2**-17, 65534)])
def test_threshold_rounds_half_to_even(p, want):
    assert threshold(p) == want
    assert abs(threshold(p) / 65536 - p) <= 2**-17


def test_same_arguments_same_mask():
    args = ((64, 33), 0.2, 7, 11, 2)
    assert torch.equal(keep_mask(*args), keep_mask(*args))


@pytest.mark.parametrize("change", [dict(seed=8), dict(seed=7 + 2**32), dict(offset=12), dict(site=1)])
def test_different_stream_different_mask(change):
    base = dict(seed=7, offset=11, site=2)
    assert not torch.equal(keep_mask((64, 33), 0.2, **base), keep_mask((64, 33), 0.2, **(base | change)))


def test_mask_independent_of_dtype_and_strides():
    x = torch.rand(4, 16, 33, dtype=torch.float64) + 1.0  # no zeros of its own
    y64 = dropout(x, 0.25, 3, 4, 0)
    y32 = dropout(x.float(), 0.25, 3, 4, 0)
    ync = dropout(x.transpose(0, 2).contiguous().transpose(0, 2), 0.25, 3, 4, 0)  # same logical tensor
    assert torch.equal(y64 == 0, y32 == 0)
    assert torch.equal(y64, ync)
    assert torch.equal(y64 != 0, keep_mask(x.shape, 0.25, 3, 4, 0))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_kept_values_scaled_exactly(p):
    x = torch.randn(1000, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    keep = keep_mask(x.shape, p, 1, 2, 1)
    y = dropout(x, p, 1, 2, 1)
    assert y.dtype == x.dtype
    assert torch.equal(y[keep], x[keep] * (1.0 / (1 - p)))
    assert torch.all(y[~keep] == 0)


def test_backward_applies_the_same_mask():
    x = torch.randn(8, 50, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(8, 50, dtype=torch.float64)
    dropout(x, 0.4, 9, 1, 2).backward(dy)
    torch.testing.assert_close(x.grad, dropout(dy, 0.4, 9, 1, 2), rtol=0, atol=0)


def test_p_zero_and_one():
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    assert torch.equal(dropout(x, 0.0, 1, 2, 0), x)
    assert keep_mask(x.shape, 0.0, 1, 2, 0).all()
    y = dropout(x, 1.0, 1, 2, 0)
    assert torch.equal(y, torch.zeros_like(x))
    assert not keep_mask(x.shape, 1.0, 1, 2, 0).any()
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert (threshold(0.0), threshold(0.5), threshold(1.0)) == (0, 2**15, 2**16)


@pytest.mark.parametrize("name, value", [
    ("p", -0.1), ("p", 1.5), ("p", math.nan), ("seed", -1), ("seed", 2**64), ("offset", -1),
    ("offset", 2**32), ("site", -1), ("site", 2**32),
])
def test_bad_arguments_raise(name, value):
    args = dict(p=0.1, seed=0, offset=0, site=0) | {name: value}
    with pytest.raises(ValueError, match=name):
        keep_mask((4, 4), **args)
    with pytest.raises(ValueError, match=name):
        dropout(torch.ones(4, 4), **args)


def test_bad_shape_and_counter_raise():
    with pytest.raises(ValueError, match="shape"):
        keep_mask((4, -1), 0.1, 0, 0, 0)
    with pytest.raises(ValueError, match="counter"):
        philox4x32(torch.zeros(3, dtype=torch.int64), (0, 0))
    with pytest.raises(ValueError, match="key"):
        philox4x32(torch.zeros(1, 4, dtype=torch.int64), (2**32, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mask_equals_cpu():
    shape = (3, 1 << 20)  # crosses the CPU chunks; the GPU path uses its own chunk size
    cpu = keep_mask(shape, 0.1, 2**63 + 5, 7, 2)
    gpu = keep_mask(shape, 0.1, 2**63 + 5, 7, 2, device="cuda")
    assert gpu.is_cuda
    assert torch.equal(gpu.cpu(), cpu)
    x = torch.randn(shape, dtype=torch.float64)
    assert torch.equal(dropout(x.cuda(), 0.1, 2**63 + 5, 7, 2).cpu(), dropout(x, 0.1, 2**63 + 5, 7, 2))
