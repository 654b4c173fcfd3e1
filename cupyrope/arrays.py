"""The interop boundary: arrays in, pointers/shapes/strides/dtype/device/stream out, results back.

Nothing else in cupyrope knows which framework it is serving. ``describe`` turns any supported array
into an :class:`ArrayInfo`; ``empty_like_caller`` allocates an output of the caller's own type on the
caller's device; ``current_stream`` names the stream a kernel for that caller must run on (torch's
current stream for torch tensors, CuPy's otherwise); ``host_view`` exposes a CPU array to NumPy
without copying; ``gpu_array_key`` and ``new_gpu_outputs`` serve repeated calls with CUDA torch
tensors and CuPy arrays from a few attribute reads.

torch tensors are read directly (``data_ptr``, ``shape``, ``stride``, ``dtype``): a DLPack round
trip costs ~11 us per tensor and its cross-stream synchronisation breaks CUDA graph capture.
JAX and other producers go through DLPack, which hands CuPy a zero-copy view on CuPy's current stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import ITEMSIZE, dtype_name, numpy_dtype

# DLPack device types (dlpack.h): kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged.
_DLPACK_CPU = (1, 3)
_DLPACK_CUDA = (2, 13)

_TORCH_DTYPES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.int32": "int32",
    "torch.int64": "int64",
}


@dataclass
class ArrayInfo:
    """What the kernels and the NumPy path need to know about one array argument."""

    obj: Any  # the caller's object
    kind: str  # "numpy", "torch", "cupy", "jax" or "dlpack"
    device: int | None  # CUDA device ordinal, None on the CPU
    ptr: int  # device pointer (0 on the CPU)
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # canonical name: "bfloat16", "float32", "int64", ...
    writable: bool = True
    view: Any = None  # zero-copy CuPy/NumPy view for producers reached through DLPack

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def on_gpu(self) -> bool:
        return self.device is not None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def where(self) -> str:
        return "CPU" if self.device is None else f"cuda:{self.device}"


def _module_of(x) -> str:
    return type(x).__module__.split(".", 1)[0]


def _element_strides(byte_strides, itemsize: int, name: str) -> tuple[int, ...]:
    strides = []
    for s in byte_strides:
        if s % itemsize:
            raise ValueError(
                f"{name}: byte strides {tuple(byte_strides)} are not multiples of the element size "
                f"{itemsize}; cupyrope needs element-aligned strides"
            )
        strides.append(s // itemsize)
    return tuple(strides)


def _from_numpy(x: np.ndarray, name: str, *, obj=None, kind="numpy", writable=None) -> ArrayInfo:
    dtype = dtype_name(x.dtype)
    itemsize = x.dtype.itemsize
    return ArrayInfo(
        obj=x if obj is None else obj,
        kind=kind,
        device=None,
        ptr=0,
        shape=tuple(x.shape),
        strides=_element_strides(x.strides, itemsize, name),
        dtype=dtype,
        writable=x.flags.writeable if writable is None else writable,
        view=x,
    )


def _from_cupy(x, name: str, *, obj=None, kind="cupy", writable=True) -> ArrayInfo:
    return ArrayInfo(
        obj=x if obj is None else obj,
        kind=kind,
        device=x.device.id,
        ptr=x.data.ptr,
        shape=tuple(x.shape),
        strides=_element_strides(x.strides, x.dtype.itemsize, name),
        dtype=dtype_name(x.dtype),
        writable=writable,
        view=x,
    )


def _from_torch(x, name: str) -> ArrayInfo:
    dtype = _TORCH_DTYPES.get(str(x.dtype), str(x.dtype).replace("torch.", ""))
    device = x.device
    if device.type == "cuda":
        index = device.index if device.index is not None else _torch().cuda.current_device()
        return ArrayInfo(x, "torch", index, x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype)
    if device.type == "cpu":
        return ArrayInfo(x, "torch", None, 0, tuple(x.shape), tuple(x.stride()), dtype)
    raise TypeError(f"{name}: torch tensors on device {device} are not supported (CPU or CUDA only)")


def _torch():
    import torch

    return torch


def _cupy():
    from .kernels import _import_cupy

    return _import_cupy()


def describe(x, name: str) -> ArrayInfo:
    """Inspect one array argument without copying it.

    Raises TypeError naming ``name`` for anything that is not a NumPy, CuPy, torch or JAX array or
    another DLPack producer on the CPU or a CUDA device.
    """
    if isinstance(x, np.ndarray):
        return _from_numpy(x, name)
    module = _module_of(x)
    if module == "torch":
        return _from_torch(x, name)
    if module == "cupy":
        return _from_cupy(x, name)
    if module in ("jax", "jaxlib"):
        return _from_jax(x, name)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _from_dlpack(x, name)
    raise TypeError(
        f"{name}: expected a CuPy, torch, JAX or NumPy array (or another DLPack producer), "
        f"got {type(x).__module__}.{type(x).__qualname__}"
    )


def _from_jax(x, name: str) -> ArrayInfo:
    devices = x.devices() if hasattr(x, "devices") else set()
    platforms = {d.platform for d in devices}
    if platforms == {"cpu"}:
        # JAX arrays are immutable: NumPy sees them read-only, and in-place calls are refused.
        return _from_numpy(np.asarray(x), name, obj=x, kind="jax", writable=False)
    if platforms <= {"gpu", "cuda"} and len(devices) == 1:
        # CuPy passes its current stream to __dlpack__, so JAX's pending writes are visible.
        return _from_cupy(_cupy().from_dlpack(x), name, obj=x, kind="jax", writable=False)
    raise TypeError(f"{name}: JAX arrays must live on one CPU or CUDA device, got {devices}")


def _from_dlpack(x, name: str) -> ArrayInfo:
    device_type, _ = x.__dlpack_device__()
    if device_type in _DLPACK_CPU:
        return _from_numpy(np.from_dlpack(x), name, obj=x, kind="dlpack")
    if device_type in _DLPACK_CUDA:
        return _from_cupy(_cupy().from_dlpack(x), name, obj=x, kind="dlpack")
    raise TypeError(f"{name}: DLPack device type {device_type} is not supported (CPU or CUDA only)")


# ----------------------------------------------------------------------------------------------
# Outputs in the caller's type


def empty_like_caller(like: ArrayInfo, shape: tuple[int, ...], dtype: str):
    """A new contiguous array of ``like``'s type and device.

    Returns (native, info): ``native`` is what the caller gets back (after ``finish``); ``info``
    describes its memory for the kernels or the NumPy path.
    """
    if like.kind == "torch":
        torch = _torch()
        device = "cpu" if like.device is None else f"cuda:{like.device}"
        out = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        return out, describe(out, "output")
    if like.on_gpu:
        cupy = _cupy()
        with cupy.cuda.Device(like.device):
            out = cupy.empty(shape, dtype=numpy_dtype(dtype))
        return out, _from_cupy(out, "output")
    out = np.empty(shape, dtype=numpy_dtype(dtype))
    return out, _from_numpy(out, "output")


def finish(like: ArrayInfo, out):
    """Hand an output made by ``empty_like_caller`` back in the caller's type."""
    if like.kind == "jax":
        import jax

        if like.on_gpu:
            return jax.dlpack.from_dlpack(out)
        return jax.numpy.asarray(out)
    return out


def host_view(info: ArrayInfo) -> np.ndarray:
    """A NumPy view (no copy) of a CPU array, bfloat16 included."""
    if info.kind == "torch":
        t = info.obj.detach()
        if info.dtype == "bfloat16":
            # NumPy has no bfloat16: reinterpret the bits, then view them as ml_dtypes.bfloat16.
            return t.view(_torch().int16).numpy().view(numpy_dtype("bfloat16"))
        return t.numpy()
    return info.view


def requires_grad(info: ArrayInfo) -> bool:
    if info.kind != "torch":
        return False
    return bool(info.obj.requires_grad) and _torch().is_grad_enabled()


def itemsize(info: ArrayInfo) -> int:
    return ITEMSIZE[info.dtype]


# ----------------------------------------------------------------------------------------------
# The repeat-call path: metadata keys, pointers and outputs for CUDA torch tensors and CuPy arrays,
# read with a few attribute lookups (no ArrayInfo, no DLPack).

_GPU_KINDS: dict[type, str] = {}  # array type -> "torch" / "cupy", filled on first sight


def _gpu_kind(x) -> str | None:
    kind = _GPU_KINDS.get(type(x))
    if kind is None:
        module = _module_of(x)
        if module not in ("torch", "cupy"):
            return None
        kind = _GPU_KINDS.setdefault(type(x), module)
    return kind


def gpu_array_key(x):
    """(metadata, pointer) of a CUDA torch tensor or CuPy array, else None.

    The metadata is everything a launch recipe depends on: type, shape, strides, dtype, device and
    the pointer's alignment (the 16-byte path needs 16-byte-aligned pointers). torch tensors that
    require grad are left to the full path, which decides what to do with them.
    """
    kind = _gpu_kind(x)
    if kind == "torch":
        device = x.get_device()  # -1 on the CPU; cheaper than x.device / x.is_cuda
        if device < 0 or x.requires_grad:
            return None
        ptr = x.data_ptr()
        return (x.shape, x.stride(), x.dtype, device, ptr & 15), ptr
    if kind == "cupy":
        ptr = x.data.ptr
        return (x.shape, x.strides, x.dtype, x.device.id, ptr & 15), ptr
    return None


def new_gpu_outputs(q, k):
    """(q_out, q_out pointer, k_out, k_out pointer): new contiguous arrays of q's and k's type,
    shape, dtype and device (k may be None).

    ``empty_like`` is the cheapest torch allocation from Python (measured on the H200 machine's
    host: ~1.4 us each, against ~3.2 us for ``torch.empty(shape, dtype=, device=)`` and ~8.8 us
    for one buffer sliced into two views).
    """
    if _gpu_kind(q) == "torch":
        torch = _torch()
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
        k_out = None if k is None else torch.empty_like(k, memory_format=torch.contiguous_format)
        return q_out, q_out.data_ptr(), k_out, 0 if k is None else k_out.data_ptr()
    cupy = _cupy()
    with cupy.cuda.Device(q.device.id):
        q_out = cupy.empty(q.shape, dtype=q.dtype)
        k_out = None if k is None else cupy.empty(k.shape, dtype=k.dtype)
    return q_out, q_out.data.ptr, k_out, 0 if k is None else k_out.data.ptr


def current_stream(like, device: int) -> int:
    """The stream handle for a torch tensor or CuPy array on ``device`` (the current device)."""
    if _gpu_kind(like) == "torch":
        return _raw_torch_stream(device)
    return _cupy().cuda.get_current_stream().ptr


def _raw_torch_stream(device: int) -> int:
    global _raw_torch_stream
    torch = _torch()
    get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_raw is None:  # a torch without it: the public (slower, ~2 us) route
        def get_raw(index):
            return torch.cuda.current_stream(index).cuda_stream
    _raw_torch_stream = get_raw  # ~0.1 us per call from now on
    return get_raw(device)
