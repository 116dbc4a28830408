"""Substation: a data-movement-driven layout optimizer for transformer encoder layers."""
from setuptools import setup

# The pipeline's stage folders live at the top of the repository (one folder per stage) but are
# installed as subpackages of `substation`, so nothing else lands at the top of site-packages.
STAGES = ("tc_profiling", "kernels", "config_selection")

setup(
    name="substation",
    version="0.1.0",
    description="Data-movement-driven layout optimizer for BERT encoder layers on NVIDIA GPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # substation.shipped: the shipped configurations (substation/shipped.py), data only, from layouts/.
    packages=["substation", *(f"substation.{stage}" for stage in STAGES), "substation.shipped"],
    package_dir={"substation": "substation", **{f"substation.{stage}": stage for stage in STAGES},
                 "substation.shipped": "layouts"},
    package_data={"substation.kernels": ["templates/*.j2"],  # the CUDA templates the JIT renders
                  "substation.shipped": ["h[0-9]00-bert-*.json"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "networkx>=3",
        "pulp>=2.8",
        "highspy",
        "jinja2>=3",
        "pandas>=2",
        "tqdm",
        "matplotlib",
        "nvidia-cutlass>=4.2",  # CUTLASS/CuTe headers: the GEMMs with our epilogues (kernels/gemm_epilogue.py)
    ],
    extras_require={
        "hf": ["transformers>=4.40"],
        "gpu": ["nvmath-python"],  # cuBLAS(Lt); kernels launch through the driver API (substation/launch.py)
        "dev": ["pytest>=7"],
    },
    entry_points={"console_scripts": ["substation=substation.cli:main"]},
)
