"""Problem sizes of one encoder layer: batch, sequence length, heads, head size, embedding, FFN width."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch

from substation.errors import SizeError

DTYPES = ("float16", "bfloat16", "float32", "float64")
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # the one name <-> torch.dtype table


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


def get_size(name_or_size: str | Size, dtype: str | None = None) -> Size:
    """A preset by name (or a Size as is), optionally with another dtype."""
    if isinstance(name_or_size, Size):
        size = name_or_size
    elif name_or_size in PRESETS:
        size = PRESETS[name_or_size]
    else:
        raise SizeError(f"unknown size preset {name_or_size!r}; known presets: {', '.join(PRESETS)}")
    return size if dtype is None else size.with_dtype(dtype)
