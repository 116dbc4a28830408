"""scripts/compare_sass.py's comparison (no nvcc or cuobjdump needed): which variants' machine code changed, and
the opcode counts that did."""
import json
import runpy
from pathlib import Path

import pytest

SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "compare_sass.py"))
SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/                   {extra}EXIT ;
"""


def side(root: Path, kernels: dict[str, str]) -> Path:
    root.mkdir()
    for number, text in enumerate(kernels.values()):
        (root / f"{number}.sass").write_text(text)
    (root / "index.json").write_text(json.dumps({key: f"{n}.sass" for n, key in enumerate(kernels)}))
    return root


def test_changed_kernels_are_counted_and_their_opcodes_listed(tmp_path, capsys):
    same = SASS.format(extra="")
    more = SASS.format(extra="IMAD R2, R2, R3, RZ ;\n        /*0030*/                   ")
    base = side(tmp_path / "base", {"a": same, "b": same, "old": same})
    head = side(tmp_path / "head", {"a": same, "b": more, "new": same})
    assert SCRIPT["compare"](base, head) == 1
    out = capsys.readouterr().out
    assert "2 variants on both sides: 1 with the same machine code, 1 changed; 1 only here, 1 only at the base" in out
    assert "instructions 3 -> 4: {'IMAD': 1}" in out
    assert SCRIPT["opcodes"](same) == {"LDC": 1, "HMMA": 1, "EXIT": 1}


def test_a_base_that_is_no_commit_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT["main"](["--base", "no-such-revision"])
    assert exit_info.value.code == 2 and "--base no-such-revision: not a commit" in capsys.readouterr().err
