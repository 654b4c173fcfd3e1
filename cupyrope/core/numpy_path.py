"""The vectorised NumPy path: the same semantics as the kernels, for arrays on the CPU.

Arithmetic mirrors the kernels: cos/sin in float32 (float64 for float64 arrays), each pair rotated
as ``x1 * cos - x2 * sin``, ``x2 * cos + x1 * sin`` and rounded once to the output dtype.
"""

from __future__ import annotations

import numpy as np

from .abi import AngleSource
from .arrays import host_view
from .dtypes import compute_dtype, numpy_dtype
from .frequencies import cos_sin_table
from .fused_plan import E2M1_MAX, FP8_MAX, NVFP4, NVFP4_BLOCK
from .mrope import MROPE_NONE, mrope_components
from .plan import RopePlan, check_dense_heads


def _token_view(table: np.ndarray, strides: tuple[int, ...], token_shape, columns) -> np.ndarray:
    """``table`` indexed at every token (broadcast, zero-copy) and at the given columns."""
    item = table.itemsize
    base = np.lib.stride_tricks.as_strided(
        table, shape=tuple(token_shape) + (table.shape[-1],),
        strides=tuple(s * item for s in strides) + (table.strides[-1],),
    )
    return base[..., columns]


def _positions(plan: RopePlan) -> np.ndarray:
    """Positions of every token, ``token_shape``; under M-RoPE the position of every token and
    pair, ``token_shape + (rotary_dim // 2,)`` (each pair's own component)."""
    token_shape = plan.token_shape
    if plan.positions is None:
        last = token_shape[-1] if token_shape else 1
        return np.broadcast_to(np.arange(last, dtype=np.int64), token_shape or (1,)).reshape(
            token_shape)
    values = np.asarray(host_view(plan.positions)).astype(np.int64)
    if plan.mrope_mode != MROPE_NONE:
        per_component = [_broadcast_positions(v, token_shape) for v in values]  # 3 x token_shape
        components = mrope_components(plan.mrope_mode, plan.mrope_sections, plan.rotary_dim // 2)
        return np.stack(per_component, axis=-1)[..., components]
    return _broadcast_positions(values, token_shape)


def _broadcast_positions(values: np.ndarray, token_shape) -> np.ndarray:
    return np.broadcast_to(values.reshape(values.shape[max(0, values.ndim - len(token_shape)):]),
                           token_shape)


def cos_sin_per_token(plan: RopePlan) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every token and pair, shape ``token_shape + (rotary_dim // 2,)``."""
    compute = compute_dtype(plan.q.dtype)
    half = plan.rotary_dim // 2
    if plan.source == AngleSource.COMPUTED:
        positions = _positions(plan)
        if plan.mrope_mode != MROPE_NONE:  # already one position per pair
            angles = positions.astype(np.float64) * plan.inv_freq
            cos = np.cos(angles) * plan.attention_factor
            sin = np.sin(angles) * plan.attention_factor
        else:
            cos, sin = cos_sin_table(positions, plan.inv_freq, plan.attention_factor)
        cos, sin = cos.astype(compute), sin.astype(compute)
    elif plan.source == AngleSource.CACHE_TABLE:
        cache = np.asarray(host_view(plan.cache))
        positions = _positions(plan)
        inside = (positions >= 0) & (positions < cache.shape[0])
        safe = np.where(inside, positions, 0)  # never index outside the cache
        if plan.mrope_mode != MROPE_NONE:  # one row per pair: gather entry j of row positions[..., j]
            columns = np.arange(half)
            cos = cache[safe, columns].astype(compute)
            sin = cache[safe, columns + half].astype(compute)
        else:
            rows = cache[safe]
            cos = rows[..., :half].astype(compute)
            sin = rows[..., half:2 * half].astype(compute)
        cos[~inside] = np.nan
        sin[~inside] = np.nan
    else:
        # Full-width interleaved tables repeat each entry: pair j reads column 2j.
        full_width_interleaved = plan.interleaved and plan.cos.shape[-1] == plan.rotary_dim
        columns = np.arange(half) * (2 if full_width_interleaved else 1)
        cos = _token_view(np.asarray(host_view(plan.cos)), plan.cos_strides, plan.token_shape,
                          columns).astype(compute)
        sin = _token_view(np.asarray(host_view(plan.sin)), plan.sin_strides, plan.token_shape,
                          columns).astype(compute)
    if plan.inverse:
        sin = -sin
    return cos, sin


def rotate_on_host(plan: RopePlan, outputs) -> None:
    """Rotate q (and k) of a CPU plan into ``outputs`` (NumPy views; the inputs when in place)."""
    cos, sin = cos_sin_per_token(plan)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    r, half = plan.rotary_dim, plan.rotary_dim // 2
    compute = cos.dtype
    inputs = [plan.q] + ([plan.k] if plan.k is not None else [])
    for info, out in zip(inputs, outputs):
        x = np.asarray(host_view(info))
        if plan.interleaved:
            first, second = slice(0, r, 2), slice(1, r, 2)
        else:
            first, second = slice(0, half), slice(half, r)
        x1 = x[..., first].astype(compute)
        x2 = x[..., second].astype(compute)
        rotated1 = x1 * cos - x2 * sin
        rotated2 = x2 * cos + x1 * sin
        if not plan.inplace and r < plan.head_dim:
            out[..., r:] = x[..., r:]
        out[..., first] = rotated1
        out[..., second] = rotated2


def store_as(values: np.ndarray, dtype: str, scale: float = 1.0) -> np.ndarray:
    """float32 values as ``dtype``, rounded once; fp8 stores ``value / scale`` as the kernels do:
    ``value * (1 / scale)`` with the reciprocal rounded to float32, saturated to the format's
    largest finite value (NaN stays NaN)."""
    if dtype in FP8_MAX:
        limit = np.float32(FP8_MAX[dtype])
        inverse = np.float32(1) / np.float32(scale)
        scaled = np.clip(values * inverse, -limit, limit)
        return scaled.astype(numpy_dtype(dtype))
    return values.astype(numpy_dtype(dtype))


def _write(out: np.ndarray, index, values: np.ndarray, dtype: str, scale: float) -> None:
    _put(out, index, store_as(values, dtype, scale))


def _put(out: np.ndarray, index, stored: np.ndarray) -> None:
    if out.dtype == np.uint8 and stored.dtype != np.uint8:  # fp8 bits in a uint8 array
        stored = stored.view(np.uint8)
    out[index] = stored


def store_per_row(values: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored, scales): float32 rows (last axis) as fp8 ``dtype``, each with its own scale, as
    the kernels do (kernels_cu/quantize.cuh): ``scale = amax / the format's largest value``
    (float32 division; at least the smallest normal float32, so an all-zero row stores zeros
    with scale 2^-126), then ``value * (1 / scale)`` as :func:`store_as`. A NaN makes its row's
    scale NaN."""
    amax = np.max(np.abs(values), axis=-1)
    scales = amax / np.float32(FP8_MAX[dtype])
    tiny = np.finfo(np.float32).tiny
    scales = np.where(scales < tiny, tiny, scales).astype(np.float32)
    limit = np.float32(FP8_MAX[dtype])
    inverse = np.float32(1) / scales
    stored = np.clip(values * inverse[..., None], -limit, limit).astype(numpy_dtype(dtype))
    return stored, scales


def e2m1_codes(values: np.ndarray) -> np.ndarray:
    """uint8 e2m1 codes of float32 values in [-6, 6], rounded to nearest even onto {0, 0.5, 1,
    1.5, 2, 3, 4, 6} (each threshold passed adds one code; ties go to the even code), sign in
    bit 3."""
    a = np.abs(values)
    codes = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
             + (a >= 3.5) + (a > 5.0)).astype(np.uint8)
    return codes | (np.signbit(values).astype(np.uint8) << 3)


def nvfp4_quantize(values: np.ndarray, global_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(packed, block_scales): float32 rows (last axis, a multiple of 16) in NVFP4 as the
    kernels store them: per 16 values, the e4m3 block scale ``s = e4m3((amax / 6) * (1 / g))``
    (saturated at 448), and the e2m1 codes of ``x * (1 / (s * g))`` clamped to +-6, two per
    byte, the even value in the low nibble (uint8, last axis halved); block scales as uint8 e4m3
    bits. ``g`` is the float32 global scale: a reader dequantises ``e2m1 * s * g``."""
    g = np.float32(global_scale)
    blocks = values.reshape(values.shape[:-1] + (values.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))
    amax = np.max(np.abs(blocks), axis=-1)
    block_scale = (amax / np.float32(E2M1_MAX)) * (np.float32(1) / g)
    scales = np.minimum(block_scale, np.float32(FP8_MAX["float8_e4m3fn"])).astype(
        numpy_dtype("float8_e4m3fn"))
    scale_values = scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        to_grid = np.where(scale_values == 0, np.float32(0),
                           np.float32(1) / (scale_values * g)).astype(np.float32)
        scaled = blocks * to_grid[..., None]
    limit = np.float32(E2M1_MAX)
    codes = e2m1_codes(np.fmin(np.fmax(scaled, -limit), limit)).reshape(values.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), scales.view(np.uint8)


def fused_on_host(plan: RopePlan, outputs) -> None:
    """A fused call on the CPU: RMSNorm of each head (float32), the rotation, the stores to the
    outputs (input dtype or fp8) and to the KV cache, with the kernels' arithmetic."""
    check_dense_heads(plan)  # as the fused kernels, so that both paths accept the same calls
    f = plan.fusion
    if not f.rotate:  # write_cache: k and v into the caches as they are, nothing else written
        _write_cache(plan, np.asarray(host_view(plan.k)).astype(np.float32),
                     k_raw=np.asarray(host_view(plan.k)))
        return
    cos, sin = cos_sin_per_token(plan)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    r, half = plan.rotary_dim, plan.rotary_dim // 2
    if plan.interleaved:
        first, second = slice(0, r, 2), slice(1, r, 2)
    else:
        first, second = slice(0, half), slice(half, r)
    out_dtype = f.out_dtype or plan.q.dtype
    write_pass = not plan.inplace or f.norm or f.out_dtype is not None
    inputs = [plan.q] + ([plan.k] if plan.k is not None else [])
    scales = [f.q_scale, f.k_scale]
    rotated = []
    for which, (info, out) in enumerate(zip(inputs, outputs)):
        x = np.asarray(host_view(info)).astype(np.float32)
        if f.norm:
            weight = host_view(f.q_weight if which == 0 else f.k_weight).astype(np.float32)
            # Over each head, or over all heads of the token together (weights of every head).
            axes = (-2, -1) if f.all_heads else -1
            weight = weight.reshape(x.shape[-2:]) if f.all_heads else weight
            mean = np.mean(x * x, axis=axes, keepdims=True, dtype=np.float32)
            rms = np.float32(1) / np.sqrt(mean + np.float32(f.eps))
            x = x * (rms * (np.float32(f.weight_offset) + weight))
        y = x.copy()
        x1, x2 = x[..., first], x[..., second]
        y[..., first] = x1 * cos - x2 * sin
        y[..., second] = x2 * cos + x1 * sin
        rotated.append(y)
        columns = slice(None) if write_pass else slice(0, r)
        if f.out_dtype is not None and scales[which].rows is not None:  # fp8, a scale a row
            stored, row_scales = store_per_row(y, out_dtype)
            _put(out, Ellipsis, stored)
            np.asarray(host_view(scales[which].rows))[...] = row_scales
        else:
            _write(out, (Ellipsis, columns), y[..., columns], out_dtype, scales[which].value)
    if f.writes_cache:
        _write_cache(plan, rotated[1])


def _write_cache(plan: RopePlan, k_rotated: np.ndarray, k_raw: np.ndarray | None = None) -> None:
    """Rotated k (``k_raw``, when given, k unrotated) and unchanged v into the rows of their slots
    (padding and slots past the cache are skipped, as on the GPU). Values stored unchanged in a
    cache of their own dtype are copied bit for bit (NaN payloads included), as the kernels do."""
    f = plan.fusion
    slots = np.asarray(host_view(f.slot_mapping)).astype(np.int64)
    valid = (slots >= 0) & (slots < f.num_slots)
    blocks, within = slots[valid] // f.block_size, slots[valid] % f.block_size
    index = (blocks, within) if f.layout == "NHD" else (blocks, slice(None), within)
    dtype = f.cache_dtype or plan.q.dtype
    v = np.asarray(host_view(f.v)).astype(np.float32)
    if f.cache_dtype == NVFP4:
        for cache, block_scales, rows, scale in (
                (f.k_cache, f.k_cache_scales, k_rotated[valid], f.k_scale),
                (f.v_cache, f.v_cache_scales, v[valid], f.v_scale)):
            packed, scale_bits = nvfp4_quantize(rows, scale.value)
            np.asarray(host_view(cache))[index] = packed
            np.asarray(host_view(block_scales)).view(np.uint8)[index] = scale_bits
        return
    if f.v_scale.rows is not None:  # fp8 with a scale per (slot, head) row
        for cache, rows, scale in ((f.k_cache, k_rotated[valid], f.k_scale),
                                   (f.v_cache, v[valid], f.v_scale)):
            stored, row_scales = store_per_row(rows, dtype)
            _put(np.asarray(host_view(cache)), index, stored)
            np.asarray(host_view(scale.rows))[index] = row_scales
        return
    if f.cache_dtype is None:
        if k_raw is None:
            _write(np.asarray(host_view(f.k_cache)), index, k_rotated[valid], dtype, 1.0)
        else:
            np.asarray(host_view(f.k_cache))[index] = k_raw[valid]
        np.asarray(host_view(f.v_cache))[index] = np.asarray(host_view(f.v))[valid]
        return
    _write(np.asarray(host_view(f.k_cache)), index, k_rotated[valid], dtype, f.k_scale.value)
    _write(np.asarray(host_view(f.v_cache)), index, v[valid], dtype, f.v_scale.value)
