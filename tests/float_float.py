"""A bit-exact NumPy emulation of the float-float angle path of ``kernels_cu/float_float.cuh``.

The kernel built with ``-DCUPYROPE_ANGLES_FLOAT_FLOAT=1`` (GPUs with slow FP64) computes cos/sin of
``position * inv_freq`` in float32 arithmetic only. This module replays the very same sequence of
float32 operations (same constants, same order, same roundings), vectorised over arrays, so that
its accuracy can be measured on the CPU against an exact reference at millions of (position,
inv_freq) points, and so that a GPU test can check the kernel against it bit for bit.

Keep it in lockstep with ``kernels_cu/float_float.cuh`` and the polynomials of
``kernels_cu/angles.cuh``: every function here names the device function it mirrors.

Emulating the device operations:

- ``+``, ``-``, ``*`` of ``np.float32`` arrays are IEEE float32 operations rounded to nearest even,
  as ``__fadd_rn``, ``__fsub_rn``, ``__fmul_rn`` (and plain float arithmetic) on the GPU;
- ``fmaf(a, b, c)`` is one rounding of the exact ``a * b + c``: ``fma32`` forms the product exactly
  in float64 (24 + 24 bits fit in 53), adds ``c`` with float64 round-to-odd (an error-free sum, then
  the last bit forced odd where the sum was inexact), and rounds that to float32 once. Round-to-odd
  at 53 bits followed by rounding to 24 bits equals rounding the exact value to 24 bits (the
  classic result needs 53 >= 24 + 2);
- ``rintf`` is ``np.rint`` (nearest, ties to even), ``floorf`` is ``np.floor``;
- ``__ll2float_rn`` of an int64 is float32(float64(x)), one rounding for |x| <= 2^53 (the
  emulation refuses larger positions); ``__float2ll_rn`` / ``__float2int_rn`` of integer-valued
  floats are exact.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "TWO_OVER_PI_HI", "TWO_OVER_PI_LO", "PI_OVER_2_HI", "PI_OVER_2_MID", "PI_OVER_2_LO",
    "fma32", "two_sum", "two_prod", "split_double", "split_position", "reduce_angle",
    "sin_kernel", "cos_kernel", "float_float_sincos",
]

F32 = np.float32

# The constants of float_float.cuh, as float32 bit patterns (the .cuh spells the same values as
# hexadecimal float literals).
TWO_OVER_PI_HI = np.uint32(0x3F22F983).view(F32)   # float32 nearest 2/pi
TWO_OVER_PI_LO = np.uint32(0x32DC9C88).view(F32)   # float32 nearest 2/pi - TWO_OVER_PI_HI
PI_OVER_2_HI = np.uint32(0x3FC90FDB).view(F32)     # float32 nearest pi/2
PI_OVER_2_MID = np.uint32(0xB33BBD2E).view(F32)    # float32 nearest pi/2 - HI
PI_OVER_2_LO = np.uint32(0xA6F72CED).view(F32)     # float32 nearest pi/2 - HI - MID (|rest| ~1e-23)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=F32)


def fma32(a, b, c) -> np.ndarray:
    """fmaf(a, b, c): a * b + c rounded once to float32 (see the module docstring)."""
    a, b, c = (_f32(v).astype(np.float64) for v in (a, b, c))
    p = a * b  # exact: two 24-bit significands
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        # Knuth's TwoSum in float64: err = (p + c) - s exactly.
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        inexact = np.isfinite(s) & (err != 0)
        bits = s.view(np.int64)
        even = (bits & 1) == 0
        # round to odd: where s is inexact and has an even last bit, the odd neighbour toward
        # the exact value is the round-to-odd result
        toward = np.where(err > 0, np.inf, -np.inf)
        s = np.where(inexact & even, np.nextafter(s, toward), s)
        return s.astype(F32)


def two_sum(a, b):
    """float_float::two_sum: s + e == a + b exactly (Knuth), s = fl(a + b)."""
    a, b = _f32(a), _f32(b)
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def two_prod(a, b):
    """float_float::two_prod: p + e == a * b exactly, p = fl(a * b), e = fmaf(a, b, -p)."""
    a, b = _f32(a), _f32(b)
    p = a * b
    return p, fma32(a, b, -p)


def _int_to_f32(n) -> np.ndarray:
    """__int2float_rn of ints with at most 24 significant bits (exact, as the device's are)."""
    n = np.asarray(n, dtype=np.int64)
    f = n.astype(F32)
    assert np.array_equal(f.astype(np.int64), n), "an __int2float_rn here would round"
    return f


def _power_of_two_f32(sign_bits, biased) -> np.ndarray:
    """__int_as_float(sign | clamp(biased, 0, 255) << 23): 0 below the normal range, inf above."""
    field = np.clip(np.asarray(biased, dtype=np.int64), 0, 255).astype(np.uint32) << np.uint32(23)
    return (np.asarray(sign_bits, dtype=np.uint32) | field).view(F32)


def split_double(x):
    """float_float::split_double: float64 ``x`` as hi + mid + lo, three float32 (exact for
    2^-74 <= |x| < 2^128): hi the leading 24 bits of the significand (rounded to nearest even),
    mid and lo the remaining 29 bits (mid a multiple of 16 units of the last place, lo in [-8, 8)
    units). Integer and bit operations only."""
    bits = np.asarray(x, dtype=np.float64).view(np.uint64)
    exponent = ((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64) - 1023
    sign = ((bits >> np.uint64(32)).astype(np.uint32)) & np.uint32(0x80000000)
    significand = ((bits & np.uint64(0xFFFFFFFFFFFFF)) | np.uint64(1 << 52)).astype(np.int64)
    # leading 24 bits, rounded to nearest with ties to even (as __ll2float_rn rounds)
    odd = (significand >> 29) & 1
    top = (significand + (1 << 28) - 1 + odd) >> 29
    rest = significand - (top << 29)                       # [-2^28, 2^28]
    rest_hi = (rest + 8) & ~np.int64(15)                  # a multiple of 16: <= 24 bits
    rest_lo = rest - rest_hi                               # [-8, 8)
    top_scale = _power_of_two_f32(sign, exponent + 104)    # 2^(exponent - 23)
    rest_scale = _power_of_two_f32(sign, exponent + 75)    # 2^(exponent - 52)
    with np.errstate(over="ignore", invalid="ignore"):
        return (_int_to_f32(top) * top_scale, _int_to_f32(rest_hi) * rest_scale,
                _int_to_f32(rest_lo) * rest_scale)


def split_position(position):
    """float_float::split_position (int64 overload): hi = __ll2float_rn(pos),
    lo = __ll2float_rn(pos - __float2ll_rn(hi)); hi + lo == pos exactly for |pos| <= 2^48."""
    pos = np.asarray(position, dtype=np.int64)
    assert np.all(np.abs(pos) <= 2**53), "the emulation rounds int64 -> float32 exactly to 2^53"
    hi = pos.astype(np.float64).astype(F32)
    rest = pos - hi.astype(np.int64)
    lo = rest.astype(np.float64).astype(F32)
    return hi, lo


def split_position_double(position):
    """float_float::split_position (float64 overload, the lean kernel's position): hi and
    fl(mid + lo) of split_double; the same pair as the int64 overload for |pos| <= 2^53."""
    hi, mid, lo = split_double(np.asarray(position, dtype=np.float64))
    return hi, mid + lo


def reduce_angle(ph, pl, fh, fm, fl):
    """float_float::reduce_angle: (r, quadrant) with r ~ (ph + pl) * (fh + fm + fl) - k * pi/2 and
    quadrant = k mod 4. Mirrors the device code statement by statement."""
    ph, pl, fh, fm, fl = (_f32(v) for v in (ph, pl, fh, fm, fl))
    with np.errstate(invalid="ignore", over="ignore"):
        th, te = two_prod(ph, fh)
        mh, me = two_prod(ph, fm)
        nh, ne = two_prod(pl, fh)
        k0 = np.rint(fma32(th, TWO_OVER_PI_HI, th * TWO_OVER_PI_LO))
        p1, e1 = two_prod(k0, PI_OVER_2_HI)
        p2, e2 = two_prod(k0, PI_OVER_2_MID)
        d0 = th - p1
        s, a = two_sum(d0, te)
        s, b = two_sum(s, mh)
        s, c = two_sum(s, nh)
        s, d = two_sum(s, -e1)
        s, e = two_sum(s, -p2)
        t = me + ne
        t = fma32(pl, fm, t)
        t = fma32(ph, fl, t)
        t = t - e2
        t = fma32(-k0, PI_OVER_2_LO, t)
        t = t + ((a + b) + ((c + d) + e))
        k1 = np.rint((s + t) * TWO_OVER_PI_HI)
        rh = fma32(-k1, PI_OVER_2_HI, s)
        rl = fma32(-k1, PI_OVER_2_MID, t)
        rl = fma32(-k1, PI_OVER_2_LO, rl)
        k0_mod4 = fma32(F32(-4.0), np.floor(k0 * F32(0.25)), k0)
        quadrant = _float2int(k0_mod4 + k1) & 3
        return rh + rl, quadrant


def _float2int(x) -> np.ndarray:
    """__float2int_rn of integer-valued floats (NaN -> 0, as on the GPU)."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(np.isfinite(x), x, 0.0).astype(np.int64)


def sin_kernel(x):
    """angles.cuh sin_kernel: minimax sin on [-pi/4, pi/4] (Cephes sinf coefficients)."""
    x = _f32(x)
    z = x * x
    p = F32(-1.9515295891e-4)
    p = fma32(p, z, F32(8.3321608736e-3))
    p = fma32(p, z, F32(-1.6666654611e-1))
    return fma32(p * z, x, x)


def cos_kernel(x):
    """angles.cuh cos_kernel: minimax cos on [-pi/4, pi/4] (Cephes cosf coefficients)."""
    x = _f32(x)
    z = x * x
    p = F32(2.443315711809948e-5)
    p = fma32(p, z, F32(-1.388731625493765e-3))
    p = fma32(p, z, F32(4.166664568298827e-2))
    return fma32(p * z, z, fma32(F32(-0.5), z, F32(1.0)))


def quadrant_sincos(r, quadrant):
    """angles.cuh sincos_of_reduced: (sin, cos) of r + quadrant * pi/2."""
    sr, cr = sin_kernel(r), cos_kernel(r)
    q = np.asarray(quadrant)
    s = np.select([q == 0, q == 1, q == 2], [sr, cr, -sr], -cr)
    c = np.select([q == 0, q == 1, q == 2], [cr, -sr, -cr], sr)
    return s.astype(F32), c.astype(F32)


def float_float_sincos(position, inv_freq, *, position_as_double=False):
    """angles.cuh float_float_sincos: float32 (sin, cos) of position * inv_freq, broadcast over
    the arguments. ``position_as_double`` takes the lean kernel's path (the position arrives as a
    float64 there)."""
    position, inv_freq = np.broadcast_arrays(np.asarray(position, dtype=np.int64),
                                             np.asarray(inv_freq, dtype=np.float64))
    if position_as_double:
        ph, pl = split_position_double(position.astype(np.float64))
    else:
        ph, pl = split_position(position)
    fh, fm, fl = split_double(inv_freq)
    r, quadrant = reduce_angle(ph, pl, fh, fm, fl)
    return quadrant_sincos(r, quadrant)
