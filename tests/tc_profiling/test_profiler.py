"""The contraction profiler: the plan and its isolated tasks, the profile-directory guard, the CLI (CPU); a small
profile on the GPU, resumed."""
import dataclasses
import gzip
import pickle

import pytest
import torch

from substation.cli import main
from substation.records import Candidate, ProfileRow, RecordWriter, read_rows
from substation.sizes import get_size
from substation.profiling import ProfileDirError, check_profile_dir
from substation.tc_profiling.profiler import plan, reuse_rows, run, tasks
from substation.tc_profiling.worker import Baseline, CallGroup, EpilogueGroup

SIZE = get_size("bert-large-b8-l512")
GPU = "NVIDIA H100 80GB HBM3 (sm_90)"


def _row(size=SIZE, gpu=GPU, median=10.0, layout="bji"):
    cand = Candidate.make("ffn_in", "forward", "torch", {"X1": layout, "W1": "ui"}, {"F": "bju"})
    return ProfileRow.make(cand, size, gpu, {"torch": "x"}, 25, median, median, dropout=None)


def test_plan_groups_mappings_by_call():
    work = plan(SIZE)
    assert sum(work.feasible.values()) == 1248 and sum(work.infeasible.values()) == 136_560
    assert len(work.groups) == 144
    assert sum(len(g.mappings) for g in work.groups) == 1248
    for group in work.groups:  # every mapping of a group makes exactly the group's call
        assert all(m.call == group.call for m in group.mappings)
    assert len(work.baselines) == 18 and work.baselines[0] == Baseline("qkv_proj", (("X", "bji"), ("Wqkv", "thpi"),
                                                                                    ("QKV", "bjthp")))


def test_tasks_are_picklable_jobs_and_baselines_name_their_row():
    work = plan(SIZE)
    found = tasks(work, SIZE, ["float16", "bfloat16"])
    assert len(found) == 2 * (18 + len(work.groups) + len(work.epilogues))
    assert [type(t.payload.work) for t in found[17:19]] == [Baseline, CallGroup]
    assert type(found[-1].payload.work) is EpilogueGroup and found[-1].payload.dtype == "bfloat16"
    (cand, size), = found[0].candidates
    assert cand.label == "qkv_proj/fwd torch X:bji Wqkv:thpi -> QKV:bjthp" and size.dtype == "float16"
    assert all(not t.candidates for t in found if not isinstance(t.payload.work, Baseline)), \
        "a group's rows are known once its worker has asked cuBLASLt"
    assert pickle.loads(pickle.dumps(found)) == found


def test_profile_dir_of_another_size_or_gpu_is_refused_unless_forced(tmp_path):
    path = tmp_path / "contractions.csv"
    with RecordWriter(path) as writer:
        writer.write(_row())
    assert check_profile_dir(path, SIZE, GPU, None, force=False) == {_row().key}  # same size and GPU: resume from it
    other = get_size("bert-large-b96-l128")
    with pytest.raises(ProfileDirError, match=r"holds rows for .*'B': 8.* not .*'B': 96.*--force"):
        check_profile_dir(path, other, GPU, None, force=False)
    with pytest.raises(ProfileDirError, match="A100"):
        check_profile_dir(path, SIZE, "A100", None, force=False)
    with pytest.raises(ProfileDirError, match=r"at no dropout, not .* at dropout 0\.1"):
        check_profile_dir(path, SIZE, GPU, 0.1, force=False)
    assert check_profile_dir(path, other, GPU, None, force=True) == set()
    assert not path.exists() and (tmp_path / "contractions.csv.old").exists()


def _packed(path):
    """`path` gzipped beside itself as shipped (`<path>.gz`), the plain file gone."""
    with open(path, "rb") as source, gzip.open(path.with_name(path.name + ".gz"), "wb") as target:
        target.write(source.read())
    path.unlink()


def test_a_compressed_profile_is_unpacked_and_extended(tmp_path):
    """A shipped profile (`kernels.csv.gz`): a run on its size and GPU resumes from its rows in `kernels.csv`, the
    only file left (the optimizer refuses a directory holding both); one of another size is refused as before."""
    path = tmp_path / "kernels.csv"
    with RecordWriter(path) as writer:
        writer.write(_row())
    _packed(path)
    assert check_profile_dir(path, SIZE, GPU, None, force=False) == {_row().key}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.csv"] and read_rows(path) == [_row()]
    path.replace(tmp_path / "contractions.csv")
    _packed(tmp_path / "contractions.csv")
    with pytest.raises(ProfileDirError, match="'B': 8.* not .*'B': 96"):
        check_profile_dir(tmp_path / "contractions.csv", get_size("bert-large-b96-l128"), GPU, None, force=False)


def test_profile_without_gpu_is_one_line(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["profile", "--size", "bert-large-b8-l512", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert err == "substation profile: error: profiling needs an NVIDIA GPU, and torch sees none\n"


def test_unknown_profiler_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--size", "bert-large-b8-l512", "--out", "x", "--only", "gemms"])
    assert "invalid choice: 'gemms'" in capsys.readouterr().err


def test_mappings_command_lists_calls_and_reasons(capsys):
    assert main(["mappings", "--size", "bert-large-b8-l512", "--op", "ffn_in"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "op,layouts,call_or_reason" and len(lines) == 1 + 16
    assert main(["mappings", "--size", "bert-large-b8-l512", "--op", "ffn_in", "--infeasible"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 56 and "not adjacent" in "".join(lines)
    assert main(["mappings", "--size", "bert-large-b8-l512", "--op", "softmax"]) == 2
    assert "fused operator" in capsys.readouterr().err


def test_shipped_profiles_load_and_cover_every_contraction():
    from pathlib import Path

    from substation.graph import layer_graph
    from substation.records import load_records

    contractions = {op.name for op in layer_graph().operators if op.is_contraction}
    for preset in ("bert-large-b8-l512", "bert-large-b96-l128"):
        rows = load_records(Path(__file__).parents[2] / "layouts/profiles/h100" / preset / "contractions.csv.gz")
        assert set(rows.op) == contractions
        assert (rows.status == "ok").all() and set(rows.dtype) == {"float16", "bfloat16"}
        assert rows.B.iloc[0] == get_size(preset).B


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_small_profile_in_isolated_workers_resumes(tmp_path):
    pytest.importorskip("nvmath")
    size = get_size("bert-large-b8-l512")
    work = plan(size)
    small = dataclasses.replace(work, groups=work.groups[:3], epilogues=work.epilogues[:1])
    path = run(small, size, ["float16"], tmp_path, [0], force=False, algorithms=2, runs=3)
    rows = read_rows(path)
    assert all(r.status == "ok" for r in rows), [(r.label, r.error) for r in rows if r.status != "ok"]
    assert {r.impl for r in rows} == {"torch", "cublas", "cublaslt", "cublaslt_bias"}
    assert sum(r.impl == "torch" for r in rows) == 18
    run(small, size, ["float16"], tmp_path, [0], force=False, algorithms=2, runs=3)
    assert read_rows(path) == rows, "a resumed run adds nothing"


def test_a_profile_at_another_dropout_reuses_the_gemm_rows(tmp_path):
    default, other = tmp_path / "bert-large-b8-l512", tmp_path / "bert-large-b8-l512-dropout0"
    assert reuse_rows(default, other) is None and not other.exists(), "nothing to reuse"
    default.mkdir()
    (default / "contractions.csv.gz").write_bytes(b"packed rows")
    copy = reuse_rows(default, other)
    assert copy == other / "contractions.csv.gz" and copy.read_bytes() == b"packed rows"
    (default / "contractions.csv.gz").write_bytes(b"newer rows")
    assert reuse_rows(default, other) is None and copy.read_bytes() == b"packed rows", "its own rows are kept"
