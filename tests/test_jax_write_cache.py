"""cupyrope.write_cache on JAX arrays (cupyrope/frontends/jax/ops.py): the functional form of
vLLM's reshape_and_cache_flash. k and v go unrotated into new caches (the arrays given stay as
they were), on JAX CPU (jax.numpy) and JAX GPU (the native kernel call, marked gpu), eagerly and
under jax.jit:

- caches of k's dtype get k's and v's bits at the valid slots (inf and NaN included), the other
  rows the input cache's, bit for bit the NumPy path's;
- fp8 caches (value / scale), per-row fp8 scales and NVFP4 caches return their new scale arrays
  after the caches, bit for bit the NumPy path's;
- one primitive per call; validate=True and bad input refused with the eager messages;
- the native entry of the launch planned and compiled by NVRTC (no GPU needed).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

import cupyrope as cr  # noqa: E402
from backends import Backend, backend_params  # noqa: E402
from jax_route import launches, require_native_gpu  # noqa: E402
from nvrtc_build import assert_native_entry_compiles  # noqa: E402
from test_cache_write import SPECIAL_BITS, _with_specials  # noqa: E402
from tolerances import as_numpy, assert_bits_equal, np_dtype  # noqa: E402

JAX = backend_params(["jax", "jax-gpu"])
POISON = 0xA5


def _case(rng, dtype, T=23, Hk=2, D=64, num_blocks=7, block_size=4):
    k = rng.standard_normal((T, Hk, D)).astype(np_dtype(dtype))
    v = (rng.standard_normal((T, Hk, D)) * rng.uniform(0.01, 10, (T, Hk, 1))).astype(
        np_dtype(dtype))
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[[1, T - 2]] = -1  # padding: nothing written
    return k, v, slots


def _poisoned(shape, dtype) -> np.ndarray:
    """An array of POISON bytes: the rows no slot names must keep them."""
    dt = np.dtype(np_dtype(dtype))
    return np.full(shape[:-1] + (shape[-1] * dt.itemsize,), POISON, np.uint8).view(dt)


def _bits(x) -> np.ndarray:
    return as_numpy(x).view(np.uint8)


def _on_jax(backend: Backend, arrays: dict, jit: bool, **options):
    """write_cache on the backend's JAX arrays (under jax.jit when asked): its results, as NumPy
    bytes, after checking that the arrays given are unchanged."""
    given = {name: backend.put(x) for name, x in arrays.items()}

    def call(k, v, k_cache, v_cache, slot_mapping, **scales):
        return cr.write_cache(k, v, k_cache, v_cache, slot_mapping, **scales, **options)

    out = (jax.jit(call) if jit else call)(**given)
    assert all(isinstance(x, jax.Array) for x in out)
    for name, x in arrays.items():
        if x.dtype.kind in "iu" and x.dtype != np.uint8:  # int64 slots are int32 without x64
            np.testing.assert_array_equal(as_numpy(given[name]), x)
        else:
            assert_bits_equal(_bits(given[name]), x.view(np.uint8), what=f"{name} given")
    return [_bits(x) for x in out]


def _on_numpy(arrays: dict, **options):
    """The NumPy path's caches (and scale arrays), written into copies, as bytes."""
    copies = {name: x.copy() for name, x in arrays.items()}
    cr.write_cache(**copies, **options)
    return {name: x.view(np.uint8) for name, x in copies.items()}


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout,block_size", [("NHD", 4), ("HND", 4), ("NHD", 1)])
@pytest.mark.parametrize("jit", [False, True])
def test_new_caches_hold_k_and_v_bits_at_the_valid_slots(backend, rng, dtype, layout,
                                                         block_size, jit):
    k, v, slots = _case(rng, dtype, block_size=block_size, num_blocks=28 // block_size)
    _with_specials(k, dtype, rng)
    _with_specials(v, dtype, rng)
    Hk, D = k.shape[1:]
    num_blocks = 28 // block_size
    shape = ((num_blocks, block_size, Hk, D) if layout == "NHD"
             else (num_blocks, Hk, block_size, D))
    poison = _poisoned(shape, dtype)
    arrays = dict(k=k, v=v, k_cache=poison, v_cache=poison.copy(), slot_mapping=slots)
    got = _on_jax(backend, arrays, jit, layout=layout)
    assert len(got) == 2
    expected = _on_numpy(arrays, layout=layout)
    assert_bits_equal(got[0], expected["k_cache"], what="k cache")
    assert_bits_equal(got[1], expected["v_cache"], what="v cache")
    # The NumPy path itself: k's bits at the valid slots, POISON elsewhere.
    bits_type = SPECIAL_BITS[dtype][0]
    rows = got[0].view(np_dtype(dtype)).view(bits_type)
    rows = (np.swapaxes(rows, 1, 2) if layout == "HND" else rows).reshape(-1, Hk, D)
    valid = slots >= 0
    np.testing.assert_array_equal(rows[slots[valid]], k[valid].view(bits_type))
    untouched = np.setdiff1d(np.arange(rows.shape[0]), slots[valid])
    assert (rows[untouched].view(np.uint8) == POISON).all(), "stray write"


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("jit", [False, True])
def test_fp8_caches_with_tensor_and_per_row_scales(backend, rng, fmt, jit):
    """One scale a tensor (a number, a one-element array): two new caches; a scale a (slot, head)
    row (float32 arrays beside the caches): the new scale arrays after them."""
    k, v, slots = _case(rng, "bfloat16")
    k[3, 1, 5] = np.nan
    v[2, 0, 0] = 1e30  # saturates
    rows = (7, 4, 2)
    cache = _poisoned(rows + (64,), fmt)
    tensor = dict(k=k, v=v, k_cache=cache, v_cache=cache.copy(), slot_mapping=slots)
    got = _on_jax(backend, {**tensor, "v_scale": np.array([2.0], np.float32)}, jit, k_scale=0.5)
    expected = _on_numpy({**tensor, "v_scale": np.array([2.0], np.float32)}, k_scale=0.5)
    assert len(got) == 2
    fp8 = np.dtype(getattr(ml_dtypes, fmt))
    for a, name in zip(got, ("k_cache", "v_cache")):
        # Values, NaN equal to NaN: XLA's CPU conversion stores another of e5m2's NaN codes.
        np.testing.assert_array_equal(a.view(fp8).astype(np.float64),
                                      expected[name].view(fp8).astype(np.float64),
                                      err_msg=f"{name}, tensor scale")
    scales = _poisoned(rows, "float32")
    per_row = {**tensor, "k_scale": scales, "v_scale": scales.copy()}
    got = _on_jax(backend, per_row, jit)
    expected = _on_numpy(per_row)
    assert len(got) == 4  # k_cache, v_cache, k_scale, v_scale
    for a, name in zip(got, ("k_cache", "v_cache", "k_scale", "v_scale")):
        view = fp8 if name.endswith("cache") else np.float32
        np.testing.assert_array_equal(a.view(view).astype(np.float64),
                                      expected[name].view(view).astype(np.float64),
                                      err_msg=f"{name}, per-row scales")
    written = np.zeros(28, bool)
    written[slots[slots >= 0]] = True
    assert (got[2].view(np.float32).reshape(-1, 2)[~written].view(np.uint8) == POISON).all()
    row_scales = got[2].view(np.float32).reshape(-1, 2)[written]
    assert ((row_scales > 0) | np.isnan(row_scales)).all()  # k[3, 1] holds a NaN


@pytest.mark.parametrize("backend", JAX, indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("jit", [False, True])
def test_nvfp4_caches_return_their_block_scales(backend, rng, layout, jit):
    k, v, slots = _case(rng, "float16")
    v[4, 0] = 0  # an all-zero row: block scales 0
    rows = (7, 4, 2) if layout == "NHD" else (7, 2, 4)
    cache = np.full(rows + (32,), POISON, np.uint8)
    block_scales = np.full(rows + (4,), POISON, np.uint8)
    arrays = dict(k=k, v=v, k_cache=cache, v_cache=cache.copy(), slot_mapping=slots,
                  k_cache_scales=block_scales, v_cache_scales=block_scales.copy())
    options = dict(layout=layout, cache_dtype="nvfp4", k_scale=0.02, v_scale=0.005)
    got = _on_jax(backend, arrays, jit, **options)
    expected = _on_numpy(arrays, **options)
    assert len(got) == 4  # k_cache, v_cache, k_cache_scales, v_cache_scales
    for a, name in zip(got, ("k_cache", "v_cache", "k_cache_scales", "v_cache_scales")):
        assert_bits_equal(a, expected[name], what=f"NVFP4 {name}")
    assert not (got[0] == POISON).all()


def test_one_primitive_a_call_under_jit(rng):
    k, v, slots = _case(rng, "bfloat16")
    cache = jnp.zeros((7, 4, 2, 64), jnp.bfloat16)

    def step(k, v, kc, vc, s):
        return cr.write_cache(k, v, kc, vc, s)

    assert launches(step, jnp.asarray(k), jnp.asarray(v), cache, cache, jnp.asarray(slots)) == [
        (23, 0, 64)]  # q: a zero-head view of k


def test_vmap_over_batched_caches_and_grad_refused(rng):
    """jax.vmap over a batch of caches writes each element's cache as one call would; jax.grad
    through the write is refused, naming write_cache."""
    B = 3
    k = jnp.asarray(rng.standard_normal((B, 5, 2, 8)).astype(np.float32))
    v = k + 1
    caches = jnp.full((B, 2, 4, 2, 8), 7.0)
    slots = jnp.asarray(np.stack([rng.permutation(8)[:5] for _ in range(B)]))
    slots = slots.at[1, 2].set(-1)  # padding in one element
    batched = jax.jit(jax.vmap(cr.write_cache))(k, v, caches, caches, slots)
    for b in range(B):
        one = cr.write_cache(k[b], v[b], caches[b], caches[b], slots[b])
        for got, expected in zip(batched, one):
            assert_bits_equal(as_numpy(got)[b], as_numpy(expected), what=f"element {b}")
    with pytest.raises(NotImplementedError,
                       match="write_cache: jax.grad through the KV-cache write"):
        jax.grad(lambda k: cr.write_cache(k, v[0], caches[0], caches[0], slots[0])[0].sum())(k[0])


def test_validate_and_bad_input_match_eager_calls(rng):
    k, v, slots = _case(rng, "float32")
    cache = np.zeros((7, 4, 2, 64), np.float32)
    past = slots.copy()
    past[0] = 28  # one past the cache
    on_jax = [jnp.asarray(x) for x in (k, v, cache, cache, past)]
    with pytest.raises(IndexError, match="slot_mapping holds 1 slot") as eager:
        cr.write_cache(k, v, cache.copy(), cache.copy(), past, validate=True)
    with pytest.raises(IndexError, match=re.escape(str(eager.value))):
        cr.write_cache(*on_jax, validate=True)
    wrong = jnp.zeros((7, 4, 3, 64), jnp.float32)  # 3 heads for k's 2
    with pytest.raises(ValueError) as eager:
        cr.write_cache(k, v, np.zeros((7, 4, 3, 64), np.float32), cache.copy(), slots)
    for f in (cr.write_cache, jax.jit(cr.write_cache)):
        with pytest.raises(ValueError, match=re.escape(str(eager.value))):
            f(jnp.asarray(k), jnp.asarray(v), wrong, jnp.asarray(cache), jnp.asarray(slots))
    with pytest.raises(ValueError, match="write_cache: k must be"):
        cr.write_cache(jnp.zeros((3, 64)), jnp.asarray(v), jnp.asarray(cache), jnp.asarray(cache),
                       jnp.asarray(slots))


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_native_entry_plans_and_compiles(cache, arch):
    """The native entry of a jitted write_cache: the fused kernel with nothing to rotate (no
    positions, no angle source), the caches written through their input buffers."""
    from cupyrope.frontends.jax import native
    from cupyrope.frontends.jax.planning import RotationOptions, plan_fused_call
    from test_kernel_compile import _nvrtc_or_skip

    nvrtc = _nvrtc_or_skip()
    T, Hk, D = 40, 2, 128
    avals = dict(q=jax.ShapeDtypeStruct((T, 0, D), jnp.bfloat16),
                 k=jax.ShapeDtypeStruct((T, Hk, D), jnp.bfloat16),
                 v=jax.ShapeDtypeStruct((T, Hk, D), jnp.bfloat16),
                 k_cache=jax.ShapeDtypeStruct((16, 8, Hk, D), jnp.dtype(np_dtype(cache))),
                 v_cache=jax.ShapeDtypeStruct((16, 8, Hk, D), jnp.dtype(np_dtype(cache))),
                 slot_mapping=jax.ShapeDtypeStruct((T,), jnp.int64))
    infos = native.planning_infos(list(avals.values()), tuple(avals), 0)
    infos["k_cache"].writable = infos["v_cache"].writable = True
    options = dict(rotate=False, norm=False, out_dtype=None, layout="NHD",
                   k_scale=0.5 if cache != "bfloat16" else None)
    rotation = RotationOptions(10000.0, None, False, None, False, False, None)
    plan = plan_fused_call("write_cache", rotation, options, infos, validate=False)
    assert plan.rotary_dim == 0 and plan.positions is None
    outs = [jax.ShapeDtypeStruct(avals[n].shape, jnp.bfloat16) for n in ("q", "k")]
    outs += [avals["k_cache"], avals["v_cache"]]
    launch = native.plan_native_launch(plan, outs, tuple(avals), num_regs=lambda spec: 128,
                                       multiprocessors=132, angle_arithmetic=None)
    kernel = launch.spec.kernel
    assert kernel.fused and not kernel.lean, kernel.name_expression
    # The new caches are written through the input caches' buffers (no results of their own).
    assert launch.buffers[len(avals) + 2:] == (None, None), launch.buffers
    labels = dict(zip(avals, launch.buffers))
    assert labels["k_cache"] == "k_cache" and labels["v_cache"] == "v_cache", labels
    assert_native_entry_compiles(nvrtc, launch, arch, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn", "nvfp4"])
def test_gpu_jit_is_one_native_call_and_matches_eager_cupy(rng, cache):
    cupy = require_native_gpu()
    T, Hk, D, num_blocks, block_size = 37, 2, 128, 8, 8
    k, v, slots = _case(rng, "bfloat16", T=T, Hk=Hk, D=D, num_blocks=num_blocks,
                        block_size=block_size)
    rows = (num_blocks, block_size, Hk)
    device = jax.devices("gpu")[0]
    if cache == "nvfp4":
        arrays = (np.zeros(rows + (D // 2,), np.uint8),) * 2 + (np.zeros(rows + (D // 16,),
                                                                          np.uint8),) * 2
        options = dict(cache_dtype="nvfp4", k_scale=0.02, v_scale=0.01)
    else:
        arrays = (np.zeros(rows + (D,), np.uint8 if cache != "bfloat16" else np_dtype(cache)),) * 2
        options = dict(cache_dtype=cache, k_scale=0.5) if cache != "bfloat16" else {}

    def call(k, v, slots, kc, vc, *block_scales):
        extra = dict(zip(("k_cache_scales", "v_cache_scales"), block_scales))
        return cr.write_cache(k, v, kc, vc, slots, **options, **extra)

    def put(x):
        return jax.device_put(jnp.asarray(x), device)

    def on_cupy(x):
        if x.dtype == np_dtype("bfloat16"):
            return cupy.asarray(x.view(np.uint16)).view(x.dtype)
        return cupy.asarray(x)

    args = [put(x) for x in (k, v, slots, *arrays)]
    text = jax.jit(call).lower(*args).compile().as_text()
    assert text.count('custom_call_target="triton_kernel_call_ffi"') == 1
    assert "callback" not in text.lower()
    got = jax.jit(call)(*args)
    cupy_args = [on_cupy(x.copy()) for x in (k, v, slots, *arrays)]
    call(*cupy_args)  # eager: written in place
    for a, b in zip(got, cupy_args[3:]):
        np.testing.assert_array_equal(as_numpy(a).view(np.uint8),
                                      cupy.asnumpy(b).view(np.uint8))
