"""The runtime's CPU side: choices from files and defaults, kernel compilation and its cache, plans, errors."""
import ctypes
import dataclasses
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from substation import Encoder, Size
from substation.config_file import to_configuration
from substation.sizes import get_size
from substation.errors import ConfigurationFileError, SizeError
from substation.graph import layer_graph
from substation.kernels.registry import kernel_params
from substation.encoder import PARAMETERS
from substation.layouts import Configuration, to_layout
from substation.reference import OpArgs, run_operator
from substation.implementations import registry
from substation.kernels.sdpa import AttentionStep
from substation.protocol import Choice, StepContext
from substation.runtime import check_choices, compile_kernels, default_choices, file_choices, reference_plan
from substation.tc_profiling.cublaslt import CublasLt
from substation.tc_profiling.epilogues import SPLITS, BiasEpilogueStep, CublasLtBias, bias_epilogue
from substation.tc_profiling.mapping import map_contraction

LAYOUTS = Path(__file__).parents[1] / "layouts"
SHIPPED = sorted(LAYOUTS.glob("h[0-9]00-bert-*.json"))  # the H100 and H200 configurations
DEFAULT = LAYOUTS / "h100-bert-large-b8-l512.json"  # the shipped configuration with a padding mask, at B8/L512
ODD = Size.from_heads(B=3, L=77, H=12, P=64, U=3072)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_file_choices_cover_every_operator_once(path):
    data = json.loads(path.read_text())
    choices = file_choices(data)
    assert sorted(choices) == sorted(op.name for op in layer_graph().operators)
    for op, choice in choices.items():
        assert op in choice.covers and choice.impl == data["operators"][op]["impl"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_kernels_rebuild_their_labels_and_calls(path):
    """What the runtime rebuilds from a file is what the profile timed: same kernel label, same GEMM call."""
    data = json.loads(path.read_text())
    size, graph = Size(**data["size"], dtype=data["dtype"]), layer_graph()
    config, choices = to_configuration(data), file_choices(data)
    check_choices(choices, config, size, graph)  # every recorded GEMM call, epilogue and SDPA layout fits
    for op in graph.operators:
        entry = data["operators"][op.name]
        if entry["impl"] == "kernel":
            assert kernel_params(op.name, size, size.dtype, entry["layouts"], entry["options"]).label == entry["label"]
        elif entry["impl"] == "cublaslt_bias" and op.name == entry["covers"][0]:
            choice = choices[op.name]
            rebuilt = CublasLtBias().epilogue([graph.operator(o) for o in choice.covers], choice, config,
                                              size).candidate({})
            assert dict(rebuilt.inputs + rebuilt.outputs) == entry["layouts"]


def test_a_call_recorded_at_another_size_is_refused():
    data = json.loads(DEFAULT.read_text())
    op = layer_graph().operator("ffn_in")
    entry = data["operators"]["ffn_in"]
    other = Size.from_heads(B=2, L=512, H=16, P=64, U=4096)
    with pytest.raises(ConfigurationFileError, match="operators.ffn_in: impl 'cublaslt' records the GEMM call .* "
                                                     "made for another size"):
        CublasLt().check([op], Choice(("ffn_in",), "cublaslt", entry["options"]), to_configuration(data), other)


def test_a_kernel_that_does_not_fit_the_size_is_refused():
    data = json.loads(DEFAULT.read_text())
    op = layer_graph().operator("ln1")
    entry = data["operators"]["ln1"]
    choice = Choice(("ln1",), "kernel", entry["options"], entry["label"])
    with pytest.raises(ConfigurationFileError, match=r"operators.ln1: impl 'kernel' variant .* does not fit this size "
                                                     r"and dtype: .*must divide"):
        registry(layer_graph()).find("kernel", ("ln1",)).check(
            [op], choice, to_configuration(data), Size.from_heads(B=8, L=511, H=16, P=64, U=4096))


@pytest.mark.parametrize("seed", range(4))
def test_default_choices_run_any_configuration(seed):
    config, graph = Configuration.random(seed), layer_graph()
    choices = default_choices(config, ODD, graph)
    for op in graph.operators:
        choice = choices[op.name]
        layouts = {t: config.layout(t, op.pass_) for t in op.inputs} | {t: config.layouts[t] for t in op.outputs}
        if op.is_contraction:
            mapped = map_contraction(op, layouts, ODD.extents).call is not None
            assert choice.impl == ("cublaslt" if mapped else "torch")
        elif choice.impl == "kernel":
            kernel_params(op.name, ODD, "float16", layouts, choice.options)  # feasible
    assert any(c.impl == "kernel" for c in choices.values())


def test_kernels_compile_once_then_come_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    config = Configuration.random(1)
    choices = default_choices(config, ODD)
    kernels = sum(c.impl == "kernel" for c in choices.values())
    assert compile_kernels(choices, config, ODD) == kernels > 0
    assert compile_kernels(choices, config, ODD) == 0


def test_reference_plan_transposes_split_variables_after_the_forward():
    config = Configuration.random(7, split=("X1", "Q"))
    plan = reference_plan(config)
    moved = {t for t in ("X1", "Q") if config.backward[t] != config.layouts[t]}
    assert [s.name for s in plan.forward if s.choice.impl == "transpose"] == [f"transpose_{t}" for t in sorted(moved, key=list(config.backward).index)]
    assert [s.name for s in plan.backward] == [op.name for op in layer_graph().pass_operators("backward")]
    assert set(plan.saved) == set(layer_graph().saved_for_backward()) | {"X"}


def test_a_backward_writes_the_gradients_into_given_tensors():
    """`into` (where a graphed step's backward writes its gradients): steps that cannot write there, or not in that
    dtype, are copied (and converted) there."""
    encoder = Encoder(Size.from_heads(B=2, L=5, H=2, P=8, U=24), dtype=torch.float64, config=Configuration.random(3))
    x = torch.randn(2, 5, encoder.size.I, dtype=torch.float64)
    mask, params = torch.ones(2, 5, dtype=torch.float64), [getattr(encoder, n).detach() for n in PARAMETERS]
    plan, dy = encoder.plan(2, 5, x.device), torch.randn_like(x)
    args = encoder.step_args(plan, None, 0.0, 0.0)
    env = encoder.run_forward(plan, x, mask, params, args)
    want = encoder.run_backward(plan, env, dy, args)
    into = {"dX": torch.full_like(to_layout(x, "bji", encoder.config.layouts["dX"]), float("nan")),
            "dW1": torch.full_like(encoder.W1, float("nan")),
            "dW2": torch.full_like(encoder.W2, float("nan"), dtype=torch.float32)}
    got = encoder.run_backward(plan, env, dy, args, into)
    assert got[1 + PARAMETERS.index("W2")] is into["dW2"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0)
    torch.testing.assert_close(to_layout(into["dX"], encoder.config.layouts["dX"], "bji"), want[0], rtol=0, atol=0)
    torch.testing.assert_close(into["dW1"], want[1 + PARAMETERS.index("W1")], rtol=0, atol=0)
    torch.testing.assert_close(into["dW2"], want[1 + PARAMETERS.index("W2")].float(), rtol=0, atol=0)


def test_from_layouts_runs_the_reference_on_the_cpu():
    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float64)
    assert encoder.size.B == 8 and encoder.size.L == 512
    assert encoder.config.layouts["QKV"] == json.loads(DEFAULT.read_text())["tensors"]["QKV"]
    assert not encoder.plan(8, 512, torch.device("cpu")).compiled
    assert encoder.Wqkv.shape == tuple(encoder.size.extents[d] for d in encoder.config.layouts["Wqkv"])


def test_from_layouts_says_when_the_layer_trains_at_another_dropout_than_profiled():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Encoder.from_layouts(DEFAULT, dtype=torch.float64)  # BERT's 0.1, as the shipped profiles
    with pytest.warns(UserWarning, match=r"timed at dropout 0.1, this layer trains at attention dropout 0 and "
                                         r"hidden dropout 0.1: .*substation profile --dropout"):
        Encoder.from_layouts(DEFAULT, dtype=torch.float64, attention_dropout=0.0)


def test_from_layouts_refuses_a_damaged_file(tmp_path):
    truncated = tmp_path / "cut.pickle"
    truncated.write_bytes(DEFAULT.with_suffix(".pickle").read_bytes()[:200])
    with pytest.raises(ConfigurationFileError, match="cut.pickle"):
        Encoder.from_layouts(truncated, dtype=torch.float64)
    data = json.loads(DEFAULT.read_text())
    data["format_version"] = 99
    other = tmp_path / "v99.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ConfigurationFileError, match="format_version"):
        Encoder.from_layouts(other, dtype=torch.float64)


def test_from_hf_refuses_layouts_of_another_model_size():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = transformers.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  attn_implementation="eager")
    with pytest.raises(SizeError, match="the BertLayer has H=4, P=16, I=64, U=128"):
        Encoder.from_hf(BertLayer(cfg).double(), layouts=DEFAULT, dtype=torch.float64)


def test_shipped_sdpa_attention_rows_bind_to_their_layouts():
    """An SDPA row binds where the backend writes Z (forward) and dQ, dK, dV (backward) in the configuration's
    layouts, and is refused where it would not (B8/L512's configuration chooses cuDNN; B96/L128's our attention)."""
    data = json.loads(next(p for p in SHIPPED if "b8-l512" in p.stem).read_text())
    size, graph = Size(**data["size"], dtype=data["dtype"]), layer_graph()
    config, choices = to_configuration(data), file_choices(data)
    attention = list({id(c): c for c in choices.values() if c.impl.startswith("sdpa_")}.values())
    assert {c.covers[0] for c in attention} == {"attn_scores", "attn_context_dgrad_a"}
    for choice in attention:
        ops = [graph.operator(o) for o in choice.covers]
        step = AttentionStep(ops, choice, registry(graph).find(choice.impl, choice.covers).attention(ops, choice,
                                                                                                    config, size))
        assert ("Z" in step.outputs) == (step.pass_ == "forward")
    moved = Configuration({**config.layouts, "Z": "bhjp" if config.layouts["Z"] != "bhjp" else "jbhp"})
    forward = next(c for c in attention if c.covers[0] == "attn_scores")
    with pytest.raises(ConfigurationFileError, match="writes Z as"):
        registry(graph).find(forward.impl, forward.covers).check([graph.operator(o) for o in forward.covers],
                                                                 forward, moved, size)


def test_a_configuration_from_another_architecture_warns(monkeypatch):
    from substation.device import DeviceSpec

    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float64)
    a100 = DeviceSpec("NVIDIA A100-SXM4-80GB", 8, 0, 108, 163 * 1024)
    monkeypatch.setattr(DeviceSpec, "of", staticmethod(lambda device: a100))
    with pytest.warns(UserWarning, match=r"made on NVIDIA H100 80GB HBM3 \(sm_90\), this is NVIDIA A100-SXM4-80GB "
                                         r"\(sm_80\)"):
        encoder._check_gpu(torch.device("cuda", 0))
    h100_pcie = DeviceSpec("NVIDIA H100 PCIe", 9, 0, 114, 227 * 1024)
    monkeypatch.setattr(DeviceSpec, "of", staticmethod(lambda device: h100_pcie))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encoder._check_gpu(torch.device("cuda", 0))  # same architecture, another board: no warning


def test_compiling_without_nvcc_says_so(monkeypatch, tmp_path):
    from substation import jit

    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    monkeypatch.delenv("SUBSTATION_NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    jit.nvcc.cache_clear()
    try:
        with pytest.raises(jit.ToolchainError, match="nvcc was not found on PATH"):
            Encoder.from_layouts(DEFAULT, dtype=torch.float16)
    finally:
        jit.nvcc.cache_clear()


def _epilogue_config(**layouts) -> Configuration:
    base = Configuration.default()
    layouts = {"X": "bji", "Wqkv": "thpi", "bqkv": "thp", "Q": "bjhp", "K": "bkhp", "V": "bkhp", **layouts}
    tied = {"d" + name: layouts[name] for name in ("Wqkv", "bqkv")}  # a gradient is stored like its parameter
    return dataclasses.replace(base, layouts={**base.layouts, **layouts, **tied})


def test_a_bias_epilogue_choice_binds_to_its_layouts_or_says_why_not():
    """qkv_proj + qkv_bias as one cuBLASLt call with the bias epilogue: QKV is t + Q's layout; the bias, the slices
    and the recorded call must be the configuration's at this size."""
    graph, size = layer_graph(), get_size("bert-large-b8-l512")
    ops = [graph.operator("qkv_proj"), graph.operator("qkv_bias")]
    config = _epilogue_config()
    expected = bias_epilogue(SPLITS[0], {"X": "bji", "Wqkv": "thpi", "QKV": "tbjhp"}, size.extents)
    choice = Choice(("qkv_proj", "qkv_bias"), "cublaslt_bias", expected.options() | {"algo": 0})
    implementation = CublasLtBias()
    assert implementation.epilogue(ops, choice, config, size) == expected
    with pytest.raises(ConfigurationFileError, match="bqkv"):
        implementation.check(ops, choice, _epilogue_config(bqkv="tph"), size)
    with pytest.raises(ConfigurationFileError, match="cannot run layouts"):
        implementation.check(ops, choice, _epilogue_config(Wqkv="htpi"), size)
    with pytest.raises(ConfigurationFileError, match="another size"):
        implementation.check(ops, choice, config, get_size("bert-large-b96-l128"))
    with pytest.raises(ConfigurationFileError, match="no bias epilogue"):
        implementation.check(ops[:1], choice, config, size)


class _HostMatmul:
    """cuBLASLt's call with the bias epilogue, emulated on host memory addressed by data_ptr() (float64): what
    BiasEpilogueStep hands the library, executed as the library reads and writes it."""

    def __init__(self, epilogue, numel):
        self.epilogue, self.numel, self.bias_sets = epilogue, numel, 0

    def set_epilogue_pointer(self, pointer):
        self.bias, self.bias_sets = pointer, self.bias_sets + 1

    def _flat(self, pointer, name):
        return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_double * self.numel[name]).from_address(pointer)))

    def __call__(self, a, b, c, algorithm, stream):
        from tests.tc_profiling.test_epilogues import run_with_bias

        mapping, split = self.epilogue.mapping, self.epilogue.split
        values = {mapping.a_operand: self._flat(a, mapping.a_operand), mapping.b_operand: self._flat(b, mapping.b_operand),
                  split.bias: self._flat(self.bias, split.bias)}
        self._flat(c, "result").copy_(run_with_bias(self.epilogue, values, self.numel["result"]))


def test_a_bias_epilogue_step_returns_q_k_v_as_slices_of_one_result():
    """BiasEpilogueStep on host memory: Q, K, V equal qkv_proj then qkv_bias in float64, are views of one buffer,
    and the bias pointer is set once while the parameter stays where it is."""
    size, graph = Size.from_heads(B=2, L=3, H=5, P=7, U=11), layer_graph()
    ops = [graph.operator("qkv_proj"), graph.operator("qkv_bias")]
    config = _epilogue_config(Wqkv="tihp")
    epilogue = bias_epilogue(SPLITS[0], {"X": "bji", "Wqkv": "tihp", "QKV": "tbjhp"}, size.extents)
    choice = Choice(("qkv_proj", "qkv_bias"), "cublaslt_bias", epilogue.options())
    assert CublasLtBias().epilogue(ops, choice, config, size) == epilogue
    gen = torch.Generator().manual_seed(5)
    env = {t: torch.randn([size.extents[d] for d in config.layouts[t]], generator=gen, dtype=torch.float64)
           for t in ("X", "Wqkv", "bqkv")}
    numel = {t: env[t].numel() for t in env} | {"result": math.prod(size.extents[d] for d in epilogue.result_layout)}
    matmul = _HostMatmul(epilogue, numel)
    step = BiasEpilogueStep(ops, choice, epilogue, matmul, None, torch.float64, torch.device("cpu"), size.extents)
    assert step.inputs == ("X", "Wqkv", "bqkv") and step.outputs == ("QKV", "Q", "K", "V")
    assert step.views == {"Q": ("QKV", 0), "K": ("QKV", 1), "V": ("QKV", 2)}  # a plan keeps QKV, not its slices
    args, ext = OpArgs(scale=1.0), size.extents
    got = step(env, StepContext(args, ext))
    step(env, StepContext(args, ext))
    want = run_operator(ops[1], env | run_operator(ops[0], env, config, args, ext, graph), config, args, ext, graph)
    for name in ("Q", "K", "V"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
        assert got[name].is_contiguous() and got[name].untyped_storage().data_ptr() == got["Q"].untyped_storage().data_ptr()
    assert matmul.bias_sets == 1


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_configuration_is_replanned_for_shapes_it_was_not_tuned_for(path):
    """At another (B, L), odd ones included: GEMM calls of the same layouts at that size with no recorded
    algorithm (cuBLASLt's heuristic picks one), every other choice's implementation kept (a kernel's variant where
    it fits, else its first one that does: one row per block fits any length), except a GEMM with our epilogue
    whose token-contiguous result TMA cannot stride at an odd token count: its operators run one by one there,
    with a warning. Every resized choice checks there."""
    from substation.runtime import check_choices, choices_at_size

    config, choices, tuned = shipped_choices(path)
    assert choices_at_size(choices, config, tuned) == choices
    fused = {op for op, choice in choices.items() if choice.impl in ("cutlass_epilogue", "cutlass_gelu_slope")}
    for B, L in ((16, 384), (3, 77), (1, 1)):
        size = dataclasses.replace(tuned, B=B, L=L)
        aligned = B * L % 8 == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resized = choices_at_size(choices, config, size)
        assert [str(w.message) for w in caught if "16-byte" not in str(w.message)] == []
        assert bool(caught) == (bool(fused) and not aligned)
        check_choices(resized, config, size)
        for op, choice in resized.items():
            before = choices[op]
            if op in fused and not aligned:
                assert choice.covers == (op,) and choice.impl != before.impl, op
                continue
            assert choice.impl == before.impl, op
            if before.impl in ("cublaslt", "cublas", "cublaslt_bias"):
                # check_choices above: its recorded call is the call of its layouts at this size
                assert "algo_id" not in choice.options and choice.options != before.options, op


def test_an_encoder_for_padded_batches_binds_the_split_attention_backward():
    """padded_batches (on by default with length_multiple) binds the shipped configuration's attention backward with
    split_queries wherever L takes three key tiles or more, at its own size and others, and changes nothing else;
    off, or without length_multiple, the configuration's choices as they are."""
    from substation.kernels.attention import STACKED_COVERS
    from substation.runtime import padded_batch_choices

    path = DEFAULT
    config, choices, tuned = shipped_choices(path)
    plain = Encoder.from_layouts(path, dtype=torch.float32)
    assert not plain.padded_batches and plain._for_batches(choices, tuned) == choices
    for kwargs in ({"length_multiple": 64}, {"padded_batches": True}):
        encoder = Encoder.from_layouts(path, dtype=torch.float32, **kwargs)
        assert encoder.padded_batches
        for L in (512, 320, 256, 128):
            size = dataclasses.replace(tuned, L=L)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # not tuned for this length
                unsplit = plain._choices_at(size)
                bound = encoder._for_batches(encoder._choices_at(size), size)
            changed = {op for op in bound if bound[op] != unsplit[op]}
            assert changed == (set(STACKED_COVERS) if L > 256 else set()), L
            assert all(bound[op].options["split_queries"] == 1 for op in changed)
            assert bound == padded_batch_choices(unsplit, config, size)
    cudnn_config, cudnn_choices, cudnn_size = shipped_choices(LAYOUTS / "h100-bert-large-b8-l512-cudnn.json")
    assert padded_batch_choices(cudnn_choices, cudnn_config, cudnn_size) == cudnn_choices  # SDPA's: nothing to split
    assert not Encoder.from_layouts(path, dtype=torch.float32, length_multiple=64, padded_batches=False).padded_batches
    with pytest.raises(TypeError, match="padded_batches=1 must be True, False or None"):
        Encoder(tuned, padded_batches=1)


def test_a_choice_without_a_candidate_at_a_shape_falls_back_to_pytorchs_ops(monkeypatch):
    from substation.kernels.registry import FusedKernels
    from substation.protocol import Infeasible
    from substation.runtime import choices_at_size

    config, choices, tuned = shipped_choices(DEFAULT)
    monkeypatch.setattr(FusedKernels, "candidates",
                        lambda self, ops, size, layouts: iter([Infeasible("kernel", (ops[0].name,), "a rule")]))
    size = dataclasses.replace(tuned, B=3, L=77)  # where the chosen LayerNorm variants do not fit
    with pytest.warns(UserWarning, match=r"operators.ln1: .* running torch instead"):
        resized = choices_at_size(choices, config, size)
    assert resized["ln1"].impl == "torch" and resized["ffn_out"].impl == choices["ffn_out"].impl


def shipped_choices(path):
    from substation.config_file import load_configuration
    from substation.runtime import file_choices

    data = load_configuration(path)
    return to_configuration(data), file_choices(data), Size(**data["size"], dtype=data["dtype"])


def test_shapes_a_configuration_was_not_tuned_for_are_warned_about_once():
    """No GPU needed: which choices a shape binds, and whether it says so (the tuned shapes and each other once)."""
    encoder = Encoder.from_layouts(DEFAULT, dtype=torch.float64, tuned_shapes=[(4, 256)])
    size = encoder.size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert encoder._choices_at(size) == encoder.choices
        tuned_too = encoder._choices_at(dataclasses.replace(size, B=4, L=256))
    assert tuned_too["ffn_in"].options != encoder.choices["ffn_in"].options  # its GEMM call at B=4, L=256
    with pytest.warns(UserWarning, match=r"tuned for B=4, L=256 and B=8, L=512; B=2, L=77 runs"):
        encoder._choices_at(dataclasses.replace(size, B=2, L=77))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encoder._choices_at(dataclasses.replace(size, B=2, L=77))
