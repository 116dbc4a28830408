"""`substation.inject` on tiny transformers models in float64 on the CPU: logits, loss and every gradient as before
injection, with a padding mask; HF's keys in and out of state_dict(); and each refusal, naming the layer."""
import ast
import copy
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from substation import Encoder, inject, shipped_configuration
from substation.errors import InputError, UnsupportedError
from substation.inject import FAMILIES, InjectedEncoder, InjectedLayer, PaddingMasks, decay_parameter_names

transformers = pytest.importorskip("transformers")
from transformers import (BertForMaskedLM, BertForSequenceClassification, BertModel,  # noqa: E402
                          CamembertForMaskedLM, Data2VecTextForMaskedLM, ElectraForMaskedLM, ErnieForMaskedLM,
                          RobertaForMaskedLM, RoCBertForMaskedLM, XLMRobertaForMaskedLM)

B, L, VOCAB = 3, 7, 40
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


PADDED_POSITIONS = (RobertaForMaskedLM, XLMRobertaForMaskedLM, CamembertForMaskedLM, Data2VecTextForMaskedLM)


def tiny(model_class=BertForMaskedLM, attn: str = "eager", **config):
    """A tiny float64 model, seeded."""
    torch.manual_seed(0)
    config_class = model_class.config_class
    extra = dict(pad_token_id=1) if model_class in PADDED_POSITIONS else {}  # positions count from pad_token_id + 1
    if model_class is RoCBertForMaskedLM:
        extra |= dict(shape_vocab_size=VOCAB, pronunciation_vocab_size=VOCAB)
    return model_class(config_class(**(TINY | extra | config), attn_implementation=attn)).double()


def batch(model_class=BertForMaskedLM) -> dict[str, torch.Tensor]:
    """Token ids, a padding mask (sequence 1 padded after 4 tokens, 2 after 6) and labels."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (B, L), generator=generator)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 6:] = 0
    if model_class is BertForSequenceClassification:
        labels = torch.tensor([0, 1, 1])
    else:
        labels = torch.where((torch.rand(B, L, generator=generator) < 0.5) & (mask == 1), ids, -100)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if model_class is RoCBertForMaskedLM:  # its glyph and pronunciation ids beside the tokens
        inputs |= {name: torch.randint(0, VOCAB, (B, L), generator=generator)
                   for name in ("input_shape_ids", "input_pronunciation_ids")}
    return inputs


def hf_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its HF name (an injected layer's from its Encoder)."""
    layers = {path: module for path, module in model.named_modules() if isinstance(module, InjectedLayer)}
    in_layers = {id(p) for layer in layers.values() for p in layer.parameters()}
    grads = {name: p.grad for name, p in model.named_parameters() if id(p) not in in_layers}
    for path, layer in layers.items():
        grads |= {f"{path}.{name}": grad for name, grad in layer.encoder.grad_state_dict().items()}
    return grads


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_class", [BertForMaskedLM, BertForSequenceClassification, RobertaForMaskedLM,
                                         XLMRobertaForMaskedLM, CamembertForMaskedLM, ElectraForMaskedLM,
                                         Data2VecTextForMaskedLM, ErnieForMaskedLM, RoCBertForMaskedLM])
def test_injected_model_computes_what_it_did(model_class, attn):
    reference = tiny(model_class, attn)
    injected = inject(copy.deepcopy(reference))
    assert sum(isinstance(m, InjectedLayer) for m in injected.modules()) == 2
    assert sum(isinstance(m, InjectedEncoder) for m in injected.modules()) == 1  # its layers run as one stack
    inputs = batch(model_class)
    want, got = reference(**inputs), injected(**inputs)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    want.loss.backward()
    got.loss.backward()
    want_grads, got_grads = hf_gradients(reference), hf_gradients(injected)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=lambda m, name=name: f"{name}: {m}")


def _code(cls: type, prefix: str) -> str:
    """A class's syntax tree with its family's prefix read as "Bert", without docstrings (comments are not in it)."""
    tree = ast.parse(inspect.getsource(cls).replace(prefix, "Bert"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@pytest.mark.parametrize("module, prefix", FAMILIES[1:], ids=[prefix for _, prefix in FAMILIES[1:]])
def test_every_family_inject_replaces_runs_berts_code(module, prefix):
    """inject takes these families' layers and encoders for BERT's: their code must be BERT's under another name (a
    transformers release that changes one family's fails here, not silently in a user's model)."""
    bert, family = (importlib.import_module(f"transformers.models.{name}") for name in ("bert.modeling_bert", module))
    for part in ("Layer", "Attention", "SelfAttention", "SelfOutput", "Intermediate", "Output", "Encoder"):
        assert _code(getattr(family, prefix + part), prefix) == _code(getattr(bert, "Bert" + part), "Bert"), part


def test_every_layer_runs_a_configuration_file_in_its_layouts():
    """A BERT-large-shaped layer from a shipped configuration (its layouts, on the CPU reference path)."""
    path = Path(__file__).parents[1] / "layouts" / "h100-bert-large-b8-l512.pickle"
    reference = tiny(BertModel, hidden_size=1024, num_attention_heads=16, intermediate_size=4096, num_hidden_layers=1)
    injected = inject(copy.deepcopy(reference), layouts=path)
    encoder = injected.encoder.layer[0].encoder
    assert encoder.config.layouts != Encoder(encoder.size).config.layouts  # not PyTorch's layouts
    inputs = {name: batch()[name] for name in ("input_ids", "attention_mask")}
    torch.testing.assert_close(injected(**inputs).last_hidden_state, reference(**inputs).last_hidden_state)


def test_shipped_runs_the_configuration_for_the_layers_dimensions_or_warns():
    """layouts="shipped": a BERT-large-shaped layer takes the shipped configuration for its dimensions and its
    max_position_embeddings (computing what it did); a tiny one, which none has, warns and runs PyTorch's layouts."""
    reference = tiny(BertModel, hidden_size=1024, num_attention_heads=16, intermediate_size=4096, num_hidden_layers=1,
                     max_position_embeddings=128)
    injected = inject(copy.deepcopy(reference), layouts="shipped")
    encoder = injected.encoder.layer[0].encoder
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    chosen = Encoder.from_layouts(shipped_configuration(16, 64, 4096, 128, device))
    assert chosen.size.L == 128 and encoder.config.layouts == chosen.config.layouts
    inputs = {name: batch()[name] for name in ("input_ids", "attention_mask")}
    torch.testing.assert_close(injected(**inputs).last_hidden_state, reference(**inputs).last_hidden_state)
    with pytest.warns(UserWarning, match="no shipped configuration has H=4, P=8, U=64"):
        small = inject(tiny(BertModel), layouts="shipped").encoder.layer[0].encoder
    assert small.config.layouts == Encoder(small.size).config.layouts


def test_a_layer_takes_every_mask_form_transformers_passes():
    """None, [B, L] 1/0 and bool, [B, 1, L, L] additive and bool, [B, 1, 1, L] additive: the same layer output."""
    model = tiny(BertModel)
    layer = model.encoder.layer[0]
    injected = inject(copy.deepcopy(model)).encoder.layer[0]
    x = torch.randn(B, L, 32, dtype=torch.float64)
    keep = batch()["attention_mask"].bool()
    lowest = torch.finfo(torch.float64).min
    additive = torch.zeros(B, 1, 1, L, dtype=torch.float64).masked_fill(~keep[:, None, None], lowest)
    want = layer(x, additive)
    for mask in (keep.long(), keep, additive, additive.expand(B, 1, L, L), keep[:, None, None].expand(B, 1, L, L)):
        torch.testing.assert_close(injected(x, mask), want)
    torch.testing.assert_close(injected(x, None), layer(x, None))


def test_a_mask_is_converted_once_for_every_layer_until_edited():
    masks = PaddingMasks()
    x = torch.zeros(B, L, 8)
    mask = torch.ones(B, 1, L, L, dtype=torch.bool)
    mask[1, 0, :, -1] = False
    first = masks(mask, x, "layer.0")
    assert masks(mask, x, "layer.1") is first and first[0].all() and not first[1, -1]
    mask[0, 0, :, 0] = False
    assert masks(mask, x, "layer.0") is not first and not masks(mask, x, "layer.0")[0, 0]


def test_a_checked_mask_that_pads_nothing_becomes_none():
    """What transformers' eager attention passes without padding (zeros, additive) needs no mask: None, from the
    check's one read, so that a configuration whose attention takes no mask reads the device in no layer. Unchecked,
    the mask stays (nothing was read to tell)."""
    x = torch.zeros(B, L, 8)
    for mask in (torch.zeros(B, 1, L, L), torch.ones(B, L, dtype=torch.long), torch.ones(B, 1, 1, L, dtype=torch.bool)):
        assert PaddingMasks()(mask, x, "layer.0") is None
        assert PaddingMasks(check=False)(mask, x, "layer.0").all()
    padded = torch.ones(B, L, dtype=torch.long)
    padded[0, -2:] = 0
    assert PaddingMasks()(padded, x, "layer.0").tolist() == (padded == 1).tolist()


def test_state_dict_keys_are_hf_and_a_plain_model_loads_them(tmp_path):
    reference = tiny()
    injected = inject(copy.deepcopy(reference))
    assert injected.state_dict().keys() == reference.state_dict().keys()
    with torch.no_grad():
        for p in injected.parameters():
            p.add_(0.01 * torch.randn_like(p))  # weights a fresh model must take from the injected one
    inputs = batch()
    want = injected(**inputs).logits

    plain = tiny()
    plain.load_state_dict(injected.state_dict())
    torch.testing.assert_close(plain(**inputs).logits, want)

    injected.save_pretrained(tmp_path)
    loaded, info = BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True, torch_dtype=torch.float64)
    assert not any(info.values()), info
    torch.testing.assert_close(loaded(**inputs).logits, want)

    again = inject(tiny())
    again.load_state_dict(plain.state_dict())  # HF keys back into injected layers
    torch.testing.assert_close(again(**inputs).logits, want)


def test_layer_seeds_follow_torch_or_the_seed_given():
    assert [layer.encoder.seed for layer in inject(tiny(), seed=7).bert.encoder.layer] == [7, 8]
    drawn = [[layer.encoder.seed for layer in inject(tiny()).bert.encoder.layer] for _ in range(2)]
    assert drawn[0] == drawn[1] and drawn[0][1] == drawn[0][0] + 1  # tiny() seeded torch: the draw repeats


# ---- refusals -------------------------------------------------------------------------------------------
LAYER0 = "bert.encoder.layer.0"


@pytest.mark.parametrize("call, what", [
    (dict(output_attentions=True), "output_attentions=True asks for the attention probabilities"),
    (dict(output_hidden_states=True), "output_hidden_states=True asks for each layer's hidden states"),
    (dict(head_mask=torch.ones(4)), r"head_mask=a tensor of shape \(4,\) asks for a head mask"),
    (dict(past_key_values=transformers.DynamicCache()), "(past_key_values|cache)=.* asks for a key/value cache"),
    (dict(encoder_hidden_states=torch.zeros(B, L, 32, dtype=torch.float64)),
     "encoder_hidden_states=.* asks for cross-attention"),
    (dict(some_new_flag=True), "some_new_flag=True asks for what it does not know"),
])
@pytest.mark.parametrize("stack, where", [(True, "bert.encoder"), (False, LAYER0)], ids=["stack", "layers"])
def test_calls_asking_for_what_an_encoder_does_not_compute_are_refused(call, what, stack, where):
    model = inject(tiny(), stack=stack)
    with pytest.raises(UnsupportedError, match=f"{where}: {what}"):
        model(**batch(), **call)


def test_output_attentions_set_in_the_config_is_refused():
    model = inject(tiny())
    model.config.output_attentions = True
    with pytest.raises(UnsupportedError, match="output_attentions=True"):
        model(**batch())
    model(**batch(), output_attentions=False)  # the call's own flag counts first, as in transformers


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_masks_that_are_not_key_padding_masks_are_refused(attn):
    model = inject(tiny(BertModel, attn))
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L)
    # the stack checks the mask once for its layers, and names itself
    with pytest.raises(UnsupportedError, match="^encoder: attention_mask differs between queries"):
        model(batch()["input_ids"], attention_mask=causal)
    bias = torch.zeros(B, 1, L, L, dtype=torch.float64)
    bias[..., 0] = -1.0
    with pytest.raises(UnsupportedError, match="an attention bias"):
        model(batch()["input_ids"], attention_mask=bias)


def test_malformed_masks_name_the_layer():
    layer = inject(tiny(BertModel)).encoder.layer[1]
    x = torch.randn(B, L, 32, dtype=torch.float64)
    with pytest.raises(InputError, match=r"encoder.layer.1: attention_mask of shape \(3, 1, 7\)"):
        layer(x, torch.ones(B, 1, L))
    with pytest.raises(InputError, match="only 0 .padding. and 1"):
        layer(x, torch.full((B, L), 2.0))
    with pytest.raises(InputError, match="keeps no key of some sequence"):
        layer(x, torch.zeros(B, L))
    with pytest.raises(UnsupportedError, match="attention_mask is a object"):
        layer(x, object())


@pytest.mark.parametrize("config, what", [
    (dict(hidden_act="gelu_new"), "hidden_act='gelu_new'"),
    (dict(is_decoder=True, add_cross_attention=True), "cross-attention"),
])
def test_layers_an_encoder_cannot_replace_are_refused_by_path(config, what):
    model = tiny(**config)
    with pytest.raises(ValueError, match=f"{LAYER0} \\(BertLayer\\): {what}"):
        inject(model)
    assert not any(isinstance(m, InjectedLayer) for m in model.modules())  # nothing half-done


def test_gradient_checkpointing_and_models_without_layers_are_refused():
    model = tiny()
    model.activation_checkpointing_enable()
    with pytest.raises(UnsupportedError, match=f"{LAYER0} \\(BertLayer\\) is gradient-checkpointed"):
        inject(model)
    with pytest.raises(UnsupportedError, match="Linear holds no layer to replace: inject takes the layers of Bert, "
                                               "Roberta, XLMRoberta, Camembert, Electra, Data2VecText, Ernie, "
                                               "RoCBert models"):
        inject(torch.nn.Linear(2, 2))


def test_capturing_shapes_ahead_needs_an_injected_stack_on_a_gpu():
    """substation.capture_shapes finds the injected stacks and checks them (`stack_capture`): on the CPU there are
    no CUDA graphs to capture, and a model without an injected stack has nothing to capture."""
    from substation import capture_shapes
    from substation.errors import DeviceError

    model = inject(tiny(), layouts=None)
    with pytest.raises(DeviceError, match="on a GPU"):
        capture_shapes(model, 2, [8, 16])
    with pytest.raises(InputError, match="cuda_graphs=True"):
        capture_shapes(inject(tiny(), layouts=None, cuda_graphs=False), 2, [8])
    with pytest.raises(UnsupportedError, match="no injected encoder run as a stack"):
        capture_shapes(inject(tiny(), layouts=None, stack=False), 2, [8])


def test_by_default_every_encoder_takes_the_fast_path_and_says_where_it_is_untuned():
    """inject(model): the shipped configuration (a tiny model has none: a warning, the untuned choices), CUDA graphs
    and sequences padded to a multiple of 64; each overridden by its keyword, the Encoder's own defaults included."""
    with pytest.warns(UserWarning, match="no shipped configuration has H=4, P=8, U=64"):
        model = inject(tiny())
    encoders = [m for m in model.modules() if isinstance(m, Encoder)]
    assert all(e.cuda_graphs and e.length_multiple == 64 for e in encoders)
    plain = inject(tiny(), layouts=None, cuda_graphs=False, length_multiple=None)
    assert all(not e.cuda_graphs and e.length_multiple is None for e in plain.modules() if isinstance(e, Encoder))
    inputs = batch()
    torch.testing.assert_close(model(**inputs).logits, plain(**inputs).logits)  # padded to 64 on the CPU: the same


def test_encoder_kwargs_reach_every_encoder():
    model = inject(tiny(), cuda_graphs=False, check_mask=False)
    encoders = [m for m in model.modules() if isinstance(m, Encoder)]
    assert len(encoders) == 2 and all(not e.check_mask for e in encoders)
    assert not model.bert.encoder.layer[0].masks.check


# ---- DDP ------------------------------------------------------------------------------------------------
WORLD = 2


def ddp_rank(rank: int, port: int, out: str) -> None:
    """One of WORLD processes: saves what `ddp_step` returns, within a gloo process group."""
    torch.set_num_threads(1)  # forked: no OpenMP thread pool of the parent's to enter
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.save(ddp_step(rank), f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def ddp_step(rank: int) -> dict:
    """This rank's share of the global batch through DDP around an injected model: its gradients (HF names) and its
    Encoders' dropout seeds, which it set apart from the other rank's. The DDP wrapper is gone when it returns: its
    Reducer holds the process group, and released after `destroy_process_group` its destructor joins gloo's
    threads, which hung about one run in five."""
    model = inject(tiny(BertForSequenceClassification), seed=100 * rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    share = {name: value.chunk(WORLD)[rank] for name, value in ddp_batch().items()}
    ddp(**share).loss.backward()
    seeds = [int(layer.encoder.rng_state[0]) for layer in model.bert.encoder.layer]
    return {"grads": hf_gradients(model), "seeds": seeds}


def ddp_batch() -> dict[str, torch.Tensor]:
    """A global batch of 2 * WORLD sequences, padded, with a label each (the loss is a mean over sequences: the mean
    of the ranks' means is the global batch's)."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(2, VOCAB, (2 * WORLD, L), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 3:] = mask[2, 5:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 1, 0]))


def test_ddp_gives_the_gradients_of_one_process_on_the_global_batch(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Forked rather than spawned: a spawned process imports transformers again, 15-30 s on a small machine.
    torch.multiprocessing.start_processes(ddp_rank, args=(port, str(tmp_path)), nprocs=WORLD, start_method="fork")

    model = inject(tiny(BertForSequenceClassification))
    model(**ddp_batch()).loss.backward()
    want = hf_gradients(model)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got["grads"][name], grad, msg=lambda m, name=name: f"rank {rank}, {name}: {m}")
        # DDP broadcast rank 0's buffers, but not the dropout state: each rank kept its own seeds
        assert got["seeds"] == [100 * rank, 100 * rank + 1]


def test_an_encoder_of_injected_layers_runs_them_as_one_stack_under_hf_keys():
    plain = tiny()
    model = inject(copy.deepcopy(plain))
    assert isinstance(model.bert.encoder, InjectedEncoder)
    assert sorted(model.state_dict()) == sorted(plain.state_dict())
    layers_only = inject(copy.deepcopy(plain), stack=False)
    assert not isinstance(layers_only.bert.encoder, InjectedEncoder)
    assert all(isinstance(layer, InjectedLayer) for layer in layers_only.bert.encoder.layer)


def test_weight_decay_spares_the_injected_biases_and_layernorms_as_hf_spares_the_originals():
    plain = tiny()
    named = set(transformers.Trainer.get_decay_parameter_names(None, plain))  # tied weights under both names
    hf_decayed = {name for name, _ in plain.named_parameters() if name in named}
    model = inject(copy.deepcopy(plain))
    decayed = decay_parameter_names(model)
    layers = [name for name in decayed if ".encoder.layer." in name]
    assert sorted(layers) == sorted(f"bert.encoder.layer.{i}.encoder.{w}" for i in range(2)
                                    for w in ("Wqkv", "Wo", "W1", "W2"))
    # the rest of the model as HF's Trainer decays it (the layers' originals: weights only, as here)
    assert sorted(set(decayed) - set(layers)) == sorted(n for n in hf_decayed if ".encoder.layer." not in n)
    assert all(n.endswith("weight") and "LayerNorm" not in n for n in hf_decayed if ".encoder.layer." in n)
