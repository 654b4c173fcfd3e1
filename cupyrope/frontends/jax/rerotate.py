"""``rerotate_cache`` on JAX arrays: the functional form, which returns the re-rotated cache (XLA
updates it in place where the caller donates it, e.g. ``jax.jit(..., donate_argnums=...)``).

The call is checked while tracing (:func:`cupyrope.core.rerotate.plan_rerotate` on the shapes
and dtypes) and is a jax.numpy formulation on every platform: a gather of the slots' rows, the
rotation in float32 by the angles of :mod:`cupyrope.frontends.jax.lowering` (the table row of the
delta, or ``delta * inv_freq`` reduced exactly), one rounding to the cache's format, and a
scatter back. XLA fuses the three; ``jax.jit``, ``jax.vmap`` and ``jax.grad`` (through the
cache) work as for any jax.numpy code. Design: ``docs/rerotate.md``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ...core.abi import AngleSource
from ...core.arrays import describe, describe_traced
from ...core.dtypes import FP8_DTYPES, numpy_dtype
from ...core.rerotate import OP_NAME, RerotatePlan, check_rerotate_values, plan_rerotate
from .lowering import _stored, cos_sin_per_token

_ARRAYS = ("k_cache", "slots", "delta", "cos_sin_cache", "k_scale")
_INT32_RANGE = (-2**31, 2**31 - 1)


def _jax_or_numpy(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer, np.ndarray))


def is_rerotate_on_jax(k_cache, slots, delta, cos_sin_cache, k_scale) -> bool:
    """Whether a call belongs here: a JAX cache (arrays are immutable: the new cache is returned)
    or a JAX tracer among the arguments."""
    return isinstance(k_cache, (jax.Array, jax.core.Tracer)) or any(
        isinstance(x, jax.core.Tracer) for x in (slots, delta, cos_sin_cache, k_scale))


def _info(x, name: str):
    """What the checks see of an argument: the shape and dtype of a JAX array or tracer (the
    cache as written: the call returns a new one), a NumPy array as it is."""
    if isinstance(x, np.ndarray):
        info = describe(x, name)
    else:
        info = describe_traced(x, name)
    if name == "k_cache":
        info.writable = True
    elif name == "k_scale" and info.size == 1:
        info.view = np.ones(info.shape, np.float32)  # the checks read a value; the call reads x
    return info


def rerotate_cache(k_cache, slots, delta, *, cos_sin_cache=None, theta=10000.0, scaling=None,
                   interleaved=False, rotary_dim=None, layout="NHD", k_scale=None,
                   cache_dtype=None, validate=False, seq_len=None):
    """:func:`cupyrope.rerotate_cache` on JAX arrays and tracers: same arguments and errors,
    returns the new cache (a JAX array). ``validate=True`` needs concrete slots and deltas (it
    reads them on the host)."""
    given = dict(zip(_ARRAYS, (k_cache, slots, delta, cos_sin_cache, k_scale)))
    for name, x in given.items():
        if x is None or (name in ("delta", "k_scale") and not hasattr(x, "shape")):
            continue  # a Python number: static
        if not _jax_or_numpy(x):
            raise TypeError(f"{OP_NAME}: {name} must be a JAX or NumPy array when k_cache is a "
                            f"JAX array or another argument a tracer, got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
    if isinstance(k_cache, np.ndarray):
        raise TypeError(f"{OP_NAME}: k_cache is a NumPy array in a call with JAX tracers; pass it "
                        "as a JAX array (the call returns the new cache)")
    infos = {name: x if (x is None or not hasattr(x, "shape")) else _info(x, name)
             for name, x in given.items()}
    plan = plan_rerotate(infos["k_cache"], infos["slots"], infos["delta"],
                         cos_sin_cache=infos["cos_sin_cache"], theta=theta, scaling=scaling,
                         interleaved=interleaved, rotary_dim=rotary_dim, layout=layout,
                         k_scale=infos["k_scale"], cache_dtype=cache_dtype, seq_len=seq_len)
    if plan.delta is None and not jax.config.jax_enable_x64 and not (
            _INT32_RANGE[0] <= plan.delta_value <= _INT32_RANGE[1]):
        raise ValueError(f"{OP_NAME}: delta {plan.delta_value} does not fit int32, the integer "
                         "width of JAX without jax_enable_x64")
    if validate:
        traced = [name for name in ("slots", "delta") if isinstance(given[name], jax.core.Tracer)]
        if traced:
            raise TypeError(f"{OP_NAME}: validate=True reads {' and '.join(traced)} on the host, "
                            "but under a JAX transformation they are traced; validate outside "
                            "jax.jit, or leave validate off")
        check_rerotate_values(_with_host_values(plan, given))
    arrays = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x
              for name, x in given.items()}
    return rerotate_jnp(plan, arrays["k_cache"], arrays["slots"], arrays["delta"],
                        arrays["cos_sin_cache"], arrays["k_scale"])


def _with_host_values(plan: RerotatePlan, given: dict) -> RerotatePlan:
    """The plan with host views of concrete slots and deltas, for the value checks."""
    slots = describe(np.asarray(given["slots"]), "slots")
    delta = plan.delta if plan.delta is None else describe(np.asarray(given["delta"]), "delta")
    return dataclasses.replace(plan, slots=slots, delta=delta)


def rerotate_jnp(plan: RerotatePlan, k_cache, slots, delta, cos_sin_cache, k_scale):
    """The new cache, as the NumPy path (``core.rerotate.rerotate_on_host``) computes it: rows of
    valid slots decoded to float32 (fp8: times the scale), rotated by the delta's angles, rounded
    once to the cache's format; padding and slots past the cache dropped from the scatter."""
    rope = plan.rope
    if plan.is_empty:
        return k_cache
    if delta is None or not hasattr(delta, "shape"):
        delta = jnp.full((1,), plan.delta_value,
                         jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    cos, sin = cos_sin_per_token(rope, delta, cos_sin_cache, None, None)  # [N, half]
    if rope.source == AngleSource.CACHE_TABLE:  # the angle alone (core.rerotate)
        inverse = jnp.float32(1) / cos_sin_cache[0, :rope.rotary_dim // 2].astype(jnp.float32)
        cos, sin = cos * inverse, sin * inverse
    cos, sin = cos[:, None, :].astype(jnp.float32), sin[:, None, :].astype(jnp.float32)
    slots = slots.astype(jnp.int32 if plan.cache_slots < 2**31 else jnp.int64)
    valid = (slots >= 0) & (slots < plan.cache_slots)
    blocks = jnp.where(valid, slots // plan.block_size, 0)
    rows = jnp.where(valid, slots % plan.block_size, 0)
    fmt = numpy_dtype(plan.cache_dtype)
    values = jax.lax.bitcast_convert_type(k_cache, fmt) if k_cache.dtype == jnp.uint8 else k_cache
    r, half = rope.rotary_dim, rope.rotary_dim // 2
    gathered = values[blocks, rows] if plan.layout == "NHD" else values[blocks, :, rows]
    x = gathered[..., :r].astype(jnp.float32)  # [N, heads, r]
    scale = None
    if plan.cache_dtype in FP8_DTYPES:
        scale = (jnp.float32(plan.scale.value) if k_scale is None or not hasattr(k_scale, "shape")
                 else jnp.asarray(k_scale, jnp.float32).reshape(()))
        x = x * scale
    if rope.interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if rope.interleaved:
        y = jnp.stack((y1, y2), axis=-1).reshape(x.shape)
    else:
        y = jnp.concatenate((y1, y2), axis=-1)
    stored = _stored(y, fmt, scale)
    if k_cache.dtype == jnp.uint8:
        stored = jax.lax.bitcast_convert_type(stored, jnp.uint8)
    dropped = jnp.where(valid, blocks, plan.num_blocks)  # out of range: not written
    if plan.layout == "NHD":
        return k_cache.at[dropped, rows, :, :r].set(stored, mode="drop")
    return k_cache.at[dropped, :, rows, :r].set(stored, mode="drop")
