"""In-kernel angles under both arithmetics on the GPU, and every angle source up to position 2^24.

- The float-float device code (``kernels_cu/float_float.cuh``, compiled as the kernels compile it)
  gives, bit for bit, what ``tests/float_float.py`` replays on the CPU, and the float64 build is
  within its bound of the exact reduced angle: the CPU sweeps of ``test_float_float_angles.py``
  then hold for the kernel itself.
- ``apply_rope`` and ``rms_norm_rope`` with computed angles, under ``CUPYROPE_ANGLE_ARITHMETIC``
  float64 and float-float (set, then ``cupyrope.clear_cache()``), bfloat16 / float16 / float32,
  NeoX and interleaved, the lean and the general kernel, at positions random in [-2^24, 2^24]
  plus both ends, every power of two and its neighbours, against the float64 reference.
- A cache of 2^24 + 1 rows and per-token tables, read at positions up to 2^24.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
import float_float as ff
from cupyrope.cuda import compiler
from reference import exact_reduced_angles, reference_cos_sin_cache, reference_inv_freq, reference_rope
from tolerances import assert_rope_close, max_abs_angle, np_dtype, unit_roundoff

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

ARITHMETICS = ("float64", "float-float")
TWO_24 = 2**24


def to_gpu(host: np.ndarray):
    host = np.ascontiguousarray(host)
    bits = np.dtype(f"u{host.dtype.itemsize}")  # bit for bit, bfloat16 included
    return cp.asarray(host.view(bits)).view(host.dtype)


def to_host(dev) -> np.ndarray:
    return dev.view(np.dtype(f"u{dev.dtype.itemsize}")).get().view(dev.dtype)


def random_host(rng, shape, dtype) -> np.ndarray:
    values = rng.standard_normal(shape)
    values = np.where(np.abs(values) < 1e-3, np.copysign(0.5, values), values)
    return values.astype(np_dtype(dtype))


def positions_to_2p24(rng, count: int) -> np.ndarray:
    """Both ends, 0, +-1, every +-2^k and its neighbours, then random in [-2^24, 2^24]."""
    special = [0, 1, -1, TWO_24, -TWO_24, TWO_24 - 1, -(TWO_24 - 1)]
    special += [s * (2**k + d) for k in range(1, 24) for d in (-1, 0, 1) for s in (1, -1)]
    random = rng.integers(-TWO_24, TWO_24 + 1, size=max(count - len(special), 0))
    return np.concatenate([special, random]).astype(np.int64)[:count]


@pytest.fixture(params=ARITHMETICS)
def arithmetic(request, monkeypatch):
    """Kernels compiled with this angle arithmetic from here on (and forgotten afterwards)."""
    monkeypatch.setenv(compiler.ANGLE_ARITHMETIC_ENV, request.param)
    cr.clear_cache()
    yield request.param
    monkeypatch.undo()
    cr.clear_cache()


def assert_compiled_with(arithmetic):
    """Every computed-angle kernel compiled since clear_cache used ``arithmetic``."""
    used = {key[1] for key in compiler._compiled if key[1] is not None}
    assert used == {arithmetic}, used


# --------------------------------------------------------------------------------------------------
# The device code itself, against the CPU replay

PROBE = r"""
#include "angles.cuh"
extern "C" __global__ void angle_probe(const long long* positions, const double* inv_freq, int n,
                                       float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s, c;
  cupyrope::angle_sincos(positions[i], inv_freq[i], &s, &c);  // the general kernels' int64
  out[4 * i] = s;
  out[4 * i + 1] = c;
  cupyrope::angle_sincos(static_cast<double>(positions[i]), inv_freq[i], &s, &c);  // the lean one
  out[4 * i + 2] = s;
  out[4 * i + 3] = c;
}
"""


def probe(arithmetic, positions, inv_freq):
    """float32 (sin, cos) of every position * inv_freq from the device, as the int64 and the
    float64 position paths compute them: shape (4, n)."""
    module = cp.RawModule(code=PROBE, options=compiler.compile_options(arithmetic))
    function = module.get_function("angle_probe")
    n = len(positions)
    out = cp.empty(4 * n, dtype=cp.float32)
    function(((n + 127) // 128,), (128,),
             (cp.asarray(positions, dtype=cp.int64), cp.asarray(inv_freq, dtype=cp.float64),
              np.int32(n), out))
    return out.get().reshape(n, 4).T


@pytest.fixture(scope="module")
def probe_points():
    """(position, inv_freq) pairs: every inv_freq of four schedules at rotary_dim 128 with
    positions up to 2^24 (and some to 2^31 and 2^46), plus random inv_freq."""
    rng = np.random.default_rng(2024)
    freqs = np.unique(np.concatenate([
        cr.rope_frequencies(128, theta=10000.0)[0], cr.rope_frequencies(128, theta=500000.0)[0],
        cr.rope_frequencies(128, theta=500000.0, scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})[0],
        cr.rope_frequencies(128, theta=10000.0, scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})[0]]))
    positions = positions_to_2p24(rng, 3000)
    p = np.repeat(positions, len(freqs))
    f = np.tile(freqs, len(positions))
    p = np.concatenate([p, rng.integers(-(2**31), 2**31, 20000), rng.integers(2**40, 2**46, 2000)])
    f = np.concatenate([f, rng.uniform(0, 1, 22000)])
    return p, f


def test_float_float_kernel_is_the_cpu_replay_bit_for_bit(probe_points):
    positions, inv_freq = probe_points
    s, c, s_lean, c_lean = probe("float-float", positions, inv_freq)
    want_s, want_c = ff.float_float_sincos(positions, inv_freq)
    for name, got, want in (("sin", s, want_s), ("cos", c, want_c), ("sin (float64 position)",
                            s_lean, want_s), ("cos (float64 position)", c_lean, want_c)):
        differ = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert differ.size == 0, (
            f"{name}: {differ.size} of {len(got)} differ from the replay; first at position "
            f"{positions[differ[0]]}, inv_freq {inv_freq[differ[0]]!r}: {got[differ[0]]!r} vs "
            f"{want[differ[0]]!r}")


@pytest.mark.parametrize("arithmetic_name", ARITHMETICS)
def test_device_sin_cos_within_bound(probe_points, arithmetic_name):
    """Both builds: cos/sin within 1.75 * 2^-24 of the exact values at every |position| <= 2^24
    (test_float_float_angles.py's bound; the float64 build adds at most 2^-29 rad there)."""
    positions, inv_freq = probe_points
    keep = np.abs(positions) <= TWO_24
    positions, inv_freq = positions[keep], inv_freq[keep]
    s, c, s_lean, c_lean = probe(arithmetic_name, positions, inv_freq)
    k, r_hi, r_lo = exact_reduced_angles(positions, inv_freq)
    sin_r, cos_r = np.sin(r_hi) + r_lo * np.cos(r_hi), np.cos(r_hi) - r_lo * np.sin(r_hi)
    q = k % 4
    exact_sin = np.select([q == 0, q == 1, q == 2], [sin_r, cos_r, -sin_r], -cos_r)
    exact_cos = np.select([q == 0, q == 1, q == 2], [cos_r, -sin_r, -cos_r], sin_r)
    for got_s, got_c in ((s, c), (s_lean, c_lean)):
        worst = max(np.max(np.abs(got_s - exact_sin)), np.max(np.abs(got_c - exact_cos)))
        assert worst <= 1.75 * 2.0**-24, f"{arithmetic_name}: {worst / 2.0**-24:.3f} * 2^-24"


# --------------------------------------------------------------------------------------------------
# apply_rope and rms_norm_rope with computed angles, both arithmetics


@pytest.mark.parametrize("kernel", ["lean", "general"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_computed_angles_to_2p24(rng, monkeypatch, arithmetic, dtype, interleaved, kernel):
    from cupyrope.cuda import launch

    if kernel == "general":
        monkeypatch.setattr(launch, "lean_kernel_applies", lambda *args, **kwargs: False)
    t, hq, hk, d = 2048 + 111, 4, 2, 128  # past the decode kernel's token count
    positions = positions_to_2p24(rng, t)
    q_host, k_host = random_host(rng, (t, hq, d), dtype), random_host(rng, (t, hk, d), dtype)
    for theta in (10000.0, 500000.0):
        q_out, k_out = cr.apply_rope(to_gpu(q_host), to_gpu(k_host), to_gpu(positions),
                                     theta=theta, interleaved=interleaved)
        max_angle = max_abs_angle(positions, reference_inv_freq(d, theta))
        for out, x in ((q_out, q_host), (k_out, k_host)):
            ref = reference_rope(x, positions, theta=theta, interleaved=interleaved)
            assert_rope_close(to_host(out), ref, x, interleaved=interleaved, rotary_dim=d,
                              max_angle=max_angle)
    assert_compiled_with(arithmetic)


def test_computed_angles_int32_positions_and_inverse(rng, arithmetic):
    t, d = 512, 64
    positions = positions_to_2p24(rng, t).astype(np.int32)
    q_host = random_host(rng, (t, 8, d), "float32")
    out = cr.apply_rope(to_gpu(q_host), positions=to_gpu(positions), inverse=True)
    ref = reference_rope(q_host, positions.astype(np.int64), inverse=True)
    assert_rope_close(to_host(out), ref, q_host, interleaved=False, rotary_dim=d,
                      max_angle=max_abs_angle(positions, reference_inv_freq(d)))
    assert_compiled_with(arithmetic)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_norm_rope_to_2p24(rng, arithmetic, dtype):
    """The fused kernel's computed angles (RMSNorm in float32, then the rotation)."""
    t, hq, hk, d = 300, 4, 2, 128
    positions = positions_to_2p24(rng, t)
    q_host, k_host = random_host(rng, (t, hq, d), dtype), random_host(rng, (t, hk, d), dtype)
    w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    eps = 1e-6
    q_out, k_out = cr.rms_norm_rope(to_gpu(q_host), to_gpu(k_host), to_gpu(w), to_gpu(w),
                                    to_gpu(positions), eps=eps, theta=500000.0)
    for out, x in ((q_out, q_host), (k_out, k_host)):
        x64 = x.astype(np.float64)
        normed = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w
        expected = reference_rope(normed, positions, theta=500000.0)
        got = to_host(out).astype(np.float64)
        # 1 ulp of the output dtype plus float32 arithmetic (the norm's included), of the head
        scale = np.max(np.abs(expected), axis=-1, keepdims=True)
        bound = scale * (2 * unit_roundoff(dtype) + 64 * 2.0**-24)
        assert np.all(np.abs(got - expected) <= bound), np.max(np.abs(got - expected) / bound)
    assert_compiled_with(arithmetic)


# --------------------------------------------------------------------------------------------------
# Table sources up to 2^24 (their kernels read cos/sin: the arithmetic does not apply)


@pytest.fixture(scope="module")
def cache_2p24():
    """The library's float32 cache of 2^24 + 1 rows at rotary_dim 8 (512 MB), built on the GPU."""
    like = cp.empty(1, dtype=cp.float32)
    cache = cr.cos_sin_cache(TWO_24 + 1, 8, theta=10000.0, dtype="float32", like=like)
    yield cache
    del cache
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cache_rows_to_2p24(rng, cache_2p24, dtype, interleaved):
    t, d = 1000, 8
    positions = np.abs(positions_to_2p24(rng, t))
    positions[-10:] = np.arange(TWO_24 - 9, TWO_24 + 1)
    rows = to_host(cache_2p24[to_gpu(positions)])
    exact = reference_cos_sin_cache(0, d, theta=10000.0, positions=positions)
    # the rows at 2^24 are the float64 values rounded once, like row 0
    assert np.all(np.abs(rows - exact) <= unit_roundoff("float32") * np.abs(exact) + 2.0**-150)
    q_host = random_host(rng, (t, 4, 64), dtype)
    out = cr.apply_rope(to_gpu(q_host), positions=to_gpu(positions), cos_sin_cache=cache_2p24,
                        interleaved=interleaved)
    ref = reference_rope(q_host, positions, theta=10000.0, interleaved=interleaved, rotary_dim=d)
    assert_rope_close(to_host(out), ref, q_host, interleaved=interleaved, rotary_dim=d,
                      table_dtype="float32", max_angle=max_abs_angle(positions, reference_inv_freq(d)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_token_tables_near_2p24(rng, dtype):
    """Per-token tables from cupyrope.core.frequencies.cos_sin_table at positions near +-2^24."""
    from cupyrope.core.frequencies import cos_sin_table

    t, d = 600, 128
    positions = np.concatenate([np.arange(TWO_24 - 200, TWO_24 + 1), -np.arange(TWO_24 - 199, TWO_24 + 1),
                                rng.integers(-TWO_24, TWO_24 + 1, t - 401)]).astype(np.int64)
    inv_freq, attention_factor = cr.rope_frequencies(d, theta=500000.0)
    cos, sin = cos_sin_table(positions, inv_freq, attention_factor)
    cos32, sin32 = cos.astype(np.float32), sin.astype(np.float32)
    q_host = random_host(rng, (t, 4, d), dtype)
    # half-width tables ([T, d / 2]): rotary_dim says so (the default reads them as full width)
    out = cr.apply_rope(to_gpu(q_host), cos=to_gpu(cos32), sin=to_gpu(sin32), rotary_dim=d)
    ref = reference_rope(q_host, positions, theta=500000.0)
    assert_rope_close(to_host(out), ref, q_host, interleaved=False, rotary_dim=d,
                      table_dtype="float32",
                      max_angle=max_abs_angle(positions, reference_inv_freq(d, 500000.0)))
