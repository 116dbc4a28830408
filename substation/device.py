"""What a GPU offers the kernels: its architecture, SM count and shared-memory limit.

Kernel feasibility (shared memory per block), the grids some variants aim at (a few blocks per SM) and the
architecture nvcc compiles for all come from a `DeviceSpec`. On a GPU it is read from the device
(`DeviceSpec.of(index)`); where there is none (planning variants, compiling in CI, the CPU tests) the `H100`
spec stands in, the GPU the shipped profiles were measured on.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    """The properties of one GPU that kernels are planned and compiled for."""

    name: str
    major: int  # compute capability
    minor: int
    sm_count: int
    max_shared_bytes_per_block: int  # dynamic shared memory a block may use once it opts in (beyond 48 KiB)

    @property
    def arch(self) -> str:
        """nvcc's name of the architecture: 'sm_90' for compute capability 9.0."""
        return f"sm_{self.major}{self.minor}"

    @classmethod
    def from_properties(cls, properties) -> DeviceSpec:
        """The spec of `torch.cuda.get_device_properties(...)`'s answer."""
        return cls(name=properties.name, major=properties.major, minor=properties.minor,
                   sm_count=properties.multi_processor_count,
                   max_shared_bytes_per_block=properties.shared_memory_per_block_optin)

    @classmethod
    def of(cls, device: int) -> DeviceSpec:
        """The spec of CUDA device `device` (an index, as torch numbers the visible devices)."""
        return _spec_of(device)

    @classmethod
    def build_target(cls) -> DeviceSpec:
        """What kernels are built for here: the current CUDA device's spec, or the H100's where there is none."""
        return cls.of(torch.cuda.current_device()) if torch.cuda.is_available() else H100


@functools.cache
def _spec_of(device: int) -> DeviceSpec:
    if not isinstance(device, int) or isinstance(device, bool):
        raise TypeError(f"{device=} must be a CUDA device index (int)")
    return DeviceSpec.from_properties(torch.cuda.get_device_properties(device))


# The H100 SXM (80 GB HBM3): 132 SMs, 227 KiB of shared memory per block with the opt-in. Only where no GPU
# is present: on a GPU, take `DeviceSpec.of(index)`.
H100 = DeviceSpec(name="NVIDIA H100 80GB HBM3", major=9, minor=0, sm_count=132, max_shared_bytes_per_block=227 * 1024)
