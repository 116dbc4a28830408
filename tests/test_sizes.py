"""Problem sizes and presets."""
import pytest

from substation.errors import SizeError
from substation.sizes import PRESETS, Size, get_size


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
