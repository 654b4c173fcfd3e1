"""The one launch of the DeepSeek MLA ops (kernels_cu/mla.cuh): a checked
:class:`cupyrope.core.mla.MlaPlan` and its output arrays turned into an ``MlaParams`` struct, the
specialisation, the geometry, and the launch on the caller's stream (no allocation, no
synchronisation once the kernel is compiled and, for computed angles, the frequencies are on the
device).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math

import numpy as np

from ..core.abi import AngleSource, access_layout
from ..core.arrays import (ArrayInfo, cupy_module, current_stream, describe, host_view,
                           mark_written, new_output, stream_is_capturing)
from ..core.dtypes import FP8_DTYPES, ITEMSIZE
from ..core.fused_plan import STORE_FORMATS
from ..core.mla import MlaPlan, mla_on_host
from ..core.mrope import MROPE_NONE
from .compiler import MlaSpec, get_kernel, is_compiled
from .launch import (FAST_MEMORY, FP8_MIN_COMPUTE_CAPABILITY, INDEX32_LIMIT, STAGED_STAGES,
                     _compute_capability, _extent, _memory_bandwidth, _multiprocessors,
                     _resident_blocks, device_constants, occupancy_blocks)

_POINTERS = ("q_nope", "q_pe", "k_nope", "k_pe", "kv_c", "q_nope_out", "q_pe_out", "k_nope_out",
             "k_pe_out", "kv_cache", "kpe_cache", "positions", "slot_mapping", "table",
             "inv_freq", "q_scale", "k_scale", "kv_scale")
_STRIDE_PAIRS = ("q_nope_strides", "q_pe_strides", "k_nope_strides", "k_pe_strides",
                 "q_nope_out_strides", "q_pe_out_strides", "k_nope_out_strides",
                 "k_pe_out_strides")
_WORDS = ("kv_c_stride", "cache_block_stride", "cache_row_stride", "kpe_block_stride",
          "kpe_row_stride", "positions_stride", "slot_stride", "table_row_stride",
          "table_col_stride", "num_tokens", "num_q_heads", "num_k_heads", "nope_dim", "k_nope_dim",
          "rope_dim", "rank", "num_slots", "block_size", "max_position", "positions_int64",
          "slots_int64", "out_format", "cache_format", "rotate")
# The layout of ``cupyrope::MlaParams`` (kernels_cu/mla.cuh), field for field.
MLA_PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in _POINTERS]
    + [(name, np.int64, (2,)) for name in _STRIDE_PAIRS]
    + [(name, np.int64) for name in _WORDS]
    + [(name, np.float32) for name in ("q_scale_value", "k_scale_value", "kv_scale_value",
                                       "attention_factor")])
THREADS = 128  # the kernel's __launch_bounds__: the largest block
# Blocks of many tokens, and the kernel's throughput with each against the best (H200,
# DeepSeek-V3 at T = 65536, bf16 cache, the kernel at 40 registers: 82.5 / 81.1 / 75.3 % of a
# copy; at the 32 registers of its 32-bit-offset build, 64 against 128: 85.9 / 84.2). A block
# takes a token, its threads the token's items in rounds (296 items: five rounds of 64, four of
# 96, three of 128): more, smaller blocks keep more tokens' start-up chains (parameters,
# position, slot, first loads) in flight an SM (at 40 registers 25 blocks of 64 against 12 of
# 128; at 32, 32 against 16). Blocks of 160 or 320 (two rounds, one) were slower still than
# 128: 69.0 / 41.7 %. The launch takes the best by a wave model (mla_geometry). measured:
# docs/perf_log.md
BLOCK_THROUGHPUT = ((64, 1.0), (96, 0.983), (128, 0.913))
# A kernel of at most 32 registers (the 32-bit-offset DeepSeek build on sm_90: 2048 threads an SM
# in blocks of 64 or 96) runs fastest in blocks of 96 at every T past the SMs, which the wave
# model does not see (it took 64 from 4096 tokens). H200, T = 512 / 4096 / 16384 / 65536, bf16
# cache, blocks of 64 / 96 / 128: 7.90 / 6.58 / 6.69 us, 75.0 / 76.2 / 74.4, 82.3 / 83.5 / 81.4,
# 86.3 / 86.2 / 84.5 % of a copy; fp8 cache at 4096 / 16384 / 65536: 70.0 / 74.2 / 71.6, 80.5 /
# 83.7 / 79.5, 86.6 / 87.1 / 82.3. measured: docs/perf_log.md
BLOCK_THROUGHPUT_32_REGISTERS = ((96, 1.0),)
MAX_BLOCKS = 65535 * 4  # tokens beyond are strided over
TOKEN_ELEMENTS_MAX = 2**31 - 1  # a token's items are counted in 32 bits


def mla_token_items(spec: MlaSpec, p: np.ndarray) -> int:
    """The items of one token (kernels_cu/mla.cuh, mla_rope_tokens) of a launch's ``MlaParams``:
    pass-through chunks of one access or (GPT-J pairs, parts that split into them) two, rope
    chunks of P pairs, the cache row's kv_c chunks and, without k outputs, its k_pe chunks."""
    access, pairs = access_layout(ITEMSIZE[spec.dtype], spec.vector, spec.interleaved)
    wide = spec.vector and spec.interleaved and all(
        int(p[name]) % (2 * access) == 0 for name in ("nope_dim", "k_nope_dim", "rank"))
    width = 2 * access if wide else access
    rope_chunks = int(p["rope_dim"]) // 2 // pairs
    q_nope = int(p["nope_dim"]) // width if int(p["q_nope_out"]) else 0
    k_nope = int(p["k_nope_dim"]) // width if int(p["k_nope_out"]) else 0
    q_items = int(p["num_q_heads"]) * (q_nope + rope_chunks) if int(p["q_pe_out"]) else 0
    k_items = int(p["num_k_heads"]) * (k_nope + rope_chunks) if int(p["k_pe_out"]) else 0
    cache_items = 0
    if int(p["slot_mapping"]):
        cache_items = int(p["rank"]) // width + (rope_chunks if k_items == 0 else 0)
    return q_items + k_items + cache_items


def mla_grid(spec: MlaSpec, p: np.ndarray, multiprocessors: int) -> tuple[int, int]:
    """(gridDim.x, gridDim.y) of a launch: a block a token (strided past MAX_BLOCKS), and a few
    tokens' items split over blocks of one item a thread where the split still leaves at most
    one block an SM (a decode step: DeepSeek-V3's 296 items a token in three blocks, up to 44
    tokens on 132 SMs)."""
    tokens = int(p["num_tokens"])
    if tokens > multiprocessors:  # no split leaves one block an SM: not worth counting items
        return min(tokens, MAX_BLOCKS), 1
    shares = max(1, -(-mla_token_items(spec, p) // THREADS))
    if tokens * shares > multiprocessors:
        shares = 1
    return tokens, shares


def mla_geometry(spec: MlaSpec, p: np.ndarray, multiprocessors: int,
                 num_regs: int) -> tuple[int, tuple[int, int]]:
    """(threads a block, (gridDim.x, gridDim.y)) of a launch of a kernel of ``num_regs``
    registers: a decode step (no more tokens than SMs) in blocks of THREADS, its items split
    (:func:`mla_grid`); more tokens in the block of BLOCK_THROUGHPUT with the best score, the
    square root of the last wave's fill times the block's throughput (as
    ``launch.launch_geometry``: a partial last wave runs faster than its idle fraction says).
    DeepSeek-V3 on 132 SMs at 40 registers (64-bit offsets): 128 below ~2000 tokens, 96 up to
    ~8000 (4096: 1.8 waves of 17 blocks an SM where 64 leaves 1.2 of 25), 64 from 16384; at 32
    registers (its 32-bit-offset build on sm_90) 96 past the SMs (BLOCK_THROUGHPUT_32_REGISTERS:
    measured best there at every T, where the model took 64 from 4096 tokens)."""
    grid = mla_grid(spec, p, multiprocessors)
    if int(p["num_tokens"]) <= multiprocessors:
        return THREADS, grid
    best = None
    table = BLOCK_THROUGHPUT_32_REGISTERS if num_regs <= 32 else BLOCK_THROUGHPUT
    for block, throughput in table:
        waves = grid[0] / (_resident_blocks(block, num_regs) * multiprocessors)
        score = (waves / math.ceil(waves)) ** 0.5 * throughput
        if best is None or score > best[0]:
            best = (score, block)
    return best[1], grid


# The staged MLA kernel (kernels_cu/mla_staged.cuh): launches of at least MLA_STAGED_MIN_TOKENS
# tokens on Hopper GPUs of fast memory, a block's token rows moved by bulk copies through
# STAGED_STAGES shared-memory stages by a producer warp, converted there by MLA_STAGED_CONSUMERS
# threads (kMlaStagedConsumers; the block has the producer warp besides). Stages of at most
# MLA_STAGED_MAX_STAGE_BYTES, so that the stages of at least two blocks fit an SM. H200,
# DeepSeek-V3 at TP 8 (q [T, 16, 128 + 64] bf16 -> fp8, fp32 table), item kernel -> staged, two
# rounds: bf16 cache T = 32 / 64 / 512 3.12-3.14 / 3.89 / 6.56 -> 3.12-3.13 / 3.37-3.38 /
# 5.41-5.44 us (graphs of 20 calls), T = 4096 / 16384 / 65536 74.9 / 83.3-83.7 / 86.4 -> 78.5-79.0
# / 85.1 / 88.5 % of an SM copy; fp8 cache 3.21-3.22 / 3.91 / 6.48 -> 3.20-3.22 / 3.37-3.38 /
# 5.28-5.29 us, 74.5-74.6 / 83.3-83.4 / 87.1 -> 78.8-79.0 / 83.7 / 86.7-87.1 %. Launches of fewer
# tokens keep the item kernel, whose decode steps split a token's items over blocks (T = 32 as
# fast either way, T = 1 2.84 against 3.21 us).
# measured: docs/perf_log.md#the-staged-mla-kernel-h200-2026-11-29-sixth
MLA_STAGED_MIN_TOKENS = 64
MLA_STAGED_CONSUMERS = 128
MLA_STAGED_THREADS = MLA_STAGED_CONSUMERS + 32
MLA_STAGED_MAX_STAGE_BYTES = 24 * 1024


def _mla_stage_parts(spec: MlaSpec, p: np.ndarray) -> list[int]:
    """Bytes of each part of one stage of the staged MLA kernel (mla_staged.cuh: MlaStageLayout):
    the input rows (q's heads when q is written, k_pe's when k or the cache is, kv_c when the
    cache is), the cos / sin row, the flag word, the output rows (q, k_pe, the cache row)."""
    size = ITEMSIZE[spec.dtype]
    out = 1 if int(p["out_format"]) else size
    cache_size = 1 if int(p["cache_format"]) else size
    rope = int(p["rope_dim"])
    cache = bool(int(p["slot_mapping"]))
    k_out = bool(int(p["k_pe_out"]))
    q = int(p["num_q_heads"]) * (int(p["nope_dim"]) + rope) if int(p["q_pe_out"]) else 0
    k = int(p["num_k_heads"]) * rope if k_out or cache else 0
    kv = int(p["rank"]) if cache else 0
    return [q * size, k * size, kv * size, rope * ITEMSIZE[spec.table_dtype], 16, q * out,
            k * out if k_out else 0, (kv + rope) * cache_size if cache else 0]


def mla_stage_bytes(spec: MlaSpec, p: np.ndarray) -> int:
    """Bytes of one stage (its parts, rounded up to whole 128-byte lines)."""
    return _whole_lines(_mla_stage_parts(spec, p))


def _whole_lines(parts: list[int]) -> int:
    return -(-sum(parts) // 128) * 128


def mla_staged_shared_bytes(spec: MlaSpec, p: np.ndarray) -> int:
    """Dynamic shared memory of a staged MLA launch: the stages and their two barriers each."""
    return STAGED_STAGES * mla_stage_bytes(spec, p) + STAGED_STAGES * 2 * 8


def _contiguous_rows(p: np.ndarray, first: str, second: str | None, heads: int, dim: int,
                     second_at: int, itemsize: int) -> bool:
    """Whether a part's token rows (``first``'s pointer and strides, its heads of ``dim``
    elements, and ``second`` ``second_at`` elements into each head where given: a q head's
    rope part after its nope part) are one contiguous, 16-byte aligned run of bytes a token
    (one head's stride is any: a ``[T, dim]`` array's unit head dim)."""

    def rows_of(name):
        token, head = (int(s) for s in p[f"{name}_strides"])
        return token, head if heads > 1 else dim

    if rows_of(first) != (heads * dim, dim) or int(p[first]) % 16 or heads * dim * itemsize % 16:
        return False
    return second is None or (rows_of(second) == rows_of(first)
                              and int(p[second]) == int(p[first]) + second_at * itemsize)


def mla_staged_applies(spec: MlaSpec, p: np.ndarray, *, memory_bandwidth: float,
                       compute_capability: int) -> bool:
    """Whether the staged MLA kernel runs a launch (``spec``, ``p``: plan_mla_launch's): a Hopper
    GPU (``compute_capability`` 90-99: bulk copies, the stages' shared memory) of fast memory, at
    least MLA_STAGED_MIN_TOKENS tokens, 16-bit inputs in 16-byte accesses from a cos_sin_cache,
    no k nope part, and every row a bulk copy moves contiguous and 16-byte aligned: q's heads
    [nope | rope] one row a token (its nope part written where it has one), k_pe's heads one row
    (one head where the cache is written), kv_c's row, the cache rows and the table's."""
    if not (90 <= compute_capability < 100 and memory_bandwidth >= FAST_MEMORY):
        return False
    if (spec.dtype not in ("float16", "bfloat16") or not spec.vector
            or spec.source != AngleSource.CACHE_TABLE
            or int(p["num_tokens"]) < MLA_STAGED_MIN_TOKENS):
        return False
    if int(p["k_nope"]) or int(p["k_nope_out"]):
        return False
    size = ITEMSIZE[spec.dtype]
    out = 1 if int(p["out_format"]) else size
    cache_size = 1 if int(p["cache_format"]) else size
    rope, nope = int(p["rope_dim"]), int(p["nope_dim"])
    heads, k_heads = int(p["num_q_heads"]), int(p["num_k_heads"])
    cache = bool(int(p["slot_mapping"]))
    if int(p["q_pe_out"]):
        if nope:
            if not (int(p["q_nope_out"])
                    and _contiguous_rows(p, "q_nope", "q_pe", heads, nope + rope, nope, size)
                    and _contiguous_rows(p, "q_nope_out", "q_pe_out", heads, nope + rope, nope,
                                         out)):
                return False
        elif not (_contiguous_rows(p, "q_pe", None, heads, rope, 0, size)
                  and _contiguous_rows(p, "q_pe_out", None, heads, rope, 0, out)):
            return False
    elif int(p["q_nope_out"]):
        return False
    if int(p["k_pe_out"]) or cache:
        if not _contiguous_rows(p, "k_pe", None, k_heads, rope, 0, size):
            return False
        if int(p["k_pe_out"]) and not _contiguous_rows(p, "k_pe_out", None, k_heads, rope, 0, out):
            return False
    if cache:
        if k_heads != 1 or int(p["kv_c"]) % 16 or int(p["kv_c_stride"]) * size % 16:
            return False
        caches = [("kv_cache", "cache_block_stride", "cache_row_stride")]
        if int(p["kpe_cache"]):
            caches.append(("kpe_cache", "kpe_block_stride", "kpe_row_stride"))
        for pointer, block, row in caches:
            if int(p[pointer]) % 16 or (int(p[block]) * cache_size) % 16 or (
                    int(p[row]) * cache_size) % 16:
                return False
    table = ITEMSIZE[spec.table_dtype]
    if (int(p["table_col_stride"]) != 1 or int(p["table"]) % 16
            or (int(p["table_row_stride"]) * table) % 16):
        return False
    parts = _mla_stage_parts(spec, p)
    return (all(part % 16 == 0 for part in parts)
            and _whole_lines(parts) <= MLA_STAGED_MAX_STAGE_BYTES)


def mla_staged_geometry(p: np.ndarray, resident: int,
                        multiprocessors: int) -> tuple[int, int]:
    """(threads a block, blocks) of a staged MLA launch: a persistent grid of the ``resident``
    blocks an SM holds (the driver's occupancy of the kernel with its stages' shared memory,
    ``launch.occupancy_blocks``), at most one a token."""
    return MLA_STAGED_THREADS, min(int(p["num_tokens"]), max(1, resident) * multiprocessors)


def _store_format(dtype: str | None) -> int:
    return int(STORE_FORMATS[dtype]) if dtype in FP8_DTYPES else 0


def _vector_ok(plan: MlaPlan, arrays: list[tuple[ArrayInfo | None, int]], access: int) -> bool:
    """16-byte accesses: every row dim split into whole accesses and every pointer and stride
    of the arrays touched aligned to one access."""
    rope = plan.rope
    half = rope.rotary_dim // 2
    dims = [rope.rotary_dim if rope.interleaved else half]
    dims += [info.shape[-1] for info in (plan.q_nope, plan.k_nope, plan.kv_c) if info is not None]
    if any(d % access for d in dims):
        return False
    for info, itemsize in arrays:
        if info is None:
            continue
        if info.ptr % (access * itemsize) or any(s % access for s in info.strides[:-1]):
            return False
    return True


def mla_on_gpu(plan: MlaPlan, outputs: list[ArrayInfo | None]) -> None:
    """Launch a checked plan; ``outputs``: ``[q_nope_out, q_pe_out, k_nope_out, k_pe_out]`` as
    ``[T, heads, dim]`` ArrayInfos (None where nothing is written; q_pe / k_pe themselves in
    place)."""
    rope = plan.rope
    device = rope.q.device
    like = rope.q.obj
    op_name = plan.op_name
    if rope.source not in (AngleSource.CACHE_TABLE, AngleSource.COMPUTED):
        raise ValueError(f"{op_name}: on the GPU the MLA ops take a cos_sin_cache or computed "
                         "angles (theta / scaling), not per-token cos / sin tables")
    if rope.mrope_mode != MROPE_NONE:
        raise ValueError(f"{op_name}: M-RoPE positions are not supported by the MLA ops")
    if rope.inverse:
        raise ValueError(f"{op_name}: inverse rotations are not supported by the MLA ops")
    if ((plan.out_dtype is not None or plan.cache_dtype is not None)
            and _compute_capability(device) < FP8_MIN_COMPUTE_CAPABILITY):
        raise RuntimeError(f"{op_name}: fp8 outputs need a GPU of compute capability 8.9 or "
                           f"newer; device {device} has {_compute_capability(device) / 10:.1f}")
    capturing = stream_is_capturing(like, device)

    def needs_warmup(what: str) -> str:
        return (f"{op_name}: called while the stream is being captured into a CUDA graph, but "
                f"{what}; make one call with the same dtypes and angle source before capturing")

    inv_freq = None
    if rope.source == AngleSource.COMPUTED:
        key = (device, rope.inv_freq.tobytes())
        if capturing and key not in device_constants._arrays:
            raise RuntimeError(needs_warmup("the inverse frequencies of this schedule are not on "
                                            "the device yet (uploading them synchronises)"))
        inv_freq = device_constants.inv_freq(device, rope.inv_freq)
    spec, p = plan_mla_launch(plan, outputs,
                              inv_freq_ptr=0 if inv_freq is None else inv_freq.data.ptr)
    staged = mla_staged_applies(spec, p, memory_bandwidth=_memory_bandwidth(device),
                                compute_capability=_compute_capability(device))
    if staged:
        spec = dataclasses.replace(spec, wide_index=True, staged=True)
    if capturing and not is_compiled(spec, device):
        raise RuntimeError(needs_warmup(f"{spec.name_expression} is not compiled yet"))
    kernel = get_kernel(spec, device)
    if rope.q.shape[0] == 0:
        return
    shared_bytes = 0
    if staged:
        shared_bytes = mla_staged_shared_bytes(spec, p)
        resident = occupancy_blocks(kernel, device, MLA_STAGED_THREADS, shared_bytes, op_name)
        block, blocks = mla_staged_geometry(p, resident, _multiprocessors(device))
        grid = (blocks, 1)
    else:
        block, grid = mla_geometry(spec, p, _multiprocessors(device), kernel.num_regs)
    words = (ctypes.c_uint64 * (MLA_PARAMS_DTYPE.itemsize // 8)).from_buffer_copy(p.tobytes())
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(words))
    cupy = cupy_module()
    runtime, driver = cupy.cuda.runtime, cupy.cuda.driver
    previous = runtime.getDevice()
    if previous != device:
        runtime.setDevice(device)
    try:
        driver.launchKernel(kernel.ptr, *grid, 1, block, 1, 1, shared_bytes,
                            current_stream(like, device), ctypes.addressof(argv), 0)
    finally:
        if previous != device:
            runtime.setDevice(previous)


def plan_mla_launch(plan: MlaPlan, outputs: list[ArrayInfo | None], *,
                    inv_freq_ptr: int = 0) -> tuple[MlaSpec, np.ndarray]:
    """The specialisation and the ``MlaParams`` of a plan's launch (no CuPy: the host side of
    the launch, testable anywhere). ``inv_freq_ptr``: the device frequencies of computed
    angles."""
    rope = plan.rope
    # The kernel splits a token's work into items in 32-bit arithmetic (kernels_cu/mla.cuh).
    q_nope_dim = 0 if plan.q_nope is None else plan.q_nope.shape[-1]
    k_nope_dim = 0 if plan.k_nope is None else plan.k_nope.shape[-1]
    token_elements = (rope.q.shape[1] * (q_nope_dim + rope.rotary_dim)
                      + rope.k.shape[1] * (k_nope_dim + rope.rotary_dim)
                      + (plan.kv_c.shape[-1] + rope.rotary_dim if plan.writes_cache else 0))
    if token_elements > TOKEN_ELEMENTS_MAX:
        raise ValueError(f"{plan.op_name}: one token's q, k and cache row hold {token_elements} "
                         f"elements, more than the kernel's {TOKEN_ELEMENTS_MAX}; split the heads "
                         "over several calls")
    p = np.zeros((), dtype=MLA_PARAMS_DTYPE)
    itemsize = ITEMSIZE[rope.q.dtype]
    out_itemsize = 1 if plan.out_dtype is not None else itemsize
    cache_itemsize = 1 if plan.cache_dtype is not None else itemsize
    inputs = (("q_nope", plan.q_nope), ("q_pe", rope.q), ("k_nope", plan.k_nope),
              ("k_pe", rope.k))
    for name, info in inputs:
        if info is not None:
            p[name] = info.ptr
            p[f"{name}_strides"] = info.strides[:2]
    for name, info in zip(("q_nope_out", "q_pe_out", "k_nope_out", "k_pe_out"), outputs):
        if info is not None:
            p[name] = info.ptr
            p[f"{name}_strides"] = info.strides[:2]
    p["num_tokens"], p["num_q_heads"] = rope.q.shape[0], rope.q.shape[1]
    p["num_k_heads"], p["rope_dim"] = rope.k.shape[1], rope.rotary_dim
    p["nope_dim"] = 0 if plan.q_nope is None else plan.q_nope.shape[-1]
    p["k_nope_dim"] = 0 if plan.k_nope is None else plan.k_nope.shape[-1]
    p["rotate"] = int(plan.rotate)
    p["out_format"] = _store_format(plan.out_dtype)
    for name, scale in (("q_scale", plan.q_scale), ("k_scale", plan.k_scale),
                        ("kv_scale", plan.kv_scale)):
        p[f"{name}_value"] = 1.0 if scale is None else scale.value
        if scale is not None and scale.array is not None:
            p[name] = scale.array.ptr
    if rope.positions is not None:
        p["positions"] = rope.positions.ptr
        p["positions_stride"] = rope.positions_strides[0] if rope.positions_strides else 0
        p["positions_int64"] = rope.positions.dtype == "int64"
    table_dtype = "float32"
    if rope.source == AngleSource.CACHE_TABLE:
        table = rope.cache
        table_dtype = table.dtype
        p["table"] = table.ptr
        p["table_row_stride"], p["table_col_stride"] = table.strides[0], table.strides[1]
        p["max_position"] = table.shape[0]
    else:
        p["inv_freq"] = inv_freq_ptr
        p["attention_factor"] = rope.attention_factor
    if plan.writes_cache:
        p["kv_c"], p["kv_c_stride"] = plan.kv_c.ptr, plan.kv_c.strides[0]
        p["kv_cache"], p["rank"] = plan.kv_cache.ptr, plan.kv_c.shape[-1]
        p["cache_block_stride"], p["cache_row_stride"] = plan.kv_cache.strides[:2]
        # kpe_cache 0: k_pe goes after kv_c in the joint row, with the joint row's strides.
        kpe = plan.kv_cache if plan.kpe_cache is None else plan.kpe_cache
        p["kpe_block_stride"], p["kpe_row_stride"] = kpe.strides[:2]
        if plan.kpe_cache is not None:
            p["kpe_cache"] = plan.kpe_cache.ptr
        p["num_slots"] = plan.num_blocks * plan.block_size
        p["block_size"] = plan.block_size
        p["slot_mapping"] = plan.slot_mapping.ptr
        p["slot_stride"] = plan.slot_mapping.strides[0]
        p["slots_int64"] = plan.slot_mapping.dtype == "int64"
        p["cache_format"] = _store_format(plan.cache_dtype)

    access = 16 // itemsize
    arrays = [(plan.q_nope, itemsize), (rope.q, itemsize), (plan.k_nope, itemsize),
              (rope.k, itemsize), (plan.kv_c, itemsize), (plan.kv_cache, cache_itemsize),
              (plan.kpe_cache, cache_itemsize)]
    arrays += [(info, out_itemsize) for info in outputs]
    vector = _vector_ok(plan, arrays, access)
    # 32-bit element offsets where every array the kernel indexes by token, head or slot
    # reaches less than INDEX32_LIMIT elements (positions, slots and the table stay 64-bit).
    wide_index = max([rope.q.shape[0]] + [_extent(info) for info, _ in arrays]) >= INDEX32_LIMIT
    return MlaSpec(rope.q.dtype, table_dtype, vector, rope.interleaved, rope.source,
                   wide_index), p


# ------------------------------------------------------------------------------------------------
# The outputs of an MLA call, and the call itself (GPU launch or NumPy path).


def new_mla_output(x, dtype: str | None, *, heads: bool = True):
    """A new contiguous array shaped like ``x`` (of ``dtype``, by default x's), and the
    description of its memory as ``[T, heads, dim]`` (a 2-d ``[T, dim]`` gains a unit head
    dim)."""
    info = describe(x, "x")
    out = new_output(x, info.kind, info.device, info.shape, dtype or info.dtype)
    view = out[:, None, :] if heads and info.ndim == 2 else out
    out_info = describe(view, "output")
    if dtype is not None and out_info.dtype == "uint8":
        out_info.dtype = dtype  # CuPy's fp8 bits
    return out, out_info


def described_output(x, dtype: str | None):
    """The description of an output view (fp8 for CuPy's uint8 bits)."""
    info = describe(x, "output")
    if dtype is not None and info.dtype == "uint8":
        info.dtype = dtype
    return info


def run_mla(mla, outputs: list) -> None:
    """One launch on the GPU, the NumPy path on the host; ``outputs``: ArrayInfos
    ``[q_nope_out, q_pe_out, k_nope_out, k_pe_out]`` (None where nothing is written)."""
    if mla.rope.q.on_gpu:
        mla_on_gpu(mla, outputs)
    else:
        mla_on_host(mla, [None if info is None else host_view(info) for info in outputs])
    written = [info.obj for info in outputs if info is not None]
    if mla.writes_cache:
        written += [info.obj for info in (mla.kv_cache, mla.kpe_cache) if info is not None]
    mark_written(*written)
