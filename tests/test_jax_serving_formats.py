"""Per-(token, head) fp8 scales and the NVFP4 KV cache on JAX (cupyrope/frontends/jax/ops.py):
``apply_rope`` / ``rms_norm_rope`` with ``q_scale="per_head"`` or scale arrays, and
``rope_and_cache`` with per-row cache scales or an NVFP4 cache, on JAX arrays and under jax.jit,
on JAX CPU (jax.numpy) and JAX GPU (the native kernel call, marked gpu).

- results against the float64 reference within the bounds of tests/test_fp8_per_head.py and
  tests/test_nvfp4_cache.py; rows stored as given (v) bit for bit the NumPy path's;
- the functional form: new outputs, caches and scale arrays come back (after the results, in the
  order q_scale, k_scale, v_scale, k_cache_scales, v_cache_scales); the arrays given are unchanged,
  the new caches and scales written at the valid slots only;
- one primitive per call; jax.vmap of per-row outputs folds into one call;
- refusals with the eager messages, before anything runs;
- the native entries of row-scaled launches planned and compiled by NVRTC (no GPU needed).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

import cupyrope as cr  # noqa: E402
from nvrtc_build import assert_native_entry_compiles  # noqa: E402
from backends import backend_params  # noqa: E402
from jax_route import launches, require_native_gpu  # noqa: E402
from reference import reference_rope  # noqa: E402
from test_fp8_per_head import FP8, TINY, _rms_norm64, assert_fp8_rows  # noqa: E402
from test_nvfp4_cache import assert_nvfp4_rows  # noqa: E402
from tolerances import as_numpy, assert_bits_equal, np_dtype  # noqa: E402

JAX = backend_params(["jax", "jax-gpu"])


def _fp8(x: np.ndarray, fmt: str) -> np.ndarray:
    """fp8 values (or their uint8 bits) as the ml_dtypes type."""
    return x.view(np.uint8).view(np.dtype(getattr(ml_dtypes, fmt)))


def _rows(array: np.ndarray, slots: np.ndarray, layout: str, block_size: int) -> np.ndarray:
    blocks, within = slots // block_size, slots % block_size
    return array[blocks, within] if layout == "NHD" else array[blocks, :, within]


def _unwritten(slots: np.ndarray, num_slots: int) -> np.ndarray:
    every = np.ones(num_slots, bool)
    every[slots[slots >= 0]] = False
    return np.arange(num_slots)[every]


def _cache_case(rng, T, Hq, Hk, D, dtype, num_blocks, block_size):
    q = (rng.standard_normal((T, Hq, D)) * 2).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 2).astype(np_dtype(dtype))
    v = (rng.standard_normal((T, Hk, D)) * rng.uniform(0.01, 10, (T, Hk, 1))).astype(
        np_dtype(dtype))
    v[4, 0] = 0  # an all-zero row: scale 2^-126 (fp8), block scales 0 (NVFP4)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[[1, T - 2]] = -1  # padding
    return q, k, v, slots


# ----------------------------------------------------------------------------------------------
# Per-row fp8 scales of the outputs


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype,interleaved,rotary_dim", [("bfloat16", False, None),
                                                          ("float16", True, 64),
                                                          ("float32", False, 96)])
@pytest.mark.parametrize("jit", [False, True])
def test_apply_rope_per_head_returns_new_scales(backend, rng, fmt, dtype, interleaved, rotary_dim,
                                                jit):
    T, Hq, Hk, D = 13, 4, 2, 128
    q = (rng.standard_normal((T, Hq, D)) * rng.uniform(0.1, 30, (T, Hq, 1))).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * rng.uniform(0.1, 30, (T, Hk, 1))).astype(np_dtype(dtype))
    q[3, 1] = 0
    positions = rng.integers(0, 4096, T)

    def call(q, k, positions):
        return cr.apply_rope(q, k, positions, out_dtype=fmt, q_scale="per_head",
                             k_scale="per_head", interleaved=interleaved, rotary_dim=rotary_dim)

    q8, k8, q_scales, k_scales = (jax.jit(call) if jit else call)(
        backend.put(q), backend.put(k), backend.put(positions))
    assert q_scales.shape == (T, Hq) and k_scales.shape == (T, Hk)
    assert q_scales.dtype == jnp.float32 and q8.dtype == jnp.dtype(np_dtype(fmt))
    for x, stored, scales, name in ((q, q8, q_scales, "q"), (k, k8, k_scales, "k")):
        exact = reference_rope(x, positions, interleaved=interleaved, rotary_dim=rotary_dim)
        assert_fp8_rows(_fp8(as_numpy(stored), fmt), as_numpy(scales), exact, fmt,
                        f"{backend} {name}")
    assert as_numpy(q_scales)[3, 1] == np.float32(TINY)
    assert not as_numpy(q8)[3, 1].astype(np.float32).any()


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("fmt", FP8)
def test_rms_norm_rope_with_given_scale_arrays_returns_new_ones(backend, rng, fmt):
    """Arrays given are checked and left as they are; the call returns the new scales."""
    T, Hq, Hk, D = 9, 4, 1, 64
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((T, Hk, D)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    positions = rng.integers(0, 4096, T)
    given_q, given_k = np.full((T, Hq), -1.0, np.float32), np.full((T, Hk), -1.0, np.float32)
    put = backend.put
    q_scales_in, k_scales_in = put(given_q), put(given_k)
    q8, k8, q_scales, k_scales = jax.jit(lambda q, k, w, p, qs, ks: cr.rms_norm_rope(
        q, k, w, w, p, eps=1e-6, out_dtype=fmt, q_scale=qs, k_scale=ks))(
        put(q), put(k), put(w), put(positions), q_scales_in, k_scales_in)
    assert_bits_equal(as_numpy(q_scales_in), given_q, what="q_scale given")
    assert_bits_equal(as_numpy(k_scales_in), given_k, what="k_scale given")
    for x, stored, scales, name in ((q, q8, q_scales, "q"), (k, k8, k_scales, "k")):
        exact = reference_rope(_rms_norm64(x, w), positions)
        assert_fp8_rows(_fp8(as_numpy(stored), fmt), as_numpy(scales), exact, fmt, name)


def test_per_row_outputs_are_one_primitive_and_vmap_folds(rng):
    B, T, H, D = 3, 5, 2, 32
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    positions = rng.integers(0, 100, (B, T))

    def call(q, positions):
        return cr.apply_rope(q, positions=positions, out_dtype="float8_e4m3fn",
                             q_scale="per_head")

    assert launches(call, q[0], positions[0]) == [(T, H, D)]
    assert launches(jax.vmap(call), q, positions) == [(B, T, H, D)]  # one call for the batch
    q8, scales = jax.jit(jax.vmap(call))(q, positions)
    assert q8.shape == q.shape and scales.shape == (B, T, H)
    for b in range(B):
        one8, one_scales = call(q[b], positions[b])
        np.testing.assert_allclose(as_numpy(scales)[b], as_numpy(one_scales), rtol=2.0 ** -20)
        exact = reference_rope(q[b], positions[b])
        assert_fp8_rows(_fp8(as_numpy(q8)[b], "float8_e4m3fn"), as_numpy(scales)[b], exact,
                        "float8_e4m3fn", f"element {b}")


def test_validate_under_jit_runs_row_scales_through_the_callback(rng):
    """validate=True under jit takes the callback (the NumPy path on XLA's CPU buffers): the new
    scales come back from it as from the jax.numpy lowering."""
    T, H, D = 6, 2, 32
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    positions = rng.integers(0, 100, T)
    cache = cr.cos_sin_cache(128, D, dtype="float32")
    call = jax.jit(lambda q, p, c: cr.apply_rope(q, positions=p, cos_sin_cache=c,
                                                 out_dtype="float8_e4m3fn", q_scale="per_head",
                                                 validate=True))
    q8, scales = call(q, positions, cache)
    eager8, eager_scales = cr.apply_rope(q, positions=positions, cos_sin_cache=cache,
                                         out_dtype="float8_e4m3fn", q_scale="per_head")
    assert_bits_equal(as_numpy(scales), eager_scales, what="scales")
    assert_bits_equal(as_numpy(q8), eager8, what="q8")


def test_validate_under_jit_writes_nvfp4_block_scales_through_the_callback(rng):
    """The callback writes the caches and their block scales in the outputs aliased to them:
    bit for bit the NumPy path's, rows no slot names kept."""
    T, Hk, D, num_blocks, block_size = 6, 2, 32, 3, 4
    q, k, v, slots = _cache_case(rng, T, 4, Hk, D, "float32", num_blocks, block_size)
    positions = rng.integers(0, 100, T)
    rows = (num_blocks, block_size, Hk)
    cache, scales = np.full(rows + (D // 2,), 0xA5, np.uint8), np.full(rows + (D // 16,), 0xA5,
                                                                       np.uint8)
    options = dict(cache_dtype="nvfp4", k_scale=0.01, v_scale=0.02, inplace=False)
    expected = [x.copy() for x in (cache, cache, scales, scales)]
    cr.rope_and_cache(q, k, v, positions, expected[0], expected[1], slots,
                      k_cache_scales=expected[2], v_cache_scales=expected[3], **options)
    out = jax.jit(lambda q, k, v, p, kc, vc, s, kbs, vbs: cr.rope_and_cache(
        q, k, v, p, kc, vc, s, k_cache_scales=kbs, v_cache_scales=vbs, validate=True,
        **options))(q, k, v, positions, cache, cache, slots, scales, scales)
    for got, want, what in zip(out[2:], expected, ("k cache", "v cache", "k scales", "v scales")):
        assert_bits_equal(as_numpy(got), want, what=what)


# ----------------------------------------------------------------------------------------------
# Per-row fp8 cache scales


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,norm,interleaved,bits", [("bfloat16", False, False, False),
                                                         ("float16", True, True, True),
                                                         ("float32", True, False, False)])
def test_rope_and_cache_per_row_fp8_cache(backend, rng, fmt, layout, dtype, norm, interleaved,
                                          bits):
    T, Hq, Hk, D, num_blocks, block_size = 12, 4, 2, 64, 5, 4
    q, k, v, slots = _cache_case(rng, T, Hq, Hk, D, dtype, num_blocks, block_size)
    positions = rng.integers(0, 4096, T)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    rows = (num_blocks, block_size, Hk) if layout == "NHD" else (num_blocks, Hk, block_size)
    cache_host = np.full(rows + (D,), 0xA5, np.uint8)
    scales_host = np.full(rows, -1.0, np.float32)
    cache = cache_host if bits else _fp8(cache_host, fmt)
    extra = {"cache_dtype": fmt} if bits else {}
    norm_kw = dict(eps=1e-6) if norm else {}
    put = backend.put
    inputs = [put(x) for x in (cache, cache, scales_host, scales_host)]

    @jax.jit
    def write(q, k, v, positions, kc, vc, slots, ks, vs, w):
        weights = dict(q_weight=w, k_weight=w) if norm else {}
        return cr.rope_and_cache(q, k, v, positions, kc, vc, slots, layout=layout,
                                 interleaved=interleaved, k_scale=ks, v_scale=vs, inplace=False,
                                 **extra, **norm_kw, **weights)

    out = write(put(q), put(k), put(v), put(positions), *inputs[:2], put(slots), *inputs[2:],
                put(w))
    assert len(out) == 6  # q_out, k_out, k_cache, v_cache, k_scale, v_scale
    for given, host in zip(inputs, (cache, cache, scales_host, scales_host)):
        assert_bits_equal(as_numpy(given), host, what="an array given")
    kc, vc, ks, vs = (as_numpy(x) for x in out[2:])
    exact_k = reference_rope(_rms_norm64(k, w) if norm else k, positions, interleaved=interleaved)
    valid = slots >= 0
    unwritten = _unwritten(slots, num_blocks * block_size)
    for cache_out, scales, exact, name in ((kc, ks, exact_k, "k"),
                                           (vc, vs, v.astype(np.float64), "v")):
        assert_fp8_rows(_rows(_fp8(cache_out, fmt), slots[valid], layout, block_size),
                        _rows(scales, slots[valid], layout, block_size), exact[valid], fmt,
                        f"{backend} {name} cache")
        assert (_rows(scales, unwritten, layout, block_size) == -1).all()
        assert (_rows(cache_out.view(np.uint8), unwritten, layout, block_size) == 0xA5).all()
    assert _rows(vs, slots[[4]], layout, block_size)[0, 0] == np.float32(TINY)
    # v is quantised as given: the NumPy path's bytes and scales, bit for bit.
    host_vc, host_vs = _fp8(cache_host.copy(), fmt), scales_host.copy()
    cr.rope_and_cache(q.copy(), k.copy(), v, positions, _fp8(cache_host.copy(), fmt), host_vc,
                      slots, layout=layout, interleaved=interleaved,
                      k_scale=scales_host.copy(), v_scale=host_vs,
                      **(dict(q_weight=w, k_weight=w, eps=1e-6) if norm else {}))
    assert_bits_equal(vs, host_vs, what="v scales")
    np.testing.assert_array_equal(vc.view(np.uint8), host_vc.view(np.uint8))


@pytest.mark.parametrize("backend", JAX, indirect=True)
def test_rope_and_cache_fp8_outputs_with_per_row_scales(backend, rng):
    """fp8 outputs with per-row scales and a cache of q's dtype: the (T, H) arrays given are
    checked, the call returns new ones after the caches."""
    T, Hq, Hk, D = 7, 4, 2, 64
    q, k, v, slots = _cache_case(rng, T, Hq, Hk, D, "bfloat16", 4, 4)
    positions = rng.integers(0, 4096, T)
    kc = np.zeros((4, 4, Hk, D), np_dtype("bfloat16"))
    put = backend.put
    out = jax.jit(lambda q, k, v, p, kc, vc, s, qs, ks: cr.rope_and_cache(
        q, k, v, p, kc, vc, s, out_dtype="float8_e5m2", q_scale=qs, k_scale=ks,
        inplace=False))(put(q), put(k), put(v), put(positions), put(kc), put(kc), put(slots),
                        put(np.zeros((T, Hq), np.float32)), put(np.zeros((T, Hk), np.float32)))
    q8, k8, _, _, q_scales, k_scales = out
    for x, stored, scales in ((q, q8, q_scales), (k, k8, k_scales)):
        assert_fp8_rows(_fp8(as_numpy(stored), "float8_e5m2"), as_numpy(scales),
                        reference_rope(x, positions), "float8_e5m2", "outputs")


# ----------------------------------------------------------------------------------------------
# The NVFP4 cache


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,interleaved,norm", [("bfloat16", False, False),
                                                    ("float16", True, True),
                                                    ("float32", False, True)])
@pytest.mark.parametrize("scale_dtype,traced_global", [("uint8", False),
                                                       ("float8_e4m3fn", True)])
def test_rope_and_cache_into_an_nvfp4_cache(backend, rng, layout, dtype, interleaved, norm,
                                            scale_dtype, traced_global):
    T, Hq, Hk, D, num_blocks, block_size = 11, 4, 2, 64, 5, 4
    q, k, v, slots = _cache_case(rng, T, Hq, Hk, D, dtype, num_blocks, block_size)
    positions = rng.integers(0, 4096, T)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    rows = (num_blocks, block_size, Hk) if layout == "NHD" else (num_blocks, Hk, block_size)
    cache_host = np.full(rows + (D // 2,), 0xA5, np.uint8)
    scales_host = np.full(rows + (D // 16,), 0xA5, np.uint8)
    block_scales = scales_host if scale_dtype == "uint8" else _fp8(scales_host, scale_dtype)
    g_k, g_v = 0.02, 0.005
    put = backend.put
    inputs = [put(x) for x in (cache_host, cache_host, block_scales, block_scales)]
    globals_ = (put(np.array([g_k], np.float32)), put(np.float32(g_v).reshape(()))) \
        if traced_global else (g_k, g_v)

    @jax.jit
    def write(q, k, v, positions, kc, vc, slots, kbs, vbs, w, g):
        weights = dict(q_weight=w, k_weight=w, eps=1e-6) if norm else {}
        return cr.rope_and_cache(q, k, v, positions, kc, vc, slots, layout=layout,
                                 interleaved=interleaved, cache_dtype="nvfp4",
                                 k_cache_scales=kbs, v_cache_scales=vbs, k_scale=g[0],
                                 v_scale=g[1], inplace=False, **weights)

    out = write(put(q), put(k), put(v), put(positions), *inputs[:2], put(slots), *inputs[2:],
                put(w), globals_)
    assert len(out) == 6  # q_out, k_out, k_cache, v_cache, k_cache_scales, v_cache_scales
    assert out[4].dtype == jnp.dtype(np_dtype(scale_dtype))
    for given, host in zip(inputs, (cache_host, cache_host, block_scales, block_scales)):
        assert_bits_equal(as_numpy(given), host, what="an array given")
    kc, vc, kbs, vbs = (as_numpy(x).view(np.uint8) for x in out[2:])
    exact_k = reference_rope(_rms_norm64(k, w) if norm else k, positions, interleaved=interleaved)
    valid = slots >= 0
    unwritten = _unwritten(slots, num_blocks * block_size)
    for cache, scales, g, exact, name in ((kc, kbs, g_k, exact_k, "k"),
                                          (vc, vbs, g_v, v.astype(np.float64), "v")):
        assert_nvfp4_rows(_rows(cache, slots[valid], layout, block_size),
                          _rows(scales, slots[valid], layout, block_size), g, exact[valid],
                          f"{backend} {name}")
        assert (_rows(cache, unwritten, layout, block_size) == 0xA5).all()
        assert (_rows(scales, unwritten, layout, block_size) == 0xA5).all()
    # v is quantised as given: the NumPy path's bits.
    host_vc, host_vbs = cache_host.copy(), scales_host.copy()
    cr.rope_and_cache(q.copy(), k.copy(), v, positions, cache_host.copy(), host_vc, slots,
                      layout=layout, interleaved=interleaved, cache_dtype="nvfp4",
                      k_cache_scales=scales_host.copy(), v_cache_scales=host_vbs, k_scale=g_k,
                      v_scale=g_v, **(dict(q_weight=w, k_weight=w, eps=1e-6) if norm else {}))
    assert_bits_equal(vc, host_vc, what="v cache")
    assert_bits_equal(vbs, host_vbs, what="v block scales")


def test_concrete_jax_arrays_take_the_functional_form(rng):
    """Outside jit, a call on JAX arrays that writes scale arrays returns them too."""
    T, Hk, D = 5, 1, 32
    q, k, v, slots = _cache_case(rng, T, 2, Hk, D, "float32", 2, 4)
    kc, bs = jnp.zeros((2, 4, Hk, D // 2), jnp.uint8), jnp.zeros((2, 4, Hk, D // 16), jnp.uint8)
    out = cr.rope_and_cache(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.arange(T), kc, kc,
                            jnp.asarray(slots), cache_dtype="nvfp4", k_cache_scales=bs,
                            v_cache_scales=bs, inplace=False)
    assert len(out) == 6 and all(isinstance(x, jax.Array) for x in out)
    assert not as_numpy(kc).any() and not as_numpy(bs).any()
    q8, scales = cr.apply_rope(jnp.asarray(q), positions=jnp.arange(T), out_dtype="float8_e4m3fn",
                               q_scale="per_head")
    assert isinstance(scales, jax.Array) and scales.shape == (T, 2)


# ----------------------------------------------------------------------------------------------
# Refusals: the eager calls' messages, before anything runs


def _refusal_case(rng, case):
    """(kwargs of rope_and_cache on NumPy arrays, the same on JAX arrays) for one refusal."""
    T, Hk, D = 5, 1, 32
    q, k, v, slots = _cache_case(rng, T, 2, Hk, D, "float32", 2, 4)
    rows = (2, 4, Hk)
    base = dict(q=q, k=k, v=v, positions=np.arange(T), slot_mapping=slots, inplace=False)
    if case.startswith("nvfp4"):
        cache, bs = np.zeros(rows + (D // 2,), np.uint8), np.zeros(rows + (D // 16,), np.uint8)
        base.update(k_cache=cache, v_cache=cache.copy(), cache_dtype="nvfp4",
                    k_cache_scales=bs, v_cache_scales=bs.copy())
        if case == "nvfp4_per_row_global":
            base["k_scale"] = np.zeros(rows, np.float32)
        elif case == "nvfp4_bad_scales":
            base["k_cache_scales"] = np.zeros(rows + (3,), np.uint8)
        elif case == "nvfp4_missing_scales":
            base.pop("v_cache_scales")
    else:
        cache = np.zeros(rows + (D,), np.uint8)
        base.update(k_cache=cache, v_cache=cache.copy(), cache_dtype="float8_e4m3fn",
                    k_scale=np.zeros(rows, np.float32), v_scale=np.zeros(rows, np.float32))
        if case == "mixed":
            base["v_scale"] = 0.5
        elif case == "per_head_string":
            base["k_scale"] = "per_head"
        elif case == "wrong_shape":
            base["k_scale"] = np.zeros((2, Hk, 3), np.float32)
        elif case == "wrong_dtype":
            base["v_scale"] = np.zeros(rows, np.float16)
    on_jax = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x
              for name, x in base.items()}
    return base, on_jax


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case,error", [
    ("mixed", ValueError), ("per_head_string", ValueError), ("wrong_shape", ValueError),
    ("wrong_dtype", TypeError), ("nvfp4_per_row_global", ValueError),
    ("nvfp4_bad_scales", ValueError), ("nvfp4_missing_scales", TypeError),
])
def test_refusals_match_eager_calls(rng, case, error, jit):
    eager_kwargs, jax_kwargs = _refusal_case(rng, case)
    with pytest.raises(error) as eager:
        cr.rope_and_cache(**eager_kwargs)
    arrays = {name: x for name, x in jax_kwargs.items() if isinstance(x, jax.Array)}
    rest = {name: x for name, x in jax_kwargs.items() if name not in arrays}
    call = (lambda arrays: cr.rope_and_cache(**arrays, **rest))
    with pytest.raises(error) as on_jax:
        (jax.jit(call) if jit else call)(arrays)
    assert str(on_jax.value).split("\n")[0] == str(eager.value)


def test_per_head_without_a_token_dim_and_numpy_scale_arrays_are_refused(rng):
    host = rng.standard_normal((2, 16)).astype(np.float32)
    options = dict(out_dtype="float8_e4m3fn", q_scale="per_head")
    with pytest.raises(ValueError, match="per-row scales need q and k with a token dim") as eager:
        cr.apply_rope(host, positions=np.array([3]), **options)
    with pytest.raises(ValueError) as on_jax:
        cr.apply_rope(jnp.asarray(host), positions=jnp.array([3]), **options)
    assert str(on_jax.value) == str(eager.value)
    q3 = jnp.asarray(host)[None]
    with pytest.raises(TypeError, match="q_scale must be the array type and device of q"):
        jax.jit(lambda q: cr.apply_rope(q, positions=jnp.arange(1), out_dtype="float8_e4m3fn",
                                        q_scale=np.zeros((1, 2), np.float32)))(q3)


def test_grad_through_the_nvfp4_cache_write_is_refused(rng):
    T, Hk, D = 3, 1, 32
    q, k, v, slots = _cache_case(rng, 5, 2, Hk, D, "float32", 2, 4)
    cache, bs = jnp.zeros((2, 4, Hk, D // 2), jnp.uint8), jnp.zeros((2, 4, Hk, D // 16), jnp.uint8)

    def loss(q):
        out = cr.rope_and_cache(q, k, v, np.arange(5), cache, cache, slots, cache_dtype="nvfp4",
                                k_cache_scales=bs, v_cache_scales=bs, inplace=False)
        return out[0].sum()

    with pytest.raises(NotImplementedError, match="jax.grad through the KV-cache write"):
        jax.grad(loss)(jnp.asarray(q))


# ----------------------------------------------------------------------------------------------
# The native entries of row-scaled launches, planned and compiled without a GPU


def _native_case(case):
    from cupyrope.frontends.jax import native
    from cupyrope.frontends.jax.planning import RotationOptions, plan_fused_call

    T, Hq, Hk, D = 40, 8, 2, 128
    shapes = dict(q=((T, Hq, D), "bfloat16"), k=((T, Hk, D), "bfloat16"),
                  positions=((T,), "int32"), cos_sin_cache=((4096, D), "float32"))
    options = dict(out_dtype=None)
    new_rows: tuple = ()
    if case == "rows_outputs":
        options.update(out_dtype="float8_e4m3fn")
        new_rows = ("q_scale", "k_scale")
        op_name = "apply_rope"
    else:
        op_name = "rope_and_cache"
        shapes.update(v=((T, Hk, D), "bfloat16"), slot_mapping=((T,), "int64"))
        if case == "rows_cache":
            shapes.update(k_cache=((16, 8, Hk, D), "float8_e5m2"),
                          v_cache=((16, 8, Hk, D), "float8_e5m2"),
                          k_scale=((16, 8, Hk), "float32"), v_scale=((16, 8, Hk), "float32"))
        else:  # nvfp4, HND
            options.update(cache_dtype="nvfp4", layout="HND", k_scale=0.5)
            shapes.update(k_cache=((16, Hk, 8, D // 2), "uint8"),
                          v_cache=((16, Hk, 8, D // 2), "uint8"),
                          k_cache_scales=((16, Hk, 8, D // 16), "float8_e4m3fn"),
                          v_cache_scales=((16, Hk, 8, D // 16), "uint8"))
    avals = {name: jax.ShapeDtypeStruct(shape, jnp.dtype(np_dtype(dtype)))
             for name, (shape, dtype) in shapes.items()}
    infos = native.planning_infos(list(avals.values()), tuple(avals), 0)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale", "k_cache_scales", "v_cache_scales"):
        if name in infos:
            infos[name].writable = True
    rotation = RotationOptions(10000.0, None, False, None, False, False, None)
    plan = plan_fused_call(op_name, rotation, options, infos, validate=False,
                           new_row_scales=new_rows)
    written = [name for name in ("k_cache", "v_cache") if name in avals]
    written += [name for name, _ in plan.fusion.written_scales()]
    out_dtype = options["out_dtype"]
    outs = [jax.ShapeDtypeStruct(avals[n].shape, jnp.dtype(np_dtype(out_dtype or "bfloat16")))
            for n in ("q", "k")]
    outs += [avals[name] if name in avals else
             jax.ShapeDtypeStruct(avals[name[0]].shape[:-1], jnp.float32) for name in written]
    return plan, avals, outs, written


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("case", ["rows_outputs", "rows_cache", "nvfp4"])
def test_native_entry_of_row_scaled_launches_plans_and_compiles(case, arch):
    from cupyrope.frontends.jax import native
    from test_kernel_compile import _nvrtc_or_skip

    nvrtc = _nvrtc_or_skip()
    plan, avals, outs, written = _native_case(case)
    launch = native.plan_native_launch(plan, outs, tuple(avals), num_regs=lambda spec: 128,
                                       multiprocessors=132, angle_arithmetic=None)
    spec = launch.spec
    assert spec.kernel.rows and spec.kernel.name_expression.startswith(
        "cupyrope::rope_fused_rows_kernel"), spec.kernel.name_expression
    results = launch.buffers[len(avals) + 2:]
    if case == "rows_outputs":  # the outputs' per-row scales: results of their own
        assert results == ("q_out_scales", "k_out_scales")
    else:  # the caches and their scales: written through the input buffers
        assert results == (None,) * len(written)
        labels = dict(zip(avals, launch.buffers))
        assert labels["k_cache_scales" if case == "nvfp4" else "k_scale"] == "k_cache_scales"
        assert labels["v_cache_scales" if case == "nvfp4" else "v_scale"] == "v_cache_scales"
    source = assert_native_entry_compiles(nvrtc, launch, arch, case)
    assert "rope_fused_tokens<" in source and ", true>(rope.p, fusion.p)" in source


# ----------------------------------------------------------------------------------------------
# JAX GPU: one native kernel call, bit for bit the eager CuPy call


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["per_head", "rows_cache", "nvfp4"])
def test_gpu_jit_is_one_native_call_and_matches_eager_cupy(rng, case):
    cupy = require_native_gpu()
    T, Hq, Hk, D, num_blocks, block_size = 37, 8, 2, 128, 8, 8
    q, k, v, slots = _cache_case(rng, T, Hq, Hk, D, "bfloat16", num_blocks, block_size)
    positions = rng.integers(0, 4096, T)
    table = cr.cos_sin_cache(4096, D, dtype="float32")
    device = jax.devices("gpu")[0]
    rows = (num_blocks, block_size, Hk)

    def put(x):
        return jax.device_put(jnp.asarray(x), device)

    def on_cupy(x):
        return cupy.asarray(x.view(np.uint16)).view(x.dtype) if x.dtype.itemsize == 2 and (
            x.dtype == np_dtype("bfloat16")) else cupy.asarray(x)

    if case == "per_head":
        def call(q, k, v, positions, table, *caches):
            return cr.apply_rope(q, k, positions, cos_sin_cache=table, out_dtype="float8_e4m3fn",
                                 q_scale="per_head", k_scale="per_head")
        caches = ()
    elif case == "rows_cache":
        caches = (np.zeros(rows + (D,), np.uint8),) * 2 + (np.zeros(rows, np.float32),) * 2

        def call(q, k, v, positions, table, kc, vc, s, ks, vs):
            return cr.rope_and_cache(q, k, v, positions, kc, vc, s, cos_sin_cache=table,
                                     cache_dtype="float8_e4m3fn", k_scale=ks, v_scale=vs,
                                     inplace=False)
        caches = caches[:2] + (slots,) + caches[2:]
    else:
        caches = ((np.zeros(rows + (D // 2,), np.uint8),) * 2 + (slots,)
                  + (np.zeros(rows + (D // 16,), np.uint8),) * 2)

        def call(q, k, v, positions, table, kc, vc, s, kbs, vbs):
            return cr.rope_and_cache(q, k, v, positions, kc, vc, s, cos_sin_cache=table,
                                     cache_dtype="nvfp4", k_cache_scales=kbs,
                                     v_cache_scales=vbs, k_scale=0.02, v_scale=0.01,
                                     inplace=False)
    args = [put(x) for x in (q, k, v, positions, table, *caches)]
    text = jax.jit(call).lower(*args).compile().as_text()
    assert text.count('custom_call_target="triton_kernel_call_ffi"') == 1
    assert "callback" not in text.lower()
    got = jax.jit(call)(*args)
    cupy_args = [on_cupy(x) for x in (q, k, v, positions, table, *caches)]
    eager = call(*cupy_args)
    if case != "per_head":  # eager: (q_out, k_out, k_cache, v_cache); the scales in place
        eager = (*eager, cupy_args[-2], cupy_args[-1])
    for a, b in zip(got, eager):
        np.testing.assert_array_equal(as_numpy(a).view(np.uint8), as_numpy(b).view(np.uint8))
