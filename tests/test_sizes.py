"""Problem sizes: presets, size specs and their names, and `--size` on the commands."""
import json
import re

import pytest

from substation.cli import build_parser, main
from substation.errors import SizeError
from substation.sizes import PRESETS, Size, get_size, size_name


def test_presets():
    size = get_size("bert-large-b8-l512")
    assert (size.B, size.L, size.H, size.P, size.I, size.U) == (8, 512, 16, 64, 1024, 4096)
    assert get_size("bert-large-b96-l128", "bfloat16").dtype == "bfloat16"
    assert size.extents["k"] == size.extents["j"] == 512 and size.extents["t"] == 3


def test_any_size_works():
    size = Size.from_heads(B=3, L=77, H=12, P=64, U=3072)
    assert size.I == 768 and size.dims() == {"B": 3, "L": 77, "H": 12, "P": 64, "I": 768, "U": 3072}


def test_unknown_preset_lists_known_ones():
    with pytest.raises(SizeError, match="known presets: " + ", ".join(PRESETS)):
        get_size("bert-huge")


@pytest.mark.parametrize("kwargs, match", [
    (dict(B=0), "B=0"), (dict(L=-4), "L=-4"), (dict(P=2.5), "P=2.5"), (dict(I=1000), "I=1000 must equal H\\*P"),
    (dict(dtype="int8"), "dtype='int8'"), (dict(U=True), "U=True"),
])
def test_bad_sizes(kwargs, match):
    base = dict(B=2, L=4, H=2, P=8, I=16, U=32)
    with pytest.raises(SizeError, match=match):
        Size(**(base | kwargs))


# ---- size specs: presets, custom sizes, presets with overrides, names ------------------------------------
@pytest.mark.parametrize("spec", ["B=16,L=384,H=16,P=64,U=4096", " B=16, L=384 ,H=16,P=64,U=4096",
                                  "bert-large-b8-l512:B=16,L=384", "bert-large-b96-l128:L=384,B=16",
                                  "b16-l384-h16-p64-u4096"])
def test_a_custom_size_by_any_spec(spec):
    size = get_size(spec)
    assert size == Size.from_heads(B=16, L=384, H=16, P=64, U=4096)
    assert size_name(size) == "b16-l384-h16-p64-u4096" and get_size(size_name(size)) == size


def test_a_preset_is_named_by_its_name_however_given():
    assert size_name(get_size("B=8,L=512,H=16,P=64,U=4096")) == "bert-large-b8-l512"
    assert size_name(get_size("bert-large-b96-l128:B=8,L=512")) == "bert-large-b8-l512"
    assert get_size("bert-large-b8-l512:B=2", "bfloat16") == Size.from_heads(2, 512, 16, 64, 4096, "bfloat16")


@pytest.mark.parametrize("spec, match", [
    ("bert-huge", "unknown size preset 'bert-huge'; known presets: bert-large-b8-l512, bert-large-b96-l128; or "
                  "give B=..,L=..,H=..,P=..,U=.."),
    ("B=2,L=128,H=16,P=64", "size 'B=2,L=128,H=16,P=64' misses U"),
    ("B=2,L=128,H=16,P=64,U=x", "U='x' is not an integer"),
    ("B=2,L=128,H=16,P=64,U=4,I=7", "'I=7' is not NAME=VALUE with NAME one of B, L, H, P, U"),
    ("B=2,L=128,H=16,P=64,U", "'U' is not NAME=VALUE"),
    ("B=2,B=3,L=128,H=16,P=64,U=4", "B is given twice"),
    ("B=2,L=0,H=16,P=64,U=4096", "size 'B=2,L=0,H=16,P=64,U=4096': L=0 must be a positive integer"),
    ("bert-huge:B=2", "size 'bert-huge:B=2': unknown size preset 'bert-huge'"),
    ("bert-large-b8-l512:", "size 'bert-large-b8-l512:': '' is not NAME=VALUE"),
    ("b16-l0-h16-p64-u4096", "L=0 must be a positive integer"),
])
def test_bad_specs_name_the_part(spec, match):
    with pytest.raises(SizeError, match=re.escape(match)):
        get_size(spec)


# ---- --size on the commands: several sizes at once, one where only one can be -----------------------------
def test_analyze_several_sizes(capsys):
    assert main(["analyze", "--size", "bert-large-b8-l512", "bert-large-b8-l512:B=2,L=64", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "size,op,pass,kind,flop,bytes" and len(lines) == 1 + 2 * 29
    assert {line.split(",")[0] for line in lines[1:]} == {"bert-large-b8-l512", "b2-l64-h16-p64-u4096"}
    assert main(["analyze", "--size", "bert-large-b8-l512", "b2-l64-h16-p64-u4096", "--format", "json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["size"]["B"] for r in reports] == [8, 2] and all(len(r["operators"]) == 29 for r in reports)
    assert main(["analyze", "--size", "bert-large-b8-l512", "B=2,L=64,H=16,P=64,U=4096"]) == 0
    out = capsys.readouterr().out
    assert "bert-large-b8-l512 (float16): minimum data movement" in out and "\n\nb2-l64-h16-p64-u4096 (float16)" in out


def test_mappings_several_sizes(capsys):
    assert main(["mappings", "--size", "bert-large-b8-l512", "bert-large-b8-l512:B=2,L=64", "--op", "ffn_in"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "size,op,layouts,call_or_reason" and len(lines) == 1 + 2 * 16
    small = [line for line in lines if line.startswith("b2-l64-h16-p64-u4096,ffn_in,X1:bji W1:ui F:bju,")]
    assert len(small) == 1 and '""n"": 128' in small[0]  # B*L = 128 columns at B=2, L=64


def fails(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_size_errors_on_the_commands_are_one_line(capsys, tmp_path):
    fails(capsys, ["analyze", "--size", "bert-large-b8-l512", "B=8,L=512,H=16,P=64,U=4096"],
          "substation analyze: error: --size names bert-large-b8-l512 twice")
    fails(capsys, ["mappings", "--size", "bert-large-b8-l512", "B=2,L=64"], "size 'B=2,L=64' misses H, P, U")
    fails(capsys, ["analyze", "--size", "bert-large-b8-l512", "b2-l64-h16-p64-u4096", "--plot",
                   str(tmp_path / "a.png")], "draws one size's shares; give one --size with it (2 given)")
    fails(capsys, ["profile", "--size", "bert-large-b8-l512", "b2-l0-h16-p64-u4096", "--out", str(tmp_path)],
          "L=0 must be a positive integer")  # checked before the GPU is looked for
    assert not list(tmp_path.iterdir())


def test_profile_writes_a_directory_per_size_and_refuses_a_profile_as_out(capsys, tmp_path):
    (tmp_path / "kernels.csv.gz").write_bytes(b"")  # one size's profile straight in --out, as before
    fails(capsys, ["profile", "--size", "bert-large-b8-l512", "--out", str(tmp_path)],
          f"--out {tmp_path} is itself a profile (kernels.csv); profile writes one directory per size")
    help_text = build_parser()._subparsers._group_actions[0].choices["profile"].format_help()
    assert "DIR/<size name>/" in " ".join(help_text.split())


def test_profile_refuses_an_operator_the_kernel_profiler_does_not_time(capsys, tmp_path):
    fails(capsys, ["profile", "--size", "bert-large-b8-l512", "--out", str(tmp_path), "--ops", "attn_scores", "ffn_in"],
          "--ops ffn_in: the kernel profiler times only qkv_bias,")  # a contraction: checked before the GPU is looked for
    assert not list(tmp_path.iterdir())
    fails(capsys, ["profile", "--size", "bert-large-b8-l512", "--out", str(tmp_path), "--ops", "ffn_out_dgrad"],
          "; ffn_out_dgrad with our epilogue is timed as --ops bias_gelu_bwd")


def test_profile_dropout_is_a_probability_and_names_its_directory(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["profile", "--size", "bert-large-b8-l512", "--out", str(tmp_path), "--dropout", "1"])
    assert "argument --dropout: must be a probability in [0, 1), got '1'" in capsys.readouterr().err
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["profile"].format_help().split())
    assert "default 0.1, BERT's" in help_text and "DIR/<size name>-dropout<P>/" in help_text


def test_profile_at_another_dropout_times_the_gemms_only_where_no_default_profile_has_them(monkeypatch, tmp_path):
    from substation import cli

    calls = []
    monkeypatch.setattr(cli, "_gpus", lambda gpus: [0])
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())  # as if nvmath were installed
    monkeypatch.setattr(cli, "_profile_contractions", lambda name, size, out, gpus, args: calls.append(("gemm", out)))
    monkeypatch.setattr(cli, "_profile_kernels", lambda name, size, out, gpus, args: calls.append(("kernels", out)))
    argv = ["profile", "--size", "bert-large-b8-l512", "--out", str(tmp_path), "--dropout", "0"]
    other = tmp_path / "bert-large-b8-l512-dropout0"
    assert main(argv) == 0 and calls == [("gemm", other), ("kernels", other)]
    calls.clear()
    (tmp_path / "bert-large-b8-l512").mkdir()
    (tmp_path / "bert-large-b8-l512" / "contractions.csv.gz").write_bytes(b"rows")
    assert main(argv) == 0 and calls == [("kernels", other)]
    assert (other / "contractions.csv.gz").read_bytes() == b"rows"
    calls.clear()
    assert main(argv[:-2]) == 0, "the default dropout profiles into the size's own directory"
    assert calls == [("gemm", tmp_path / "bert-large-b8-l512"), ("kernels", tmp_path / "bert-large-b8-l512")]
