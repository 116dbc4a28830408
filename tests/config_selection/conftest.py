"""Profiles shared by the optimizer's tests: synthetic ones (written once per session through RecordWriter) and
the shipped H100 ones (read once per session: seconds each)."""
from pathlib import Path

import pytest

from substation.config_selection.profiles import load_profile
from substation.config_selection.synthetic import SyntheticSpec, write_synthetic_profile
from substation.graph import layer_graph
from substation.sizes import Size

SMALL = Size.from_heads(B=2, L=16, H=2, P=8, U=32)
GRAPH = layer_graph()
SHIPPED = Path(__file__).parents[2] / "layouts" / "profiles" / "h100"

# Small enough to brute-force: only the named tensors take other layouts than their canonical one.
SPECS = {
    "ffn": SyntheticSpec(SMALL, seed=0, algorithms=2, fused_combos=64, sdpa=False,
                         free_tensors=("X1", "F", "H1", "N1", "Rs1")),
    "ffn_seed1": SyntheticSpec(SMALL, seed=1, algorithms=2, fused_combos=64, sdpa=False,
                               free_tensors=("X1", "F", "H1", "N1", "Rs1")),
    "attention": SyntheticSpec(SMALL, seed=2, algorithms=2, fused_combos=64, sdpa=True, free_tensors=("Q", "dQ")),
    "attention_seed3": SyntheticSpec(SMALL, seed=3, algorithms=2, fused_combos=64, sdpa=True,
                                     free_tensors=("K", "dK")),
    # Every tensor free, a few rows each: the whole layer's structure at test speed.
    "layer": SyntheticSpec(SMALL, seed=4, algorithms=1, fused_combos=24, sdpa_combos=16, sdpa=True),
}


@pytest.fixture(scope="session")
def specs():
    """name -> SyntheticSpec of the shared profiles."""
    return SPECS


@pytest.fixture(scope="session")
def profile_dirs(tmp_path_factory):
    """name -> directory holding the spec's contractions.csv and kernels.csv."""
    root = tmp_path_factory.mktemp("profiles")
    dirs = {}
    for name, spec in SPECS.items():
        write_synthetic_profile(root / name, spec, GRAPH)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="session")
def profiles(profile_dirs):
    """name -> loaded Profile."""
    return {name: load_profile(path, GRAPH) for name, path in profile_dirs.items()}


@pytest.fixture(scope="session")
def shipped():
    """preset -> the shipped H100 profile of that size."""
    return {preset: load_profile(SHIPPED / preset, GRAPH) for preset in ("bert-large-b8-l512", "bert-large-b96-l128")}
