"""The contraction profiler's CPU side: the plan, the profile-directory guard, part-file merging, the CLI."""
import pytest

from substation.cli import main
from substation.records import Candidate, ProfileRow, RecordWriter, read_rows
from substation.sizes import get_size
from substation.profiling import ProfileDirError, check_profile_dir, merge
from substation.tc_profiling.profiler import plan

SIZE = get_size("bert-large-b8-l512")
GPU = "NVIDIA H100 80GB HBM3 (sm_90)"


def _row(size=SIZE, gpu=GPU, median=10.0, layout="bji"):
    cand = Candidate.make("ffn_in", "forward", "torch", {"X1": layout, "W1": "ui"}, {"F": "bju"})
    return ProfileRow.make(cand, size, gpu, {"torch": "x"}, 25, median, median)


def test_plan_groups_mappings_by_call():
    work = plan(SIZE)
    assert sum(work.feasible.values()) == 1248 and sum(work.infeasible.values()) == 136_560
    assert len(work.groups) == 144
    assert sum(len(g.mappings) for g in work.groups) == 1248
    for group in work.groups:  # every mapping of a group makes exactly the group's call
        assert all(m.call == group.call for m in group.mappings)
    assert len(work.baselines) == 18 and work.baselines[0] == ("qkv_proj", (("X", "bji"), ("Wqkv", "thpi"),
                                                                           ("QKV", "bjthp")))


def test_profile_dir_of_another_size_or_gpu_is_refused_unless_forced(tmp_path):
    path = tmp_path / "contractions.csv"
    with RecordWriter(path) as writer:
        writer.write(_row())
    check_profile_dir(path, SIZE, GPU, force=False)  # same size and GPU: resume
    other = get_size("bert-large-b96-l128")
    with pytest.raises(ProfileDirError, match=r"holds rows for .*'B': 8.* not .*'B': 96.*--force"):
        check_profile_dir(path, other, GPU, force=False)
    with pytest.raises(ProfileDirError, match="A100"):
        check_profile_dir(path, SIZE, "A100", force=False)
    check_profile_dir(path, other, GPU, force=True)
    assert not path.exists() and (tmp_path / "contractions.csv.old").exists()


def test_merge_appends_new_rows_of_part_files(tmp_path):
    path, parts = tmp_path / "contractions.csv", [tmp_path / "p0.csv", tmp_path / "p1.csv"]
    with RecordWriter(path) as writer:
        writer.write(_row(layout="bji"))
    for part, layouts in zip(parts, (["bji", "jbi"], ["ibj"])):
        with RecordWriter(part) as writer:
            for layout in layouts:
                writer.write(_row(layout=layout))
    merge(parts, path)
    assert sorted(r.layouts for r in read_rows(path)) == ["F:bju W1:ui X1:bji", "F:bju W1:ui X1:ibj",
                                                          "F:bju W1:ui X1:jbi"]
    assert not any(p.exists() for p in parts)


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
