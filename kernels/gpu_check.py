"""Inputs, reference checks and runners for timing fused operators on the GPU (the profiler's GPU side)."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from substation.device import DeviceSpec
from substation.graph import Operator, layer_graph
from substation.kernels.base import KernelParams
from substation.layouts import logical
from substation.protocol import Step, StepContext
from substation.reference import FUSED, OpArgs, cover_reference
from substation.sizes import TORCH_DTYPES, Size
from substation.accuracy import relative_error

SEED, OFFSET = 1234, 1


def op_args(size: Size, p: float, native_dropout: bool = False) -> OpArgs:
    return OpArgs(scale=1 / math.sqrt(size.P), attention_dropout=p, hidden_dropout=p, seed=SEED, offset=OFFSET,
                  native_dropout=native_dropout).with_device_rng("cuda")


def random_input(name: str, layout: str, extents: dict[str, int], dtype: torch.dtype,
                 generator: torch.Generator) -> torch.Tensor:
    """Random values of the kind the tensor holds: a 0/1 mask keeping key 0, positive 1/std, else normal."""
    shape = [extents[d] for d in layout]
    if name == "M":
        mask = (torch.rand(shape, device="cuda", generator=generator) > 0.2).to(dtype)
        return mask.index_fill_(layout.index("k"), torch.tensor([0], device="cuda"), 1)
    if name.startswith("Rs"):
        return (torch.rand(shape, device="cuda", generator=generator) + 0.5).to(dtype)
    return torch.randn(shape, device="cuda", generator=generator).to(dtype)


def checked_runner(params: KernelParams, size: Size, p: float) -> tuple[Callable[[], None], float]:
    """A closure launching the kernel on random inputs (bound once, on PyTorch's current stream of the
    current device), and its outputs' max relative error vs the float32 torch reference on the same inputs
    (same dropout masks)."""
    graph, op = layer_graph(), layer_graph().operator(params.op)
    dtype, ext, layouts = TORCH_DTYPES[params.dtype], size.extents, dict(params.layouts)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name in op.inputs + op.outputs:
        tensors[name] = (random_input(name, layouts[name], ext, dtype, generator) if name in op.inputs
                         else torch.empty([ext[d] for d in layouts[name]], device="cuda", dtype=dtype))
    args = op_args(size, p)
    device = torch.cuda.current_device()
    params.check_tensors(tensors)
    bound = params.bind(params.compile(DeviceSpec.of(device)), device)
    pointers = [tensors[name].data_ptr() for name in bound.names]

    def run() -> None:
        bound(pointers, args, torch.cuda.current_stream().cuda_stream)

    run()
    inputs = [logical(tensors[n], layouts[n], graph.tensors[n].dims).float() for n in op.inputs]
    want = FUSED[op.name](args, *inputs)
    error = max(relative_error(logical(tensors[n], layouts[n], graph.tensors[n].dims), w)
                for n, w in zip(op.outputs, want))
    return run, error


def checked_step(step: Step, layouts: Mapping[str, str], size: Size) -> tuple[Callable[[], None], float]:
    """A closure running a bound step of a multi-operator cover on random inputs in `layouts` (on PyTorch's current
    stream), and its outputs' max relative error against the float64 reference of the cover's operators."""
    graph, extents, dtype = layer_graph(), size.extents, TORCH_DTYPES[size.dtype]
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = {t: random_input(t, layouts[t], extents, dtype, generator) for t in step.inputs}
    ctx = StepContext(OpArgs(scale=1 / math.sqrt(size.P)), extents, torch.cuda.current_stream().cuda_stream)
    out = step(inputs, ctx)
    want = cover_reference(step.ops, inputs, layouts, ctx.args, graph)
    error = max(relative_error(logical(out[t], layouts[t], graph.tensors[t].dims), want[t]) for t in step.outputs)
    return (lambda: step(inputs, ctx)), error


def torch_runner(op: Operator, size: Size, p: float) -> Callable[[], object]:
    """PyTorch's op sequence for the operator (the reference's ops, PyTorch's dropout), canonical layouts."""
    graph, ext, dtype = layer_graph(), size.extents, TORCH_DTYPES[size.dtype]
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = [random_input(n, graph.tensors[n].dims, ext, dtype, generator) for n in op.inputs]
    args, function = op_args(size, p, native_dropout=True), FUSED[op.name]
    return lambda: function(args, *inputs)
