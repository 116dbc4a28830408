"""Every implementation Substation has, registered in one place: the index of the implementation layer, which
the profilers iterate and the runtime looks choices up in. Adding an implementation is one file (it follows
`substation.protocol.Implementation`) and one line here.
"""
from __future__ import annotations

import functools

from substation.graph import LayerGraph
from substation.kernels import attention, sdpa
from substation.kernels.gemm_epilogue import GemmEpilogue, GemmGeluSlope
from substation.kernels.qkv_backward import SlicedQkvBackward
from substation.kernels.residual_dgrad import ResidualDgrad
from substation.kernels.registry import FusedKernels
from substation.protocol import Registry
from substation.tc_profiling.cublas import Cublas
from substation.tc_profiling.cublaslt import CublasLt
from substation.tc_profiling.epilogues import CublasLtBias
from substation.torch_ops import TorchOps


@functools.cache
def registry(graph: LayerGraph) -> Registry:
    """The implementations of `graph`'s operators, in order of preference for a configuration without a profile
    (`runtime.default_choices`): library GEMMs, then our kernels, then PyTorch's ops (the attention implementations,
    the GEMMs with our epilogues and qkv_proj's backward covers cover several operators at once: only a profile or a
    configuration chooses them)."""
    return Registry((CublasLt(), Cublas(), CublasLtBias(), FusedKernels(), *sdpa.IMPLEMENTATIONS,
                     attention.FusedAttention(), GemmEpilogue(), GemmGeluSlope(), SlicedQkvBackward(), ResidualDgrad(),
                     TorchOps(graph)),
                    graph)
