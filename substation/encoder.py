"""`Encoder`: a drop-in BERT encoder layer (HF `BertLayer`'s math) running the layer graph.

The layer's forward and backward are the custom ops of `substation.layer_op` (torch.compile sees one node per
layer), which walk a `runtime.Plan`: on a CUDA device in float16/bfloat16, the implementations a configuration
file chose (cuBLASLt/cuBLAS calls, compiled kernels; `Encoder.from_layouts`), or for a configuration without a
file a runnable default choice; elsewhere (CPU, float32/64) the torch reference of every operator, in the
configuration's layouts. The graph's own backward operators compute every gradient.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from substation import layer_op
from substation.config_file import configuration_dropout, configuration_sizes, load_configuration, to_configuration
from substation.device import DeviceSpec
from substation.errors import DeviceError, InputError, SizeError, UnsupportedError
from substation.graph import LayerGraph, layer_graph
from substation.graphed import StepGraphs
from substation.layouts import Configuration, permutation, to_layout
from substation.lengths import check_length_multiple, pad_sequences, padded_length, refuse_without_mask
from substation.mixed_precision import WeightCache, autocast_dtype, autocast_off, weights_edited
from substation.protocol import COMPILED_DTYPES, Choice
from substation.reference import OpArgs
from substation.runtime import (Plan, bind_plan, check_choices, choices_at_size, compile_kernels, default_choices,
                                file_choices, padded_batch_choices, reference_plan)
from substation.shipped import SHIPPED, shipped_configuration
from substation.sizes import TORCH_DTYPES, Size, get_size

log = logging.getLogger(__name__)

Tensor = torch.Tensor

PARAMETERS = ("Wqkv", "bqkv", "Wo", "bo", "g1", "be1", "W1", "b1", "W2", "b2", "g2", "be2")
QKV_NAMES = ("query", "key", "value")
# HF BertLayer parameter name -> graph parameter; Wqkv and bqkv gather the three projections.
HF_NAMES = {
    "attention.output.dense.weight": "Wo",
    "attention.output.dense.bias": "bo",
    "attention.output.LayerNorm.weight": "g1",
    "attention.output.LayerNorm.bias": "be1",
    "intermediate.dense.weight": "W1",
    "intermediate.dense.bias": "b1",
    "output.dense.weight": "W2",
    "output.dense.bias": "b2",
    "output.LayerNorm.weight": "g2",
    "output.LayerNorm.bias": "be2",
}
DTYPES = tuple(TORCH_DTYPES.values())


def hf_shapes(size: Size) -> dict[str, tuple[int, ...]]:
    """The shape of every HF BertLayer parameter at this size."""
    shapes = {}
    for name in QKV_NAMES:
        shapes[f"attention.self.{name}.weight"] = (size.I, size.I)
        shapes[f"attention.self.{name}.bias"] = (size.I,)
    shapes.update({"attention.output.dense.weight": (size.I, size.I), "intermediate.dense.weight": (size.U, size.I),
                   "intermediate.dense.bias": (size.U,), "output.dense.weight": (size.I, size.U)})
    for name in HF_NAMES:
        shapes.setdefault(name, (size.I,))
    return shapes


def from_hf_tensors(hf: Mapping[str, Tensor], size: Size) -> dict[str, Tensor]:
    """HF tensors -> the graph's parameters in canonical dims order."""
    ext = size.extents
    logical = {graph_name: hf[hf_name] for hf_name, graph_name in HF_NAMES.items()}
    logical["Wqkv"] = torch.stack([hf[f"attention.self.{n}.weight"] for n in QKV_NAMES])
    logical["bqkv"] = torch.stack([hf[f"attention.self.{n}.bias"] for n in QKV_NAMES])
    graph = layer_graph()
    return {name: value.reshape(graph.tensors[name].shape(ext)) for name, value in logical.items()}


def _shipped_layouts(size: Size, length: int, device: torch.device) -> Path | None:
    """The shipped configuration for `size`'s H, P, U on the GPU the layer is on (else the current CUDA device, else
    the H100's), tuned for the length nearest `length`; None, with a warning, where none has these dimensions."""
    if device.type != "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    found = shipped_configuration(size.H, size.P, size.U, length, name)
    if found is None:
        warnings.warn(f"layouts='shipped': no shipped configuration has H={size.H}, P={size.P}, U={size.U}; running "
                      "the untuned choices (`substation profile` and `substation optimize` make a configuration for "
                      "them)", stacklevel=3)
    return found


def to_hf_tensors(logical: Mapping[str, Tensor], size: Size) -> dict[str, Tensor]:
    """The graph's parameters in canonical dims order -> HF tensors."""
    shapes = hf_shapes(size)
    hf = {hf_name: logical[graph_name].reshape(shapes[hf_name]) for hf_name, graph_name in HF_NAMES.items()}
    for t, name in enumerate(QKV_NAMES):
        hf[f"attention.self.{name}.weight"] = logical["Wqkv"][t].reshape(shapes[f"attention.self.{name}.weight"])
        hf[f"attention.self.{name}.bias"] = logical["bqkv"][t].reshape(shapes[f"attention.self.{name}.bias"])
    return hf


class Encoder(nn.Module):
    """One BERT encoder layer, exactly HF `BertLayer` (post-LN, exact GELU), in any layout configuration.

    `Encoder(size, dtype=torch.float64)` initializes like HF (normal(0, 0.02) weights, zero biases,
    unit LayerNorm weights). `size` fixes H, P, I, U; inputs may have any batch and length (B and L are those a
    configuration was tuned for: at other shapes its layouts and implementations run, re-planned for the shape,
    with a warning once per shape not in `tuned_shapes`; plans and CUDA graphs are kept for the `max_shapes`
    shapes used last, fewer where their graphs' memory pool does not fit: a capture out of memory drops the oldest).
    Float32 parameters under `torch.autocast` run in the autocast dtype (`substation.mixed_precision`: a cached
    low-precision copy of the weights, float32 gradients). Parameters are stored in their layouts;
    `state_dict()` and `load_state_dict()` speak HF `BertLayer` names and shapes. `choices` (operator ->
    `runtime.Choice`, as a configuration file names them) fixes the implementations the GPU path runs;
    without them it runs `runtime.default_choices`. `Encoder.from_layouts` builds one from a file.
    `cuda_graphs=True` replays each step's compiled forward and backward from CUDA graphs captured on first
    use (`substation.graphed`): a step as called then costs about its graphed time. To capture the Encoder in
    a CUDA graph of your own, leave `cuda_graphs` False (the attribute may be changed between steps); under
    torch.compile it is not used, the step runs the custom ops (`substation.layer_op`).
    `check_mask=False` skips the padding mask's value checks (0/1, no empty sequence; see `forward`).
    `length_multiple=64` pads each batch's sequences to a multiple of 64 (masked, exact: `substation.lengths`), so
    that training on batches of varying length runs a few shapes, each planned and captured once.
    `padded_batches=True` runs the variants of the chosen kernels that turn padding into less time where the
    profile, timed on one batch without padding, cannot weigh them (`Implementation.for_padded_batches`: the
    attention backward's `split_queries`); on a batch without padding they cost about 1 % of that kernel at most
    (measured on the H100 at B8). By default it is on where `length_multiple` is given: training on batches of
    varying length, which padding fills.
    """

    def __init__(self, size: Size | str, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 config: Configuration | None = None, attention_dropout: float = 0.1, hidden_dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12, seed: int = 0, choices: Mapping[str, Choice] | None = None,
                 layouts_gpu: str | None = None, cuda_graphs: bool = False, check_mask: bool = True,
                 max_shapes: int = 8, tuned_shapes: Iterable[tuple[int, int]] = (),
                 length_multiple: int | None = None, padded_batches: bool | None = None) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise TypeError(f"dtype={dtype} is not supported; expected one of {DTYPES}")
        for name, p in (("attention_dropout", attention_dropout), ("hidden_dropout", hidden_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name}={p} must lie in [0, 1)")
        if not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes!r} must be a positive integer")
        check_length_multiple(length_multiple)
        if padded_batches is not None and not isinstance(padded_batches, bool):
            raise TypeError(f"padded_batches={padded_batches!r} must be True, False or None (on with length_multiple)")
        self.size = get_size(size)
        self.graph: LayerGraph = layer_graph()
        self.config = config or Configuration.default(self.graph)
        self.attention_dropout, self.hidden_dropout = attention_dropout, hidden_dropout
        self.layer_norm_eps = layer_norm_eps
        self.choices = dict(choices) if choices is not None else None
        self.layouts_gpu = layouts_gpu  # the GPU a configuration file was made on
        self.cuda_graphs = cuda_graphs  # replay each step's compiled passes from CUDA graphs (substation.graphed)
        self.check_mask = check_mask
        self.max_shapes = max_shapes
        self.length_multiple = length_multiple  # sequences padded to a multiple of it (substation.lengths)
        self.padded_batches = length_multiple is not None if padded_batches is None else padded_batches
        # Per (device, dtype, batch, length): bound plans and captured graphs hold memory (graphs their pools), so
        # only the shapes used last are kept.
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._graphs = StepGraphs(max_shapes)
        # The (B, L) the choices were made for (a configuration optimized over several sizes has several): others
        # are warned about once each.
        self.tuned_shapes = {(self.size.B, self.size.L), *tuned_shapes}
        self._replanned: set[tuple[int, int]] = set()  # shapes whose choices were re-planned (and warned about) once
        self._weights = WeightCache()
        self._ones: dict[tuple, Tensor] = {}
        self._checked_mask: tuple | None = None  # the last mask whose values passed (see _check_mask_values)
        self._handle = layer_op.register(self)
        # Dropout (seed, next offset), int64 [2], on the parameters' device (a buffer: `.to()` moves it): kernels
        # read it there and a step advances it there, so that CUDA graphs and torch.compile draw new masks at every
        # step; the reference path reads it on the host.
        self.register_buffer("rng_state", torch.zeros(2, dtype=torch.int64, device=device), persistent=False)
        self.manual_seed(seed)
        ext = self.size.extents
        for name in PARAMETERS:
            shape = tuple(ext[d] for d in self.config.layouts[name])
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self.reset_parameters()

    @classmethod
    def from_layouts(cls, path: str | os.PathLike[str], dtype: torch.dtype | None = None, **kwargs) -> Encoder:
        """An Encoder running the configuration file `path` (a layouts pickle or its JSON twin): its layouts,
        and on a CUDA device in float16/bfloat16 its chosen GEMM calls and kernels (compiled here, once:
        the disk cache serves later processes). `dtype` defaults to the file's. Inputs of the file's B and L run
        its choices as they are; other shapes, its layouts and implementations re-planned for them."""
        data = load_configuration(path)
        size = Size(**data["size"], dtype=data["dtype"])  # type: ignore[arg-type]
        dtype = dtype or TORCH_DTYPES[size.dtype]
        if dtype in COMPILED_DTYPES and COMPILED_DTYPES[dtype] != size.dtype:
            warnings.warn(f"{path} was optimized for {size.dtype}; running it in {COMPILED_DTYPES[dtype]}", stacklevel=2)
        config, choices = to_configuration(data), file_choices(data)
        check_choices(choices, config, size)
        tuned = [(s.B, s.L) for s, _ in configuration_sizes(data)] + list(kwargs.pop("tuned_shapes", ()))
        encoder = cls(size, dtype=dtype, config=config, choices=choices, layouts_gpu=str(data["gpu"]),
                      tuned_shapes=tuned, **kwargs)
        timed = configuration_dropout(data)
        if timed is not None and {encoder.attention_dropout, encoder.hidden_dropout} != {timed}:
            warnings.warn(f"{path} was optimized on a profile timed at dropout {timed:g}, this layer trains at "
                          f"attention dropout {encoder.attention_dropout:g} and hidden dropout "
                          f"{encoder.hidden_dropout:g}: its choices compute the same, but may not be the fastest "
                          f"there (`substation profile --dropout P`, then optimize that profile)", stacklevel=2)
        if dtype in COMPILED_DTYPES:
            spec = DeviceSpec.build_target()
            sized = size.with_dtype(COMPILED_DTYPES[dtype])
            fresh = compile_kernels(encoder._for_batches(choices, sized), config, sized, spec)
            log.info("%s: %d kernels compiled, the others came from the cache", path, fresh)
        return encoder

    def cuda(self, device: int | torch.device | None = None) -> Encoder:
        """Move to a CUDA device; a clear error where this torch sees none (a CPU build, or no driver) instead of
        torch's bare AssertionError."""
        if not torch.cuda.is_available():
            raise DeviceError("Encoder.cuda(): this torch sees no CUDA GPU (a CPU build of torch, or no driver); "
                              "on a CPU machine run the Encoder in float32/float64 without .cuda()")
        return super().cuda(device)

    def manual_seed(self, seed: int) -> None:
        """Seed the dropout generator; each training-mode forward then advances its offset by one. Written in
        place, so that CUDA graphs already captured draw from the new seed."""
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed={seed} must lie in [0, 2**64)")
        self.seed = seed
        self.rng_state.copy_(torch.tensor([seed, 0], dtype=torch.uint64).view(torch.int64))

    @property
    def offset(self) -> int:
        """The dropout offset of the next training step (reading it waits for the GPU where the state lives)."""
        return int(self.rng_state[1])

    @offset.setter
    def offset(self, value: int) -> None:
        self.rng_state[1] = value

    def __getstate__(self) -> dict:
        """Without what is bound to this process and these tensors (plans, CUDA graphs, the weight cache): a copy
        (deepcopy, pickling) binds its own on first use."""
        return dict(super().__getstate__(), _plans=OrderedDict(), _ones={}, _checked_mask=None, _weights=WeightCache())

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._handle = layer_op.register(self)  # a copy (deepcopy, unpickling) is another layer: its own handle

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name in PARAMETERS:
                param = getattr(self, name)
                if name.startswith("W"):
                    param.normal_(0.0, 0.02)
                elif name.startswith("g"):
                    param.fill_(1.0)
                else:
                    param.zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.Wqkv.dtype

    def extents(self, x: Tensor) -> dict[str, int]:
        """Dim extents for this input: H, P, I, U from the size, B and L from x."""
        return self.size.extents | {"b": x.shape[0], "j": x.shape[1], "k": x.shape[1]}

    def plan(self, batch: int, length: int, device: torch.device, dtype: torch.dtype | None = None) -> Plan:
        """The plan that runs inputs of this batch and length in `dtype` (default: the parameters') on `device`
        (bound once, then kept for the `max_shapes` shapes used last)."""
        dtype = dtype or self.dtype
        compiled = device.type == "cuda" and dtype in COMPILED_DTYPES
        key = (device, dtype, batch, length) if compiled else (device, dtype)
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        if compiled:
            self._check_gpu(device)
            size = dataclasses.replace(self.size, B=batch, L=length, dtype=COMPILED_DTYPES[dtype])
            plan = bind_plan(self._for_batches(self._choices_at(size), size), self.config, size, dtype, device,
                             self.graph)
        else:
            if dtype in COMPILED_DTYPES or device.type == "cuda":  # a CPU float32/64 step is what was asked for
                ignored = "; cuda_graphs is ignored" if self.cuda_graphs else ""
                warnings.warn(f"an Encoder in {dtype} on {device} runs the torch reference of every operator "
                              f"(compiled plans run float16/bfloat16 on a CUDA device{ignored}): correct, and slow",
                              stacklevel=4)
            plan = reference_plan(self.config, self.graph)
        self._plans[key] = plan
        self._evict(self._plans)
        return plan

    def _choices_at(self, size: Size) -> dict[str, Choice]:
        """The choices to bind at this size: the configuration's where it was tuned for it, else the same layouts
        and implementations re-planned for it (warned once per shape), or without a configuration a default."""
        if self.choices is None:
            return default_choices(self.config, size, self.graph)
        if (size.B, size.L) == (self.size.B, self.size.L):
            return self.choices
        first = (size.B, size.L) not in self._replanned
        self._replanned.add((size.B, size.L))
        if first and (size.B, size.L) not in self.tuned_shapes:
            tuned = " and ".join(f"B={b}, L={l}" for b, l in sorted(self.tuned_shapes))
            warnings.warn(f"the configuration was tuned for {tuned}; B={size.B}, L={size.L} "
                          "runs its layouts and implementations, GEMMs with cuBLASLt's heuristic algorithm (`substation "
                          "optimize` over several sizes makes one configuration tuned for all of them)", stacklevel=5)
        with warnings.catch_warnings():
            if not first:  # a choice that falls back at this shape said so the first time
                warnings.simplefilter("ignore")
            return choices_at_size(self.choices, self.config, size, self.graph)

    def _for_batches(self, choices: dict[str, Choice], size: Size) -> dict[str, Choice]:
        """`choices` at this size as they run this Encoder's batches: for padded ones where `padded_batches`."""
        return padded_batch_choices(choices, self.config, size, self.graph) if self.padded_batches else choices

    def _evict(self, cache: OrderedDict) -> None:
        while len(cache) > self.max_shapes:
            cache.popitem(last=False)

    def _check_gpu(self, device: torch.device) -> None:
        """Warn where the configuration was timed on another architecture: it runs (kernels compiled for this one,
        a variant or algorithm that does not fit it replaced), but its choices were not made for this GPU."""
        spec = DeviceSpec.of(device.index if device.index is not None else torch.cuda.current_device())
        made_on = self.layouts_gpu.rsplit("(", 1)[-1].rstrip(")") if self.layouts_gpu else None  # "... (sm_90)"
        if made_on and made_on != spec.arch:
            warnings.warn(f"the configuration was made on {self.layouts_gpu}, this is {spec.name} ({spec.arch}): its "
                          "choices were timed on another architecture (profile and optimize on this GPU for the best "
                          "layer)", stacklevel=4)

    def environment(self, x: Tensor, mask: Tensor, params) -> dict[str, Tensor]:
        """The inputs of a forward pass, each in its layout."""
        env = dict(zip(PARAMETERS, params))
        env["X"] = to_layout(x, "bji", self.config.layouts["X"])
        env["M"] = to_layout(mask, "bk", self.config.layouts["M"])
        return env

    def run_pass(self, plan: Plan, pass_: str, env: dict[str, Tensor], args: OpArgs, extents: Mapping[str, int],
                 into: Mapping[str, Tensor] | None = None, meta: bool = False) -> None:
        """One pass of the plan on `env`; `meta` (fake tensors): only its outputs' shapes, dtypes and devices,
        launching nothing (`Plan.run_meta`)."""
        if meta:
            plan.run_meta(pass_, env, args, extents)
        else:
            plan.run(pass_, env, args, extents, dict(into) if into else None)

    def run_forward(self, plan: Plan, x: Tensor, mask: Tensor, params, args: OpArgs) -> dict[str, Tensor]:
        """The forward pass on x (bji): every tensor it makes, in its layout."""
        env = self.environment(x, mask, params)
        self.run_pass(plan, "forward", env, args, self.extents(x))
        return env

    def run_backward(self, plan: Plan, env: Mapping[str, Tensor], dy: Tensor, args: OpArgs,
                     into: Mapping[str, Tensor] | None = None, meta: bool = False) -> tuple[Tensor, ...]:
        """The backward pass from the tensors the forward kept and dY (bji): dX (bji), then the gradient of each
        of PARAMETERS in its layout; `into` names tensors (dX in its layout) to write those gradients into."""
        env = dict(env)
        env["dY"] = to_layout(dy.contiguous(), "bji", self.config.layouts["dY"])
        self.run_pass(plan, "backward", env, args, self.extents(dy), into, meta)
        return (to_layout(env["dX"], self.config.layouts["dX"], "bji"), *(env["d" + name] for name in PARAMETERS))

    def prepared_step(self, x: Tensor, attention_mask: Tensor | None = None):
        """(plan, args, environment, extents) of one step on x, with a random dY: what `runtime.breakdown`
        needs to run each step on its own."""
        x, mask = self.check_input(x, attention_mask)
        plan = self.checked_plan(x, mask)
        params = [p.detach() for p in self._parameters_in(x.dtype)]
        env = self.environment(x, self.mask_or_ones(x, mask), params)
        env["dY"] = to_layout(torch.randn_like(x), "bji", self.config.layouts["dY"])
        dropout = self.step_dropout()
        args = self.step_args(plan, self._next_rng_state() if any(dropout) else None, *dropout)
        return plan, args, env, self.extents(x)

    # ---- HF interoperability -------------------------------------------------------------
    @classmethod
    def from_hf(cls, layer: nn.Module, layouts: str | os.PathLike[str] | None = None, **kwargs) -> Encoder:
        """An Encoder with the weights and hyper-parameters of a transformers `BertLayer`; with `layouts`,
        running that configuration file (`from_layouts`), whose H, P, I, U must be the layer's. `layouts="shipped"`
        takes the shipped configuration for the layer's dimensions on this GPU (`substation.shipped`), tuned for the
        length nearest the model's `max_position_embeddings`; where none has its dimensions, a warning, and the
        untuned choices of an Encoder without a file."""
        cfg = layer.attention.self.config if hasattr(layer.attention.self, "config") else layer.config
        if getattr(cfg, "hidden_act", "gelu") != "gelu":
            raise UnsupportedError(f"hidden_act={cfg.hidden_act!r}: Substation implements HF's exact 'gelu' only")
        if getattr(layer, "add_cross_attention", False) or getattr(cfg, "is_decoder", False):
            raise UnsupportedError("cross-attention / decoder BertLayers are not supported")
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        if hidden % heads:
            raise SizeError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        size = kwargs.pop("size", None) or Size.from_heads(B=1, L=1, H=heads, P=hidden // heads,
                                                          U=cfg.intermediate_size)
        param = next(layer.parameters())
        if layouts == SHIPPED:
            layouts = _shipped_layouts(size, getattr(cfg, "max_position_embeddings", 512), param.device)
        kwargs = dict(dtype=param.dtype, attention_dropout=cfg.attention_probs_dropout_prob,
                      hidden_dropout=cfg.hidden_dropout_prob, layer_norm_eps=cfg.layer_norm_eps) | kwargs
        if layouts is None:
            encoder = cls(size, device=param.device, **kwargs)
        else:
            encoder = cls.from_layouts(layouts, **kwargs)
            given = {k: getattr(encoder.size, k) for k in "HPIU"}
            if given != {k: getattr(size, k) for k in "HPIU"}:
                raise SizeError(f"{layouts} is for {given}, the BertLayer has H={size.H}, P={size.P}, I={size.I}, "
                                f"U={size.U}")
            encoder.to(param.device)
        encoder.load_state_dict(layer.state_dict())
        return encoder

    def _hf_tensors(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Tensors stored like the parameters (graph names, chosen layouts) -> HF names and shapes."""
        logical = {name: values[name].permute(permutation(self.config.layouts[name], self.graph.tensors[name].dims))
                   for name in PARAMETERS}
        return {hf_name: value.contiguous() for hf_name, value in to_hf_tensors(logical, self.size).items()}

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        values = {name: getattr(self, name) if keep_vars else getattr(self, name).detach() for name in PARAMETERS}
        for hf_name, value in self._hf_tensors(values).items():
            destination[prefix + hf_name] = value

    def grad_state_dict(self) -> dict[str, Tensor]:
        """The parameters' gradients under HF `BertLayer` names and shapes, like `state_dict()` (None: no grad yet)."""
        missing = [name for name in PARAMETERS if getattr(self, name).grad is None]
        if missing:
            raise RuntimeError(f"no gradient yet for {missing}: run a backward first")
        return self._hf_tensors({name: getattr(self, name).grad for name in PARAMETERS})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        shapes = hf_shapes(self.size)
        present = {}
        for hf_name, shape in shapes.items():
            key = prefix + hf_name
            if key not in state_dict:
                missing_keys.append(key)
            elif tuple(state_dict[key].shape) != shape:
                error_msgs.append(f"size mismatch for {key}: expected {shape}, got {tuple(state_dict[key].shape)}")
            else:
                present[hf_name] = state_dict[key]
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix)
                                   and k[len(prefix):] not in shapes and "." in k[len(prefix):])
        if len(present) < len(shapes):
            return
        with torch.no_grad():
            for name, value in from_hf_tensors(present, self.size).items():
                layout = self.config.layouts[name]
                getattr(self, name).copy_(value.permute(permutation(self.graph.tensors[name].dims, layout)))

    # ---- forward ------------------------------------------------------------------------
    def run_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype a step on x runs in: autocast's for float32 parameters under `torch.autocast`, else the
        parameters'."""
        return autocast_dtype(x.device.type, self.dtype) or self.dtype

    def check_input(self, x: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """x in the dtype the step runs in (cast under autocast) and the mask in that dtype, contiguous (None: no
        padding). Shapes, dtypes and devices are checked at every call, the mask's values as
        `_check_mask_values` says."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[2] != self.size.I:
            raise InputError(f"x.shape={tuple(x.shape)}, expected [B, L, I] with I={self.size.I}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise InputError(f"x.shape={tuple(x.shape)}: an empty batch or sequence")
        if x.device != self.Wqkv.device:
            raise DeviceError(f"x is on {x.device} but the Encoder's parameters are on {self.Wqkv.device}; move one "
                              "of them (`encoder.cuda()` or `x.cuda()`)")
        dtype = self.run_dtype(x)
        if x.dtype != dtype:
            if dtype == self.dtype or not x.is_floating_point():
                raise TypeError(f"x.dtype={x.dtype}, expected the Encoder's dtype {self.dtype} (or, for float32 "
                                "parameters under torch.autocast, any floating dtype)")
            x = x.to(dtype)
        if attention_mask is None:
            return x, None
        if not isinstance(attention_mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != tuple(x.shape[:2]):
            raise InputError(f"attention_mask.shape={tuple(attention_mask.shape)}, expected [B, L] = "
                             f"{list(x.shape[:2])} (1 keeps a position, 0 pads it)")
        if attention_mask.dtype.is_complex or attention_mask.device != x.device:
            raise TypeError(f"attention_mask must be a real or bool tensor on {x.device}, "
                            f"got {attention_mask.dtype} on {attention_mask.device}")
        mask = attention_mask.to(x.dtype).contiguous()
        self._check_mask_values(attention_mask, mask)
        return x, mask

    def _check_mask_values(self, attention_mask: Tensor, mask: Tensor) -> None:
        """Only 0 and 1, and a kept position in every sequence. Reading values waits for the GPU, so a mask is
        checked once: again only when another tensor comes, or the same one edited in place (its version
        counter; an inference-mode tensor has none: its in-place edits go unseen). Never while torch.compile
        traces or a CUDA graph captures, nor with `check_mask=False` (for fresh masks without a wait per step)."""
        if (not self.check_mask or torch.compiler.is_compiling()
                or (mask.is_cuda and torch.cuda.is_current_stream_capturing())):
            return
        storage = StorageWeakRef(attention_mask.untyped_storage())  # held: its address is not reused meanwhile
        version = None if attention_mask.is_inference() else attention_mask._version
        key = (storage, attention_mask.data_ptr(), attention_mask.shape, attention_mask.stride(),
               attention_mask.dtype, version)
        if key == self._checked_mask:
            return
        if not torch.all((mask == 0) | (mask == 1)):
            raise InputError("attention_mask must hold only 0 (padding) and 1 (keep)")
        empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
        if empty:
            raise InputError(f"attention_mask keeps no position in sequences {empty}: attention is undefined there")
        self._checked_mask = key

    def mask_or_ones(self, x: Tensor, mask: Tensor | None, cache: bool = True) -> Tensor:
        """The mask, or without one all ones [B, L] in x's dtype, kept per shape (nothing to allocate or fill in a
        step) unless `cache` is False (fake tensors)."""
        if mask is not None:
            return mask
        if not cache:
            return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
        key = (tuple(x.shape[:2]), x.device, x.dtype)
        if key not in self._ones:
            self._ones[key] = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
        return self._ones[key]

    def checked_plan(self, x: Tensor, mask: Tensor | None) -> Plan:
        """The plan for x; an error where a mask that pads a position comes to a configuration whose attention
        takes none. An all-ones mask pads nothing and is let through (the mask-free steps do not read it); telling
        it apart waits for the GPU at every call, and cannot while torch.compile traces or a CUDA graph captures:
        there any mask is refused."""
        plan = self.plan(x.shape[0], x.shape[1], x.device, x.dtype)
        if mask is None or plan.takes_mask:
            return plan
        readable = not (torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()))
        if readable and bool(torch.all(mask == 1)):
            return plan
        raise InputError("this configuration runs an attention that takes no padding mask (PyTorch's flash or "
                         "flash-attn-4: it was optimized with --no-padding-mask), and attention_mask "
                         f"{'pads positions' if readable else 'cannot be read here (compiling or capturing)'}: call "
                         "it without attention_mask, or optimize without that flag")

    def step_args(self, plan: Plan, rng: Tensor | None, attention_dropout: float, hidden_dropout: float) -> OpArgs:
        """The operators' arguments for one step. `rng` is its dropout (seed, offset), int64 [2] on the Encoder's
        device (None: no dropout, or fake tensors). Compiled kernels read it there; torch ops (the reference plan,
        a compiled plan's torch steps) read it on the host: that waits for the GPU where it lives there, and a CUDA
        graph cannot capture it."""
        args = OpArgs(scale=1.0 / math.sqrt(self.size.P), layer_norm_eps=self.layer_norm_eps,
                      attention_dropout=attention_dropout, hidden_dropout=hidden_dropout,
                      rng=rng if plan.compiled else None)
        if rng is None or (plan.compiled and not plan.fixed_dropout):
            return args
        if rng.is_cuda and torch.cuda.is_current_stream_capturing():
            raise InputError("this Encoder runs PyTorch ops with Substation's dropout (the reference path, or torch "
                             "steps of a compiled plan), which read (seed, offset) on the host: a CUDA graph cannot "
                             "capture them with dropout on; capture it in eval mode or with dropout 0")
        seed, offset = (value % 2**64 for value in rng.tolist())  # stored as int64, meant as uint64
        return dataclasses.replace(args, seed=seed, offset=offset)

    def step_dropout(self) -> tuple[float, float]:
        """This step's (attention, hidden) dropout probabilities: the Encoder's in training mode, else none."""
        return (self.attention_dropout, self.hidden_dropout) if self.training else (0.0, 0.0)

    def _next_rng_state(self) -> Tensor:
        """This step's (seed, offset) for its forward and backward, then the state advances; both where the state
        lives, so that a CUDA graph or a compiled graph of the step draws new masks at every run."""
        state = self.rng_state.clone()
        self.rng_state[1] += 1
        return state

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """x: bji [B, L, I]; attention_mask: [B, L], 1 keeps a position, 0 pads it. Returns Y: bji.

        A mask's values are checked once per mask tensor (and after an in-place edit of it), which waits for the
        GPU: `_check_mask_values` says when not. Under torch.compile, the layer is one custom op of the graph.
        Under torch.autocast, float32 parameters run in autocast's dtype, and so does Y. Under torch.inference_mode
        it runs as under no_grad, so that what it keeps (weight copies, graphs) serves training steps after.
        """
        return stack_forward((self,), self._graphs, x, attention_mask)

    def padded(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """A checked x and mask padded along L to a multiple of `length_multiple` (`substation.lengths`); an error
        where padding is due and the configuration's attention takes no mask."""
        if self.length_multiple is None or x.shape[1] % self.length_multiple == 0:
            return x, mask
        compiling = torch.compiler.is_compiling()  # the custom op's own plan refuses a mask it cannot take
        if not compiling and not self.plan(x.shape[0], padded_length(x.shape[1], self.length_multiple), x.device,
                                           x.dtype).takes_mask:
            raise refuse_without_mask(self.length_multiple, x.shape[1])
        ones = None if mask is not None else self.mask_or_ones(x, None, cache=not compiling)
        return pad_sequences(x, mask, self.length_multiple, ones)

    def eager_forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """The step launched from the host (or traced by torch.compile), on a checked x and mask."""
        dropout = self.step_dropout()
        rng = self._next_rng_state() if any(dropout) else None
        return layer_op.layer(self._handle, x, mask, self._parameters_in(x.dtype), rng, *dropout)

    def refresh_weights(self) -> None:
        """Under autocast with float32 parameters: make the low-precision copies of the weights again at the next step
        (`substation.mixed_precision.weights_edited`: every Encoder's and every graphed stack's, a launch each).
        Needed only after editing parameters through `.data`, or by an optimizer step replayed from a CUDA graph of
        one's own: neither moves their version counters or the count of optimizer steps."""
        weights_edited()

    def _parameters_in(self, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """The parameters, in `dtype` (autocast's) from the weight cache where they are float32."""
        params = tuple(getattr(self, n) for n in PARAMETERS)
        return params if dtype == self.dtype else self._weights.cast(params, dtype)

    def extra_repr(self) -> str:
        s = self.size
        padded = "" if self.length_multiple is None else f", length_multiple={self.length_multiple}"
        if self.padded_batches != (self.length_multiple is not None):  # not the default
            padded += f", padded_batches={self.padded_batches}"
        return (f"H={s.H}, P={s.P}, I={s.I}, U={s.U}, dtype={self.dtype}, attention_dropout={self.attention_dropout}, "
                f"hidden_dropout={self.hidden_dropout}{padded}")


def stack_forward(encoders: Sequence[Encoder], graphs: StepGraphs, x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Y of `encoders` applied in turn to x [B, L, I] with one key-padding mask [B, L] (1 keeps), padded once for
    all of them (`length_multiple`): replayed from the chain's graphs in `graphs` where every Encoder has
    `cuda_graphs` (and the graphs can run: `StepGraphs.forward`), otherwise each Encoder's step launched in turn.
    An Encoder's own forward is the chain of one; `EncoderStack` and `inject` run longer ones."""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        # What the layer makes and keeps (weight copies, a cached mask, the graphs' buffers) would be inference
        # tensors, which a later training step could not save for its backward or write in place: no_grad instead.
        # (A compiled layer is one custom op, which keeps nothing.)
        with torch.inference_mode(False), torch.no_grad():  # inference_mode(False) turns grad mode back on
            return _stack_forward(encoders, graphs, x, attention_mask)
    return _stack_forward(encoders, graphs, x, attention_mask)


def _stack_forward(encoders: Sequence[Encoder], graphs: StepGraphs, x: Tensor, attention_mask: Tensor | None) -> Tensor:
    first = encoders[0]
    x, mask = first.check_input(x, attention_mask)  # cast to the step's dtype: autocast's for float32 parameters
    _check_stack(encoders)
    length = x.shape[1]
    x, mask = first.padded(x, mask)  # once for the stack: every layer runs the padded shape
    with autocast_off(x.device.type):  # the plans' torch ops run in x's dtype, as their kernels do
        y = None
        if all(encoder.cuda_graphs for encoder in encoders) and not torch.compiler.is_compiling():
            y = graphs.forward(encoders, PARAMETERS, x, mask)
        if y is None:
            y = x
            for encoder in encoders:  # x is in the step's dtype: each Encoder casts its parameters to it
                y = encoder.eager_forward(y, mask)
    return y if y.shape[1] == length else y[:, :length]


def _check_stack(encoders: Sequence[Encoder]) -> None:
    first = encoders[0]
    for index, encoder in enumerate(encoders):
        if encoder.dtype != first.dtype or encoder.Wqkv.device != first.Wqkv.device:
            raise InputError(f"layer {index} holds {encoder.dtype} parameters on {encoder.Wqkv.device}, layer 0 "
                             f"{first.dtype} on {first.Wqkv.device}: a stack's Encoders share one dtype and device")
        if encoder.length_multiple != first.length_multiple:
            raise InputError(f"layer {index} pads sequences to multiples of {encoder.length_multiple}, layer 0 to "
                             f"{first.length_multiple}: a stack's Encoders share one length_multiple")


def stack_capture(encoders: Sequence[Encoder], graphs: StepGraphs, batch_size: int, lengths: Iterable[int],
                  train: bool = True) -> list[int]:
    """Capture the graphs of `encoders` applied in turn (training graphs; train=False: forward-only ones) for
    batches of `batch_size` sequences of each of `lengths`, padded as `length_multiple` pads them, longest first,
    so that no step of the loop to come stalls for a capture (0.8-0.9 s a shape for 24 BERT-large layers on an H100)
    and the shapes share a pool laid out for the longest (`StepGraphs._kept`). Nothing is replayed: no gradient,
    output or dropout state changes. Call it as the loop will run: under its torch.autocast, with the modules in its
    train or eval mode (dropout is on or off in a shape's graphs). Returns the padded lengths, longest first."""
    first = encoders[0]
    lengths = list(lengths)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size={batch_size!r}: a positive int")
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise InputError(f"lengths={lengths!r}: one or more positive ints")
    if not all(encoder.cuda_graphs for encoder in encoders):
        raise InputError("capturing ahead is for Encoders with cuda_graphs=True (inject's default); these run "
                         "launched step by step")
    _check_stack(encoders)
    device = first.Wqkv.device
    if device.type != "cuda":
        raise DeviceError(f"CUDA graphs need the Encoders on a GPU; they are on {device}")
    multiple = first.length_multiple
    padded = sorted({n if multiple is None else padded_length(n, multiple) for n in lengths}, reverse=True)
    dtype = first.run_dtype(torch.empty(0, device=device))
    for length in padded:
        x = torch.zeros(batch_size, length, first.size.I, device=device, dtype=dtype)
        with autocast_off(device.type), torch.enable_grad():
            if not graphs.capture(encoders, PARAMETERS, x, trains=train):
                raise UnsupportedError("these Encoders' steps run launched, not from CUDA graphs (float32 "
                                       "parameters outside torch.autocast, a reference plan, or PyTorch ops drawing "
                                       "the dropout): nothing to capture")
    return padded
