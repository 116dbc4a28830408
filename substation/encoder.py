"""`Encoder`: a drop-in BERT encoder layer (HF `BertLayer`'s math) running the layer graph.

This is the reference path: every operator runs its torch reference (`substation.reference`) in the
configuration's layouts, the forward and the backward each walking the graph's operators in order.
Autograd sees one Function, so the graph's own backward operators compute every gradient.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from substation.errors import InputError, SizeError
from substation.graph import LayerGraph, layer_graph
from substation.layouts import Configuration, permutation
from substation.reference import OpArgs, run_operator
from substation.sizes import Size, get_size

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
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def to_hf_tensors(logical: Mapping[str, Tensor], size: Size) -> dict[str, Tensor]:
    """The graph's parameters in canonical dims order -> HF tensors."""
    shapes = hf_shapes(size)
    hf = {hf_name: logical[graph_name].reshape(shapes[hf_name]) for hf_name, graph_name in HF_NAMES.items()}
    for t, name in enumerate(QKV_NAMES):
        hf[f"attention.self.{name}.weight"] = logical["Wqkv"][t].reshape(shapes[f"attention.self.{name}.weight"])
        hf[f"attention.self.{name}.bias"] = logical["bqkv"][t].reshape(shapes[f"attention.self.{name}.bias"])
    return hf


class _LayerFunction(torch.autograd.Function):
    """Forward: the graph's forward operators; backward: its backward operators."""

    @staticmethod
    def forward(ctx, encoder: Encoder, args: OpArgs, x: Tensor, mask: Tensor, *params: Tensor) -> Tensor:
        graph, config, ext = encoder.graph, encoder.config, encoder.extents(x)
        env = dict(zip(PARAMETERS, params))
        env["X"] = _to_layout(x, "bji", config.layouts["X"])
        env["M"] = _to_layout(mask, "bk", config.layouts["M"])
        for op in graph.pass_operators("forward"):
            env.update(run_operator(op, env, config, args, ext, graph))
        for name, layout in config.backward.items():  # split variables: the transpose the backward reads
            env[name] = _to_layout(env[name], config.layouts[name], layout)
        ctx.saved = graph.saved_for_backward() + ("X",)
        ctx.save_for_backward(*(env[name] for name in ctx.saved), *params)
        ctx.encoder, ctx.args, ctx.extents = encoder, args, ext
        return _to_layout(env["Y"], config.layouts["Y"], "bji")

    @staticmethod
    def backward(ctx, dy: Tensor):
        encoder = ctx.encoder
        graph, config = encoder.graph, encoder.config
        saved = ctx.saved_tensors
        env = dict(zip(ctx.saved, saved)) | dict(zip(PARAMETERS, saved[len(ctx.saved):]))
        env["dY"] = _to_layout(dy.contiguous(), "bji", config.layouts["dY"])
        for op in graph.pass_operators("backward"):
            env.update(run_operator(op, env, config, ctx.args, ctx.extents, graph))
        dx = _to_layout(env["dX"], config.layouts["dX"], "bji")
        return (None, None, dx, None, *(env["d" + name] for name in PARAMETERS))


def _to_layout(x: Tensor, src: str, dst: str) -> Tensor:
    return x if src == dst else x.permute(permutation(src, dst)).contiguous()


class Encoder(nn.Module):
    """One BERT encoder layer, exactly HF `BertLayer` (post-LN, exact GELU), in any layout configuration.

    `Encoder(size, dtype=torch.float64)` initializes like HF (normal(0, 0.02) weights, zero biases,
    unit LayerNorm weights). `size` fixes H, P, I, U; its B and L are enforced on inputs only when
    `fixed_batch=True` (the GPU path compiles for them). Parameters are stored in their layouts;
    `state_dict()` and `load_state_dict()` speak HF `BertLayer` names and shapes.
    """

    def __init__(self, size: Size | str, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 config: Configuration | None = None, attention_dropout: float = 0.1, hidden_dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12, seed: int = 0, fixed_batch: bool = False) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise TypeError(f"dtype={dtype} is not supported; expected one of {DTYPES}")
        for name, p in (("attention_dropout", attention_dropout), ("hidden_dropout", hidden_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name}={p} must lie in [0, 1)")
        self.size = get_size(size)
        self.graph: LayerGraph = layer_graph()
        self.config = config or Configuration.default(self.graph)
        self.attention_dropout, self.hidden_dropout = attention_dropout, hidden_dropout
        self.layer_norm_eps, self.fixed_batch = layer_norm_eps, fixed_batch
        self.manual_seed(seed)
        ext = self.size.extents
        for name in PARAMETERS:
            shape = tuple(ext[d] for d in self.config.layouts[name])
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self.reset_parameters()

    def manual_seed(self, seed: int) -> None:
        """Seed the dropout generator; each training-mode forward then advances its offset by one."""
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed={seed} must lie in [0, 2**64)")
        self.seed, self.offset = seed, 0

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

    # ---- HF interoperability -------------------------------------------------------------
    @classmethod
    def from_hf(cls, layer: nn.Module, **kwargs) -> Encoder:
        """An Encoder with the weights and hyper-parameters of a transformers `BertLayer`."""
        cfg = layer.attention.self.config if hasattr(layer.attention.self, "config") else layer.config
        if getattr(cfg, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: Substation implements HF's exact 'gelu' only")
        if getattr(layer, "add_cross_attention", False) or getattr(cfg, "is_decoder", False):
            raise ValueError("cross-attention / decoder BertLayers are not supported")
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        if hidden % heads:
            raise SizeError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        size = kwargs.pop("size", None) or Size.from_heads(B=1, L=1, H=heads, P=hidden // heads,
                                                          U=cfg.intermediate_size)
        param = next(layer.parameters())
        kwargs = dict(dtype=param.dtype, device=param.device, attention_dropout=cfg.attention_probs_dropout_prob,
                      hidden_dropout=cfg.hidden_dropout_prob, layer_norm_eps=cfg.layer_norm_eps) | kwargs
        encoder = cls(size, **kwargs)
        encoder.load_state_dict(layer.state_dict())
        return encoder

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        logical = {}
        for name in PARAMETERS:
            value = getattr(self, name)
            value = value if keep_vars else value.detach()
            logical[name] = value.permute(permutation(self.config.layouts[name], self.graph.tensors[name].dims))
        for hf_name, value in to_hf_tensors(logical, self.size).items():
            destination[prefix + hf_name] = value.contiguous()

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
    def _check_input(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        want = (self.size.B, self.size.L, self.size.I) if self.fixed_batch else ("B", "L", self.size.I)
        if x.dim() != 3 or x.shape[2] != self.size.I or (self.fixed_batch and tuple(x.shape) != want):
            raise InputError(f"x.shape={tuple(x.shape)}, expected [B, L, I] = {list(want)}")
        if x.dtype != self.dtype:
            raise TypeError(f"x.dtype={x.dtype}, expected the Encoder's dtype {self.dtype}")
        if x.device != self.Wqkv.device:
            raise InputError(f"x.device={x.device}, expected the Encoder's device {self.Wqkv.device}")
        if attention_mask is None:
            return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
        if not isinstance(attention_mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != tuple(x.shape[:2]):
            raise InputError(f"attention_mask.shape={tuple(attention_mask.shape)}, expected [B, L] = "
                             f"{list(x.shape[:2])} (1 keeps a position, 0 pads it)")
        if attention_mask.dtype.is_complex or attention_mask.device != x.device:
            raise TypeError(f"attention_mask must be a real or bool tensor on {x.device}, "
                            f"got {attention_mask.dtype} on {attention_mask.device}")
        mask = attention_mask.to(x.dtype)
        if not torch.all((mask == 0) | (mask == 1)):
            raise InputError("attention_mask must hold only 0 (padding) and 1 (keep)")
        empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
        if empty:
            raise InputError(f"attention_mask keeps no position in sequences {empty}: attention is undefined there")
        return mask

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """x: bji [B, L, I]; attention_mask: [B, L], 1 keeps a position, 0 pads it. Returns Y: bji."""
        mask = self._check_input(x, attention_mask)
        args = OpArgs(scale=1.0 / math.sqrt(self.size.P), layer_norm_eps=self.layer_norm_eps,
                      seed=self.seed, offset=self.offset,
                      attention_dropout=self.attention_dropout if self.training else 0.0,
                      hidden_dropout=self.hidden_dropout if self.training else 0.0)
        if self.training and (self.attention_dropout or self.hidden_dropout):
            self.offset += 1
        return _LayerFunction.apply(self, args, x, mask, *(getattr(self, n) for n in PARAMETERS))

    def extra_repr(self) -> str:
        s = self.size
        return (f"H={s.H}, P={s.P}, I={s.I}, U={s.U}, dtype={self.dtype}, attention_dropout={self.attention_dropout}, "
                f"hidden_dropout={self.hidden_dropout}")
