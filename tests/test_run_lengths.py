"""scripts/run_lengths.py on the CPU (float64, the reference path): a tiny stack trained on batches of varying
length, padded to a multiple and not, beside PyTorch's layer; its rows; its argument errors."""
import json
import runpy
from pathlib import Path

import pytest

SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "run_lengths.py"))
TINY = ["--size", "B=3,L=8,H=2,P=4,U=16", "--layers", "2", "--device", "cpu", "--dtype", "float64"]


def test_a_tiny_stack_trains_on_varying_lengths_padded_and_not(tmp_path):
    out = tmp_path / "rows.json"
    argv = [*TINY, "--lengths", "3", "13", "--steps", "6", "--multiple", "8", "--json", str(out), "--variants",
            "substation", "substation_padded", "eager_sdpa"]
    assert SCRIPT["main"](argv) == 0
    rows = {row["variant"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["substation", "substation_padded", "eager_sdpa"]
    lengths = {x.shape[1] for x, _, _ in SCRIPT["batches"](SCRIPT["get_size"]("B=3,L=8,H=2,P=4,U=16"), (3, 13), 6,
                                                             SCRIPT["torch"].float64, "cpu", 0)}
    assert rows["substation"]["shapes"] == len(lengths) > 2  # one per length
    assert rows["substation_padded"]["shapes"] == len({8 if n <= 8 else 16 for n in lengths}) <= 2
    for row in rows.values():
        assert row["total_s"] > 0 and row["median_ms"] > 0 and row["steps"] == 6 and row["lengths"] == [3, 13]


def test_batches_are_padded_to_their_longest_sequence():
    size = SCRIPT["get_size"]("B=4,L=8,H=2,P=4,U=16")
    for x, mask, dy in SCRIPT["batches"](size, (5, 9), 5, SCRIPT["torch"].float64, "cpu", 1):
        length = x.shape[1]
        assert 5 <= length <= 9 and mask.shape == (4, length) and dy.shape == x.shape
        assert mask[0].all() and (mask.sum(1) >= 1).all()  # the first sequence is the longest; none is empty
        assert ((mask[:, 1:] <= mask[:, :-1]).all())  # padding only at the end


@pytest.mark.parametrize("argv", [["--lengths", "9", "3"], ["--steps", "1"], ["--multiple", "0"]])
def test_argument_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"]([*TINY, *argv])
    assert exit_info.value.code == 2 and "need 1 <= MIN <= MAX" in capsys.readouterr().err
