"""Launch of the rope kernels for a checked plan on a CUDA device.

Per call: token dims merged, 16-byte or scalar accesses, the kernel (decode, lean, general or
fused) and its geometry, one packed ``RopeParams`` struct, a launch on the caller's stream.
Nothing here synchronises or allocates (but a schedule's ``inv_freq``, uploaded once and kept).

Design notes: docs/architecture.md#cudalaunchpy
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable

import numpy as np

from . import dependent_launch
from ..core.abi import (DECODE_PARAMS_DTYPE, FUSED_DECODE_PARAMS_DTYPE, FUSION_PARAMS_DTYPE,
                         MAX_TOKEN_DIMS, PARAMS_DTYPE, THREADS_PER_BLOCK, AngleSource,
                         StoreFormat, WeightDtype, access_layout)
from ..core.arrays import ArrayInfo, cupy_module, mark_written, stream_is_capturing, upload
from ..core.dtypes import ITEMSIZE
from ..core.mrope import MROPE_INTERLEAVED, MROPE_NONE, MROPE_SECTIONED
from ..core.fused_plan import STORE_FORMATS
from ..core.overlap import byte_span
from .compiler import KernelSpec, RerotateSpec, get_kernel, is_compiled
from .compiler import angle_arithmetic as device_angle_arithmetic
from ..core.plan import RopePlan, check_dense_heads, has_dense_heads
from ..core.rerotate import RERO_PARAMS_DTYPE, RerotatePlan, plan_rerotate, rerotate_on_host
from .recipes import LaunchRecipe, keep_rerotate_recipe

# CUDA's grid limits (every GPU since compute capability 3.0).
MAX_GRID_X, MAX_GRID_Y = 2**31 - 1, 65535
# Launches whose every offset (and token count) stays below this use 32-bit offsets. Half of the
# int32 range: the kernel's token loop steps up to one grid past the last token before it stops.
INDEX32_LIMIT = 2**30

def merge_token_dims(shape: tuple[int, ...], strides: list[tuple[int, ...]]):
    """Drop size-1 token dims and merge neighbours that every operand walks contiguously.

    ``strides`` holds one tuple per operand, aligned with ``shape``. Returns the merged shape and
    strides; ``[B, S]`` of contiguous operands becomes ``[B * S]``.
    """
    kept = [i for i, n in enumerate(shape) if n != 1]
    out_shape: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for i in kept:
        if out_shape and all(s[-1] == st[i] * shape[i] for s, st in zip(out_strides, strides)):
            out_shape[-1] *= shape[i]
            for s, st in zip(out_strides, strides):
                s[-1] = st[i]
        else:
            out_shape.append(shape[i])
            for s, st in zip(out_strides, strides):
                s.append(st[i])
    return tuple(out_shape), [tuple(s) for s in out_strides]


def _vector_path_ok(plan: RopePlan, operands: list[ArrayInfo], token_strides, copy_pass) -> bool:
    if not all(has_dense_heads(info) for info in operands):
        return False  # the scalar path takes any stride between a head's elements
    itemsize = ITEMSIZE[plan.q.dtype]
    access, _ = access_layout(itemsize, True, plan.interleaved)
    r, half = plan.rotary_dim, plan.rotary_dim // 2
    if (r if plan.interleaved else half) % access:
        return False
    if copy_pass and ((plan.head_dim - r) % access or r % access):
        return False
    for info, strides in zip(operands, token_strides):
        if info.ptr % 16 or info.strides[-2] % access or any(s % access for s in strides):
            return False
    return True


def _extent(info: ArrayInfo | None) -> int:
    """1 + the largest |element offset| any index of ``info`` reaches from its data pointer."""
    if info is None:
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(info.shape, info.strides) if n > 0)


def needs_wide_index(plan: RopePlan, outputs: list[ArrayInfo]) -> bool:
    arrays = [plan.q, plan.k, plan.positions, plan.cache, plan.cos, plan.sin, *outputs]
    if plan.fusion is not None:  # (cache rows are 64-bit in the kernel whatever this says)
        arrays += [plan.fusion.v, plan.fusion.slot_mapping]
    return max([plan.num_tokens] + [_extent(a) for a in arrays]) >= INDEX32_LIMIT


def lean_kernel_applies(plan: RopePlan, *, vector: bool, wide_index: bool, token_ndim: int,
                        table_vector_ok: bool, mrope_ok: bool = False) -> bool:
    """Whether the lean kernel (LEAN in kernels_cu/rope.cu) handles this launch: 16-byte accesses,
    32-bit offsets, at most one token dim after merging, no M-RoPE (``mrope_ok``: the lean fused
    kernel reads M-RoPE positions), and cos/sin rows (if any) that take vector loads. Everything
    else runs the general kernel."""
    return (vector and not wide_index and token_ndim <= 1 and (mrope_ok or not plan.mrope_mode)
            and (plan.source == AngleSource.COMPUTED or table_vector_ok))


# The decode kernel (kernels_cu/decode.cuh: one thread per token, head and chunk of pairs) runs
# launches of the lean kernel's layouts with at most this many tokens, where latency, not
# bandwidth, decides: it beats the lean kernel up to 2048 tokens and is within noise at 4096.
# measured: docs/perf_log.md#decode_max_tokens
DECODE_MAX_TOKENS = 2048


# Launches of at most DECODE_MAX_TOKENS tokens on the decode or lean kernels (fused ones too) are
# programmatic dependent launches where the device supports them (cupyrope.cuda.dependent_launch): they
# are dispatched while the previous kernel drains, and wait for it before touching memory. Larger
# launches gain nothing and would let the next kernel's blocks take their SMs early. False turns
# it off. measured: docs/perf_log.md#dependent_launch
DEPENDENT_LAUNCH = True


def dependent_launch_applies(plan: RopePlan, spec: KernelSpec) -> bool:
    """Whether a launch is made a programmatic dependent launch (the kernel must wait for the
    previous grid before its first memory access: the decode and lean kernels do)."""
    return (DEPENDENT_LAUNCH and (spec.decode or spec.lean)
            and plan.num_tokens <= DECODE_MAX_TOKENS and dependent_launch.supported(plan.device))


def decode_kernel_applies(plan: RopePlan, *, lean: bool, copy_pass: bool, pairs: int,
                          angle_arithmetic: str | None = None) -> bool:
    """Whether the decode kernel runs this launch: a lean launch of few tokens that copies
    nothing past rotary_dim, whose chunks of a head fit one block (and, with computed angles,
    where they pay: ``computed_decode_pays`` with the device's ``angle_arithmetic``, None for
    unknown, and whose warps' angles fit the shared memory a launch may use without opting
    in)."""
    chunks = (plan.rotary_dim // 2) // pairs
    if not (lean and not copy_pass and plan.num_tokens <= DECODE_MAX_TOKENS
            and chunks <= THREADS_PER_BLOCK):
        return False
    if plan.source == AngleSource.COMPUTED:
        if not computed_decode_pays(plan, angle_arithmetic):
            return False
        block, _ = decode_geometry(plan, pairs)
        return (block[0] * block[1] <= THREADS_PER_BLOCK
                and decode_shared_angle_bytes(plan, block) <= MAX_SHARED_ANGLE_BYTES)
    return True


# Computed angles on the decode kernel (each warp computes its token's angles, no block barrier)
# against the lean kernel (each pair once per block, behind a barrier): with float64 angle
# arithmetic the decode kernel is faster up to 512 tokens and slower from 1024; float-float angles
# (~3x the instructions a pair) gain little there and lose from 1024. So the decode kernel takes
# computed angles up to this many tokens, with float64 angle arithmetic only.
# measured: docs/perf_log.md#decode_max_computed_tokens
DECODE_MAX_COMPUTED_TOKENS = 512


def computed_decode_pays(plan: RopePlan, angle_arithmetic: str | None) -> bool:
    """Whether computed angles are faster on the decode kernel than on the lean one (above):
    few tokens, float16 / bfloat16 / float32 q and k, and float64 angle arithmetic (the
    device's, ``cupyrope.cuda.compiler.angle_arithmetic``)."""
    return (plan.num_tokens <= DECODE_MAX_COMPUTED_TOKENS and plan.q.dtype != "float64"
            and angle_arithmetic == "float64")


def decode_shared_angle_bytes(plan: RopePlan, block: tuple[int, int, int]) -> int:
    """Shared memory of a computed-angle decode launch: each warp of a block keeps cos and sin of
    every pair of its token (kernels_cu/decode.cuh computes them per warp: no block barrier)."""
    warps = block[0] * block[1] // 32  # whole warps: see decode_geometry
    compute_itemsize = 8 if plan.q.dtype == "float64" else 4
    return warps * (plan.rotary_dim // 2) * 2 * compute_itemsize


def decode_struct(p: np.ndarray, source: AngleSource) -> np.ndarray:
    """The decode kernel's DecodeParams from a lean launch's RopeParams (one token dim: the first
    of each token-stride array; every value fits 32 bits, as the lean kernel's offsets do)."""
    d = np.zeros((), dtype=DECODE_PARAMS_DTYPE)
    for name in ("q", "k", "q_out", "k_out", "positions", "cos", "sin", "inv_freq",
                 "q_head_stride", "k_head_stride", "q_out_head_stride", "k_out_head_stride",
                 "num_q_heads", "max_position", "positions_are_int64", "sin_sign",
                 "attention_factor"):
        d[name] = p[name]
    for name in ("q_token_stride", "k_token_stride", "q_out_token_stride", "k_out_token_stride",
                 "positions_token_stride"):
        d[name] = p[name][0]
    d["num_heads"] = p["num_q_heads"] + p["num_k_heads"]
    if source == AngleSource.CACHE_TABLE:
        d["cos_row_stride"] = d["sin_row_stride"] = p["table_row_stride"]
    else:
        d["cos_row_stride"], d["sin_row_stride"] = p["cos_token_stride"][0], p["sin_token_stride"][0]
    return d


def decode_geometry(plan: RopePlan, pairs: int, extra_heads: int = 0):
    """(block, grid) of the decode kernel: x the chunks of a head, y the heads of q then k (then
    ``extra_heads``: the fused decode kernel's v heads; split evenly over gridDim.y when they do
    not fit one block), grid x the tokens. With computed angles a block is whole warps (each
    warp computes its token's angles: kernels_cu/decode.cuh): its heads are padded up to that,
    which can take it past THREADS_PER_BLOCK (then decode_kernel_applies says no)."""
    chunks = (plan.rotary_dim // 2) // pairs
    num_heads = plan.num_q_heads + plan.num_k_heads + extra_heads
    grid_y = -(-num_heads // (THREADS_PER_BLOCK // chunks))
    block_y = -(-num_heads // grid_y)  # 40 heads over 2 blocks: 20 + 20, not 32 + 8
    if plan.source == AngleSource.COMPUTED:
        step = whole_warp_heads(chunks)
        block_y = -(-block_y // step) * step
    return (chunks, block_y, 1), (plan.num_tokens, grid_y)


def whole_warp_heads(chunks: int) -> int:
    """The multiple of heads that makes a decode block of ``chunks`` lanes a head whole warps."""
    return 32 // math.gcd(chunks, 32)


# Dynamic shared memory a launch may use without opting in to more (every CUDA GPU).
MAX_SHARED_ANGLE_BYTES = 48 * 1024


def shared_angle_bytes(plan: RopePlan, spec: KernelSpec, block: tuple[int, int, int]) -> int:
    """Shared memory of a launch: the lean computed-angle kernel keeps cos and sin of every pair
    of each of its block's tokens there (computed once per pair, read by every head lane)."""
    if not (spec.lean and spec.source == AngleSource.COMPUTED) or spec.decode:
        return 0
    compute_itemsize = 8 if plan.q.dtype == "float64" else 4
    return block[2] * (plan.rotary_dim // 2) * 2 * compute_itemsize


def _table_vector_ok(plan: RopePlan, pairs: int, cos_ptr: int, sin_ptr: int,
                     row_strides: list[int]) -> bool:
    table = plan.table
    itemsize = ITEMSIZE[table.dtype]
    align = min(16, pairs * itemsize)
    if plan.cos_col_stride != 1 or plan.sin_col_stride != 1:
        return False
    if cos_ptr % align or sin_ptr % align:
        return False
    return all((s * itemsize) % align == 0 for s in row_strides)


class _DeviceConstants:
    """float64 inv_freq arrays uploaded once per (device, schedule) and kept for later calls.

    Arrays are never freed while the process runs: a captured CUDA graph may read one long after
    the call that uploaded it, even after clear() (which only forgets them for lookups). They are
    ``rotary_dim / 2`` float64 each.
    """

    def __init__(self):
        self._arrays: dict[tuple[int, bytes], object] = {}
        self._retired: list = []
        self._lock = threading.Lock()

    def inv_freq(self, device: int, values: np.ndarray, *, capturing: bool = False):
        key = (device, values.tobytes())
        array = self._arrays.get(key)
        if array is None:
            if capturing:
                raise RuntimeError(_needs_warmup("the inverse frequencies of this schedule are not "
                                                 "on the device yet (uploading them synchronises)"))
            with self._lock:
                array = upload(np.ascontiguousarray(values, dtype=np.float64), device)
                self._arrays[key] = array
        return array

    def clear(self) -> None:
        with self._lock:
            self._retired.extend(self._arrays.values())
            self._arrays.clear()


def _needs_warmup(what: str) -> str:
    return (f"apply_rope: called while the stream is being captured into a CUDA graph, but {what}; "
            "call cupyrope.warmup(...) with this call's dtypes, angle source and (for computed "
            "angles) theta / scaling / rotary_dim before capturing")


device_constants = _DeviceConstants()


@dataclasses.dataclass(eq=False)
class LaunchSpec:
    """One kernel launch, decided: which specialisation, its parameter struct, the geometry and
    the data pointers. Built from a plan without CuPy (see :func:`plan_launch`)."""

    kernel: KernelSpec
    params: np.ndarray  # a PARAMS_DTYPE (decode kernel: DECODE_PARAMS_DTYPE) scalar
    grid: tuple[int, int]
    block: tuple[int, int, int]
    shared_bytes: int  # dynamic shared memory (lean computed angles)
    pointers: tuple[int, ...]  # q, k, q_out, k_out, positions, cos, sin (0 where absent)
    sin_offset: int | None  # cache source: the sin half starts this many bytes after cos
    vector: bool  # 16-byte accesses: the outputs of a repeat call must be 16-byte aligned
    fusion_params: np.ndarray | None = None  # a FUSION_PARAMS_DTYPE scalar (the fused kernel)


def plan_launch(plan: RopePlan, outputs: list[ArrayInfo], *, inv_freq_ptr: int = 0,
                num_regs: Callable[[KernelSpec], int], multiprocessors: int,
                angle_arithmetic: str | None = None, memory_bandwidth: float = 0.0,
                compute_capability: int = 0,
                resident_blocks: Callable[..., int] | None = None) -> LaunchSpec:
    """The launch that rotates q (and k) of ``plan`` into ``outputs``.

    ``inv_freq_ptr`` is the device copy of ``plan.inv_freq`` (computed angles), ``num_regs`` gives
    the registers a specialisation uses (the geometry sizes blocks by it), ``multiprocessors``
    is the device's SM count and ``angle_arithmetic`` the device's computed-angle arithmetic
    (``cupyrope.cuda.compiler.angle_arithmetic``; None: unknown, computed angles stay on the lean
    kernel), ``memory_bandwidth`` the device's in bytes per second (:func:`lean_all_heads_held`;
    0: unknown) and ``compute_capability`` its major and minor digits, e.g. 90
    (:func:`fused_staged_applies`; 0: unknown, no staged launch); ``resident_blocks(spec,
    threads, shared_bytes=...)`` the blocks of a specialisation an SM holds, as the driver counts
    them (:func:`occupancy_blocks`; None: counted by the SM's limits).
    """
    if plan.fusion is not None:
        check_dense_heads(plan)  # the fused kernels read and write whole, dense heads
    q_out = outputs[0]
    k_out = outputs[1] if plan.k is not None else None
    k = plan.k
    none = (0,) * len(plan.token_shape)
    operands = [plan.q] + ([k, q_out, k_out] if k is not None else [q_out])
    operand_strides = [info.strides[:-2] for info in operands]
    table_strides = [plan.cos_strides or none, plan.sin_strides or none]
    shape, merged = merge_token_dims(
        plan.token_shape, operand_strides + [plan.positions_strides or none] + table_strides)
    if len(shape) > MAX_TOKEN_DIMS:
        raise ValueError(
            f"{plan.op_name}: the token dims {plan.token_shape} of q/k/positions/tables need "
            f"{len(shape)} strided dims after merging contiguous ones; at most {MAX_TOKEN_DIMS} are "
            "supported: make some of them contiguous"
        )
    rotated_strides = merged[:len(operands)]
    positions_strides, cos_strides, sin_strides = merged[len(operands):]

    fusion = plan.fusion
    copy_pass = plan.rotary_dim < plan.head_dim and (
        not plan.inplace or (fusion is not None and fusion_touches_pass_through(fusion)))
    vector = _vector_path_ok(plan, operands, rotated_strides, copy_pass) and (
        fusion is None or _fusion_vector_ok(plan, fusion))
    itemsize = ITEMSIZE[plan.q.dtype]
    access, pairs = access_layout(itemsize, vector, plan.interleaved)

    p = np.zeros((), dtype=PARAMS_DTYPE)
    p["num_tokens"] = plan.num_tokens
    p["token_ndim"] = len(shape)
    p["token_shape"][:len(shape)] = shape
    names = ["q_token_stride"] + (["k_token_stride", "q_out_token_stride", "k_out_token_stride"]
                                  if k is not None else ["q_out_token_stride"])
    for name, strides in zip(names, rotated_strides):
        p[name][:len(shape)] = strides
    p["positions_token_stride"][:len(shape)] = positions_strides
    p["q_head_stride"], p["q_out_head_stride"] = plan.q.strides[-2], q_out.strides[-2]
    p["q_dim_stride"], p["q_out_dim_stride"] = plan.q.strides[-1], q_out.strides[-1]
    if k is not None:
        p["k_head_stride"], p["k_out_head_stride"] = k.strides[-2], k_out.strides[-2]
        p["k_dim_stride"], p["k_out_dim_stride"] = k.strides[-1], k_out.strides[-1]
    p["num_q_heads"], p["num_k_heads"] = plan.num_q_heads, plan.num_k_heads
    p["head_dim"], p["rotary_dim"] = plan.head_dim, plan.rotary_dim
    p["copy_pass_through"] = copy_pass
    p["sin_sign"] = -1.0 if plan.inverse else 1.0
    p["attention_factor"] = plan.attention_factor
    if plan.positions is not None:
        p["positions_are_int64"] = plan.positions.dtype == "int64"
    if plan.mrope_mode:
        p["mrope_mode"] = plan.mrope_mode
        p["mrope_section"] = plan.mrope_sections
        p["positions_component_stride"] = plan.positions_component_stride

    table_dtype = "float32"
    cos_ptr = sin_ptr = 0
    sin_offset = None
    if plan.source == AngleSource.COMPUTED:
        p["inv_freq"] = inv_freq_ptr
    elif plan.rotary_dim == 0:
        pass  # no rotation (write_cache): no angle is read, tables or not
    else:
        table = plan.table
        table_dtype = table.dtype
        table_itemsize = ITEMSIZE[table_dtype]
        if plan.source == AngleSource.CACHE_TABLE:
            cos_ptr = table.ptr
            sin_offset = (plan.rotary_dim // 2) * table.strides[1] * table_itemsize
            sin_ptr = table.ptr + sin_offset
            row_strides = [table.strides[0]]
            p["table_row_stride"] = table.strides[0]
            p["max_position"] = table.shape[0]
        else:
            cos_ptr, sin_ptr = plan.cos.ptr, plan.sin.ptr
            row_strides = list(cos_strides) + list(sin_strides)
            p["cos_token_stride"][:len(shape)] = cos_strides
            p["sin_token_stride"][:len(shape)] = sin_strides
        p["cos_col_stride"], p["sin_col_stride"] = plan.cos_col_stride, plan.sin_col_stride
        p["table_vector_ok"] = _table_vector_ok(plan, pairs, cos_ptr, sin_ptr, row_strides)

    wide_index = needs_wide_index(plan, outputs)
    pointers = (plan.q.ptr, 0 if k is None else k.ptr, q_out.ptr, 0 if k is None else k_out.ptr,
                0 if plan.positions is None else plan.positions.ptr, cos_ptr, sin_ptr)
    if fusion is not None and LEAN_ALL_HEADS and fused_lean_all_heads_applies(
            plan, vector=vector, wide_index=wide_index, token_ndim=len(shape), pairs=pairs,
            table_vector_ok=bool(p["table_vector_ok"])):
        held = lean_all_heads_held(plan, memory_bandwidth)
        spec = KernelSpec(plan.q.dtype, table_dtype, vector, plan.interleaved, plan.source,
                          wide_index, lean=True, fused=True, norm=True,
                          cache=fusion.writes_cache, all_heads=True, held=held)
        block, grid = lean_all_heads_geometry(plan, pairs, num_regs(spec), multiprocessors,
                                              held=held)
        return LaunchSpec(spec, p, grid, block, 0, pointers, sin_offset, vector,
                          fusion_struct(plan, fusion, copy_pass))
    if fusion is not None:
        lean = fused_lean_applies(plan, vector=vector, wide_index=wide_index,
                                  token_ndim=len(shape), pairs=pairs,
                                  table_vector_ok=bool(p["table_vector_ok"])) and (
            _norm_weights_vector_ok(fusion))
        spec = KernelSpec(plan.q.dtype, table_dtype, vector, plan.interleaved, plan.source,
                          wide_index, lean, fused=True, norm=lean and fusion.norm,
                          cache=lean and fusion.writes_cache,
                          rows=fusion.row_scaled and not fusion.all_heads,
                          all_heads=fusion.all_heads,
                          mrope=lean and bool(plan.mrope_mode),
                          partial=lean and plan.rotary_dim < plan.head_dim)
        ring = not lean and fused_ring(plan, fusion, vector)
        fusion_params = fusion_struct(plan, fusion, copy_pass)
        if lean and fused_decode_applies(plan, pairs=pairs, angle_arithmetic=angle_arithmetic,
                                         memory_bandwidth=memory_bandwidth):
            block, grid = decode_geometry(plan, pairs, fused_v_heads(fusion))
            shared_bytes = (decode_shared_angle_bytes(plan, block)
                            if plan.source == AngleSource.COMPUTED else 0)
            return LaunchSpec(dataclasses.replace(spec, decode=True),
                              decode_struct(p, plan.source), grid, block, shared_bytes, pointers,
                              sin_offset, vector, fused_decode_struct(fusion_params))
        if lean and fused_staged_applies(plan, outputs, memory_bandwidth=memory_bandwidth,
                                         compute_capability=compute_capability):
            return _staged_launch(plan, dataclasses.replace(spec, staged=True), p, pairs,
                                  num_regs, multiprocessors, resident_blocks, pointers,
                                  sin_offset, vector, fusion_params)
        fusion_params["ring"] = ring
        extra_heads = plan.num_k_heads if fusion.writes_cache else 0
        if fusion.all_heads:
            block, grid = all_heads_geometry(plan, access, pairs, copy_pass, extra_heads,
                                             num_regs(spec), multiprocessors)
        else:
            block, grid = launch_geometry(plan, access, pairs, copy_pass, num_regs(spec),
                                          multiprocessors, extra_heads=extra_heads,
                                          power_of_two_lanes=fusion.norm or fusion.row_scaled,
                                          pass_lanes=(lean_pass_lanes(plan, pairs, copy_pass)
                                                      if lean else 0))
        if fusion.row_scaled:
            block, grid = fit_row_buffers(plan, fusion, block, grid)
        elif lean:
            waves = fused_lean_persistent_waves(spec, memory_bandwidth, plan.mrope_mode)
            if waves:
                grid = persistent_token_grid(grid, block, num_regs(spec), multiprocessors, waves)
        shared_bytes = 0 if lean else fused_shared_bytes(plan, fusion, ring, block)
        return LaunchSpec(spec, p, grid, block, shared_bytes, pointers, sin_offset, vector,
                          fusion_params)
    lean = lean_kernel_applies(plan, vector=vector, wide_index=wide_index, token_ndim=len(shape),
                               table_vector_ok=bool(p["table_vector_ok"]))
    spec = KernelSpec(plan.q.dtype, table_dtype, vector, plan.interleaved, plan.source,
                      wide_index, lean)
    if decode_kernel_applies(plan, lean=lean, copy_pass=copy_pass, pairs=pairs,
                             angle_arithmetic=angle_arithmetic):
        block, grid = decode_geometry(plan, pairs)
        shared_bytes = (decode_shared_angle_bytes(plan, block)
                        if plan.source == AngleSource.COMPUTED else 0)
        return LaunchSpec(dataclasses.replace(spec, decode=True), decode_struct(p, plan.source),
                          grid, block, shared_bytes, pointers, sin_offset, vector)
    if lean and plain_staged_applies(plan, outputs, lanes=(plan.rotary_dim // 2) // pairs,
                                     memory_bandwidth=memory_bandwidth,
                                     compute_capability=compute_capability):
        # The staged fused kernel with no fusion: its FusionParams all zero (stores of the input
        # dtype, no norm, no cache).
        return _staged_launch(plan, dataclasses.replace(spec, fused=True, staged=True), p, pairs,
                              num_regs, multiprocessors, resident_blocks, pointers, sin_offset,
                              vector, np.zeros((), dtype=FUSION_PARAMS_DTYPE))
    block, grid = launch_geometry(plan, access, pairs, copy_pass, num_regs(spec), multiprocessors,
                                  plain=True, memory_bandwidth=memory_bandwidth)
    shared_bytes = shared_angle_bytes(plan, spec, block)
    if shared_bytes > MAX_SHARED_ANGLE_BYTES:  # never at the usual head sizes; general kernel
        spec = dataclasses.replace(spec, lean=False)
        block, grid = launch_geometry(plan, access, pairs, copy_pass, num_regs(spec),
                                      multiprocessors, plain=True,
                                      memory_bandwidth=memory_bandwidth)
        shared_bytes = 0
    return LaunchSpec(spec, p, grid, block, shared_bytes, pointers, sin_offset, vector)


def _staged_launch(plan: RopePlan, staged: KernelSpec, p: np.ndarray, pairs: int,
                   num_regs: Callable[[KernelSpec], int], multiprocessors: int,
                   resident_blocks: Callable[..., int] | None, pointers: tuple, sin_offset,
                   vector: bool, fusion_params: np.ndarray) -> LaunchSpec:
    """The launch of the staged kernel ``staged``: its stages' shared memory, and a persistent
    grid of the blocks an SM holds (the driver's count where ``resident_blocks`` is given)."""
    shared_bytes = staged_shared_bytes(plan)
    resident = None
    if resident_blocks is not None:
        resident = functools.partial(resident_blocks, staged, shared_bytes=shared_bytes)
    block, grid = staged_geometry(plan, pairs, num_regs(staged), multiprocessors, shared_bytes,
                                  resident)
    return LaunchSpec(staged, p, grid, block, shared_bytes, pointers, sin_offset, vector,
                      fusion_params)


def rotate_on_gpu(plan: RopePlan, outputs: list[ArrayInfo]) -> LaunchRecipe:
    """Launch one kernel that rotates q (and k) of ``plan`` into ``outputs`` (the fused kernel for
    a fused plan); returns the recipe that repeats this launch for other arrays of the same
    layout."""
    device = plan.device
    if plan.fusion is not None:
        check_dense_heads(plan)  # what to pass instead, before what the device lacks
        check_fp8_support(plan)
    capturing = stream_is_capturing(plan.q.obj, device)
    inv_freq = None
    if plan.source == AngleSource.COMPUTED:
        inv_freq = device_constants.inv_freq(device, plan.inv_freq, capturing=capturing)

    def compiled(kernel_spec: KernelSpec):
        if capturing and not is_compiled(kernel_spec, device):
            raise RuntimeError(_needs_warmup(f"{kernel_spec.name_expression} is not compiled "
                                             "yet (compiling and loading it is not capturable)"))
        return get_kernel(kernel_spec, device)

    spec = plan_launch(plan, outputs, inv_freq_ptr=0 if inv_freq is None else inv_freq.data.ptr,
                       num_regs=lambda kernel_spec: compiled(kernel_spec).num_regs,
                       multiprocessors=_multiprocessors(device),
                       memory_bandwidth=_memory_bandwidth(device),
                       compute_capability=_compute_capability(device),
                       angle_arithmetic=(device_angle_arithmetic(device)
                                         if plan.source == AngleSource.COMPUTED else None),
                       resident_blocks=lambda kernel_spec, threads, shared_bytes: occupancy_blocks(
                           compiled(kernel_spec), device, threads, shared_bytes, plan.op_name))
    kernel = compiled(spec.kernel)
    if spec.shared_bytes > MAX_SHARED_ANGLE_BYTES:
        allow_shared_bytes(kernel, device, spec.shared_bytes, plan.op_name,
                           all_heads=getattr(spec.kernel, "all_heads", False))
    recipe = LaunchRecipe(kernel.ptr, device, spec.grid, spec.block, spec.params, spec.sin_offset,
                          spec.vector, inv_freq, spec.shared_bytes, spec.kernel,
                          fusion_params=spec.fusion_params,
                          dependent=dependent_launch_applies(plan, spec.kernel))
    recipe.launch(plan.q.obj, *spec.pointers)
    if plan.fusion is not None and plan.fusion.row_scaled:
        # Its scale arrays are no repeat-call operands: every such call takes the full path.
        return None
    return recipe


# Candidate heads per thread. More heads per thread reuse each thread's token offsets, position and
# cos/sin more; fewer make more, smaller work items: more loads in flight across threads, a
# better-filled last wave of blocks, and a shorter critical path for a decode step.
HEADS_PER_THREAD = (16, 8, 4, 2, 1)
# Relative throughput against the work one thread does per token, in pairs of 16-byte accesses
# (NeoX, full rotary: one pair per head; interleaved: half; partial rotary out of place: plus the
# copied dims). The best is ~4 (e.g. 4 heads of full NeoX, 2 heads of half-rotary NeoX that also
# copy the other half). measured: docs/perf_log.md#_throughput_by_work
_THROUGHPUT_BY_WORK = ((1, 0.75), (2, 0.93), (4, 1.0), (8, 0.96), (16, 0.85), (32, 0.75))


# The same curve for the re-rotation of an fp8 NeoX cache (16 pairs a 16-byte access, each
# converted from and back to e4m3): a thread's heads of one slot share its angles and scale, and
# eight heads a thread measured fastest from 16384 slots (H200, 8 heads of 128, % of a copy,
# table / computed, heads a thread 2 / 4 / 8: 16384 slots 60.8 / 64.5 / 68.3 and 49.4 / 54.4 /
# 63.7; 65536 slots 63.0 / 74.0 / 73.1 and 50.7 / 65.5 / 69.0; 4096 slots 64.6 / 56.5 / 41.0
# and 54.4 / 49.0 / 37.2, where the last wave's fill decides). measured: docs/perf_log.md
RERO_FP8_NEOX_THROUGHPUT_BY_WORK = ((1, 0.6), (2, 0.75), (4, 0.9), (8, 1.0), (16, 0.9),
                                    (32, 0.75))


def _throughput(work: float, points=_THROUGHPUT_BY_WORK) -> float:
    """Piecewise-linear in log2(work) through ``points`` (_THROUGHPUT_BY_WORK), flat beyond its
    ends."""
    if work <= points[0][0]:
        return points[0][1]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if work <= w1:
            f = (math.log2(work) - math.log2(w0)) / (math.log2(w1) - math.log2(w0))
            return t0 + f * (t1 - t0)
    return points[-1][1]
MAX_TOKENS_PER_BLOCK = 64
# Heads per thread of a plain in-place rope launch whose heads take a number of lanes that is not
# a power of two (launch_geometry's ``plain``), on lanes padded to a power of two. bf16 q
# [65536, 32, D] k [65536, 8, D] from a cache, % of an SM copy in place, wave model -> this: H100
# D = 80 76.2 -> 90.2, D = 96 83.2 -> 93.5; H200 70.5 -> 81.2, 79.6 -> 87.2. Out of place keeps
# the wave model (the cap cost the H200 2-4 points there). measured:
# docs/perf_log.md#uneven_lanes_max_heads
UNEVEN_LANES_MAX_HEADS = 2
# Those in-place launches also round a block's head lanes up to whole warps (lanes x head lanes a
# multiple of 32: 36 heads at 2 a thread take 20 head lanes of 8, not 18). Then every warp holds
# four whole heads of one round, and a round's head step is a multiple of four heads: whole
# 128-byte lines for 160-byte heads, where every slow in-place geometry measured started its
# second round mid-line. H200, in place, T = 65536, GQA 8 (q 32, k 4 heads): D = 80 69.3 -> 80.9
# %, D = 96 83.6 -> 86.4 (40 or 64 heads already fill whole warps). measured:
# docs/perf_log.md#uneven_lanes_whole_warps
UNEVEN_LANES_WHOLE_WARPS = True
# On FAST_MEMORY, from UNEVEN_LANES_FAST_MEMORY_MIN_TOKENS, in-place heads of uneven lanes take
# their lanes unpadded, full rotation only (the launches measured):
# - a token's heads fewer than UNEVEN_ODD_LANES_HEAD_LANES (tensor-parallel shards: q 8 / k 1):
#   every head a block row and whole tokens, ~UNEVEN_FEW_HEADS_THREADS threads a block. The padded
#   launch rounded their few head lanes up to whole warps and left most of its second round idle
#   (9 heads in rows of 8, 8 then 1). For 6 lanes (head_dim 96) only where a token's heads take at
#   most UNEVEN_EVEN_LANES_FEW_HEADS_MAX_LANES lanes: from 12 heads the padded launch measured
#   faster;
# - odd lanes (5: head_dim 80) with more heads: blocks of 5 x 32 (five whole warps, no idle lane,
#   a head step of whole 128-byte lines), the heads past 32 by the kernel's loop over head lanes.
# H200, T = 65536, two rounds, % of an SM copy in place, padded -> this: D = 80, q / k heads 4 / 1
# 56.5 -> 77.5, 8 / 1 59.8 -> 79.8, 8 / 2 63.4 -> 75.5, 8 / 4 74.5 -> 81.5, 16 / 2 69.9 -> 81.4,
# 16 / 4 76.7 -> 77.4, 16 / 8 79.7 -> 83.3, 32 / 4 80.0 -> 83.3, 32 / 32 (T = 32768) 82.7 ->
# 88.0; D = 96 4 / 1 61.2 -> 78.4, 8 / 1 65.0 -> 77.4 (8 / 4: 79.2 padded against 75.8, 16 / 8 85.1
# against 81.7). At 4096 tokens 5 x 32 measured 1.2 points under the padded launch. The H100
# keeps the launch measured there. measured: docs/perf_log.md#uneven_lanes_fast_memory
UNEVEN_LANES_FAST_MEMORY_MIN_TOKENS = 16384
UNEVEN_ODD_LANES_HEAD_LANES = 32
UNEVEN_FEW_HEADS_THREADS = 128
UNEVEN_EVEN_LANES_FEW_HEADS_MAX_LANES = 64


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: int) -> int:
    return cupy_module().cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


# cudaDeviceGetAttribute: the memory clock (kHz) and bus width (bits).
_ATTRIBUTE_MEMORY_CLOCK_KHZ, _ATTRIBUTE_MEMORY_BUS_BITS = 36, 37


@functools.lru_cache(maxsize=None)
def _memory_bandwidth(device: int) -> float:
    """The device's peak memory bandwidth in bytes per second (double data rate: two transfers
    a clock, as NVIDIA quotes it: H100 SXM 3.35e12, H200 4.8e12), or 0.0 where the driver does not
    report the clock (the launches then make the choices of slower memory)."""
    runtime = cupy_module().cuda.runtime
    try:
        khz = runtime.deviceGetAttribute(_ATTRIBUTE_MEMORY_CLOCK_KHZ, device)
        bits = runtime.deviceGetAttribute(_ATTRIBUTE_MEMORY_BUS_BITS, device)
    except runtime.CUDARuntimeError:  # an attribute this driver does not report
        return 0.0
    return 2.0 * khz * 1e3 * bits / 8


# Memory of at least this many bytes per second (the H200's 4.8 TB/s; an H100 SXM has 3.35) takes
# the launches measured faster there: four held heads on the lean all-heads kernel, the fused
# decode kernel past decode, persistent lean grids (each choice's measurements beside it).
FAST_MEMORY = 4.0e12


def _resident_blocks(threads: int, num_regs: int) -> int:
    """Blocks of ``threads`` that fit on one SM (Hopper/Ampere limits: 2048 threads, 64K
    registers allocated per warp in units of 256, 32 blocks)."""
    warps = -(-threads // 32)
    regs_per_warp = -(-num_regs * 32 // 256) * 256
    return max(1, min(32, 64 // warps, 65536 // (regs_per_warp * warps)))


def launch_geometry(plan: RopePlan, access: int, pairs: int, copy_pass: bool, num_regs: int,
                    multiprocessors: int | None = None, *, extra_heads: int = 0,
                    power_of_two_lanes: bool = False, plain: bool = False,
                    pass_lanes: int = 0, throughput_by_work=_THROUGHPUT_BY_WORK,
                    memory_bandwidth: float = 0.0):
    """(block, grid) for a plan.

    x: lanes over the chunks of pairs of a head (out of place, the same lanes then copy the
    pass-through chunks);
    y: head lanes, split over blockIdx.y when they do not fit one block (the fused kernel's v heads
    count: ``extra_heads``); z: tokens, ~256 threads a block. The heads per thread are chosen by a
    wave model: the square root of the fraction of the last wave of resident blocks that has work
    (a partial last wave runs faster, so the loss is less than the idle fraction), times the
    measured throughput of the work per thread that many heads make (_THROUGHPUT_BY_WORK).

    ``plain``: the rope kernels' launch (not the fused or re-rotation kernels'), where in place
    heads whose chunks are not a power-of-two number of lanes (head_dim 80, 96: 5, 6 lanes) take
    lanes rounded up to a power of two and at most UNEVEN_LANES_MAX_HEADS heads a thread, so that
    no warp holds part of a head whose other part another warp rewrites, in blocks of whole warps
    (on FAST_MEMORY with many tokens: unpadded, see ``memory_bandwidth``).

    ``pass_lanes``: the lean fused kernel's lanes of the dims past rotary_dim, after the
    rotated chunks' (:func:`lean_pass_lanes`); the other kernels spread those dims over the
    rotated chunks' lanes.

    ``throughput_by_work``: the curve of the kernel's throughput against a thread's work
    (_THROUGHPUT_BY_WORK; the fp8 NeoX re-rotation has its own).

    ``memory_bandwidth``: the device's, bytes per second (0: unknown); on FAST_MEMORY plain
    in-place launches of uneven lanes and many tokens take their lanes unpadded (the rules beside
    UNEVEN_LANES_FAST_MEMORY_MIN_TOKENS).
    """
    chunks = (plan.rotary_dim // 2) // pairs
    pass_chunks = (plan.head_dim - plan.rotary_dim) // access if copy_pass else 0
    if pass_lanes:
        chunks, pass_chunks = chunks + pass_lanes, 0
    # Without rotation (rotary_dim 0: write_cache) the lanes split the copied chunks instead.
    lanes = max(1, min(chunks or pass_chunks, 32))
    num_heads = max(1, plan.num_q_heads + plan.num_k_heads + extra_heads)
    uneven_in_place = plain and plan.inplace and lanes & (lanes - 1)
    if (uneven_in_place and plan.rotary_dim == plan.head_dim and memory_bandwidth >= FAST_MEMORY
            and plan.num_tokens >= UNEVEN_LANES_FAST_MEMORY_MIN_TOKENS):
        if (num_heads < UNEVEN_ODD_LANES_HEAD_LANES and lanes * num_heads <= THREADS_PER_BLOCK
                and (lanes % 2 or lanes * num_heads <= UNEVEN_EVEN_LANES_FEW_HEADS_MAX_LANES)):
            tokens = max(1, UNEVEN_FEW_HEADS_THREADS // (lanes * num_heads))
            return ((lanes, num_heads, tokens), (min(-(-plan.num_tokens // tokens), MAX_GRID_X), 1))
        if (lanes % 2 and num_heads >= UNEVEN_ODD_LANES_HEAD_LANES
                and lanes * UNEVEN_ODD_LANES_HEAD_LANES <= THREADS_PER_BLOCK):
            return ((lanes, UNEVEN_ODD_LANES_HEAD_LANES, 1), (min(plan.num_tokens, MAX_GRID_X), 1))
    candidates = HEADS_PER_THREAD
    whole_warps = False
    if uneven_in_place:
        candidates = tuple(h for h in HEADS_PER_THREAD if h <= UNEVEN_LANES_MAX_HEADS)
        power_of_two_lanes = True
        whole_warps = UNEVEN_LANES_WHOLE_WARPS
    if power_of_two_lanes:  # RMSNorm sums a head over its lanes with warp shuffles (fused.cuh)
        lanes = 1 << (lanes - 1).bit_length()
    # 16-byte accesses per head and thread: both halves (NeoX) or one (interleaved), plus a share
    # of the copied dims (a copy is a load and a store, like a rotated access).
    accesses_per_head = (1 if plan.interleaved else 2) * -(-chunks // lanes) + pass_chunks / lanes
    if multiprocessors is None:
        multiprocessors = _multiprocessors(plan.device)
    best = None
    for heads_per_thread in candidates:
        throughput = _throughput(heads_per_thread * accesses_per_head / 2, throughput_by_work)
        head_lanes = -(-num_heads // heads_per_thread)
        grid_y = -(-head_lanes // max(1, THREADS_PER_BLOCK // lanes))
        block_y = -(-head_lanes // grid_y)  # 40 head lanes over 2 blocks: 20 + 20, not 32 + 8
        if whole_warps:
            block_y = -(-block_y * lanes // 32) * 32 // lanes
        tokens = max(1, min(MAX_TOKENS_PER_BLOCK, THREADS_PER_BLOCK // (lanes * block_y)))
        grid_x = -(-plan.num_tokens // tokens)
        threads = lanes * block_y * tokens
        slots_per_sm = _resident_blocks(threads, num_regs)
        waves = grid_x * grid_y / (slots_per_sm * multiprocessors)
        score = (waves / -(-waves // 1)) ** 0.5 * throughput
        if heads_per_thread == 1 and waves <= 0.5:
            score = float("inf")  # a decode step: latency, not bandwidth, decides
        if best is None or score > best[0]:
            # The kernels loop over tokens by gridDim.x and over head lanes by gridDim.y, so a grid
            # capped at CUDA's limits still covers every token and head.
            best = (score, (lanes, block_y, tokens), (min(grid_x, MAX_GRID_X), min(grid_y, MAX_GRID_Y)))
    return best[1], best[2]


# ------------------------------------------------------------------------------------------------
# The fused kernel (kernels_cu/fused.cuh): what it adds to a rope launch.


# The fused kernel's ring of head chunks in flight per thread (kRingDepth x kRingSlotBytes in
# kernels_cu/fused.cuh), and the launches that use it: RMSNorm or a cache write on 16-byte accesses
# with many tokens, which it speeds up; fp8 outputs alone and small launches it slows.
# measured: docs/perf_log.md#fused_ring_min_tokens
FUSED_RING_BYTES_PER_THREAD = 4 * 32
FUSED_RING_MIN_TOKENS = 4096


def fused_lean_applies(plan: RopePlan, *, vector: bool, wide_index: bool, token_ndim: int,
                       pairs: int, table_vector_ok: bool) -> bool:
    """Whether the lean fused kernel (kernels_cu/fused_lean.cuh) runs this fused launch: the lean
    layout of the rope kernels (M-RoPE included), one chunk of pairs per lane (at most 32 a head)
    and norm weights that take 16-byte loads. A partial rotation (rotary_dim < head_dim, no
    M-RoPE) runs there too when the rotated and the other dims come in whole lanes of 2 *
    ``pairs`` elements, for NeoX pairs in blocks of rotary_dim (head_dim a multiple of it:
    Qwen3-Next's 64 of 256, GLM's 64 of 128): lanes past the rotated chunks hold the other dims
    (:func:`lean_pass_lanes`). Everything else runs the general fused kernel."""
    lanes = 2 * pairs
    partial_ok = (not plan.mrope_mode and plan.rotary_dim > 0 and plan.rotary_dim % lanes == 0
                  and (plan.head_dim - plan.rotary_dim) % lanes == 0
                  and (plan.interleaved or plan.head_dim % plan.rotary_dim == 0))
    return (lean_kernel_applies(plan, vector=vector, wide_index=wide_index, token_ndim=token_ndim,
                                table_vector_ok=table_vector_ok, mrope_ok=True)
            and (plan.rotary_dim == plan.head_dim or partial_ok)
            and plan.head_dim // lanes <= 32 and plan.head_dim % 4 == 0
            # rows, and the norm over all heads: the general kernel
            and not (plan.fusion is not None
                     and (plan.fusion.row_scaled or plan.fusion.all_heads)))


# The lean all-heads kernel (kernels_cu/fused_lean.cuh) takes the launches that
# fused_lean_all_heads_applies admits (False: the general fused kernel's all-heads variant takes
# them, as before it; the tests run both). H100, bf16 q [T, 32, 128], k [T, 8, 128], µs general
# -> lean: rms_norm_rope T = 1 6.75 -> 2.9, 512 14.5 -> 6.6, 65536 799 -> 514 (56 -> 89 % of an
# SM copy; torch.compile 716).
# docs/perf_log.md#the-lean-all-heads-kernel-on-a-gpu-h100-2026-11-28
LEAN_ALL_HEADS = True


def fused_lean_all_heads_applies(plan: RopePlan, *, vector: bool, wide_index: bool,
                                 token_ndim: int, pairs: int, table_vector_ok: bool) -> bool:
    """Whether the lean all-heads kernel (kernels_cu/fused_lean.cuh:
    rope_fused_lean_all_heads_kernel) runs a launch with the norm over all heads: the lean layout
    without M-RoPE, every dim rotated, at most 32 lanes a head, stores quantised per tensor (per
    row: the general kernel gathers rows) and norm weights that take 16-byte loads (unit stride,
    16-byte aligned: each head's run then is too, being a whole number of lanes' chunks in)."""
    fusion = plan.fusion
    return (fusion.all_heads and not fusion.row_scaled
            and lean_kernel_applies(plan, vector=vector, wide_index=wide_index,
                                    token_ndim=token_ndim, table_vector_ok=table_vector_ok)
            and 0 < plan.rotary_dim == plan.head_dim
            and (plan.rotary_dim // 2) // pairs <= 32
            and _norm_weights_vector_ok(fusion))


# The heads a thread row of the lean all-heads kernel holds in registers through the token's sums
# (kernels_cu/fused_lean.cuh: HELD): two NeoX chunks or four interleaved ones, 16 registers either
# way. Holding one (a row a head, the heads past the block's rows read one after another) left
# 32 + 8 heads at 65 % of an SM copy on an H100.
LEAN_ALL_HEADS_HELD = {False: 2, True: 4}  # by plan.interleaved

# Four NeoX heads a row (32 registers of q and k, twice the bytes in flight) where the memory is
# this fast (bytes per second, from the device's memory clock and bus width) and the launch has
# this many tokens. bf16 32 + 8 heads of 128, two -> four held: H200 (4.8 TB/s) rms_norm_rope
# 79.5 / 83.6 -> 85.4 / 89.1 % of an SM copy at T = 16384 / 65536, with the cache write 72.4 /
# 74.0 -> 77.1 / 78.1, T = 4096 71.5 -> 72.8 and 66.5 -> 70.1; H100 (3.35 TB/s) 93.2 -> 83.1 at
# T = 16384; decode 0.5-1.3 µs slower on both (docs/perf_log.md).
LEAN_ALL_HEADS_FAST_MEMORY_MIN_TOKENS = 4096


def lean_all_heads_held(plan: RopePlan, memory_bandwidth: float) -> int:
    """The heads a thread row of the lean all-heads kernel holds for ``plan`` on a device of
    ``memory_bandwidth`` bytes per second (0: unknown, the narrower choice)."""
    if (not plan.interleaved and memory_bandwidth >= FAST_MEMORY
            and plan.num_tokens >= LEAN_ALL_HEADS_FAST_MEMORY_MIN_TOKENS):
        return 4
    return LEAN_ALL_HEADS_HELD[plan.interleaved]


# Past this many waves of resident blocks the lean all-heads kernel's grid is persistent: each
# block then prefetches its next token into L2 while the loads of this one are in flight. Below,
# one token a block: at T = 512 a persistent grid of 396 blocks (two tokens for some) made
# 32 + 8 heads 6.6 -> 8.7 µs on an H100.
LEAN_ALL_HEADS_PERSISTENT_WAVES = 4


def lean_all_heads_geometry(plan: RopePlan, pairs: int, num_regs: int, multiprocessors: int,
                            held: int | None = None):
    """(block, grid) of the lean all-heads kernel: x the lanes of a head (a power of two), y the
    rows that hold every q and k head, ``held`` a row (default LEAN_ALL_HEADS_HELD's), where they
    fit a block (whole warps; rows past the heads only take part in the sums, heads past the rows'
    held ones are read again by the rows they fall to). One token a block up to LEAN_ALL_HEADS_PERSISTENT_WAVES
    waves of resident blocks; past that a persistent grid with the tokens spread evenly (every
    block the same number, give or take one)."""
    chunks = (plan.rotary_dim // 2) // pairs
    lanes = 1 << (chunks - 1).bit_length()
    warp_rows = max(1, 32 // lanes)
    held = LEAN_ALL_HEADS_HELD[plan.interleaved] if held is None else held
    heads = plan.num_q_heads + plan.num_k_heads
    rows = min(-(-heads // held), THREADS_PER_BLOCK // lanes)
    rows = -(-rows // warp_rows) * warp_rows
    block = (lanes, rows, 1)
    grid_x, _ = persistent_token_grid((plan.num_tokens, 1), block, num_regs, multiprocessors,
                                      LEAN_ALL_HEADS_PERSISTENT_WAVES)
    return block, (min(grid_x, MAX_GRID_X), 1)


# Waves of resident blocks past which the lean per-head fused kernel with the norm and the cache
# write runs on a persistent grid (one wave: each block loops over ~T / wave tokens). bf16 q
# [T, 32, 128], k and v [T, 8, 128], % of an SM copy at T = 4096 / 16384 / 65536, one token pair a
# block -> persistent: H200 78.1 / 82.2 / 84.2 -> 83.1 / 86.9 / 89.9, H100 89.3 / 93.8 / 95.5 ->
# 91.4 / 94.8 / 93.0. The other lean fused kernels keep one block per token pair: persistent,
# rms_norm_rope alone lost 9 points at T = 16384 on the H100 (gains 0.3-1.5 on the H200: below),
# the cache write alone and fp8 outputs lost 1-10 on both (docs/perf_log.md).
FUSED_LEAN_PERSISTENT_WAVES = 1
# On FAST_MEMORY the norm alone and sectioned M-RoPE (Qwen2-VL's, either op) take the persistent
# grid too (the H200: the norm 0.3-1.5 points of an SM copy more at T = 1024-65536, sectioned
# M-RoPE 3.4-5.1 at T = 16384 and 65536; the H100 lost 9 with the norm at T = 16384).
# Interleaved M-RoPE lost 2.8 points at T = 65536 and partial rotations (+3 at 16384, -0.2 / -2.8
# at 65536) stay on a block per token group. measured: docs/perf_log.md#fast_memory


def fused_lean_persistent_waves(spec: KernelSpec, memory_bandwidth: float,
                                mrope_mode: int = MROPE_NONE) -> int | None:
    """The waves of resident blocks past which the lean per-head fused kernel ``spec`` runs on a
    persistent grid on a device of ``memory_bandwidth`` bytes per second (0: unknown), or None
    for one block per token group. ``mrope_mode``: the plan's M-RoPE (sectioned M-RoPE takes
    the persistent grid on fast memory, interleaved keeps a block per token group); partial
    rotations keep one block per token group."""
    fast = memory_bandwidth >= FAST_MEMORY
    if spec.mrope:
        return FUSED_LEAN_PERSISTENT_WAVES if fast and mrope_mode == MROPE_SECTIONED else None
    if spec.partial:
        return None
    if spec.norm and (spec.cache or fast):
        return FUSED_LEAN_PERSISTENT_WAVES
    return None


def persistent_token_grid(grid: tuple[int, int], block: tuple[int, int, int], num_regs: int,
                          multiprocessors: int, waves: int) -> tuple[int, int]:
    """``grid`` with its x (blocks of ``block[2]`` tokens) cut to a persistent grid when it
    passes ``waves`` waves of resident blocks: ceil(n / ceil(n / wave)) blocks, every block the
    same number of tokens give or take one (kernels loop over tokens by gridDim.x)."""
    grid_x, grid_y = grid
    wave = max(1, _resident_blocks(block[0] * block[1] * block[2], num_regs) * multiprocessors
               // grid_y)
    if grid_x > waves * wave:
        grid_x = -(-grid_x // -(-grid_x // wave))
    return grid_x, grid_y


def lean_pass_lanes(plan: RopePlan, pairs: int, copy_pass: bool) -> int:
    """The lanes of a lean fused launch that hold the dims past rotary_dim (2 * ``pairs`` each),
    when the launch reads and writes them (``copy_pass``); 0 for a full rotation."""
    return (plan.head_dim - plan.rotary_dim) // (2 * pairs) if copy_pass else 0


# The fused decode kernel (kernels_cu/fused_decode.cuh: one thread per token, head and chunk,
# compact parameters) runs the lean fused kernel's launches (M-RoPE aside) of at most this many
# tokens, with the norm at most FUSED_DECODE_MAX_NORM_TOKENS. H200, bf16 q [T, 32, 128], k and v
# [T, 8, 128], graph of 20 calls, µs, lean -> decode: rope_and_cache T = 1 2.19 -> 1.31, 512 6.16
# -> 4.68, 2048 17.16 -> 15.33; fp8 out 2048 11.92 -> 10.71; rms_norm_rope T = 1 2.03 -> 1.57,
# 128 2.84 -> 2.24, 512 5.79 -> 5.93, 2048 14.01 -> 14.84; norm + rope + cache 128 3.42 -> 2.53,
# 512 6.44 -> 6.33, 2048 18.62 -> 19.45. measured: docs/perf_log.md#fused_decode_max_tokens
FUSED_DECODE_MAX_TOKENS = 2048
FUSED_DECODE_MAX_NORM_TOKENS = 256
# On FAST_MEMORY (the H200) the fused decode kernel's many small work items keep more bytes in
# flight than the lean kernel's loop over a thread's heads, past the few tokens of a serving step
# too. From a table it runs launches
# with the cache write up to FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS (past them the lean kernel
# is faster), those with neither the norm nor the cache write at any T (6-9 points of an SM copy
# more at T = 4096) and those with the norm up to FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS (from
# 3072 each head's reduction, exposed, makes it slower). Slower memory (the H100) and computed
# angles keep FUSED_DECODE_MAX_TOKENS and FUSED_DECODE_MAX_NORM_TOKENS.
# measured: docs/perf_log.md#fast_memory
FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS = 16384
FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS = 2048


def fused_decode_max_tokens(plan: RopePlan, memory_bandwidth: float) -> float:
    """The most tokens of a launch of ``plan`` that the fused decode kernel runs on a device of
    ``memory_bandwidth`` bytes per second (0: unknown, the few tokens of a serving step)."""
    fast = memory_bandwidth >= FAST_MEMORY and plan.source != AngleSource.COMPUTED
    if plan.fusion.norm:
        return FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS if fast else FUSED_DECODE_MAX_NORM_TOKENS
    if fast:
        return FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS if plan.fusion.writes_cache else math.inf
    return FUSED_DECODE_MAX_TOKENS


def fused_decode_applies(plan: RopePlan, *, pairs: int, angle_arithmetic: str | None,
                         memory_bandwidth: float = 0.0) -> bool:
    """Whether the fused decode kernel runs a launch that the lean fused kernel would: few tokens
    (``fused_decode_max_tokens``: more on fast memory), no M-RoPE, the chunks of a head a power
    of two (the norm sums over them with shuffles), and with computed angles where they pay on a
    decode kernel (``computed_decode_pays``) and its warps' angles fit the shared memory a launch
    may use without opting in. Norm weights must have q's dtype (the kernel reads them as that
    type; the lean fused kernel takes any)."""
    chunks = (plan.rotary_dim // 2) // pairs
    most = fused_decode_max_tokens(plan, memory_bandwidth)
    if plan.mrope_mode or plan.num_tokens > most or chunks & (chunks - 1) or chunks > 32:
        return False
    if plan.rotary_dim != plan.head_dim:  # a partial rotation: the lean fused kernel
        return False
    if plan.fusion.norm and plan.fusion.q_weight.dtype != plan.q.dtype:
        return False
    if plan.source == AngleSource.COMPUTED:
        if not computed_decode_pays(plan, angle_arithmetic):
            return False
        block, _ = decode_geometry(plan, pairs, fused_v_heads(plan.fusion))
        return (block[0] * block[1] <= THREADS_PER_BLOCK
                and decode_shared_angle_bytes(plan, block) <= MAX_SHARED_ANGLE_BYTES)
    return True


def fused_v_heads(fusion) -> int:
    """The v heads a fused launch copies into the v cache (one thread row each on the decode
    kernel; none without a fusion)."""
    return fusion.v.shape[1] if fusion is not None and fusion.writes_cache else 0


# The staged fused kernel (kernels_cu/fused_staged.cuh): the norm's launches past the fused decode
# kernel on Hopper GPUs of fast memory, each block's token rows moved by bulk copies through
# STAGED_STAGES shared-memory stages (kStagedStages) by a producer warp, the heads normalised and
# rotated there by up to STAGED_MAX_THREADS - 32 consumer threads (kStagedMaxThreads). H200,
# bf16 q [T, 32, 128], k and v [T, 8, 128], % of an SM copy, lean -> staged, two rounds each:
# norm + rope + cache T = 4096 / 8192 / 16384 / 65536 82.5-82.9 / 84.8-84.9 / 86.8 / 88.9-89.2 ->
# 86.6-86.8 / 85.0-85.6 / 87.9-88.5 / 88.6-88.8; rms_norm_rope T = 4096 / 8192 83.9-84.0 /
# 86.7-86.9 -> 85.6-85.8 / 85.8-86.3; between the two ends, norm + rope + cache T = 16384 /
# 32768 / 65536 86.7-86.9 / 87.6-87.7 / 89.2-89.4 -> 87.3 / 88.0-88.1 / 88.2-88.3. So the cache
# write with the norm takes it up to STAGED_CACHE_MAX_TOKENS, the norm alone up to
# STAGED_NORM_MAX_TOKENS. The H100 (slower memory) keeps the lean kernel: unmeasured there.
# measured: docs/perf_log.md#the-staged-fused-kernel-h200-2026-11-29-fifth
STAGED_STAGES = 4
STAGED_MAX_THREADS = 192
STAGED_NORM_MAX_TOKENS = 4096
STAGED_CACHE_MAX_TOKENS = 32768
# M-RoPE and the partial rotation (the norm, the cache write or both) take it from
# STAGED_LAYOUT_MIN_TOKENS, with no upper bound but for sectioned M-RoPE's cache write without the
# norm (up to STAGED_CACHE_MAX_TOKENS): the lean kernel's M-RoPE and partial layouts keep one
# block fewer an SM, and interleaved M-RoPE looks up each pair's row. H200, the serving layouts
# (bench --serving: Qwen2-VL sectioned, Qwen3-VL interleaved, rotary_dim D / 4 and D / 2), % of
# an SM copy lean -> staged: rms_norm_rope T = 512 (CUDA graph) 74.7 / 56.6 / 80.8 / 80.7 ->
# 67.3 / 64.7 / 70.4 / 71.5, T = 1024 87.3 / 72.6 / 83.9 / 79.5 -> 87.0 / 84.4 / 86.8 / 89.5,
# T = 4096 75.1 / 60.1 / 70.3 / 76.6 -> 82.3 / 80.5 / 81.1 / 81.8, T = 65536 83.6-83.8 / 66.4 /
# 79.1 / 84.8-85.1 -> 88.1-88.3 / 85.0 / 87.3 / 87.1-87.7; rope_and_cache T = 4096 82.5 / 68.8 /
# 73.9 / 76.6 -> 85.7 / 84.8 / 87.3 / 87.0, T = 32768 (sectioned) 86.4 -> 87.5, T = 65536 87.2-87.4
# / 73.4 / 83.3 / 86.0-86.4 -> 85.6-86.1 / 84.9 / 88.3 / 87.0-87.4.
# measured: docs/perf_log.md#m-rope-and-partial-rotations-on-the-staged-kernel-h200-2026-11-29-seventh
STAGED_LAYOUT_MIN_TOKENS = 1024
# apply_rope's launches the staged kernel takes (plain_staged_applies): in place, heads of 5 or 6
# lanes (bf16 / fp16 NeoX heads of 80 or 96), at least PLAIN_STAGED_MIN_HEADS of q and k a token,
# from PLAIN_STAGED_MIN_TOKENS tokens. In place, the lean launches of those heads rewrite lines
# that other warps still read (ncu, same geometry in place / out of place: 274.8 / 210.5 us,
# drain stalls 288 / 9 cycles a warp); whole rows through shared memory write whole lines. H200,
# bf16, fp32 table, % of an SM copy in place, lean -> staged: D = 80, q / k 32 / 4 T = 4096 /
# 16384 / 65536 80.1 / 83.1 / 84.0 -> 85.8 / 89.5 / 88.1-88.6, 32 / 8 T = 16384 / 65536 82.4 /
# 83.4 -> 88.2 / 89.1, 32 / 32 (T = 32768) 87.5 -> 89.7, 16 / 4 78.5 -> 83.4; D = 96 32 / 4
# T = 16384 / 65536 85.6 / 86.3 -> 89.0 / 88.2, 32 / 32 88.6 -> 90.4. Fewer heads lose (16 / 2
# 81.7 -> 79.6, tensor-parallel shards of 5-10 heads 5-22 points), and out of place the lean
# launches stay ahead from 16384 tokens (91.4 -> 85.6 at D = 80, 32 / 4).
# measured: docs/perf_log.md#apply_rope-in-place-on-the-staged-kernel-h200-2026-11-29-seventh
PLAIN_STAGED_LANES = frozenset({5, 6})
PLAIN_STAGED_MIN_HEADS = 20
PLAIN_STAGED_IN_PLACE_ONLY = True
PLAIN_STAGED_MIN_TOKENS = 4096
# A stage of at most this many bytes (the reference shape's: 12.8 KB), so that the stages of at
# least two blocks fit an SM's shared memory.
STAGED_MAX_STAGE_BYTES = 24 * 1024
HOPPER_SM_SHARED_BYTES = 228 * 1024  # an SM's shared memory on sm_90 ...
BLOCK_SHARED_RESERVED_BYTES = 1024  # ... of which the driver keeps this much a resident block


def staged_stage_bytes(plan: RopePlan) -> int:
    """Bytes of one stage of the staged kernel (kernels_cu/fused_staged.cuh: StageLayout): a
    token's q, k and (cache write) v heads, its cos and sin rows (interleaved M-RoPE: those of its
    three position components), rounded up to whole 128-byte lines."""
    fusion = plan.fusion
    heads = plan.num_q_heads + plan.num_k_heads + fused_v_heads(fusion)
    rows = 3 if plan.mrope_mode == MROPE_INTERLEAVED else 1
    angles = rows * 2 * (plan.rotary_dim // 2) * ITEMSIZE[plan.table.dtype]
    return -(-(heads * plan.head_dim * ITEMSIZE[plan.q.dtype] + angles) // 128) * 128


def staged_shared_bytes(plan: RopePlan) -> int:
    """Dynamic shared memory of a staged launch: the stages and their two barriers each."""
    return STAGED_STAGES * staged_stage_bytes(plan) + STAGED_STAGES * 2 * 8


def fused_staged_applies(plan: RopePlan, outputs: list[ArrayInfo], *, memory_bandwidth: float,
                         compute_capability: int) -> bool:
    """Whether the staged fused kernel runs a launch that the lean fused kernel would (and the
    fused decode kernel does not): a Hopper GPU (``compute_capability`` 90-99: bulk copies and
    the shared memory the stages take) of fast memory; the norm of full rotations without M-RoPE
    (with the cache write up to STAGED_CACHE_MAX_TOKENS, alone up to STAGED_NORM_MAX_TOKENS), or
    M-RoPE or a partial rotation with the norm, the cache write or both from
    STAGED_LAYOUT_MIN_TOKENS (sectioned M-RoPE's cache write without the norm up to
    STAGED_CACHE_MAX_TOKENS); 16-bit q / k, a cos_sin_cache, stores of the input dtype, weights
    of q's dtype, and every row a bulk copy moves contiguous and a whole number of 16-byte units
    (the lean layout's 16-byte alignment gives their starts; sectioned M-RoPE's runs of pairs
    too, each copied from its component's row)."""
    fusion = plan.fusion
    if not (90 <= compute_capability < 100 and memory_bandwidth >= FAST_MEMORY):
        return False
    if plan.k is None or (fusion.norm and (fusion.q_weight is None or fusion.k_weight is None)):
        return False
    layout = bool(plan.mrope_mode) or plan.rotary_dim < plan.head_dim
    if layout:
        if not (fusion.norm or fusion.writes_cache) or plan.num_tokens < STAGED_LAYOUT_MIN_TOKENS:
            return False
        if (plan.mrope_mode == MROPE_SECTIONED and not fusion.norm
                and plan.num_tokens > STAGED_CACHE_MAX_TOKENS):
            return False
    elif not fusion.norm or plan.num_tokens > (
            STAGED_CACHE_MAX_TOKENS if fusion.writes_cache else STAGED_NORM_MAX_TOKENS):
        return False
    if (plan.q.dtype not in ("float16", "bfloat16") or plan.source != AngleSource.CACHE_TABLE
            or plan.rotary_dim == 0 or fusion.all_heads or fusion.row_scaled):
        return False
    if (STORE_FORMATS.get(fusion.out_dtype, StoreFormat.INPUT) != StoreFormat.INPUT
            or STORE_FORMATS.get(fusion.cache_dtype, StoreFormat.INPUT) != StoreFormat.INPUT):
        return False
    if fusion.norm and (fusion.q_weight.dtype != plan.q.dtype
                        or fusion.k_weight.dtype != plan.q.dtype):
        return False
    if not _staged_rows_ok(plan, outputs):
        return False
    if plan.mrope_mode == MROPE_SECTIONED and any(
            (pairs * ITEMSIZE[plan.table.dtype]) % 16 for pairs in _mrope_runs(plan)):
        return False
    return staged_stage_bytes(plan) <= STAGED_MAX_STAGE_BYTES


def _staged_rows_ok(plan: RopePlan, outputs: list[ArrayInfo]) -> bool:
    """Whether a staged launch's bulk copies can move its rows: a token's heads one contiguous
    row in q, k, their outputs and (cache write) v, and table rows of whole 16-byte units (the
    lean layout's table_vector_ok asks only for the alignment of a lane's pairs: 8 bytes for
    GPT-J pairs of a 16-bit table)."""
    fusion = plan.fusion
    d = plan.head_dim
    rows = [plan.q, plan.k, *outputs[:2]] + ([fusion.v] if fused_v_heads(fusion) else [])
    if any(info.strides[-2] != d for info in rows):
        return False
    table = plan.table
    table_itemsize = ITEMSIZE[table.dtype]
    return not (plan.cos_col_stride != 1 or plan.sin_col_stride != 1 or table.ptr % 16
                or (table.strides[0] * table_itemsize) % 16
                or ((plan.rotary_dim // 2) * table_itemsize) % 16)


def plain_staged_applies(plan: RopePlan, outputs: list[ArrayInfo], *, lanes: int,
                         memory_bandwidth: float, compute_capability: int) -> bool:
    """Whether ``apply_rope`` (no fusion) of a lean launch runs the staged kernel instead
    (NORM and CACHE off: rows in, rotated in shared memory, rows out): a Hopper GPU of fast
    memory, at least PLAIN_STAGED_MIN_TOKENS tokens, q and k of 16 bits from a cos_sin_cache,
    full rotation, heads of ``lanes`` chunks (a thread row a head) in PLAIN_STAGED_LANES, at least
    PLAIN_STAGED_MIN_HEADS of them a token, in place where PLAIN_STAGED_IN_PLACE_ONLY, and every
    row a bulk copy moves contiguous and a whole number of 16-byte units."""
    if not (90 <= compute_capability < 100 and memory_bandwidth >= FAST_MEMORY):
        return False
    if (plan.k is None or plan.num_tokens < PLAIN_STAGED_MIN_TOKENS
            or lanes not in PLAIN_STAGED_LANES or (PLAIN_STAGED_IN_PLACE_ONLY and not plan.inplace)
            or plan.num_q_heads + plan.num_k_heads < PLAIN_STAGED_MIN_HEADS
            or plan.q.dtype not in ("float16", "bfloat16")
            or plan.source != AngleSource.CACHE_TABLE or plan.mrope_mode
            or plan.rotary_dim != plan.head_dim):
        return False
    return _staged_rows_ok(plan, outputs) and staged_stage_bytes(plan) <= STAGED_MAX_STAGE_BYTES


def _mrope_runs(plan: RopePlan) -> tuple[int, int, int]:
    """Sectioned M-RoPE's runs of pairs by component, as mrope_component assigns them (the third
    takes the pairs the first two leave)."""
    s0, s1 = plan.mrope_sections[0], plan.mrope_sections[1]
    return s0, s1, plan.rotary_dim // 2 - s0 - s1


def staged_geometry(plan: RopePlan, pairs: int, num_regs: int, multiprocessors: int,
                    shared_bytes: int, resident_blocks: Callable[[int], int] | None = None
                    ) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """(block, grid) of a staged launch: lanes a head (a power of two, for the norm's shuffles),
    thread rows for the rotated heads up to STAGED_MAX_THREADS - 32 threads (whole warps), then
    the producer warp's rows; a persistent grid of the blocks an SM holds, at most one a token:
    ``resident_blocks(threads)``, the driver's count (:func:`occupancy_blocks`), or without it
    what registers and the stages' shared memory leave by the SM's limits (a count the driver
    can undercut: the staged MLA kernel's, cupyrope/cuda/mla_launch.py). A partial rotation's
    norm takes lanes for every dim (fused_staged.cuh: head_lanes)."""
    partial_norm = (plan.rotary_dim < plan.head_dim and plan.fusion is not None
                    and plan.fusion.norm)
    chunks = (plan.head_dim if partial_norm else plan.rotary_dim) // 2 // pairs
    lanes = 1 << (chunks - 1).bit_length()
    group = 32 // lanes  # thread rows a warp
    heads = plan.num_q_heads + plan.num_k_heads
    most = (STAGED_MAX_THREADS - 32) // lanes // group * group
    rows = min(-(-heads // group) * group, most)
    block = (lanes, rows + group, 1)
    threads = lanes * (rows + group)
    if resident_blocks is not None:
        resident = max(1, resident_blocks(threads))
    else:
        by_shared = HOPPER_SM_SHARED_BYTES // (shared_bytes + BLOCK_SHARED_RESERVED_BYTES)
        resident = max(1, min(_resident_blocks(threads, num_regs), by_shared))
    return block, (min(plan.num_tokens, resident * multiprocessors), 1)


def fused_decode_struct(f: np.ndarray) -> np.ndarray:
    """The fused decode kernel's FusedDecodeParams from a launch's FusionParams (every field of the
    one is a field of the other; the int32 ones fit, as the lean kernels' offsets do)."""
    d = np.zeros((), dtype=FUSED_DECODE_PARAMS_DTYPE)
    for name in FUSED_DECODE_PARAMS_DTYPE.names:
        d[name] = f[name]
    return d


def _norm_weights_vector_ok(fusion) -> bool:
    """The lean fused kernels read each lane's norm weights with 16-byte loads (the general one
    copies them to shared memory element by element): unit stride (the last dim's, for weights
    of every head), 16-byte aligned."""
    return all(w is None or (w.ptr % 16 == 0 and w.strides[-1] == 1)
               for w in (fusion.q_weight, fusion.k_weight))


def fused_ring(plan: RopePlan, fusion, vector: bool) -> bool:
    return (vector and (fusion.norm or fusion.writes_cache) and plan.rotary_dim > 0
            and plan.num_tokens >= FUSED_RING_MIN_TOKENS
            and not fusion.row_scaled  # rows are gathered instead (kernels_cu/fused.cuh)
            and not fusion.all_heads)  # every head is read for the token's sums first


# The norm over all heads: per warp, a q and a k partial sum in shared memory after the weights
# (kAllHeadsScratch in kernels_cu/fused.cuh).
ALL_HEADS_SCRATCH_FLOATS = 2 * 32


def norm_shared_floats(plan: RopePlan, fusion) -> int:
    """The norm weights of a fused launch in shared memory, in float32s (norm_shared_floats in
    kernels_cu/fused.cuh): q's and k's head_dim each, or with the norm over all heads their
    whole projections, then the sums' scratch."""
    if not fusion.norm:
        return 0
    if not fusion.all_heads:
        return 2 * plan.head_dim
    return (plan.num_q_heads + plan.num_k_heads) * plan.head_dim + ALL_HEADS_SCRATCH_FLOATS


def fused_shared_bytes(plan: RopePlan, fusion, ring: bool, block) -> int:
    """Dynamic shared memory of a fused launch: the ring of chunks in flight (when used), then
    the norm weights of q and k as float32 (:func:`norm_shared_floats`), then (stores quantised
    per row) a row of head_dim float32 per head lane group (blockDim.y x blockDim.z)."""
    ring_bytes = FUSED_RING_BYTES_PER_THREAD * block[0] * block[1] * block[2] if ring else 0
    row_bytes = 4 * plan.head_dim * block[1] * block[2] if fusion.row_scaled else 0
    return ring_bytes + 4 * norm_shared_floats(plan, fusion) + row_bytes


def all_heads_geometry(plan: RopePlan, access: int, pairs: int, copy_pass: bool,
                       extra_heads: int, num_regs: int, multiprocessors: int):
    """(block, grid) of a fused launch with the norm over all heads (kernels_cu/fused.cuh:
    block_sums): one token a block (blockDim.z = 1) and every head of it in that block
    (gridDim.y = 1), whole warps. x: the lanes of a head, a power of two (the per-head launches'
    lanes); y: head lanes, as many as fit, each thread taking the same number of heads. At most
    one wave of resident blocks, each striding over tokens: a block fills the weights of every
    head into its shared memory once, not once a token."""
    chunks = (plan.rotary_dim // 2) // pairs
    pass_chunks = (plan.head_dim - plan.rotary_dim) // access if copy_pass else 0
    lanes = 1 << (max(1, min(chunks or pass_chunks, 32)) - 1).bit_length()
    num_heads = plan.num_q_heads + plan.num_k_heads + extra_heads
    most = THREADS_PER_BLOCK // lanes
    heads_per_thread = -(-num_heads // most)
    warp_rows = max(1, 32 // lanes)  # head lanes that make whole warps
    rows = min(-(-(-(-num_heads // heads_per_thread)) // warp_rows) * warp_rows, most)
    wave = _resident_blocks(lanes * rows, num_regs) * multiprocessors
    return (lanes, rows, 1), (min(plan.num_tokens, wave), 1)


# kernel handle -> the dynamic shared memory its launches are allowed (the attribute stays with
# the loaded function; loaded modules are never unloaded).
_shared_opt_ins: dict[int, int] = {}


def allow_shared_bytes(kernel, device: int, nbytes: int, op_name: str,
                       all_heads: bool = False) -> None:
    """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory, past the 48 KiB every
    launch may use (``all_heads``: the norm over all heads keeps the weights of every head there;
    else the staged kernels' ring of stages), or raise ValueError before any launch where the
    device allows less."""
    if nbytes <= _shared_opt_ins.get(kernel.ptr, 0):
        return
    cupy = cupy_module()
    most = cupy.cuda.runtime.getDeviceProperties(device)["sharedMemPerBlockOptin"]
    if nbytes > most and all_heads:
        raise ValueError(f"{op_name}: the launch needs {nbytes} bytes of shared memory (with "
                         "norm_over='all_heads', the norm weights of every q and k head as "
                         f"float32), more than this GPU's {most}: normalise with fewer heads a "
                         "call (the norm over all heads reads every head of a token at once)")
    if nbytes > most:  # the staged kernels' stages, sized for Hopper GPUs' 227 KB
        raise ValueError(f"{op_name}: the launch needs {nbytes} bytes of shared memory (the "
                         f"staged kernel's ring of stages, a token's or slot's heads each), "
                         f"more than this GPU's {most}: pass fewer heads a call")
    # The attribute is one bound a kernel: only ever raised, so that a later launch of a size
    # opted in before never finds it lowered by a smaller one in between (CUDA_ERROR_INVALID_VALUE).
    cupy.cuda.driver.funcSetAttribute(
        kernel.ptr, cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    _shared_opt_ins[kernel.ptr] = nbytes


_occupancies: dict = {}  # (kernel pointer, threads, shared bytes) -> blocks an SM holds


def occupancy_blocks(kernel, device: int, threads: int, shared_bytes: int, op_name: str) -> int:
    """Blocks of ``threads`` an SM holds of ``kernel`` with ``shared_bytes`` of dynamic shared
    memory, as the driver counts them (cuOccupancyMaxActiveBlocksPerMultiprocessor; the launch's
    shared memory allowed first), asked once a kernel and size (an MLA call asks every call).
    Counted by the SM's 228 KB less 1 KB a block, five blocks of the staged MLA kernel's 45.7 KB
    fitted where the driver holds four, and a grid sized for five ran a second, partial wave
    (docs/perf_log.md, "The staged MLA kernel")."""
    key = (kernel.ptr, threads, shared_bytes)
    blocks = _occupancies.get(key)
    if blocks is None:
        if shared_bytes > MAX_SHARED_ANGLE_BYTES:
            allow_shared_bytes(kernel, device, shared_bytes, op_name)
        driver = cupy_module().cuda.driver
        blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads,
                                                                  shared_bytes)
        _occupancies[key] = blocks
    return blocks


def fit_row_buffers(plan: RopePlan, fusion, block, grid):
    """(block, grid) of a row-scaled fused launch whose row buffers fit the shared memory a
    launch may use without opting in: fewer tokens a block, then fewer heads, where the
    geometry's would not (the kernel strides over tokens and heads, so any grid covers them)."""
    rows = (MAX_SHARED_ANGLE_BYTES - fused_shared_bytes(plan, fusion, False, (0, 0, 0))) // (
        4 * plan.head_dim)
    lanes, heads, tokens = block
    warp_rows = max(1, 32 // lanes)
    if fusion.all_heads and rows < warp_rows:
        raise ValueError(f"{fusion.op_name}: with norm_over='all_heads' the norm weights of "
                         "every head leave too little shared memory for stores quantised per "
                         f"row (head_dim {plan.head_dim}): quantise per tensor, or call "
                         "rms_norm_rope and the cache write apart")
    if rows < 1:
        raise ValueError(f"{fusion.op_name}: head_dim {plan.head_dim} is too large for stores "
                         "quantised per row (a row of it must fit in 48 KiB of shared memory)")
    if heads * tokens <= rows:
        return block, grid
    if fusion.all_heads:  # every head of the token in one block: fewer rows, whole warps
        return (lanes, rows // warp_rows * warp_rows, 1), grid
    head_lanes = heads * grid[1]
    heads = min(heads, rows)
    tokens = max(1, rows // heads)
    return ((lanes, heads, tokens),
            (min(-(-plan.num_tokens // tokens), MAX_GRID_X), min(-(-head_lanes // heads),
                                                                 MAX_GRID_Y)))


def fusion_touches_pass_through(fusion) -> bool:
    """Whether the dims past rotary_dim are read and written even in place: normalised, stored
    as fp8, or copied into the k cache."""
    return fusion.norm or fusion.out_dtype is not None or fusion.writes_cache


def _fusion_vector_ok(plan: RopePlan, fusion) -> bool:
    """16-byte accesses also need v and the caches aligned, and whole heads in 16-byte steps for
    the v copy."""
    access, _ = access_layout(ITEMSIZE[plan.q.dtype], True, plan.interleaved)
    if fusion.writes_cache and plan.head_dim % access:
        return False
    for info in (fusion.v, fusion.k_cache, fusion.v_cache):
        if info is not None and (info.ptr % 16 or any(s % access for s in info.strides[:-1])):
            return False
    return True


def fusion_struct(plan: RopePlan, fusion, copy_pass: bool) -> np.ndarray:
    """The FusionParams of a fused launch."""
    f = np.zeros((), dtype=FUSION_PARAMS_DTYPE)
    f["norm"] = fusion.norm
    f["write_pass_through"] = copy_pass and (not plan.inplace or fusion.norm) and fusion.rotate
    if fusion.norm:  # (all heads: [num_heads, head_dim] weights are one run of equal steps)
        f["q_weight"], f["q_weight_stride"] = fusion.q_weight.ptr, fusion.q_weight.strides[-1]
        if fusion.k_weight is not None:
            f["k_weight"], f["k_weight_stride"] = fusion.k_weight.ptr, fusion.k_weight.strides[-1]
        f["weight_dtype"] = WeightDtype[fusion.q_weight.dtype.upper()]
        f["eps"], f["weight_offset"] = fusion.eps, fusion.weight_offset
    f["out_format"] = STORE_FORMATS.get(fusion.out_dtype, StoreFormat.INPUT)
    _row_scale_fields(f, fusion)
    for name in ("q_scale", "k_scale", "v_scale"):
        scale = getattr(fusion, name)
        if scale is not None:
            f[name + "_value"] = scale.value
            if scale.array is not None:
                f[name] = scale.array.ptr
    if fusion.writes_cache:
        v, kc, vc, slots = fusion.v, fusion.k_cache, fusion.v_cache, fusion.slot_mapping
        f["v"], f["k_cache"], f["v_cache"], f["slot_mapping"] = v.ptr, kc.ptr, vc.ptr, slots.ptr
        f["cache_format"] = STORE_FORMATS.get(fusion.cache_dtype, StoreFormat.INPUT)
        f["num_v_heads"] = v.shape[1]
        f["v_token_stride"], f["v_head_stride"] = v.strides[0], v.strides[1]
        f["slot_stride"], f["slots_are_int64"] = slots.strides[0], slots.dtype == "int64"
        f["num_slots"], f["block_size"] = fusion.num_slots, fusion.block_size
        (f["k_cache_block_stride"], f["k_cache_slot_stride"],
         f["k_cache_head_stride"]) = fusion.cache_strides(kc)
        (f["v_cache_block_stride"], f["v_cache_slot_stride"],
         f["v_cache_head_stride"]) = fusion.cache_strides(vc)
    return f


def _row_scale_fields(f: np.ndarray, fusion) -> None:
    """The FusionParams fields of stores quantised per row: the output rows' scale arrays (C
    order: a token's heads side by side), the caches' per-row scales or NVFP4 block scales
    (block, slot, head strides in the cache's layout)."""
    f["row_scaled"] = fusion.row_scaled
    outputs = fusion.out_dtype is not None  # per-row k_scale: k_out's rows, else the cache's
    for name, scale in (("q", fusion.q_scale), ("k", fusion.k_scale)):
        rows = None if scale is None else scale.rows
        if rows is not None and (name == "q" or outputs):
            f[f"{name}_out_scales"] = rows.ptr
            f[f"{name}_out_scales_token_stride"], f[f"{name}_out_scales_head_stride"] = (
                rows.shape[-1], 1)
    k_rows = None if outputs or fusion.k_scale is None else fusion.k_scale.rows
    v_rows = None if fusion.v_scale is None else fusion.v_scale.rows
    caches = (("k", k_rows if fusion.k_cache_scales is None else fusion.k_cache_scales),
              ("v", v_rows if fusion.v_cache_scales is None else fusion.v_cache_scales))
    for name, info in caches:
        if info is not None:
            f[f"{name}_cache_scales"] = info.ptr
            (f[f"{name}_cache_scales_block_stride"], f[f"{name}_cache_scales_slot_stride"],
             f[f"{name}_cache_scales_head_stride"]) = fusion.cache_strides(info)


# fp8 conversion instructions (cvt ... e4m3x2 / e5m2x2) arrive with compute capability 8.9.
FP8_MIN_COMPUTE_CAPABILITY = 89


def check_fp8_support(plan: RopePlan) -> None:
    """fp8 stores need the conversion instructions of compute capability 8.9+: refuse before
    launching elsewhere."""
    fusion = plan.fusion
    if fusion.out_dtype is None and fusion.cache_dtype in (None, "nvfp4"):
        return  # NVFP4 converts by hand where the hardware cannot (kernels_cu/quantize.cuh)
    capability = _compute_capability(plan.device)
    if capability < FP8_MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"{fusion.op_name}: fp8 outputs need a GPU of compute capability 8.9 or newer (Ada, "
            f"Hopper, Blackwell) for its fp8 conversions; device {plan.device} has "
            f"{capability // 10}.{capability % 10}. Store in the input dtype instead")


@functools.lru_cache(maxsize=None)
def _compute_capability(device: int) -> int:
    return int(cupy_module().cuda.Device(device).compute_capability)


# ------------------------------------------------------------------------------------------------
# rerotate_cache (kernels_cu/rerotate.cuh): the cached keys of named slots rotated in place.


# Few rows (slots x heads) cannot fill the GPU, so a launch's time is one thread's chain of work.
# A 16-byte access gives a thread 16 fp8 pairs (8 of 16-bit types), each with its own angle; with
# computed angles or fp8's conversions that chain outlasts the loads, and one pair per thread wins:
# on an H200 at 32 / 512 slots x 8 heads, fp8 with computed angles 5.39 / 5.61 µs -> 3.10 / 3.78,
# fp8 with a table 3.61 / 3.75 -> 3.02 / 3.80, bf16 computed 3.58 / 3.93 -> 2.96 / 3.61; bf16 with
# a table lost (2.73 / 3.05 -> 2.91 / 3.73), and from 4096 slots the vectors win everywhere.
RERO_ELEMENT_MAX_ROWS = 4096


def _rerotate_vector_ok(plan: RerotatePlan) -> bool:
    """16-byte accesses: the rotated dims split into whole accesses (NeoX: each half), and the
    cache's pointer and block, row and head strides aligned to them; not at few rows where each
    access's angles or conversions are the longer chain (above)."""
    if plan.num_slots * plan.num_heads <= RERO_ELEMENT_MAX_ROWS and (
            plan.rope.source == AngleSource.COMPUTED or ITEMSIZE[plan.cache_dtype] == 1):
        return False
    return _rerotate_16_byte_layout(plan)


def _rerotate_16_byte_layout(plan: RerotatePlan) -> bool:
    """Whether the rotated dims split into whole 16-byte accesses (NeoX: each half) and the
    cache's pointer and block, row and head strides are aligned to them."""
    access, _ = access_layout(ITEMSIZE[plan.cache_dtype], True, plan.rope.interleaved)
    r = plan.rope.rotary_dim
    if (r if plan.rope.interleaved else r // 2) % access:
        return False
    return plan.cache.ptr % 16 == 0 and all(s % access == 0 for s in plan.cache_strides())


# The staged re-rotation (kernels_cu/rerotate_staged.cuh: rows by bulk copies through shared
# memory, Hopper GPUs of fast memory): its block (RERO_STAGED_CONSUMERS consumer threads and the
# producer warp), the most entries of `slots` a stage (one producer lane each), the most bytes a
# stage, and the launches it takes: from RERO_STAGED_MIN_ROWS rows (slots x heads). A consumer
# item is one chunk of as many heads as hold RERO_STAGED_*_ITEM_BYTES of the cache: its cos / sin
# serve them all (computed: the sincos; a table: the stage's row, read once), and a stage holds
# the entries whose items give each consumer RERO_STAGED_ITEMS_A_CONSUMER of them.
# H200, benchmarks/test_rerotate.py's data (8 heads of 128, NeoX), % of an SM copy, the 16-byte
# kernel -> staged at 16384 / 65536 slots: fp8 e4m3 from a table 68.6 / 73.2 -> 75.7 / 86.6,
# computed 63.8 / 69.1 -> 68.8 / 88.8; bf16 from a table 84.9 / 87.0 -> 84.9 / 90.4, computed
# 81.0 / 87.7 -> 92.4 / 95.8. Items of one head from a table (cos, sin and the factor read from
# shared memory again for each head): fp8 56.5 / 53.6; fewer entries a stage or two items a
# consumer: slower everywhere. At 4096 slots a block holds one or two stages' entries and nothing
# is in flight behind them (staged fp8 50-61, bf16 66-78; 16-byte 54-65, 74-83): the 16-byte
# kernel there and at 8192 (mixed). docs/perf_log.md, "rerotate_cache on the staged kernel".
RERO_STAGED_CONSUMERS = 128
RERO_STAGED_THREADS = RERO_STAGED_CONSUMERS + 32
RERO_STAGED_MAX_SLOTS = 32  # the producer warp's lanes, one an entry
RERO_STAGED_MAX_STAGE_BYTES = 24 * 1024
RERO_STAGED_MIN_ROWS = 16384 * 8
RERO_STAGED_TABLE_ITEM_BYTES = 64
RERO_STAGED_COMPUTED_ITEM_BYTES = 128
RERO_STAGED_ITEMS_A_CONSUMER = 1


@dataclasses.dataclass(frozen=True)
class RerotateStageLayout:
    """A stage of the staged re-rotation, in bytes from its start: ``stage_slots`` entries
    (StagedSlot: the row's offset and the delta, 16 bytes each), then the slots' rows (their heads
    side by side), then (a table) their cos / sin rows; whole 128-byte lines. The kernel reads
    these fields from RerotateParams; ``shared_bytes`` adds the stages' barriers and the inverses
    of the table's row 0 (rerotate_staged_slots)."""

    stage_slots: int
    heads_per_item: int
    rows_at: int
    angles_at: int
    stage_bytes: int
    shared_bytes: int


def rerotate_stage_layout(plan: RerotatePlan) -> RerotateStageLayout:
    """The stages of ``plan``'s staged launch: enough entries a stage that its items (chunks of
    ``heads_per_item`` heads) give every consumer one, within RERO_STAGED_MAX_SLOTS."""
    rope = plan.rope
    size = ITEMSIZE[plan.cache_dtype]
    # Pairs an item (rerotate_staged.cuh, StagedPairs): a 16-byte access's, 8 for fp8 NeoX.
    pairs = 8 if size == 1 and not rope.interleaved else access_layout(size, True,
                                                                       rope.interleaved)[1]
    table = rope.source == AngleSource.CACHE_TABLE
    head_bytes = 2 * pairs * size  # a head's share of an item: both halves' (or its pairs')
    item_bytes = RERO_STAGED_TABLE_ITEM_BYTES if table else RERO_STAGED_COMPUTED_ITEM_BYTES
    heads_per_item = max(1, min(plan.num_heads, item_bytes // head_bytes))
    per_slot = -(-plan.num_heads // heads_per_item) * (rope.rotary_dim // 2 // pairs)
    items = RERO_STAGED_CONSUMERS * RERO_STAGED_ITEMS_A_CONSUMER
    stage_slots = max(1, min(RERO_STAGED_MAX_SLOTS, -(-items // per_slot)))
    row_bytes = plan.num_heads * plan.head_dim * size
    angle_bytes = rope.rotary_dim * ITEMSIZE[rope.cache.dtype] if table else 0

    def stage_bytes_of(slots: int) -> int:
        return -(-(16 * slots + slots * (row_bytes + angle_bytes)) // 128) * 128

    # Fewer entries where that many would pass RERO_STAGED_MAX_STAGE_BYTES (wide heads).
    while stage_slots > 1 and stage_bytes_of(stage_slots) > RERO_STAGED_MAX_STAGE_BYTES:
        stage_slots -= 1
    rows_at = 16 * stage_slots
    angles_at = rows_at + stage_slots * row_bytes
    stage_bytes = stage_bytes_of(stage_slots)
    shared = STAGED_STAGES * stage_bytes + 2 * STAGED_STAGES * 8
    if table:
        shared += 4 * (rope.rotary_dim // 2)
    return RerotateStageLayout(stage_slots, heads_per_item, rows_at, angles_at, stage_bytes,
                               shared)


def rerotate_staged_layout(plan: RerotatePlan, *, memory_bandwidth: float,
                           compute_capability: int) -> RerotateStageLayout | None:
    """The stages of the staged re-rotation where it runs ``plan``, else None (rerotate_cache plans
    every call: the layout is worked out once, for the rule and the launch). It runs on a Hopper
    GPU (bulk copies) of fast memory, at
    least RERO_STAGED_MIN_ROWS rows, the 16-byte layout (_rerotate_16_byte_layout), a slot's heads
    side by side (NHD, or HND of one-slot blocks: a row is one bulk copy; HND of 16-slot blocks,
    a copy a head, ran at 39-76 % of an SM copy where the 16-byte kernel ran 63-87), a table's rows
    of whole 16-byte units (cos then sin, unit column stride, aligned), and one entry's stage
    within RERO_STAGED_MAX_STAGE_BYTES."""
    if not (90 <= compute_capability < 100 and memory_bandwidth >= FAST_MEMORY):
        return None
    if (plan.num_slots * plan.num_heads < RERO_STAGED_MIN_ROWS
            or not _rerotate_16_byte_layout(plan)):
        return None
    if ((plan.head_dim * ITEMSIZE[plan.cache_dtype]) % 16
            or plan.cache_strides()[2] != plan.head_dim):
        return None
    rope = plan.rope
    if rope.source == AngleSource.CACHE_TABLE:
        table = rope.cache
        itemsize = ITEMSIZE[table.dtype]
        if (rope.cos_col_stride != 1 or rope.sin_col_stride != 1 or table.strides[1] != 1
                or table.ptr % 16 or (table.strides[0] * itemsize) % 16
                or ((rope.rotary_dim // 2) * itemsize) % 16):
            return None
    stages = rerotate_stage_layout(plan)
    return stages if stages.stage_bytes <= RERO_STAGED_MAX_STAGE_BYTES else None


def plan_rerotate_launch(plan: RerotatePlan, *, inv_freq_ptr: int = 0,
                         num_regs: Callable[[RerotateSpec], int],
                         multiprocessors: int, memory_bandwidth: float = 0.0,
                         compute_capability: int = 0,
                         resident_blocks: Callable[..., int] | None = None) -> LaunchSpec:
    """The one launch that re-rotates the slots of ``plan``: a ``RopeParams`` holding the angle
    source (cos_sin_cache rows indexed by the delta, or ``inv_freq`` for computed angles) and a
    ``RerotateParams`` holding the cache, slots and deltas. Geometry as the rope kernels': lanes
    over a head's chunks, heads, slots; or (rerotate_staged_layout) the staged kernel's block on a
    persistent grid of the blocks an SM holds (``resident_blocks(spec, threads, shared_bytes)``,
    the driver's count; without it what registers and shared memory leave)."""
    rope = plan.rope
    stages = rerotate_staged_layout(plan, memory_bandwidth=memory_bandwidth,
                                    compute_capability=compute_capability)
    staged = stages is not None
    vector = staged or _rerotate_vector_ok(plan)
    access, pairs = access_layout(ITEMSIZE[plan.cache_dtype], vector, rope.interleaved)
    p = np.zeros((), dtype=PARAMS_DTYPE)
    p["num_tokens"] = plan.num_slots
    p["num_q_heads"] = plan.num_heads
    p["head_dim"], p["rotary_dim"] = plan.head_dim, rope.rotary_dim
    p["sin_sign"] = 1.0
    p["attention_factor"] = rope.attention_factor
    table_dtype, cos_ptr, sin_ptr, sin_offset = "float32", 0, 0, None
    if rope.source == AngleSource.COMPUTED:
        p["inv_freq"] = inv_freq_ptr
    else:
        table = rope.cache
        table_dtype = table.dtype
        cos_ptr = table.ptr
        sin_offset = (rope.rotary_dim // 2) * table.strides[1] * ITEMSIZE[table.dtype]
        sin_ptr = cos_ptr + sin_offset
        p["table_row_stride"], p["max_position"] = table.strides[0], table.shape[0]
        p["cos_col_stride"], p["sin_col_stride"] = rope.cos_col_stride, rope.sin_col_stride
        p["table_vector_ok"] = _table_vector_ok(rope, pairs, cos_ptr, sin_ptr, [table.strides[0]])
    p["cos"], p["sin"] = cos_ptr, sin_ptr

    r = np.zeros((), dtype=RERO_PARAMS_DTYPE)
    r["cache"], r["slots"] = plan.cache.ptr, plan.slots.ptr
    r["num_slots"] = plan.num_slots
    r["slots_are_int64"], r["slot_stride"] = plan.slots.dtype == "int64", plan.slots.strides[0]
    if plan.delta is not None:
        r["delta"], r["delta_is_int64"] = plan.delta.ptr, plan.delta.dtype == "int64"
        r["delta_stride"] = plan.delta_stride
    r["delta_value"] = plan.delta_value
    r["cache_slots"], r["block_size"] = plan.cache_slots, plan.block_size
    r["block_stride"], r["row_stride"], r["head_stride"] = plan.cache_strides()
    r["num_heads"] = plan.num_heads
    r["scale_value"] = plan.scale.value
    if plan.scale.array is not None:
        r["scale"] = plan.scale.array.ptr

    spec = RerotateSpec(plan.cache_dtype, table_dtype, vector, rope.interleaved, rope.source,
                        staged)
    if staged:
        for name in ("stage_slots", "heads_per_item", "stage_bytes", "rows_at", "angles_at"):
            r[name] = getattr(stages, name)
        if resident_blocks is not None:
            resident = resident_blocks(spec, RERO_STAGED_THREADS, stages.shared_bytes)
        else:
            by_shared = HOPPER_SM_SHARED_BYTES // (stages.shared_bytes
                                                   + BLOCK_SHARED_RESERVED_BYTES)
            resident = min(_resident_blocks(RERO_STAGED_THREADS, num_regs(spec)), by_shared)
        groups = -(-plan.num_slots // stages.stage_slots)
        grid = (min(groups, max(1, resident) * multiprocessors), 1)
        return LaunchSpec(spec, p, grid, (RERO_STAGED_THREADS, 1, 1), stages.shared_bytes,
                          (0, 0, 0, 0, 0, cos_ptr, sin_ptr), sin_offset, vector,
                          fusion_params=r)
    curve = (RERO_FP8_NEOX_THROUGHPUT_BY_WORK
             if vector and ITEMSIZE[plan.cache_dtype] == 1 and not rope.interleaved
             else _THROUGHPUT_BY_WORK)
    block, grid = launch_geometry(rope, access, pairs, False, num_regs(spec), multiprocessors,
                                  throughput_by_work=curve)
    return LaunchSpec(spec, p, grid, block, 0, (0, 0, 0, 0, 0, cos_ptr, sin_ptr), sin_offset,
                      vector, fusion_params=r)


def rerotate_on_gpu(plan: RerotatePlan) -> LaunchRecipe:
    """Launch the re-rotation of a checked plan on the cache's device, on the caller's stream (no
    allocation, no synchronisation: capturable once its kernel is compiled and, for computed
    angles, its frequencies are on the device)."""
    device = plan.cache.device  # fp8 caches on any GPU: rerotate.cuh converts in software below 8.9
    capturing = stream_is_capturing(plan.cache.obj, device)

    def needs_warmup(what: str) -> str:
        return (f"{plan.op_name}: called while the stream is being captured into a CUDA graph, "
                f"but {what}; make one call with the same cache format, layout, angle source "
                "and number of slots (few rows take one pair a thread, many a staged kernel on "
                "some GPUs; computed angles also the same theta / scaling / rotary_dim) before "
                "capturing")

    inv_freq = None
    if plan.rope.source == AngleSource.COMPUTED:
        key = (device, plan.rope.inv_freq.tobytes())
        if capturing and key not in device_constants._arrays:
            raise RuntimeError(needs_warmup("the inverse frequencies of this schedule are not on "
                                            "the device yet (uploading them synchronises)"))
        inv_freq = device_constants.inv_freq(device, plan.rope.inv_freq)

    def compiled(spec: RerotateSpec):
        if capturing and not is_compiled(spec, device):
            raise RuntimeError(needs_warmup(f"{spec.name_expression} is not compiled yet"))
        return get_kernel(spec, device)

    launch = plan_rerotate_launch(
        plan, inv_freq_ptr=0 if inv_freq is None else inv_freq.data.ptr,
        num_regs=lambda spec: compiled(spec).num_regs, multiprocessors=_multiprocessors(device),
        memory_bandwidth=_memory_bandwidth(device),
        compute_capability=_compute_capability(device),
        resident_blocks=lambda spec, threads, shared_bytes: occupancy_blocks(
            compiled(spec), device, threads, shared_bytes, plan.op_name))
    kernel = compiled(launch.kernel)
    if launch.shared_bytes > MAX_SHARED_ANGLE_BYTES:
        allow_shared_bytes(kernel, device, launch.shared_bytes, plan.op_name)
    recipe = LaunchRecipe(kernel.ptr, device, launch.grid, launch.block, launch.params,
                          launch.sin_offset, launch.vector, inv_freq, launch.shared_bytes,
                          launch.kernel, fusion_params=launch.fusion_params)
    recipe.launch(plan.cache.obj, *launch.pointers)
    return recipe


def run_rerotate(k_cache, slots, delta, key=None, **options):
    """:func:`cupyrope.rerotate_cache` on arrays that can be written (NumPy, CuPy, torch, DLPack
    producers): the checks (:func:`cupyrope.core.rerotate.plan_rerotate`), then one launch on the
    GPU or the NumPy path on the host; the cache's version counter bumped (torch). ``key``: the
    call's repeat key (:func:`cupyrope.cuda.recipes.rerotate_key`), under which the launch's
    recipe is kept. Returns ``k_cache``."""
    plan = plan_rerotate(k_cache, slots, delta, **options)
    if not plan.is_empty:
        if plan.cache.on_gpu:
            recipe = rerotate_on_gpu(plan)
            if key is not None:
                infos = (plan.cache, plan.slots, plan.delta, plan.rope.cache, plan.scale.array)
                keep_rerotate_recipe(recipe, [None if info is None else byte_span(info)
                                              for info in infos], key,
                                     plan.cache.kind == "torch")
        else:
            rerotate_on_host(plan)
        mark_written(plan.cache.obj)
    return k_cache
