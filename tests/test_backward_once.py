"""scripts/backward_once.py on the CPU: the padding mask it runs with (time_split_queries.py's) and its refusals
(the run needs a GPU)."""
import runpy
from pathlib import Path

import pytest
import torch

SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "backward_once.py"))


@pytest.mark.parametrize("keep, kept", [(1.0, 256), (0.75, 192), (0.7, 180), (1e-9, 1)])
def test_each_sequence_keeps_a_prefix_of_its_keys(keep, kept):
    mask = SCRIPT["prefix_mask"](3, 256, keep, torch.float16)
    assert mask.shape == (3, 256) and mask.dtype == torch.float16 and mask.is_contiguous()
    assert (mask.sum(1) == kept).all() and (mask[:, :kept] == 1).all() and (mask[:, kept:] == 0).all()


@pytest.mark.parametrize("argv, message", [(["--keep", "0"], "--keep"), (["--keep", "1.5"], "--keep"),
                                           (["--split", "2"], "invalid choice")])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        SCRIPT["main"](argv)
    assert raised.value.code == 2 and message in capsys.readouterr().err
