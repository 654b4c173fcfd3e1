"""JAX transformations through apply_rope on the CPU: jax.grad (custom_vjp), jax.jit and jax.vmap
(see cupyrope/frontends/jax/ops.py and docs/jax_internals.md).

- gradients are the float64 reference's inverse rotation of the cotangent, for every angle source,
  both pairings, partial rotary, q and k; they agree with jax.grad of a pure jax.numpy formulation
  and pass jax.test_util.check_grads (numerical differentiation);
- jax.jit gives the eager (DLPack path) results to within an ulp (XLA's CPU contracts products
  into fused multiply-adds), jax.jit(jax.grad) the eager gradients;
- jax.vmap over a batch equals the per-element traced calls bit for bit, in one launch over the
  batch folded into the token dims (per element only for a batched cos/sin cache);
- argument errors are raised while tracing with the eager types; in place is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

import cupyrope as cr  # noqa: E402
from autograd_cases import MAX_POSITION, SOURCES, THETA, widen_tables  # noqa: E402
from reference import reference_angles, reference_inv_freq, reference_rope  # noqa: E402
from jax_route import assert_within_ulps, launches  # noqa: E402
from tolerances import assert_bits_equal, assert_rope_close, max_abs_angle  # noqa: E402


def jax_angles(source, token_shape, rotary_dim, interleaved, rng):
    """(cupyrope kwargs with JAX arrays, reference kwargs, check kwargs, float64 cos/sin per pair)."""
    positions = rng.integers(0, MAX_POSITION, size=token_shape).astype(np.int32)
    factor = 2.0 if source == "computed_linear" else 1.0
    inv_freq = reference_inv_freq(rotary_dim, THETA, factor)
    angles = reference_angles(positions, inv_freq)
    cos64, sin64 = np.cos(angles), np.sin(angles)
    if source == "cache":
        cache = cr.cos_sin_cache(MAX_POSITION, rotary_dim, theta=THETA)
        rows, half = cache.astype(np.float64)[positions], rotary_dim // 2
        return (dict(positions=jnp.asarray(positions), cos_sin_cache=jnp.asarray(cache)),
                dict(positions=positions, cos_sin_cache=cache.astype(np.float64)), {},
                (rows[..., :half], rows[..., half:]))
    if source.startswith("tables"):
        c, s = widen_tables(cos64, sin64, source, interleaved)
        c, s = c.astype(np.float32), s.astype(np.float32)
        lib = dict(cos=jnp.asarray(c), sin=jnp.asarray(s), rotary_dim=rotary_dim)
        step = 2 if (source == "tables_full" and interleaved) else 1
        cols = np.arange(rotary_dim // 2) * step
        return (lib, dict(cos=c.astype(np.float64), sin=s.astype(np.float64), rotary_dim=rotary_dim),
                {}, (c.astype(np.float64)[..., cols], s.astype(np.float64)[..., cols]))
    lib = dict(positions=jnp.asarray(positions), theta=THETA, rotary_dim=rotary_dim)
    ref = dict(positions=positions, theta=THETA, rotary_dim=rotary_dim)
    if factor != 1.0:
        lib["scaling"] = {"rope_type": "linear", "factor": factor}
        ref["linear_factor"] = factor
    return lib, ref, {"max_angle": max_abs_angle(positions, inv_freq)}, (cos64, sin64)


def jnp_rope(x, cos, sin, rotary_dim, interleaved):
    """A pure jax.numpy RoPE (per-token cos/sin [..., r/2]), for jax.grad to differentiate."""
    cos, sin = cos[..., None, :], sin[..., None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1).reshape(rot.shape)
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = jnp.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
    return jnp.concatenate((out, rest), axis=-1)


def random(rng, shape, dtype=np.float32):
    values = rng.standard_normal(shape)
    return np.where(np.abs(values) < 1e-3, 0.5, values).astype(dtype)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_grad_is_inverse_rotation(source, interleaved, rotary, jit, rng):
    B, S, Hq, Hk, D = 2, 3, 4, 2, 16
    r = D if rotary == "full" else 8
    lib, ref, check, _ = jax_angles(source, (B, S), r, interleaved, rng)
    q, k = random(rng, (B, S, Hq, D)), random(rng, (B, S, Hk, D))
    wq, wk = random(rng, (B, S, Hq, D)), random(rng, (B, S, Hk, D))

    def loss(q, k):
        q_out, k_out = cr.apply_rope(q, k, interleaved=interleaved, **lib)
        return jnp.sum(q_out * wq) + jnp.sum(k_out * wk)

    grad = jax.grad(loss, argnums=(0, 1))
    if jit:
        grad = jax.jit(grad)
    grad_q, grad_k = grad(jnp.asarray(q), jnp.asarray(k))
    for got, w in ((grad_q, wq), (grad_k, wk)):
        assert got.dtype == jnp.float32 and got.shape == w.shape
        expected = reference_rope(w, interleaved=interleaved, inverse=True, **ref)
        assert_rope_close(np.asarray(got), expected, w, interleaved=interleaved, rotary_dim=r, **check)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_vjp_matches_jax_numpy_formulation(source, interleaved, rng):
    T, H, D, r = 5, 3, 12, 8
    lib, _, _, (cos, sin) = jax_angles(source, (T,), r, interleaved, rng)
    x, w = jnp.asarray(random(rng, (T, H, D))), jnp.asarray(random(rng, (T, H, D)))
    out, vjp = jax.vjp(lambda x: cr.apply_rope(x, interleaved=interleaved, **lib), x)
    ref_out, ref_vjp = jax.vjp(
        lambda x: jnp_rope(x, jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32), r,
                           interleaved), x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(vjp(w)[0]), np.asarray(ref_vjp(w)[0]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("source", ["cache", "tables_full", "computed"])
def test_check_grads_numerically(source, rng):
    from jax.test_util import check_grads

    T, D = 4, 8
    # check_grads evaluates f on host and on default-device arrays: keep everything on the CPU
    # (where JAX's default device is a GPU, a host q with device positions would be refused).
    with jax.default_device(jax.devices("cpu")[0]):
        lib, _, _, _ = jax_angles(source, (T,), D, True, rng)
        q, k = jnp.asarray(random(rng, (T, 2, D))), jnp.asarray(random(rng, (T, 1, D)))
        check_grads(lambda q, k: cr.apply_rope(q, k, interleaved=True, **lib), (q, k), order=1,
                    modes=["rev"], atol=1e-2, rtol=1e-2)


def test_jit_matches_eager_within_an_ulp(rng):
    T, Hq, Hk, D = 7, 4, 2, 32
    for source in SOURCES:
        lib, _, _, _ = jax_angles(source, (T,), D, False, rng)
        q, k = jnp.asarray(random(rng, (T, Hq, D))), jnp.asarray(random(rng, (T, Hk, D)))
        eager = cr.apply_rope(q, k, **lib)  # concrete arrays: the DLPack path
        arrays = {name: v for name, v in lib.items() if hasattr(v, "shape")}
        options = {name: v for name, v in lib.items() if name not in arrays}
        jitted = jax.jit(lambda q, k, arrays: cr.apply_rope(q, k, **arrays, **options))(q, k, arrays)
        for a, b, x in zip(eager, jitted, (q, k)):
            assert isinstance(b, jax.Array)
            assert_within_ulps(b, a, x, what=f"jit vs eager ({source})")


def test_jit_grad_k_none_and_inverse(rng):
    T, D = 5, 16
    positions = jnp.asarray(rng.integers(0, 1000, T), dtype=jnp.int32)
    x, w = jnp.asarray(random(rng, (T, 2, D))), random(rng, (T, 2, D))

    def loss(x):
        return jnp.sum(cr.apply_rope(x, positions=positions, inverse=True) * w)

    eager, jitted = jax.grad(loss)(x), jax.jit(jax.grad(loss))(x)
    assert_bits_equal(np.asarray(jitted), np.asarray(eager), what="jit(grad) vs grad")
    expected = reference_rope(w, np.asarray(positions))  # inverse of the inverse
    assert_rope_close(np.asarray(eager), expected, w, interleaved=False, rotary_dim=D,
                      max_angle=max_abs_angle(np.asarray(positions), reference_inv_freq(D)))


def test_tables_get_zero_cotangent(rng):
    T, D = 3, 8
    lib, _, _, _ = jax_angles("tables_half", (T,), D, False, rng)
    q = jnp.asarray(random(rng, (T, 2, D)))
    grads = jax.grad(lambda q, c, s: jnp.sum(cr.apply_rope(q, cos=c, sin=s, rotary_dim=D) ** 2),
                     argnums=(1, 2))(q, lib["cos"], lib["sin"])
    for g in grads:
        assert not np.any(np.asarray(g))


def test_vmap_equals_per_element_calls(rng):
    N, T, H, D = 3, 4, 2, 8
    positions = jnp.asarray(rng.integers(0, 100, (N, T)), dtype=jnp.int32)
    xs = jnp.asarray(random(rng, (N, T, H, D)))
    batched = jax.vmap(lambda x, p: cr.apply_rope(x, positions=p))(xs, positions)
    single = jax.jit(lambda x, p: cr.apply_rope(x, positions=p))
    for i in range(N):
        assert_bits_equal(np.asarray(batched[i]), np.asarray(single(xs[i], positions[i])),
                          what=f"vmap element {i}")
    grad = jax.grad(lambda xs: jnp.sum(jax.vmap(lambda x, p: cr.apply_rope(x, positions=p))(xs, positions) ** 3))
    assert grad(xs).shape == xs.shape


# (name, per-element call, batched arguments (with their vmap axis), shared arguments) for the
# vmap rule: positions / tables batched or shared, k batched or shared, batch not leading.
VMAP_CASES = {
    "positions_and_q": (lambda q, p, k, c: cr.apply_rope(q, k, p, cos_sin_cache=c), "qp"),
    "q_only_shared_positions": (lambda q, p, k, c: cr.apply_rope(q, k, p, cos_sin_cache=c), "q"),
    "positions_only": (lambda q, p, k, c: cr.apply_rope(q, k, p, cos_sin_cache=c), "p"),
    "k_batched": (lambda q, p, k, c: cr.apply_rope(q, k, p, cos_sin_cache=c), "qpk"),
    "computed_batch_on_axis_1": (lambda q, p, k, c: cr.apply_rope(q, k, p, theta=THETA), "qp1"),
    "implicit_positions": (lambda q, p, k, c: cr.apply_rope(q, k, theta=THETA), "q"),
    "tables": (lambda q, p, k, c: cr.apply_rope(q, k, cos=c[p, :4], sin=c[p, 4:]), "qp"),
}


@pytest.mark.parametrize("case", list(VMAP_CASES))
def test_vmap_folds_the_batch_into_one_launch(rng, case):
    """jax.vmap of a rotation is one launch over the batch as a leading token dim, bit-identical to
    the per-element calls, whatever is batched (q, positions, k, per-token tables; the batch on
    any axis) and shared (positions broadcast over the batch, the cache)."""
    call, batched = VMAP_CASES[case]
    N, B0, T, H, D = 3, 2, 4, 2, 8
    axis = 1 if batched.endswith("1") else 0
    cache = jnp.asarray(cr.cos_sin_cache(MAX_POSITION, D, theta=THETA))
    q = jnp.asarray(random(rng, (N, B0, T, H, D) if "q" in batched else (B0, T, H, D)))
    k = jnp.asarray(random(rng, (N, B0, T, 1, D) if "k" in batched else (B0, T, 1, D)))
    p = jnp.asarray(rng.integers(0, MAX_POSITION, (N, T) if "p" in batched else (T,)),
                    dtype=jnp.int32)
    if axis:
        q, p = jnp.moveaxis(q, 0, 1), jnp.moveaxis(p, 0, 1)
    in_axes = (axis if "q" in batched else None, axis if "p" in batched else None,
               0 if "k" in batched else None, None)
    vmapped = jax.vmap(call, in_axes=in_axes)
    assert launches(vmapped, q, p, k, cache) == [(N, B0, T, H, D)]
    out_q, out_k = jax.jit(vmapped)(q, p, k, cache)
    for i in range(N):
        take = (lambda x, b, ax=0: jnp.take(x, i, axis=ax) if b else x)
        want_q, want_k = jax.jit(call)(take(q, "q" in batched, axis), take(p, "p" in batched, axis),
                              take(k, "k" in batched), cache)
        assert_bits_equal(np.asarray(out_q[i]), np.asarray(want_q), what=f"{case}: q {i}")
        assert_bits_equal(np.asarray(out_k[i]), np.asarray(want_k), what=f"{case}: k {i}")


def test_vmap_of_a_batched_cache_runs_per_element(rng):
    """A cache per batch element cannot fold into the token dims: one launch per element, the same
    results."""
    N, T, H, D = 3, 4, 2, 8
    caches = jnp.stack([jnp.asarray(cr.cos_sin_cache(MAX_POSITION, D, theta=t))
                        for t in (THETA, 500.0, 1e6)])
    q = jnp.asarray(random(rng, (N, T, H, D)))
    p = jnp.asarray(rng.integers(0, MAX_POSITION, (N, T)), dtype=jnp.int32)
    single = jax.jit(lambda q, p, c: cr.apply_rope(q, None, p, cos_sin_cache=c))
    assert launches(jax.vmap(single), q, p, caches) == [(T, H, D)] * N
    out = jax.vmap(single)(q, p, caches)
    for i in range(N):
        assert_bits_equal(np.asarray(out[i]), np.asarray(single(q[i], p[i], caches[i])),
                          what=f"element {i}")


def test_grad_of_vmap_and_vmap_of_grad_fold_too(rng):
    """Differentiating through the vmapped call (and vmapping the gradient) keeps one launch per
    pass over the whole batch, with the per-element gradients."""
    N, T, H, D = 3, 4, 2, 8
    q = jnp.asarray(random(rng, (N, T, H, D)))
    p = jnp.asarray(rng.integers(0, MAX_POSITION, (N, T)), dtype=jnp.int32)

    def loss(q, p):
        return jnp.sum(cr.apply_rope(q, None, p, theta=THETA) ** 3)

    grad_of_vmap = jax.grad(lambda q: jnp.sum(jax.vmap(loss)(q, p)))
    vmap_of_grad = jax.vmap(jax.grad(loss))
    # forward and backward of each
    assert launches(grad_of_vmap, q) + launches(vmap_of_grad, q, p) == [(N, T, H, D)] * 4
    grad_of_vmap, vmap_of_grad = grad_of_vmap(q), vmap_of_grad(q, p)
    for i in range(N):
        want = np.asarray(jax.grad(loss)(q[i], p[i]))
        assert_bits_equal(np.asarray(grad_of_vmap[i]), want, what=f"grad(vmap) {i}")
        assert_bits_equal(np.asarray(vmap_of_grad[i]), want, what=f"vmap(grad) {i}")


@pytest.mark.parametrize("call, error, match", [
    (lambda q, p: cr.apply_rope(q, positions=p, rotary_dim=7), ValueError, "rotary_dim"),
    (lambda q, p: cr.apply_rope(q, positions=p.astype(jnp.float32)), TypeError, "positions"),
    (lambda q, p: cr.apply_rope(q, positions=p, inplace=True), TypeError, "immutable"),
    (lambda q, p: cr.apply_rope(q, positions=p, theta=jnp.sum(q)), TypeError, "theta"),
    (lambda q, p: cr.apply_rope(q, positions=p, scaling={"rope_type": "nope"}), ValueError, "nope"),
    (lambda q, p: cr.apply_rope(q, q[:, :1].astype(jnp.bfloat16), positions=p), TypeError, "dtype"),
    (lambda q, p: cr.apply_rope(q, positions=p, cos_sin_cache=jnp.ones((8, 10))), ValueError, "wide"),
])
def test_errors_raise_while_tracing(call, error, match, rng):
    q = jnp.asarray(random(rng, (5, 2, 8)))
    positions = jnp.arange(5, dtype=jnp.int32)
    with pytest.raises(error, match=match):
        jax.jit(call)(q, positions)


def test_validate_under_jit_reports_at_run_time(rng):
    q = jnp.asarray(random(rng, (4, 2, 8)))
    cache = jnp.asarray(cr.cos_sin_cache(16, 8))
    ok = jax.jit(lambda q, p: cr.apply_rope(q, positions=p, cos_sin_cache=cache, validate=True))
    ok(q, jnp.arange(4, dtype=jnp.int32)).block_until_ready()
    with pytest.raises(Exception, match="positions must lie in"):
        ok(q, jnp.array([0, 1, 2, 99], dtype=jnp.int32)).block_until_ready()
