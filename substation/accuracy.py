"""How close a kernel comes to the float64 reference: one error measure and one budget rule, shared by the
profilers' checks and the tests."""
from __future__ import annotations

import torch

# A kernel's error vs the float64 reference may be at most twice that of the PyTorch ops it replaces
# in the same dtype, plus this floor (both can be near zero on easy data).
ERROR_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want|: one number per tensor, robust to zeros in `want`."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def norm_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖₂ / ‖want‖₂: the error of a whole tensor, as a layer's accuracy is usually stated."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def error_budget(pytorch_error: float, dtype: torch.dtype) -> float:
    return 2 * pytorch_error + ERROR_FLOOR[dtype]
