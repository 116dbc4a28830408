"""scripts/time_padded_batches.py's batches on the CPU: the masks it times the split on (the timing needs a GPU)."""
import runpy
from pathlib import Path

import torch

SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "time_padded_batches.py"))


def test_masks_are_full_three_quarters_and_two_batches_as_a_loader_pads_them():
    masks = SCRIPT["masks"](8, 384, torch.Generator().manual_seed(0))
    assert list(masks) == ["full", "3/4 kept", "loader A", "loader B"]
    assert masks["full"].all() and (masks["3/4 kept"].sum(1) == 288).all()
    for name, mask in masks.items():
        assert mask.shape == (8, 384) and mask.dtype == torch.float32, name
        assert (mask[:, 1:] <= mask[:, :-1]).all() and (mask.sum(1) >= 1).all(), name  # prefixes, none empty
    for name in ("loader A", "loader B"):
        lengths = masks[name].sum(1)
        assert lengths[0] == 384 and lengths.unique().numel() > 2, name  # the first is the longest; lengths vary
    assert not torch.equal(masks["loader A"], masks["loader B"])
