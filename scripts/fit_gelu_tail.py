#!/usr/bin/env python3
"""The polynomials behind `epilogue_costs.py`'s one-special-function GELU variants (no GPU): Phi(-t), t = |x|, the
normal distribution's tail, either as 2^(r(t) - t²·log2(e)/2) with r(t) = log2(erfcx(t/√2)/2) a polynomial
(`--form log`: GELU' needs phi/Phi(-t) = t - ln2·r'(t), the polynomial's derivative) or as P(t)·exp(-t²/2) with
P(t) = erfcx(t/√2)/2 a polynomial (`--form direct`: phi = exp(-t²/2)/√(2π) comes from the same exp). Each is fitted
by least squares at Chebyshev points of [0, T], weighted by the size of the GELU and GELU' errors a misfit makes
there (Phi(-t)·(1 + t)), as a polynomial in s = 2t/T - 1 (t clamped to T), then evaluated in float32 as the CUDA
code does and compared with float64 GELU and GELU' over x in [-14, 14] (and out to ±1000, and ±3e38), beside the
shipped form (Abramowitz & Stegun 7.1.26: a reciprocal and a 2^x an element).

    python scripts/fit_gelu_tail.py              # both forms at the degrees epilogue_costs.py takes
    python scripts/fit_gelu_tail.py --form log --degrees 6 7 8 9 --span 6
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

LOG2E_HALF = math.log2(math.e) / 2  # t²/2 in base 2
FITTED = {"log": (8, 6.0), "direct": (11, 5.0)}  # form: (degree, T) of epilogue_costs.py's variants

_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def scaled_tail(t: np.ndarray) -> np.ndarray:
    """erfcx(t/√2)/2 = Phi(-t)·exp(t²/2), in float64 (math.erfc keeps its relative accuracy far into the tail)."""
    return 0.5 * _erfc(t / math.sqrt(2)) * np.exp(t * t / 2)


def exact(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 GELU(x) = x·Phi(x) and GELU'(x) = Phi(x) + x·phi(x)."""
    cdf = 0.5 * _erfc(-x / math.sqrt(2))
    return x * cdf, cdf + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def fit(form: str, degree: int, span: float, points: int = 4000) -> tuple[float, ...]:
    """The coefficients, highest power of s first, rounded to float32."""
    k = np.arange(points)
    t = span / 2 * (1 - np.cos(np.pi * (k + 0.5) / points))
    weight = scaled_tail(t) * np.exp(-t * t / 2) * (1 + t)
    target = np.log2(scaled_tail(t)) if form == "log" else scaled_tail(t)
    powers = np.vander(2 * t / span - 1, degree + 1)
    coefficients = np.linalg.lstsq(powers * weight[:, None], target * weight, rcond=None)[0]
    return tuple(float(np.float32(c)) for c in coefficients)


def evaluate(form: str, coefficients: tuple[float, ...], span: float, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """GELU and GELU' of float32 `x` as the CUDA code computes them, in float32 (ex2 exact here)."""
    f = np.float32
    x = x.astype(f)
    t = np.abs(x)
    s = np.minimum(t, f(span)) * f(2 / span) - f(1)
    value, slope = np.full_like(s, f(coefficients[0])), np.zeros_like(s)
    with np.errstate(all="ignore"):
        for c in coefficients[1:]:
            slope = slope * s + value
            value = value * s + f(c)
        if form == "log":
            tail = np.exp2(value - f(LOG2E_HALF) * t * t).astype(f)
            pdf = tail * (t - f(math.log(2) * 2 / span) * slope)  # phi = Phi(-t)·(t - ln2·r'(t))
        else:
            e = np.exp2(t * t * f(-LOG2E_HALF)).astype(f)
            tail, pdf = value * e, f(1 / math.sqrt(2 * math.pi)) * e
        cdf = np.where(x < 0, tail, f(1) - tail)
        return (x * cdf).astype(np.float64), (cdf + x * pdf).astype(np.float64)


def shipped(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shipped form (kernels/templates/gemm_epilogue.cu.j2, NormalCdfPdf), in float32."""
    f = np.float32
    x = x.astype(f)
    r = f(1) / (f(1) + f(0.23164189) * np.abs(x))
    with np.errstate(over="ignore"):
        e = np.exp2(x * x * f(-0.72134752044448170)).astype(f)
    poly = r * (f(0.254829592) + r * (f(-0.284496736) + r * (f(1.421413741) + r * (f(-1.453152027)
                                                                                    + r * f(1.061405429)))))
    tail = f(0.5) * poly * e
    cdf = np.where(x < 0, tail, f(1) - tail)
    return (x * cdf).astype(np.float64), (cdf + x * f(0.39894228040143268) * e).astype(np.float64)


@dataclass(frozen=True)
class Errors:
    gelu: float  # max |GELU error|
    gelu_relative: float  # max relative GELU error where |GELU| > 1e-3
    slope: float  # max |GELU' error|
    nans: int  # NaNs where float64 has none


def errors(got: tuple[np.ndarray, np.ndarray], x: np.ndarray) -> Errors:
    gelu, slope = exact(x.astype(np.float32).astype(np.float64))
    sizable = np.abs(gelu) > 1e-3
    return Errors(float(np.max(np.abs(got[0] - gelu))),
                  float(np.max(np.abs(got[0] - gelu)[sizable] / np.abs(gelu)[sizable])),
                  float(np.max(np.abs(got[1] - slope))), int(np.isnan(got[0]).sum() + np.isnan(got[1]).sum()))


def checked_x() -> np.ndarray:
    return np.concatenate([np.linspace(-14, 14, 280_001), np.linspace(-1000, 1000, 20_001),
                           np.array([-3e38, -1e20, 1e20, 3e38])]).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--form", choices=sorted(FITTED), nargs="+", default=sorted(FITTED))
    parser.add_argument("--degrees", type=int, nargs="+", help="default: the fitted degree of each form")
    parser.add_argument("--span", type=float, help="T (default: the fitted one of each form)")
    args = parser.parse_args(argv)
    x = checked_x()
    found = errors(shipped(x), x)
    print(f"shipped (A&S 7.1.26): |GELU err| {found.gelu:.2e}, relative {found.gelu_relative:.2e}, "
          f"|GELU' err| {found.slope:.2e}")
    for form in args.form:
        degree, span = FITTED[form]
        span = args.span or span
        for degree in args.degrees or [degree]:
            coefficients = fit(form, degree, span)
            found = errors(evaluate(form, coefficients, span, x), x)
            print(f"{form} degree {degree}, T = {span}: |GELU err| {found.gelu:.2e}, relative "
                  f"{found.gelu_relative:.2e}, |GELU' err| {found.slope:.2e}, NaNs {found.nans}")
            print("  coefficients, highest power first:", ", ".join(f"{c:.9g}" for c in coefficients))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
