"""substation.shipped: which shipped configuration a layer of given dimensions runs, on which GPU, at which length."""
import json

import pytest

from substation.shipped import FOLDERS, Shipped, gpu_kind, shipped, shipped_configuration, shipped_for
from substation.sizes import PRESETS

LAYOUTS = FOLDERS[1]
BERT_LARGE = (16, 64, 4096)


def test_every_shipped_default_is_found_and_the_special_purpose_files_are_not():
    found = {s.path.name: s for s in shipped()}
    named = {p.name for p in LAYOUTS.glob("h[0-9]00-*.json") if p.stem.removesuffix("-nondet").split("-", 1)[1]
             in PRESETS}
    assert set(found) == named and len(named) >= 6
    assert not any(name.endswith(("-cudnn.json", "-nomask.json")) for name in found)
    for s in found.values():
        data = json.loads(s.path.read_text())
        assert s.dims == (data["size"]["H"], data["size"]["P"], data["size"]["U"]) and s.length == data["size"]["L"]
        assert s.deterministic == data["deterministic"] and data["gpu"].lower().split()[1].startswith(s.gpu)


@pytest.mark.parametrize("length, device, nondet, want", [
    (512, None, False, "h100-bert-large-b8-l512.json"),
    (512, None, True, "h100-bert-large-b8-l512-nondet.json"),
    (128, "NVIDIA H100 80GB HBM3", True, "h100-bert-large-b96-l128.json"),  # no -nondet at L=128: one key tile
    (384, "NVIDIA H200", False, "h200-bert-large-b8-l512.json"),  # nearer 512 than 128
    (300, "NVIDIA H200", True, "h200-bert-large-b96-l128.json"),  # nearer 128
    (320, "NVIDIA H200", False, "h200-bert-large-b8-l512.json"),  # as near both: the longer
    (512, "NVIDIA A100-SXM4-80GB", False, "h100-bert-large-b8-l512.json"),  # no profile of its own: the H100's
])
def test_the_nearest_length_on_the_gpus_own_profile_else_the_h100s(length, device, nondet, want):
    assert shipped_configuration(*BERT_LARGE, length, device, nondet).name == want


def test_no_configuration_for_other_dimensions():
    assert shipped_configuration(12, 64, 3072) is None  # BERT-base: profile and optimize it
    assert shipped_configuration(16, 64, 2048) is None


def test_gpu_kind_reads_the_device_name():
    assert [gpu_kind(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe")] == ["h100", "h200",
                                                                                                  "h100"]
    assert [gpu_kind(n) for n in ("NVIDIA A100-SXM4-80GB", "NVIDIA H20", None)] == ["h100"] * 3


def test_records_are_frozen():
    with pytest.raises(AttributeError):
        shipped()[0].length = 1
    assert isinstance(shipped()[0], Shipped)


def test_shipped_for_takes_the_gpus_own_files_and_the_h100s_for_presets_it_lacks():
    h200 = shipped_for("NVIDIA H200")
    assert {s.gpu for s in h200} == {"h200"} and {s.preset for s in h200} == {s.preset for s in shipped()}
    assert {s.gpu for s in shipped_for("NVIDIA A100-SXM4-80GB")} == {"h100"}
