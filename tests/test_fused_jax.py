"""The fused ops on JAX (cupyrope/frontends/jax/ops.py): ``rms_norm_rope``, fp8 outputs and
``rope_and_cache`` under jax.jit, jax.grad and jax.vmap, on JAX CPU (CI) and JAX GPU (marked gpu).

- jit of each op against the float64 reference, and bit for bit against the eager call;
- fp8 scales as Python floats or traced 0-d / one-element arrays, read when the call runs;
- rope_and_cache returns new caches: rows no slot names keep the input cache's values, the input
  caches are unchanged, and donated caches are updated in place (same buffer);
- jax.grad of rms_norm_rope (q, k, q_weight, k_weight) against jax.grad of a float64 jax.numpy
  formulation and numerical differentiation; differentiating fp8 outputs or the cache write raises;
- jax.vmap equals the per-element calls;
- refusals under jit carry the eager calls' exception types and messages.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

import cupyrope as cr  # noqa: E402
from backends import Backend, angle_source, backend_params  # noqa: E402
from reference import reference_rope  # noqa: E402
from test_fused import FP8, _assert_close, _cache_case, _cache_rows, _rms_norm64  # noqa: E402
from test_jax_grad import jax_angles, jnp_rope, random  # noqa: E402
from jax_route import assert_within_ulps, launches  # noqa: E402
from tolerances import assert_bits_equal, np_dtype  # noqa: E402

JAX = backend_params(["jax", "jax-gpu"])
EPS = 1e-6


def _on(backend: Backend, lib: dict) -> tuple[dict, dict]:
    """(arrays on the backend, other options) of a dict of call arguments."""
    arrays = {name: backend.put(v) for name, v in lib.items() if isinstance(v, np.ndarray)}
    return arrays, {name: v for name, v in lib.items() if name not in arrays}


def _jit(op, **options):
    """``op`` under jax.jit: its arrays (one dict) traced, its other options closed over."""
    return jax.jit(lambda arrays: op(**arrays, **options))


def _as_format(got: np.ndarray, fmt: np.dtype) -> np.ndarray:
    return got.view(fmt) if got.dtype == np.uint8 else got


def _assert_rounded_once(got, exact64, fmt, what):
    """fp8 values one rounding of a float32 value within a float32 ulp of the exact one."""
    lo = np.nextafter(exact64.astype(np.float32), -np.inf).astype(fmt).astype(np.float64)
    hi = np.nextafter(exact64.astype(np.float32), np.inf).astype(fmt).astype(np.float64)
    value = np.asarray(got).astype(np.float64)
    bad = ~((value >= np.minimum(lo, hi)) & (value <= np.maximum(lo, hi)))
    assert not bad.any(), f"{what}: {bad.sum()} value(s) off, first at {np.argwhere(bad)[0]}"


# ----------------------------------------------------------------------------------------------
# jax.jit


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
@pytest.mark.parametrize("interleaved,rotary_fraction,weight_offset",
                         [(False, 1, 0.0), (True, 2, 1.0)])
def test_jit_rms_norm_rope_matches_the_reference_and_eager(backend, rng, dtype, source,
                                                          interleaved, rotary_fraction,
                                                          weight_offset):
    T, Hq, Hk, D = 19, 4, 2, 64
    r = D // rotary_fraction
    positions = rng.integers(0, 4096, T).astype(np.int32)
    host = dict(q=(rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype)),
                k=(rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype)),
                q_weight=rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype)),
                k_weight=rng.uniform(0.5, 1.5, D).astype(np.float32).astype(np_dtype(dtype)))
    lib, ref_kw, _ = angle_source(source, (T,), positions, r, interleaved=interleaved)
    arrays, options = _on(backend, {**host, **lib})
    options.update(eps=EPS, weight_offset=weight_offset, interleaved=interleaved)
    jitted = _jit(cr.rms_norm_rope, **options)(arrays)
    eager = cr.rms_norm_rope(**arrays, **options)  # concrete arrays: the DLPack path
    for name, out, again in zip(("q", "k"), jitted, eager):
        assert isinstance(out, jax.Array) and out.dtype == np_dtype(dtype)
        assert out.devices() == arrays[name].devices()
        expected = reference_rope(_rms_norm64(host[name], host[f"{name}_weight"], EPS,
                                              weight_offset), interleaved=interleaved, **ref_kw)
        _assert_close(np.asarray(out), expected, dtype, f"{backend} jit {name}")
        # RMSNorm's sum of squares is added in another order too
        assert_within_ulps(out, again, host[name], what=f"jit vs eager {name}", ulps=2)


@pytest.mark.parametrize("backend", JAX, indirect=True)
def test_jit_rms_norm_rope_of_q_alone(backend, rng):
    x = random(rng, (6, 3, 32))
    w = rng.uniform(0.5, 1.5, 32).astype(np.float32)
    positions = np.arange(6, dtype=np.int32)
    arrays, _ = _on(backend, dict(q=x, q_weight=w, positions=positions))
    out = _jit(cr.rms_norm_rope, k=None, k_weight=None, eps=EPS)(arrays)
    assert isinstance(out, jax.Array) and out.shape == x.shape
    _assert_close(np.asarray(out), reference_rope(_rms_norm64(x, w, EPS, 0.0), positions),
                  "float32", "q alone")


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scales", ["numbers", "0-d", "one-element"])
@pytest.mark.parametrize("norm", [False, True])
def test_jit_fp8_outputs_with_static_or_traced_scales(backend, rng, fp8, scales, norm):
    T, Hq, Hk, D = 23, 4, 1, 96
    q, k = random(rng, (T, Hq, D)) * 4, random(rng, (T, Hk, D)) * 4
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    positions = rng.integers(0, 1000, T).astype(np.int32)
    host = dict(q=q, k=k, positions=positions)
    if norm:
        host.update(q_weight=w, k_weight=w)
    arrays, _ = _on(backend, host)
    options = dict(rotary_dim=64, out_dtype=fp8, eps=EPS) if norm else dict(rotary_dim=64,
                                                                             out_dtype=fp8)
    op = cr.rms_norm_rope if norm else cr.apply_rope
    shape = {"0-d": (), "one-element": (1,)}.get(scales)

    def scaled(q_scale, k_scale):
        if shape is None:
            return _jit(op, **options, q_scale=q_scale, k_scale=k_scale)(arrays)
        values = {name: backend.put(np.full(shape, s, np.float32))
                  for name, s in (("q_scale", q_scale), ("k_scale", k_scale))}
        return _jit(op, **options)({**arrays, **values})

    fmt = np.dtype(getattr(ml_dtypes, fp8))
    for q_scale, k_scale in ((0.25, 2.0), (0.5, 0.125)):  # traced: one compiled call, new values
        outs = scaled(q_scale, k_scale)
        eager = op(**arrays, **options, q_scale=q_scale, k_scale=k_scale)
        for x, out, again, scale, name in zip((q, k), outs, eager, (q_scale, k_scale), "qk"):
            assert out.dtype == fmt and out.shape == x.shape
            rotated = reference_rope(_rms_norm64(x, w, EPS, 0.0) if norm else x, positions,
                                     rotary_dim=64)
            _assert_rounded_once(np.asarray(out), rotated / scale, fmt, f"{name} / {scale}")
            assert_bits_equal(np.asarray(out), _as_format(np.asarray(again), fmt),
                              what=f"jit vs eager {name}")


def _assert_cache_rows(k_cache, v_cache, layout, slots, k_rotated, v, dtype, fills):
    """The rows the slots name hold the rotated k and v (copied exactly); every other row keeps
    its fill value."""
    valid = slots >= 0
    rows_k, rows_v = _cache_rows(np.asarray(k_cache), layout), _cache_rows(np.asarray(v_cache),
                                                                          layout)
    _assert_close(rows_k[slots[valid]], k_rotated[valid], dtype, "k cache")
    np.testing.assert_array_equal(rows_v[slots[valid]], v[valid])
    untouched = np.setdiff1d(np.arange(rows_k.shape[0]), slots[valid])
    for rows, fill, name in ((rows_k, fills[0], "k"), (rows_v, fills[1], "v")):
        assert np.all(rows[untouched].astype(np.float32) == fill), f"{name} cache: rows changed"


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("layout,block_size", [("NHD", 1), ("NHD", 16), ("HND", 1), ("HND", 16)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rope_and_cache_returns_new_caches(backend, rng, layout, block_size, dtype):
    dt = np_dtype(dtype)
    q, k, v, slots, shape = _cache_case(rng, layout=layout, block_size=block_size,
                                        num_blocks=64 // block_size + 2)
    positions = rng.integers(0, 512, len(q)).astype(np.int32)
    table = cr.cos_sin_cache(512, 64, dtype="float32")
    host = dict(q=q.astype(dt), k=k.astype(dt), v=v.astype(dt), positions=positions,
                k_cache=np.full(shape, 7, dt), v_cache=np.full(shape, -3, dt),
                slot_mapping=slots.astype(np.int32), cos_sin_cache=table)
    arrays, _ = _on(backend, host)
    jitted = _jit(cr.rope_and_cache, layout=layout, inplace=False)(arrays)
    eager = cr.rope_and_cache(**arrays, layout=layout, inplace=False)
    for out, again, name in zip(jitted, eager, ("q_out", "k_out", "k_cache", "v_cache")):
        assert isinstance(out, jax.Array) and out.dtype == dt
        assert out.devices() == arrays["q"].devices()
        assert_bits_equal(np.asarray(out), np.asarray(again), what=f"jit vs eager {name}")
    q_out, k_out, k_cache, v_cache = jitted
    _assert_close(np.asarray(q_out), reference_rope(host["q"], positions, cos_sin_cache=table),
                  dtype, "q")
    k_rot = reference_rope(host["k"], positions, cos_sin_cache=table)
    _assert_close(np.asarray(k_out), k_rot, dtype, "k")
    _assert_cache_rows(k_cache, v_cache, layout, slots, k_rot, host["v"], dtype, (7, -3))
    for name in ("k_cache", "v_cache"):  # JAX arrays never change
        assert_bits_equal(np.asarray(arrays[name]), host[name], what=f"input {name}")


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("cache_format", ["float32", "float8_e4m3fn"])
def test_donated_caches_are_updated_in_place_across_decode_steps(backend, rng, cache_format):
    """Two decode steps of one jitted function that donates its caches: each step's caches are
    consumed, its slots written, and the first step's rows survive the second."""
    T, Hk, D, blocks, size = 4, 2, 64, 3, 4
    fmt = np_dtype(cache_format) if cache_format == "float32" else getattr(ml_dtypes, cache_format)
    caches = [backend.put(np.zeros((blocks, size, Hk, D), fmt)) for _ in range(2)]
    step = jax.jit(lambda q, k, v, p, kc, vc, s: cr.rope_and_cache(q, k, v, p, kc, vc, s,
                                                                   inplace=False),
                   donate_argnums=(4, 5))
    written = {}
    for first_slot in (0, T):
        q, k, v = random(rng, (T, 3, D)), random(rng, (T, Hk, D)), random(rng, (T, Hk, D))
        positions, slots = np.arange(T, dtype=np.int32) + first_slot, np.arange(T) + first_slot
        *_, k_cache, v_cache = step(*(backend.put(x) for x in (q, k, v, positions)), *caches,
                                    backend.put(slots.astype(np.int32)))
        assert all(c.is_deleted() for c in caches)
        # Donation lets XLA reuse the buffers (may-alias) but does not oblige it to: on an H200
        # machine (jaxlib 0.11.2) XLA gave a cache a new buffer in some runs, on the GPU and the
        # CPU device, float32 and fp8 caches, through every route (also at the commit before
        # them), so buffer reuse is not asserted; the donated arrays are consumed, and each
        # step's rows must survive the next.
        caches = [k_cache, v_cache]
        written[first_slot] = (reference_rope(k, positions), v)
    rows_k, rows_v = (np.asarray(c).astype(np.float64).reshape(-1, Hk, D) for c in caches)
    for first_slot, (k_rot, v) in written.items():
        slots = slice(first_slot, first_slot + T)
        if cache_format == "float32":
            _assert_close(rows_k[slots], k_rot, "float32", f"k rows of step {first_slot}")
            np.testing.assert_array_equal(rows_v[slots], v)
        else:
            _assert_rounded_once(rows_k[slots], k_rot, np.dtype(fmt), f"k rows {first_slot}")
            _assert_rounded_once(rows_v[slots], v.astype(np.float64), np.dtype(fmt), "v rows")
    assert not rows_k[2 * T:].any() and not rows_v[2 * T:].any()


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("bits", [False, True])
def test_jit_rope_and_cache_fp8_with_norm_and_traced_scales(backend, rng, fp8, bits):
    """QK-norm + RoPE + fp8 cache write under jit; k_scale / v_scale traced; the caches as fp8
    arrays or as their bits (uint8 with cache_dtype)."""
    q, k, v, slots, shape = _cache_case(rng, num_blocks=8, block_size=4)
    D = q.shape[-1]
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    positions = rng.integers(0, 256, len(q)).astype(np.int32)
    fmt = np.dtype(getattr(ml_dtypes, fp8))
    fill = np.full(shape, 7, np.float32).astype(fmt)
    host = dict(q=q, k=k, v=v, positions=positions, q_weight=w, k_weight=w,
                k_cache=fill.view(np.uint8) if bits else fill,
                v_cache=fill.view(np.uint8) if bits else fill, slot_mapping=slots.astype(np.int32),
                k_scale=np.full((), 0.5, np.float32), v_scale=np.full((1,), 2.0, np.float32))
    arrays, _ = _on(backend, host)
    options = dict(theta=1e6, eps=EPS, inplace=False, **({"cache_dtype": fp8} if bits else {}))
    q_out, k_out, k_cache, v_cache = _jit(cr.rope_and_cache, **options)(arrays)
    assert k_cache.dtype == host["k_cache"].dtype and v_cache.dtype == host["v_cache"].dtype
    valid = slots >= 0
    k_rot = reference_rope(_rms_norm64(k, w, EPS, 0.0), positions, theta=1e6)
    _assert_close(np.asarray(k_out), k_rot, "float32", "k_out")
    _assert_close(np.asarray(q_out), reference_rope(_rms_norm64(q, w, EPS, 0.0), positions,
                                                    theta=1e6), "float32", "q_out")
    for cache, exact, name in ((k_cache, k_rot / 0.5, "k"), (v_cache, v / 2.0, "v")):
        rows = _cache_rows(_as_format(np.asarray(cache), fmt), "NHD")
        _assert_rounded_once(rows[slots[valid]], exact[valid].astype(np.float64), fmt,
                             f"{name} cache")
        untouched = np.setdiff1d(np.arange(rows.shape[0]), slots[valid])
        assert np.all(rows[untouched].astype(np.float32) == 7)


def test_the_same_array_as_both_caches_gives_two_new_caches(rng):
    """Eager calls refuse a k_cache that overlaps v_cache (one would overwrite the other); on
    JAX the caches come back as two new arrays, so one array may stand for both."""
    q, k, v, slots, shape = _cache_case(rng, T=6, num_blocks=2, block_size=4)
    cache = jnp.zeros(shape, jnp.float32)
    _, _, k_cache, v_cache = cr.rope_and_cache(*(jnp.asarray(x) for x in (q, k, v)), None, cache,
                                               cache, jnp.asarray(slots), inplace=False)
    _assert_cache_rows(k_cache, v_cache, "NHD", slots, reference_rope(k, np.arange(6)), v,
                       "float32", (0, 0))
    assert not np.asarray(cache).any()


# ----------------------------------------------------------------------------------------------
# jax.vmap


@pytest.mark.parametrize("backend", JAX, indirect=True)
def test_vmap_equals_per_element_calls(backend, rng):
    N, T, H, D = 3, 5, 2, 32
    xs, ks, vs = random(rng, (N, T, H, D)), random(rng, (N, T, 1, D)), random(rng, (N, T, 1, D))
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    positions = rng.integers(0, 100, (N, T)).astype(np.int32)
    slots = np.stack([rng.permutation(8)[:T] for _ in range(N)]).astype(np.int32)
    caches = rng.standard_normal((N, 4, 2, 1, D)).astype(np.float32)
    a = {name: backend.put(x) for name, x in
         dict(x=xs, k=ks, v=vs, w=w, p=positions, s=slots, c=caches).items()}
    calls = {
        "rms_norm_rope": (lambda x, k, p: cr.rms_norm_rope(x, k, a["w"], a["w"], p, eps=EPS),
                          (a["x"], a["k"], a["p"])),
        "fp8": (lambda x, p: cr.apply_rope(x, positions=p, out_dtype="float8_e4m3fn",
                                           q_scale=0.5), (a["x"], a["p"])),
        "rope_and_cache": (lambda x, k, v, p, c, s: cr.rope_and_cache(
            x, k, v, p, c, c, s, inplace=False), (a["x"], a["k"], a["v"], a["p"], a["c"], a["s"])),
    }
    for name, (call, args) in calls.items():
        batched = jax.tree.leaves(jax.vmap(call)(*args))
        for i in range(N):
            single = jax.tree.leaves(jax.jit(call)(*(x[i] for x in args)))
            for got, want in zip(batched, single):
                assert_bits_equal(np.asarray(got[i]), np.asarray(want), what=f"{name} element {i}")


def test_vmap_folds_rms_norm_rope_and_fp8_into_one_launch(rng):
    """jax.vmap of rms_norm_rope and of fp8 outputs is one launch over the batch (a leading token
    dim); batched norm weights, shared by nothing, run per element; the cache write runs per
    element. Every result equals the per-element call bit for bit (test above)."""
    N, T, H, D = 3, 5, 2, 32
    xs, ks, vs = random(rng, (N, T, H, D)), random(rng, (N, T, 1, D)), random(rng, (N, T, 1, D))
    w = jnp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32))
    ws = jnp.stack([w, w * 0.5, w * 2.0])
    positions = jnp.asarray(rng.integers(0, 100, (N, T)).astype(np.int32))
    shared_k = jnp.asarray(ks[0])

    assert launches(jax.vmap(lambda x, p: cr.rms_norm_rope(x, shared_k, w, w, p, eps=EPS)),
                    xs, positions) == [(N, T, H, D)]
    assert launches(jax.vmap(lambda x, p: cr.apply_rope(x, positions=p, out_dtype="float8_e4m3fn",
                                                        q_scale=0.5)), xs, positions) == [(N, T, H, D)]
    per_weight = jax.vmap(lambda x, p, w: cr.rms_norm_rope(x, None, w, None, p, eps=EPS))
    assert launches(per_weight, xs, positions, ws) == [(T, H, D)] * N
    out = per_weight(xs, positions, ws)
    single = jax.jit(lambda x, p, w: cr.rms_norm_rope(x, None, w, None, p, eps=EPS))
    for i in range(N):
        assert_bits_equal(np.asarray(out[i]), np.asarray(single(jnp.asarray(xs[i]), positions[i],
                                                                ws[i])),
                          what=f"batched weights, element {i}")
    slots = jnp.asarray(np.stack([rng.permutation(8)[:T] for _ in range(N)]).astype(np.int32))
    caches = jnp.asarray(rng.standard_normal((N, 4, 2, 1, D)).astype(np.float32))
    assert launches(jax.vmap(lambda x, k, v, p, c, s: cr.rope_and_cache(x, k, v, p, c, c, s,
                                                                        inplace=False)),
                    xs, ks, vs, positions, caches, slots) == [(T, H, D)] * N


# ----------------------------------------------------------------------------------------------
# jax.grad


def _jnp_rms_norm_rope(x, weight, cos, sin, rotary_dim, interleaved, weight_offset):
    """RMSNorm then RoPE in plain jax.numpy (float64 under jax.enable_x64), for jax.grad."""
    n = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
    return jnp_rope(n * (weight_offset + weight), cos, sin, rotary_dim, interleaved)


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("rotary,weight_offset", [("full", 0.0), ("partial", 1.0)])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", ["cache", "tables_half", "tables_full", "computed"])
def test_grad_rms_norm_rope_matches_float64_jax_numpy(backend, rng, source, interleaved, rotary,
                                                      weight_offset, jit):
    T, Hq, Hk, D = 5, 4, 2, 16
    r = D if rotary == "full" else 8
    lib, _, _, (cos, sin) = jax_angles(source, (T,), r, interleaved, rng)
    device = jax.devices("gpu" if backend.on_gpu else "cpu")[0]
    lib = {name: jax.device_put(x, device) if isinstance(x, jax.Array) else x
           for name, x in lib.items()}
    host = dict(q=random(rng, (T, Hq, D)), k=random(rng, (T, Hk, D)),
                q_weight=rng.uniform(0.5, 1.5, D).astype(np.float32),
                k_weight=rng.uniform(0.5, 1.5, D).astype(np.float32))
    cotangents = random(rng, (T, Hq, D)), random(rng, (T, Hk, D))

    def loss(q, k, q_weight, k_weight):
        q_out, k_out = cr.rms_norm_rope(q, k, q_weight, k_weight, eps=EPS,
                                        weight_offset=weight_offset, interleaved=interleaved,
                                        **lib)
        return jnp.sum(q_out * cotangents[0]) + jnp.sum(k_out * cotangents[1])

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    got = (jax.jit(grad) if jit else grad)(*(backend.put(host[n]) for n in
                                             ("q", "k", "q_weight", "k_weight")))

    def loss64(q, k, q_weight, k_weight):
        return sum(jnp.sum(_jnp_rms_norm_rope(x, w, cos, sin, r, interleaved, weight_offset) * g)
                   for x, w, g in ((q, q_weight, cotangents[0]), (k, k_weight, cotangents[1])))

    with jax.enable_x64(True):
        want = jax.jit(jax.grad(loss64, argnums=(0, 1, 2, 3)))(
            *(jnp.asarray(host[n], jnp.float64) for n in ("q", "k", "q_weight", "k_weight")))
        want = [np.asarray(w) for w in want]
    for g, w, name in zip(got, want, ("q", "k", "q_weight", "k_weight")):
        assert g.dtype == jnp.float32 and g.shape == host[name].shape
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5 * np.abs(w).max(),
                                   err_msg=f"grad of {name}")


@pytest.mark.parametrize("backend", JAX, indirect=True)
def test_grad_in_bfloat16_and_of_q_alone(backend, rng):
    """bfloat16 inputs get bfloat16 gradients (computed in float32, rounded once); with k None
    the gradient covers q and q_weight; jit(grad) equals grad bit for bit."""
    T, H, D = 6, 3, 32
    x = random(rng, (T, H, D)).astype(np_dtype("bfloat16"))
    w = rng.uniform(0.5, 1.5, D).astype(np_dtype("bfloat16"))
    g = random(rng, (T, H, D))
    positions = backend.put(np.arange(T, dtype=np.int32))

    def loss(x, w):
        out = cr.rms_norm_rope(x, None, w, None, positions, eps=EPS)
        return jnp.sum(out.astype(jnp.float32) * g)

    grad = jax.grad(loss, argnums=(0, 1))
    eager, jitted = grad(backend.put(x), backend.put(w)), jax.jit(grad)(backend.put(x),
                                                                        backend.put(w))
    for a, b, name in zip(eager, jitted, ("q", "q_weight")):
        assert a.dtype == jnp.bfloat16
        assert_bits_equal(np.asarray(b), np.asarray(a), what=f"jit(grad) of {name}")
    angles = np.arange(T)[:, None] * 10000.0 ** (-np.arange(D // 2) * 2 / D)
    with jax.enable_x64(True):
        want = jax.jit(jax.grad(lambda x, w: jnp.sum(_jnp_rms_norm_rope(
            x, w, jnp.cos(angles), jnp.sin(angles), D, False, 0.0) * g), argnums=(0, 1)))(
            *(jnp.asarray(a, jnp.float64) for a in (x, w)))
    for got, ref, name in zip(eager, want, ("q", "q_weight")):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref), rtol=2 ** -7,
                                   atol=2 ** -7 * np.abs(np.asarray(ref)).max(),
                                   err_msg=f"bfloat16 grad of {name}")


def test_grad_rms_norm_rope_numerically(rng):
    from jax.test_util import check_grads

    T, D = 4, 16
    with jax.default_device(jax.devices("cpu")[0]):
        positions = jnp.asarray(rng.integers(0, 64, T), jnp.int32)
        args = (jnp.asarray(random(rng, (T, 2, D))), jnp.asarray(random(rng, (T, 1, D))),
                jnp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32)),
                jnp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32)))
        check_grads(lambda q, k, wq, wk: cr.rms_norm_rope(q, k, wq, wk, positions, eps=EPS,
                                                          weight_offset=1.0, interleaved=True,
                                                          rotary_dim=8),
                    args, order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_vmap_of_grad(rng):
    N, T, D = 3, 4, 16
    xs = jnp.asarray(random(rng, (N, T, 2, D)))
    w = jnp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32))

    def loss(x):
        return jnp.sum(cr.rms_norm_rope(x, None, w, None, eps=EPS) ** 3)

    grad = jax.jit(jax.grad(loss))
    batched = jax.jit(jax.vmap(grad))(xs)
    for i in range(N):
        assert_bits_equal(np.asarray(batched[i]), np.asarray(grad(xs[i])),
                          what=f"vmap(grad) element {i}")


@pytest.mark.parametrize("call,error,match", [
    (lambda q, k: cr.apply_rope(q, k, out_dtype="float8_e4m3fn", q_scale=0.5)[0],
     TypeError, r"apply_rope: fp8 outputs \(out_dtype='float8_e4m3fn'\) have no gradient"),
    (lambda q, k: cr.rms_norm_rope(q, k, jnp.ones(16), jnp.ones(16), eps=EPS,
                                   out_dtype="float8_e5m2")[1],
     TypeError, "rms_norm_rope: fp8 outputs .* have no gradient"),
    (lambda q, k: cr.rope_and_cache(q, k, k, None, jnp.zeros((2, 4, 1, 16)),
                                    jnp.zeros((2, 4, 1, 16)), jnp.arange(3), inplace=False)[1],
     NotImplementedError, "rope_and_cache: jax.grad through the KV-cache write"),
])
def test_differentiating_fp8_outputs_or_the_cache_write_raises_while_tracing(rng, call, error,
                                                                             match):
    q, k = jnp.asarray(random(rng, (3, 2, 16))), jnp.asarray(random(rng, (3, 1, 16)))
    loss = jax.jit(jax.grad(lambda q: jnp.sum(call(q, k).astype(jnp.float32))))
    with pytest.raises(error, match=match):
        loss.lower(q)  # tracing only: nothing runs


def test_stop_gradient_lets_fp8_outputs_through_grad(rng):
    q = jnp.asarray(random(rng, (3, 2, 16)))

    def loss(q):
        q8 = cr.apply_rope(jax.lax.stop_gradient(q), out_dtype="float8_e4m3fn")
        return jnp.sum(q * q8.astype(jnp.float32))

    np.testing.assert_array_equal(
        np.asarray(jax.grad(loss)(q)),
        np.asarray(cr.apply_rope(q, out_dtype="float8_e4m3fn")).astype(np.float32))


# ----------------------------------------------------------------------------------------------
# Refusals: the eager calls' types and messages, raised while tracing


def _norm_case(rng):
    return dict(q=random(rng, (3, 2, 64)), k=random(rng, (3, 1, 64)),
                q_weight=np.ones(64, np.float32), k_weight=np.ones(64, np.float32),
                positions=np.arange(3, dtype=np.int32))


def _cache_args(rng):
    q, k, v, slots, shape = _cache_case(rng)
    return dict(q=q, k=k, v=v, positions=np.arange(len(q), dtype=np.int32),
                k_cache=np.zeros(shape, np.float32),
                v_cache=np.zeros(shape, np.float32), slot_mapping=slots.astype(np.int32))


def _fp8_caches(args):
    fmt = np.dtype(ml_dtypes.float8_e4m3fn)
    return dict(k_cache=args["k_cache"].astype(fmt), v_cache=args["v_cache"].astype(fmt))


# (op, case builder, changes to the arrays (a function of them), options): each refused.
REFUSALS = {
    "eps missing": (cr.rms_norm_rope, _norm_case, None, dict(eps=None)),
    "eps text": (cr.rms_norm_rope, _norm_case, None, dict(eps="1e-6")),
    "weight shape": (cr.rms_norm_rope, _norm_case,
                     lambda a: dict(q_weight=np.ones(32, np.float32)), dict(eps=EPS)),
    "weight dtypes": (cr.rms_norm_rope, _norm_case,
                      lambda a: dict(k_weight=np.ones(64, np.float16)), dict(eps=EPS)),
    "out_dtype": (cr.rms_norm_rope, _norm_case, None, dict(eps=EPS, out_dtype="int8")),
    "fp8 in place": (cr.rms_norm_rope, _norm_case, None,
                     dict(eps=EPS, out_dtype="float8_e4m3fn", inplace=True)),
    "scale without fp8": (cr.rms_norm_rope, _norm_case,
                          lambda a: dict(q_scale=np.float32(0.5).reshape(())), dict(eps=EPS)),
    "cache heads": (cr.rope_and_cache, _cache_args, lambda a: dict(
        k_cache=np.zeros((8, 4, 3, 64), np.float32), v_cache=np.zeros((8, 4, 3, 64), np.float32)),
        {}),
    "cache dtype": (cr.rope_and_cache, _cache_args, lambda a: dict(
        k_cache=a["k_cache"].astype(np.float16), v_cache=a["v_cache"].astype(np.float16)), {}),
    "v tokens": (cr.rope_and_cache, _cache_args, lambda a: dict(v=a["v"][:-1]), {}),
    "slot shape": (cr.rope_and_cache, _cache_args,
                   lambda a: dict(slot_mapping=a["slot_mapping"][:-1]), {}),
    "slot dtype": (cr.rope_and_cache, _cache_args,
                   lambda a: dict(slot_mapping=a["slot_mapping"].astype(np.float32)), {}),
    "scale shape": (cr.rope_and_cache, _cache_args,
                    lambda a: dict(_fp8_caches(a), k_scale=np.ones(2, np.float32)), {}),
    "layout": (cr.rope_and_cache, _cache_args, None, dict(layout="NDH")),
    "uint8 caches": (cr.rope_and_cache, _cache_args, lambda a: dict(
        k_cache=a["k_cache"].astype(np.uint8), v_cache=a["v_cache"].astype(np.uint8)), {}),
    "blocks": (cr.rope_and_cache, _cache_args, lambda a: dict(v_cache=a["v_cache"][:-1]), {}),
    "k missing": (cr.rope_and_cache, _cache_args, lambda a: dict(k=None, v=None), {}),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_under_jit_match_eager_calls(rng, case):
    op, build, change, options = REFUSALS[case]
    host = build(rng)
    host.update(change(host) if change else {})
    if op is cr.rope_and_cache:
        options = dict(options, inplace=False)
    with pytest.raises((TypeError, ValueError)) as eager:  # NumPy arrays: the array path
        op(**host, **options)
    arrays = {name: jnp.asarray(x) for name, x in host.items() if x is not None}
    nones = {name: None for name, x in host.items() if x is None}
    with pytest.raises(eager.type) as traced:
        _jit(op, **nones, **options).lower(arrays)
    assert str(traced.value) == str(eager.value)


def test_in_place_on_jax_is_refused_alike_eager_and_under_jit(rng):
    a = {name: jnp.asarray(x) for name, x in _norm_case(rng).items()}
    with pytest.raises(TypeError, match="q is an immutable JAX array") as eager:
        cr.rms_norm_rope(**a, eps=EPS, inplace=True)
    with pytest.raises(TypeError) as traced:
        _jit(cr.rms_norm_rope, eps=EPS, inplace=True).lower(a)
    assert str(traced.value) == str(eager.value)


@pytest.mark.parametrize("jit", [False, True])
def test_rope_and_cache_on_jax_needs_inplace_false(rng, jit):
    arrays = {name: jnp.asarray(x) for name, x in _cache_args(rng).items()}
    call = _jit(cr.rope_and_cache) if jit else (lambda a: cr.rope_and_cache(**a))
    with pytest.raises(TypeError, match="rope_and_cache: JAX arrays are immutable, so q and k "
                                        "cannot be rotated in place: pass inplace=False"):
        call(arrays)


@pytest.mark.parametrize("jit", [False, True])
def test_numpy_caches_beside_jax_arrays_are_refused(rng, jit):
    """A NumPy cache would not be written (the call returns new caches): refused, as in eager
    calls whose caches are not q's array type."""
    host = _cache_args(rng)
    caches = {name: host.pop(name) for name in ("k_cache", "v_cache")}  # closed over under jit
    arrays = {name: jnp.asarray(x) for name, x in host.items()}
    call = _jit(cr.rope_and_cache, inplace=False, **caches) if jit else (
        lambda a: cr.rope_and_cache(**a, **caches, inplace=False))
    with pytest.raises(TypeError, match=r"k_cache must be the array type and device of q \(jax"):
        call(arrays)


def test_traced_eps_is_refused(rng):
    a = {name: jnp.asarray(x) for name, x in _norm_case(rng).items()}
    with pytest.raises(TypeError, match="rms_norm_rope: eps must be a concrete number"):
        jax.jit(lambda a, eps: cr.rms_norm_rope(**a, eps=eps))(a, jnp.float32(1e-6))


# ----------------------------------------------------------------------------------------------
# validate=True


def test_validate_slots_eager_raises_under_jit_reports_when_run(rng):
    host = _cache_args(rng)
    host["slot_mapping"][1] = 1000
    arrays = {name: jnp.asarray(x) for name, x in host.items()}
    with pytest.raises(IndexError, match="slot_mapping holds 1 slot"):  # concrete: raised now
        cr.rope_and_cache(**arrays, inplace=False, validate=True)
    checked = _jit(cr.rope_and_cache, inplace=False, validate=True)
    with pytest.raises(Exception, match="slot_mapping holds 1 slot"):
        jax.block_until_ready(checked(arrays))
    _, _, k_cache, _ = _jit(cr.rope_and_cache, inplace=False)(arrays)  # skipped, not written
    rows = _cache_rows(np.asarray(k_cache), "NHD")
    valid = (host["slot_mapping"] >= 0) & (host["slot_mapping"] < rows.shape[0])
    assert rows[host["slot_mapping"][valid]].any()
    assert not np.delete(rows, host["slot_mapping"][valid], axis=0).any()


def test_validate_positions_under_jit_reports_when_run(rng):
    a = {name: jnp.asarray(x) for name, x in _norm_case(rng).items()}
    a["cos_sin_cache"] = jnp.asarray(cr.cos_sin_cache(16, 64))
    checked = _jit(cr.rms_norm_rope, eps=EPS, validate=True)
    jax.block_until_ready(checked(a))
    with pytest.raises(Exception, match="positions must lie in"):
        jax.block_until_ready(checked(dict(a, positions=jnp.array([0, 1, 99], jnp.int32))))
