"""Lean kernel launches: a cubin's kernel through the CUDA driver API (ctypes on libcuda.so.1), no CuPy.

A `PackedLaunch` is built once per kernel step: grid, block, shared memory and the argument signature are
fixed, and the kernel's arguments live in one host buffer that a `void*[]` array points into. A launch only
writes the stream and the argument values (one `struct.pack_into`) and calls the driver, which copies them,
so the buffer is free again when it returns (CUDA-graph capture copies them into the graph).

It calls `cuLaunchKernelEx`, `cuLaunchKernel` with grid, block, shared memory and stream in a struct
(`LaunchConfig`), built once: ctypes converts 4 arguments per call instead of 11, about a third of the cost.

A *dependent* launch (the second kernel of a two-kernel operator, which adds the first one's partial sums) carries
programmatic stream serialization (Hopper's programmatic dependent launch): it may begin while the kernel before it
still runs, once every block of that kernel has executed `griddepcontrol.launch_dependents`, and waits for it to
finish (its memory visible) at `griddepcontrol.wait`, its first instruction. Its launch and ramp then overlap the
first kernel's last wave instead of following it. CUDA-graph capture keeps the edge programmatic.

A *cooperative* launch (a kernel with a grid-wide barrier, `cooperative_groups::this_grid().sync()`) runs only if
every block of its grid is resident at once; the driver refuses a grid that is not (a clear launch error, never a
hang). It replaces the second kernel of a two-kernel operator: the main kernel waits at the barrier for every block's
partial sums, then adds them up itself.

Modules are loaded into the device's primary context, the one PyTorch's runtime uses, so a kernel runs on
PyTorch's streams and memory. A module and its functions are loaded once per process and device.
"""
from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from substation.errors import DeviceError, SubstationError

# An argument's type -> its struct code, in native size and alignment as the kernel's C signature has it. A pointer
# is 64 bits on every platform CUDA runs on; "Q" rejects a negative address, which "P" would wrap.
ARGUMENT_CODES = {"pointer": "Q", "float32": "f", "int32": "i", "uint32": "I", "int64": "q", "uint64": "Q"}
DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory a kernel gets without opting in
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CUDA_ERROR_INVALID_CONTEXT = 201
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an attribute id, padding to 8 bytes, then a 64-byte union of which the
    attributes used here read the first int."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


# CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** kernelParams, void** extra),
# every argument passed as an address.
LaunchFunction = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

_SIGNATURES = {  # argtypes of the other driver calls used here (all return CUresult)
    "cuInit": (ctypes.c_uint,),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
    "cuCtxGetCurrent": (ctypes.POINTER(ctypes.c_void_p),),
    "cuCtxSetCurrent": (ctypes.c_void_p,),
    "cuModuleLoadData": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p),
    "cuModuleGetFunction": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p),
    "cuFuncSetAttribute": (ctypes.c_void_p, ctypes.c_int, ctypes.c_int),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int,
                                                    ctypes.c_size_t),
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}


class DriverError(SubstationError, RuntimeError):
    """A CUDA driver call failed; the message names the call, what it was for and the driver's error."""


@functools.cache
def driver() -> ctypes.CDLL:
    """libcuda, its calls typed, initialized."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise DeviceError(f"the CUDA driver (libcuda.so.1) cannot be loaded, so kernels cannot run: {err}") from None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    check(lib.cuInit(0), "cuInit", "the CUDA driver")
    return lib


@functools.cache
def _launch_kernel() -> LaunchFunction:
    try:
        return LaunchFunction(("cuLaunchKernelEx", driver()))
    except AttributeError:
        raise DeviceError("the CUDA driver has no cuLaunchKernelEx: it needs CUDA 11.8 or newer") from None


def error_text(result: int) -> str:
    """'CUDA_ERROR_NAME: description' of a CUresult."""
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib = driver()
    lib.cuGetErrorName(result, ctypes.byref(name))
    lib.cuGetErrorString(result, ctypes.byref(text))
    return f"{(name.value or b'unknown CUresult').decode()} ({result}): {(text.value or b'').decode()}"


def check(result: int, call: str, subject: str) -> None:
    """DriverError naming the call and its subject when `result` is not CUDA_SUCCESS."""
    if result:
        raise DriverError(f"{call} failed for {subject}: {error_text(result)}")


@functools.cache
def _primary_context(device: int) -> int:
    """The primary context of `device` (PyTorch's), retained for the process's life."""
    lib, handle, context = driver(), ctypes.c_int(), ctypes.c_void_p()
    check(lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet", f"device {device}")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain", f"device {device}")
    return context.value


def use_primary_context(device: int) -> None:
    """Make `device`'s primary context current to the calling thread. PyTorch's runtime makes it current
    once it has set the device; a thread that has not (a fresh one) has none, and the driver API needs one."""
    torch.cuda.init()
    lib, current = driver(), ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent", f"device {device}")
    primary = _primary_context(device)
    if current.value != primary:
        check(lib.cuCtxSetCurrent(primary), "cuCtxSetCurrent", f"the primary context of device {device}")


@functools.cache
def _module(path: str, device: int) -> int:
    handle = ctypes.c_void_p()
    check(driver().cuModuleLoadData(ctypes.byref(handle), Path(path).read_bytes()), "cuModuleLoadData",
          f"{path} on device {device} ({torch.cuda.get_device_name(device)})")
    return handle.value


@functools.cache
def _function(path: str, name: str, device: int) -> int:
    handle = ctypes.c_void_p()
    check(driver().cuModuleGetFunction(ctypes.byref(handle), _module(path, device), name.encode()),
          "cuModuleGetFunction", f"kernel {name!r} of {path}")
    return handle.value


def kernel_function(path: Path | str, name: str, device: int, shared_bytes: int = 0) -> int:
    """The CUfunction of kernel `name` in the cubin at `path` on `device` (loaded once per process and device),
    allowed `shared_bytes` of dynamic shared memory."""
    torch.cuda.init()
    with torch.cuda.device(device):
        use_primary_context(device)
        function = _function(str(path), name, device)
        if shared_bytes > DEFAULT_SHARED_LIMIT:  # beyond the default a kernel must opt in
            check(driver().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                  "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", f"kernel {name!r} ({shared_bytes} bytes)")
    return function


def _dims(name: str, what: str, dims: int | Sequence[int]) -> tuple[int, int, int]:
    """A grid or block as (x, y, z), missing dims 1."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"{name}: {what}={dims!r} must be 1 to 3 positive integers")
    return (*dims, *(1,) * (3 - len(dims)))  # type: ignore[return-value]


class PackedLaunch:
    """One kernel's launch, prepared once: grid, block and shared memory in a `LaunchConfig`, and an argument
    buffer in the kernel's signature, which `kernelParams` points into. Calling it writes the stream and the
    argument values and launches.

    Not for two threads at once: they would share the buffers between writing and launching.
    """

    def __init__(self, function: int, name: str, device: int, grid: int | Sequence[int], block: int | Sequence[int],
                 shared_bytes: int, signature: Sequence[str],
                 launch: Callable[[int, int, int, None], int] | None = None, dependent: bool = False,
                 cooperative: bool = False) -> None:
        """`signature`: the type of every kernel argument, in order (keys of ARGUMENT_CODES). `launch`:
        cuLaunchKernelEx, or a stand-in of its C signature (a LaunchFunction) for tests without a GPU. `dependent`:
        a programmatic dependent launch (the module docstring); the kernel must begin with `griddepcontrol.wait`.
        `cooperative`: a cooperative launch (the module docstring), for a kernel with a grid-wide barrier."""
        unknown = [t for t in signature if t not in ARGUMENT_CODES]
        if unknown:
            raise ValueError(f"{name}: argument types {unknown} unknown; expected some of {list(ARGUMENT_CODES)}")
        codes = [ARGUMENT_CODES[t] for t in signature]
        self.name, self.device, self.signature, self.function = name, device, tuple(signature), function
        self._packer = struct.Struct("@" + "".join(codes))
        # Native alignment: argument i ends at the size of the first i + 1 codes.
        self.offsets = tuple(struct.calcsize("@" + "".join(codes[:i + 1])) - struct.calcsize(code)
                             for i, code in enumerate(codes))
        self._buffer = ctypes.create_string_buffer(max(1, self._packer.size))
        self.parameters = (ctypes.c_void_p * len(codes))(*(self.buffer_address + offset for offset in self.offsets))
        self.config = LaunchConfig(*_dims(name, "grid", grid), *_dims(name, "block", block), shared_bytes)
        self.dependent, self.cooperative = dependent, cooperative
        ids = ([CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION] * dependent
               + [CU_LAUNCH_ATTRIBUTE_COOPERATIVE] * cooperative)
        if ids:
            self._attributes = (LaunchAttribute * len(ids))(*(LaunchAttribute(i, value=1) for i in ids))
            self.config.attrs, self.config.numAttrs = ctypes.addressof(self._attributes), len(ids)
        self._stream = 0  # config.hStream's value (NULL: the legacy default stream)
        self._arguments = (ctypes.addressof(self.config), function, ctypes.addressof(self.parameters), None)
        self._launch = launch or _launch_kernel()

    @property
    def blocks(self) -> int:
        """The grid's blocks."""
        return self.config.gridDimX * self.config.gridDimY * self.config.gridDimZ

    def resident_blocks(self) -> int:
        """How many of its blocks one SM holds at once (the driver's occupancy calculator, from the kernel's
        registers, its block and its shared memory): with the SM count, how many waves the grid takes."""
        count, config = ctypes.c_int(), self.config
        threads = config.blockDimX * config.blockDimY * config.blockDimZ
        check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(count), self.function, threads,
                                                                   config.sharedMemBytes),
              "cuOccupancyMaxActiveBlocksPerMultiprocessor", f"kernel {self.name}")
        return count.value

    @property
    def buffer_address(self) -> int:
        """Where the argument values live (`kernelParams[i]` = this + offsets[i])."""
        return ctypes.addressof(self._buffer)

    def __call__(self, stream: int, *values: int | float) -> None:
        """Launch on CUDA stream `stream` (a handle, as `torch.cuda.Stream.cuda_stream`) with these argument
        values: ints for pointers and integers, floats for float32."""
        if stream != self._stream:  # a step's stream rarely changes; setting a ctypes field costs more than this test
            self.config.hStream = self._stream = stream
        try:
            self._packer.pack_into(self._buffer, 0, *values)
        except struct.error as err:
            raise TypeError(f"{self.name}: arguments {values} do not fit its signature {self.signature}: "
                            f"{err}") from None
        result = self._launch(*self._arguments)
        if result:
            self._failed(result)

    def _failed(self, result: int) -> None:
        """A thread with no current context (one PyTorch has not used yet) gets the device's primary context
        and launches again; any other failure is an error."""
        if result == CUDA_ERROR_INVALID_CONTEXT:
            use_primary_context(self.device)
            result = self._launch(*self._arguments)
        c = self.config
        check(result, "cuLaunchKernelEx", f"kernel {self.name} (grid {(c.gridDimX, c.gridDimY, c.gridDimZ)}, block "
                                          f"{(c.blockDimX, c.blockDimY, c.blockDimZ)}, {c.sharedMemBytes} bytes of "
                                          f"shared memory, device {self.device})")
