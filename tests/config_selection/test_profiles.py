"""Loading a profile directory: which files, one problem, every operator covered, rows that fit the graph."""
import dataclasses
import shutil

import pytest

from substation.config_selection.profiles import CONTRACTIONS_CSV, KERNELS_CSV, load_profile
from substation.config_selection.selection import default_configuration
from substation.config_selection.synthetic import SyntheticSpec, write_synthetic_profile
from substation.errors import RecordError, SelectionError
from substation.graph import layer_graph
from substation.records import Candidate, ProfileRow, RecordWriter
from substation.sizes import Size

GRAPH = layer_graph()
TINY = SyntheticSpec(Size.from_heads(B=2, L=16, H=2, P=8, U=32), algorithms=1, fused_combos=4, sdpa=True,
                     sdpa_combos=2, free_tensors=("X1",))
CONTRACTIONS = [op.name for op in GRAPH.operators if op.is_contraction]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_synthetic_profile(path, TINY, GRAPH)
    return path


def _copy(src, dst, *names):
    dst.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(src / name, dst / name)
    return dst


def test_loads_ok_rows_of_both_files(tiny_dir, profiles):
    profile = load_profile(tiny_dir, GRAPH)
    assert profile.files == (CONTRACTIONS_CSV, KERNELS_CSV) and len(profile.sha256) == 64
    assert profile.size == TINY.size and profile.gpu == TINY.gpu and profile.dropout == TINY.dropout
    assert {row.source for row in profile.rows} == {CONTRACTIONS_CSV, KERNELS_CSV}
    sdpa = [row for row in profile.rows if row.impl == "sdpa_flash"]
    assert {row.covers for row in sdpa} == {("attn_scores", "softmax", "attn_context"),
                                            ("attn_context_dgrad_a", "attn_context_dgrad_v", "softmax_bwd",
                                             "attn_scores_dgrad_q", "attn_scores_dgrad_k")}
    assert profile.best_us[("ffn_in",)] == min(r.median_us for r in profile.rows if r.covers == ("ffn_in",))


def test_no_profile_files_names_both(tmp_path):
    with pytest.raises(RecordError, match=f"no profile: expected {CONTRACTIONS_CSV} and/or {KERNELS_CSV}"):
        load_profile(tmp_path, GRAPH)
    with pytest.raises(RecordError, match="no such directory"):
        load_profile(tmp_path / "missing", GRAPH)


def test_one_file_alone_names_the_operators_without_rows(tiny_dir, tmp_path):
    only_kernels = _copy(tiny_dir, tmp_path / "k", KERNELS_CSV)
    with pytest.raises(SelectionError, match="operators without a measured candidate: no rows for qkv_proj, "
                                             "out_proj, ffn_in") as error:
        load_profile(only_kernels, GRAPH)
    assert all(name in str(error.value) for name in CONTRACTIONS if not name.startswith("attn"))
    only_contractions = _copy(tiny_dir, tmp_path / "c", CONTRACTIONS_CSV)
    with pytest.raises(SelectionError, match="no rows for qkv_bias, softmax, ln1"):
        load_profile(only_contractions, GRAPH)


def test_operators_whose_rows_all_failed_are_named_with_the_error(tmp_path):
    write_synthetic_profile(tmp_path, dataclasses.replace(TINY, failed_ops=("ffn_in",), omit_ops=("ln2",)), GRAPH)
    with pytest.raises(SelectionError, match=r"no rows for ln2; every row failed or was infeasible for ffn_in "
                                             r"\(3 failed, e.g. 'CUBLAS_STATUS_NOT_SUPPORTED"):
        load_profile(tmp_path, GRAPH)


def test_rows_of_another_size_are_refused(tiny_dir, tmp_path):
    mixed = _copy(tiny_dir, tmp_path / "mixed", CONTRACTIONS_CSV)
    write_synthetic_profile(mixed, dataclasses.replace(TINY, size=Size.from_heads(B=4, L=16, H=2, P=8, U=32)),
                            GRAPH, files=(KERNELS_CSV,))
    with pytest.raises(RecordError, match=r"rows of more than one size: .*'B': 2.* in \['contractions.csv'\]; "
                                          r".*'B': 4.* in \['kernels.csv'\]"):
        load_profile(mixed, GRAPH)


def test_rows_of_another_gpu_or_dtype(tiny_dir, tmp_path):
    other_gpu = _copy(tiny_dir, tmp_path / "gpu", CONTRACTIONS_CSV)
    write_synthetic_profile(other_gpu, dataclasses.replace(TINY, gpu="Another GPU"), GRAPH, files=(KERNELS_CSV,))
    with pytest.raises(RecordError, match="rows of more than one GPU"):
        load_profile(other_gpu, GRAPH)
    dtypes = _copy(tiny_dir, tmp_path / "dtypes", CONTRACTIONS_CSV, KERNELS_CSV)
    ln1 = Candidate.make("ln1", "forward", "torch", {"X": "bji"}, {"X1": "bji"})

    def row(dtype):
        return ProfileRow.make(ln1, TINY.size.with_dtype(dtype), TINY.gpu, {}, runs=20, median_us=5.0, min_us=4.0,
                               dropout=0.1)

    with RecordWriter(dtypes / KERNELS_CSV) as writer:
        writer.write(row("bfloat16"))
    assert load_profile(dtypes, GRAPH).size.dtype == "float16", "float16 among several dtypes by default"
    with pytest.raises(RecordError, match="no rows of dtype='float32'"):
        load_profile(dtypes, GRAPH, dtype="float32")
    with pytest.raises(SelectionError, match="no rows for qkv_proj"):
        load_profile(dtypes, GRAPH, dtype="bfloat16")  # its one bfloat16 row covers ln1 only
    with RecordWriter(tmp_path / "no_fp16" / KERNELS_CSV) as writer:
        for dtype in ("bfloat16", "float32"):
            writer.write(row(dtype))
    with pytest.raises(RecordError, match=r"several dtypes \['bfloat16', 'float32'\]; pick one \(--dtype\)"):
        load_profile(tmp_path / "no_fp16", GRAPH)


def test_one_dropout_per_profile_the_gemm_rows_having_none(tiny_dir, tmp_path):
    at_zero = _copy(tiny_dir, tmp_path / "zero", CONTRACTIONS_CSV)  # the GEMM rows serve any dropout
    write_synthetic_profile(at_zero, dataclasses.replace(TINY, dropout=0.0), GRAPH, files=(KERNELS_CSV,))
    assert load_profile(at_zero, GRAPH).dropout == 0.0 and load_profile(tiny_dir, GRAPH).dropout == 0.1
    mixed = _copy(tiny_dir, tmp_path / "mixed", CONTRACTIONS_CSV, KERNELS_CSV)
    ln1 = Candidate.make("ln1", "forward", "torch", {"X": "bji"}, {"X1": "bji"})
    with RecordWriter(mixed / KERNELS_CSV) as writer:
        writer.write(ProfileRow.make(ln1, TINY.size, TINY.gpu, {}, runs=20, median_us=5.0, min_us=4.0, dropout=0.0))
    with pytest.raises(RecordError, match=r"more than one dropout probability: dropout 0 in \['kernels.csv'\]; "
                                          r"dropout 0.1 in \['kernels.csv'\]"):
        load_profile(mixed, GRAPH)


def test_compressed_profiles_as_shipped(tiny_dir, tmp_path):
    import gzip

    packed = _copy(tiny_dir, tmp_path / "gz", CONTRACTIONS_CSV)
    (packed / (KERNELS_CSV + ".gz")).write_bytes(gzip.compress((tiny_dir / KERNELS_CSV).read_bytes()))
    profile = load_profile(packed, GRAPH)
    assert profile.files == (CONTRACTIONS_CSV, KERNELS_CSV + ".gz")
    assert len(profile.rows) == len(load_profile(tiny_dir, GRAPH).rows)
    shutil.copy(tiny_dir / KERNELS_CSV, packed / KERNELS_CSV)
    with pytest.raises(RecordError, match="both kernels.csv and kernels.csv.gz; keep one"):
        load_profile(packed, GRAPH)


@pytest.mark.parametrize("preset", ["bert-large-b8-l512", "bert-large-b96-l128"])
def test_the_shipped_h100_profiles_load_and_cover_every_operator(shipped, preset):
    profile = shipped[preset]
    assert profile.size.dtype == "float16" and profile.gpu.startswith("NVIDIA H100") and profile.dropout == 0.1
    assert {op for row in profile.rows for op in row.covers} == {op.name for op in GRAPH.operators}


@pytest.mark.parametrize("candidate, message", [
    (Candidate.make("ln9", "forward", "kernel", {"X": "bji"}, {"X1": "bji"}),
     r"column 'covers': unknown operators \['ln9'\]"),
    (Candidate.make("ln1", "backward", "kernel", {"X": "bji"}, {"X1": "bji"}), "column 'pass': 'backward'"),
    (Candidate.make("ln1", "forward", "kernel", {"X": "bji"}, {"Xq": "bji"}), "unknown tensor 'Xq'"),
    (Candidate.make("ln1", "forward", "kernel", {"X": "bjk"}, {"X1": "bji"}), "layout 'bjk' is not an order"),
    (Candidate.make("transpose_Q9", "backward", "kernel", {}, {"Q": "bhjp"}), "'transpose_Q9' names no tensor"),
    (Candidate.make("ln1", "forward", "cutlass", {"X": "bji"}, {"X1": "bji"}),
     r"column 'impl': impl 'cutlass' is not one this version of Substation runs; known: cublaslt"),
    (Candidate.make("ln1", "forward", "cublaslt", {"X": "bji"}, {"X1": "bji"}),
     r"column 'impl': impl 'cublaslt' covers .*, not \['ln1'\]"),
])
def test_rows_that_do_not_fit_the_graph_name_file_and_label(tiny_dir, tmp_path, candidate, message):
    bad = _copy(tiny_dir, tmp_path / "bad", CONTRACTIONS_CSV, KERNELS_CSV)
    with RecordWriter(bad / KERNELS_CSV) as writer:
        writer.write(ProfileRow.make(candidate, TINY.size, TINY.gpu, {}, runs=20, median_us=5.0, min_us=4.0,
                                     dropout=0.1))
    with pytest.raises(RecordError, match=f"kernels.csv: row '{candidate.label[:8]}.*{message}"):
        load_profile(bad, GRAPH)


def test_a_malformed_csv_names_file_line_and_column(tiny_dir, tmp_path):
    bad = _copy(tiny_dir, tmp_path / "bad", CONTRACTIONS_CSV, KERNELS_CSV)
    text = (bad / KERNELS_CSV).read_text().splitlines()
    text[3] = text[3].replace(",ok,", ",maybe,")
    (bad / KERNELS_CSV).write_text("\n".join(text) + "\n")
    with pytest.raises(RecordError, match=r"kernels.csv:4: column 'status'"):
        load_profile(bad, GRAPH)


def test_default_configuration_is_canonical_unfused_and_says_what_is_missing(tiny_dir):
    profile = load_profile(tiny_dir, GRAPH)
    default = default_configuration(profile, GRAPH)
    assert not default.missing and len(default.rows) == len(GRAPH.operators)
    for row in default.rows:
        assert len(row.covers) == 1 and row.impl in ("cublas", "cublaslt", "torch")
        assert all(layout == GRAPH.tensors[t].dims for t, layout in row.layouts)
    # attn_context has no single GEMM at canonical layouts (Z: bjhp): only its torch row makes a default.
    assert next(r for r in default.rows if r.covers == ("attn_context",)).impl == "torch"
    without_torch = dataclasses.replace(profile, rows=tuple(r for r in profile.rows if r.impl != "torch"))
    missing = default_configuration(without_torch, GRAPH)
    assert missing.total_us is None and "attn_context" in missing.missing and "ln1" in missing.missing
