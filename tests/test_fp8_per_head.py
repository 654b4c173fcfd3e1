"""fp8 stores with a scale per (token, head) row, computed by the call from the row's amax
(``scale = amax / the format's largest value``, at least 2^-126): fp8 outputs of
``apply_rope`` / ``rms_norm_rope`` (``q_scale="per_head"`` returns the scales, or a float32
array of shape ``q.shape[:-1]`` is filled) and the fp8 cache write of ``rope_and_cache`` (scales
``[num_blocks, block_size, Hk]`` beside an NHD cache, ``[num_blocks, Hk, block_size]`` beside an
HND one).

- The NumPy path (CPU) against the float64 reference: each scale the float32 rounding of the
  exact row's amax / fp8 max, each stored value the fp8 rounding of the exact value / its scale;
  a zero row gets scale 2^-126 and zeros, a NaN makes its row's scale NaN.
- Refusals with their messages (mixing per-row and per-tensor scales, shapes, dtypes, layouts).
- The GPU (CuPy, torch CUDA, marked gpu): the same bounds, and rows quantised as they are given
  (v into the cache) bit for bit the NumPy path's.
- torch: the operators of per-row scales under ``torch.compile`` and opcheck.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import Backend, backend_params
from reference import reference_rope
from tolerances import np_dtype

FP8 = ["float8_e4m3fn", "float8_e5m2"]
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
TINY = float(np.finfo(np.float32).tiny)


def _host(backend: Backend, x, fmt: str | None = None) -> np.ndarray:
    """A backend array's values as NumPy; fp8 (or its uint8 bits) as the ml_dtypes type."""
    if backend.framework == "torch" and x.element_size() == 1:
        import torch

        host = x.detach().cpu().view(torch.uint8).numpy()
    else:
        host = backend.get(x)
    if fmt is not None and host.dtype.itemsize == 1:
        host = host.view(np.uint8).view(np.dtype(getattr(ml_dtypes, fmt)))
    return host


def _fp8_array(backend: Backend, shape, fmt: str):
    """A zeroed fp8 array (CuPy: its uint8 bits)."""
    host = np.zeros(shape, np.uint8)
    if backend.framework == "torch":
        import torch

        return backend.put(host).view(getattr(torch, fmt))
    if backend.framework == "cupy":
        return backend.put(host)
    return host.view(np.dtype(getattr(ml_dtypes, fmt)))


def assert_fp8_rows(stored, scales, exact64, fmt, what):
    """Per row (last axis): the scale is the float32 rounding of amax / fp8 max of the exact row
    (at least 2^-126), within float32 arithmetic on the way (a relative 2^-18 of the row); every
    stored value the fp8 rounding of exact / scale, within the same slack."""
    fmt_dtype = np.dtype(getattr(ml_dtypes, fmt))
    limit = FP8_MAX[fmt]
    amax = np.abs(exact64).max(axis=-1)
    ideal = np.maximum(amax / limit, TINY)
    scales = np.asarray(scales, np.float64)
    assert np.all(np.abs(scales - ideal) <= 2.0 ** -18 * ideal), (
        f"{what}: scales off by {np.abs(scales / ideal - 1).max():.3g} (relative)")
    y = exact64 / scales[..., None]
    slack = 2.0 ** -18 * (np.abs(y).max(axis=-1, keepdims=True))
    lo = np.clip(y - slack, -limit, limit).astype(fmt_dtype).astype(np.float64)
    hi = np.clip(y + slack, -limit, limit).astype(fmt_dtype).astype(np.float64)
    got = stored.astype(np.float64)
    bad = ~((got >= lo) & (got <= hi))
    assert not bad.any(), (f"{what}: {int(bad.sum())} values off the fp8 rounding, first at "
                           f"{np.argwhere(bad)[0]}: {got[bad][0]} not in [{lo[bad][0]}, "
                           f"{hi[bad][0]}]")


def _rms_norm64(x, weight, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


@pytest.mark.parametrize("backend", backend_params(["numpy", "torch", "cupy", "torch-cuda"]),
                         indirect=True)
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype,interleaved,rotary_dim", [("bfloat16", False, None),
                                                          ("float16", True, 64),
                                                          ("float32", False, 96)])
def test_apply_rope_per_head_fp8_outputs(backend, rng, fmt, dtype, interleaved, rotary_dim):
    T, Hq, Hk, D = 13, 4, 2, 128
    q = (rng.standard_normal((T, Hq, D)) * rng.uniform(0.1, 30, (T, Hq, 1))).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * rng.uniform(0.1, 30, (T, Hk, 1))).astype(np_dtype(dtype))
    q[3, 1] = 0  # an all-zero row: scale 2^-126, zeros stored
    positions = rng.integers(0, 4096, T)
    q8, k8, q_scales, k_scales = cr.apply_rope(
        backend.put(q), backend.put(k), backend.put(positions), out_dtype=fmt,
        q_scale="per_head", k_scale="per_head", interleaved=interleaved, rotary_dim=rotary_dim)
    backend.check_type(q_scales, backend.put(np.zeros((T, Hq), np.float32)))
    for x, stored, scales, name in ((q, q8, q_scales, "q"), (k, k8, k_scales, "k")):
        exact = reference_rope(x, positions, interleaved=interleaved, rotary_dim=rotary_dim)
        assert_fp8_rows(_host(backend, stored, fmt), _host(backend, scales), exact, fmt,
                        f"{backend} {name}")
    assert _host(backend, q_scales)[3, 1] == np.float32(TINY)
    assert not _host(backend, q8, fmt)[3, 1].astype(np.float32).any()


@pytest.mark.parametrize("backend", backend_params(["numpy", "torch", "cupy", "torch-cuda"]),
                         indirect=True)
@pytest.mark.parametrize("fmt", FP8)
def test_rms_norm_rope_fills_given_scale_arrays(backend, rng, fmt):
    """The amax is the normalised, rotated row's; arrays given are filled, and the call returns
    only the outputs."""
    T, Hq, Hk, D = 9, 3, 1, 64
    q = (rng.standard_normal((T, Hq, D)) * 5).astype(np.float32)
    k = (rng.standard_normal((T, Hk, D)) * 5).astype(np.float32)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    positions = rng.integers(0, 1024, T)
    q_scales = backend.put(np.full((T, Hq), -1.0, np.float32))
    k_scales = backend.put(np.full((T, Hk), -1.0, np.float32))
    result = cr.rms_norm_rope(backend.put(q), backend.put(k), backend.put(w), backend.put(w),
                              backend.put(positions), eps=1e-6, out_dtype=fmt, q_scale=q_scales,
                              k_scale=k_scales, theta=5e5)
    assert len(result) == 2
    for x, stored, scales, name in ((q, result[0], q_scales, "q"), (k, result[1], k_scales, "k")):
        exact = reference_rope(_rms_norm64(x, w), positions, theta=5e5)
        assert_fp8_rows(_host(backend, stored, fmt), _host(backend, scales), exact, fmt, name)


def _cache_case(rng, T=12, Hq=4, Hk=2, D=64, dtype="bfloat16", num_blocks=5, block_size=4):
    q = (rng.standard_normal((T, Hq, D)) * 2).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 2).astype(np_dtype(dtype))
    v = (rng.standard_normal((T, Hk, D)) * rng.uniform(0.01, 10, (T, Hk, 1))).astype(
        np_dtype(dtype))
    v[4, 0] = 0
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[[1, T - 2]] = -1  # padding (token 4, with its zero v row, keeps its slot)
    return q, k, v, slots


def _rows(cache: np.ndarray, slots: np.ndarray, layout: str, block_size: int) -> np.ndarray:
    blocks, within = slots // block_size, slots % block_size
    return cache[blocks, within] if layout == "NHD" else cache[blocks, :, within]


@pytest.mark.parametrize("backend", backend_params(["numpy", "torch", "cupy", "torch-cuda"]),
                         indirect=True)
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,norm,interleaved", [("bfloat16", False, False),
                                                    ("float16", True, True),
                                                    ("float32", True, False)])
def test_rope_and_cache_per_row_fp8_cache(backend, rng, fmt, layout, dtype, norm, interleaved):
    T, Hq, Hk, D, num_blocks, block_size = 12, 4, 2, 64, 5, 4
    q, k, v, slots = _cache_case(rng, T=T, Hq=Hq, Hk=Hk, D=D, dtype=dtype)
    positions = rng.integers(0, 4096, T)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    rows = (num_blocks, block_size, Hk) if layout == "NHD" else (num_blocks, Hk, block_size)
    kc, vc = _fp8_array(backend, rows + (D,), fmt), _fp8_array(backend, rows + (D,), fmt)
    ks = backend.put(np.full(rows, -1.0, np.float32))
    vs = backend.put(np.full(rows, -1.0, np.float32))
    extra = {"cache_dtype": fmt} if backend.framework == "cupy" else {}
    norm_kw = ({"q_weight": backend.put(w), "k_weight": backend.put(w), "eps": 1e-6} if norm
               else {})
    qb, kb = backend.put(q), backend.put(k)
    cr.rope_and_cache(qb, kb, backend.put(v), backend.put(positions), kc, vc, backend.put(slots),
                      layout=layout, interleaved=interleaved, k_scale=ks, v_scale=vs, **extra,
                      **norm_kw)
    exact_k = reference_rope(_rms_norm64(k, w) if norm else k, positions, interleaved=interleaved)
    valid = slots >= 0
    for cache, scales, exact, name in ((kc, ks, exact_k, "k"),
                                       (vc, vs, v.astype(np.float64), "v")):
        assert_fp8_rows(_rows(_host(backend, cache, fmt), slots[valid], layout, block_size),
                        _rows(_host(backend, scales), slots[valid], layout, block_size),
                        exact[valid], fmt, f"{backend} {name} cache")
        unwritten = np.ones(num_blocks * block_size, bool)
        unwritten[slots[valid]] = False
        every = np.arange(num_blocks * block_size)[unwritten]
        assert (_rows(_host(backend, scales), every, layout, block_size) == -1).all()
    assert _rows(_host(backend, vs), slots[[4]], layout, block_size)[0, 0] == np.float32(TINY)

    if backend.on_gpu:  # v is quantised as given: the GPU's bytes and scales are NumPy's
        host_kc = np.zeros(rows + (D,), np.dtype(getattr(ml_dtypes, fmt)))
        host_vc, host_ks, host_vs = host_kc.copy(), np.full(rows, -1.0, np.float32), np.full(
            rows, -1.0, np.float32)
        cr.rope_and_cache(q.copy(), k.copy(), v, positions, host_kc, host_vc, slots,
                          layout=layout, interleaved=interleaved, k_scale=host_ks,
                          v_scale=host_vs, **({"q_weight": w, "k_weight": w, "eps": 1e-6}
                                              if norm else {}))
        np.testing.assert_array_equal(_host(backend, vs), host_vs)
        np.testing.assert_array_equal(_host(backend, vc, fmt).view(np.uint8),
                                      host_vc.view(np.uint8))


@pytest.mark.parametrize("backend", backend_params(["numpy", "cupy", "torch-cuda"]),
                         indirect=True)
def test_rope_and_cache_per_row_fp8_outputs_with_a_16_bit_cache(backend, rng):
    """fp8 q_out / k_out with per-row scales beside a cache of q's dtype (written as it is)."""
    T, Hq, Hk, D, num_blocks, block_size = 10, 4, 2, 64, 4, 4
    q, k, v, slots = _cache_case(rng, T=T, Hq=Hq, Hk=Hk, D=D, dtype="bfloat16",
                                 num_blocks=num_blocks, block_size=block_size)
    positions = rng.integers(0, 4096, T)
    kc = backend.put(np.zeros((num_blocks, block_size, Hk, D), np_dtype("bfloat16")))
    vc = backend.put(np.zeros((num_blocks, block_size, Hk, D), np_dtype("bfloat16")))
    q_scales = backend.put(np.zeros((T, Hq), np.float32))
    k_scales = backend.put(np.zeros((T, Hk), np.float32))
    q8, k8, _, _ = cr.rope_and_cache(backend.put(q), backend.put(k), backend.put(v),
                                     backend.put(positions), kc, vc, backend.put(slots),
                                     out_dtype="float8_e4m3fn", q_scale=q_scales,
                                     k_scale=k_scales, inplace=False)
    for x, stored, scales, name in ((q, q8, q_scales, "q"), (k, k8, k_scales, "k")):
        assert_fp8_rows(_host(backend, stored, "float8_e4m3fn"), _host(backend, scales),
                        reference_rope(x, positions), "float8_e4m3fn", name)
    valid = slots >= 0
    np.testing.assert_array_equal(_host(backend, vc).reshape(-1, Hk, D)[slots[valid]], v[valid])


def test_a_nan_makes_its_rows_scale_nan(rng):
    q, k, v, slots = _cache_case(rng, dtype="float32")
    v[0, 1, 5] = np.nan
    kc = np.zeros((5, 4, 2, 64), ml_dtypes.float8_e4m3fn)
    vc = kc.copy()
    ks, vs = np.zeros((5, 4, 2), np.float32), np.zeros((5, 4, 2), np.float32)
    cr.rope_and_cache(q, k, v, None, kc, vc, slots, k_scale=ks, v_scale=vs)
    block, row = divmod(int(slots[0]), 4)
    assert np.isnan(vs[block, row, 1]) and np.isfinite(vs[block, row, 0])
    assert np.isnan(vc[block, row, 1].astype(np.float32)).all()
    assert np.isfinite(vs[slots[2] // 4, slots[2] % 4]).all()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"q_scale": "per_head", "k_scale": 0.5}, ValueError,
     r"q_scale per \(token, head\) row but k_scale one per tensor: scale every fp8 store of a "
     r"call per tensor, or every one per row \(k_scale: 'per_head' or a float32 array of shape "
     r"\(3, 1\)\)"),
    ({"q_scale": "per_head"}, ValueError, "k_scale not given"),
    ({"q_scale": np.zeros((3, 4), np.float32), "k_scale": "per_head"}, ValueError,
     r"q_scale holds the scales of q_out's rows, one per row: it must have shape \(3, 2\)"),
    ({"q_scale": np.zeros((3, 2), np.float64), "k_scale": "per_head"}, TypeError,
     r"q_scale \(per-row scales\) must be float32"),
    ({"q_scale": np.zeros((2, 3), np.float32).T, "k_scale": "per_head"}, ValueError,
     "must be C-contiguous"),
    ({"q_scale": "per_token"}, ValueError, "q_scale must be a number, a 0-d / one-element"),
    ({"q_scale": "per_head", "k_scale": "per_head", "out_dtype": None}, ValueError,
     "q_scale is only used with an fp8 out_dtype"),
    ({"q_scale": np.ones(2, np.float32)}, ValueError, "q_scale must be a number or a 0-d"),
])
def test_apply_rope_per_row_refusals(rng, kwargs, error, match):
    q = rng.standard_normal((3, 2, 64)).astype(np.float32)
    k = rng.standard_normal((3, 1, 64)).astype(np.float32)
    args = {"out_dtype": "float8_e4m3fn"}
    args.update(kwargs)
    given = [v for v in kwargs.values() if isinstance(v, np.ndarray)]
    before = [x.copy() for x in (q, k, *given)]
    with pytest.raises(error, match=match):
        cr.apply_rope(q, k, np.arange(3), **args)
    for x, b in zip((q, k, *given), before):
        np.testing.assert_array_equal(x, b)


def test_read_only_and_overlapping_scale_arrays_are_refused(rng):
    q = rng.standard_normal((3, 2, 64)).astype(np.float32)
    k = rng.standard_normal((3, 1, 64)).astype(np.float32)
    frozen = np.zeros((3, 2), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="q_scale is read-only"):
        cr.apply_rope(q, k, np.arange(3), out_dtype="float8_e4m3fn", q_scale=frozen,
                      k_scale="per_head")
    both = np.zeros(8, np.float32)  # q's scales in [0, 6), k's in [5, 8)
    with pytest.raises(ValueError, match="q_scale shares memory with k_scale"):
        cr.apply_rope(q, k, np.arange(3), out_dtype="float8_e4m3fn",
                      q_scale=both[:6].reshape(3, 2), k_scale=both[5:].reshape(3, 1))
    assert not both.any()


@pytest.mark.parametrize("case,error,match", [
    ("mixed", ValueError, r"k_scale per \(token, head\) row but v_scale one per tensor"),
    ("per_head_string", ValueError, "k_scale='per_head' for the k cache's rows: their scales "
                                    "must stay beside the cache"),
    ("nhd_shape_in_hnd", ValueError, r"must have shape \(5, 2, 4\)"),
    ("fp8_out_and_cache", ValueError, "per-row scales for fp8 outputs and an fp8 cache in one "
                                      "call are not supported"),
    ("out_per_head_string", ValueError, "makes new scale arrays only in apply_rope and "
                                        "rms_norm_rope"),
    ("no_fp8", ValueError, "v_scale is only used with an fp8 cache"),
])
def test_rope_and_cache_per_row_refusals_write_nothing(rng, case, error, match):
    q, k, v, slots = _cache_case(rng, dtype="float32")
    layout = "HND" if case == "nhd_shape_in_hnd" else "NHD"
    rows = (5, 4, 2) if layout == "NHD" else (5, 2, 4)
    kc = np.zeros(rows + (64,), ml_dtypes.float8_e4m3fn)
    vc = kc.copy()
    ks, vs = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    kw = dict(k_scale=ks, v_scale=vs, layout=layout)
    if case == "mixed":
        kw["v_scale"] = 0.5
    elif case == "per_head_string":
        kw["k_scale"] = "per_head"
    elif case == "nhd_shape_in_hnd":
        kw["k_scale"] = np.zeros((5, 4, 2), np.float32)
    elif case == "fp8_out_and_cache":
        kw.update(out_dtype="float8_e4m3fn", q_scale="per_head", inplace=False)
    elif case == "out_per_head_string":
        kc, vc = kc.astype(np.float32), vc.astype(np.float32)
        kw = dict(out_dtype="float8_e4m3fn", q_scale="per_head", k_scale="per_head",
                  inplace=False)
    elif case == "no_fp8":
        kc, vc = kc.astype(np.float32), vc.astype(np.float32)
    before = [x.copy() for x in (q, k, kc, vc, ks, vs)]
    with pytest.raises(error, match=match):
        cr.rope_and_cache(q, k, v, None, kc, vc, slots, **kw)
    for x, b in zip((q, k, kc, vc, ks, vs), before):
        np.testing.assert_array_equal(x, b)


def test_plan_of_a_row_scaled_launch():
    """Row-scaled launches take the general fused kernel's rows build (never the lean one), lanes
    of a power of two (the row's amax is a warp reduction), no ring, and a row buffer per head
    lane group that fits 48 KiB of shared memory."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.fused_plan import plan_fused
    from cupyrope.cuda import launch

    for D, Hq, T in ((128, 32, 70), (1024, 64, 8192)):
        q = np.zeros((T, Hq, D), np.float32)
        k = np.zeros((T, 8, D), np.float32)
        plan = plan_fused("apply_rope", q, k, np.arange(T), validate=False,
                          rope=dict(theta=1e4, inplace=False),
                          fusion=dict(out_dtype="float8_e4m3fn",
                                      q_scale=np.zeros((T, Hq), np.float32),
                                      k_scale=np.zeros((T, 8), np.float32)))
        outputs = [describe(np.zeros(q.shape, np.uint8), "q_out"),
                   describe(np.zeros(k.shape, np.uint8), "k_out")]
        for out in outputs:
            out.dtype = "float8_e4m3fn"
        spec = launch.plan_launch(plan, outputs, inv_freq_ptr=4096, num_regs=lambda s: 128,
                                  multiprocessors=132)
        assert spec.kernel.fused and spec.kernel.rows and not spec.kernel.lean
        assert "rope_fused_rows_kernel" in spec.kernel.name_expression
        lanes, heads, tokens = spec.block
        assert lanes & (lanes - 1) == 0
        assert spec.shared_bytes == 4 * D * heads * tokens <= 48 * 1024
        assert spec.grid[0] * tokens >= T and spec.grid[1] * heads * 16 >= Hq + 8
        f = spec.fusion_params
        assert int(f["row_scaled"]) == 1 and int(f["ring"]) == 0
        assert int(f["q_out_scales"]) == plan.fusion.q_scale.rows.ptr
        assert int(f["k_out_scales_token_stride"]) == 8 and int(f["k_out_scales_head_stride"]) == 1


def test_torch_compile_and_opcheck_of_per_row_scales(rng):
    torch = pytest.importorskip("torch")
    from test_fused_torch import op_args

    q = torch.from_numpy(rng.standard_normal((5, 4, 32)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((5, 2, 32)).astype(np.float32))
    positions = torch.arange(5)

    def quantise(q, k):
        return cr.apply_rope(q, k, positions, out_dtype="float8_e4m3fn", q_scale="per_head",
                             k_scale="per_head")

    eager = quantise(q, k)
    compiled = torch.compile(quantise, fullgraph=True, backend="aot_eager")(q, k)
    assert len(compiled) == 4
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    rows = dict(q_scale_rows=torch.zeros(5, 4), k_scale_rows=torch.zeros(5, 2))
    tests = ("test_schema", "test_faketensor")  # fp8 arithmetic torch lacks on the CPU: as in
    # test_fused_torch.py, the schema and the fake implementation
    torch.library.opcheck(torch.ops.cupyrope.apply_rope_fp8_rows.default,
                          op_args("apply_rope_fp8_rows", q=q, k=k, positions=positions,
                                  out_dtype="float8_e4m3fn", **rows), test_utils=tests)
    w = torch.ones(32)
    torch.library.opcheck(torch.ops.cupyrope.rms_norm_rope_fp8_rows.default,
                          op_args("rms_norm_rope_fp8_rows", q=q, k=k, positions=positions,
                                  q_weight=w, k_weight=w, eps=1e-6, out_dtype="float8_e5m2",
                                  **rows), test_utils=tests)
