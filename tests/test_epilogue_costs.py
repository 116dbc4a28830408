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


FIT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "fit_gelu_tail.py"))


def test_the_one_mufu_variants_take_the_fitted_polynomials_and_beat_the_shipped_error():
    """The coefficients written into the variants are what fit_gelu_tail.py fits (to float32 rounding and BLAS
    differences), and evaluated in float32 as the CUDA code does, each form's GELU and GELU' errors against float64
    are at most the shipped form's (with the stated bounds), with no NaN where float64 has none."""
    import numpy as np

    x = FIT["checked_x"]()
    shipped = FIT["errors"](FIT["shipped"](x), x)
    for form, written in (("log", SCRIPT["R_COEFFICIENTS"]), ("direct", SCRIPT["P_COEFFICIENTS"])):
        degree, span = FIT["FITTED"][form]
        fitted = FIT["fit"](form, degree, span)
        np.testing.assert_allclose(written, fitted, rtol=1e-5, atol=1e-7, err_msg=form)
        found = FIT["errors"](FIT["evaluate"](form, written, span, x), x)
        assert found.nans == 0, form
        assert found.gelu <= max(shipped.gelu, 4.2e-7) and found.slope <= shipped.slope, (form, found, shipped)
        assert found.gelu_relative <= shipped.gelu_relative / 4, (form, found, shipped)
    assert "exp2_ftz" in SCRIPT["source"]("gelu_poly11") and "reciprocal_ftz(1.f" not in SCRIPT["GELU_POLY11"]
