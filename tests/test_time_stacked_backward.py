"""scripts/time_stacked_backward.py on the CPU: which attention points `--config` (with `--backward`) times."""
import json
import runpy
from pathlib import Path

import pytest

from substation.kernels.base import InfeasibleVariantError

ROOT = Path(__file__).parents[1]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "time_stacked_backward.py"))
CONFIG = json.loads((ROOT / "layouts" / "h100-bert-large-b8-l512.json").read_text(encoding="utf-8"))


def test_the_backward_is_timed_once_per_set_of_knobs_in_the_configurations_layouts():
    configured = SCRIPT["points"](CONFIG, [])
    assert [p.op for p in configured] == ["attn_scores", "attn_context_dgrad_a"]
    forward, backward = configured
    found = SCRIPT["points"](CONFIG, SCRIPT["knob_sets"](["fuse_dq=1", "fuse_dq=4,min_blocks=1"]))
    assert found[0] == forward and len(found) == 3
    assert [(p.fuse_dq, p.min_blocks) for p in found[1:]] == [(1, backward.min_blocks), (4, 1)]
    assert all(p.layouts == backward.layouts and p.block_m == backward.block_m for p in found[1:])


def test_the_forward_is_timed_once_per_set_of_knobs_too():
    forward, backward = SCRIPT["points"](CONFIG, [])
    found = SCRIPT["points"](CONFIG, [], SCRIPT["knob_sets"](["wgmma=1", "wgmma=2,min_blocks=3"], "--forward"))
    assert [(p.op, p.wgmma, p.min_blocks) for p in found] == [("attn_scores", 1, forward.min_blocks),
                                                             ("attn_scores", 2, 3), ("attn_context_dgrad_a", 1, 2)]
    assert found[2] == backward and all(p.layouts == forward.layouts and p.block_m == forward.block_m
                                        for p in found[:2])


def test_bad_knobs_are_named():
    with pytest.raises(SystemExit, match="--backward 'fuse_dq': expected NAME=INT"):
        SCRIPT["knob_sets"](["fuse_dq"])
    with pytest.raises(SystemExit, match="--forward 'wgmma': expected NAME=INT"):
        SCRIPT["knob_sets"](["wgmma"], "--forward")
    with pytest.raises(InfeasibleVariantError, match="fuse_dq=3 must be"):
        SCRIPT["points"](CONFIG, SCRIPT["knob_sets"](["fuse_dq=3"]))
