"""The rotation as a native XLA operation on NVIDIA GPUs: jaxlib's GPU kernel call with NVRTC's PTX.

jaxlib ships a GPU custom call that launches a kernel given as PTX, with a grid and a list of array
and scalar parameters (``jax._src.lib.gpu_triton``: ``TritonKernel``, ``TritonKernelCall``; the
call target ``triton_kernel_call_ffi``, what Pallas and jax-triton lower to). :func:`lower_rope`
lowers a traced ``apply_rope`` (the ``cupyrope_rope`` primitive of :mod:`cupyrope.jax_ops`) to
that call: the launch is planned while lowering, from the shapes and dtypes XLA will pass
(``plan_rope`` and ``launch.plan_launch``, as for an eager call), and the kernel that plan picks is
compiled by NVRTC to PTX for the device's architecture. When the compiled function runs, XLA
launches it on its own stream and buffers: no Python runs, the call can be captured in XLA's
command buffers (CUDA graphs), and ``jax.export`` can serialise it (the PTX travels in the call's
configuration; see "Export" below).

The kernels are the ones every other route runs, through an entry point with flat arguments
(:func:`_entry_source`): jaxlib's call passes one kernel argument per parameter, in XLA's buffer
order (operands, then results), where the kernels take a parameter struct. The entry takes the
data pointers in XLA's order and the rest of the struct as 64-bit words (scalar parameters, fixed
when lowering), reassembles the struct and runs the kernel body. jaxlib launches blocks of whole
warps along x only: the entry is compiled with the planned block shape
(``CUPYROPE_FLAT_BLOCK_X/Y/Z``, ``kernels_cu/thread_index.cuh``), so a flat thread index maps onto
the same warps, lane for lane, as the eager launch's three-dimensional block. A block that is not a
whole number of warps gets more head lanes (every kernel strides over heads, so any number
covers them).

Export
------
``jax.export`` refuses custom calls without a compatibility guarantee unless told: pass
``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")]``. The
serialised module holds PTX for the exporting GPU's architecture (``compute_XY``): it runs on that
architecture and, through the driver's PTX JIT, on newer ones.

Availability
------------
:func:`unavailable_reason` says why the call cannot be used (a jaxlib without ``gpu_triton`` or
without its CUDA plugin, or NVRTC missing); :mod:`cupyrope.jax_ops` then keeps the callback route
and warns once. ``CUPYROPE_JAX_NATIVE=0`` asks for the callback route.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib

import numpy as np

from . import kernels, launch
from .abi import AngleSource
from .arrays import ArrayInfo, cupy_module, describe_traced
from .plan import plan_rope

NATIVE_ENV = "CUPYROPE_JAX_NATIVE"
CALL_TARGET = "triton_kernel_call_ffi"
# The kernel call checks that every array parameter's address is a multiple of this: the vector
# path the plan assumes needs 16-byte alignment (XLA aligns its buffers to far more).
POINTER_DIVISIBILITY = 16
# The data pointers in the order the entry takes them: XLA passes operands, then results.
_OPERAND_POINTERS = ("q", "k", "positions", "cos", "sin", "inv_freq")
_RESULT_POINTERS = ("q_out", "k_out")
# Where each of them sits among the parameter struct's leading eight pointer words.
_STRUCT_WORD = {"q": 0, "k": 1, "q_out": 2, "k_out": 3, "positions": 4, "cos": 5, "sin": 6,
                "inv_freq": 7}
_FAKE_POINTER_STEP = 1 << 40  # planning addresses: 256-aligned, far apart (no overlap)


def unavailable_reason() -> str | None:
    """None when the native call can be used here, else why not (for the warning)."""
    if os.environ.get(NATIVE_ENV, "") == "0":
        return f"{NATIVE_ENV}=0 asks for the callback route"
    try:
        from jax._src.lib import gpu_triton
    except ImportError as exc:
        return f"this jaxlib has no GPU kernel call (jax._src.lib.gpu_triton: {exc})"
    missing = [name for name in ("TritonKernel", "TritonKernelCall", "create_array_parameter",
                                 "create_scalar_parameter") if not hasattr(gpu_triton, name)]
    if missing:
        return (f"this jaxlib's jax._src.lib.gpu_triton lacks {', '.join(missing)} (its CUDA "
                "plugin, jax-cuda12-plugin / jax-cuda13-plugin, may be missing)")
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
    except ImportError as exc:
        return f"NVRTC cannot be loaded through CuPy ({exc})"
    return None


def lower_rope(ctx, *operands, static, present):
    """The ``cupyrope_rope`` primitive as one XLA kernel call (see the module docstring).

    ``operands``: q, then k, positions, cos_sin_cache, cos, sin where ``present`` marks them;
    ``static``: the call's options (``jax_ops._Static``). Returns q_out (and k_out)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    names = ("q",) + tuple(name for name, here in zip(
        ("k", "positions", "cos_sin_cache", "cos", "sin"), present) if here)
    device = kernels.current_device()
    infos = {name: _planning_info(aval, name, index, device)
             for index, (name, aval) in enumerate(zip(names, ctx.avals_in))}
    plan = plan_rope(infos["q"], infos.get("k"), infos.get("positions"),
                     cos_sin_cache=infos.get("cos_sin_cache"), cos=infos.get("cos"),
                     sin=infos.get("sin"), **static.call_options())
    if plan.is_empty:  # nothing to rotate: empty results, no launch
        return [mlir.full_like_aval(ctx, 0, aval) for aval in ctx.avals_out]
    outputs = [_planning_info(aval, "output", len(names) + i, device, writable=True)
               for i, aval in enumerate(ctx.avals_out)]
    inv_freq = None
    if plan.source == AngleSource.COMPUTED:
        inv_freq = np.ascontiguousarray(plan.inv_freq, dtype=np.float64)
    arithmetic = (kernels.angle_arithmetic(device) if plan.source == AngleSource.COMPUTED
                  else None)
    spec = launch.plan_launch(
        plan, outputs, inv_freq_ptr=0 if inv_freq is None else _fake_pointer(len(names) + 2),
        num_regs=lambda kernel_spec: kernels.get_kernel(kernel_spec, device).num_regs,
        multiprocessors=launch._multiprocessors(device), angle_arithmetic=arithmetic)
    block, shared_bytes = _flat_block(plan, spec)
    kernel = _kernel_call_kernel(spec, block, shared_bytes, device)

    gpu_triton = _gpu_triton()
    buffers = {name: infos.get(name) for name in ("q", "k", "positions")}
    if plan.source == AngleSource.CACHE_TABLE:
        buffers["cos"] = infos["cos_sin_cache"]
    elif plan.source == AngleSource.TOKEN_TABLES:
        buffers["cos"], buffers["sin"] = infos["cos"], infos["sin"]
    nodes = list(operands)
    if inv_freq is not None:  # the schedule's float64 frequencies, a constant of the module
        buffers["inv_freq"] = True
        nodes.append(mlir.ir_constant(inv_freq.view(np.uint32)))
    parameters = []
    for name in _OPERAND_POINTERS:
        parameters.append(_array() if buffers.get(name) is not None else _word(0))
    parameters.append(_array())  # q_out
    parameters.append(_array() if plan.k is not None else _word(0))
    parameters.append(gpu_triton.create_scalar_parameter(
        -1 if spec.sin_offset is None else int(spec.sin_offset), "i64"))
    words = np.frombuffer(spec.params.tobytes(), dtype=np.uint64)
    parameters += [_word(int(w)) for w in words[8:]]
    grid = (int(spec.grid[0]), int(spec.grid[1]), 1)
    call = gpu_triton.TritonKernelCall(kernel, *grid, parameters)
    name = kernel_name(spec, block)
    result_types = [mlir.aval_to_ir_type(ctx.module_context, aval) for aval in ctx.avals_out]
    layouts = [list(reversed(range(len(aval.shape)))) for aval in ctx.avals_in]
    if inv_freq is not None:
        layouts.append([0])
    return mlir.custom_call(
        CALL_TARGET, result_types=result_types, operands=nodes,
        backend_config=dict(name=ir.StringAttr.get(name),
                            opaque=ir.StringAttr.get(zlib.compress(call.to_proto(name, b"")))),
        operand_layouts=layouts,
        result_layouts=[list(reversed(range(len(aval.shape)))) for aval in ctx.avals_out],
    ).results


def _gpu_triton():
    from jax._src.lib import gpu_triton

    return gpu_triton


def _array():
    return _gpu_triton().create_array_parameter(0, POINTER_DIVISIBILITY)


def _word(value: int):
    return _gpu_triton().create_scalar_parameter(value, "u64")


def _fake_pointer(index: int) -> int:
    return (index + 1) * _FAKE_POINTER_STEP


def _planning_info(aval, name: str, index: int, device: int, writable: bool = False) -> ArrayInfo:
    """An array as XLA will pass it (C order, on ``device``) with a planning address: aligned
    like XLA's buffers and apart from every other operand's, so no check sees an overlap."""
    info = describe_traced(aval, name)
    info.device, info.ptr, info.writable = device, _fake_pointer(index), writable
    return info


def _flat_block(plan, spec) -> tuple[tuple[int, int, int], int]:
    """A block of whole warps for the planned launch (jaxlib launches whole warps), and its
    dynamic shared memory. The decode kernel gives each head its own thread: its heads are padded
    up (threads without a head do nothing). The other kernels stride over heads and tokens, so
    any y and z cover them: the largest whole-warp block of the planned lanes is taken."""
    x, y, z = (int(n) for n in spec.block)
    limit = launch.THREADS_PER_BLOCK
    if spec.kernel.decode:
        while (x * y) % 32:
            y += 1
        choice = (x, y, 1) if x * y <= limit else None
    else:
        shapes = [(x * b * c, c, b) for c in range(1, z + 1) for b in range(1, limit // (x * c) + 1)
                  if (x * b * c) % 32 == 0]
        choice = (x, max(shapes)[2], max(shapes)[1]) if shapes else None
    if choice is None:
        raise NotImplementedError(
            f"apply_rope under jax.jit: no block of whole warps within {limit} threads fits the "
            f"planned block {tuple(spec.block)} for XLA's kernel call")
    if spec.kernel.decode and spec.kernel.source == AngleSource.COMPUTED:
        shared_bytes = launch.decode_shared_angle_bytes(plan, choice)
    else:
        shared_bytes = launch.shared_angle_bytes(plan, spec.kernel, choice)
    return choice, shared_bytes


def kernel_name(spec, block) -> str:
    """The entry's (unmangled) name: unique per specialisation and block shape."""
    digest = hashlib.sha256(f"{spec.kernel.name_expression}{block}".encode()).hexdigest()[:16]
    return f"cupyrope_xla_{digest}"


# What the entry runs, by kernel: the body of the __global__ kernel the eager launch would use.
def _body(spec) -> tuple[str, str, str]:
    """(parameter struct, body call, launch bounds) of the entry for a kernel specialisation."""
    template = spec.name_expression[spec.name_expression.index("<"):]
    args = template[1:-1]
    if spec.decode:
        t, table, _, interleaved, source, _ = (a.strip() for a in args.split(","))
        return ("cupyrope::DecodeParams",
                f"cupyrope::rope_decode_thread<{t}, {table}, {interleaved}, {source}>",
                "cupyrope::kMaxThreadsPerBlock")
    t, table, _, _, source, wide = (a.strip() for a in args.split(","))
    if spec.lean:
        return ("cupyrope::RopeParams", f"cupyrope::rope_lean{template}",
                f"cupyrope::kMaxThreadsPerBlock, "
                f"cupyrope::MinBlocksPerSM<{t}, {table}, {source}, {wide}, true>::value")
    return ("cupyrope::RopeParams", f"cupyrope::rope_tokens{template[:-1]}, false>",
            f"cupyrope::kMaxThreadsPerBlock, "
            f"cupyrope::MinBlocksPerSM<{t}, {table}, {source}, {wide}, false>::value")


def _entry_source(spec, block, name: str, words: int) -> str:
    """The flat-argument entry of one launch (see the module docstring)."""
    params, body, bounds = _body(spec.kernel)
    pointers = _OPERAND_POINTERS + _RESULT_POINTERS
    word_params = ",\n    ".join(f"unsigned long long w{i}" for i in range(8, words))
    sets = "\n  ".join(f"u.w[{i}] = w{i};" for i in range(8, words))
    pointer_sets = "\n  ".join(f"u.w[{_STRUCT_WORD[p]}] = ptr_{p};" for p in pointers)
    pointer_params = ",\n    ".join(f"unsigned long long ptr_{p}" for p in pointers)
    return f"""#include "rope.cu"

// XLA's entry: data pointers in XLA's buffer order, then the struct's other words.
extern "C" __global__ void __launch_bounds__({bounds}) {name}(
    {pointer_params},
    long long sin_offset,
    {word_params}) {{
  union {{
    {params} p;
    unsigned long long w[{words}];
  }} u;
  {pointer_sets}
  {sets}
  // A cos/sin cache: sin is the second half of cos's row (one XLA buffer).
  if (sin_offset >= 0) {{
    u.w[{_STRUCT_WORD["sin"]}] = ptr_cos + static_cast<unsigned long long>(sin_offset);
  }}
  {body}(u.p);
}}
"""


_ptx_cache: dict = {}
_ptx_lock = threading.Lock()


def _kernel_call_kernel(spec, block, shared_bytes: int, device: int):
    """jaxlib's TritonKernel for one launch: the entry compiled to PTX for ``device``."""
    cupy = cupy_module()
    major_minor = cupy.cuda.Device(device).compute_capability  # e.g. "90"
    arithmetic = kernels.kernel_arithmetic(spec.kernel, device)
    name = kernel_name(spec, block)
    words = spec.params.dtype.itemsize // 8
    key = (name, major_minor, arithmetic, kernels.source_fingerprint(), words)
    with _ptx_lock:
        ptx = _ptx_cache.get(key)
        if ptx is None:
            options = kernels.compile_options(arithmetic) + (
                f"--gpu-architecture=compute_{major_minor}",
                f"-DCUPYROPE_FLAT_BLOCK_X={block[0]}", f"-DCUPYROPE_FLAT_BLOCK_Y={block[1]}",
                f"-DCUPYROPE_FLAT_BLOCK_Z={block[2]}")
            ptx = _nvrtc_ptx(_entry_source(spec, block, name, words), options)
            _ptx_cache[key] = ptx
    threads = block[0] * block[1] * block[2]
    return _gpu_triton().TritonKernel(name, threads // 32, 1, shared_bytes, ptx, "",
                                      int(major_minor))


def _nvrtc_ptx(source: str, options: tuple[str, ...]) -> str:
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, "cupyrope_xla.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC failed to compile cupyrope's XLA entry: {exc}\n{log}") from None
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def clear_cache() -> None:
    """Forget compiled PTX (``cupyrope.clear_cache``)."""
    with _ptx_lock:
        _ptx_cache.clear()
