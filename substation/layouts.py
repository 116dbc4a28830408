"""Layouts: a tensor's dims in memory order, row-major, the last letter contiguous.

X in `bji` is PyTorch's [B, J, I]; in `jbi` it is sequence-first. A `Configuration` gives every
tensor of the layer graph one layout, or, for a *split variable*, one layout for the forward pass
and another one that backward operators read (the optimizer pays a transpose where they differ).
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from substation.errors import LayoutError
from substation.graph import LayerGraph, Pass, layer_graph

# The tensors a user hands in or gets back keep PyTorch's [B, L, I] unless the user frees them.
USER_VISIBLE = ("X", "Y", "dX", "dY")


def enumerate_layouts(dims: str) -> list[str]:
    """Every layout of a tensor with these dims: all n! orders, the canonical order first."""
    return ["".join(order) for order in itertools.permutations(dims)]


def check_layout(tensor: str, dims: str, layout: str) -> None:
    """Raise LayoutError unless `layout` is an order of exactly `dims`."""
    if not isinstance(layout, str) or sorted(layout) != sorted(dims):
        raise LayoutError(f"tensor {tensor!r}: layout {layout!r} is not an order of its dims "
                          f"{sorted(dims)} (e.g. {dims!r})")


def tied_layouts(graph: LayerGraph) -> dict[str, str]:
    """Tensors whose layout must equal another's: a parameter's gradient is stored like the parameter."""
    return {s.name: s.grad_of for s in graph.tensors.values()
            if s.grad_of is not None and graph.tensors[s.grad_of].role == "parameter"}


def permutation(src: str, dst: str) -> tuple[int, ...]:
    """The `Tensor.permute` argument that turns a tensor laid out as `src` into one laid out as `dst`."""
    return tuple(src.index(d) for d in dst)


def stored(x, src: str, dst: str):
    """A torch tensor laid out as `src`, stored contiguously in layout `dst` (x itself only where it is contiguous
    and the layouts agree): what a kernel reading `dst` by its strides takes."""
    return x.permute(permutation(src, dst)).contiguous()


def to_layout(x, src: str, dst: str):
    """A torch tensor laid out as `src`, copied into layout `dst` (returned as is where they agree)."""
    return x if src == dst else stored(x, src, dst)


def logical(x, layout: str, dims: str):
    """A torch tensor laid out as `layout`, viewed with its letters in the order `dims` (no copy)."""
    return x.permute(permutation(layout, dims))


@dataclass(frozen=True)
class Configuration:
    """One layout per tensor; `backward` overrides the layout backward operators read (split variables)."""

    layouts: Mapping[str, str]
    backward: Mapping[str, str] = field(default_factory=dict)
    free_user_layouts: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", MappingProxyType(dict(self.layouts)))
        object.__setattr__(self, "backward", MappingProxyType(dict(self.backward)))
        self.validate(layer_graph())

    def __reduce__(self):  # the read-only views do not pickle (nor deepcopy): rebuild from plain dicts
        return type(self), (dict(self.layouts), dict(self.backward), self.free_user_layouts)

    def validate(self, graph: LayerGraph) -> None:
        missing = sorted(set(graph.tensors) - set(self.layouts))
        unknown = sorted(set(self.layouts) - set(graph.tensors))
        if missing or unknown:
            raise LayoutError(f"configuration must give every tensor a layout: missing {missing}, unknown {unknown}")
        for name, layout in [*self.layouts.items(), *self.backward.items()]:
            if name not in graph.tensors:
                raise LayoutError(f"split variable {name!r} is not a tensor of the graph")
            check_layout(name, graph.tensors[name].dims, layout)
        for name in self.backward:
            if graph.producer(name) is None or graph.producer(name).pass_ != "forward":
                raise LayoutError(f"split variable {name!r} must be a forward activation read by the backward")
        for name, base in tied_layouts(graph).items():
            if self.layouts[name] != self.layouts[base]:
                raise LayoutError(f"tensor {name!r} must share the layout of {base!r} "
                                  f"({self.layouts[base]!r}), got {self.layouts[name]!r}")
        if not self.free_user_layouts:
            for name in USER_VISIBLE:
                want = graph.tensors[name].dims
                if self.layouts[name] != want:
                    raise LayoutError(f"tensor {name!r} is user-visible and keeps layout {want!r} "
                                      f"(got {self.layouts[name]!r}); free it with free_user_layouts=True")

    def layout(self, tensor: str, pass_: Pass = "forward") -> str:
        """The layout in which an operator of `pass_` reads `tensor`."""
        if pass_ == "backward" and tensor in self.backward:
            return self.backward[tensor]
        return self.layouts[tensor]

    @classmethod
    def default(cls, graph: LayerGraph | None = None) -> Configuration:
        """Every tensor in its canonical order: PyTorch's own layouts."""
        graph = graph or layer_graph()
        return cls({name: spec.dims for name, spec in graph.tensors.items()})

    @classmethod
    def random(cls, seed: int, graph: LayerGraph | None = None, split: tuple[str, ...] = ()) -> Configuration:
        """A seeded random valid configuration (tests and fuzzing); `split` tensors get a backward layout."""
        graph = graph or layer_graph()
        rng = random.Random(seed)
        ties = tied_layouts(graph)
        layouts = {name: spec.dims if name in USER_VISIBLE else rng.choice(enumerate_layouts(spec.dims))
                   for name, spec in graph.tensors.items()}
        layouts.update({name: layouts[base] for name, base in ties.items()})
        backward = {name: rng.choice(enumerate_layouts(graph.tensors[name].dims)) for name in split}
        return cls(layouts, backward)


def layout_space(graph: LayerGraph | None = None) -> Iterator[tuple[str, int]]:
    """(tensor, number of layouts) for every tensor whose layout is free to choose."""
    graph = graph or layer_graph()
    ties = tied_layouts(graph)
    for name, spec in graph.tensors.items():
        if name not in ties and name not in USER_VISIBLE:
            yield name, len(enumerate_layouts(spec.dims))
