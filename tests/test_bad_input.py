"""Bad input, as a new user gives it: one line on stderr naming the problem and the fix, exit status 2, nothing
left behind and nothing damaged (CPU)."""
import gzip
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from substation import Encoder, Size
from substation.cli import main
from substation.errors import ConfigurationFileError, RecordError
from substation.records import read_rows

ROOT = Path(__file__).parents[1]
PROFILE = ROOT / "layouts" / "profiles" / "h100" / "bert-large-b8-l512"
SHIPPED = ROOT / "layouts" / "h100-bert-large-b8-l512.json"


def fails(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "not utf-8"])
def test_a_damaged_profile_file_is_named(tmp_path, damage):
    path = tmp_path / "kernels.csv.gz"
    data = (PROFILE / "kernels.csv.gz").read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        path.write_bytes(gzip.compress(b"\xff\xfe" + b"\x80" * 100))
    with pytest.raises(RecordError, match=f"{path}: not a readable profile"):
        read_rows(path)


def test_optimize_refuses_a_damaged_profile_in_one_line(tmp_path, capsys):
    shutil.copy(PROFILE / "contractions.csv.gz", tmp_path / "contractions.csv.gz")
    (tmp_path / "kernels.csv.gz").write_bytes(b"\x1f\x8b" + b"junk" * 50)
    fails(capsys, ["optimize", str(tmp_path), "-o", str(tmp_path / "x.pickle")], "not a readable profile")
    assert not list(tmp_path.glob("x.*")) and not list(tmp_path.glob(".x*"))


def test_optimize_checks_its_output_before_loading_anything(tmp_path, capsys):
    missing = tmp_path / "no-profile-here"  # the error must be about -o, not about this directory
    fails(capsys, ["optimize", str(missing), "-o", str(tmp_path / "x.json")], "expected a path ending in .pickle")
    (tmp_path / "taken.pickle").mkdir()
    fails(capsys, ["optimize", str(missing), "-o", str(tmp_path / "taken.pickle")], "is a directory")
    fails(capsys, ["optimize", str(missing), "--split_vars", "X1", "X1", "-o", str(tmp_path / "y.pickle")],
          "names X1 more than once")
    fails(capsys, ["optimize", str(missing), "--split_vars", "X9", "-o", str(tmp_path / "y.pickle")],
          "split_vars ['X9']: a split variable is a forward activation the backward reads, one of: Q K V")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.pickle"]


def test_analyze_refuses_an_infinite_rate_and_a_plot_into_a_missing_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["analyze", "--size", "bert-large-b8-l512", "--copy-tbs", "inf"])
    assert exit_.value.code == 2 and "must be a positive finite number" in capsys.readouterr().err
    fails(capsys, ["analyze", "--size", "bert-large-b8-l512", "--plot", str(tmp_path / "missing" / "a.png")],
          "does not exist")


def test_mappings_says_which_contractions_have_an_epilogue(capsys):
    fails(capsys, ["mappings", "--size", "bert-large-b8-l512", "--op", "out_proj", "--epilogues"],
          "no bias epilogue covers it; the epilogues cover qkv_proj + qkv_bias")


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    import substation.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_analyze", interrupted)
    assert main(["analyze", "--size", "bert-large-b8-l512"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_numpy_integers_are_sizes():
    size = Size.from_heads(B=np.int64(2), L=np.int32(16), H=4, P=8, U=np.int64(64))
    assert size.B == 2 and type(size.B) is int and size.dims() == {"B": 2, "L": 16, "H": 4, "P": 8, "I": 32, "U": 64}


def test_a_configuration_naming_an_unknown_impl_is_refused_on_the_cpu(tmp_path):
    data = json.loads(SHIPPED.read_text())
    data["operators"]["ffn_in"]["impl"] = "cutlass"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigurationFileError, match="operators.ffn_in: impl 'cutlass' is not one this version"):
        Encoder.from_layouts(path, dtype=torch.float64)


def test_a_half_precision_encoder_on_the_cpu_says_it_runs_the_reference_once():
    encoder = Encoder(Size.from_heads(B=1, L=4, H=2, P=4, U=16), dtype=torch.bfloat16, cuda_graphs=True)
    x = torch.randn(1, 4, 8, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="runs the torch reference of every operator .*cuda_graphs is ignored"):
        encoder(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encoder(x)  # once per device and dtype


def test_the_command_says_its_version_and_runs_as_a_module(capsys):
    import subprocess
    import sys

    from substation.version import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"substation {__version__}"
    done = subprocess.run([sys.executable, "-m", "substation", "analyze", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "(default: 750.0)" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
def test_moving_an_encoder_to_a_missing_gpu_says_so():
    from substation.errors import DeviceError

    with pytest.raises(DeviceError, match=r"Encoder.cuda\(\): this torch sees no CUDA GPU"):
        Encoder(Size.from_heads(B=1, L=4, H=2, P=4, U=16), dtype=torch.float32).cuda()


def test_a_mask_free_configuration_takes_an_all_ones_mask_and_refuses_padding(monkeypatch):
    """A configuration optimized with --no-padding-mask runs attention that reads no M: a mask that pads nothing
    goes through (HF's eager layers pass one), one that pads a position is refused before anything runs."""
    from types import SimpleNamespace

    from substation.errors import InputError

    encoder = Encoder(Size.from_heads(B=2, L=8, H=2, P=4, U=16), dtype=torch.float64)
    mask_free = SimpleNamespace(takes_mask=False)
    monkeypatch.setattr(encoder, "plan", lambda *args: mask_free)
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    assert encoder.checked_plan(x, torch.ones(2, 8, dtype=torch.float64)) is mask_free
    assert encoder.checked_plan(x, None) is mask_free
    padded = torch.ones(2, 8, dtype=torch.float64)
    padded[1, 6:] = 0
    with pytest.raises(InputError, match="takes no padding mask .* and attention_mask pads positions"):
        encoder.checked_plan(x, padded)
