"""The jax.numpy formulation of cupyrope's ops: what a traced call becomes on XLA's CPU (and on any
platform without a native lowering), with the semantics of the NumPy path. Each function takes the
checked plan of the call and the arrays, and returns the outputs as JAX values (the primitives
lower through them with ``mlir.lower_fun``). Design (angles, rounding): ``docs/jax_internals.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core.abi import AngleSource
from ...core.dtypes import compute_dtype, numpy_dtype
from ...core.fused_plan import E2M1_MAX, FP8_MAX, NVFP4, NVFP4_BLOCK
from ...core.mrope import MROPE_NONE, mrope_components
from ...core.plan import RopePlan

# The scale arrays a fused call may write, in the order its results give them.
_WRITTEN = ("q_scale", "k_scale", "v_scale", "k_cache_scales", "v_cache_scales")
# floor(2^192 / (2 pi)): 1 / (2 pi) as a 192-bit binary fraction.
_INV_TWO_PI_192 = 0x28BE60DB9391054A7F09D5F47D4D377036D8A5664F10E410
_FRACTION_LIMBS = 5  # inv_freq / 2pi modulo 1 in 16-bit limbs: 80 bits


def _chunks_of_12_bits(value: float, count: int) -> tuple[np.float32, ...]:
    """``value`` as ``count`` float32 of at most 12 significant bits each, leading first."""
    chunks = []
    for _ in range(count):
        exponent = np.frexp(value)[1]
        chunk = np.ldexp(np.trunc(np.ldexp(value, 12 - exponent)), exponent - 12)
        chunks.append(np.float32(chunk))
        value -= chunk
    return tuple(chunks)


_TWO_PI_CHUNKS = _chunks_of_12_bits(2 * np.pi, 3)  # 36 bits of 2pi
# Adding and subtracting 1.5 * 2^18 rounds |x| < 2^7 to a multiple of 2^-5: 12 bits.
_TWELVE_BITS_BELOW_2_7 = np.float32(1.5 * 2.0 ** 18)


def rotate(plan: RopePlan, q, k, positions, cache, cos, sin):
    """(q_out, k_out or None) of a plain rotation: q ``[..., Hq, D]``, k ``[..., Hk, D]``, in
    their dtypes."""
    cos_t, sin_t = cos_sin_per_token(plan, positions, cache, cos, sin)
    return tuple(None if x is None else _rotated(plan, x, cos_t, sin_t).astype(x.dtype)
                 for x in (q, k))


def fused(plan: RopePlan, q, k, positions, cache, cos, sin, *, q_weight=None, k_weight=None,
          scales=None, v=None, k_cache=None, v_cache=None, slot_mapping=None,
          k_cache_scales=None, v_cache_scales=None):
    """The outputs of a fused call, as ``numpy_path.fused_on_host`` computes them: q_out (k_out)
    in the plan's out_dtype (fp8) or the input dtype, then the new caches when the call writes
    them, then the new scale arrays it writes (per-row q_scale, k_scale, v_scale, NVFP4 block
    scales, in that order). ``scales``: name -> float, a 0-d / one-element float32 array
    (``q_scale``, ``k_scale``, ``v_scale``), or a cache's per-row scale array."""
    f = plan.fusion
    # write_cache rotates nothing (and has no angle source): k goes to the cache as it is.
    cos_t, sin_t = (cos_sin_per_token(plan, positions, cache, cos, sin) if f.rotate
                    else (None, None))
    out_dtype = numpy_dtype(f.out_dtype or plan.q.dtype)
    outputs, rotated, row_scales = [], [], {}
    for name, x, weight in (("q", q, q_weight), ("k", k, k_weight)):
        if x is None:
            continue
        x = x.astype(jnp.float32)
        if f.norm:  # over each head, or over all heads of the token together
            axes = (-2, -1) if f.all_heads else -1
            weight = weight.reshape(x.shape[-2:]) if f.all_heads else weight
            mean = jnp.mean(x * x, axis=axes, keepdims=True)
            rms = jnp.float32(1) / jnp.sqrt(mean + jnp.float32(f.eps))
            x = x * (rms * (jnp.float32(f.weight_offset) + weight.astype(jnp.float32)))
        y = _rotated(plan, x, cos_t, sin_t) if f.rotate else x
        rotated.append(y)
        scale = getattr(f, f"{name}_scale")
        if f.out_dtype is not None and scale.rows is not None:  # fp8, a scale a row
            stored, row_scales[f"{name}_scale"] = _stored_per_row(y, out_dtype)
            outputs.append(stored)
        else:
            outputs.append(_stored(y, out_dtype, scales.get(f"{name}_scale")))
    if f.writes_cache:
        cache_format = f.cache_dtype if f.cache_dtype == NVFP4 else numpy_dtype(
            f.cache_dtype or plan.q.dtype)
        # write_cache stores k as given (its bits, NaN payloads included, in a cache of its dtype).
        caches, cache_scales = _cache_write(
            f, rotated[1] if f.rotate else k, v, k_cache, v_cache, slot_mapping, cache_format,
            scales, (k_cache_scales, v_cache_scales))
        outputs += caches
        row_scales.update(cache_scales)
    return tuple(outputs) + tuple(row_scales[name] for name in _WRITTEN if name in row_scales)


def cos_sin_per_token(plan: RopePlan, positions, cache, cos, sin):
    """cos and sin of every token and pair, ``token_shape + (rotary_dim // 2,)``, in the compute
    dtype, sin negated for ``inverse``."""
    compute = compute_dtype(plan.q.dtype)
    half = plan.rotary_dim // 2
    if plan.source == AngleSource.TOKEN_TABLES:
        step = 2 if plan.interleaved and cos.shape[-1] == plan.rotary_dim else 1
        cos_t, sin_t = (_per_token(t, plan.token_shape)[..., 0:step * half:step].astype(compute)
                        for t in (cos, sin))
    else:
        pair_positions = _pair_positions(plan, positions)  # token_shape + (half or 1,)
        if plan.source == AngleSource.CACHE_TABLE:
            cos_t, sin_t = _cache_rows(plan, cache, pair_positions, compute)
        else:
            cos_t, sin_t = _computed(plan, pair_positions, compute)
    return cos_t, (-sin_t if plan.inverse else sin_t)


def _per_token(table, token_shape):
    """A per-token table ``[..., w]`` broadcast to ``token_shape + (w,)`` (leading dims past the
    token dims are ones: the plan checked it)."""
    extra = max(0, table.ndim - 1 - len(token_shape))
    table = table.reshape(table.shape[extra:])
    return jnp.broadcast_to(table, tuple(token_shape) + table.shape[-1:])


def _pair_positions(plan: RopePlan, positions):
    """The position of every token, ``token_shape + (1,)``; under M-RoPE the position of every
    token and pair, ``token_shape + (rotary_dim // 2,)`` (each pair's own component)."""
    token_shape = tuple(plan.token_shape)
    if positions is None:  # arange along the last token dim; one token at 0 for q [H, D]
        if not token_shape:
            return jnp.zeros((1,), jnp.int32)
        return jax.lax.broadcasted_iota(jnp.int32, token_shape + (1,), len(token_shape) - 1)
    if plan.mrope_mode == MROPE_NONE:
        return _broadcast_positions(positions, token_shape)[..., None]
    components = mrope_components(plan.mrope_mode, plan.mrope_sections, plan.rotary_dim // 2)
    per_component = jnp.stack([_broadcast_positions(p, token_shape) for p in positions], axis=-1)
    return per_component[..., components]


def _broadcast_positions(values, token_shape):
    values = values.reshape(values.shape[max(0, values.ndim - len(token_shape)):])
    return jnp.broadcast_to(values, token_shape)


def _cache_rows(plan: RopePlan, cache, pair_positions, compute):
    """cos / sin from the cache rows of the positions; NaN where a position is outside it (its
    row is never read)."""
    half = plan.rotary_dim // 2
    inside = (pair_positions >= 0) & (pair_positions < cache.shape[0])
    rows = jnp.where(inside, pair_positions, 0)
    columns = jnp.arange(half)
    if plan.mrope_mode == MROPE_NONE:  # one row per token
        rows = rows[..., 0]
        cos_t, sin_t = cache[rows, :half], cache[rows, half:2 * half]
    else:  # one row per pair: entry j of row positions[..., j]
        cos_t, sin_t = cache[rows, columns], cache[rows, columns + half]
    nan = jnp.array(np.nan, compute)
    return (jnp.where(inside, cos_t.astype(compute), nan),
            jnp.where(inside, sin_t.astype(compute), nan))


def _computed(plan: RopePlan, pair_positions, compute):
    """cos / sin of ``position * inv_freq`` times the attention factor."""
    if jax.config.jax_enable_x64:  # float64 product and reduction, as the NumPy path
        angles = pair_positions.astype(jnp.float64) * jnp.asarray(plan.inv_freq, jnp.float64)
        factor = jnp.float64(plan.attention_factor)
        return (jnp.cos(angles) * factor).astype(compute), (jnp.sin(angles) * factor).astype(compute)
    sin_t, cos_t = _sincos_fixed_point(pair_positions, plan.inv_freq)
    not_finite = np.where(np.isfinite(plan.inv_freq), 0.0, np.nan).astype(np.float32)
    factor = jnp.float32(plan.attention_factor)
    return (cos_t * factor + not_finite).astype(compute), (sin_t * factor + not_finite).astype(compute)


def turns_limbs(inv_freq: np.ndarray) -> np.ndarray:
    """``inv_freq / 2pi`` modulo 1 as 16-bit limbs, ``[len(inv_freq), 5]`` uint32: limb ``i``
    weighs ``2^(-16 (i + 1))``. Exact from the float64 values (Python integers) but for the
    truncation past 2^-80; non-finite values give zeros (their cos/sin are made NaN apart)."""
    limbs = np.zeros((len(inv_freq), _FRACTION_LIMBS), np.uint32)
    bits = 16 * _FRACTION_LIMBS
    for j, value in enumerate(np.asarray(inv_freq, np.float64)):
        if not np.isfinite(value):
            continue
        numerator, denominator = float(value).as_integer_ratio()  # denominator: a power of 2
        fraction = (numerator * _INV_TWO_PI_192 << bits) // (denominator << 192) % (1 << bits)
        for i in range(_FRACTION_LIMBS):
            limbs[j, i] = (fraction >> (bits - 16 * (i + 1))) & 0xFFFF
    return limbs


def _turns_fraction(positions, limbs):
    """The fraction of a turn of ``|position| * inv_freq`` in 16-bit limbs (weights 2^-16,
    2^-32, 2^-48, 2^-64), exactly (but for the limbs' truncation past 2^-80 of inv_freq / 2pi).
    ``positions``: int32 ``[..., n]``, ``limbs``: uint32 ``[n, 5]`` (:func:`turns_limbs`)."""
    magnitude = jnp.abs(positions).astype(jnp.uint32)  # |-2^31| wraps to 2^31: right as uint32
    position_limbs = (magnitude & 0xFFFF, magnitude >> 16)  # weights 1, 2^16
    # accumulators[i] weighs 2^(-16 i); index 0 (whole turns) is dropped. A product of 16-bit
    # limbs fits 32 bits; each accumulator sums at most four 16-bit halves.
    accumulators = [jnp.zeros(positions.shape, jnp.uint32) for _ in range(_FRACTION_LIMBS + 1)]
    for shift, p in enumerate(position_limbs):
        for i in range(_FRACTION_LIMBS):
            product = p * jnp.asarray(limbs[:, i])  # weight 2^(-16 (i + 1 - shift))
            weight = i + 1 - shift
            if weight - 1 >= 1:
                accumulators[weight - 1] = accumulators[weight - 1] + (product >> 16)
            if weight >= 1:
                accumulators[weight] = accumulators[weight] + (product & 0xFFFF)
    for i in range(_FRACTION_LIMBS, 1, -1):  # carries, lowest limb first
        accumulators[i - 1] = accumulators[i - 1] + (accumulators[i] >> 16)
        accumulators[i] = accumulators[i] & 0xFFFF
    return [a & 0xFFFF for a in accumulators[1:_FRACTION_LIMBS]]


def _sincos_fixed_point(positions, inv_freq):
    """float32 (sin, cos) of ``positions * inv_freq`` (int32 positions ``[..., n or 1]``,
    float64 inv_freq ``[n]``) from the exact fraction of a turn (see the module docstring)."""
    positions = positions.astype(jnp.int32)
    top, second, third, fourth = _turns_fraction(positions, turns_limbs(inv_freq))
    rounded = top.astype(jnp.int32) + 0x2000  # + 1/8 turn: the nearest quarter turn
    quadrant = (rounded >> 14) & 3
    # The rest, in [-1/8, 1/8) turn, times 2^32: an exact int32 (30 bits) plus two limbs (below
    # 2^-48 turn, rounded). Times 2pi as a sum of products of 12-bit floats: each product exact,
    # so the sum rounds the same whether or not XLA fuses a product into an addition.
    leading = (((rounded & 0x3FFF) - 0x2000) << 16) + second.astype(jnp.int32)
    top_chunk = (leading >> 17).astype(jnp.float32) * jnp.float32(2.0 ** 17)
    middle_chunk = ((leading >> 5) & 0xFFF).astype(jnp.float32) * jnp.float32(2.0 ** 5)
    low_chunk = ((leading & 0x1F).astype(jnp.float32)
                 + third.astype(jnp.float32) * jnp.float32(2.0 ** -16)
                 + fourth.astype(jnp.float32) * jnp.float32(2.0 ** -32))
    low_chunk = (low_chunk + _TWELVE_BITS_BELOW_2_7) - _TWELVE_BITS_BELOW_2_7  # 12 bits
    p0, p1, p2 = _TWO_PI_CHUNKS
    # smallest terms first, so that only the last addition rounds at the result's magnitude
    turned = (middle_chunk * p2 + low_chunk * p1) + low_chunk * p2
    turned = (top_chunk * p2 + middle_chunk * p1 + low_chunk * p0) + turned
    turned = (top_chunk * p1 + middle_chunk * p0) + turned
    turned = top_chunk * p0 + turned
    reduced = turned * jnp.float32(2.0 ** -32)  # exact
    negative = positions < 0  # angle(-p) = -angle(p)
    reduced = jnp.where(negative, -reduced, reduced)
    quadrant = jnp.where(negative, (4 - quadrant) & 3, quadrant)
    s, c = jnp.sin(reduced), jnp.cos(reduced)
    sin_t = jnp.select([quadrant == 0, quadrant == 1, quadrant == 2], [s, c, -s], -c)
    cos_t = jnp.select([quadrant == 0, quadrant == 1, quadrant == 2], [c, -s, -c], s)
    return sin_t, cos_t


def _rotated(plan: RopePlan, x, cos_t, sin_t):
    """x ``[..., H, D]`` rotated in the compute dtype (dims past rotary_dim as they are, in the
    compute dtype: exact)."""
    cos_t, sin_t = cos_t[..., None, :], sin_t[..., None, :]  # broadcast over heads
    r, half = plan.rotary_dim, plan.rotary_dim // 2
    x = x.astype(cos_t.dtype)
    if plan.interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    else:
        x1, x2 = x[..., :half], x[..., half:r]
    first, second = x1 * cos_t - x2 * sin_t, x2 * cos_t + x1 * sin_t
    if plan.interleaved:  # pairs (2j, 2j + 1) back side by side
        rotated = jnp.stack((first, second), axis=-1).reshape(x.shape[:-1] + (r,))
    else:
        rotated = jnp.concatenate((first, second), axis=-1)
    return jnp.concatenate((rotated, x[..., r:]), axis=-1) if r < x.shape[-1] else rotated


def _stored(values, dtype: np.dtype, scale):
    """float32 values as ``dtype``, rounded once; fp8 stores ``values * (1 / scale)`` saturated to
    the format's largest finite value (NaN stays NaN), as ``numpy_path.store_as``."""
    name = dtype.name
    if name not in FP8_MAX:
        return values.astype(dtype)
    scale = jnp.float32(1.0) if scale is None else jnp.asarray(scale, jnp.float32).reshape(())
    limit = jnp.float32(FP8_MAX[name])
    return jnp.clip(values * (jnp.float32(1) / scale), -limit, limit).astype(dtype)


def _quotient(values, divisor):
    """``values / divisor`` (a float32 scalar) rounded once, as the kernels and NumPy divide: XLA
    turns a division by a broadcast scalar into a product by its reciprocal (two roundings),
    which a divisor behind an optimisation barrier keeps it from doing."""
    return values / jax.lax.optimization_barrier(jnp.full(values.shape, divisor, values.dtype))


def _stored_per_row(values, dtype: np.dtype):
    """(stored, scales): float32 rows (last axis) as fp8 ``dtype``, each with its own scale, as
    ``numpy_path.store_per_row``: ``amax / the format's largest value``, at least 2^-126."""
    limit = jnp.float32(FP8_MAX[dtype.name])
    row_scales = _quotient(jnp.max(jnp.abs(values), axis=-1), limit)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    row_scales = jnp.where(row_scales < tiny, tiny, row_scales)
    inverse = jnp.float32(1) / row_scales
    return jnp.clip(values * inverse[..., None], -limit, limit).astype(dtype), row_scales


def _e2m1_codes(values):
    """uint8 e2m1 codes of float32 values in [-6, 6], as ``numpy_path.e2m1_codes``."""
    a = jnp.abs(values)
    steps = [a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0]
    codes = sum(step.astype(jnp.uint8) for step in steps)
    return codes | (jnp.signbit(values).astype(jnp.uint8) << 3)


def _nvfp4_quantized(values, global_scale):
    """(packed, block_scale_bits): float32 rows in NVFP4, as ``numpy_path.nvfp4_quantize``."""
    g = jnp.asarray(global_scale, jnp.float32).reshape(())
    blocks = values.reshape(values.shape[:-1] + (values.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    block_scale = _quotient(amax, jnp.float32(E2M1_MAX)) * (jnp.float32(1) / g)
    scales = jnp.minimum(block_scale, jnp.float32(FP8_MAX["float8_e4m3fn"])).astype(
        jnp.float8_e4m3fn)
    scale_values = scales.astype(jnp.float32)
    safe = jnp.where(scale_values == 0, jnp.float32(1), scale_values * g)
    to_grid = jnp.where(scale_values == 0, jnp.float32(0), jnp.float32(1) / safe)
    limit = jnp.float32(E2M1_MAX)
    scaled = jnp.fmin(jnp.fmax(blocks * to_grid[..., None], -limit), limit)
    codes = _e2m1_codes(scaled).reshape(values.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, jax.lax.bitcast_convert_type(scales, jnp.uint8)


_BITS_OF_WIDTH = {2: jnp.uint16, 4: jnp.uint32}  # the fused ops' dtypes: 16- and 32-bit floats


def _cache_write(f, k_rotated, v, k_cache, v_cache, slot_mapping, cache_format, scales,
                 block_scales):
    """([k_cache_new, v_cache_new], {name: new scale array}): rotated k and v stored in the rows
    of their slots, with their per-row scales or NVFP4 block scales in the same rows; negative
    slots (padding) and slots past the cache are skipped. Caches of uint8 hold fp8 bits."""
    slots = slot_mapping.astype(jnp.int32)
    valid = (slots >= 0) & (slots < f.num_slots)
    blocks = jnp.where(valid, slots // f.block_size, f.num_blocks)  # out of range: dropped
    within = jnp.where(valid, slots % f.block_size, 0)

    def at_slots(array):
        return array.at[blocks, within] if f.layout == "NHD" else array.at[blocks, :, within]

    written, written_scales = [], {}
    for name, cache, values, block_scale_array in (
            ("k", k_cache, k_rotated, block_scales[0]), ("v", v_cache, v, block_scales[1])):
        scale, given = getattr(f, f"{name}_scale"), scales.get(f"{name}_scale")
        if given is None and f.cache_dtype is None and values.dtype == cache_format:
            # A cache of the values' own dtype: their bits as they are (inf, NaN payloads, -0.0),
            # as the kernels and the NumPy path store them. Scattered as unsigned integers of
            # their width: XLA's CPU scatter of bfloat16 / float16 turns a NaN's payload into
            # the canonical NaN's.
            bits = _BITS_OF_WIDTH[values.dtype.itemsize]
            new = at_slots(jax.lax.bitcast_convert_type(cache, bits)).set(
                jax.lax.bitcast_convert_type(values, bits), mode="drop")
            written.append(jax.lax.bitcast_convert_type(new, cache.dtype))
            continue
        values = values.astype(jnp.float32)
        if f.cache_dtype == NVFP4:  # given: the global scale
            stored, bits = _nvfp4_quantized(values, 1.0 if given is None else given)
            if block_scale_array.dtype != jnp.uint8:
                bits = jax.lax.bitcast_convert_type(bits, block_scale_array.dtype)
            written_scales[f"{name}_cache_scales"] = at_slots(block_scale_array).set(
                bits, mode="drop")
        elif f.v_scale.rows is not None:  # fp8, a scale per (slot, head) row
            stored, row_scales = _stored_per_row(values, cache_format)
            written_scales[f"{name}_scale"] = at_slots(given).set(row_scales, mode="drop")
        else:
            stored = _stored(values, cache_format, given)
        if cache.dtype == jnp.uint8 and stored.dtype != jnp.uint8:
            stored = jax.lax.bitcast_convert_type(stored, jnp.uint8)
        written.append(at_slots(cache).set(stored, mode="drop"))
    return written, written_scales
