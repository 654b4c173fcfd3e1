"""The DeepSeek MLA ops on JAX (cupyrope/frontends/jax/mla.py): ``mla_rope_and_cache`` and
``mla_rope_quantize`` on JAX arrays and under jax.jit, on JAX CPU (jax.numpy) and JAX GPU (one
native kernel call, marked gpu).

- jit against the float64 reference (tests/test_mla.py's bounds), joint q and the (q_nope, q_pe)
  pair, both pairings, fp8 outputs and caches (fp8 arrays, uint8 bits), traced scales;
- the functional cache: a new cache, written at the valid slots only, the input cache unchanged;
  a donated cache across steps;
- the traced call is one ``cupyrope_mla`` primitive; jax.vmap runs it per element;
- refusals (shapes, dtypes, in place, NumPy caches, traced validate) with the eager messages,
  before anything runs; validate=True on concrete arrays;
- the native entry planned from XLA's shapes and compiled by NVRTC (no GPU needed);
- on a GPU: one native kernel call, bit for bit the eager CuPy call.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cupyrope as cr  # noqa: E402
from nvrtc_build import compile_entry  # noqa: E402
from backends import backend_params  # noqa: E402
from jax_route import assert_within_ulps, require_native_gpu  # noqa: E402
from test_fused_mla import DEEPSEEK_V3, assert_fp8_close  # noqa: E402
from test_mla import (MAX_POSITION, POISON, RANK, ROPE, _mla_case, _poisoned_cache,  # noqa: E402
                      check_part, exact_rope)
from tolerances import as_numpy, assert_bits_equal, assert_rope_close, np_dtype  # noqa: E402

from cupyrope.frontends.jax import mla as jax_mla  # noqa: E402
from cupyrope.frontends.jax.planning import RotationOptions  # noqa: E402

JAX = backend_params(["jax", "jax-gpu"])


@pytest.fixture(scope="module")
def deepseek_cache() -> np.ndarray:
    return cr.cos_sin_cache(MAX_POSITION, ROPE, theta=10000.0, scaling=DEEPSEEK_V3,
                            dtype="float32")


def _cache_rows(cache: np.ndarray, slots: np.ndarray, block_size: int):
    """(rows of the valid slots, a mask of the rows no slot names)."""
    valid = slots >= 0
    blocks, rows = slots[valid] // block_size, slots[valid] % block_size
    untouched = np.ones(cache.shape[:2], bool)
    untouched[blocks, rows] = False
    return cache[blocks, rows], untouched


def _rope_and_cache_case(rng, randn, cache_fmt):
    """(q, k_pe, kv_c, positions, slots, a poisoned joint cache, its fp8 format or None, the
    cache options) of 11 bf16 tokens, 4 heads of 128 + 64, two padding slots; ``cache_fmt``
    None, an fp8 dtype, or "uint8-e5m2" (fp8 bits in a uint8 cache)."""
    T, H, nope, blocks, block_size = 11, 4, 128, 6, 4
    q = randn((T, H, nope + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, T)
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[[2, 7]] = -1  # padding
    fp8 = None if cache_fmt is None else cache_fmt.replace("uint8-e5m2", "float8_e5m2")
    cache = _poisoned_cache("bfloat16", blocks, block_size, fp8)
    options = {}
    if cache_fmt == "uint8-e5m2":
        cache = cache.view(np.uint8)
        options["cache_dtype"] = "float8_e5m2"
    return q, k_pe, kv_c, positions, slots, cache, fp8, options


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn", "uint8-e5m2"])
@pytest.mark.parametrize("joint", [True, False])
def test_jit_rope_and_cache_matches_the_reference(backend, rng, randn, deepseek_cache,
                                                  interleaved, fmt, cache_fmt, joint):
    T, H, nope, block_size = 11, 4, 128, 4
    q, k_pe, kv_c, positions, slots, cache, fp8_cache, options = _rope_and_cache_case(
        rng, randn, cache_fmt)
    scales = {}
    if fp8_cache is not None:
        scales["kv_scale"] = np.full((1,), 0.125, np.float32)  # traced: read when the call runs
    if fmt is not None:
        options.update(out_dtype=fmt, q_scale=0.5)
        scales["k_scale"] = np.float32(2.0).reshape(())
    put = backend.put
    cache_in = put(cache)

    @jax.jit
    def step(q, k_pe, kv_c, positions, kv_cache, slots, table, scales):
        q_in = q if joint else (q[..., :nope], q[..., nope:])
        return cr.mla_rope_and_cache(q_in, k_pe, kv_c, positions, kv_cache, slots,
                                     cos_sin_cache=table, interleaved=interleaved,
                                     **options, **scales)

    q_out, k_out, cache_out = step(put(q), put(k_pe), put(kv_c), put(positions), cache_in,
                                   put(slots), put(deepseek_cache),
                                   {name: put(np.asarray(s)) for name, s in scales.items()})
    assert_bits_equal(as_numpy(cache_in), cache, what="the input cache")
    if not joint:
        assert q_out[0].shape == (T, H, nope) and q_out[1].shape == (T, H, ROPE)
        q_out = jnp.concatenate(q_out, axis=-1)
    q_out, k_out, cache_out = (as_numpy(x) for x in (q_out, k_out, cache_out))
    assert q_out.shape == q.shape and k_out.shape == k_pe.shape
    q_exact = exact_rope(q[..., nope:], positions, deepseek_cache, interleaved)
    check_part(q_out[..., nope:], q_exact, q[..., nope:], fmt, 0.5, rotated=True,
               interleaved=interleaved, what="q rope part")
    check_part(q_out[..., :nope], q[..., :nope], q[..., :nope], fmt, 0.5, rotated=False,
               interleaved=interleaved, what="q nope part")
    k_exact = exact_rope(k_pe[:, None, :], positions, deepseek_cache, interleaved)[:, 0]
    check_part(k_out[:, None, :], k_exact[:, None, :], k_pe[:, None, :], fmt, 2.0, rotated=True,
               interleaved=interleaved, what="k_pe out")
    assert cache_out.dtype == cache.dtype
    stored = cache_out.view(np_dtype(fp8_cache)) if cache_fmt == "uint8-e5m2" else cache_out
    rows, untouched = _cache_rows(stored, slots, block_size)
    assert_bits_equal(cache_out[untouched], cache[untouched], what="rows of skipped slots")
    written = slots >= 0
    if fp8_cache is None:
        assert_bits_equal(rows[:, :RANK], kv_c[written], what="cached kv_c")
        assert_rope_close(rows[:, None, RANK:], k_exact[written][:, None, :],
                          k_pe[written][:, None, :], interleaved=interleaved, rotary_dim=ROPE)
    else:
        assert_fp8_close(rows[:, :RANK], kv_c[written].astype(np.float64) / 0.125, "kv_c")
        assert_fp8_close(rows[:, RANK:], k_exact[written] / 0.125, "cached k_pe")


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_k_nope", [False, True])
@pytest.mark.parametrize("fmt", [None, "float8_e5m2"])
def test_jit_rope_quantize_matches_the_reference(backend, rng, randn, deepseek_cache, dtype,
                                                 with_k_nope, fmt):
    T, H, nope = 9, 4, 64
    q_pe, q_nope = randn((T, H, ROPE), dtype), randn((T, H, nope), dtype)
    k_pe = randn((T, ROPE), dtype)
    k_nope = randn((T, 1, 32), dtype) if with_k_nope else None
    k_rope = k_pe[:, None, :] if with_k_nope else k_pe
    positions = rng.integers(0, MAX_POSITION, T)
    options = dict(out_dtype=fmt, q_scale=0.25, k_scale=4.0) if fmt else {}
    put = backend.put
    outs = jax.jit(lambda q_pe, k_pe, q_nope, k_nope, p, t: cr.mla_rope_quantize(
        q_pe, k_pe, q_nope, k_nope, p, cos_sin_cache=t, **options))(
        put(q_pe), put(k_rope), put(q_nope), None if k_nope is None else put(k_nope),
        put(positions), put(deepseek_cache))
    q_pe_out, k_pe_out, q_nope_out, k_nope_out = (None if x is None else as_numpy(x)
                                                  for x in outs)
    assert k_pe_out.shape == k_rope.shape and (k_nope_out is None) == (k_nope is None)
    check_part(q_pe_out, exact_rope(q_pe, positions, deepseek_cache, True), q_pe, fmt, 0.25,
               rotated=True, interleaved=True, what="q_pe")
    check_part(q_nope_out, q_nope, q_nope, fmt, 0.25, rotated=False, interleaved=True,
               what="q_nope")
    k_exact = exact_rope(k_pe[:, None, :], positions, deepseek_cache, True)
    check_part(k_pe_out.reshape(T, 1, ROPE), k_exact, k_pe[:, None, :], fmt, 4.0, rotated=True,
               interleaved=True, what="k_pe")
    if with_k_nope:
        check_part(k_nope_out, k_nope, k_nope, fmt, 4.0, rotated=False, interleaved=True,
                   what="k_nope")


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("interleaved", [True, False])
def test_computed_yarn_angles_match_the_eager_numpy_path(backend, rng, randn, interleaved):
    T, H, nope = 7, 2, 64
    q, k_pe, kv_c = randn((T, H, nope + ROPE)), randn((T, ROPE)), randn((T, 128))
    positions, slots = rng.integers(0, 100000, T), rng.permutation(16)[:T]
    cache = np.full((4, 4, 128 + ROPE), POISON, np.float32)
    eager = cr.mla_rope_and_cache(q, k_pe, kv_c, positions, cache.copy(), slots,
                                  scaling=DEEPSEEK_V3, interleaved=interleaved)
    put = backend.put
    got = jax.jit(lambda *a: cr.mla_rope_and_cache(*a, scaling=DEEPSEEK_V3,
                                                   interleaved=interleaved))(
        put(q), put(k_pe), put(kv_c), put(positions), put(cache), put(slots))
    # XLA contracts the rotation into fused multiply-adds: within an ulp of the NumPy path.
    assert_within_ulps(got[0][..., nope:], eager[0][..., nope:], q[..., nope:], "q rope part")
    assert_bits_equal(as_numpy(got[0])[..., :nope], eager[0][..., :nope], what="q nope part")
    assert_within_ulps(got[1][:, None], eager[1][:, None], k_pe[:, None], "k_pe")
    assert_within_ulps(got[2], eager[2], eager[2], "cache")


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn", "uint8-e5m2"])
@pytest.mark.parametrize("jit", [False, True])
def test_two_caches_hold_the_joint_rows(backend, rng, randn, deepseek_cache, cache_fmt, jit):
    """kpe_cache (FlashInfer's ckv / kpe layout): two new caches, which hold, slot for slot, the
    two parts of the joint cache's rows (the same bits), the arrays given unchanged, and the
    eager NumPy call's values."""
    q, k_pe, kv_c, positions, slots, joint, fp8, options = _rope_and_cache_case(
        rng, randn, cache_fmt)
    options["cos_sin_cache"] = deepseek_cache
    if fp8 is not None:
        options["kv_scale"] = 0.25
    ckv, kpe = joint[..., :RANK].copy(), joint[..., RANK:].copy()
    put = backend.put
    arrays = [put(x) for x in (q, k_pe, kv_c, positions)]
    ckv_in, kpe_in, joint_in = put(ckv), put(kpe), put(joint)

    def call(q, k_pe, kv_c, positions, cache, slots, kpe_cache=None):
        return cr.mla_rope_and_cache(q, k_pe, kv_c, positions, cache, slots,
                                     kpe_cache=kpe_cache, **options)

    run = jax.jit(call) if jit else call
    two = run(*arrays, ckv_in, put(slots), kpe_in)
    one = run(*arrays, joint_in, put(slots))
    assert len(two) == 4 and len(one) == 3
    for a, b, what in ((two[0], one[0], "q_out"), (two[1], one[1], "k_pe_out")):
        assert_bits_equal(as_numpy(a), as_numpy(b), what=what)
    assert_bits_equal(as_numpy(two[2]), as_numpy(one[2])[..., :RANK], what="kv_cache")
    assert_bits_equal(as_numpy(two[3]), as_numpy(one[2])[..., RANK:], what="kpe_cache")
    for given, host, what in ((ckv_in, ckv, "kv_cache given"), (kpe_in, kpe, "kpe_cache given")):
        assert_bits_equal(as_numpy(given), host, what=what)
    host_ckv, host_kpe = ckv.copy(), kpe.copy()
    cr.mla_rope_and_cache(q, k_pe, kv_c, positions, host_ckv, slots, kpe_cache=host_kpe,
                          **options)
    stored = np.dtype(np_dtype(fp8 or "bfloat16"))
    # kv_c is stored as given (or times 1 / kv_scale, exact): the NumPy path's bits.
    assert_bits_equal(as_numpy(two[2]), host_ckv, what="kv_cache against the NumPy path")
    # k_pe is rotated: XLA contracts the rotation into fused multiply-adds, so within an ulp.
    got_kpe, host_kpe = as_numpy(two[3]).view(stored), host_kpe.view(stored)
    if fp8 is None:
        assert_within_ulps(got_kpe, host_kpe, host_kpe, "kpe_cache against the NumPy path")
    else:
        info = ml_dtypes.finfo(stored)
        np.testing.assert_allclose(got_kpe.astype(np.float64), host_kpe.astype(np.float64),
                                   rtol=float(info.eps), atol=float(info.smallest_subnormal),
                                   err_msg="kpe_cache against the NumPy path")


def test_concrete_jax_arrays_take_the_functional_form(rng, randn, deepseek_cache):
    """Outside jit too the call returns new arrays and a new cache (q_out in q's layout)."""
    case = _mla_case(randn, rng)
    arrays = {name: jnp.asarray(x) for name, x in case.items()}
    q_out, k_out, cache = cr.mla_rope_and_cache(
        arrays["q"], arrays["k_pe"], arrays["kv_c"], arrays["positions"], arrays["kv_cache"],
        arrays["slot_mapping"], cos_sin_cache=deepseek_cache)
    eager = cr.mla_rope_and_cache(case["q"], case["k_pe"], case["kv_c"], case["positions"],
                                  case["kv_cache"].copy(), case["slot_mapping"],
                                  cos_sin_cache=deepseek_cache)
    assert all(isinstance(x, jax.Array) for x in (q_out, k_out, cache))
    for got, expected, x, what in ((q_out, eager[0], case["q"], "q"),
                                   (k_out[:, None], eager[1][:, None], case["k_pe"][:, None],
                                    "k_pe"),
                                   (cache, eager[2], None, "cache")):
        assert_within_ulps(got, expected, eager[2] if x is None else x, what)
    assert_bits_equal(as_numpy(arrays["kv_cache"]), case["kv_cache"], what="the input cache")


def test_one_primitive_per_call_and_vmap_per_element(rng, randn, deepseek_cache):
    T, H, nope, B = 3, 2, 64, 4
    q = randn((B, T, H, nope + ROPE))
    k_pe, kv_c = randn((B, T, ROPE)), randn((B, T, 64))
    positions = rng.integers(0, 100, (B, T))
    caches = np.full((B, 2, 4, 64 + ROPE), POISON, np.float32)
    slots = np.stack([rng.permutation(8)[:T] for _ in range(B)])

    def call(q, k_pe, kv_c, positions, cache, slots):
        return cr.mla_rope_and_cache(q, k_pe, kv_c, positions, cache, slots,
                                     cos_sin_cache=deepseek_cache)

    jaxpr = jax.make_jaxpr(call)(q[0], k_pe[0], kv_c[0], positions[0], caches[0], slots[0])
    names = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    assert names.count("cupyrope_mla") == 1, names
    batched = jax.jit(jax.vmap(call))(q, k_pe, kv_c, positions, caches, slots)
    for b in range(B):
        one = call(q[b], k_pe[b], kv_c[b], positions[b], caches[b], slots[b])
        for got, expected in zip(batched, one):  # two XLA programs: within an ulp
            assert_within_ulps(as_numpy(got)[b], expected, expected, f"element {b}")


def test_donated_cache_across_decode_steps(rng, randn, deepseek_cache):
    H, nope, blocks, block_size = 2, 64, 3, 4
    cache = jnp.full((blocks, block_size, 64 + ROPE), POISON, jnp.float32)
    step = jax.jit(lambda q, k_pe, kv_c, p, c, s: cr.mla_rope_and_cache(
        q, k_pe, kv_c, p, c, s, cos_sin_cache=deepseek_cache), donate_argnums=(4,))
    expected = np.full(cache.shape, POISON, np.float32)
    for position, slot in enumerate([5, 0, 11]):
        q, k_pe, kv_c = randn((1, H, nope + ROPE)), randn((1, ROPE)), randn((1, 64))
        _, k_out, cache = step(q, k_pe, kv_c, np.array([position]), cache, np.array([slot]))
        expected[slot // block_size, slot % block_size] = np.concatenate(
            [kv_c[0], as_numpy(k_out)[0]])
    assert_bits_equal(as_numpy(cache), expected, what="the cache after three steps")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("change, error, message", [
    (dict(k_pe=("shape", (5, 32))), ValueError, "kv_cache must be .* 512 \\+ 32.*got shape"),
    (dict(kv_c=("shape", (4, RANK))), ValueError,
     "kv_c must be \\[num_tokens=5.*got shape \\(4, 512\\)"),
    (dict(slot_mapping=("dtype", "float32")), TypeError,
     "slot_mapping must be int32 or int64, got float32"),
    (dict(kv_c=("dtype", "float16")), TypeError, "kv_c must have q's dtype bfloat16, got float16"),
    (dict(kv_cache=("dtype", "uint8")), TypeError, "uint8 kv_cache holds fp8 bits"),
    (dict(kw=dict(kv_scale=0.5)), ValueError, "kv_scale is only used with an fp8 kv_cache"),
    (dict(kw=dict(q_scale=-1.0, out_dtype="float8_e4m3fn")), ValueError,
     "q_scale must be finite and > 0"),
    (dict(kw=dict(cos_sin_cache=np.zeros((10, 32), np.float32))), ValueError, "rope_dim 64"),
])
def test_refusals_match_eager_calls(rng, randn, jit, change, error, message):
    case = _mla_case(randn, rng)
    change = dict(change)  # shared by both jit cases
    kw = dict(change.pop("kw", {}))
    for name, (what, value) in change.items():
        case[name] = np.resize(case[name], value) if what == "shape" else case[name].astype(value)
    order = ("q", "k_pe", "kv_c", "positions", "kv_cache", "slot_mapping")
    with pytest.raises(error, match=message) as eager:
        cr.mla_rope_and_cache(*(case[name] for name in order), **kw)
    call = (lambda *a: cr.mla_rope_and_cache(*a, **kw))
    with pytest.raises(error, match=message) as on_jax:
        (jax.jit(call) if jit else call)(*(jnp.asarray(case[name]) for name in order))
    assert str(on_jax.value) == str(eager.value)


def test_jax_only_refusals(rng, randn):
    case = _mla_case(randn, rng)
    arrays = {name: jnp.asarray(x) for name, x in case.items()}
    order = ("q", "k_pe", "kv_c", "positions", "kv_cache", "slot_mapping")
    with pytest.raises(TypeError, match="mla_rope_and_cache: JAX arrays are immutable"):
        cr.mla_rope_and_cache(*(arrays[n] for n in order), inplace=True)
    with pytest.raises(TypeError, match="mla_rope_quantize: JAX arrays are immutable"):
        cr.mla_rope_quantize(arrays["q"][..., -ROPE:], arrays["k_pe"], inplace=True)
    with pytest.raises(TypeError, match="kv_cache must be a JAX array"):
        cr.mla_rope_and_cache(*(arrays[n] for n in order[:4]), case["kv_cache"],
                              arrays["slot_mapping"])
    with pytest.raises(TypeError,
                       match="validate=True reads positions and slot_mapping on the host"):
        jax.jit(lambda *a: cr.mla_rope_and_cache(*a, validate=True))(
            *(arrays[n] for n in order[:5]), arrays["slot_mapping"])
    # validate=True on concrete arrays reads them now, as the eager call does.
    with pytest.raises(IndexError, match="slot_mapping holds 1 slot"):
        cr.mla_rope_and_cache(*(arrays[n] for n in order[:5]), jnp.array([0, 1, 99, 2, 3]),
                              validate=True)


# ----------------------------------------------------------------------------------------------
# The native entry, planned and compiled without a GPU


NATIVE_CASES = {
    "joint_fp8_cache": dict(
        names=("q", "k_pe", "kv_c", "positions", "kv_cache", "slot_mapping", "cos_sin_cache",
               "kv_scale"),
        shapes=[((7, 16, 192), "bfloat16"), ((7, 1, 64), "bfloat16"), ((7, 512), "bfloat16"),
                ((7,), "int32"), ((4, 16, 576), "uint8"), ((7,), "int64"),
                ((4096, 64), "float32"), ((1,), "float32")],
        out_dtype="float8_e4m3fn", cache_dtype="float8_e4m3fn", vector=True),
    "split_computed": dict(
        names=("q_nope", "q_pe", "k_pe", "kv_c", "positions", "kv_cache", "slot_mapping"),
        shapes=[((5, 4, 128), "float32"), ((5, 4, 64), "float32"), ((5, 1, 64), "float32"),
                ((5, 512), "float32"), ((5,), "int64"), ((2, 8, 576), "float32"),
                ((5,), "int32")],
        out_dtype=None, cache_dtype=None, vector=True),
    "joint_unaligned_rope": dict(  # nope 100: the rope part is no 16-byte multiple apart
        names=("q", "k_pe", "kv_c", "positions", "kv_cache", "slot_mapping"),
        shapes=[((3, 2, 164), "float16"), ((3, 1, 64), "float16"), ((3, 64), "float16"),
                ((3,), "int32"), ((2, 4, 128), "float16"), ((3,), "int32")],
        out_dtype=None, cache_dtype=None, vector=False),
    "two_caches_fp8": dict(  # FlashInfer's ckv / kpe caches, both new results
        names=("q", "k_pe", "kv_c", "positions", "kv_cache", "kpe_cache", "slot_mapping",
               "cos_sin_cache", "kv_scale"),
        shapes=[((7, 16, 192), "bfloat16"), ((7, 1, 64), "bfloat16"), ((7, 512), "bfloat16"),
                ((7,), "int32"), ((4, 16, 512), "uint8"), ((4, 16, 64), "uint8"),
                ((7,), "int64"), ((4096, 64), "float32"), ((1,), "float32")],
        out_dtype=None, cache_dtype="float8_e4m3fn", vector=True),
    "quantize_k_nope": dict(
        names=("q_nope", "q_pe", "k_nope", "k_pe", "positions", "cos_sin_cache"),
        shapes=[((9, 4, 128), "bfloat16"), ((9, 4, 64), "bfloat16"), ((9, 2, 32), "bfloat16"),
                ((9, 2, 64), "bfloat16"), ((9,), "int32"), ((4096, 64), "bfloat16")],
        out_dtype="float8_e5m2", cache_dtype=None, vector=True),
}


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_native_entry_plans_and_compiles(case, arch):
    from test_kernel_compile import _FRAME_RE, _nvrtc_or_skip

    nvrtc = _nvrtc_or_skip()
    spec = NATIVE_CASES[case]
    names = spec["names"]
    avals = [jax.ShapeDtypeStruct(shape, jnp.dtype(np_dtype(dtype)))
             for shape, dtype in spec["shapes"]]
    op_name = "mla_rope_and_cache" if "kv_cache" in names else "mla_rope_quantize"
    call = jax_mla.MlaCall(op_name, RotationOptions(10000.0, None, True, None, False, False,
                                                    None), names, spec["out_dtype"],
                           spec["cache_dtype"], ())
    outs = jax_mla._abstract_eval(*avals, call=call)
    planned = jax_mla.plan_native_mla(call, avals, outs, 0, multiprocessors=132,
                                      num_regs=lambda spec: 40)
    assert planned.spec.vector == spec["vector"], planned.spec
    assert len(planned.buffers) == len(names) + (planned.inv_freq is not None) + len(outs)
    caches = [name for name in ("kv_cache", "kpe_cache") if name in names]
    if caches:  # the new caches: written through the input caches
        assert planned.buffers[-len(caches):] == ((),) * len(caches)
    if names[0] == "q":  # q whole: its rope part starts past the nope dims
        nope = avals[0].shape[-1] - 64
        assert planned.buffers[0] == (("q_nope", 0), ("q_pe", nope * avals[0].dtype.itemsize))
    name = jax_mla.mla_kernel_name(planned)
    source = jax_mla.mla_entry_source(planned, name)
    from cupyrope.cuda import compiler

    log, ptx = compile_entry(nvrtc, source, "cupyrope_xla_mla.cu",
                             compiler.compile_options("float64"), arch, case)
    entry = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S)
    assert entry, f"{case}: no entry {name} in the PTX"
    assert entry.group(1).count(".param") == len(planned.buffers) + planned.params.nbytes // 8
    assert ".local" not in ptx, f"{case}: the entry uses local memory"
    frames = [tuple(int(g) for g in m.groups()) for m in _FRAME_RE.finditer(log)]
    assert all(f == (0, 0, 0) for f in frames), (case, frames, log[-2000:])


# ----------------------------------------------------------------------------------------------
# JAX GPU: one native kernel call, bit for bit the eager CuPy call


@pytest.mark.gpu
@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("source", ["table", "computed"])
@pytest.mark.parametrize("fmt,cache_fmt", [(None, None), ("float8_e4m3fn", "float8_e4m3fn")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("sms", [None, 1])
def test_gpu_jit_is_one_native_call_and_matches_eager_cupy(monkeypatch, rng, randn,
                                                           deepseek_cache, joint, source, fmt,
                                                           cache_fmt, dtype, sms):
    """``sms``: the SMs both launches see; None the GPU's (33 tokens: a decode step's split
    items), 1: blocks of 96 threads, a token's items in rounds (mla_launch.mla_geometry)."""
    cupy = require_native_gpu()
    if sms is not None:
        from cupyrope.cuda import launch, mla_launch

        monkeypatch.setattr(launch, "_multiprocessors", lambda device: sms)
        monkeypatch.setattr(mla_launch, "_multiprocessors", lambda device: sms)
    T, H, nope, blocks, block_size = 33, 16, 128, 8, 8
    q, k_pe, kv_c = randn((T, H, nope + ROPE), dtype), randn((T, ROPE), dtype), randn(
        (T, RANK), dtype)
    positions = rng.integers(0, MAX_POSITION, T)
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[3] = -1
    cache = np.zeros((blocks, block_size, RANK + ROPE), np.uint8 if cache_fmt else np_dtype(dtype))
    options = dict(scaling=DEEPSEEK_V3) if source == "computed" else dict(
        cos_sin_cache=deepseek_cache)
    if fmt:
        options.update(out_dtype=fmt, q_scale=0.5, k_scale=2.0)
    if cache_fmt:
        options.update(cache_dtype=cache_fmt, kv_scale=0.25)
    device = jax.devices("gpu")[0]

    def put(x):
        return jax.device_put(jnp.asarray(x), device)

    def call(q, k_pe, kv_c, positions, kv_cache, slots):
        q_in = q if joint else (q[..., :nope], q[..., nope:])
        return cr.mla_rope_and_cache(q_in, k_pe, kv_c, positions, kv_cache, slots, **options)

    args = (put(q), put(k_pe), put(kv_c), put(positions), put(cache), put(slots))
    text = jax.jit(call).lower(*args).compile().as_text()
    if joint:  # q whole in, q whole out: the kernel call alone
        assert text.count('custom_call_target="triton_kernel_call_ffi"') == 1
        assert "callback" not in text.lower()
    got = jax.jit(call)(*args)
    cupy_q = cupy.asarray(q.view(np.uint16)).view(q.dtype) if dtype == "bfloat16" else (
        cupy.asarray(q))
    # The eager CuPy call takes its angle table on the GPU too: CuPy calls refuse a host table.
    eager_options = {**options, **({"cos_sin_cache": cupy.asarray(deepseek_cache)}
                                   if "cos_sin_cache" in options else {})}
    eager = cr.mla_rope_and_cache(
        cupy_q if joint else (cupy_q[..., :nope], cupy_q[..., nope:]),
        *(cupy.asarray(x.view(np.uint16)).view(x.dtype) if x.dtype == np_dtype("bfloat16")
          else cupy.asarray(x) for x in (k_pe, kv_c)), cupy.asarray(positions),
        cupy.asarray(cache), cupy.asarray(slots), **eager_options)
    q_got = got[0] if joint else jnp.concatenate(got[0], axis=-1)
    q_eager = eager[0] if joint else cupy.concatenate(eager[0], axis=-1)
    for a, b, what in ((q_got, q_eager, "q_out"), (got[1], eager[1], "k_pe_out"),
                       (got[2], eager[2], "cache")):
        a, b = as_numpy(a), as_numpy(b)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn"])
def test_gpu_jit_two_caches_is_one_native_call_and_matches_eager_cupy(rng, randn, deepseek_cache,
                                                                      cache_fmt):
    cupy = require_native_gpu()
    T, H, nope, blocks, block_size, dtype = 33, 16, 128, 8, 8, "bfloat16"
    q, k_pe, kv_c = randn((T, H, nope + ROPE), dtype), randn((T, ROPE), dtype), randn(
        (T, RANK), dtype)
    positions = rng.integers(0, MAX_POSITION, T)
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[3] = -1
    cache_dtype = np.uint8 if cache_fmt else np_dtype(dtype)
    ckv = np.zeros((blocks, block_size, RANK), cache_dtype)
    kpe = np.zeros((blocks, block_size, ROPE), cache_dtype)
    options = dict(cache_dtype=cache_fmt, kv_scale=0.25) if cache_fmt else {}
    device = jax.devices("gpu")[0]

    def call(q, k_pe, kv_c, positions, ckv, kpe, slots, table):
        return cr.mla_rope_and_cache(q, k_pe, kv_c, positions, ckv, slots, kpe_cache=kpe,
                                     cos_sin_cache=table, **options)

    host = (q, k_pe, kv_c, positions, ckv, kpe, slots, deepseek_cache)
    args = [jax.device_put(jnp.asarray(x), device) for x in host]
    text = jax.jit(call).lower(*args).compile().as_text()
    assert text.count('custom_call_target="triton_kernel_call_ffi"') == 1
    assert "callback" not in text.lower()
    got = jax.jit(call)(*args)
    on_cupy = [cupy.asarray(x.view(np.uint16)).view(x.dtype) if x.dtype == np_dtype("bfloat16")
               else cupy.asarray(x) for x in host]
    eager = call(*on_cupy)  # (q_out, k_pe_out, kv_cache); kpe_cache written in place
    for a, b, what in ((got[0], eager[0], "q_out"), (got[1], eager[1], "k_pe_out"),
                       (got[2], on_cupy[4], "kv_cache"), (got[3], on_cupy[5], "kpe_cache")):
        np.testing.assert_array_equal(as_numpy(a).view(np.uint8), as_numpy(b).view(np.uint8),
                                      err_msg=what)
