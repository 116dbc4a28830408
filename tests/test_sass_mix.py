"""scripts/sass_mix.py's SASS reading, on a hand-written listing in cuobjdump's format (no toolkit needed)."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "sass_mix.py"
LISTING = """
	code for sm_90
		Function : attn_dq
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/                   BRA 0x0 ;
		Function : attn_dkdv
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0030*/               @P0 IMAD.WIDE.U32 R10, R3, -0x2daee0ad, RZ ;
        /*0040*/                   LOP3.LUT R12, R10, R11, R5, 0x96, !PT ;
        /*0050*/              @!P1 BRA 0x20 ;
        /*0060*/                   LOP3.LUT R13, R10, R11, R5, 0x96, !PT ;
        /*0070*/               @P2 BRA 0x50 ;
        /*0080*/                   EXIT ;
"""


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("sass_mix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_longest_backward_branch_is_the_main_loop(script):
    """0x20..0x50 (4 instructions, predicates dropped) beats 0x50..0x70; the other kernel's loop is not counted."""
    mix = script.main_loop(LISTING, "_dkdv")
    assert mix == {"HMMA": 1, "IMAD.WIDE": 1, "LOP3": 1, "BRA": 1}


def test_a_kernel_without_a_loop_or_missing_is_named(script):
    with pytest.raises(SystemExit, match="no kernel ending '_dqsum'"):
        script.main_loop(LISTING, "_dqsum")
    with pytest.raises(SystemExit, match="no loop"):
        script.main_loop(LISTING.replace("BRA 0x20", "BRA 0x80").replace("BRA 0x50", "BRA 0x80"), "_dkdv")


def test_a_configuration_names_the_kernels_it_runs(script):
    """--config: the shipped B8/L512 configuration runs our forward (its one kernel) and stacked backward (`_dkdv`
    counted) with its chosen knobs; the -cudnn one takes SDPA's cuDNN both ways, so there is nothing to count."""
    layouts = Path(__file__).parents[1] / "layouts"
    found = script.configured(layouts / "h100-bert-large-b8-l512.json")
    assert [(what, suffix) for what, _, suffix in found] == [("forward", ""), ("_dkdv", "_dkdv")]
    forward, backward = (point for _, point, _ in found)
    assert (forward.L, forward.wgmma, backward.stacked) == (512, 2, True)
    assert script.configured(layouts / "h100-bert-large-b8-l512-cudnn.json") == []


def test_no_dropout_compiles_the_switch_out_of_each_kernel(script):
    """--no-dropout: both attention templates decide dropout in the one line the script makes the constant false; a
    source without that line stops the script instead of counting the kernel with dropout on."""
    for _, point, _ in script.configured(Path(__file__).parents[1] / "layouts" / "h100-bert-large-b8-l512.json"):
        source = point.render()
        changed = script.without_dropout(source)
        assert script.DROPOUT_SWITCH not in changed and changed.count("const bool dropout = false;") == 1
        assert len(changed.splitlines()) == len(source.splitlines())
    with pytest.raises(SystemExit, match="does not decide dropout"):
        script.without_dropout("__global__ void k() {}")
