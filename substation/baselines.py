"""PyTorch baselines of one BERT encoder layer, with exactly HF `BertLayer`'s math.

Every baseline is an `nn.Module` called as `layer(x, attention_mask)`, x: bji [B, L, I], attention_mask:
[B, L] (1 keeps a position, 0 pads it) or None, returning Y: bji. Parameters carry HF `BertLayer` names and
shapes, so the `state_dict()` of a `substation.Encoder` loads into each of them and all run the same
weights. The math (docs/DESIGN.md): post-LN, exact erf GELU, attention dropout on the softmax, hidden dropout
after the attention output and FFN output projections (none after the GELU), padding as an additive
`finfo(dtype).min` on the scores of padded keys, LayerNorm eps 1e-12.

Variants (`VARIANTS`):
- `eager_manual`: matmul, softmax, dropout, matmul, as HF's eager attention;
- `eager_sdpa`: `torch.nn.functional.scaled_dot_product_attention` (flash / cuDNN / memory-efficient);
- `hf_bertlayer`: transformers' own `BertLayer` with the eager attention implementation;
- `compile_default`, `compile_max_autotune`: `torch.compile` of `eager_sdpa`. The latter uses the mode
  "max-autotune-no-cudagraphs": max-autotune's kernel search, without Inductor's own CUDA graphs, so that
  the benchmark can capture the whole step in one graph of its own, as it does for every variant.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from substation.errors import InputError
from substation.sizes import Size

Tensor = torch.Tensor

EAGER = ("eager_manual", "eager_sdpa", "hf_bertlayer")
COMPILED = {"compile_default": "default", "compile_max_autotune": "max-autotune-no-cudagraphs"}
VARIANTS = (*EAGER, *COMPILED)


def padding_bias(attention_mask: Tensor | None, x: Tensor) -> Tensor | None:
    """[B, L] mask (1 keep, 0 pad) -> additive [B, 1, 1, K] bias in x's dtype: 0 or finfo.min, as HF's."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != tuple(x.shape[:2]):
        raise InputError(f"attention_mask.shape={tuple(attention_mask.shape)}, expected [B, L] = {list(x.shape[:2])}")
    keep = attention_mask.to(device=x.device, dtype=x.dtype)
    return ((1.0 - keep) * torch.finfo(x.dtype).min)[:, None, None, :]


def _container(**children: nn.Module) -> nn.Module:
    module = nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module


class TorchBertLayer(nn.Module):
    """HF `BertLayer` in plain PyTorch ops; `attention` is "manual" (matmul-softmax-dropout-matmul) or "sdpa".

    Submodules reproduce HF's parameter names: `attention.self.{query,key,value}`, `attention.output.dense`,
    `attention.output.LayerNorm`, `intermediate.dense`, `output.dense`, `output.LayerNorm`.
    """

    def __init__(self, size: Size, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 attention: str = "sdpa", attention_dropout: float = 0.1, hidden_dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12) -> None:
        super().__init__()
        if attention not in ("manual", "sdpa"):
            raise ValueError(f"attention={attention!r}, expected 'manual' or 'sdpa'")
        for name, p in (("attention_dropout", attention_dropout), ("hidden_dropout", hidden_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name}={p} must lie in [0, 1)")
        self.size, self.attention_impl = size, attention
        self.attention_dropout, self.hidden_dropout = attention_dropout, hidden_dropout
        kw = dict(dtype=dtype, device=device)
        I, U = size.I, size.U
        self.attention = _container(
            self=_container(query=nn.Linear(I, I, **kw), key=nn.Linear(I, I, **kw), value=nn.Linear(I, I, **kw)),
            output=_container(dense=nn.Linear(I, I, **kw), LayerNorm=nn.LayerNorm(I, eps=layer_norm_eps, **kw)))
        self.intermediate = _container(dense=nn.Linear(I, U, **kw))
        self.output = _container(dense=nn.Linear(U, I, **kw), LayerNorm=nn.LayerNorm(I, eps=layer_norm_eps, **kw))

    def _heads(self, t: Tensor) -> Tensor:
        """bj(hp) -> bhjp."""
        return t.view(t.shape[0], t.shape[1], self.size.H, self.size.P).transpose(1, 2)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """x: bji [B, L, I]; attention_mask: [B, L] (1 keep, 0 pad) or None. Returns Y: bji."""
        if x.dim() != 3 or x.shape[2] != self.size.I:
            raise InputError(f"x.shape={tuple(x.shape)}, expected [B, L, I] with I={self.size.I}")
        B, L, I = x.shape
        bias = padding_bias(attention_mask, x)
        a = self.attention.self
        q, k, v = self._heads(a.query(x)), self._heads(a.key(x)), self._heads(a.value(x))
        scale = 1.0 / math.sqrt(self.size.P)
        p_attn = self.attention_dropout if self.training else 0.0
        if self.attention_impl == "sdpa":
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p_attn, scale=scale)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * scale
            if bias is not None:
                scores = scores + bias
            probs = F.dropout(torch.softmax(scores, dim=-1), p=p_attn, training=self.training)
            z = torch.matmul(probs, v)
        z = z.transpose(1, 2).reshape(B, L, I)
        o = self.attention.output
        x1 = o.LayerNorm(F.dropout(o.dense(z), p=self.hidden_dropout, training=self.training) + x)
        h1 = F.gelu(self.intermediate.dense(x1))  # exact erf GELU, HF's "gelu"
        out = F.dropout(self.output.dense(h1), p=self.hidden_dropout, training=self.training)
        return self.output.LayerNorm(out + x1)

    def extra_repr(self) -> str:
        s = self.size
        return (f"H={s.H}, P={s.P}, I={s.I}, U={s.U}, attention={self.attention_impl!r}, "
                f"attention_dropout={self.attention_dropout}, hidden_dropout={self.hidden_dropout}")


def hf_bert_layer(size: Size, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                  attention_dropout: float = 0.1, hidden_dropout: float = 0.1,
                  layer_norm_eps: float = 1e-12) -> nn.Module:
    """transformers' `BertLayer` (eager attention) behind the baselines' `(x, attention_mask[B, L])` call.

    Raises ImportError when transformers is not installed.
    """
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    class HFBertLayer(BertLayer):
        """BertLayer whose forward takes the [B, L] 0/1 mask and returns the hidden states alone."""

        def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
            out = super().forward(x, attention_mask=padding_bias(attention_mask, x))
            return out[0] if isinstance(out, tuple) else out

    cfg = transformers.BertConfig(hidden_size=size.I, num_attention_heads=size.H, intermediate_size=size.U,
                                  hidden_act="gelu", hidden_dropout_prob=hidden_dropout,
                                  attention_probs_dropout_prob=attention_dropout, layer_norm_eps=layer_norm_eps,
                                  attn_implementation="eager")
    return HFBertLayer(cfg).to(device=device, dtype=dtype)


def make_baseline(variant: str, size: Size, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None, state_dict: Mapping[str, Tensor] | None = None,
                  attention_dropout: float = 0.1, hidden_dropout: float = 0.1) -> nn.Module:
    """One baseline of `VARIANTS`, with the weights of `state_dict` (HF names, e.g. `Encoder.state_dict()`).

    The compiled variants are returned un-run: `torch.compile` compiles at the first call.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}, expected one of {VARIANTS}")
    kw = dict(attention_dropout=attention_dropout, hidden_dropout=hidden_dropout)
    if variant == "hf_bertlayer":
        layer = hf_bert_layer(size, dtype, device, **kw)
    else:
        layer = TorchBertLayer(size, dtype, device, attention="manual" if variant == "eager_manual" else "sdpa", **kw)
    if state_dict is not None:
        layer.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()})
    if variant in COMPILED:
        return torch.compile(layer, mode=COMPILED[variant])
    return layer
