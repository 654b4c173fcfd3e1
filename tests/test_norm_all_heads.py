"""RMSNorm over all heads of a token (``norm_over="all_heads"``: OLMo 2's q_norm / k_norm over
the whole projection, FlashInfer's ``fused_qk_rmsnorm_rope``) fused with the rotation, the fp8
stores and the cache write, against the float64 reference on every backend; its gradients; its
launch (one token a block, every head in it); its refusals. CuPy and torch CUDA run the lean
all-heads kernel (the lean layout, every dim rotated) or the general fused kernel on the GPU
(marked gpu)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import angle_source, backend_params, host_values
from reference import reference_rope
from test_fused import _assert_close, _put_fp8
from tolerances import np_dtype

BACKENDS = backend_params(["numpy", "torch", "jax", "cupy", "torch-cuda", "jax-gpu"])
MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
GPU_AND_NUMPY = backend_params(["numpy", "cupy", "torch-cuda"])


def _norm_all_heads64(x, weight, eps, weight_offset=0.0):
    """x / rms(x over its last two dims) * (weight_offset + weight), in float64."""
    x = np.asarray(x, dtype=np.float64)
    rms = np.sqrt(np.mean(x * x, axis=(-2, -1), keepdims=True) + eps)
    w = np.asarray(weight, dtype=np.float64).reshape(x.shape[-2:])
    return x / rms * (weight_offset + w)


@pytest.fixture(params=["general", "lean", "lean-fast-memory"])
def all_heads_kernel(request, monkeypatch):
    """The kernel of the GPU launches with the norm over all heads in the lean layout: the lean
    all-heads kernel (``launch.LEAN_ALL_HEADS``, the default), the same as on a GPU of fast memory
    at every T (four held NeoX heads a thread row: ``launch.lean_all_heads_held``), or the general
    fused kernel's all-heads variant (switched off). Yields (lean, planned): whether the lean
    kernel is on, and the list each lean launch planned appends to; launch recipes of the other
    kernels are forgotten before and after."""
    from cupyrope import execute
    from cupyrope.cuda import launch

    lean, planned = request.param.startswith("lean"), []
    monkeypatch.setattr(launch, "LEAN_ALL_HEADS", lean)
    if request.param == "lean-fast-memory":
        monkeypatch.setattr(launch, "_memory_bandwidth", lambda device: 4.8e12)
        monkeypatch.setattr(launch, "LEAN_ALL_HEADS_FAST_MEMORY_MIN_TOKENS", 1)
    if lean:
        geometry = launch.lean_all_heads_geometry
        monkeypatch.setattr(launch, "lean_all_heads_geometry",
                            lambda *args, **kwargs: planned.append(args) or geometry(*args,
                                                                                     **kwargs))
    execute.clear()
    yield lean, planned
    execute.clear()


def _fp8_values(backend, x) -> np.ndarray:
    """An e4m3 array's values on the host (CuPy's are uint8 bits)."""
    values = host_values(backend, x)
    return values.view(ml_dtypes.float8_e4m3fn) if values.dtype == np.uint8 else values


def _inputs(rng, T, Hq, Hk, D, dtype, *, weight_shape="flat", weight_dtype=None):
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    w_dtype = np_dtype(weight_dtype or dtype)
    wq = rng.uniform(0.5, 1.5, (Hq, D)).astype(w_dtype)
    wk = rng.uniform(0.5, 1.5, (Hk, D)).astype(w_dtype)
    if weight_shape == "flat":
        wq, wk = wq.reshape(-1), wk.reshape(-1)
    return q, k, wq, wk


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
@pytest.mark.parametrize("interleaved,rotary_fraction,weight_offset,weight_shape",
                         [(False, 1, 0.0, "flat"), (True, 1, 1.0, "heads"),
                          (False, 2, 1.0, "heads"), (True, 4, 0.0, "flat")])
def test_norm_over_all_heads_matches_the_reference(backend, rng, dtype, source, interleaved,
                                                   rotary_fraction, weight_offset, weight_shape):
    """Each token's q heads normalised together (and its k heads apart), weights of every
    element of the projection, then the rotation; the dims past rotary_dim normalised too."""
    T, Hq, Hk, D = 37, 6, 2, 128
    r = D // rotary_fraction
    positions = rng.integers(0, 4096, T)
    q, k, wq, wk = _inputs(rng, T, Hq, Hk, D, dtype, weight_shape=weight_shape)
    lib, ref_kw, _ = angle_source(source, (T,), positions, r, interleaved=interleaved)
    put = {name: backend.put(v) if isinstance(v, np.ndarray) else v for name, v in lib.items()}
    q_out, k_out = cr.rms_norm_rope(backend.put(q), backend.put(k), backend.put(wq),
                                    backend.put(wk), eps=1e-6, weight_offset=weight_offset,
                                    interleaved=interleaved, norm_over="all_heads", **put)
    for x, w, out, name in ((q, wq, q_out, "q"), (k, wk, k_out, "k")):
        expected = reference_rope(_norm_all_heads64(x, w, 1e-6, weight_offset),
                                  interleaved=interleaved, **ref_kw)
        got = host_values(backend, out)
        assert got.dtype == np_dtype(dtype) and got.shape == x.shape
        _assert_close(got, expected, dtype, f"{backend} {name}")


@pytest.mark.parametrize("backend", backend_params(["numpy", "cupy", "torch-cuda", "jax-gpu"]),
                         indirect=True)
@pytest.mark.parametrize("T,Hq,Hk,D,dtype", [
    (5, 64, 64, 128, "bfloat16"),   # 64 KiB of float32 weights: past 48 KiB of shared memory
    (3, 5, 3, 64, "float16"),       # heads that fill no whole warp
    (9, 7, 1, 80, "bfloat16"),      # 5 chunks a head on 8 lanes; MQA
    (4100, 4, 2, 128, "float32"),   # many tokens: no ring (every head is read for the sums)
    (1, 32, 8, 128, "bfloat16"),    # decode: the general kernel all the same
])
def test_norm_over_all_heads_at_other_sizes(backend, rng, T, Hq, Hk, D, dtype):
    positions = rng.integers(0, 8192, T)
    cache = cr.cos_sin_cache(8192, D, dtype="float32")
    q, k, wq, wk = _inputs(rng, T, Hq, Hk, D, dtype, weight_dtype="float32")
    q_out, k_out = cr.rms_norm_rope(backend.put(q), backend.put(k), backend.put(wq),
                                    backend.put(wk), backend.put(positions), eps=1e-5,
                                    cos_sin_cache=backend.put(cache), norm_over="all_heads")
    for x, w, out, name in ((q, wq, q_out, "q"), (k, wk, k_out, "k")):
        expected = reference_rope(_norm_all_heads64(x, w, 1e-5), positions, cos_sin_cache=cache)
        _assert_close(host_values(backend, out), expected, dtype, f"{backend} {name} T={T}")


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("dtype,interleaved,source,weight_offset", [
    ("bfloat16", False, "cache", 0.0), ("float16", True, "tables_half", 1.0),
    ("float32", False, "computed", 0.0), ("bfloat16", True, "computed", 1.0),
    ("float16", False, "tables_full", 0.0)])
@pytest.mark.parametrize("T,Hq,Hk,weight_dtype", [
    (1, 32, 8, None),        # decode; 40 heads held on 20 rows (NeoX) or 10 (interleaved)
    (37, 6, 2, "float32"),   # weights of another dtype than q's
    (300, 64, 64, None),     # 128 heads: 64 held on 32 rows of 8 lanes or 16 of 16, 64 read twice
    (5, 5, 3, None),         # 8 heads: rows past them
    (3, 25, 8, None),        # 33 heads: rows whose second held head is past the heads
    (20000, 4, 2, None),     # past 4 waves of blocks of one warp: a persistent grid
])
def test_lean_all_heads_kernel_matches_the_reference(backend, rng, all_heads_kernel, dtype,
                                                     interleaved, source, weight_offset, T, Hq,
                                                     Hk, weight_dtype):
    """The lean layout, every dim rotated, on both kernels: the same results within the
    tolerance of the float64 reference, out of place and in place."""
    D = 128
    positions = rng.integers(0, 4096, T)
    q, k, wq, wk = _inputs(rng, T, Hq, Hk, D, dtype, weight_dtype=weight_dtype)
    lib, ref_kw, _ = angle_source(source, (T,), positions, D, interleaved=interleaved)
    put = {name: backend.put(v) if isinstance(v, np.ndarray) else v for name, v in lib.items()}
    args = (backend.put(wq), backend.put(wk))
    options = dict(eps=1e-6, weight_offset=weight_offset, interleaved=interleaved,
                   norm_over="all_heads", **put)
    q_dev, k_dev = backend.put(q), backend.put(k)
    results = cr.rms_norm_rope(q_dev, k_dev, *args, **options)
    in_place = cr.rms_norm_rope(q_dev, k_dev, *args, inplace=True, **options)
    for x, w, outs, name in ((q, wq, (results[0], in_place[0]), "q"),
                             (k, wk, (results[1], in_place[1]), "k")):
        expected = reference_rope(_norm_all_heads64(x, w, 1e-6, weight_offset),
                                  interleaved=interleaved, **ref_kw)
        for out, how in zip(outs, ("out of place", "in place")):
            _assert_close(host_values(backend, out), expected, dtype, f"{backend} {name} {how}")
    lean, planned = all_heads_kernel
    assert len(planned) == (2 if lean else 0)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
def test_norm_over_all_heads_in_place_on_fused_qkv_views(backend, rng):
    """vLLM's layout (q and k views of one [T, (Hq + 2 Hk) D] buffer) and an odd head stride
    (one element at a time on the GPU), written in place; v is never touched."""
    T, Hq, Hk, D = 11, 4, 2, 64
    for pad in (0, 1):
        qkv = (rng.standard_normal((T, Hq + 2 * Hk, D + pad)) * 2).astype(np.float32)
        wq = rng.uniform(0.5, 1.5, Hq * D).astype(np.float32)
        wk = rng.uniform(0.5, 1.5, Hk * D).astype(np.float32)
        positions = rng.integers(0, 1000, T)
        buf = backend.put(qkv)
        q, k = buf[:, :Hq, :D], buf[:, Hq:Hq + Hk, :D]
        cr.rms_norm_rope(q, k, backend.put(wq), backend.put(wk), backend.put(positions),
                         eps=1e-6, norm_over="all_heads", inplace=True)
        got = host_values(backend, buf)
        for h0, h1, w in ((0, Hq, wq), (Hq, Hq + Hk, wk)):
            expected = reference_rope(_norm_all_heads64(qkv[:, h0:h1, :D], w, 1e-6), positions)
            _assert_close(got[:, h0:h1, :D], expected, "float32", f"{backend} pad={pad}")
        np.testing.assert_array_equal(got[:, Hq + Hk:], qkv[:, Hq + Hk:])  # v
        np.testing.assert_array_equal(got[:, :Hq + Hk, D:], qkv[:, :Hq + Hk, D:])  # padding


@pytest.mark.parametrize("backend", GPU_AND_NUMPY, indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_format", ["bfloat16", "float8_e4m3fn", "per_row"])
def test_rope_and_cache_with_the_norm_over_all_heads(backend, rng, layout, cache_format,
                                                     all_heads_kernel):
    """OLMo 2 serving: the norm over all heads, the rotation and the paged cache write in one
    launch; fp8 caches with a scale, or a scale per (slot, head) row (the row-scaled kernel);
    with the lean all-heads kernel switched on too (per-row scales stay on the general one)."""
    T, Hq, Hk, D, block_size, num_blocks = 21, 8, 4, 128, 4, 9
    positions = rng.integers(0, 4096, T)
    cache = cr.cos_sin_cache(4096, D, dtype="float32")
    q, k, wq, wk = _inputs(rng, T, Hq, Hk, D, "bfloat16")
    v = rng.standard_normal((T, Hk, D)).astype(ml_dtypes.bfloat16)
    slots = rng.permutation(num_blocks * block_size)[:T]
    slots[::5] = -1
    shape = ((num_blocks, block_size, Hk, D) if layout == "NHD"
             else (num_blocks, Hk, block_size, D))
    if cache_format == "bfloat16":
        k_cache, v_cache = (backend.put(np.zeros(shape, ml_dtypes.bfloat16)) for _ in range(2))
        scales = {}
    else:
        k_cache, v_cache = (_put_fp8(backend, np.zeros(shape, ml_dtypes.float8_e4m3fn))
                            for _ in range(2))
        scales = {"cache_dtype": "float8_e4m3fn"}
    if cache_format == "float8_e4m3fn":
        scales.update(k_scale=0.05, v_scale=0.02)
    elif cache_format == "per_row":
        rows_shape = shape[:3]
        scales.update(k_scale=backend.put(np.zeros(rows_shape, np.float32)),
                      v_scale=backend.put(np.zeros(rows_shape, np.float32)))
    q_out, k_out, _, _ = cr.rope_and_cache(
        backend.put(q), backend.put(k), backend.put(v), backend.put(positions), k_cache, v_cache,
        backend.put(slots), cos_sin_cache=backend.put(cache), layout=layout,
        q_weight=backend.put(wq), k_weight=backend.put(wk), eps=1e-6, norm_over="all_heads",
        inplace=False, **scales)
    expected = {}
    for x, w, out, name in ((q, wq, q_out, "q"), (k, wk, k_out, "k")):
        expected[name] = reference_rope(_norm_all_heads64(x, w, 1e-6), positions,
                                        cos_sin_cache=cache)
        _assert_close(host_values(backend, out), expected[name], "bfloat16", f"{backend} {name}")
    got = _fp8_values(backend, k_cache).astype(np.float64)
    if layout == "HND":
        got = got.transpose(0, 2, 1, 3)
    got = got.reshape(-1, Hk, D)
    written = slots >= 0
    if cache_format == "per_row":
        row_scales = host_values(backend, scales["k_scale"])
        row_scales = (row_scales if layout == "NHD" else row_scales.transpose(0, 2, 1))
        got = got * row_scales.reshape(-1, Hk)[:, :, None]
        amax = np.abs(expected["k"][written]).max(-1, keepdims=True)
        bound = amax * 2.0 ** -3  # e4m3: 3 mantissa bits, to nearest
    elif cache_format == "float8_e4m3fn":
        got = got * 0.05
        bound = np.abs(expected["k"][written]) * 2.0 ** -4 + 0.05 * 2.0 ** -9
    else:
        bound = np.abs(expected["k"][written]).max(-1, keepdims=True) * 2.0 ** -7
    err = np.abs(got[slots[written]] - expected["k"][written])
    assert np.all(err <= bound), f"{backend} k cache: max error {err.max():.3g}"
    # v's rows: as they are (bfloat16), or as fp8 of v / scale
    got_v = _fp8_values(backend, v_cache).astype(np.float64)
    if layout == "HND":
        got_v = got_v.transpose(0, 2, 1, 3)
    got_v = got_v.reshape(-1, Hk, D)[slots[written]]
    want_v = v.astype(np.float64)[written]
    if cache_format == "bfloat16":
        np.testing.assert_array_equal(got_v, want_v)
    else:
        if cache_format == "per_row":
            v_scales = host_values(backend, scales["v_scale"])
            v_scales = v_scales if layout == "NHD" else v_scales.transpose(0, 2, 1)
            got_v = got_v * v_scales.reshape(-1, Hk)[slots[written]][:, :, None]
            bound_v = np.abs(want_v).max(-1, keepdims=True) * 2.0 ** -3
        else:
            got_v = got_v * 0.02
            bound_v = np.abs(want_v) * 2.0 ** -4 + 0.02 * 2.0 ** -9
        assert np.all(np.abs(got_v - want_v) <= bound_v), f"{backend} v cache"
    lean, planned = all_heads_kernel
    assert len(planned) == (1 if lean and backend.on_gpu and cache_format != "per_row" else 0)


@pytest.mark.parametrize("backend", GPU_AND_NUMPY, indirect=True)
def test_norm_over_all_heads_with_fp8_outputs_and_mrope(backend, rng):
    """fp8 outputs (per tensor) and M-RoPE positions ([3, T], Qwen2-VL sections) on the same
    norm; the expected rotation is the float64 path of apply_rope on the float64 norm."""
    T, Hq, Hk, D = 13, 4, 2, 128
    scaling = {"rope_type": "default", "mrope_section": [16, 24, 24]}
    positions = rng.integers(0, 2048, (3, T))
    cache = cr.cos_sin_cache(2048, D, dtype="float64")
    q, k, wq, wk = _inputs(rng, T, Hq, Hk, D, "bfloat16")
    normed = [_norm_all_heads64(x, w, 1e-6) for x, w in ((q, wq), (k, wk))]
    expected = cr.apply_rope(*normed, positions, cos_sin_cache=cache, scaling=scaling)
    q_out, k_out = cr.rms_norm_rope(
        backend.put(q), backend.put(k), backend.put(wq), backend.put(wk),
        backend.put(positions), eps=1e-6, norm_over="all_heads",
        cos_sin_cache=backend.put(cache.astype(np.float32)), scaling=scaling)
    for out, want, name in ((q_out, expected[0], "q"), (k_out, expected[1], "k")):
        _assert_close(host_values(backend, out), want, "bfloat16", f"{backend} mrope {name}")
    q8, k8 = cr.rms_norm_rope(
        backend.put(q), backend.put(k), backend.put(wq), backend.put(wk),
        backend.put(positions), eps=1e-6, norm_over="all_heads",
        cos_sin_cache=backend.put(cache.astype(np.float32)), scaling=scaling,
        out_dtype="float8_e4m3fn", q_scale=0.25, k_scale=0.5)
    for out, want, scale in ((q8, expected[0], 0.25), (k8, expected[1], 0.5)):
        got = _fp8_values(backend, out).astype(np.float64) * scale
        assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -4 + scale * 2.0 ** -9)


def _torch_reference_grads(torch, q, k, wq, wk, positions, cache, upstream):
    """Gradients of sum(upstream * rotated norm) in float64 torch, through autograd of the
    formula (cupyrope's float64 NumPy-free path: the torch arithmetic below)."""
    q64, k64, wq64, wk64 = (torch.tensor(np.asarray(x, np.float64), requires_grad=True)
                            for x in (q, k, wq, wk))
    cos_sin = torch.tensor(np.asarray(cache, np.float64))[torch.tensor(positions)]
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    total = 0
    for x, w, g in ((q64, wq64, upstream[0]), (k64, wk64, upstream[1])):
        n = x * torch.rsqrt(x.square().mean((-2, -1), keepdim=True) + 1e-6) * w.reshape(x.shape[-2:])
        x1, x2 = n[..., :half], n[..., half:]
        y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        total = total + (y * torch.tensor(g)).sum()
    total.backward()
    return [t.grad.numpy() for t in (q64, k64, wq64, wk64)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_norm_over_all_heads_gradients_in_torch(rng, device):
    """q, k and both weights get the gradients of the norm over all heads (the weights' in their
    own shape), through the operator's backward."""
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    T, Hq, Hk, D = 6, 4, 2, 64
    positions = rng.integers(0, 512, T)
    cache = cr.cos_sin_cache(512, D, dtype="float32")
    q, k, wq, wk = _inputs(rng, T, Hq, Hk, D, "float32", weight_shape="heads")
    wq = wq.reshape(-1)
    upstream = [rng.standard_normal(q.shape), rng.standard_normal(k.shape)]
    leaves = [torch.tensor(x, device=device, requires_grad=True) for x in (q, k, wq, wk)]
    q_out, k_out = cr.rms_norm_rope(*leaves, torch.tensor(positions, device=device), eps=1e-6,
                                    cos_sin_cache=torch.tensor(cache, device=device),
                                    norm_over="all_heads")
    loss = ((q_out * torch.tensor(upstream[0], device=device, dtype=torch.float32)).sum()
            + (k_out * torch.tensor(upstream[1], device=device, dtype=torch.float32)).sum())
    loss.backward()
    expected = _torch_reference_grads(torch, q, k, wq, wk, positions, cache, upstream)
    for leaf, want, name in zip(leaves, expected, ("q", "k", "q_weight", "k_weight")):
        got = leaf.grad.detach().cpu().double().numpy()
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max(),
                                   err_msg=name)


def test_norm_over_all_heads_gradients_in_jax(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    torch = pytest.importorskip("torch")
    T, Hq, Hk, D = 5, 3, 1, 32
    positions = rng.integers(0, 256, T)
    cache = cr.cos_sin_cache(256, D, dtype="float32")
    q, k, wq, wk = _inputs(rng, T, Hq, Hk, D, "float32")
    upstream = [rng.standard_normal(q.shape), rng.standard_normal(k.shape)]

    def loss(q, k, wq, wk):
        q_out, k_out = cr.rms_norm_rope(q, k, wq, wk, jnp.asarray(positions), eps=1e-6,
                                        cos_sin_cache=jnp.asarray(cache), norm_over="all_heads")
        return (q_out * upstream[0]).sum() + (k_out * upstream[1]).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*(jnp.asarray(x) for x in (q, k, wq, wk)))
    expected = _torch_reference_grads(torch, q, k, wq, wk, positions, cache, upstream)
    for got, want, name in zip(grads, expected, ("q", "k", "q_weight", "k_weight")):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-4,
                                   atol=2e-4 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("T", [1, 300, 70000])
@pytest.mark.parametrize("rotary,lean", [("full", False), ("full", True), ("half", True)])
def test_norm_over_all_heads_takes_one_token_a_block_with_every_head(T, rotary, lean,
                                                                     monkeypatch):
    """The launch, one token a block. Every dim rotated (the lean layout) with the lean all-heads
    kernel switched on (launch.LEAN_ALL_HEADS): that kernel, two NeoX heads a thread row held in
    registers, rows for every q and k head where 256 threads hold them (whole warps), no shared
    memory, a block a token (past a few waves of blocks a persistent grid, every block the same
    number of tokens give or take one). Otherwise,
    and with half the dims rotated either way: the all-heads variant of the general fused kernel
    (no ring), every q, k and v head in the block (gridDim.y = 1), whole warps, the weights of
    every head in shared memory; more than 48 KiB of them for 64 + 64 heads of 128."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.fused_plan import plan_fused
    from cupyrope.cuda import launch

    monkeypatch.setattr(launch, "LEAN_ALL_HEADS", lean)
    for hq, hk, cache in ((32, 8, False), (32, 8, True), (64, 64, False), (5, 3, True),
                          (12, 4, True)):
        D = 128
        rotary_dim = D if rotary == "full" else D // 2
        q, k = np.zeros((T, hq, D), np.float32), np.zeros((T, hk, D), np.float32)
        fusion = dict(norm=True, q_weight=np.ones(hq * D, np.float32),
                      k_weight=np.ones((hk, D), np.float32), eps=1e-6, norm_over="all_heads")
        if cache:
            fusion.update(v=np.zeros((T, hk, D), np.float32),
                          k_cache=np.zeros((T, 1, hk, D), np.float32),
                          v_cache=np.zeros((T, 1, hk, D), np.float32), slot_mapping=np.arange(T))
        rope = dict(cos_sin_cache=np.zeros((70000, rotary_dim), np.float32), inplace=False)
        plan = plan_fused("rope_and_cache" if cache else "rms_norm_rope", q, k, np.arange(T),
                          validate=False, rope=rope, fusion=fusion)
        outputs = [describe(np.zeros(x.shape, np.float32), name)
                   for x, name in ((q, "q_out"), (k, "k_out"))]
        spec = launch.plan_launch(plan, outputs, num_regs=lambda spec: 128, multiprocessors=132,
                                  angle_arithmetic="float64")
        kernel, (x, y, z), (grid_x, grid_y) = spec.kernel, spec.block, spec.grid
        if rotary == "full" and lean:
            assert kernel.fused and kernel.lean and kernel.all_heads and kernel.norm, kernel
            assert kernel.cache == cache and not (kernel.decode or kernel.rows), kernel
            assert "rope_fused_lean_all_heads_kernel<" in kernel.name_expression
            assert x == 16  # float32 NeoX: 64 pairs of 4
            rows = min(-(-(hq + hk) // 2), 256 // x)  # two held heads a row
            assert y == -(-rows // 2) * 2 and z == 1 and (x * y) % 32 == 0
            wave = launch._resident_blocks(x * y, 128) * 132
            if T > launch.LEAN_ALL_HEADS_PERSISTENT_WAVES * wave:  # persistent, tokens spread evenly
                assert grid_x <= wave and -(-T // grid_x) == -(-T // wave), (T, grid_x, wave)
            else:
                assert grid_x == T
            assert grid_y == 1 and spec.shared_bytes == 0
            continue
        assert kernel.fused and kernel.all_heads and not (kernel.lean or kernel.decode), kernel
        assert "rope_fused_all_heads_kernel<" in kernel.name_expression
        # one wave of blocks at most (128 registers: 2 blocks of 256 threads an SM, 132 SMs)
        wave = launch._resident_blocks(x * y, 128) * 132
        assert z == 1 and grid_y == 1 and grid_x == min(T, wave) and (x * y) % 32 == 0
        assert x * y <= 256
        # float32 NeoX: 64 pairs of 4, or with 64 dims rotated 32
        assert x == (16 if rotary == "full" else 8)
        heads = hq + 2 * hk if cache else hq + hk
        assert -(-heads // y) == -(-heads // min(heads, 256 // x))  # heads spread evenly
        assert int(spec.fusion_params["ring"]) == 0
        assert spec.shared_bytes == 4 * ((hq + hk) * D + 64)
        assert int(spec.fusion_params["q_weight_stride"]) == 1


@pytest.mark.parametrize("interleaved,pairs,hq,hk,block", [
    (False, 8, 32, 8, (8, 20, 1)),    # bf16 NeoX heads of 128: two held a row, 20 rows
    (True, 4, 32, 8, (16, 10, 1)),    # bf16 interleaved: four held a row, 10 rows
    (False, 8, 64, 64, (8, 32, 1)),   # 128 heads: 256 threads hold 64, the rest read twice
    (True, 4, 5, 3, (16, 2, 1)),      # 8 heads: two rows, whole warps
    (False, 4, 25, 8, (16, 16, 1)),   # float32 NeoX, 33 heads: 16 rows hold 32, one read twice
])
def test_lean_all_heads_geometry_holds_every_head_and_spreads_tokens(interleaved, pairs, hq, hk,
                                                                     block):
    """lean_all_heads_geometry: rows for every head, LEAN_ALL_HEADS_HELD a row (up to 256
    threads, whole warps); one token a block up to LEAN_ALL_HEADS_PERSISTENT_WAVES waves of
    resident blocks, past that a persistent grid of at most one wave whose blocks take the
    same number of tokens, give or take one."""
    from types import SimpleNamespace

    from cupyrope.cuda import launch

    assert launch.LEAN_ALL_HEADS_HELD == {False: 2, True: 4}
    D = 128
    for T in (1, 300, 2000, 5000, 70001, 1 << 20):
        plan = SimpleNamespace(rotary_dim=D, head_dim=D, interleaved=interleaved,
                               num_q_heads=hq, num_k_heads=hk, num_tokens=T)
        got_block, (grid_x, grid_y) = launch.lean_all_heads_geometry(plan, pairs, 96, 132)
        assert got_block == block and grid_y == 1
        wave = launch._resident_blocks(block[0] * block[1], 96) * 132
        if T <= launch.LEAN_ALL_HEADS_PERSISTENT_WAVES * wave:
            assert grid_x == T
            continue
        assert grid_x <= wave, (T, grid_x, wave)
        per_block = -(-T // grid_x)
        assert per_block == -(-T // wave)  # no more tokens a block than a full wave needs
        assert (per_block - 1) * grid_x < T  # every block has at least per_block - 1


@pytest.mark.parametrize("interleaved,bandwidth,T,held", [
    (False, 3.35e12, 65536, 2),   # H100: two NeoX heads a row at every T
    (False, 4.8e12, 4096, 4),     # H200: four from LEAN_ALL_HEADS_FAST_MEMORY_MIN_TOKENS
    (False, 4.8e12, 4095, 2),     # ... two below it (decode, T = 512: two were faster)
    (False, 0.0, 65536, 2),       # bandwidth unknown: the narrower choice
    (True, 4.8e12, 65536, 4),     # interleaved: four at every T on every GPU
    (True, 3.35e12, 1, 4),
])
def test_lean_all_heads_holds_four_neox_heads_on_fast_memory(interleaved, bandwidth, T, held):
    """launch.lean_all_heads_held, and the launch it makes: the kernel's HELD template argument
    and rows ceil(heads / held), whole warps, for bf16 32 + 8 heads of 128."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.fused_plan import plan_fused
    from cupyrope.cuda import compiler, launch

    hq, hk, D = 32, 8, 128
    q = np.zeros((T, hq, D), ml_dtypes.bfloat16)
    k = np.zeros((T, hk, D), ml_dtypes.bfloat16)
    fusion = dict(norm=True, q_weight=np.ones(hq * D, ml_dtypes.bfloat16),
                  k_weight=np.ones(hk * D, ml_dtypes.bfloat16), eps=1e-6, norm_over="all_heads")
    plan = plan_fused("rms_norm_rope", q, k, np.arange(T), validate=False,
                      rope=dict(cos_sin_cache=np.zeros((70000, D), np.float32), inplace=False,
                                interleaved=interleaved),
                      fusion=fusion)
    assert launch.lean_all_heads_held(plan, bandwidth) == held
    outputs = [describe(np.zeros(x.shape, x.dtype), name) for x, name in ((q, "q_out"),
                                                                          (k, "k_out"))]
    spec = launch.plan_launch(plan, outputs, num_regs=lambda spec: 128, multiprocessors=132,
                              angle_arithmetic="float64", memory_bandwidth=bandwidth)
    assert spec.kernel.lean and spec.kernel.all_heads and spec.kernel.held == held
    assert spec.kernel.name_expression.endswith(f", {held}>")
    assert spec.kernel in compiler.FUSED_SPECIALISATIONS  # compiled ahead (cupyrope compile)
    lanes, rows, one = spec.block
    assert lanes == (16 if interleaved else 8) and one == 1 and (lanes * rows) % 32 == 0
    assert rows == -(-(-(-(hq + hk) // held)) // (32 // lanes)) * (32 // lanes)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"norm_over": "token"}, ValueError, r"norm_over must be one of \('head', 'all_heads'\)"),
    ({"norm_over": None}, ValueError, "norm_over must be one of"),
    ({"q_weight": np.ones(64, np.float32)}, ValueError,
     r"with norm_over='all_heads' q_weight must have shape \(128,\) or \(2, 64\)"),
    ({"k_weight": np.ones((2, 64), np.float32)}, ValueError,
     r"k_weight must have shape \(64,\) or \(1, 64\)"),
    ({"q_weight": np.ones((64, 2), np.float32).T}, ValueError,
     "must be one run of equal steps"),
])
def test_norm_over_all_heads_refusals(rng, kwargs, error, match):
    q = rng.standard_normal((3, 2, 64)).astype(np.float32)
    k = rng.standard_normal((3, 1, 64)).astype(np.float32)
    args = {"q_weight": np.ones(128, np.float32), "k_weight": np.ones(64, np.float32),
            "eps": 1e-6, "norm_over": "all_heads"}
    args.update(kwargs)
    q0 = q.copy()
    with pytest.raises(error, match=match):
        cr.rms_norm_rope(q, k, args.pop("q_weight"), args.pop("k_weight"), np.arange(3),
                         inplace=True, **args)
    np.testing.assert_array_equal(q, q0)


def test_norm_over_without_the_norm_is_refused(rng):
    """rope_and_cache without weights has no norm to say anything about."""
    T, H, D = 3, 2, 64
    q, k, v = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(3))
    kc, vc = np.zeros((4, 2, H, D), np.float32), np.zeros((4, 2, H, D), np.float32)
    with pytest.raises(ValueError, match="norm_over='all_heads' is only used with the norm"):
        cr.rope_and_cache(q, k, v, np.arange(T), kc, vc, np.arange(T), norm_over="all_heads")
    assert not kc.any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_norm_over_all_heads_operator_passes_opcheck(rng, device):
    """The operators' schema, fake (meta) implementation and autograd registration with the norm
    over all heads (torch.compile traces it through them)."""
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from test_fused_torch import op_args

    T, Hq, Hk, D = 4, 3, 1, 16
    q, k, wq, wk = (torch.tensor(x, device=device)
                    for x in _inputs(rng, T, Hq, Hk, D, "float32"))
    rotation = dict(positions=torch.arange(T, device=device),
                    cos_sin_cache=torch.tensor(cr.cos_sin_cache(64, D), device=device))
    op = torch.ops.cupyrope.rms_norm_rope.default
    torch.library.opcheck(op, op_args("rms_norm_rope", q=q, k=k, q_weight=wq, k_weight=wk,
                                      eps=1e-6, norm_over="all_heads", **rotation))
    grads = dict(q=q.clone().requires_grad_(True), k=k.clone().requires_grad_(True),
                 q_weight=wq.clone().requires_grad_(True), k_weight=wk.clone().requires_grad_(True))
    torch.library.opcheck(op, op_args("rms_norm_rope", eps=1e-6, norm_over="all_heads",
                                      **grads, **rotation))
    torch.library.opcheck(torch.ops.cupyrope.rms_norm_rope_.default,
                          op_args("rms_norm_rope_", q=q.clone(), k=k.clone(), q_weight=wq,
                                  k_weight=wk, eps=1e-6, norm_over="all_heads", **rotation))


def test_norm_over_all_heads_leaves_per_row_stores_room_or_refuses():
    """Stores quantised per row keep a row buffer per head row beside the weights of every head:
    with 88 heads of 128 the buffers of a whole warp's head rows still fit the 48 KiB a launch
    takes without opting in; with 92 they do not, and the launch plan refuses (nothing is
    launched) naming what to do instead."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.fused_plan import plan_fused
    from cupyrope.cuda import launch

    T, D = 3, 128
    for heads, fits in ((88, True), (92, False)):
        hq, hk = heads - 8, 8
        q = np.zeros((T, hq, D), ml_dtypes.bfloat16)
        k = np.zeros((T, hk, D), ml_dtypes.bfloat16)
        fusion = dict(norm=True, q_weight=np.ones(hq * D, np.float32),
                      k_weight=np.ones(hk * D, np.float32), eps=1e-6, norm_over="all_heads",
                      out_dtype="float8_e4m3fn", q_scale=np.zeros((T, hq), np.float32),
                      k_scale=np.zeros((T, hk), np.float32))
        plan = plan_fused("rms_norm_rope", q, k, np.arange(T), validate=False,
                          rope=dict(cos_sin_cache=np.zeros((16, D), np.float32), inplace=False),
                          fusion=fusion)
        assert plan.fusion.row_scaled and plan.fusion.all_heads
        outputs = [describe(np.zeros(x.shape, np.uint8), name)
                   for x, name in ((q, "q_out"), (k, "k_out"))]
        plan_it = lambda: launch.plan_launch(plan, outputs, num_regs=lambda spec: 128,  # noqa: E731
                                             multiprocessors=132, angle_arithmetic="float64")
        if fits:
            spec = plan_it()
            x, y, z = spec.block
            assert spec.kernel.all_heads and z == 1 and (x * y) % 32 == 0
            assert spec.shared_bytes <= launch.MAX_SHARED_ANGLE_BYTES
        else:
            with pytest.raises(ValueError, match="too little shared memory for stores quantised "
                                                 "per row"):
                plan_it()
