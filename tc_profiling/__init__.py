"""Stage 1a, contractions: every layout of every tensor contraction mapped to one GEMM call, timed on the GPU."""
