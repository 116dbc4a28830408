"""`inject(model)`: every `BertLayer` of a transformers model, and every layer of the families that run BERT's code
under another name (`FAMILIES`: RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, Data2VecText, ERNIE, RoCBert), replaced
by an `Encoder` with its weights, behind an adapter (`InjectedLayer`) that takes what transformers' encoder passes a
layer and returns what it expects.

What transformers 5 passes each layer, and what the adapter does with it:

- `hidden_states` [B, L, I]: the Encoder's x; the layer returns the new hidden states, one tensor.
- `attention_mask`: None (no padding; SDPA also skips a mask that keeps everything); [B, 1, L, L] additive, 0 keeps
  and the dtype's minimum pads (eager attention); [B, 1, L, L] bool, True keeps (SDPA); [B, L] 1/0 (flash attention,
  or a caller's own). Each becomes the Encoder's [B, L] key-padding mask, or None where the check (once a step)
  reads that it pads nothing, as eager attention's zeros without padding do. A mask whose rows differ between queries
  (causal, block-diagonal), an additive bias other than 0 and the minimum, and flex attention's BlockMask are refused.
- `encoder_hidden_states` and, as keywords, `encoder_attention_mask`, `past_key_values`, `position_ids` (already used
  by the embeddings: passed over) and the call's `output_*` flags: `REFUSED` says what each would ask for.

transformers 4 called its layers with other positional arguments and took a tuple back: `inject` refuses it.
"""
from __future__ import annotations

import importlib
import os
import weakref
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from substation.encoder import PARAMETERS, Encoder, stack_capture, stack_forward
from substation.errors import InputError, UnsupportedError
from substation.graphed import StepGraphs
from substation.shipped import SHIPPED

Tensor = torch.Tensor
Checks = list[tuple[Tensor, type[Exception], str]]  # (what must be all True, the error where it is not, its message)

ENCODER = "encoder"  # the Encoder's name in its adapter, which the adapter's state_dict() leaves out
# What transformers may pass a layer that an Encoder does not do, and what it asks for: refused unless None or False.
REFUSED = {
    "encoder_hidden_states": "cross-attention",
    "encoder_attention_mask": "cross-attention",
    "past_key_values": "a key/value cache",
    "cache": "a key/value cache",  # past_key_values' name from transformers 5.2x on
    "use_cache": "a key/value cache",
    "head_mask": "a head mask",
    "is_causal": "causal attention",
    # transformers records these with hooks on the BertSelfAttention and BertLayer modules that inject replaced
    "output_attentions": "the attention probabilities",
    "output_hidden_states": "each layer's hidden states",
}
CONFIG_FLAGS = ("output_attentions", "output_hidden_states")  # the config's value counts where a call gives none
PASSED_OVER = frozenset({"position_ids"})  # the embeddings used them before the first layer
# What every Encoder takes unless the call says otherwise: the fast path, not the Encoder's own defaults (launched
# step by step, every length its own plan). CUDA graphs replay a step as one launch on a GPU (on the CPU nothing
# captures); sequences padded to a multiple of 64 make a data loader's lengths up to 512 the 8 shapes an Encoder
# keeps plans and graphs for (`max_shapes`), each planned and captured once. Measured on an H200:
# `layouts/h200-train_mlm-defaults-twentythird.json`.
FAST_DEFAULTS = {"cuda_graphs": True, "length_multiple": 64}
# The transformers families whose layer and encoder are BertLayer's and BertEncoder's code under another name
# (transformers generates them from BERT's or RoBERTa's; tests/test_inject.py checks the sources stay the same):
# (the module under transformers.models, the classes' prefix).
FAMILIES = (("bert.modeling_bert", "Bert"), ("roberta.modeling_roberta", "Roberta"),
            ("xlm_roberta.modeling_xlm_roberta", "XLMRoberta"), ("camembert.modeling_camembert", "Camembert"),
            ("electra.modeling_electra", "Electra"), ("data2vec.modeling_data2vec_text", "Data2VecText"),
            ("ernie.modeling_ernie", "Ernie"), ("roc_bert.modeling_roc_bert", "RoCBert"))


def inject(model: nn.Module, layouts: str | os.PathLike[str] | None = SHIPPED, seed: int | None = None,
           stack: bool = True, **encoder_kwargs) -> nn.Module:
    """Replace every BertLayer of `model` (RobertaLayer, XLMRobertaLayer, ...: `FAMILIES`), in place, by an Encoder
    with its weights; returns `model`.

    `layouts`: "shipped" (the default): the shipped configuration for the layers' dimensions on this GPU
    (`Encoder.from_hf`; BERT-large's, tuned at B8/L512 or B96/L128), or, with a warning, the untuned choices where none
    has them; a configuration file every Encoder runs (`Encoder.from_layouts`); None: PyTorch's layouts with untuned
    choices.
    `seed`: layer i's dropout seed is seed + i; by default it is drawn from torch's default generator, so that
    `torch.manual_seed` governs it as it governs the model's other dropout. `encoder_kwargs` go to each Encoder
    (`cuda_graphs`, `length_multiple`, `check_mask`, ...), over `FAST_DEFAULTS` (CUDA graphs on, sequences padded to
    a multiple of 64; `cuda_graphs=False, length_multiple=None` for the Encoder's own); dropout and layer_norm_eps
    come from the model's config.
    `stack`: each BertEncoder (RobertaEncoder, ...) becomes an `InjectedEncoder` that runs its layers as one stack: with
    `cuda_graphs=True`, a training step of all its layers replays from one pair of CUDA graphs (`substation.stack`).
    With False, each layer replays its own, so that DDP's all-reduce of a layer's gradients overlaps the backward of the
    layers below it.

    The model's `state_dict()` keys stay HF's (a plain model of its class loads them, `save_pretrained` writes them).
    Each layer refuses, naming itself, what it does not compute (`REFUSED`, masks that are not key-padding masks).
    Under DDP each process keeps its own dropout state (`_keep_dropout_state_per_process`). Injected layers are not
    gradient-checkpointed: recomputing a forward would draw other dropout masks than the forward's.
    """
    _check_transformers()
    layer_types = _family_classes("Layer")
    layers = [(path, module) for path, module in model.named_modules() if isinstance(module, layer_types)]
    if not layers:
        raise UnsupportedError(f"{type(model).__name__} holds no layer to replace: inject takes the layers of "
                               f"{', '.join(prefix for _, prefix in FAMILIES)} models")
    encoder_kwargs = FAST_DEFAULTS | encoder_kwargs
    masks = PaddingMasks(check=encoder_kwargs.pop("check_mask", True))
    first_seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
    adapters = [InjectedLayer(_encoder(path, layer, layouts, encoder_kwargs | {"seed": first_seed + index}), path,
                              layer.attention.self.config, masks)
                for index, (path, layer) in enumerate(layers)]
    for (path, _), adapter in zip(layers, adapters):  # only once every layer converted: no half-injected model
        model.set_submodule(path, adapter)
    if stack:
        _run_encoders_as_stacks(model, masks, max_shapes=encoder_kwargs.get("max_shapes", 8))
    _keep_dropout_state_per_process(model, [path for path, _ in layers])
    return model


def _run_encoders_as_stacks(model: nn.Module, masks: PaddingMasks, max_shapes: int) -> None:
    """Each BertEncoder (RobertaEncoder, ...: `FAMILIES`) whose layers are all injected replaced by an InjectedEncoder
    over the same layers (its state_dict keys unchanged)."""
    encoder_types = _family_classes("Encoder")
    found = [(path, module) for path, module in model.named_modules()
             if isinstance(module, encoder_types)
             and all(isinstance(layer, InjectedLayer) for layer in module.layer)]
    for path, module in found:
        model.set_submodule(path, InjectedEncoder(module.layer, path, module.config, masks, max_shapes))


def capture_shapes(model: nn.Module, batch_size: int, lengths: Iterable[int], train: bool | None = None) -> list[int]:
    """Capture the CUDA graphs of every injected encoder of `model` (an `InjectedEncoder`, `inject`'s default
    `stack=True`) for batches of `batch_size` sequences of each of `lengths`, longest first, before the loop that
    runs them, so that none of its steps stalls for a capture. `train`: training graphs (forward and backward) or
    forward-only ones; default: as `model.training` says. Call it under the torch.autocast the loop runs in, with the
    model in the loop's train or eval mode. Returns the padded lengths, longest first (`stack_capture`)."""
    stacks = [module for module in model.modules() if isinstance(module, InjectedEncoder)]
    if not stacks:
        raise UnsupportedError(f"{type(model).__name__} holds no injected encoder run as a stack: call "
                               "substation.inject(model) first (with stack=True, its default)")
    train, lengths = model.training if train is None else train, list(lengths)  # each stack takes them all
    for stack in stacks:
        padded = stack_capture([layer.encoder for layer in stack.layer], stack._graphs, batch_size, lengths, train)
    return padded


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The names of the parameters that weight decay applies to, by HF Trainer's rule (not biases, not LayerNorm
    weights), for a model whose layers `inject` replaced: an Encoder's parameters are named by the layer graph
    (`bqkv`, `g1`, `be1`, ...), which the rule's name patterns do not see, so its biases and LayerNorm parameters are
    left out here by what they are. With HF's Trainer: `get_decay_parameter_names = lambda self, model:
    decay_parameter_names(model)` in a subclass."""
    from transformers import Trainer

    decayed = set(Trainer.get_decay_parameter_names(None, model))
    for path, module in model.named_modules():
        if isinstance(module, Encoder):
            decayed -= {f"{path}.{name}" for name in PARAMETERS if not name.startswith("W")}
    return [name for name, _ in model.named_parameters() if name in decayed]


def _check_transformers() -> None:
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise UnsupportedError(f"transformers {transformers.__version__}: inject needs transformers >= 5 (4.x passes "
                               "its layers a head mask and the cache positionally and expects a tuple back)")


def _family_classes(suffix: str) -> tuple[type[nn.Module], ...]:
    """The `<prefix><suffix>` class of every family in FAMILIES that this transformers has."""
    found = []
    for module, prefix in FAMILIES:
        try:
            found.append(getattr(importlib.import_module(f"transformers.models.{module}"), prefix + suffix))
        except (ImportError, AttributeError):  # a family this transformers does not have
            continue
    return tuple(found)


def _encoder(path: str, layer: nn.Module, layouts: str | os.PathLike[str] | None, kwargs: Mapping) -> Encoder:
    """The Encoder of one HF layer; `Encoder.from_hf`'s refusals (activation, cross-attention, sizes) name the layer."""
    if getattr(layer, "gradient_checkpointing", False):
        raise UnsupportedError(f"{path} ({type(layer).__name__}) is gradient-checkpointed: recomputing an Encoder's "
                               "forward would draw other dropout masks; turn checkpointing off before inject")
    try:
        # The adapter checks each mask once for the whole stack: the Encoders need not read it again.
        return Encoder.from_hf(layer, layouts, check_mask=False, **kwargs)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{path} ({type(layer).__name__}): {error}") from error


def _keep_dropout_state_per_process(model: nn.Module, paths: list[str]) -> None:
    """Leave the Encoders' `rng_state` buffers out of what DDP broadcasts from rank 0 (when DDP wraps `model`).

    The buffer is the state of the Encoder's dropout generator: like torch's own generator, which DDP never
    broadcasts, it belongs to each process. Broadcast, every rank would draw rank 0's masks even where the ranks
    were seeded apart (while the model's torch dropout followed each rank's seed), and pay a broadcast per step.
    """
    from torch.nn.parallel import DistributedDataParallel

    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    ignored += [f"{path}.{ENCODER}.rng_state" for path in paths]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)


class InjectedLayer(nn.Module):
    """A BertLayer's place in its model, taken by an Encoder with its weights (`self.encoder`).

    forward(hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs) -> hidden_states, as
    transformers 5 calls a BertLayer (the module docstring lists what it passes). `state_dict()` gives the BertLayer's
    keys, and `load_state_dict()` takes them.
    """

    def __init__(self, encoder: Encoder, path: str, config: object, masks: PaddingMasks) -> None:
        super().__init__()
        self.encoder = encoder
        self.path = path  # where the layer sits in its model, for error messages
        self.config = config  # the model's config: output_attentions / output_hidden_states set there count too
        self.masks = masks  # shared by every layer of the model: a mask is converted and checked once per step
        self.register_state_dict_post_hook(_hf_keys)
        self.register_load_state_dict_pre_hook(_encoder_keys)

    def forward(self, hidden_states: Tensor, attention_mask: object = None, encoder_hidden_states: Tensor | None = None,
                **kwargs) -> Tensor:
        refuse_unsupported(self.path, self.config, encoder_hidden_states=encoder_hidden_states, **kwargs)
        return self.encoder(hidden_states, self.masks(attention_mask, hidden_states, self.path))

    def extra_repr(self) -> str:
        return f"path={self.path!r}"


class InjectedEncoder(nn.Module):
    """A BertEncoder's (RobertaEncoder's) place, taken by its injected layers run as one stack
    (`substation.encoder.stack_forward`): with `cuda_graphs`, a step of all of them replays from one pair of CUDA graphs.

    forward(hidden_states, attention_mask=None, ...) -> BaseModelOutputWithPastAndCrossAttentions, as transformers 5
    calls a BertEncoder. `self.layer` holds the InjectedLayers under HF's name, so state_dict keys stay HF's.
    """

    def __init__(self, layers: nn.ModuleList, path: str, config: object, masks: PaddingMasks, max_shapes: int) -> None:
        super().__init__()
        self.layer = layers
        self.path, self.config, self.masks = path, config, masks
        self._graphs = StepGraphs(max_shapes)

    def forward(self, hidden_states: Tensor, attention_mask: object = None, encoder_hidden_states: Tensor | None = None,
                **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        refuse_unsupported(self.path, self.config, encoder_hidden_states=encoder_hidden_states, **kwargs)
        mask = self.masks(attention_mask, hidden_states, self.path)
        y = stack_forward([layer.encoder for layer in self.layer], self._graphs, hidden_states, mask)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=y)

    def extra_repr(self) -> str:
        return f"path={self.path!r}, layers run as one stack"


def refuse_unsupported(where: str, config: object, **asked: object) -> None:
    """UnsupportedError, naming `where`, for the first of what transformers asks (the call's keywords and the
    config's output flags) that an Encoder does not compute (`REFUSED`)."""
    asked = {flag: getattr(config, flag, False) for flag in CONFIG_FLAGS} | asked
    for name, value in asked.items():
        if name in PASSED_OVER or (name in REFUSED and (value is None or value is False)):
            continue
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
        what = REFUSED.get(name, "what it does not know")
        raise UnsupportedError(f"{where}: {name}={shown} asks for {what}, which a Substation Encoder does not "
                               "compute: call the model without it, or do not inject this model")


def _hf_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: the Encoder's keys (HF BertLayer names) directly under the adapter's prefix. They are the
    last ones written, so moving them keeps the model's order."""
    inner = f"{prefix}{ENCODER}."
    for key in [key for key in state_dict if key.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _encoder_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                  missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """load_state_dict pre-hook: HF BertLayer keys under the adapter's prefix handed on to its Encoder."""
    inner = f"{prefix}{ENCODER}."
    for key in [key for key in state_dict if key.startswith(prefix) and not key.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class PaddingMasks:
    """transformers' attention mask -> the Encoder's key-padding mask [B, L] (bool, True keeps a key), converted and
    checked once per mask tensor: transformers hands one tensor to every layer of a step, so that a stack of Encoders
    reads the device once per step to check it (`check=False`: never) instead of once per layer. A checked mask that
    pads nothing becomes None (`key_padding`)."""

    def __init__(self, check: bool = True) -> None:
        self.check = check
        self._last: tuple[weakref.ref, int | None, Tensor | None] | None = None  # (mask, its version, its key padding)

    def __call__(self, mask: object, x: Tensor, where: str) -> Tensor | None:
        if mask is None:
            return None
        if not isinstance(mask, Tensor):
            raise UnsupportedError(f"{where}: attention_mask is a {type(mask).__name__} (flex attention's BlockMask?), "
                                   "not a tensor: an injected model runs with attn_implementation 'eager' or 'sdpa'")
        if torch.compiler.is_compiling():  # traced: no values to read, nothing to keep between calls
            return key_padding(mask, x, where, check=False)
        version = None if mask.is_inference() else mask._version  # an in-place edit makes it another mask
        if self._last is None or self._last[0]() is not mask or self._last[1] != version:
            self._last = (weakref.ref(mask), version, key_padding(mask, x, where, self.check))
        return self._last[2]


def key_padding(mask: Tensor, x: Tensor, where: str, check: bool = True) -> Tensor | None:
    """An attention mask for x [B, L, I] as a key-padding mask [B, L], bool, True keeping a key (None: see `check`).

    mask: [B, L] 1/0 or bool; or transformers' [B or 1, 1, L or 1, L], bool (True keeps) or additive (0 keeps, the
    dtype's minimum or -inf pads), the same for every query. `check`: refuse a mask that is none of these or keeps no
    key of a sequence, reading the device once; that read also tells a mask that pads nothing (transformers' eager
    attention passes one of zeros), which comes back as None: a configuration whose attention takes no mask then
    runs without reading the device again in every layer.
    """
    batch, length = x.shape[:2]
    if tuple(mask.shape) == (batch, length):
        keep, checks = _from_padding(mask)
    elif (mask.dim() == 4 and mask.shape[0] in (1, batch) and mask.shape[1] == 1 and mask.shape[2] in (1, length)
          and mask.shape[3] == length and (mask.dtype == torch.bool or mask.is_floating_point())):
        keep, checks = _from_extended(mask)
        keep = keep.expand(batch, length)
    else:
        raise InputError(f"{where}: attention_mask of shape {tuple(mask.shape)} and dtype {mask.dtype}, expected "
                         f"[B, L] = {[batch, length]} (1 keeps, 0 pads) or transformers' [B, 1, L, L] (bool or "
                         "additive)")
    if check:
        checks.append((keep.any(1), InputError, "attention_mask keeps no key of some sequence: attention is undefined "
                       "there"))
        if _read_checks(where, checks, keep.all()):
            return None
    return keep



def _from_padding(mask: Tensor) -> tuple[Tensor, Checks]:
    """[B, L], 1 or True keeps a key, 0 or False pads it."""
    if mask.dtype == torch.bool:
        return mask, []
    keep = mask == 1
    return keep, [((mask == 0) | keep, InputError, "attention_mask [B, L] must hold only 0 (padding) and 1 (keep)")]


def _from_extended(mask: Tensor) -> tuple[Tensor, Checks]:
    """transformers' [B, 1, Lq, L] (Lq = L or 1): bool, True keeps; or additive, 0 keeps and the minimum pads."""
    rows = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    checks: Checks = [(rows == rows[:, :1], UnsupportedError, "attention_mask differs between queries (a causal or "
                       "block mask): an Encoder takes a key-padding mask only")]
    if mask.dtype != torch.bool:
        checks.append((rows | (mask[:, 0] <= torch.finfo(mask.dtype).min), UnsupportedError,
                       "attention_mask adds values other than 0 and the dtype's minimum: an attention bias, which an "
                       "Encoder does not take, not a padding mask"))
    return rows[:, 0], checks


def _read_checks(where: str, checks: Checks, flag: Tensor) -> bool:
    """Every check and the boolean `flag`, read from the device at once: raise the error of the first check whose
    tensor is not all True, else return the flag's value."""
    *passed, answer = torch.stack([*(ok.all() for ok, _, _ in checks), flag]).tolist()
    for ok, (_, error, message) in zip(passed, checks):
        if not ok:
            raise error(f"{where}: {message}")
    return bool(answer)
