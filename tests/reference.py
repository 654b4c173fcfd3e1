"""An independent float64 reference for rotary position embedding (RoPE).

Written plainly from the definitions in docs/contract.md §2 and docs/api_decisions.md, with NumPy and ``math``
only: nothing here imports cupyrope, so a mistake shared by the library and its tests is unlikely.

Pairing (``r`` = rotary_dim, ``j`` in ``range(r // 2)``)::

    NeoX (interleaved=False): dim j        with dim j + r/2
    GPT-J (interleaved=True): dim 2j       with dim 2j + 1

Pair ``j`` is rotated by the angle ``theta_j = position * inv_freq[j]``::

    out[a] = x[a] * cos(theta_j) - x[b] * sin(theta_j)
    out[b] = x[b] * cos(theta_j) + x[a] * sin(theta_j)

and ``inverse=True`` rotates by ``-theta_j``. Dims ``>= r`` pass through unchanged.

Everything is computed in float64: ``x`` and the tables are upcast exactly, the angle is the float64
product ``position * inv_freq[j]`` and ``np.cos`` / ``np.sin`` reduce large arguments accurately.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "pair_indices",
    "reference_inv_freq",
    "reference_angles",
    "reference_cos_sin_cache",
    "reference_rope",
    "round_to_dtype",
    "default_positions",
    "exact_reduced_angles",
]


def pair_indices(rotary_dim: int, interleaved: bool) -> list[tuple[int, int]]:
    """The (a, b) dim pairs that rotate together, pair j first.

    >>> pair_indices(6, False)
    [(0, 3), (1, 4), (2, 5)]
    >>> pair_indices(6, True)
    [(0, 1), (2, 3), (4, 5)]
    """
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    half = rotary_dim // 2
    pairs = []
    for j in range(half):
        if interleaved:
            pairs.append((2 * j, 2 * j + 1))
        else:
            pairs.append((j, j + half))
    return pairs


def reference_inv_freq(rotary_dim: int, theta: float = 10000.0, linear_factor: float = 1.0) -> np.ndarray:
    """inv_freq[j] = theta ** (-2j / rotary_dim) / linear_factor, float64, one libm ``pow`` per entry."""
    values = []
    for j in range(rotary_dim // 2):
        exponent = -(2.0 * j) / rotary_dim
        values.append(math.pow(float(theta), exponent) / float(linear_factor))
    return np.array(values, dtype=np.float64)


def default_positions(token_shape: tuple[int, ...]) -> np.ndarray:
    """positions=None: arange along axis -3 of q, i.e. the last token dim, broadcast over the others."""
    if len(token_shape) == 0:  # q is [H, D]: one token at position 0
        return np.zeros((), dtype=np.int64)
    last = token_shape[-1]
    return np.broadcast_to(np.arange(last, dtype=np.int64), token_shape)


def reference_angles(positions, inv_freq) -> np.ndarray:
    """float64 angles [..., r/2] = positions[..., None] * inv_freq (one float64 product each)."""
    pos = np.asarray(positions).astype(np.float64)  # exact for |position| < 2**53
    freq = np.asarray(inv_freq, dtype=np.float64)
    angles = np.empty(pos.shape + freq.shape, dtype=np.float64)
    for j in range(freq.shape[0]):
        angles[..., j] = pos * freq[j]
    return angles


def reference_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    theta: float = 10000.0,
    linear_factor: float = 1.0,
    attention_factor: float = 1.0,
    positions=None,
) -> np.ndarray:
    """The vLLM layout in float64: row p = [cos(p * inv_freq), sin(p * inv_freq)] * attention_factor.

    ``positions`` (optional) selects rows so that a few rows of a huge cache can be checked cheaply.
    """
    inv_freq = reference_inv_freq(rotary_dim, theta, linear_factor)
    if positions is None:
        positions = np.arange(max_position, dtype=np.int64)
    angles = reference_angles(positions, inv_freq)
    half = rotary_dim // 2
    cache = np.empty(angles.shape[:-1] + (rotary_dim,), dtype=np.float64)
    cache[..., :half] = np.cos(angles) * attention_factor
    cache[..., half:] = np.sin(angles) * attention_factor
    return cache


def _as_float64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def reference_rope(
    x,
    positions=None,
    *,
    cos_sin_cache=None,
    cos=None,
    sin=None,
    inv_freq=None,
    theta: float = 10000.0,
    linear_factor: float = 1.0,
    attention_factor: float = 1.0,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    inverse: bool = False,
) -> np.ndarray:
    """Exact float64 RoPE of ``x`` ([..., H, D], any float dtype NumPy can upcast).

    Angle source, exactly as cupyrope's: ``cos_sin_cache`` ([max_position, r], row ``positions[t]``;
    rows outside [0, max_position) give NaN in the rotated dims), or ``cos``/``sin`` tables broadcastable
    to ``x.shape[:-2] + (w,)`` with w = r/2 (half) or r (Hugging Face full width; the pair's first dim's
    column is read), or computed angles ``positions * inv_freq`` (``inv_freq`` defaults to
    ``reference_inv_freq(r, theta, linear_factor)``) times ``attention_factor``.
    """
    x64 = _as_float64(x)
    if x64.ndim < 2:
        raise ValueError("x must be [..., H, D]")
    head_dim = x64.shape[-1]
    token_shape = x64.shape[:-2]

    if cos_sin_cache is not None:
        cache = _as_float64(cos_sin_cache)
        r = cache.shape[1] if rotary_dim is None else rotary_dim
    elif cos is not None:
        r = np.shape(cos)[-1] if rotary_dim is None else rotary_dim
    else:
        r = head_dim if rotary_dim is None else rotary_dim
    assert r % 2 == 0 and 0 < r <= head_dim, r
    half = r // 2
    pairs = pair_indices(r, interleaved)

    if positions is None and cos is None:
        positions = default_positions(token_shape)

    # cos_j / sin_j per token: arrays of shape token_shape + (half,)
    if cos_sin_cache is not None:
        assert cache.shape[1] == r, (cache.shape, r)
        pos = np.broadcast_to(np.asarray(positions).astype(np.int64), token_shape)
        max_position = cache.shape[0]
        inside = (pos >= 0) & (pos < max_position)
        row = np.where(inside, pos, 0)
        cos_t = np.empty(token_shape + (half,), dtype=np.float64)
        sin_t = np.empty(token_shape + (half,), dtype=np.float64)
        for j in range(half):
            cos_t[..., j] = np.where(inside, cache[row, j], np.nan)
            sin_t[..., j] = np.where(inside, cache[row, half + j], np.nan)
    elif cos is not None:
        cos64 = _as_float64(cos)
        sin64 = _as_float64(sin)
        width = cos64.shape[-1]
        cos64 = np.broadcast_to(cos64, token_shape + (width,))
        sin64 = np.broadcast_to(sin64, token_shape + (width,))
        cos_t = np.empty(token_shape + (half,), dtype=np.float64)
        sin_t = np.empty(token_shape + (half,), dtype=np.float64)
        for j, (a, _b) in enumerate(pairs):
            if width == half:
                column = j
            elif width == r:
                column = a  # full width: the value stored for the pair's first dim
            else:
                raise ValueError(f"table width {width} is neither r/2={half} nor r={r}")
            cos_t[..., j] = cos64[..., column]
            sin_t[..., j] = sin64[..., column]
    else:
        freq = reference_inv_freq(r, theta, linear_factor) if inv_freq is None else _as_float64(inv_freq)
        pos = np.broadcast_to(np.asarray(positions).astype(np.int64), token_shape)
        angles = reference_angles(pos, freq)
        cos_t = np.cos(angles) * attention_factor
        sin_t = np.sin(angles) * attention_factor

    if inverse:
        sin_t = -sin_t

    out = x64.copy()  # dims >= r keep their (exact) input values
    for j, (a, b) in enumerate(pairs):
        c = cos_t[..., j][..., None]  # broadcast over heads
        s = sin_t[..., j][..., None]
        xa = x64[..., a]
        xb = x64[..., b]
        out[..., a] = xa * c - xb * s
        out[..., b] = xb * c + xa * s
    return out


def round_to_dtype(values64, dtype) -> np.ndarray:
    """Correctly round float64 values ONCE to ``dtype`` (round to nearest, ties to even).

    NumPy's float64 -> float32 / float16 casts already round once. ml_dtypes' float64 -> bfloat16 cast
    goes through float32 (a double rounding), so bfloat16 is fixed up here by choosing the nearest of
    the neighbouring bfloat16 values.
    """
    values64 = np.asarray(values64, dtype=np.float64)
    dtype = np.dtype(dtype)
    if dtype.name != "bfloat16":
        return values64.astype(dtype)
    first = values64.astype(dtype)
    bits = first.view(np.uint16).astype(np.int32)
    best = first.copy()
    best_err = np.abs(first.astype(np.float64) - values64)
    for step in (-1, 1):
        cand_bits = np.clip(bits + step, 0, 0xFFFF).astype(np.uint16)
        cand = cand_bits.view(dtype)
        cand64 = cand.astype(np.float64)
        same_sign = np.signbit(cand64) == np.signbit(first.astype(np.float64))
        err = np.abs(cand64 - values64)
        even = (cand_bits & 1) == 0
        better = np.isfinite(cand64) & same_sign & ((err < best_err) | ((err == best_err) & even))
        best = np.where(better, cand, best)
        best_err = np.where(better, err, best_err)
    return best.astype(dtype)


# pi/2 as three float64: PI_OVER_2[0] + [1] + [2] is 5.6e-50 short of pi/2.
PI_OVER_2 = (float.fromhex("0x1.921fb54442d18p+0"), float.fromhex("0x1.1a62633145c07p-54"),
             float.fromhex("-0x1.f1976b7ed8fbcp-110"))


def _two_prod(a, b):
    """a * b = p + e exactly (float64 arrays; Dekker's product, as NumPy has no FMA)."""
    def split(x):
        t = 134217729.0 * x  # 2^27 + 1: x = hi + lo, each half a significand
        hi = t - (t - x)
        return hi, x - hi

    p = a * b
    ah, al = split(a)
    bh, bl = split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _two_sum(a, b):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def exact_reduced_angles(positions, inv_freq):
    """The exact angle ``position * inv_freq`` (float64 inv_freq, no rounding of the product)
    reduced modulo pi/2: ``(k, r_hi, r_lo)`` with ``position * inv_freq = k * pi/2 + r_hi + r_lo``
    to ~1e-30 rad, |r_hi + r_lo| <= pi/4, broadcast over the arguments (|position| <= 2^53).

    Double-double arithmetic in float64: the product exactly (two-product), k * pi/2 with pi/2 in
    three float64, the differences with error-free sums.
    """
    pos = np.asarray(positions)
    if pos.size and np.max(np.abs(pos.astype(np.float64))) > 2.0**53:
        raise ValueError("exact_reduced_angles: positions beyond 2^53 are not exact in float64")
    pos, freq = np.broadcast_arrays(pos.astype(np.float64), np.asarray(inv_freq, dtype=np.float64))
    a_hi, a_lo = _two_prod(pos, freq)
    k = np.rint(a_hi * (2.0 / math.pi))
    p1, e1 = _two_prod(k, PI_OVER_2[0])
    p2, e2 = _two_prod(k, PI_OVER_2[1])
    s = a_hi - p1  # exact: the two are within a factor 2 (or k = 0)
    lo = np.zeros_like(s)
    for term in (a_lo, -e1, -p2, -e2, -k * PI_OVER_2[2]):
        s, e = _two_sum(s, term)
        lo = lo + e
    r_hi, r_lo = _two_sum(s, lo)
    for _ in range(2):  # k from the rounded product can be one off near the quadrant edges
        step = np.where(r_hi > math.pi / 4, 1.0, np.where(r_hi < -math.pi / 4, -1.0, 0.0))
        k = k + step
        s, e = _two_sum(r_hi, -step * PI_OVER_2[0])
        r_hi, r_lo = _two_sum(s, r_lo + e - step * PI_OVER_2[1] - step * PI_OVER_2[2])
    return k.astype(np.int64), r_hi, r_lo
