"""Float-float in-kernel angles (``kernels_cu/float_float.cuh``), on the CPU, and how a build picks
them.

``float_float.py`` replays the kernel's float32 operations bit for bit in NumPy (the GPU test
``test_gpu_angles.py`` checks that against the kernel itself). Here the replay is swept over
positions up to +-2^24 (dense at powers of two and at the ends, random between) and every inv_freq
of the theta 1e4 / 5e5 schedules at rotary_dim 128 and of llama3 / yarn scaled ones, against the
exact reduced angle of ``reference.exact_reduced_angles`` (double-double, itself checked against
mpmath here). The bound asserted is the one float_float.cuh states: the float reduced angle is the
exact one rounded once to float32, to within 2^-36 rad (so |error| <= 2^-25 + 2^-36 rad for
|r| <= pi/4), for |position * inv_freq| <= 2^31 rad, and cos/sin within 1.75 * 2^-24 of the exact
values. Past 2^31 rad the documented degradation (<= 2^-68 |angle| extra) is checked too.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import mpmath
import numpy as np
import pytest

import cupyrope as cr
import float_float as ff
from cupyrope.cuda import compiler
from cupyrope.core.abi import AngleSource
from reference import PI_OVER_2, exact_reduced_angles

HEADER = Path(__file__).resolve().parent.parent / "kernels_cu" / "float_float.cuh"
U32 = 2.0**-24

SCHEDULES = {
    "theta1e4": dict(theta=10000.0),
    "theta5e5": dict(theta=500000.0),
    "llama3": dict(theta=500000.0, scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192}),
    "yarn": dict(theta=10000.0, scaling={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 32768}),
}


@pytest.fixture(scope="module")
def inv_freqs() -> np.ndarray:
    """Every inv_freq of the four schedules at rotary_dim 128 (190 distinct values in (0, 1])."""
    freqs = [cr.rope_frequencies(128, **kwargs)[0] for kwargs in SCHEDULES.values()]
    values = np.unique(np.concatenate(freqs))
    assert values.max() == 1.0 and values.min() < 1e-6 and len(values) > 150
    return values


def positions_up_to_2p24(rng) -> np.ndarray:
    """+-(2^k + d) for k <= 24, d in [-3, 3]; the 2000 positions below 2^24 and above -2^24;
    4000 random ones in [-2^24, 2^24]."""
    near_powers = [s * (2**k + d) for k in range(25) for d in range(-3, 4) for s in (1, -1)]
    ends = np.concatenate([np.arange(2**24 - 1000, 2**24 + 1), -np.arange(2**24 - 1000, 2**24 + 1)])
    random = rng.integers(-(2**24), 2**24 + 1, size=4000)
    positions = np.unique(np.concatenate([near_powers, ends, random, [0]]).astype(np.int64))
    positions = positions[np.abs(positions) <= 2**24]
    assert positions.min() == -(2**24) and positions.max() == 2**24
    return positions


def reduction_errors(positions, inv_freq, *, outer=True):
    """|float-float reduced angle - exact| (radians, the quadrant accounted for), the exact |r|,
    whether the quadrant was the exact one, and the float-float |r|: for every (position,
    inv_freq) pair (``outer``), else for positions[i] with inv_freq[i]."""
    positions = np.asarray(positions, dtype=np.int64)
    inv_freq = np.asarray(inv_freq, dtype=np.float64)
    if outer:
        positions, inv_freq = positions[:, None], inv_freq[None, :]
    ph, pl = ff.split_position(positions)
    fh, fm, fl = ff.split_double(inv_freq)
    r, quadrant = ff.reduce_angle(ph, pl, fh, fm, fl)
    k, r_hi, r_lo = exact_reduced_angles(positions, inv_freq)
    turn = (quadrant - k) % 4  # the float-float quadrant minus the exact one
    offset = np.select([turn == 1, turn == 2, turn == 3], [math.pi / 2, math.pi, -math.pi / 2], 0.0)
    err = np.abs((r.astype(np.float64) - r_hi) - r_lo + offset)
    return err, np.abs(r_hi), turn == 0, np.abs(r.astype(np.float64))


def half_ulp32(x) -> np.ndarray:
    """Half the float32 spacing at |x| (normal range)."""
    _, e = np.frexp(np.maximum(np.abs(x), 2.0**-126))
    return np.ldexp(1.0, e - 25)


def assert_rounded_once(err, r_exact, r_ff, quadrant_ok, where, slack=2.0**-36, past_edge=2.0**-22):
    """err within half a float32 ulp of the exact |r| plus ``slack``; |r| at most ``past_edge``
    beyond pi/4 (there, next to the quadrant edge, the quadrant may be the neighbouring one)."""
    bound = half_ulp32(r_exact) + slack
    worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    assert np.all(err <= bound), (
        f"{where}: reduced angle off by {err[worst]:.3e} rad at |r| = {r_exact[worst]:.6g} "
        f"(bound {bound[worst]:.3e}); {np.count_nonzero(err > bound)} of {err.size} points")
    assert np.all(err <= 2.0**-25 + slack), f"{where}: max error {err.max():.3e}"
    assert np.all(r_ff <= math.pi / 4 + past_edge), f"{where}: |r| up to {r_ff.max()!r}"
    edge = np.abs(r_exact - math.pi / 4) <= past_edge
    assert np.all(quadrant_ok | edge), f"{where}: a wrong quadrant away from pi/4"


# --------------------------------------------------------------------------------------------------
# The replay and the reference themselves


def test_header_constants_are_the_emulations():
    """float_float.cuh's constants (hexadecimal float literals) are float_float.py's, bit for bit,
    and each is the float32 nearest what it approximates."""
    text = HEADER.read_text()
    literals = dict(re.findall(r"constexpr float (k\w+) = (-?0x[0-9a-fp.+-]+)f;", text))
    names = {"kTwoOverPiHi": ff.TWO_OVER_PI_HI, "kTwoOverPiLo": ff.TWO_OVER_PI_LO,
             "kPiOver2Hi": ff.PI_OVER_2_HI, "kPiOver2Mid": ff.PI_OVER_2_MID,
             "kPiOver2Lo": ff.PI_OVER_2_LO}
    assert set(literals) == set(names), literals
    for name, value in names.items():
        assert np.float32(float.fromhex(literals[name])) == value and \
            float.fromhex(literals[name]) == float(value), name

    mpmath.mp.prec = 300
    try:
        def nearest32(x):
            below = np.float32(float(x))
            candidates = [np.nextafter(below, np.float32(-1e30)), below,
                          np.nextafter(below, np.float32(1e30))]
            return min(candidates, key=lambda c: abs(mpmath.mpf(float(c)) - x))

        half_pi, two_over_pi = mpmath.pi / 2, 2 / mpmath.pi
        assert ff.PI_OVER_2_HI == nearest32(half_pi)
        assert ff.PI_OVER_2_MID == nearest32(half_pi - float(ff.PI_OVER_2_HI))
        assert ff.PI_OVER_2_LO == nearest32(half_pi - float(ff.PI_OVER_2_HI) - float(ff.PI_OVER_2_MID))
        rest = half_pi - float(ff.PI_OVER_2_HI) - float(ff.PI_OVER_2_MID) - float(ff.PI_OVER_2_LO)
        assert abs(rest) < 2e-23
        assert ff.TWO_OVER_PI_HI == nearest32(two_over_pi)
        assert ff.TWO_OVER_PI_LO == nearest32(two_over_pi - float(ff.TWO_OVER_PI_HI))
        assert abs(sum(mpmath.mpf(c) for c in PI_OVER_2) - half_pi) < 1e-49
    finally:
        mpmath.mp.prec = 53


def _round_to_float32(value: Fraction) -> np.float32:
    """The float32 nearest ``value`` (ties to even), for normal-range values, from exact rationals."""
    if value == 0:
        return np.float32(0.0)
    guess = np.float32(float(value))
    neighbours = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    distances = [abs(Fraction(float(c)) - value) for c in neighbours]
    best = min(distances)
    ties = [c for c, d in zip(neighbours, distances) if d == best]
    return min(ties, key=lambda c: int(c.view(np.uint32)) & 1)  # the even one on a tie


def test_fma32_rounds_once(rng):
    """The emulated fmaf is a * b + c rounded once, ties included (where float64 then float32 would
    round twice)."""
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.uniform(-1e-6, 1e-6, 3000))).astype(np.float32)
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a float32 midpoint: with c = 0 a tie (to even, down),
    # with c = +-2^-60 just above or below it
    one = np.float32(1 + 2.0**-12)
    a = np.concatenate([a, np.full(3, one)])
    b = np.concatenate([b, np.full(3, one)])
    c = np.concatenate([c, np.array([0.0, 2.0**-60, -(2.0**-60)], dtype=np.float32)])
    got = ff.fma32(a, b, c)
    for x, y, z, g in zip(a, b, c, got):
        want = _round_to_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        assert g == want, (x, y, z, g, want)
    assert got[-2] == np.float32(1 + 2.0**-11 + 2.0**-23) and got[-3] == got[-1] == np.float32(1 + 2.0**-11)
    # rounding twice (float64, then float32) gets the case just above the midpoint wrong
    naive = (a[-3:].astype(np.float64) * b[-3:] + c[-3:]).astype(np.float32)
    assert naive[1] != got[-2]


def test_reference_reduction_matches_mpmath(rng, inv_freqs):
    positions = np.concatenate([rng.integers(-(2**48), 2**48, 150), rng.integers(-(2**24), 2**24, 150)])
    freqs = np.concatenate([rng.choice(inv_freqs, 150), rng.uniform(0, 1, 150)])
    k, r_hi, r_lo = exact_reduced_angles(positions, freqs)
    mpmath.mp.prec = 400
    try:
        half_pi = mpmath.pi / 2
        for i in range(len(positions)):
            angle = mpmath.mpf(int(positions[i])) * mpmath.mpf(float(freqs[i]))
            kk = int(mpmath.nint(angle / half_pi))
            assert kk == k[i], (positions[i], freqs[i])
            assert abs(angle - kk * half_pi - mpmath.mpf(r_hi[i]) - mpmath.mpf(r_lo[i])) < 1e-28
    finally:
        mpmath.mp.prec = 53


def test_splits_are_exact(rng):
    """inv_freq = hi + mid + lo exactly (2^-74 <= |x| < 2^128); a position = hi + lo exactly up to
    2^48, from int64 and from float64 alike (up to 2^53)."""
    x = np.concatenate([rng.uniform(1, 2, 500) * np.exp2(rng.integers(-74, 127, 500)),
                        -rng.uniform(0, 1, 100), [1.0, 2.0**-74, np.nextafter(1.0, 0.0)]])
    hi, mid, lo = ff.split_double(x)
    for xi, h, m, low in zip(x, hi, mid, lo):
        assert Fraction(float(h)) + Fraction(float(m)) + Fraction(float(low)) == Fraction(float(xi))
    assert np.array_equal(hi, x.astype(np.float32)), "hi must be the float32 nearest x"
    # position pairs: exact below 2^48 (powers of two and their neighbours, random)
    p = np.concatenate([[s * (2**k + d) for k in range(49) for d in (-1, 0, 1) for s in (1, -1)],
                        rng.integers(-(2**48), 2**48, 2000)]).astype(np.int64)
    p = p[np.abs(p) <= 2**48]
    ph, pl = ff.split_position(p)
    assert np.array_equal(ph.astype(np.int64) + pl.astype(np.int64), p)
    ph2, pl2 = ff.split_position_double(p.astype(np.float64))
    assert np.array_equal(ph, ph2) and np.array_equal(pl, pl2)
    big = rng.integers(2**48, 2**53, 500)
    big_pairs = ff.split_position(big), ff.split_position_double(big.astype(np.float64))
    assert np.array_equal(big_pairs[0][0], big_pairs[1][0])
    assert np.array_equal(big_pairs[0][1], big_pairs[1][1])


# --------------------------------------------------------------------------------------------------
# The accuracy of the scheme


def test_reduced_angle_up_to_2p24(rng, inv_freqs):
    """The documented range of the accuracy contract: every |position| <= 2^24 at every
    inv_freq: the exact reduced angle rounded once (<= 2^-25 + 2^-36 rad)."""
    positions = positions_up_to_2p24(rng)
    err, r_exact, quadrant_ok, r_ff = reduction_errors(positions, inv_freqs)
    assert_rounded_once(err, r_exact, r_ff, quadrant_ok, "|position| <= 2^24")
    # the sweep reaches the bound's regime: errors of nearly half an ulp occur
    assert err.max() > 0.45 * 2.0**-24


def test_reduced_angle_up_to_int32(rng, inv_freqs):
    """The same bound up to |position * inv_freq| = 2^31 rad: every int32 position, and larger
    positions (up to 2^48) at small inv_freq."""
    positions = np.concatenate([rng.integers(2**24, 2**31, 2000), -rng.integers(2**24, 2**31, 1000),
                                [2**31 - 1, -(2**31)]])
    err, r_exact, quadrant_ok, r_ff = reduction_errors(positions, inv_freqs)
    # k0 * pi/2 is up to 65 quadrants off here: the second step's float32 k1 can leave |r| up to
    # 2^-16 past pi/4 (the polynomials are as accurate there)
    assert_rounded_once(err, r_exact, r_ff, quadrant_ok, "|position| <= 2^31", past_edge=2.0**-16)
    # huge positions (exact as float pairs up to 2^48) whose angles stay below 2^31 rad
    big = rng.integers(2**31, 2**48, 20000)
    freq = np.exp2(rng.uniform(-20, 0, len(big))) * np.minimum(1.0, 2.0**31 / big)
    err, r_exact, quadrant_ok, r_ff = reduction_errors(big, freq, outer=False)
    assert_rounded_once(err, r_exact, r_ff, quadrant_ok, "|position| <= 2^48, |angle| <= 2^31",
                        past_edge=2.0**-16)


@pytest.mark.parametrize("octave", [34, 40, 46])
def test_degradation_past_2p31(rng, octave):
    """As float_float.cuh documents: past 2^31 rad the error grows by at most 2^-68 |angle|."""
    positions = rng.integers(2**octave, 2 ** (octave + 1), 1500)
    err, r_exact, _, _ = reduction_errors(positions, [1.0, 0.999, 0.75])
    excess = err - half_ulp32(r_exact)
    angle = positions[:, None].astype(np.float64)
    assert np.all(excess <= 2.0**-68 * angle + 2.0**-36), (octave, excess.max())


def test_sin_cos_up_to_2p24(rng, inv_freqs):
    """cos and sin (the polynomials of angles.cuh on the float-float angle) within 1.75 * 2^-24 of
    the exact values; the lean kernel's float64 position gives the same bits."""
    positions = positions_up_to_2p24(rng)[::3]
    p, f = positions[:, None], inv_freqs[None, :]
    s, c = ff.float_float_sincos(p, f)
    s2, c2 = ff.float_float_sincos(p, f, position_as_double=True)
    assert np.array_equal(s.view(np.uint32), s2.view(np.uint32))
    assert np.array_equal(c.view(np.uint32), c2.view(np.uint32))
    k, r_hi, r_lo = exact_reduced_angles(p, f)
    sin_r, cos_r = np.sin(r_hi) + r_lo * np.cos(r_hi), np.cos(r_hi) - r_lo * np.sin(r_hi)
    q = k % 4
    exact_sin = np.select([q == 0, q == 1, q == 2], [sin_r, cos_r, -sin_r], -cos_r)
    exact_cos = np.select([q == 0, q == 1, q == 2], [cos_r, -sin_r, -cos_r], sin_r)
    worst = max(np.max(np.abs(s - exact_sin)), np.max(np.abs(c - exact_cos)))
    assert worst <= 1.75 * U32, worst / U32
    assert worst > 0.5 * U32  # the sweep reaches the rounding regime


# --------------------------------------------------------------------------------------------------
# Choosing the arithmetic


def test_arithmetic_by_compute_capability():
    full_rate = [(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)]
    slow = [(5, 2), (6, 1), (7, 2), (7, 5), (8, 6), (8, 7), (8, 9), (10, 3), (11, 0), (12, 0),
            (12, 1)]
    assert [compiler.arithmetic_for_capability(*cc) for cc in full_rate] == ["float64"] * 5
    assert [compiler.arithmetic_for_capability(*cc) for cc in slow] == ["float-float"] * len(slow)


@pytest.mark.parametrize("value,expected", [(None, "auto"), ("", "auto"), ("auto", "auto"),
                                            ("float64", "float64"), ("Float-Float ", "float-float")])
def test_environment_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(compiler.ANGLE_ARITHMETIC_ENV, raising=False)
    else:
        monkeypatch.setenv(compiler.ANGLE_ARITHMETIC_ENV, value)
    assert compiler.angle_arithmetic_setting() == expected


@pytest.mark.parametrize("value", ["fp32", "double", "float_float", "1"])
def test_bad_environment_value_raises(monkeypatch, value):
    monkeypatch.setenv(compiler.ANGLE_ARITHMETIC_ENV, value)
    with pytest.raises(ValueError, match=r"CUPYROPE_ANGLE_ARITHMETIC=.*'auto', 'float64', 'float-float'"):
        compiler.angle_arithmetic_setting()


def test_compile_options_carry_the_arithmetic():
    base = compiler.compile_options()
    assert not any("ANGLES_FLOAT_FLOAT" in o for o in base)
    assert compiler.compile_options("float-float") == base + ("-DCUPYROPE_ANGLES_FLOAT_FLOAT=1",)
    assert compiler.compile_options("float64") == base + ("-DCUPYROPE_ANGLES_FLOAT_FLOAT=0",)
    with pytest.raises(ValueError, match="arithmetic"):
        compiler.compile_options("float32")


class _FakeKernel:
    def __init__(self, spec, device_id, arithmetic):
        self.spec, self.device_id, self.angle_arithmetic = spec, device_id, arithmetic


def test_compiled_kernels_are_keyed_on_the_arithmetic(monkeypatch):
    """The setting is read at the first kernel; after a change, clear_cache() makes computed-angle
    kernels compile the other way (keyed on it); table kernels and float64 q/k never depend on it."""
    compiles = []

    def fake_compile(spec, device_id, arithmetic=None):
        compiles.append(arithmetic)
        return _FakeKernel(spec, device_id, arithmetic)

    monkeypatch.setattr(compiler, "_compile", fake_compile)
    monkeypatch.setattr(compiler, "_compute_capability",
                        lambda device_id: {0: (8, 9), 1: (9, 0)}[device_id])
    monkeypatch.setattr(compiler, "_compiled", {})
    monkeypatch.setattr(compiler, "_locks", {})
    monkeypatch.setattr(compiler, "_retired", [])
    computed = next(s for s in compiler.SPECIALISATIONS
                    if s.source == AngleSource.COMPUTED and s.dtype == "bfloat16")
    computed64 = next(s for s in compiler.SPECIALISATIONS
                      if s.source == AngleSource.COMPUTED and s.dtype == "float64")
    table = next(s for s in compiler.SPECIALISATIONS if s.source == AngleSource.CACHE_TABLE)

    monkeypatch.delenv(compiler.ANGLE_ARITHMETIC_ENV, raising=False)
    compiler.clear_cache()
    try:
        assert compiler.get_kernel(computed, 0).angle_arithmetic == "float-float"  # sm_89
        assert compiler.get_kernel(computed, 1).angle_arithmetic == "float64"      # sm_90
        assert compiler.get_kernel(table, 0).angle_arithmetic is None
        assert compiler.get_kernel(computed64, 0).angle_arithmetic is None
        assert compiles == ["float-float", "float64", None, None]
        monkeypatch.setenv(compiler.ANGLE_ARITHMETIC_ENV, "float64")
        # read once: the kernels in hand stay until clear_cache()
        assert compiler.get_kernel(computed, 0).angle_arithmetic == "float-float"
        assert compiler.angle_arithmetic(0) == "float-float" and len(compiles) == 4
        compiler.clear_cache()
        assert not compiler.is_compiled(computed, 0) and compiler.angle_arithmetic(0) == "float64"
        assert compiler.get_kernel(computed, 0).angle_arithmetic == "float64"
        assert compiler.get_kernel(table, 0).angle_arithmetic is None
        assert set(compiler._compiled) == {(0, "float64", computed), (0, None, table)}
        # a stale entry of the other arithmetic is never handed out
        compiler._compiled[(0, "float-float", computed)] = _FakeKernel(computed, 0, "float-float")
        assert compiler.get_kernel(computed, 0).angle_arithmetic == "float64"
        assert compiles == ["float-float", "float64", None, None, "float64", None]
        monkeypatch.setenv(compiler.ANGLE_ARITHMETIC_ENV, "fast")
        compiler.clear_cache()
        with pytest.raises(ValueError, match="CUPYROPE_ANGLE_ARITHMETIC"):
            compiler.get_kernel(table, 0)
    finally:
        monkeypatch.undo()
        compiler.clear_cache()  # forget the setting read under the patched environment
