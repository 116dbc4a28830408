"""Configuration files: the pickle and its JSON twin from one dict, and a loader that refuses what does not fit."""
import json
import os
import pickle

import pytest

from substation.config_file import configuration_dropout
from substation.config_selection import (combined, configuration_dict, load_configuration, to_configuration,
                                         write_configuration)
from substation.errors import ConfigurationFileError
from substation.graph import layer_graph
from substation.layouts import Configuration
from substation.sizes import Size

GRAPH = layer_graph()


@pytest.fixture(scope="module")
def written(profiles, tmp_path_factory):
    """(selection, pickle path, json path) of the layer profile, on which the ILP splits some tensors itself."""
    selection = combined(profiles["layer"], GRAPH)
    assert selection.split_vars, "the file's split variables need an example"
    pickle_path, json_path = write_configuration(selection, tmp_path_factory.mktemp("layouts") / "small.pickle")
    return selection, pickle_path, json_path


def _builtins_only(value):
    if isinstance(value, dict):
        return all(isinstance(k, str) and _builtins_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(map(_builtins_only, value))
    return value is None or type(value) in (str, int, float, bool)


def test_pickle_and_json_twin_hold_the_same_builtins(written):
    selection, pickle_path, json_path = written
    assert json_path == pickle_path.with_suffix(".json")
    from_pickle, from_json = load_configuration(pickle_path), load_configuration(json_path, size=selection.size)
    assert from_pickle == from_json and _builtins_only(from_pickle)
    assert from_pickle == pickle.loads(pickle_path.read_bytes())
    expected = configuration_dict(selection)
    assert {k: v for k, v in from_pickle.items() if k != "created"} == {k: v for k, v in expected.items()
                                                                          if k != "created"}


def test_the_file_holds_what_design_md_lists(written):
    selection, pickle_path, _ = written
    data = load_configuration(pickle_path)
    for key in ("format_version", "size", "dtype", "gpu", "graph_order", "split_vars", "tensors", "operators",
                "predicted_total_us", "default_total_us", "profile", "created", "substation_version"):
        assert key in data
    assert data["format_version"] == 1 and data["size"] == selection.size.dims() and data["graph_order"] == "combined"
    assert data["split_vars"] == list(selection.split_vars) == list(data["transposes"])
    for name, layout in data["tensors"].items():  # two layouts exactly where a conversion is paid
        if name in selection.split_vars:
            assert layout == {"forward": selection.layouts[name], "backward": selection.backward[name]}
            assert layout["forward"] != layout["backward"] == data["transposes"][name]["backward"]
        else:
            assert layout == selection.layouts[name]
    assert data["tensors"]["X"] == "bji" and sorted(data["tensors"]) == sorted(GRAPH.tensors)
    assert sorted(data["operators"]) == sorted(op.name for op in GRAPH.operators)
    for entry in data["operators"].values():
        assert {"impl", "options", "layouts", "label", "predicted_us"} <= set(entry)
    booked = sum(e["predicted_us"] for e in data["operators"].values()) + sum(
        t["us"] for t in data["transposes"].values())
    assert booked == pytest.approx(data["predicted_total_us"]) == pytest.approx(selection.predicted_total_us)
    assert data["default_total_us"] == pytest.approx(selection.default.total_us)
    assert data["profile"] == {"path": selection.profile_path, "sha256": selection.profile_sha256,
                               "excluded_impls": list(selection.excluded_impls)}
    assert data["dropout"] == selection.profile_dropout == 0.1 == configuration_dropout(data)
    assert data["deterministic"] is True  # no row of SDPA's backwards nor of our atomic dQ was allowed
    assert configuration_dropout({k: v for k, v in data.items() if k != "dropout"}) == 0.1, "files before the field"


def test_to_configuration(written):
    selection, pickle_path, _ = written
    config = to_configuration(load_configuration(pickle_path))
    assert isinstance(config, Configuration)
    split = selection.split_vars[0]
    assert config.layout(split, "forward") == selection.layouts[split]
    assert config.layout(split, "backward") == selection.backward[split]
    assert dict(config.layouts) == dict(selection.layouts)


def _rewrite(path, data):
    path.write_bytes(pickle.dumps(data))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format_version=2), r"field format_version: expected 1 .*, got 2"),
    (lambda d: d.pop("operators"), "field operators: expected a value"),
    # a valid size (and its entry in sizes), caught only when the caller names the size
    (lambda d: [d["size"].update(B=3), d["sizes"][0]["size"].update(B=3)], None),
    (lambda d: d["size"].update(I=7), r"field size: I=7 must equal H\*P"),
    (lambda d: d.update(dtype="float8"), r"field dtype: expected one of .*, got 'float8'"),
    (lambda d: d["tensors"].update(O="bjx"), r"field tensors.O: expected an order of 'bji', got 'bjx'"),
    (lambda d: d["tensors"].pop("F"), r"field tensors: expected a layout for each of"),
    (lambda d: d["tensors"].update(dW1="iu" if d["tensors"]["W1"] == "ui" else "ui"),
     r"field tensors: tensor 'dW1' must share the layout of 'W1'"),
    (lambda d: d["tensors"].update(X="jbi"), r"field tensors: tensor 'X' is user-visible"),
    (lambda d: d["tensors"].update({d["split_vars"][0]: d["tensors"][d["split_vars"][0]]["forward"]}),
     r"field tensors.\w+: expected \{forward, backward\}"),
    (lambda d: d["operators"]["ffn_in"]["layouts"].update(F="ujb" if d["tensors"]["F"] != "ujb" else "jbu"),
     r"field operators.ffn_in.layouts.F: expected '\w+' \(its layout in tensors.F\), got '\w+'"),
    (lambda d: d["operators"]["ln1"].pop("impl"), r"field operators.ln1: expected a dict with impl"),
    (lambda d: d.update(dropout=1.0), r"field dropout: expected a probability in \[0, 1\), or null, got 1.0"),
    (lambda d: d.update(dropout="0.1"), r"field dropout: expected a probability in \[0, 1\), or null, got '0.1'"),
])
def test_a_file_that_does_not_fit_names_the_field(written, tmp_path, change, message):
    _, pickle_path, _ = written
    data = pickle.loads(pickle_path.read_bytes())
    change(data)
    path = _rewrite(tmp_path / "bad.pickle", data)
    if message is None:
        load_configuration(path)
        with pytest.raises(ConfigurationFileError, match=r"field size: expected \{'B': 2, .*got \{'B': 3"):
            load_configuration(path, size=Size.from_heads(B=2, L=16, H=2, P=8, U=32))
        return
    with pytest.raises(ConfigurationFileError, match=message):
        load_configuration(path)


def test_wrong_size_or_dtype_asked_for(written):
    selection, pickle_path, _ = written
    with pytest.raises(ConfigurationFileError, match=r"field size: expected \{'B': 8, 'L': 512.*got \{'B': 2"):
        load_configuration(pickle_path, size=Size.from_heads(B=8, L=512, H=16, P=64, U=4096))
    with pytest.raises(ConfigurationFileError, match="field dtype: expected 'bfloat16', got 'float16'"):
        load_configuration(pickle_path, size=selection.size.with_dtype("bfloat16"))


def test_truncated_corrupt_or_foreign_files(written, tmp_path):
    _, pickle_path, json_path = written
    whole = pickle_path.read_bytes()
    (tmp_path / "cut.pickle").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigurationFileError, match=r"cut.pickle: not a configuration pickle: corrupt or truncated"):
        load_configuration(tmp_path / "cut.pickle")
    (tmp_path / "noise.pickle").write_bytes(os.urandom(64))
    with pytest.raises(ConfigurationFileError, match="noise.pickle: not a configuration pickle"):
        load_configuration(tmp_path / "noise.pickle")
    (tmp_path / "cut.json").write_text(json_path.read_text()[:100])
    with pytest.raises(ConfigurationFileError, match="cut.json: not a configuration JSON"):
        load_configuration(tmp_path / "cut.json")
    (tmp_path / "empty.pickle").write_bytes(b"")
    with pytest.raises(ConfigurationFileError, match="empty.pickle: not a configuration pickle"):
        load_configuration(tmp_path / "empty.pickle")
    with pytest.raises(ConfigurationFileError, match="missing.pickle: cannot read"):
        load_configuration(tmp_path / "missing.pickle")


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_the_unpickler_refuses_every_global(written, tmp_path):
    _, pickle_path, _ = written
    data = pickle.loads(pickle_path.read_bytes())
    data["gpu"] = Exploit()
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps(data))
    with pytest.raises(ConfigurationFileError, match=r"refusing (posix|os)\.system"):
        load_configuration(tmp_path / "evil.pickle")
    data["gpu"] = ("a", "tuple")
    (tmp_path / "tuple.pickle").write_bytes(pickle.dumps(data))
    with pytest.raises(ConfigurationFileError, match="field gpu: expected str, int, float, bool, None, list or dict, "
                                                     "got 'tuple'"):
        load_configuration(tmp_path / "tuple.pickle")


def test_output_must_be_a_pickle_path(written, tmp_path):
    selection, _, _ = written
    with pytest.raises(ConfigurationFileError, match="expected a path ending in .pickle"):
        write_configuration(selection, tmp_path / "x.json")


def test_json_twin_is_plain_json(written):
    _, _, json_path = written
    data = json.loads(json_path.read_text())
    assert data["unmaterialized"] == sorted(data["unmaterialized"], key=list(GRAPH.tensors).index)


@pytest.mark.parametrize("preset", ["bert-large-b8-l512", "bert-large-b96-l128"])
def test_every_shipped_configuration_loads_and_matches_its_twin(preset):
    from pathlib import Path

    from substation.sizes import get_size

    pickle_path = Path(__file__).parents[2] / "layouts" / f"h100-{preset}.pickle"
    data = load_configuration(pickle_path, size=get_size(preset))
    assert data == json.loads(pickle_path.with_suffix(".json").read_text())
    assert data["graph_order"] == "combined" and data["predicted_total_us"] < data["default_total_us"]
    to_configuration(data)  # every layout valid for the graph
