#!/usr/bin/env python3
"""Where the time of our GEMMs with GELU epilogues goes (GPU): the shipped CUTLASS kernel (pingpong 128x128x64,
cluster 1x2, TN, bias along m: `kernels/gemm_epilogue.py`) beside copies of it with one part of the epilogue taken
out, on the ffn_in call of both BERT-large sizes (m = 4096, k = 1024, n = 4096 or 12288 tokens):

- `plain`: D = acc (the mainloop's yardstick);
- `gelu`: the shipped `bias_gelu` (F and GELU(F + b1) stored); `gelu_id`: the same with GELU(z) = z (the bias and
  the store of F kept: what the erf costs); `gelu_noaux`: GELU without the store of F; `gelu_maxform`: GELU as
  max(x, 0) - |x|·Phi(-|x|), one instruction an element fewer than x·Phi(x);
- `dgelu`: the shipped `dgelu_bgrad` (dF = acc·GELU'(F + b1) and the tiles' sums); `dgelu_id`: GELU'(z) = 1;
- `gelu_ex2poly`, `dgelu_ex2poly`: Phi(-|x|) as 2^(r(t) - t²·log2(e)/2) with r a polynomial (`EX2POLY`), one
  special-function operation an element where the shipped form takes two (a reciprocal and a 2^x): if the erf's
  cost is the MUFU pipe's, these take about half of it away. GELU' needs phi/Phi(-|x|), here -ln2·d/dt of the
  exponent, from the same Horner pass;
- `gelu_poly11`, `dgelu_poly11`: Phi(-|x|) as P(t)·exp(-t²/2) with P a polynomial (`POLY11`), phi(x) from the
  same exp: one special-function operation, a higher degree, no derivative.
  On an H200 both are slower than the shipped form (`layouts/h200-epilogue-costs-one-mufu-twentysixth.txt`:
  B8/L512 `gelu` 65.5 µs, `gelu_ex2poly` 68.4, `gelu_poly11` 71.6): the erf does not wait on the MUFU pipe.

The copies are text edits of the rendered kernel (each asserted to apply), compiled through our nvcc JIT and cache,
all of them in parallel (`--jobs`). Each is timed with the L2 flushed (`substation.timing.time_steps`: median of 100
after 10 warm-up), three rounds in turn; the GELU variants that compute it are checked against PyTorch's float64
GELU, the GELU' ones against `plain`'s product times the float64 GELU'.

    python scripts/epilogue_costs.py > layouts/h100-epilogue-costs.txt
    python scripts/epilogue_costs.py --build-only   # compile the variants (no GPU needed)
"""
from __future__ import annotations

import argparse
import statistics
import types
from concurrent.futures import ThreadPoolExecutor

from substation.jit import Cubin, compile_library
from substation.kernels.gemm_epilogue import (ARCH, EpilogueGemm, GemmEpilogueVariant, cutlass_include,
                                              cutlass_package)

AUX_STORE = ("Sm90EVT<Sm90AuxStore<StagesD, EpilogueTile, Element, kRound, StrideD, SmemLayoutAtom, CopyOpAux, "
             "kAlign>, Sm90AccFetch>")
AUX_ARGUMENTS = "{{{{}, {aux, aux_stride}}, {bias, Element(0), {}}, {}}, {}}"
GELU = "return T(float(z) * NormalCdfPdf(float(z)).cdf);"
GELU_MAXFORM = """
#ifdef __CUDA_ARCH__
    const float x = float(z);
    const float t = reciprocal_ftz(1.f + 0.23164189f * fabsf(x)), e = exp2_ftz(x * x * -0.72134752044448170f);
    const float half_poly = t * (0.127414796f + t * (-0.142248368f + t * (0.7107068705f + t * (-0.7265760135f +
                            t * 0.5307027145f))));
    return T(fmaxf(x, 0.f) - fabsf(x) * (half_poly * e));
#else
    return T(float(z) * NormalCdfPdf(float(z)).cdf);
#endif
"""
GELU_GRAD = "return T(float(dy) * (n.cdf + x * n.pdf));"
# r(t) = log2(erfcx(t/√2)/2) on t in [0, 6], a degree-8 polynomial in s = t/3 - 1, highest power first
# (`scripts/fit_gelu_tail.py --form log`, which fits it and evaluates it in float32 as below: |GELU error| <= 3.8e-7
# (shipped: 4.2e-7), relative 1.5e-5 where |GELU| > 1e-3 (1.7e-4), |GELU' error| <= 1.9e-7 (3.0e-7); numpy's
# float32, not a GPU run). Past |x| = 6 (Phi(-|x|) < 1e-9) r stays r(6) and the Gaussian term alone makes the tail
# fall, so no select is needed and nothing overflows; an infinite x gives what the shipped form gives.
R_COEFFICIENTS = (-0.0148417195, -0.0472708978, -0.0284495391, -0.0600895621, 0.090324007, -0.202517569,
                  0.458663881, -1.22523344, -3.04080796)
EX2POLY = ("    const float t = fabsf(x), s = fmaf(fminf(t, 6.f), 0.333333343f, -1.f);\n"
           f"    float r = {R_COEFFICIENTS[0]}f, dr = 0.f;  // r(s) and dr/ds by one Horner pass\n"
           + "".join(f"    dr = fmaf(dr, s, r); r = fmaf(r, s, {c}f);\n" for c in R_COEFFICIENTS[1:])
           + "    const float tail = exp2_ftz(fmaf(t * t, -0.72134752044448170f, r));\n")
GELU_EX2POLY = f"""
#ifdef __CUDA_ARCH__
    const float x = float(z);
{EX2POLY}    return T(x * (x < 0.f ? tail : 1.f - tail));
#else
    {GELU}
#endif
"""
GELU_GRAD_BODY = "const NormalCdfPdf n(x);\n    " + GELU_GRAD
# P(t) = erfcx(t/√2)/2 = Phi(-t)·exp(t²/2) on t in [0, 5], a degree-11 polynomial in s = 0.4·t - 1, highest power
# first (`fit_gelu_tail.py --form direct`: |GELU error| <= 4.2e-7, relative 3.6e-5, |GELU' error| <= 1.6e-7). Past
# |x| = 5, P stays P(5) (0.078; exp(-t²/2) < 4e-6).
P_COEFFICIENTS = (-0.0072896746, -0.0085863648, -0.00165640982, 0.0159739982, -0.00328256027, 0.0131263928,
                  -0.0273649264, 0.0394951031, -0.05968998, 0.0853408426, -0.114035457, 0.141331002)
POLY11 = ("    const float t = fabsf(x), s = fmaf(fminf(t, 5.f), 0.4f, -1.f);\n"
          f"    float p = {P_COEFFICIENTS[0]}f;\n"
          + "".join(f"    p = fmaf(p, s, {c}f);\n" for c in P_COEFFICIENTS[1:])
          + "    const float e = exp2_ftz(t * t * -0.72134752044448170f), tail = p * e;\n")
GELU_POLY11 = GELU_EX2POLY.replace(EX2POLY, POLY11)
DGELU_POLY11 = f"""
#ifdef __CUDA_ARCH__
{POLY11}    return T(float(dy) * fmaf(x, 0.39894228040143268f * e, x < 0.f ? tail : 1.f - tail));
#else
    {GELU_GRAD_BODY}
#endif
"""
# phi(x)/Phi(-|x|) = t - ln2·r'(t), and r'(t) = (dr/ds)/3 (past |x| = 6 a stand-in, times a tail below 1e-9)
DGELU_EX2POLY = f"""
#ifdef __CUDA_ARCH__
{EX2POLY}    const float mills = fmaf(dr, -0.231049061f, t);
    return T(float(dy) * fmaf(x * tail, mills, x < 0.f ? tail : 1.f - tail));
#else
    {GELU_GRAD_BODY}
#endif
"""
# name: (the shipped epilogue it starts from, its text edits)
VARIANTS = {
    "plain": ("plain", ()),
    "gelu": ("bias_gelu", ()),
    "gelu_id": ("bias_gelu", ((GELU, "return z;"),)),
    "gelu_noaux": ("bias_gelu", ((AUX_STORE, "Sm90AccFetch"),
                                 (AUX_ARGUMENTS, "{{{}, {bias, Element(0), {}}, {}}, {}}"))),
    "gelu_maxform": ("bias_gelu", ((GELU, GELU_MAXFORM),)),
    "dgelu": ("dgelu_bgrad", ()),
    "dgelu_id": ("dgelu_bgrad", ((GELU_GRAD, "return dy;"),)),
    "gelu_ex2poly": ("bias_gelu", ((GELU, GELU_EX2POLY),)),
    "dgelu_ex2poly": ("dgelu_bgrad", ((GELU_GRAD_BODY, DGELU_EX2POLY),)),
    "gelu_poly11": ("bias_gelu", ((GELU, GELU_POLY11),)),
    "dgelu_poly11": ("dgelu_bgrad", ((GELU_GRAD_BODY, DGELU_POLY11),)),
}
TOKENS = {"bert-large-b8-l512": 4096, "bert-large-b96-l128": 12288}
M, K = 4096, 1024


def shipped(epilogue: str) -> GemmEpilogueVariant:
    return GemmEpilogueVariant(epilogue, "T", "N", "m", (128, 128, 64), (1, 2), "pingpong")


def source(name: str) -> str:
    """The variant's CUDA source: the shipped kernel's, edited."""
    epilogue, edits = VARIANTS[name]
    text = shipped(epilogue).render()
    for old, new in edits:
        if text.count(old) < 1:
            raise SystemExit(f"{name}: the template no longer holds {old[:60]!r}...: update this script")
        text = text.replace(old, new)
    return text


def build(name: str) -> Cubin:
    variant = shipped(VARIANTS[name][0])
    return compile_library(source(name), f"{variant.label} ({name})", ARCH, {cutlass_include(): cutlass_package()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="variants compiled at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    with ThreadPoolExecutor(args.jobs) as pool:
        built = dict(zip(VARIANTS, pool.map(build, VARIANTS)))
    if args.build_only:
        return
    import torch
    from substation.timing import time_steps
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(0)}; µs, L2 flushed, median of 100, {args.rounds} rounds in turn")
    for size, n in TOKENS.items():
        call = types.SimpleNamespace(m=M, n=n, k=K, batch=1, lda=K, ldb=K, ldc=M, stride_a=0, stride_b=0, stride_c=0)
        a = torch.randn(M * K, device="cuda", dtype=torch.float16) / 16
        b = torch.randn(K * n, device="cuda", dtype=torch.float16) / 2
        bias = torch.randn(M, device="cuda", dtype=torch.float16)
        aux_in = torch.randn(M * n, device="cuda", dtype=torch.float16)
        partials = torch.empty((n // 128 + 2) * (M + 256), device="cuda", dtype=torch.float32)
        stream = torch.cuda.current_stream().cuda_stream
        runners, outputs = {}, {}
        for name, library in built.items():
            gemm = EpilogueGemm(shipped(VARIANTS[name][0]), library)
            workspace = torch.empty(max(gemm.workspace_bytes(call), 1), device="cuda", dtype=torch.uint8)
            d = torch.empty(M * n, device="cuda", dtype=torch.float16)
            aux = aux_in if name.startswith("dgelu") else torch.empty_like(aux_in)

            def run(gemm=gemm, d=d, aux=aux, workspace=workspace) -> None:
                gemm(call, a.data_ptr(), b.data_ptr(), d.data_ptr(), stream, aux.data_ptr(), bias.data_ptr(),
                     partials.data_ptr(), workspace.data_ptr())
            run()
            torch.cuda.synchronize()
            runners[name], outputs[name] = run, (d.clone(), aux.clone())
        f = outputs["gelu"][1].float().view(n, M)  # F (column-major m x n: a row per token)
        exact = torch.nn.functional.gelu(f.double() + bias.double())
        for name in ("gelu", "gelu_maxform", "gelu_ex2poly", "gelu_poly11"):
            error = (outputs[name][0].double().view(n, M) - exact).abs().max().item()
            print(f"{size} {name}: max |H1 - GELU_erf(F + b1)| {error:.3e}")
        z = aux_in.double().view(n, M) + bias.double()
        slope = torch.special.ndtr(z) + z * torch.exp(-z * z / 2) / (2 * torch.pi) ** 0.5
        exact_grad = outputs["plain"][0].double().view(n, M) * slope  # acc·GELU'(F + b1)
        for name in ("dgelu", "dgelu_ex2poly", "dgelu_poly11"):
            error = (outputs[name][0].double().view(n, M) - exact_grad).abs().max().item()
            print(f"{size} {name}: max |dF - acc·GELU'(F + b1)| {error:.3e} (max |dF| {exact_grad.abs().max():.2f})")
        times = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, run in runners.items():
                times[name].append(time_steps(run, warmup=10, runs=100).median_us)
        for name, found in times.items():
            print(f"{size} {name:13s} {statistics.median(found):7.1f}   rounds {' '.join(f'{t:.1f}' for t in found)}")


if __name__ == "__main__":
    main()
