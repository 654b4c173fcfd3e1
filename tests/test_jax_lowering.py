"""The jax.numpy lowering of traced calls on XLA's CPU (cupyrope/frontends/jax/lowering.py) against the
float64 reference: every angle source, both pairings, partial rotary, GQA, inverse, M-RoPE, cache
rows outside the cache (NaN), every dtype (float64 under x64); computed angles with x64 off at
positions up to 2^24 within the accuracy contract; and jax.export round trips."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cupyrope as cr  # noqa: E402
from reference import reference_inv_freq, reference_rope  # noqa: E402
from tolerances import assert_rope_close, max_abs_angle, np_dtype  # noqa: E402


def random(rng, shape, dtype="float32"):
    values = rng.standard_normal(shape)
    return np.where(np.abs(values) < 1e-3, 0.5, values).astype(np_dtype(dtype))


def traced(call, **options):
    """``call`` under jax.jit with its array arguments traced."""
    return jax.jit(lambda arrays: call(**arrays, **options))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", ["cache", "tables_half", "tables_full", "computed"])
def test_every_source_pairing_and_dtype_against_the_reference(rng, source, interleaved, dtype):
    T, Hq, Hk, D, r = 9, 4, 2, 40, 24  # GQA, partial rotary, an unaligned head_dim
    positions = rng.integers(0, 2048, T).astype(np.int32)
    q, k = random(rng, (T, Hq, D), dtype), random(rng, (T, Hk, D), dtype)
    inv_freq = reference_inv_freq(r)
    angles = positions[:, None].astype(np.float64) * inv_freq
    arrays, ref, check = dict(q=q, k=k), {}, {}
    if source == "cache":
        cache = cr.cos_sin_cache(2048, r)
        arrays.update(positions=positions, cos_sin_cache=cache)
        ref = dict(positions=positions, cos_sin_cache=cache.astype(np.float64))
    elif source.startswith("tables"):
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        if source == "tables_full":  # the Hugging Face layout: each angle twice
            widen = (lambda t: np.repeat(t, 2, -1)) if interleaved else (
                lambda t: np.concatenate((t, t), -1))
            cos, sin = widen(cos), widen(sin)
        arrays.update(cos=cos, sin=sin)
        ref = dict(cos=cos.astype(np.float64), sin=sin.astype(np.float64))
    else:
        arrays.update(positions=positions)
        ref = dict(positions=positions)
        check = dict(max_angle=max_abs_angle(positions, inv_freq))
    for inverse in (False, True):
        outs = traced(cr.apply_rope, rotary_dim=r, interleaved=interleaved, inverse=inverse)(
            {name: jnp.asarray(x) for name, x in arrays.items()})
        for x, out in zip((q, k), outs):
            expected = reference_rope(x, rotary_dim=r, interleaved=interleaved, inverse=inverse,
                                      **ref)
            assert_rope_close(np.asarray(out), expected, x, interleaved=interleaved,
                              rotary_dim=r, **check)


def test_computed_angles_without_x64_meet_the_contract_to_2_24(rng):
    """x64 off: the fixed-point reduction at positions up to 2^24 (and negative ones), theta 1e4
    and 5e5, float32 and bfloat16, against the exact float64 reference."""
    assert not jax.config.jax_enable_x64
    T, H, D = 512, 2, 128
    positions = np.concatenate([rng.integers(-2 ** 24, 2 ** 24, T - 4),
                                [0, 2 ** 24, -(2 ** 24), 2 ** 24 - 1]]).astype(np.int32)
    for theta in (1e4, 5e5):
        inv_freq = reference_inv_freq(D, theta)
        for dtype in ("float32", "bfloat16"):
            q = random(rng, (T, H, D), dtype)
            out = traced(cr.apply_rope, theta=theta)(dict(q=jnp.asarray(q),
                                                          positions=jnp.asarray(positions)))
            expected = reference_rope(q, positions, theta=theta)
            assert_rope_close(np.asarray(out), expected, q, interleaved=False, rotary_dim=D,
                              max_angle=max_abs_angle(positions, inv_freq))


def test_float64_and_x64_angles(rng):
    """Under jax.enable_x64: float64 inputs rotate in float64 (int64 positions), and float32
    inputs take float64 angles as the NumPy path does."""
    T, H, D = 6, 2, 16
    positions = rng.integers(0, 2 ** 24, T)
    with jax.enable_x64(True):
        for dtype in ("float64", "float32"):
            q = random(rng, (T, H, D), dtype)
            out = traced(cr.apply_rope, theta=1e4)(dict(q=jnp.asarray(q),
                                                        positions=jnp.asarray(positions)))
            assert out.dtype == q.dtype
            assert_rope_close(np.asarray(out), reference_rope(q, positions), q,
                              interleaved=False, rotary_dim=D,
                              max_angle=max_abs_angle(positions, reference_inv_freq(D)))
    assert not jax.config.jax_enable_x64


def test_mrope_and_positions_outside_the_cache(rng):
    T, H, D = 7, 2, 16
    q = random(rng, (T, H, D))
    mrope = np.stack([rng.integers(0, 64, T)] * 3).astype(np.int32)
    scaling = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    out = traced(cr.apply_rope, scaling=scaling)(dict(q=jnp.asarray(q),
                                                      positions=jnp.asarray(mrope)))
    # equal components: M-RoPE is the plain rotation by those positions
    assert_rope_close(np.asarray(out), reference_rope(q, mrope[0]), q, interleaved=False,
                      rotary_dim=D, max_angle=64.0)
    eager = cr.apply_rope(q, positions=mrope, scaling={"rope_type": "default",
                                                       "mrope_section": [4, 2, 2]})
    mixed = np.stack([rng.integers(0, 64, T) for _ in range(3)]).astype(np.int32)
    eager = cr.apply_rope(q, positions=mixed, scaling=scaling)
    out = traced(cr.apply_rope, scaling=scaling)(dict(q=jnp.asarray(q),
                                                      positions=jnp.asarray(mixed)))
    np.testing.assert_allclose(np.asarray(out), eager, rtol=0, atol=1e-6)
    cache = cr.cos_sin_cache(16, D)
    positions = np.array([0, 3, 16, -1, 15, 100, 2], np.int32)
    out = traced(cr.apply_rope)(dict(q=jnp.asarray(q), positions=jnp.asarray(positions),
                                     cos_sin_cache=jnp.asarray(cache)))
    outside = (positions < 0) | (positions >= 16)
    assert np.all(np.isnan(np.asarray(out)[outside])) and not np.any(np.isnan(np.asarray(out)[~outside]))


def _round_trip(f, *args):
    pytest.importorskip("flatbuffers", reason="jax.export's serialisation needs flatbuffers")
    exported = jax.export.export(jax.jit(f), platforms=("cpu",))(*args)
    exported = jax.export.deserialize(exported.serialize())
    return exported.call(*args)


def test_export_round_trip(rng):
    """jax.export of apply_rope (cache and computed angles), rms_norm_rope and fp8 outputs:
    serialised, deserialised and called, the jitted call's bits. The exported module holds no
    Python callback."""
    T, Hq, Hk, D = 5, 4, 2, 32
    # The jax.numpy lowering on XLA's CPU, also where a GPU is the default device (the native
    # call's export is tested in test_jax_native_gpu.py).
    cpu = jax.devices("cpu")[0]
    q, k = jax.device_put(random(rng, (T, Hq, D)), cpu), jax.device_put(random(rng, (T, Hk, D)), cpu)
    positions = jax.device_put(rng.integers(0, 512, T).astype(np.int32), cpu)
    cache = jax.device_put(cr.cos_sin_cache(512, D), cpu)
    w = jax.device_put(rng.uniform(0.5, 1.5, D).astype(np.float32), cpu)
    calls = [lambda q, k, p: cr.apply_rope(q, k, p, cos_sin_cache=cache),
             lambda q, k, p: cr.apply_rope(q, k, p, theta=5e5),
             lambda q, k, p: cr.rms_norm_rope(q, k, w, w, p, eps=1e-6),
             lambda q, k, p: cr.apply_rope(q, k, p, out_dtype="float8_e4m3fn", q_scale=0.5)]
    for f in calls:
        text = jax.export.export(jax.jit(f), platforms=("cpu",))(q, k, positions).mlir_module()
        assert "callback" not in text
        for got, want in zip(_round_trip(f, q, k, positions), jax.jit(f)(q, k, positions)):
            assert got.dtype == want.dtype
            assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
