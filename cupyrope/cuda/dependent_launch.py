"""Programmatic dependent launch: a kernel that may start while the previous kernel on its stream
is still finishing (compute capability 9.0 and later), through ``cuLaunchKernelEx`` called with
ctypes (CuPy binds ``cuLaunchKernel`` only). The kernel waits for the previous grid before its
first memory access, so the results are those of an ordinary launch.

Design notes: docs/architecture.md#cudadependent_launchpy
"""

from __future__ import annotations

import ctypes
import functools
import sys

from ..core.arrays import cupy_module

# CUlaunchAttributeID CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# Programmatic edges in captured graphs need a CUDA 12.3 driver.
MIN_DRIVER_VERSION = 12030
MIN_COMPUTE_CAPABILITY = 90


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (here an int)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx, or None where it cannot be found."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        function = ctypes.CDLL(name).cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p] * 4
    function.restype = ctypes.c_int
    return function


@functools.lru_cache(maxsize=None)
def supported(device: int) -> bool:
    """Whether launches on ``device`` may be programmatic: compute capability >= 9.0, a driver
    that captures programmatic launches into graphs, and cuLaunchKernelEx found."""
    runtime = cupy_module().cuda.runtime
    properties = runtime.getDeviceProperties(device)
    capability = 10 * properties["major"] + properties["minor"]
    return (capability >= MIN_COMPUTE_CAPABILITY
            and runtime.driverGetVersion() >= MIN_DRIVER_VERSION
            and _launch_kernel_ex() is not None)


class DependentLauncher:
    """cuLaunchKernelEx of one kernel and geometry with programmatic stream serialization; the
    caller serialises calls (the stream is written into the shared launch configuration)."""

    __slots__ = ("_attribute", "_config", "_config_address", "_function", "_launch")

    def __init__(self, function_ptr: int, grid, block, shared_bytes: int):
        self._attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = _LaunchConfig(*grid, 1, *block, shared_bytes, None,
                                     ctypes.addressof(self._attribute), 1)
        self._config_address = ctypes.addressof(self._config)
        self._function = function_ptr
        self._launch = _launch_kernel_ex()

    def __call__(self, stream: int, argv_address: int) -> None:
        self._config.stream = stream
        status = self._launch(self._config_address, self._function, argv_address, None)
        if status:
            raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch) failed with "
                               f"CUresult {status}")
