"""cupyrope's ops as native XLA operations on NVIDIA GPUs: jaxlib's GPU kernel call with NVRTC's
PTX, planned while lowering from the shapes XLA will pass, through an entry with flat arguments.
:func:`unavailable_reason` says when the callback route must be used instead. Design (the entry,
export, availability): ``docs/jax_internals.md``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from typing import NamedTuple

import numpy as np

from ...cuda import compiler, launch
from ...core.abi import FUSION_PARAMS_DTYPE, AngleSource
from ...core.arrays import ArrayInfo, cupy_module, describe_traced

NATIVE_ENV = "CUPYROPE_JAX_NATIVE"
# jaxlib 0.11 (jax-cuda13-plugin 0.11.2 measured): TritonKernel(name, num_warps, num_ctas,
# shared_mem_bytes, ptx, ttir, compute_capability) and the FFI target below. Older jaxlibs keep
# the callback route (warned once).
MIN_JAXLIB = (0, 11)
CALL_TARGET = "triton_kernel_call_ffi"
# The kernel call checks that every array parameter's address is a multiple of this: the vector
# path the plan assumes needs 16-byte alignment (XLA aligns its buffers to far more).
POINTER_DIVISIBILITY = 16
# Where the array each XLA buffer holds goes in the kernel's parameter structs: (struct, word).
# RopeParams and DecodeParams lead with the same eight pointers; FusionParams and
# FusedDecodeParams with the same nine.
_ROPE_WORDS = {"q": 0, "k": 1, "q_out": 2, "k_out": 3, "positions": 4, "cos_sin_cache": 5,
               "cos": 5, "sin": 6, "inv_freq": 7}
_FUSION_WORDS = {"q_weight": 0, "k_weight": 1, "q_scale": 2, "k_scale": 3, "v_scale": 4, "v": 5,
                 "k_cache": 6, "v_cache": 7, "slot_mapping": 8,
                 # Stores quantised per row: the outputs' per-row scales, the caches' per-row or
                 # NVFP4 block scales (further into FusionParams).
                 **{name: FUSION_PARAMS_DTYPE.fields[name][1] // 8
                    for name in ("q_out_scales", "k_out_scales", "k_cache_scales",
                                 "v_cache_scales")}}
# The buffer of a written scale array: an operand (a cache's scales, written through the input
# buffer its result is aliased to) or a result of its own (the outputs' per-row scales).
_SCALE_OPERAND_BUFFERS = {"k_scale": "k_cache_scales", "v_scale": "v_cache_scales",
                          "k_cache_scales": "k_cache_scales", "v_cache_scales": "v_cache_scales"}
_SCALE_RESULT_BUFFERS = {"q_scale": "q_out_scales", "k_scale": "k_out_scales"}
_FAKE_POINTER_STEP = 1 << 40  # planning addresses: 256-aligned, far apart (no overlap)


def unavailable_reason() -> str | None:
    """None when the native call can be used here, else why not (for the warning)."""
    if os.environ.get(NATIVE_ENV, "") == "0":
        return f"{NATIVE_ENV}=0 asks for the callback route"
    import jaxlib

    version = tuple(int(part) for part in jaxlib.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_JAXLIB:
        return (f"jaxlib {jaxlib.__version__} is older than "
                f"{'.'.join(map(str, MIN_JAXLIB))}, the first with the kernel call this module "
                "was tested against")
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


def planning_infos(avals, names: tuple[str, ...], device: int) -> dict[str, ArrayInfo]:
    """The operands (``avals``, named ``names``) as XLA will pass them (C order, on ``device``),
    with planning addresses: aligned like XLA's buffers and apart from one another, so no check
    sees an overlap. What ``plan_rope`` / ``plan_fused`` plan a native call from."""
    infos = {}
    for index, (name, aval) in enumerate(zip(names, avals)):
        info = describe_traced(aval, name)
        info.device, info.ptr = device, fake_pointer(index)
        infos[name] = info
    return infos


def lower_planned(ctx, operands, names: tuple[str, ...], plan):
    """One XLA kernel call of a checked plan (``plan_rope`` or ``plan_fused`` on
    :func:`planning_infos`): ``operands`` are the IR values of ``names``; returns the results'
    IR values (q_out, k_out, then a cache write's new caches: the input caches' buffers, which
    the call declares aliased and writes in place, then the written scale arrays: a cache's
    aliased alike, the outputs' per-row scales results of their own)."""
    from jax._src.interpreters import mlir

    if plan.is_empty:  # nothing to rotate: the inputs' caches, empty outputs, no launch
        return _empty_results(ctx, operands, names, plan, mlir)
    device = plan.device
    if plan.fusion is not None:
        launch.check_fp8_support(plan)
    arithmetic = (compiler.angle_arithmetic(device) if plan.source == AngleSource.COMPUTED
                  else None)
    native = plan_native_launch(
        plan, ctx.avals_out, names, angle_arithmetic=arithmetic,
        num_regs=lambda kernel_spec: compiler.get_kernel(kernel_spec, device).num_regs,
        multiprocessors=launch._multiprocessors(device),
        memory_bandwidth=launch._memory_bandwidth(device))
    spec, block, buffers = native.spec, native.block, native.buffers
    nodes = list(operands)
    if native.inv_freq is not None:  # the schedule's float64 frequencies, a module constant
        nodes.append(mlir.ir_constant(native.inv_freq.view(np.uint32)))
    kernel = _kernel_call_kernel(spec, block, native.shared_bytes, device, buffers)
    rotated = 1 if plan.k is None else 2
    written = _written(plan, names)

    triton = gpu_triton()
    parameters = [triton.create_array_parameter(0, POINTER_DIVISIBILITY) for _ in buffers]
    parameters.append(triton.create_scalar_parameter(
        -1 if spec.sin_offset is None else int(spec.sin_offset), "i64"))
    for struct in (spec.params, spec.fusion_params):
        if struct is not None:
            parameters += [triton.create_scalar_parameter(int(w), "u64")
                           for w in np.frombuffer(struct.tobytes(), dtype=np.uint64)]
    call = triton.TritonKernelCall(kernel, *native.grid, 1, parameters)
    aliases = {names.index(name): rotated + i for i, name in enumerate(written)
               if name in names}
    return kernel_call(ctx, nodes, kernel_name(spec, block, buffers), call, aliases)


def kernel_call(ctx, nodes, name: str, call, aliases: dict):
    """XLA's custom call of jaxlib's kernel call ``call`` (a ``TritonKernelCall`` of the entry
    ``name``) on the IR values ``nodes`` (the operands, then a 1-d constant where the call takes
    one), with row-major layouts; ``aliases`` maps an operand's index to the result written
    through its buffer. Returns the results' IR values."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    row_major = [list(reversed(range(len(aval.shape)))) for aval in ctx.avals_in]
    row_major += [[0]] * (len(nodes) - len(row_major))
    return mlir.custom_call(
        CALL_TARGET,
        result_types=[mlir.aval_to_ir_type(ctx.module_context, aval) for aval in ctx.avals_out],
        operands=nodes,
        backend_config=dict(name=ir.StringAttr.get(name),
                            opaque=ir.StringAttr.get(zlib.compress(call.to_proto(name, b"")))),
        operand_layouts=row_major,
        result_layouts=[list(reversed(range(len(aval.shape)))) for aval in ctx.avals_out],
        operand_output_aliases=aliases or None,
    ).results


class NativeLaunch(NamedTuple):
    """A planned XLA kernel call: the launch, its block of whole warps and dynamic shared
    memory, the names of XLA's buffers in order (None: an aliased cache result the kernel does
    not read) and the float64 frequencies the call takes as a constant (computed angles)."""

    spec: launch.LaunchSpec
    block: tuple[int, int, int]
    grid: tuple[int, int]
    shared_bytes: int
    buffers: tuple
    inv_freq: np.ndarray | None


def plan_native_launch(plan, avals_out, names: tuple[str, ...], *, num_regs, multiprocessors: int,
                       angle_arithmetic: str | None,
                       memory_bandwidth: float = 0.0) -> NativeLaunch:
    """The XLA kernel call of a checked, non-empty plan on :func:`planning_infos` (``avals_out``:
    the results' shapes and dtypes). ``num_regs``, ``multiprocessors`` and ``memory_bandwidth``
    are ``launch.plan_launch``'s; ``angle_arithmetic`` the device's computed-angle arithmetic."""
    rotated = 1 if plan.k is None else 2
    outputs = []
    for i, aval in enumerate(avals_out[:rotated]):
        info = describe_traced(aval, "output")
        info.device, info.ptr, info.writable = plan.device, fake_pointer(len(names) + 1 + i), True
        if plan.fusion is not None and plan.fusion.out_dtype is not None:
            info.dtype = plan.fusion.out_dtype
        outputs.append(info)
    inv_freq = None
    if plan.source == AngleSource.COMPUTED:
        inv_freq = np.ascontiguousarray(plan.inv_freq, dtype=np.float64)
    spec = launch.plan_launch(
        plan, outputs, inv_freq_ptr=0 if inv_freq is None else fake_pointer(len(names)),
        num_regs=num_regs, multiprocessors=multiprocessors, angle_arithmetic=angle_arithmetic,
        memory_bandwidth=memory_bandwidth)
    block, grid, shared_bytes = _flat_block(plan, spec)
    # XLA's buffers: the operands (a cos/sin cache is read as `cos`, sin found by offset; a
    # cache's scales written as they are), the frequencies, then the results (new caches and
    # their scales are aliased to the input arrays and written through those; the outputs'
    # per-row scales are results of their own).
    written = _written(plan, names)
    buffers = [_SCALE_OPERAND_BUFFERS[name] if name in written and name in _SCALE_OPERAND_BUFFERS
               else name for name in names]
    buffers += ["inv_freq"] if inv_freq is not None else []
    buffers += ["q_out", "k_out"][:rotated]
    buffers += [None if name in names else _SCALE_RESULT_BUFFERS[name] for name in written]
    return NativeLaunch(spec, block, grid, shared_bytes, tuple(buffers), inv_freq)


def _written(plan, names: tuple[str, ...]) -> list[str]:
    """The results after q_out (k_out), by name: the new caches, then the written scale arrays
    (an operand's name where the result is aliased to it)."""
    if plan.fusion is None:
        return []
    return ([name for name in ("k_cache", "v_cache") if name in names]
            + [name for name, _ in plan.fusion.written_scales()])


def _empty_results(ctx, operands, names, plan, mlir):
    """No token: empty outputs and per-row scales, the input caches and their scales."""
    results = [mlir.full_like_aval(ctx, 0, aval) for aval in ctx.avals_out]
    rotated = 1 if plan.k is None else 2
    for i, name in enumerate(_written(plan, names), rotated):
        if name in names:
            results[i] = operands[names.index(name)]
    return results


def gpu_triton():
    from jax._src.lib import gpu_triton

    return gpu_triton


def fake_pointer(index: int) -> int:
    return (index + 1) * _FAKE_POINTER_STEP


def _flat_block(plan, spec) -> tuple[tuple[int, int, int], tuple[int, int], int]:
    """A block of whole warps for the planned launch (jaxlib launches whole warps), its grid and
    its dynamic shared memory. The decode kernel gives each head its own thread: its heads are
    padded up (threads without a head do nothing), over more blocks where one would pass the
    block limit. The other kernels stride over heads and tokens, so
    any y and z cover them: the whole-warp block nearest the planned one is taken, tokens per
    block first (H200, T = 65536, eager, % of an SM copy: planned (8, 10, 3) 95.4, (8, 8, 3) 94.8,
    (8, 8, 4) 94.6, (8, 4, 6) 92.8, (8, 4, 8) 91.9)."""
    x, y, z = (int(n) for n in spec.block)
    grid = (int(spec.grid[0]), int(spec.grid[1]))
    limit = launch.THREADS_PER_BLOCK
    if spec.kernel.decode:
        step = launch.whole_warp_heads(x)
        y = -(-y // step) * step
        if x * y > limit:  # the heads of one block over more blocks
            num_heads = plan.num_q_heads + plan.num_k_heads + (
                launch.fused_v_heads(plan.fusion) if spec.kernel.fused else 0)
            most = limit // (x * step) * step  # heads a whole-warp block holds
            if most:
                grid = (grid[0], -(-num_heads // most))
                y = -(-(-(-num_heads // grid[1])) // step) * step
        choice = (x, y, 1) if x * y <= limit else None
    else:
        # Row-scaled launches keep a row buffer per head lane group: at most `rows` of them.
        rows = (_row_buffers(plan) if spec.kernel.fused and plan.fusion.row_scaled
                else limit)
        shapes = [(abs(c - z), abs(b - y), -b * c, b, c) for c in range(1, z + 1)
                  for b in range(1, limit // (x * c) + 1)
                  if (x * b * c) % 32 == 0 and b * c <= rows]
        choice = (x, min(shapes)[3], min(shapes)[4]) if shapes else None
    if choice is None:
        raise NotImplementedError(
            f"cupyrope under jax.jit: no block of whole warps within {limit} threads fits the "
            f"planned block {tuple(spec.block)} for XLA's kernel call")
    kernel = spec.kernel
    if kernel.fused and not kernel.decode:
        shared_bytes = (0 if kernel.lean else launch.fused_shared_bytes(
            plan, plan.fusion, bool(spec.fusion_params["ring"]), choice))
    elif kernel.decode:
        shared_bytes = (launch.decode_shared_angle_bytes(plan, choice)
                        if kernel.source == AngleSource.COMPUTED else 0)
    else:
        shared_bytes = launch.shared_angle_bytes(plan, kernel, choice)
    return choice, grid, shared_bytes


def _row_buffers(plan) -> int:
    """The row buffers (head_dim float32 each) a row-scaled launch's shared memory holds beside
    its norm weights, as ``launch.fit_row_buffers`` sizes them."""
    weights = launch.fused_shared_bytes(plan, plan.fusion, False, (0, 0, 0))
    return (launch.MAX_SHARED_ANGLE_BYTES - weights) // (4 * plan.head_dim)


def kernel_name(spec, block, buffers: tuple) -> str:
    """The entry's (unmangled) name: unique per specialisation, block shape and buffer order."""
    digest = hashlib.sha256(
        f"{spec.kernel.name_expression}{block}{buffers}".encode()).hexdigest()[:16]
    return f"cupyrope_xla_{digest}"


def _body(kernel) -> tuple[str, str]:
    """(body call, launch bounds) of the entry for a kernel specialisation: the device function
    its __global__ kernel runs, with the same register budget."""
    template = kernel.name_expression[kernel.name_expression.index("<"):]
    args = [a.strip() for a in template[1:-1].split(",")]
    t, table, _, interleaved, source, wide = args[:6]
    threads = "cupyrope::kMaxThreadsPerBlock"
    if kernel.fused and kernel.decode:
        norm, cache = args[6:8]
        return (f"cupyrope::rope_fused_decode_body<{t}, {table}, {interleaved}, {source}, {norm}, "
                f"{cache}>", threads)
    if kernel.fused and kernel.lean and kernel.all_heads:
        cache, held = args[6:8]
        return (f"cupyrope::rope_fused_lean_all_heads_body<{t}, {table}, {interleaved}, {source}, "
                f"{cache}, {held}>",
                f"{threads}, cupyrope::LeanAllHeadsMinBlocksPerSM<{t}, {interleaved}, {cache}>::value")
    if kernel.fused and kernel.lean:
        norm, cache = args[6:8]
        return (f"cupyrope::rope_fused_lean{template}",
                f"{threads}, cupyrope::FusedLeanMinBlocksPerSM<{t}, {interleaved}, {norm}, "
                f"{cache}, {source}, {str(kernel.mrope).lower()}, "
                f"{str(kernel.partial).lower()}>::flat_entry")
    if kernel.fused and kernel.all_heads:  # rope_fused_all_heads_kernel's body and bounds
        return (f"cupyrope::rope_fused_tokens{template[:-1]}, true, true>",
                f"{threads}, {'1' if wide == 'true' else '2'}")
    if kernel.fused and kernel.rows:  # rope_fused_rows_kernel's body and bounds
        return (f"cupyrope::rope_fused_tokens{template[:-1]}, true>",
                f"{threads}, {'1' if wide == 'true' else '2'}")
    if kernel.fused:
        return (f"cupyrope::rope_fused_tokens{template}",
                f"{threads}, cupyrope::FusedMinBlocksPerSM<{args[2]}, {interleaved}, {wide}>::value")
    if kernel.decode:
        return f"cupyrope::rope_decode_thread<{t}, {table}, {interleaved}, {source}>", threads
    if kernel.lean:
        return (f"cupyrope::rope_lean{template}",
                f"{threads}, cupyrope::MinBlocksPerSM<{t}, {table}, {source}, {wide}, true>::value")
    return (f"cupyrope::rope_tokens{template[:-1]}, false>",
            f"{threads}, cupyrope::MinBlocksPerSM<{t}, {table}, {source}, {wide}, false>::value")


def _entry_source(spec, name: str, buffers: tuple) -> str:
    """The flat-argument entry of one launch (see the module docstring): XLA's buffers in
    ``buffers`` order (None: a buffer the kernel does not read), the cache's sin offset, then
    every word of the parameter struct(s), whose pointer words the buffers then replace."""
    body, bounds = _body(spec.kernel)
    params_type = "cupyrope::DecodeParams" if spec.kernel.decode else "cupyrope::RopeParams"
    structs = [("rope", params_type, spec.params.dtype.itemsize // 8, _ROPE_WORDS)]
    if spec.fusion_params is not None:
        fusion_type = ("cupyrope::FusedDecodeParams" if spec.kernel.decode
                       else "cupyrope::FusionParams")
        structs.append(("fusion", fusion_type,
                        spec.fusion_params.dtype.itemsize // 8, _FUSION_WORDS))
    arguments = [f"unsigned long long buffer{i}" for i in range(len(buffers))]
    arguments.append("long long sin_offset")
    lines = []
    for label, type_name, words, word_of in structs:
        arguments += [f"unsigned long long {label}{i}" for i in range(words)]
        lines.append(f"union {{ {type_name} p; unsigned long long w[{words}]; }} {label};")
        lines += [f"{label}.w[{i}] = {label}{i};" for i in range(words)]
        lines += [f"{label}.w[{word_of[b]}] = buffer{i};" for i, b in enumerate(buffers)
                  if b in word_of]
    cos = buffers.index("cos_sin_cache") if "cos_sin_cache" in buffers else None
    if cos is not None:  # the cos/sin cache: sin is the second half of cos's row
        lines.append(f"rope.w[{_ROPE_WORDS['sin']}] = buffer{cos} + "
                     "static_cast<unsigned long long>(sin_offset);")
    call_args = "rope.p" + (", fusion.p" if spec.fusion_params is not None else "")
    lines.append(f"{body}({call_args});")
    separator = ",\n    "
    statements = "\n  ".join(lines)
    return f"""#include "rope.cu"

// XLA's entry (cupyrope/frontends/jax/native.py): XLA's buffers, the cache's sin offset, the struct words.
extern "C" __global__ void __launch_bounds__({bounds}) {name}(
    {separator.join(arguments)}) {{
  {statements}
}}
"""


_ptx_cache: dict = {}
_ptx_lock = threading.Lock()


def _kernel_call_kernel(spec, block, shared_bytes: int, device: int, buffers: tuple):
    """jaxlib's TritonKernel for one launch: the entry compiled to PTX for ``device``."""
    capability = cupy_module().cuda.Device(device).compute_capability  # e.g. "90"
    ptx = entry_ptx(spec, block, buffers, capability,
                    compiler.kernel_arithmetic(spec.kernel, device))
    threads = block[0] * block[1] * block[2]
    return gpu_triton().TritonKernel(kernel_name(spec, block, buffers), threads // 32, 1,
                                      shared_bytes, ptx, "", int(capability))


def entry_ptx(spec, block, buffers: tuple, capability: str, arithmetic: str | None) -> str:
    """PTX of the flat-argument entry of a planned launch (``spec``: ``launch.plan_launch``'s)
    with ``block`` (whole warps) and XLA's ``buffers``, for compute capability ``capability``
    ("90"), memoised; needs NVRTC, not a GPU."""
    name = kernel_name(spec, block, buffers)
    key = (name, capability, arithmetic, compiler.source_fingerprint())
    with _ptx_lock:
        ptx = _ptx_cache.get(key)
        if ptx is None:
            source, options = entry_program(spec, block, buffers, arithmetic)
            ptx = nvrtc_ptx(source, options + (f"--gpu-architecture=compute_{capability}",))
            _ptx_cache[key] = ptx
    return ptx


def entry_program(spec, block, buffers: tuple, arithmetic: str | None) -> tuple[str, tuple]:
    """(source, NVRTC options but the architecture) of a launch's entry: the block shape it maps
    flat thread indices onto is compiled in."""
    options = compiler.compile_options(arithmetic) + (
        f"-DCUPYROPE_FLAT_BLOCK_X={block[0]}", f"-DCUPYROPE_FLAT_BLOCK_Y={block[1]}",
        f"-DCUPYROPE_FLAT_BLOCK_Z={block[2]}")
    return _entry_source(spec, kernel_name(spec, block, buffers), buffers), options


def nvrtc_ptx(source: str, options: tuple[str, ...]) -> str:
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
