"""The vectorised NumPy path: the same semantics as the kernels, for arrays on the CPU.

Arithmetic mirrors the kernels: cos/sin in float32 (float64 for float64 arrays), each pair rotated
as ``x1 * cos - x2 * sin``, ``x2 * cos + x1 * sin`` and rounded once to the output dtype.
"""

from __future__ import annotations

import numpy as np

from .abi import AngleSource
from .arrays import host_view
from .dtypes import compute_dtype
from .frequencies import cos_sin_table
from .mrope import MROPE_NONE, mrope_components
from .plan import RopePlan


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
