"""scripts/epilogue_costs.py on the CPU: every variant's text edits still apply to the rendered shipped kernels (a
template change that moves them fails here, not on the GPU), and each edit changes the source."""
import runpy
from pathlib import Path

SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "epilogue_costs.py"))


def test_every_variant_is_the_shipped_kernel_with_its_edits():
    for name, (epilogue, edits) in SCRIPT["VARIANTS"].items():
        text, shipped = SCRIPT["source"](name), SCRIPT["shipped"](epilogue).render()
        assert (text == shipped) == (not edits), name
        for old, new in edits:
            assert old in shipped and new in text, name
    assert "Sm90AuxStore" not in SCRIPT["source"]("gelu_noaux")
    assert "return dy;" in SCRIPT["source"]("dgelu_id") and "ErfGeluGrad" in SCRIPT["source"]("dgelu_id")
