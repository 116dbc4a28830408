"""softmax (scale + padding mask + softmax over k + dropout) and softmax_bwd, for any layouts.

A block owns `rows` consecutive rows (along `tile`, one of b, h, j) and the whole k extent: it moves
them through shared memory in each tensor's own layout order (coalesced wherever a tensor's innermost
dim is k or `tile`), one warp per row reduces over k, and the dropout mask is regenerated from
Philox (see substation/dropout.py), so the backward needs no stored mask.

    forward:  S: bhjk, M: bk -> Pr = softmax(S/sqrt(P) + mask), A = dropout(Pr)   (any layouts)
    backward: dA, Pr -> dS = Pr·(dPr − Σ_k dPr·Pr)/sqrt(P), dPr = dropout(dA)
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from substation.device import H100, DeviceSpec
from substation.graph import DROPOUT_SITES
from substation.kernels.base import ITEMSIZE, KernelParams, RowTile, ScaledDropoutLaunch, strides, widest_vector
from substation.sizes import Size

FREE = "bhj"  # the row dims; k is reduced


@dataclass(frozen=True)
class SoftmaxParams(RowTile, ScaledDropoutLaunch, KernelParams):
    B: int = 1
    H: int = 1
    L: int = 1
    tile: str = "j"
    rows: int = 16
    vec: int = 1
    threads: int = 256

    template = "softmax.cu.j2"
    reduced = "k"

    def size_fields(self) -> tuple[str, ...]:
        return ("B", "H", "L")

    @property
    def backward(self) -> bool:
        return self.op == "softmax_bwd"

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return {"b": self.B, "h": self.H, "j": self.L, "k": self.L}

    @property
    def tiled_tensors(self) -> list[tuple[str, str, bool]]:
        """(name, layout, is_output) of the tensors that move through shared memory, loads first."""
        outputs = {"Pr", "A"} if not self.backward else {"dS"}
        return [(n, lay, n in outputs) for n, lay in self.layouts if n != "M"]



    @functools.cached_property
    def shared_bytes(self) -> int:
        return 2 * self.rows * self.pitch * ITEMSIZE[self.dtype]

    def check(self, spec: DeviceSpec = H100) -> None:
        super().check(spec)
        self.check_row_tile(FREE)
        self.check_threads()
        self.check_shared_memory(spec)

    def render_context(self) -> dict[str, object]:
        ext = self.extents
        others = [d for d in FREE if d != self.tile]
        tensors = []
        for name, layout, is_output in self.tiled_tensors:
            st = strides(layout, ext)
            base = " + ".join([f"(long long){d} * {st[d]}" for d in others] + [f"(long long){self.tile}0 * {st[self.tile]}"])
            tensors.append(dict(name=name, base=base, stride_tile=st[self.tile], stride_red=st["k"],
                                sweep=self.sweep(layout), vec=self.vec_of(layout), output=is_output))
        mask = strides(dict(self.layouts).get("M", "bk"), {"b": self.B, "k": self.L})
        return dict(BACKWARD=self.backward, TENSORS=tensors, ROWS=self.rows, RED=self.L, PITCH=self.pitch,
                    THREADS=self.threads, TILE=self.tile, CHUNKS=ext[self.tile] // self.rows,
                    OTHERS=[(d, ext[d]) for d in others], H=self.H, SITE=DROPOUT_SITES["attention"],
                    M_STRIDE_B=mask["b"], M_STRIDE_K=mask["k"])

    @functools.cached_property
    def grid(self) -> int:
        return self.B * self.H * self.L // self.rows


OPS = ("softmax", "softmax_bwd")
PARAMS = {op: SoftmaxParams for op in OPS}


def variants(op: str, size: Size, dtype: str, layouts: dict[str, str], spec: DeviceSpec = H100
             ) -> list[SoftmaxParams]:
    """The knob settings the profiler tries for one layout combination: a tile dim that is some tensor's
    innermost dim (else j), 8 or 16 rows, the widest vector feasible on `spec`."""
    tiles = sorted({lay[-1] for lay in layouts.values() if lay[-1] in FREE}) or ["j"]
    found = []
    for tile, rows in itertools.product(tiles, (8, 16)):
        found.append(widest_vector(lambda vec: SoftmaxParams(op=op, dtype=dtype, layouts=tuple(layouts.items()),
                                                             B=size.B, H=size.H, L=size.L, tile=tile, rows=rows,
                                                             vec=vec), spec))
    return [p for p in found if p is not None]
