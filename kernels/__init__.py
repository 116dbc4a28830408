"""Stage 1b, fused kernels: jinja2 CUDA templates of the fused operators, their launchers and profiler."""
