"""Problem sizes of one encoder layer: batch, sequence length, heads, head size, embedding, FFN width."""
from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass

import torch

from substation.errors import SizeError

DTYPES = ("float16", "bfloat16", "float32", "float64")
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # the one name <-> torch.dtype table
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # its inverse


@dataclass(frozen=True)
class Size:
    """One layer's sizes. Dim letters: B batch, L = J = K sequence, H heads, P head size, I = H*P, U FFN."""

    B: int
    L: int
    H: int
    P: int
    I: int
    U: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("B", "L", "H", "P", "I", "U"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise SizeError(f"{name}={value!r} must be a positive integer")
            object.__setattr__(self, name, int(value))  # numpy's integers too, stored as Python ints
        if self.I != self.H * self.P:
            raise SizeError(f"I={self.I} must equal H*P = {self.H}*{self.P} = {self.H * self.P}")
        if self.dtype not in DTYPES:
            raise SizeError(f"dtype={self.dtype!r}, expected one of {DTYPES}")

    @property
    def extents(self) -> dict[str, int]:
        """The extent of every dimension letter of the graph (lower case, as in layouts)."""
        return {"b": self.B, "j": self.L, "k": self.L, "h": self.H, "p": self.P, "i": self.I,
                "u": self.U, "t": 3}

    def dims(self) -> dict[str, int]:
        """The six problem sizes, as written into profiles and configurations."""
        return {name: getattr(self, name) for name in ("B", "L", "H", "P", "I", "U")}

    def with_dtype(self, dtype: str) -> Size:
        return dataclasses.replace(self, dtype=dtype)

    @classmethod
    def from_heads(cls, B: int, L: int, H: int, P: int, U: int, dtype: str = "float16") -> Size:
        return cls(B=B, L=L, H=H, P=P, I=H * P, U=U, dtype=dtype)


PRESETS: dict[str, Size] = {
    "bert-large-b8-l512": Size(B=8, L=512, H=16, P=64, I=1024, U=4096),
    "bert-large-b96-l128": Size(B=96, L=128, H=16, P=64, I=1024, U=4096),
}


HEAD_DIMS = ("B", "L", "H", "P", "U")  # what a size spec gives; I = H*P follows
SIZE_SPEC_HELP = (f"a preset ({', '.join(PRESETS)}); B=..,L=..,H=..,P=..,U=.. (I = H*P); a preset with some of "
                  "them changed, PRESET:B=..,L=..; or a size's name, b16-l384-h16-p64-u4096")
_NAME = re.compile(r"b(\d+)-l(\d+)-h(\d+)-p(\d+)-u(\d+)")


def get_size(spec: str | Size, dtype: str | None = None) -> Size:
    """The Size of a spec (SIZE_SPEC_HELP; a Size as is), optionally with another dtype; SizeError names the part
    of the spec at fault."""
    if isinstance(spec, Size):
        size = spec
    else:
        size = PRESETS.get(spec.strip()) or _custom_size(spec.strip())
    return size if dtype is None else size.with_dtype(dtype)


def size_name(size: Size) -> str:
    """The name of a size's dims, for directories and results: its preset's name, else `b16-l384-h16-p64-u4096`
    (which `get_size` reads back)."""
    preset = next((name for name, known in PRESETS.items() if known.dims() == size.dims()), None)
    return preset or f"b{size.B}-l{size.L}-h{size.H}-p{size.P}-u{size.U}"


def _custom_size(spec: str) -> Size:
    """`B=..,L=..,H=..,P=..,U=..`, `PRESET:B=..,L=..` or `b16-l384-h16-p64-u4096`."""
    named = _NAME.fullmatch(spec)
    preset, colon, given = spec.rpartition(":")
    if named:
        dims = dict(zip(HEAD_DIMS, map(int, named.groups())))
    elif colon:
        if preset not in PRESETS:
            raise SizeError(f"size {spec!r}: unknown size preset {preset!r}; known presets: {', '.join(PRESETS)}")
        base = PRESETS[preset]
        dims = {name: getattr(base, name) for name in HEAD_DIMS} | _dims(spec, given)
    elif "=" in spec:
        dims = _dims(spec, given)
        missing = [name for name in HEAD_DIMS if name not in dims]
        if missing:
            raise SizeError(f"size {spec!r} misses {', '.join(missing)} (or change a preset's: PRESET:B=..,L=..)")
    else:
        raise SizeError(f"unknown size preset {spec!r}; known presets: {', '.join(PRESETS)}; or give "
                        "B=..,L=..,H=..,P=..,U=..")
    try:
        return Size.from_heads(**dims)
    except SizeError as err:
        raise SizeError(f"size {spec!r}: {err}") from None


def _dims(spec: str, given: str) -> dict[str, int]:
    """The `NAME=VALUE` parts of `given` (from the spec `spec`), each of HEAD_DIMS at most once."""
    dims: dict[str, int] = {}
    for part in given.split(","):
        name, equals, value = (text.strip() for text in part.partition("="))
        if not equals or name not in HEAD_DIMS:
            raise SizeError(f"size {spec!r}: {part.strip()!r} is not NAME=VALUE with NAME one of "
                            f"{', '.join(HEAD_DIMS)} (I = H*P follows)")
        if name in dims:
            raise SizeError(f"size {spec!r}: {name} is given twice")
        try:
            dims[name] = int(value)
        except ValueError:
            raise SizeError(f"size {spec!r}: {name}={value!r} is not an integer") from None
    return dims
