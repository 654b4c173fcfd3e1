"""The interop boundary: arrays in, pointers/shapes/strides/dtype/device/stream out, results back.

Nothing else in cupyrope knows which framework it is serving: torch tensors are read directly,
JAX and other producers go through DLPack.

Design notes: docs/architecture.md#corearrayspy
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import FP8_DTYPES, dtype_name, numpy_dtype

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
    ptr: int  # address of element 0: a device pointer, or a host address on the CPU (0: no memory)
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
        return math.prod(self.shape)  # Python ints: no overflow, and ~20x faster than np.prod

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
        ptr=x.__array_interface__["data"][0],
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
        return ArrayInfo(x, "torch", None, x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype)
    raise TypeError(f"{name}: torch tensors on device {device} are not supported (CPU or CUDA only)")


def _torch():
    import torch

    return torch


def cupy_module():
    """CuPy, or an ImportError that says which extra installs it."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "cupyrope needs CuPy to run on the GPU: pip install 'cupyrope[cuda13]' "
            "(or 'cupyrope[cuda12]' for a CUDA 12 driver)"
        ) from exc
    return cupy


def describe(x, name: str) -> ArrayInfo:
    """Inspect one array argument without copying it.

    Raises TypeError naming ``name`` for anything that is not a NumPy, CuPy, torch or JAX array or
    another DLPack producer on the CPU or a CUDA device.
    """
    if isinstance(x, np.ndarray):
        return _from_numpy(x, name)
    if isinstance(x, ArrayInfo):  # already described (a traced JAX array: cupyrope.frontends.jax)
        return x
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
        return _from_cupy(cupy_module().from_dlpack(x), name, obj=x, kind="jax", writable=False)
    raise TypeError(f"{name}: JAX arrays must live on one CPU or CUDA device, got {devices}")


def describe_traced(x, name: str) -> ArrayInfo:
    """An ArrayInfo from the shape and dtype alone, as XLA will lay the array out (C order), for
    checking a JAX call while it is traced; it has no memory (immutable, no device pointer)."""
    strides, step = [], 1
    for size in reversed(tuple(x.shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return ArrayInfo(obj=x, kind="jax", device=None, ptr=0, shape=tuple(int(n) for n in x.shape),
                     strides=tuple(reversed(strides)), dtype=dtype_name(x.dtype), writable=False)


def _from_dlpack(x, name: str) -> ArrayInfo:
    device_type, _ = x.__dlpack_device__()
    if device_type in _DLPACK_CPU:
        return _from_numpy(np.from_dlpack(x), name, obj=x, kind="dlpack")
    if device_type in _DLPACK_CUDA:
        return _from_cupy(cupy_module().from_dlpack(x), name, obj=x, kind="dlpack")
    raise TypeError(f"{name}: DLPack device type {device_type} is not supported (CPU or CUDA only)")


# ----------------------------------------------------------------------------------------------
# Outputs in the caller's type


def new_output(x, kind: str, device: int | None, shape: tuple[int, ...], dtype: str):
    """A new contiguous output shaped like an input: a torch tensor for torch inputs
    (``empty_like``: the cheapest torch allocation from Python, cheaper than
    ``torch.empty(shape, dtype=, device=)``), a CuPy array for every other input on a GPU (JAX and
    DLPack producers get theirs through :func:`finish`), a NumPy array on the CPU."""
    if kind == "torch":
        torch = _torch()
        if dtype in FP8_DTYPES:  # the fp8 outputs of the fused ops
            return torch.empty(shape, dtype=getattr(torch, dtype), device=x.device)
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if dtype in FP8_DTYPES and device is not None:
        dtype = "uint8"  # CuPy has no fp8 dtype: it gets the bits
    if device is not None:
        cupy = cupy_module()
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=numpy_dtype(dtype))
    return np.empty(shape, dtype=numpy_dtype(dtype))


def empty_like_caller(like: ArrayInfo, dtype: str | None = None):
    """(native, info) of a new contiguous array shaped like ``like`` (of ``dtype``, by default
    like's): ``native`` is what the caller gets back (after :func:`finish`), ``info`` describes
    its memory (an fp8 dtype for the bits CuPy holds as uint8)."""
    out = new_output(like.obj, like.kind, like.device, like.shape, dtype or like.dtype)
    info = describe(out, "output")
    if dtype is not None and info.dtype == "uint8":
        info.dtype = dtype
    return out, info


def finish(like: ArrayInfo, out, dtype: str | None = None):
    """Hand an output made by ``empty_like_caller`` back in the caller's type."""
    if like.kind == "jax":
        import jax

        if like.on_gpu:
            if str(out.dtype) == "uint8" and dtype is not None:  # fp8 bits from CuPy
                return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(out), getattr(jax.numpy, dtype))
            return jax.dlpack.from_dlpack(out)
        # On the input's own (CPU) device: the default device may be a GPU.
        return jax.device_put(out, next(iter(like.obj.devices())))
    return out


def host_view(info: ArrayInfo) -> np.ndarray:
    """A NumPy view (no copy) of a CPU array, bfloat16 included."""
    if info.kind == "torch":
        t = info.obj.detach()
        if info.dtype == "bfloat16":
            # NumPy has no bfloat16: reinterpret the bits, then view them as ml_dtypes.bfloat16.
            return t.view(_torch().int16).numpy().view(numpy_dtype("bfloat16"))
        if info.dtype in FP8_DTYPES:  # nor fp8: the same through bytes
            return t.view(_torch().uint8).numpy().view(numpy_dtype(info.dtype))
        return t.numpy()
    return info.view


def require_gpu(op_name: str) -> None:
    """Raise one clear RuntimeError where there is no usable CUDA GPU (instead of CuPy's own)."""
    cupy = cupy_module()
    if not cupy.is_available():
        raise RuntimeError(
            f"{op_name}: no usable CUDA GPU was found (cupy.is_available() is false). {op_name} prepares "
            "kernels for a GPU; without one, cupyrope runs its NumPy path, which needs no warmup"
        )


def to_host(info: ArrayInfo) -> np.ndarray:
    """The values of an array as a NumPy array: a view on the CPU, a copy (which synchronises)
    from a GPU."""
    if not info.on_gpu:
        return np.asarray(host_view(info))
    if info.kind == "torch":
        return host_view(describe(info.obj.detach().cpu(), "array"))
    return info.view.get()


def place_like(host: np.ndarray, like):
    """A host array as ``like``'s array type on its device (``host`` itself for None / NumPy)."""
    if like is None:
        return host
    info = describe(like, "like")
    if info.kind == "jax":
        import jax

        return jax.device_put(host, next(iter(like.devices())))
    if info.kind == "torch":
        torch = _torch()
        if host.dtype == numpy_dtype("bfloat16"):
            tensor = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(host)
        return tensor.to("cpu" if info.device is None else f"cuda:{info.device}")
    if info.on_gpu:
        out = new_output(None, "cupy", info.device, host.shape, host.dtype.name)
        out.set(host)
        return finish(info, out)
    return host


def upload(values: np.ndarray, device: int):
    """A CuPy copy of a host array on ``device``, complete when this returns: the copy runs on
    CuPy's stream and a kernel may read it from another (torch's)."""
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        array = cupy.asarray(values)
        cupy.cuda.get_current_stream().synchronize()
    return array


def cupy_view_of_buffer(buffer):
    """A CuPy array over a device buffer that has ``__cuda_array_interface__`` (an XLA buffer
    handed to a callback), without a copy and without synchronising."""
    cupy = cupy_module()
    shape, dtype = tuple(buffer.shape), np.dtype(buffer.dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    pointer = buffer.__cuda_array_interface__["data"][0]
    if nbytes == 0 or pointer == 0:
        return cupy.ndarray(shape, dtype=dtype)
    device = cupy.cuda.runtime.pointerGetAttributes(pointer).device
    memory = cupy.cuda.UnownedMemory(pointer, nbytes, owner=buffer, device_id=device)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def on_gpu_buffer(buffer) -> bool:
    """Whether a buffer handed to a callback lives on a CUDA device."""
    try:
        buffer.__cuda_array_interface__
    except Exception:  # CPU buffers have no such interface
        return False
    return True


# ----------------------------------------------------------------------------------------------
# The repeat-call path: metadata keys, pointers and outputs for CUDA torch tensors and CuPy arrays,
# read with a few attribute lookups (no ArrayInfo, no DLPack).

GPU_KINDS: dict[type, str] = {}  # array type -> "torch" / "cupy", filled on first sight


def _gpu_kind(x) -> str | None:
    kind = GPU_KINDS.get(type(x))
    if kind is None:
        module = _module_of(x)
        if module not in ("torch", "cupy"):
            return None
        if module == "torch" and _is_tensor_wrapper(x):
            return None  # DTensor and other wrapper subclasses: no storage of their own
        kind = GPU_KINDS.setdefault(type(x), module)
    return kind


def _is_tensor_wrapper(x) -> bool:
    """A torch tensor subclass that intercepts dispatch (DTensor, FakeTensor...): its data lives
    elsewhere, so it has no pointer a kernel could use."""
    torch = _torch()
    return isinstance(x, torch.Tensor) and (
        type(x).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__)


def gpu_array_key(x):
    """(metadata, pointer) of a CUDA torch tensor or CuPy array, else None.

    The metadata is everything a launch recipe depends on: type, shape, strides, dtype, device and
    the pointer's alignment (the 16-byte path needs 16-byte-aligned pointers). torch tensors that
    require grad while grad mode is on are left to the full path, which sends them to autograd;
    with grad mode off they are plain arrays, as the full path takes them (a module's parameters
    under ``torch.no_grad()``).
    """
    kind = _gpu_kind(x)
    if kind == "torch":
        device = x.get_device()  # -1 on the CPU; cheaper than x.device / x.is_cuda
        if device < 0 or (x.requires_grad and grad_enabled()):
            return None
        ptr = x.data_ptr()
        return (type(x), x.shape, x.stride(), x.dtype, device, ptr & 15), ptr
    if kind == "cupy":
        ptr = x.data.ptr
        return (type(x), x.shape, x.strides, x.dtype, x.device.id, ptr & 15), ptr
    return None


def in_place_refusal(info: ArrayInfo) -> str | None:
    """Why the array's framework forbids writing into it in place right now, or None.

    torch refuses in-place updates of an inference tensor outside ``torch.inference_mode()``."""
    if info.kind == "torch" and info.obj.is_inference() and not _torch().is_inference_mode_enabled():
        return ("is an inference tensor (made under torch.inference_mode()) and inference mode "
                "is off; torch refuses in-place updates of it outside inference mode: rotate under "
                "torch.inference_mode(), or out of place, or in place on a clone")
    return None


# torch functions a repeat call needs, looked up once (``import torch`` and the attribute chain
# cost more than the calls themselves).
_torch_functions: dict = {}


def _torch_function(name: str):
    function = _torch_functions.get(name)
    if function is None:
        torch = _torch()
        function = _torch_functions[name] = {
            "is_inference_mode_enabled": torch.is_inference_mode_enabled,
            "is_grad_enabled": torch.is_grad_enabled,
            "increment_version": torch._C._increment_version}[name]
    return function


def inference_mode_enabled() -> bool:
    return _torch_function("is_inference_mode_enabled")()


def grad_enabled() -> bool:
    return _torch_function("is_grad_enabled")()


def mark_written(*tensors) -> None:
    """Record an in-place write of torch tensors as torch's own in-place ops do (their version
    counters), so that autograd refuses a backward through values saved before the write."""
    written = tuple(x for x in tensors if x is not None and _module_of(x) == "torch")
    if written:
        bump_versions(written)


def bump_versions(tensors: tuple) -> None:
    """:func:`mark_written` for a tuple of torch tensors (the repeat-call path's form). torch's
    own entry takes a sequence: a single tensor would be iterated row by row."""
    _torch_function("increment_version")(tensors)


def new_gpu_outputs(q, k, dtype: str | None = None):
    """(q_out, q_out pointer, k_out, k_out pointer): new contiguous arrays of q's and k's type,
    shape, device and dtype (or ``dtype``: an fp8 output, bits for CuPy) (k may be None), for a
    CUDA torch tensor or CuPy array q."""
    if _gpu_kind(q) == "torch":
        q_out = new_output(q, "torch", None, tuple(q.shape) if dtype else (), dtype or "")
        k_out = None if k is None else new_output(k, "torch", None,
                                                  tuple(k.shape) if dtype else (), dtype or "")
        return q_out, q_out.data_ptr(), k_out, 0 if k is None else k_out.data_ptr()
    device = q.device.id
    q_out = new_output(q, "cupy", device, q.shape, dtype or q.dtype.name)
    k_out = None if k is None else new_output(k, "cupy", device, k.shape, dtype or k.dtype.name)
    return q_out, q_out.data.ptr, k_out, 0 if k is None else k_out.data.ptr


def current_stream(like, device: int) -> int:
    """The stream handle for a torch tensor or CuPy array on ``device`` (the current device)."""
    if _gpu_kind(like) == "torch":
        return _raw_torch_stream(device)
    return cupy_module().cuda.get_current_stream().ptr


def stream_is_capturing(like, device: int) -> bool:
    """Whether the stream a call for ``like`` runs on is being captured into a CUDA graph."""
    cupy = cupy_module()
    status = cupy.cuda.runtime.streamIsCapturing(current_stream(like, device))
    return status != cupy.cuda.runtime.streamCaptureStatusNone


def _raw_torch_stream(device: int) -> int:
    global _raw_torch_stream
    torch = _torch()
    get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_raw is None:  # a torch without it: the public (slower) route
        def get_raw(index):
            return torch.cuda.current_stream(index).cuda_stream
    # Later calls go straight to the getter (measured: docs/perf_log.md#cupyropecorearrayspy).
    _raw_torch_stream = get_raw
    return get_raw(device)
