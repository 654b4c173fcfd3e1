"""``rope_and_cache`` into an NVFP4 KV cache (TensorRT-LLM's and FlashInfer's layout): e2m1 values
two per byte (the even one in the low nibble), an e4m3 block scale per 16 values of a head row
beside the cache, a float32 global scale per tensor; a reader dequantises
``e2m1 * block_scale * global``.

- The e2m1 rounding (nearest, ties to even, saturated at 6) against a float64 search of the grid.
- The NumPy path (CPU) against the float64 reference: every dequantised value within NVFP4's
  rounding, half a step of the e2m1 grid at its block's scale (0.25, 0.5 or 1 times the scale
  for |x| / scale below 2, below 4, or above), each block scale the e4m3 rounding of
  ``amax / 6 / global``, rows without a slot untouched; NHD and HND, both pairings, the norm,
  global scales as numbers or device scalars.
- Refusals with their messages, before anything is written.
- The GPU (CuPy, torch CUDA, marked gpu): the same bounds, and the v cache (no arithmetic before
  the quantisation) bit for bit the NumPy path's.
- torch: the operator (``cupyrope::rope_and_cache_rows``) under ``torch.compile`` and opcheck.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import Backend, backend_params
from cupyrope.core.numpy_path import e2m1_codes, nvfp4_quantize
from reference import reference_rope
from tolerances import np_dtype

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
POISON = 0xA5  # cache bytes that no call should touch where no slot points


def decode_nvfp4(packed: np.ndarray, block_scales: np.ndarray, global_scale: float) -> np.ndarray:
    """float64 values of NVFP4 rows: ``packed`` uint8 [..., D // 2], ``block_scales`` e4m3 bits
    [..., D // 16]."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
    values = E2M1_GRID[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    scales = block_scales.view(np.uint8).view(E4M3).astype(np.float64) * np.float64(
        np.float32(global_scale))
    return (values.reshape(values.shape[:-1] + (-1, 16)) * scales[..., None]).reshape(values.shape)


def half_step(magnitude: np.ndarray) -> np.ndarray:
    """Half the spacing of the e2m1 grid around |x| / scale (above 6: the saturation to 6)."""
    return np.where(magnitude < 2, 0.25, np.where(magnitude < 4, 0.5,
                                                  np.maximum(1.0, magnitude - 6)))


def assert_nvfp4_rows(packed, block_scales, global_scale, exact64, what):
    """Every dequantised value within NVFP4's rounding of the float64 value, and every block
    scale the e4m3 rounding of the block's amax / 6 / global (float32 arithmetic on the way:
    a relative 2^-18 of the block's values)."""
    got = decode_nvfp4(packed, block_scales, global_scale)
    blocks = exact64.reshape(exact64.shape[:-1] + (-1, 16))
    amax = np.abs(blocks).max(axis=-1)
    g = np.float64(np.float32(global_scale))
    scale = block_scales.view(np.uint8).view(E4M3).astype(np.float64)
    ideal = amax / 6 / g
    lo = np.clip(ideal * (1 - 2.0 ** -18), 0, 448).astype(E4M3).astype(np.float64)
    hi = np.clip(ideal * (1 + 2.0 ** -18), 0, 448).astype(E4M3).astype(np.float64)
    assert np.all((scale >= lo) & (scale <= hi)), f"{what}: block scales off the e4m3 rounding"
    step = (scale * g)[..., None]  # the block's scale as a reader applies it
    with np.errstate(divide="ignore", invalid="ignore"):
        magnitude = np.where(step > 0, np.abs(blocks) / step, 0.0)
    bound = half_step(magnitude) * step + 2.0 ** -18 * amax[..., None]
    err = np.abs(got.reshape(blocks.shape) - blocks)
    assert np.all(err <= bound), (f"{what}: max error {err.max():.3g} over the bound at "
                                  f"{np.unravel_index(np.argmax(err - bound), err.shape)}")


def test_e2m1_rounding_is_nearest_even_on_the_grid(rng):
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    values = np.concatenate([ties, -ties, E2M1_GRID, -E2M1_GRID, rng.uniform(-7, 7, 4000),
                             np.nextafter(ties, 0), np.nextafter(ties, 10), [6.5, 1e9, -1e9]])
    values = values.astype(np.float32)
    clamped = np.clip(values.astype(np.float64), -6, 6)
    # float64 search: the nearest grid value; at a tie the even code (the lower of the two here).
    distance = np.abs(np.abs(clamped)[:, None] - E2M1_GRID[None, :])
    nearest = distance.min(axis=1, keepdims=True)
    candidates = np.where(np.isclose(distance, nearest, rtol=0, atol=1e-12), np.arange(8), 99)
    even_first = np.where(candidates % 2 == 0, candidates, candidates + 100)
    expected = np.take_along_axis(candidates, np.argmin(even_first, axis=1)[:, None], 1)[:, 0]
    expected = expected | (np.signbit(values).astype(np.int64) << 3)
    np.testing.assert_array_equal(e2m1_codes(np.clip(values, -6, 6)), expected)


def test_block_quantisation_within_the_rounding_bound(rng):
    values = (rng.standard_normal((64, 128)) * rng.uniform(0.01, 100, (64, 1))).astype(np.float32)
    values[3, 16:32] = 0  # an all-zero block: scale 0, values 0
    global_scale = float(np.abs(values).max() / (6 * 448))
    packed, scales = nvfp4_quantize(values, global_scale)
    assert packed.dtype == np.uint8 and packed.shape == (64, 64)
    assert scales.dtype == np.uint8 and scales.shape == (64, 8)
    assert scales[3, 1] == 0 and not packed[3, 8:16].any()
    assert_nvfp4_rows(packed, scales, global_scale, values.astype(np.float64), "blocks")
    # The low nibble holds the even element.
    one = np.zeros((1, 16), np.float32)
    one[0, 0], one[0, 1] = 6.0, -0.5
    packed, scales = nvfp4_quantize(one, 1.0)
    assert packed[0, 0] == 0x7 | (0x9 << 4) and scales.view(E4M3)[0, 0] == 1.0


def test_a_nan_makes_its_block_read_back_as_nan(rng):
    values = rng.standard_normal((2, 32)).astype(np.float32)
    values[1, 20] = np.nan
    packed, scales = nvfp4_quantize(values, 0.01)
    got = decode_nvfp4(packed, scales, 0.01)
    assert np.isnan(got[1, 16:]).all() and np.isfinite(got[1, :16]).all()
    assert np.isfinite(got[0]).all()


def _cache_case(rng, *, T=11, Hq=4, Hk=2, D=64, dtype="bfloat16", num_blocks=5, block_size=4):
    q = (rng.standard_normal((T, Hq, D)) * 2).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 2).astype(np_dtype(dtype))
    v = rng.standard_normal((T, Hk, D)).astype(np_dtype(dtype))
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[[2, T - 1]] = -1  # padding
    return q, k, v, slots


def _caches(num_blocks, block_size, Hk, D, layout):
    rows = (num_blocks, block_size, Hk) if layout == "NHD" else (num_blocks, Hk, block_size)
    kc = np.full(rows + (D // 2,), POISON, np.uint8)
    ks = np.full(rows + (D // 16,), POISON, np.uint8)
    return kc, kc.copy(), ks, ks.copy()


def _rows(cache: np.ndarray, slots: np.ndarray, layout: str, block_size: int) -> np.ndarray:
    """The cache rows of the given slots, [n, heads, ...] whatever the layout."""
    blocks, within = slots // block_size, slots % block_size
    return cache[blocks, within] if layout == "NHD" else cache[blocks, :, within]


def _host(backend: Backend, x) -> np.ndarray:
    """A backend array's values as NumPy, one-byte arrays (uint8, fp8) as their uint8 bits."""
    if backend.framework == "torch" and x.element_size() == 1:
        import torch

        return x.detach().cpu().view(torch.uint8).numpy()
    host = backend.get(x)
    return host.view(np.uint8) if host.dtype.itemsize == 1 else host


@pytest.mark.parametrize("backend", backend_params(["numpy", "torch", "cupy", "torch-cuda"]),
                         indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,interleaved,norm,device_scales", [
    ("bfloat16", False, False, False), ("float16", True, True, True),
    ("float32", False, True, False), ("bfloat16", True, False, True)])
def test_rope_and_cache_into_an_nvfp4_cache(backend, rng, layout, dtype, interleaved, norm,
                                            device_scales):
    T, Hq, Hk, D, num_blocks, block_size = 11, 4, 2, 64, 5, 4
    q, k, v, slots = _cache_case(rng, T=T, Hq=Hq, Hk=Hk, D=D, dtype=dtype)
    positions = rng.integers(0, 4096, T)
    table = cr.cos_sin_cache(4096, D, dtype="float32")
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    k_global, v_global = 3.0 / (6 * 448), 2.5 / (6 * 448)
    kc, vc, ks, vs = _caches(num_blocks, block_size, Hk, D, layout)
    put = backend.put
    kcb, vcb, ksb, vsb = put(kc), put(vc), put(ks), put(vs)
    scales = ({"k_scale": put(np.array([k_global], np.float32)),
               "v_scale": put(np.array(v_global, np.float32))} if device_scales
              else {"k_scale": k_global, "v_scale": v_global})
    norm_kw = ({"q_weight": put(w), "k_weight": put(w), "eps": 1e-6} if norm else {})
    qb, kb = put(q), put(k)
    result = cr.rope_and_cache(qb, kb, put(v), put(positions), kcb, vcb, put(slots),
                               cos_sin_cache=put(table), interleaved=interleaved, layout=layout,
                               cache_dtype="nvfp4", k_cache_scales=ksb, v_cache_scales=vsb,
                               **scales, **norm_kw)
    assert len(result) == 4 and result[2] is kcb and result[3] is vcb

    def exact(x):
        x = x.astype(np.float64)
        if norm:
            x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w
        return reference_rope(x, positions, cos_sin_cache=table, interleaved=interleaved)

    valid = slots >= 0
    got = {name: _host(backend, x) for name, x in (("kc", kcb), ("vc", vcb), ("ks", ksb),
                                                   ("vs", vsb))}
    for cache, block, global_scale, values, name in (
            ("kc", "ks", k_global, exact(k)[valid], "k"),
            ("vc", "vs", v_global, v[valid].astype(np.float64), "v")):
        assert_nvfp4_rows(_rows(got[cache], slots[valid], layout, block_size),
                          _rows(got[block], slots[valid], layout, block_size),
                          global_scale, values, f"{backend} {name} cache")
        untouched = np.ones(num_blocks * block_size, bool)
        untouched[slots[valid]] = False
        for array in (got[cache], got[block]):
            every = np.arange(num_blocks * block_size)[untouched]
            assert (_rows(array, every, layout, block_size) == POISON).all()
    # q and k rotated in place, as rope_and_cache does with a cache of q's dtype.
    for x, out in ((q, qb), (k, kb)):
        err = np.abs(backend.get(out).astype(np.float64) - exact(x))
        assert err.max() <= 2.0 ** -7 * np.abs(exact(x)).max(), err.max()

    if backend.on_gpu:  # v goes into the cache as it is: the GPU's bytes are the NumPy path's
        kc2, vc2, ks2, vs2 = _caches(num_blocks, block_size, Hk, D, layout)
        host_scales = {"k_scale": k_global, "v_scale": v_global}
        cr.rope_and_cache(q.copy(), k.copy(), v, positions, kc2, vc2, slots, cos_sin_cache=table,
                          interleaved=interleaved, layout=layout, cache_dtype="nvfp4",
                          k_cache_scales=ks2, v_cache_scales=vs2, **host_scales,
                          **({"q_weight": w, "k_weight": w, "eps": 1e-6} if norm else {}))
        np.testing.assert_array_equal(got["vc"], vc2)
        np.testing.assert_array_equal(got["vs"], vs2)


@pytest.mark.parametrize("backend", backend_params(["numpy", "cupy", "torch-cuda"]),
                         indirect=True)
def test_nvfp4_block_scales_may_be_float8_arrays_and_partial_rotary(backend, rng):
    """Block scales given as float8_e4m3fn (torch, NumPy) hold the same bits; dims past
    rotary_dim are quantised with the rotated ones; a wide head (D = 256) on the general kernel."""
    T, Hq, Hk, D, num_blocks, block_size = 7, 2, 1, 256, 3, 4
    q, k, v, slots = _cache_case(rng, T=T, Hq=Hq, Hk=Hk, D=D, dtype="float16",
                                 num_blocks=num_blocks, block_size=block_size)
    positions = rng.integers(0, 1024, T)
    kc, vc, ks, vs = _caches(num_blocks, block_size, Hk, D, "NHD")
    put = backend.put
    if backend.framework == "cupy":  # CuPy has no fp8 dtype: uint8 bits
        ksb, vsb = put(ks), put(vs)
    elif backend.framework == "torch":
        import torch

        ksb, vsb = put(ks).view(torch.float8_e4m3fn), put(vs).view(torch.float8_e4m3fn)
    else:
        ksb, vsb = put(ks.view(E4M3)), put(vs.view(E4M3))
    kcb, vcb = put(kc), put(vc)
    cr.rope_and_cache(put(q), put(k), put(v), put(positions), kcb, vcb, put(slots),
                      rotary_dim=64, theta=1e4, cache_dtype="nvfp4", k_cache_scales=ksb,
                      v_cache_scales=vsb, k_scale=0.002, v_scale=0.001, inplace=False)
    valid = slots >= 0
    expected = reference_rope(k.astype(np.float64), positions, theta=1e4, rotary_dim=64)
    assert_nvfp4_rows(_rows(_host(backend, kcb), slots[valid], "NHD", block_size),
                      _rows(_host(backend, ksb), slots[valid], "NHD", block_size), 0.002,
                      expected[valid], "k cache")
    assert_nvfp4_rows(_rows(_host(backend, vcb), slots[valid], "NHD", block_size),
                      _rows(_host(backend, vsb), slots[valid], "NHD", block_size), 0.001,
                      v[valid].astype(np.float64), "v cache")


@pytest.mark.parametrize("case,error,match", [
    ("head_dim", ValueError, "NVFP4 cache needs head_dim a multiple of 16"),
    ("not_uint8", TypeError, "NVFP4 caches are uint8"),
    ("width", ValueError, r"does not hold 2 heads of 64 NVFP4 values \(32 bytes\)"),
    ("no_scales", TypeError, "an NVFP4 cache needs its block scales"),
    ("scale_shape", ValueError, r"k_cache_scales must have shape \(5, 4, 2, 4\)"),
    ("scale_dtype", TypeError, "k_cache_scales holds e4m3 block scales"),
    ("scales_without_nvfp4", ValueError, "hold the block scales of an NVFP4 cache"),
    ("per_row_global", ValueError, "an NVFP4 cache takes one global scale per tensor"),
    ("overlap", ValueError, "k_cache_scales shares memory with v_cache_scales"),
    ("uint8_unnamed", TypeError, "or 'nvfp4' for NVFP4 caches"),
    ("bad_name", ValueError, r"cache_dtype must be None or one of \('float8_e4m3fn', "
                             r"'float8_e5m2', 'nvfp4'\)"),
])
def test_nvfp4_refusals_write_nothing(rng, case, error, match):
    T, Hq, Hk, D, num_blocks, block_size = 6, 2, 2, 64, 5, 4
    q, k, v, slots = _cache_case(rng, T=T, Hq=Hq, Hk=Hk, D=D, dtype="float32")
    kc, vc, ks, vs = _caches(num_blocks, block_size, Hk, D, "NHD")
    kw = dict(cache_dtype="nvfp4", k_cache_scales=ks, v_cache_scales=vs, k_scale=0.01,
              v_scale=0.01)
    if case == "head_dim":
        q, k, v = q[..., :40], k[..., :40], v[..., :40]
        kc, vc = kc[..., :20], vc[..., :20]
    elif case == "not_uint8":
        kc, vc = kc.view(E4M3), vc.view(E4M3)
    elif case == "width":
        kc, vc = kc[..., :16], vc[..., :16]
    elif case == "no_scales":
        kw.pop("k_cache_scales")
        kw.pop("v_cache_scales")
    elif case == "scale_shape":
        kw["k_cache_scales"] = ks[..., :2]
    elif case == "scale_dtype":
        kw["k_cache_scales"] = ks.astype(np.float32)
    elif case == "scales_without_nvfp4":  # an fp8 cache has no block scales
        kw["cache_dtype"] = "float8_e4m3fn"
        kc, vc = np.zeros(kc.shape[:-1] + (D,), np.uint8), np.zeros(vc.shape[:-1] + (D,), np.uint8)
    elif case == "per_row_global":
        kw["k_scale"] = np.ones((num_blocks, block_size, Hk), np.float32)
    elif case == "overlap":
        kw["v_cache_scales"] = ks
    elif case in ("uint8_unnamed", "bad_name"):  # caches a row of D bytes, as fp8 ones
        kw.pop("cache_dtype")
        if case == "bad_name":
            kw["cache_dtype"] = "fp4"
        kc, vc = np.zeros(kc.shape[:-1] + (D,), np.uint8), np.zeros(vc.shape[:-1] + (D,), np.uint8)
    before = [x.copy() for x in (q, k, kc, vc, ks, vs)]
    with pytest.raises(error, match=match):
        cr.rope_and_cache(q, k, v, None, kc, vc, slots, **kw)
    for x, b in zip((q, k, kc, vc, ks, vs), before):
        np.testing.assert_array_equal(x, b)


def test_torch_compile_and_opcheck_of_the_nvfp4_cache_write(rng):
    torch = pytest.importorskip("torch")
    T, Hq, Hk, D, num_blocks, block_size = 6, 4, 2, 32, 3, 4
    q, k, v, slots = (torch.from_numpy(x) for x in _cache_case(
        rng, T=T, Hq=Hq, Hk=Hk, D=D, dtype="float32", num_blocks=num_blocks,
        block_size=block_size))
    positions = torch.from_numpy(rng.integers(0, 512, T))
    kc, vc, ks, vs = (torch.from_numpy(x) for x in _caches(num_blocks, block_size, Hk, D, "HND"))
    global_scale = torch.tensor([0.004])

    def write(q, k, kc, vc, ks, vs):
        return cr.rope_and_cache(q, k, v, positions, kc, vc, slots, layout="HND",
                                 cache_dtype="nvfp4", k_cache_scales=ks, v_cache_scales=vs,
                                 k_scale=global_scale, v_scale=0.003, inplace=False)

    eager = [x.clone() for x in (kc, vc, ks, vs)]
    q_out, k_out, _, _ = write(q, k, *eager)
    compiled = [x.clone() for x in (kc, vc, ks, vs)]
    q_c, k_c, _, _ = torch.compile(write, fullgraph=True, backend="aot_eager")(q, k, *compiled)
    for a, b in zip(eager + [q_out, k_out], compiled + [q_c, k_c]):
        assert torch.equal(a, b)
    assert not torch.equal(eager[0], kc)  # the cache was written

    from test_fused_torch import op_args

    scale_args = dict(k_scale_tensor=global_scale, v_scale=0.003)
    torch.library.opcheck(
        torch.ops.cupyrope.rope_and_cache_rows.default,
        op_args("rope_and_cache_rows", q=q, k=k, v=v, positions=positions, k_cache=kc.clone(),
                v_cache=vc.clone(), slot_mapping=slots, layout="HND", cache_dtype="nvfp4",
                k_cache_scales=ks.clone(), v_cache_scales=vs.clone(), **scale_args))
