"""The implementation registry (CPU): every implementation answers for its covers through one protocol."""
import pytest
import torch

from substation.errors import ConfigurationFileError
from substation.graph import layer_graph
from substation.implementations import registry
from substation.kernels.sdpa import BACKWARD_COVERS, FORWARD_COVERS, Sdpa
from substation.layouts import Configuration
from substation.protocol import Choice, Infeasible, alert_nondeterministic, op_layouts
from substation.records import Candidate
from substation.sizes import Size

GRAPH = layer_graph()
SIZE = Size.from_heads(B=2, L=24, H=2, P=16, U=64)


def test_every_operator_has_an_implementation_of_its_own():
    covered = {cover for name in registry(GRAPH).names for cover in registry(GRAPH).covers(name)}
    assert all((op.name,) in covered for op in GRAPH.operators)


@pytest.mark.parametrize("seed", range(3))
def test_every_cover_gives_candidates_or_says_why_not(seed):
    """In a random configuration, each implementation of each cover answers with rows of its own impl and cover,
    or with an Infeasible naming a reason; the canonical layouts are never infeasible for PyTorch's ops."""
    config, implementations = Configuration.random(seed), registry(GRAPH)
    for impl in implementations.names:
        for cover in implementations.covers(impl):
            ops = [GRAPH.operator(name) for name in cover]
            layouts = {t: l for op in ops for t, l in op_layouts(op, config).items()}
            answers = list(implementations.find(impl, cover).candidates(ops, SIZE, layouts))
            assert answers, (impl, cover)
            for answer in answers:
                if isinstance(answer, Infeasible):
                    assert answer.impl == impl and answer.covers == cover and answer.reason
                else:
                    assert isinstance(answer, Candidate) and answer.impl == impl and answer.covers == cover
                    assert answer.op == cover[0]
                    assert impl != "torch" or dict(answer.inputs + answer.outputs) == {
                        t: layouts[t] for t in (*ops[0].inputs, *ops[0].outputs)}


def test_unknown_impls_and_covers_are_named():
    implementations = registry(GRAPH)
    with pytest.raises(ConfigurationFileError, match=r"operators.ffn_in: impl 'cutlass' is not one .* known: cublaslt"):
        implementations.find("cutlass", ("ffn_in",))
    with pytest.raises(ConfigurationFileError, match=r"operators.ln1: impl 'cublaslt' covers .*'ffn_in'.*, not \['ln1'\]"):
        implementations.find("cublaslt", ("ln1",))


def test_attention_libraries_are_coupled_and_listed_by_type():
    implementations = registry(GRAPH)
    backends = implementations.of_type(Sdpa)
    assert {found.impl for found in backends} == {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn_cute"}
    assert all(implementations.coupled(found.impl) for found in backends)
    assert not implementations.coupled("cublaslt") and not implementations.coupled("kernel")
    assert all(implementations.covers(found.impl) == (FORWARD_COVERS, BACKWARD_COVERS) for found in backends)


def test_a_choice_is_checked_without_a_gpu():
    """`check` refuses a choice whose options name another backend than its impl."""
    config = Configuration.default(GRAPH)
    ops = [GRAPH.operator(name) for name in FORWARD_COVERS]
    choice = Choice(FORWARD_COVERS, "sdpa_cudnn", {"backend": "flash", "mask": False})
    with pytest.raises(ConfigurationFileError, match="names no SDPA backend, or another than 'cudnn'"):
        registry(GRAPH).find("sdpa_cudnn", FORWARD_COVERS).check(ops, choice, config, SIZE)


def test_an_allocating_step_writes_into_given_tensors_of_its_dtype_only():
    """A step writes an `into` tensor itself only in its own dtype; for another the plan copies (and converts)."""
    import torch

    from substation.protocol import AllocatingStep

    class Fill(AllocatingStep):
        def __call__(self, env, ctx):
            out = self.allocate(ctx.into)
            out["dW1"].fill_(2.0)
            return out

    graph = layer_graph()
    step = Fill([graph.operator("ffn_in_wgrad")], Choice(("ffn_in_wgrad",), "test"))
    step.bind_outputs({"dW1": "iu"}, {"i": 3, "u": 4}, torch.float64, torch.device("cpu"))
    same, other = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float32)
    assert step.writes_into("dW1", torch.float64) and not step.writes_into("dW1", torch.float32)
    assert not step.writes_into("dW2", torch.float64)
    assert step.allocate({"dW1": same})["dW1"] is same
    got = step.allocate({"dW1": other})["dW1"]
    assert got is not other and got.dtype == torch.float64 and got.shape == (3, 4)


def test_only_atomic_dq_backwards_are_not_deterministic():
    """Every implementation calls its rows deterministic but our attention backward's fuse_dq=4 and PyTorch's SDPA
    backwards (flash-attn-4's is deterministic)."""
    from substation.kernels.attention import ATOMIC_DQ, BWD_COVERS, IMPL

    implementations = registry(layer_graph())
    attention = implementations.find(IMPL, BWD_COVERS)
    assert not attention.deterministic("backward", {"fuse_dq": ATOMIC_DQ, "block_m": 128})
    assert all(attention.deterministic("backward", {"fuse_dq": f}) for f in (0, 1, 2))
    sdpa = {name for name in implementations.names if name.startswith("sdpa_")}
    assert sdpa == {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn"}
    for name in set(implementations.names) - {IMPL}:
        for covers in implementations.covers(name):
            found = implementations.find(name, covers)
            assert found.deterministic("forward", {"fuse_dq": ATOMIC_DQ})
            assert found.deterministic("backward", {"fuse_dq": ATOMIC_DQ}) == (name not in sdpa), name


def test_the_nondeterminism_alert_follows_torchs_setting():
    """Silent by default, an error under torch.use_deterministic_algorithms(True), a warning with warn_only."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        alert_nondeterministic("attn_context_dgrad_a")
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="attn_context_dgrad_a is not deterministic"):
            alert_nondeterministic("attn_context_dgrad_a")
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="without --nondeterministic"):
            alert_nondeterministic("attn_context_dgrad_a")
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
