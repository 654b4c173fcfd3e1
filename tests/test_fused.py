"""The fused ops against the float64 reference, on every backend: QK-RMSNorm + RoPE
(``rms_norm_rope``), fp8 outputs (``apply_rope(out_dtype=...)``) and RoPE + KV-cache write
(``rope_and_cache``), plus their refusals. The NumPy path runs in CI; CuPy and torch CUDA run the
fused kernel on the GPU (marked gpu)."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import Backend, angle_source, backend_params, host_values
from reference import reference_rope
from tolerances import np_dtype, unit_roundoff

BACKENDS = backend_params(["numpy", "torch", "jax", "cupy", "torch-cuda", "jax-gpu"])
MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
FP8 = ["float8_e4m3fn", "float8_e5m2"]


def _rms_norm64(x, weight, eps, weight_offset):
    x = np.asarray(x, dtype=np.float64)
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / rms * (weight_offset + np.asarray(weight, dtype=np.float64))


def _assert_close(out, expected64, dtype, what):
    """Within 1 ulp of the output dtype (plus float32 arithmetic) of the exact value, scaled by
    the head's magnitude: the contract of the rotation, for normalised inputs."""
    out = np.asarray(out, dtype=np.float64)
    scale = np.max(np.abs(expected64), axis=-1, keepdims=True) + 1e-30
    bound = scale * (2 * unit_roundoff(dtype) + 64 * 2.0 ** -24)
    err = np.abs(out - expected64)
    assert np.all(err <= bound), (f"{what}: max error {err.max():.3g}, bound {bound.min():.3g} "
                                  f"at {np.unravel_index(np.argmax(err - bound), err.shape)}")


def _shuffled_paged_caches(backend, rng, T, Hk, D, dtype):
    """Zeroed k and v caches of blocks of 16 slots for ``T`` tokens, with their slot mapping:
    the blocks shuffled, every 7th token padding (-1)."""
    block_size, num_blocks = 16, T // 16 + 3
    slots = (rng.permutation(num_blocks)[:, None] * block_size
             + np.arange(block_size)).reshape(-1)[:T].copy()
    slots[::7] = -1  # padding tokens write nothing
    k_cache = backend.put(np.zeros((num_blocks, block_size, Hk, D), np_dtype(dtype)))
    v_cache = backend.put(np.zeros((num_blocks, block_size, Hk, D), np_dtype(dtype)))
    return slots, k_cache, v_cache


def _assert_cache_rows(backend, k_cache, v_cache, slots, expected_k, v, dtype):
    """The k cache holds the expected rows and the v cache v's at the slots written, both zero
    everywhere else."""
    Hk, D = v.shape[1:]
    rows = slots >= 0
    got_k = host_values(backend, k_cache).reshape(-1, Hk, D)
    got_v = host_values(backend, v_cache).reshape(-1, Hk, D)
    _assert_close(got_k[slots[rows]], expected_k[rows], dtype, f"{backend} k cache")
    np.testing.assert_array_equal(got_v[slots[rows]], v[rows])
    unwritten = np.ones(got_v.shape[0], bool)
    unwritten[slots[rows]] = False
    assert not got_k[unwritten].any() and not got_v[unwritten].any()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
@pytest.mark.parametrize("interleaved,rotary_fraction,weight_offset",
                         [(False, 1, 0.0), (True, 1, 1.0), (False, 2, 1.0), (True, 2, 0.0)])
def test_rms_norm_rope_matches_the_reference(backend, rng, dtype, source, interleaved,
                                             rotary_fraction, weight_offset):
    T, Hq, Hk, D = 37, 6, 2, 128
    r = D // rotary_fraction
    positions = rng.integers(0, 4096, T)
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    wq = rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype))
    wk = rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype))
    lib, ref_kw, _ = angle_source(source, (T,), positions, r, interleaved=interleaved)
    put = {name: backend.put(v) if isinstance(v, np.ndarray) else v for name, v in lib.items()}
    q_out, k_out = cr.rms_norm_rope(backend.put(q), backend.put(k), backend.put(wq),
                                    backend.put(wk), eps=1e-6, weight_offset=weight_offset,
                                    interleaved=interleaved, **put)
    for x, w, out, name in ((q, wq, q_out, "q"), (k, wk, k_out, "k")):
        expected = reference_rope(_rms_norm64(x, w, 1e-6, weight_offset),
                                  interleaved=interleaved, **ref_kw)
        got = host_values(backend, out)
        assert got.dtype == np_dtype(dtype) and got.shape == x.shape
        _assert_close(got, expected, dtype, f"{backend} {name}")


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
def test_strided_norm_weights_take_the_general_fused_kernel(backend, rng, launched_kernels):
    """The lean fused kernel reads norm weights 16 bytes at a time; a strided weight view goes
    to the general kernel, with the same results."""
    T, Hq, Hk, D = 9, 4, 2, 128
    positions = rng.integers(0, 4096, T)
    cache = cr.cos_sin_cache(4096, D, dtype="float32")
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np.float32)
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np.float32)
    w2 = rng.uniform(0.5, 1.5, 2 * D).astype(np.float32)
    for weights, lean in ((backend.put(w2)[::2], False), (backend.put(w2[::2].copy()), True)):
        q_out, k_out = cr.rms_norm_rope(backend.put(q), backend.put(k), weights, weights,
                                        backend.put(positions), eps=1e-6,
                                        cos_sin_cache=backend.put(cache))
        assert launched_kernels[-1].lean is lean
        for x, out in ((q, q_out), (k, k_out)):
            expected = reference_rope(_rms_norm64(x, w2[::2], 1e-6, 0.0), positions,
                                      cos_sin_cache=cache)
            _assert_close(host_values(backend, out), expected, "float32", f"lean={lean}")


# The fusions of each kernel specialisation of the lean fused kernel (fused_lean.cuh), with and
# without fp8 stores (a run-time choice in it).
LEAN_CASES = ["norm", "fp8 out", "norm + fp8 out", "cache", "norm + cache", "norm + fp8 cache"]


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("kernel", ["decode", "lean", "general"])
@pytest.mark.parametrize("case", LEAN_CASES)
@pytest.mark.parametrize("dtype,interleaved,source,D", [
    ("bfloat16", False, "cache", 128), ("bfloat16", True, "computed", 96),
    ("float16", False, "tables_half", 96), ("float32", True, "cache", 64),
    ("bfloat16", True, "computed", 128), ("float16", False, "tables_half", 128)])
def test_lean_and_general_fused_kernels(backend, rng, monkeypatch, launched_kernels, kernel, case,
                                        dtype, interleaved, source, D):
    """The common layout runs the fused decode kernel with few tokens (heads of a power-of-two
    number of chunks) and the lean fused kernel with more, each compiled for the fusions of the
    call; the general fused kernel, forced onto the same call, gives results within the same
    bounds. Head sizes of 96 leave lanes without a chunk on the lean kernel (the norm's lanes
    are a power of two) and stay off the decode kernel. The decode kernel reads norm weights of
    q's dtype (the lean kernels take float32 ones here; test_launch_geometry checks that other
    weight dtypes leave the decode kernel)."""
    from cupyrope.cuda import launch
    from cupyrope.core.arrays import cupy_module
    from cupyrope.cuda.compiler import angle_arithmetic

    ran = launched_kernels
    if kernel == "lean":  # the same call counts as many tokens
        monkeypatch.setattr(launch, "fused_decode_max_tokens", lambda plan, bandwidth: 0)
    if kernel == "general":
        monkeypatch.setattr(launch, "fused_lean_applies", lambda *args, **kwargs: False)
    norm, cache = "norm" in case, "cache" in case
    fp8 = "float8_e4m3fn" if "fp8" in case else None
    T, Hq, Hk = 37, 6, 2
    positions = rng.integers(0, 4096, T)
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    v = rng.standard_normal((T, Hk, D)).astype(np_dtype(dtype))
    weight_dtype = np_dtype(dtype) if kernel == "decode" else np.float32
    w = {"q": rng.uniform(0.5, 1.5, D).astype(weight_dtype),
         "k": rng.uniform(0.5, 1.5, D).astype(weight_dtype)}
    lib, ref_kw, _ = angle_source(source, (T,), positions, D, interleaved=interleaved)
    angles = {name: backend.put(x) if isinstance(x, np.ndarray) else x for name, x in lib.items()}
    norm_kw = ({"q_weight": backend.put(w["q"]), "k_weight": backend.put(w["k"]), "eps": 1e-6}
               if norm else {})
    qb, kb = backend.put(q), backend.put(k)
    extra = {"cache_dtype": fp8} if fp8 and backend.framework == "cupy" else {}
    if cache:
        num_blocks, block_size = 5, 16
        slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
        slots[::5] = -1  # padding
        fmt = np.dtype(getattr(ml_dtypes, fp8)) if fp8 else np_dtype(dtype)
        put_cache = functools.partial(_put_fp8, backend) if fp8 else backend.put
        k_cache = put_cache(np.zeros((num_blocks, block_size, Hk, D), fmt))
        v_cache = put_cache(np.zeros((num_blocks, block_size, Hk, D), fmt))
        scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
        q_out, k_out, _, _ = cr.rope_and_cache(
            qb, kb, backend.put(v), angles.pop("positions", None), k_cache, v_cache, backend.put(slots), interleaved=interleaved,
            inplace=False, **angles, **norm_kw, **scales, **extra)
    elif norm:
        q_out, k_out = cr.rms_norm_rope(qb, kb, **norm_kw, interleaved=interleaved, **angles,
                                        out_dtype=fp8, q_scale=0.5 if fp8 else None,
                                        k_scale=0.25 if fp8 else None)
    else:
        q_out, k_out = cr.apply_rope(qb, kb, interleaved=interleaved, **angles, out_dtype=fp8,
                                     q_scale=0.5, k_scale=0.25)
    (spec,) = ran
    pairs = 16 // np.dtype(np_dtype(dtype)).itemsize // (2 if interleaved else 1)
    chunks = D // 2 // pairs
    decodes = kernel == "decode" and chunks & (chunks - 1) == 0 and (
        source != "computed" or angle_arithmetic(cupy_module().cuda.runtime.getDevice())
        == "float64")  # computed angles take a decode kernel with float64 arithmetic only
    assert spec.fused and spec.lean is (kernel != "general") and spec.decode is decodes
    assert (spec.norm, spec.cache) == ((norm, cache) if kernel != "general" else (False, False))

    expected = {name: reference_rope(_rms_norm64(x, w[name], 1e-6, 0.0) if norm else x,
                                     interleaved=interleaved, **ref_kw)
                for name, x in (("q", q), ("k", k))}
    out_scale = {"q": 0.5, "k": 0.25} if fp8 and not cache else {"q": 1.0, "k": 1.0}
    for name, out in (("q", q_out), ("k", k_out)):
        got = host_values(backend, out)
        if out_scale[name] != 1.0:  # fp8: 1 ulp (2^-3 relative) of the value it rounds
            got = got.view(np.dtype(getattr(ml_dtypes, fp8))) if got.dtype == np.uint8 else got
            exact = expected[name] / out_scale[name]
            err = np.abs(got.astype(np.float64) - exact)
            assert np.all(err <= np.abs(exact) * 2.0 ** -3 + 2.0 ** -9), f"{name}: {err.max()}"
        else:
            _assert_close(got, expected[name], dtype, f"{kernel} {case} {name}")
    if cache:
        _check_caches(backend, k_cache, v_cache, slots, expected["k"], v, fmt if fp8 else None,
                      dtype, f"{kernel} {case}")


@pytest.mark.parametrize("backend", backend_params(["numpy", "cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("dtype,interleaved", [("bfloat16", False), ("float16", True),
                                               ("float32", False)])
@pytest.mark.parametrize("inplace,norm", [(False, True), (True, True), (True, False)])
def test_rope_and_cache_many_tokens(backend, rng, planned_launches, dtype, interleaved, inplace,
                                    norm):
    """Many tokens: odd T, heads that do not divide the block; with the norm the lean kernel
    loops over its tokens on a persistent grid (launch.FUSED_LEAN_PERSISTENT_WAVES)."""
    # On a GPU past a wave of resident blocks of up to 16 tokens on 132 SMs.
    T, Hq, Hk, D = 4099 if backend.name == "numpy" else 20011, 5, 3, 128
    launches = planned_launches
    positions = rng.integers(0, 8192, T)
    cache = cr.cos_sin_cache(8192, D, dtype="float32")
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    v = rng.standard_normal((T, Hk, D)).astype(np_dtype(dtype))
    wq = rng.uniform(0.5, 1.5, D).astype(np.float32)
    wk = rng.uniform(0.5, 1.5, D).astype(np.float32)
    slots, k_cache, v_cache = _shuffled_paged_caches(backend, rng, T, Hk, D, dtype)
    qb, kb = backend.put(q), backend.put(k)
    q_out, k_out, _, _ = cr.rope_and_cache(
        qb, kb, backend.put(v), backend.put(positions), k_cache, v_cache, backend.put(slots),
        cos_sin_cache=backend.put(cache), interleaved=interleaved,
        q_weight=backend.put(wq) if norm else None, k_weight=backend.put(wk) if norm else None,
        eps=1e-6 if norm else None, inplace=inplace)
    expected = {}
    for x, w, out, name in ((q, wq, q_out, "q"), (k, wk, k_out, "k")):
        expected[name] = reference_rope(_rms_norm64(x, w, 1e-6, 0.0) if norm else x, positions,
                                        cos_sin_cache=cache, interleaved=interleaved)
        _assert_close(host_values(backend, out), expected[name], dtype, f"{backend} {name}")
    _assert_cache_rows(backend, k_cache, v_cache, slots, expected["k"], v, dtype)
    if backend.name != "numpy":
        (spec,) = launches
        assert spec.kernel.lean and spec.kernel.cache and spec.kernel.norm == norm
        tokens_per_launch = spec.grid[0] * spec.block[2]
        assert (tokens_per_launch < T) == norm, (spec.grid, spec.block)


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("op", ["rms_norm_rope", "rms_norm_rope few", "rope_and_cache",
                                "fp8 out"])
def test_fast_memory_launches_of_many_tokens(backend, rng, monkeypatch, planned_launches, op):
    """On memory of 4 TB/s and more (the H200) many tokens take other launches: the norm up to
    FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS ("few": weights of q's dtype), the cache write up
    to FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS and fp8 outputs at any T the fused decode
    kernel, one block a token; the norm past its limit a persistent grid of the lean kernel.
    Any GPU runs them so here; the values are those of the float64 reference, padding slots
    write nothing."""
    from cupyrope.cuda import launch

    monkeypatch.setattr(launch, "_memory_bandwidth", lambda device: 4.8e12)
    launches = planned_launches
    # Past a wave of resident blocks on 132 SMs; the others below their decode limits.
    T = {"rope_and_cache": 9001, "rms_norm_rope few": 2000}.get(op, 20011)
    Hq, Hk, D, dtype = 5, 3, 128, "bfloat16"
    positions = rng.integers(0, 8192, T)
    cache = cr.cos_sin_cache(8192, D, dtype="float32")
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    args = (backend.put(q), backend.put(k), backend.put(positions))
    if op.startswith("rms_norm_rope"):
        w_dtype = np_dtype(dtype) if op.endswith("few") else np.float32
        wq = rng.uniform(0.5, 1.5, D).astype(w_dtype)
        wk = rng.uniform(0.5, 1.5, D).astype(w_dtype)
        q_out, k_out = cr.rms_norm_rope(args[0], args[1], backend.put(wq), backend.put(wk),
                                        args[2], eps=1e-6, cos_sin_cache=backend.put(cache))
        for x, w, out, name in ((q, wq, q_out, "q"), (k, wk, k_out, "k")):
            expected = reference_rope(_rms_norm64(x, w, 1e-6, 0.0), positions,
                                      cos_sin_cache=cache)
            _assert_close(host_values(backend, out), expected, dtype, f"{backend} {name}")
    elif op == "rope_and_cache":
        v = rng.standard_normal((T, Hk, D)).astype(np_dtype(dtype))
        slots, k_cache, v_cache = _shuffled_paged_caches(backend, rng, T, Hk, D, dtype)
        q_out, k_out, _, _ = cr.rope_and_cache(*args[:2], backend.put(v), args[2], k_cache,
                                               v_cache, backend.put(slots),
                                               cos_sin_cache=backend.put(cache))
        expected_k = reference_rope(k, positions, cos_sin_cache=cache)
        _assert_close(host_values(backend, q_out), reference_rope(q, positions,
                                                                  cos_sin_cache=cache),
                      dtype, f"{backend} q")
        _assert_close(host_values(backend, k_out), expected_k, dtype, f"{backend} k")
        _assert_cache_rows(backend, k_cache, v_cache, slots, expected_k, v, dtype)
    else:
        fmt = np.dtype(ml_dtypes.float8_e4m3fn)
        q_out, k_out = cr.apply_rope(*args, cos_sin_cache=backend.put(cache),
                                     out_dtype="float8_e4m3fn", q_scale=0.5, k_scale=2.0)
        for x, out, scale in ((q, q_out, 0.5), (k, k_out, 2.0)):
            got = host_values(backend, out)
            got = got.view(fmt) if got.dtype == np.uint8 else got
            exact = reference_rope(x, positions, cos_sin_cache=cache) / scale
            err = np.abs(got.astype(np.float64) - exact)  # 1 fp8 ulp of the value it rounds
            assert np.all(err <= np.abs(exact) * 2.0 ** -3 + 2.0 ** -9), f"{op}: {err.max()}"
    (spec,) = launches
    kernel = spec.kernel
    if op == "rms_norm_rope":
        assert kernel.lean and kernel.norm and not kernel.decode
        assert spec.grid[0] * spec.block[2] < T, (spec.grid, spec.block)  # persistent
    else:
        assert kernel.decode and kernel.fused and spec.grid[0] == T, (kernel, spec.grid)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
def test_rms_norm_rope_in_place_on_fused_qkv_views(backend, rng):
    """vLLM's layout: q and k are views of one [T, (Hq + 2 Hk) D] buffer; v is never touched."""
    T, Hq, Hk, D = 9, 4, 2, 64
    qkv = rng.standard_normal((T, (Hq + 2 * Hk) * D)).astype(np_dtype("bfloat16"))
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    cache = cr.cos_sin_cache(256, D, dtype="float32")
    positions = rng.integers(0, 256, T)
    buf = backend.put(qkv)
    q = buf[:, :Hq * D].reshape(T, Hq, D)
    k = buf[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D)
    cr.rms_norm_rope(q, k, backend.put(w), backend.put(w), backend.put(positions), eps=1e-6,
                     cos_sin_cache=backend.put(cache), inplace=True)
    got = host_values(backend, buf)
    np.testing.assert_array_equal(got[:, (Hq + Hk) * D:], qkv[:, (Hq + Hk) * D:])
    for lo, heads in ((0, Hq), (Hq * D, Hk)):
        x = qkv[:, lo:lo + heads * D].reshape(T, heads, D)
        expected = reference_rope(_rms_norm64(x, w, 1e-6, 0.0), positions,
                                  cos_sin_cache=cache)
        _assert_close(got[:, lo:lo + heads * D].reshape(T, heads, D), expected, "bfloat16",
                      "fused qkv")


def test_rms_norm_rope_matches_transformers_qwen3():
    """Qwen3's q_norm / k_norm then apply_rotary_pos_emb: float32 to a few float32 ulps, bfloat16
    (where transformers rounds after the norm, the weight and each rotation term) within 2 ulps."""
    torch = pytest.importorskip("torch")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    T, Hq, Hk, D = 16, 8, 2, 128
    g = torch.Generator().manual_seed(3)
    for dtype, ulps in ((torch.float32, None), (torch.bfloat16, 2)):
        q = torch.randn(1, T, Hq, D, generator=g).to(dtype)
        k = torch.randn(1, T, Hk, D, generator=g).to(dtype)
        q_norm, k_norm = qwen3.Qwen3RMSNorm(D, eps=1e-6), qwen3.Qwen3RMSNorm(D, eps=1e-6)
        with torch.no_grad():
            q_norm.weight.uniform_(0.5, 1.5, generator=g)
            k_norm.weight.uniform_(0.5, 1.5, generator=g)
        q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
        positions = torch.arange(T)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        angles = positions[:, None].double() * inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)
        with torch.no_grad():
            hq = q_norm(q).transpose(1, 2)
            hk = k_norm(k).transpose(1, 2)
            want_q, want_k = qwen3.apply_rotary_pos_emb(hq, hk, cos, sin)
            got_q, got_k = cr.rms_norm_rope(q, k, q_norm.weight, k_norm.weight, eps=1e-6,
                                            cos=cos, sin=sin)
        for got, want in ((got_q, want_q.transpose(1, 2)), (got_k, want_k.transpose(1, 2))):
            diff = (got.double() - want.double()).abs()
            magnitude = want.double().abs().amax(dim=-1, keepdim=True)
            if ulps is None:
                assert torch.all(diff <= magnitude * 64 * 2.0 ** -24)
            else:
                assert torch.all(diff <= magnitude * ulps * 2.0 ** -7)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_outputs_round_the_exact_value_once(backend, rng, fp8):
    if backend.framework == "jax" and backend.on_gpu is False:
        pass
    T, Hq, Hk, D = 23, 4, 1, 96
    q = rng.standard_normal((T, Hq, D)).astype(np.float32) * 4
    k = rng.standard_normal((T, Hk, D)).astype(np.float32) * 4
    positions = rng.integers(0, 1000, T)
    q_out, k_out = cr.apply_rope(backend.put(q), backend.put(k), backend.put(positions),
                                 rotary_dim=64, out_dtype=fp8, q_scale=0.25, k_scale=2.0)
    fmt = np.dtype(getattr(ml_dtypes, fp8))
    for x, out, scale in ((q, q_out, 0.25), (k, k_out, 2.0)):
        got = host_values(backend, out)
        if got.dtype == np.uint8:  # CuPy: the bits
            got = got.view(fmt)
        assert got.dtype == fmt and got.shape == x.shape
        exact = reference_rope(x, positions, rotary_dim=64) / scale
        # One rounding of a float32 value within a few float32 ulps of the exact one: the
        # neighbours of the correctly rounded fp8 value at most.
        lo = np.nextafter(exact.astype(np.float32), -np.inf).astype(fmt).astype(np.float64)
        hi = np.nextafter(exact.astype(np.float32), np.inf).astype(fmt).astype(np.float64)
        value = got.astype(np.float64)
        assert np.all((value >= np.minimum(lo, hi)) & (value <= np.maximum(lo, hi)))


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_saturates_instead_of_overflowing(backend, fp8):
    q = np.full((2, 1, 8), 1e6, np.float32)
    q[1] = -1e6
    out = host_values(backend, cr.apply_rope(backend.put(q), positions=backend.put(np.zeros(2, np.int64)),
                                       out_dtype=fp8))
    fmt = np.dtype(getattr(ml_dtypes, fp8))
    values = out.view(fmt).astype(np.float64) if out.dtype == np.uint8 else out.astype(np.float64)
    limit = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fp8]
    assert np.all(values[0] == limit) and np.all(values[1] == -limit)


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fused_decode_kernel_splits_many_heads_over_blocks(backend, rng, launched_kernels, layout):
    """64 q, 8 k and 8 v heads of 8 lanes are 640 threads a token: the fused decode kernel splits
    them over blocks (some threads without a head), q's, k's and v's heads in any block; every
    row is normalised, rotated and written where it belongs, padding slots write nothing."""
    T, Hq, Hk, D, block_size, num_blocks = 3, 64, 8, 128, 4, 2
    positions = rng.integers(0, 4096, T)
    cache = cr.cos_sin_cache(4096, D, dtype="float32")
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(ml_dtypes.bfloat16)
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((T, Hk, D)).astype(ml_dtypes.bfloat16)
    w = {"q": rng.uniform(0.5, 1.5, D).astype(ml_dtypes.bfloat16),
         "k": rng.uniform(0.5, 1.5, D).astype(ml_dtypes.bfloat16)}
    slots = np.array([5, -1, 2])
    shape = ((num_blocks, block_size, Hk, D) if layout == "NHD"
             else (num_blocks, Hk, block_size, D))
    k_cache = backend.put(np.zeros(shape, ml_dtypes.bfloat16))
    v_cache = backend.put(np.zeros(shape, ml_dtypes.bfloat16))
    q_out, k_out, _, _ = cr.rope_and_cache(
        backend.put(q), backend.put(k), backend.put(v), backend.put(positions), k_cache, v_cache,
        backend.put(slots), cos_sin_cache=backend.put(cache), q_weight=backend.put(w["q"]),
        k_weight=backend.put(w["k"]), eps=1e-6, layout=layout, inplace=False)
    (spec,) = launched_kernels
    assert spec.fused and spec.decode and spec.norm and spec.cache, spec.name_expression
    expected = {name: reference_rope(_rms_norm64(x, w[name].astype(np.float64), 1e-6, 0.0),
                                     positions, cos_sin_cache=cache)
                for name, x in (("q", q), ("k", k))}
    _assert_close(host_values(backend, q_out), expected["q"], "bfloat16", "q")
    _assert_close(host_values(backend, k_out), expected["k"], "bfloat16", "k")
    got_k, got_v = (host_values(backend, c).astype(np.float32) for c in (k_cache, v_cache))
    if layout == "HND":
        got_k, got_v = (c.transpose(0, 2, 1, 3) for c in (got_k, got_v))
    got_k, got_v = (c.reshape(-1, Hk, D) for c in (got_k, got_v))
    for t, slot in enumerate(slots):
        if slot >= 0:
            _assert_close(got_k[slot], expected["k"][t], "bfloat16", f"k cache slot {slot}")
            np.testing.assert_array_equal(got_v[slot], v[t].astype(np.float32))
    written = [s for s in slots if s >= 0]
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), written)
    assert not got_k[untouched].any() and not got_v[untouched].any()


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("case", ["norm", "fp8 out", "cache", "norm + fp8 cache"])
@pytest.mark.parametrize("dtype,interleaved,D,r", [
    ("bfloat16", False, 256, 64), ("float16", False, 128, 64), ("bfloat16", True, 128, 96),
    ("float32", True, 64, 32)])
@pytest.mark.parametrize("inplace", [False, True])
def test_partial_rotation_on_the_lean_fused_kernel(backend, rng, launched_kernels, case, dtype,
                                                   interleaved, D, r, inplace):
    """rotary_dim < head_dim (Qwen3-Next's 64 of 256, GLM's 64 of 128; interleaved 96 of 128)
    runs the lean fused kernel's partial specialisations: lanes past the rotated chunks
    normalise and store the other dims, copy them into the k cache, and leave them exactly as
    they are without a norm (an infinity there stays one)."""
    norm, cache = "norm" in case, "cache" in case
    fp8 = "float8_e4m3fn" if "fp8" in case else None
    if fp8 and inplace and not cache:
        pytest.skip("fp8 outputs are new arrays")
    T, Hq, Hk = 300, 6, 2
    positions = rng.integers(0, 4096, T)
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    if not norm:  # dims past rotary_dim are copied bit for bit
        q[1, 2, r + 1], k[3, 1, D - 1] = np.inf, -np.inf
    v = rng.standard_normal((T, Hk, D)).astype(np_dtype(dtype))
    w = {"q": rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype)),
         "k": rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype))}
    table = cr.cos_sin_cache(4096, r, dtype="float32")
    angles = dict(cos_sin_cache=backend.put(table), interleaved=interleaved)
    norm_kw = ({"q_weight": backend.put(w["q"]), "k_weight": backend.put(w["k"]), "eps": 1e-6}
               if norm else {})
    qb, kb = backend.put(q), backend.put(k)
    if cache:
        num_blocks, block_size = 40, 16
        slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
        slots[::7] = -1
        fmt = np.dtype(getattr(ml_dtypes, fp8)) if fp8 else np_dtype(dtype)
        put_cache = functools.partial(_put_fp8, backend) if fp8 else backend.put
        k_cache = put_cache(np.zeros((num_blocks, block_size, Hk, D), fmt))
        v_cache = put_cache(np.zeros((num_blocks, block_size, Hk, D), fmt))
        scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
        extra = {"cache_dtype": fp8} if fp8 and backend.framework == "cupy" else {}
        q_out, k_out, _, _ = cr.rope_and_cache(
            qb, kb, backend.put(v), backend.put(positions), k_cache, v_cache, backend.put(slots),
            inplace=inplace, **angles, **norm_kw, **scales, **extra)
    elif norm:
        q_out, k_out = cr.rms_norm_rope(qb, kb, **norm_kw, positions=backend.put(positions),
                                        inplace=inplace, **angles)
    else:
        q_out, k_out = cr.apply_rope(qb, kb, backend.put(positions), **angles, out_dtype=fp8,
                                     q_scale=0.5, k_scale=0.25)
    (spec,) = launched_kernels
    assert spec.fused and spec.lean and spec.partial and not spec.decode, spec.name_expression
    expected = {name: reference_rope(_rms_norm64(x, w[name], 1e-6, 0.0) if norm else x,
                                     positions, cos_sin_cache=table, interleaved=interleaved,
                                     rotary_dim=r)
                for name, x in (("q", q), ("k", k))}
    for name, out, x in (("q", q_out, q), ("k", k_out, k)):
        got = host_values(backend, out)
        if fp8 and not cache:
            got = got.view(np.dtype(getattr(ml_dtypes, fp8))) if got.dtype == np.uint8 else got
            exact = expected[name] / {"q": 0.5, "k": 0.25}[name]
            err = np.abs(got.astype(np.float64) - exact)
            assert np.all(err <= np.abs(exact) * 2.0 ** -3 + 2.0 ** -9), f"{name}: {err.max()}"
            continue
        finite = np.isfinite(x) if not norm else np.ones(x.shape, bool)
        assert np.array_equal(got[~finite], x[~finite])  # the infinities, untouched
        rows = np.all(finite, axis=-1)  # heads without one, against the reference
        _assert_close(got[rows], expected[name][rows], dtype, f"{case} {name}")
        if not norm:  # dims past rotary_dim: the input's bits
            assert np.array_equal(got[..., r:], x[..., r:])
    if cache:
        got_k = _check_caches(backend, k_cache, v_cache, slots, expected["k"], v,
                              fmt if fp8 else None, dtype, case, rows_of=k)
        if not fp8:  # dims past rotary_dim: the input's bits
            assert np.array_equal(got_k[..., r:], k[slots >= 0][..., r:])


def _check_caches(backend: Backend, k_cache, v_cache, slots, expected_k, v, fp8_format, dtype,
                  what, rows_of=None):
    """The k and v cache rows of the valid slots: k against the float64 reference (heads of
    ``rows_of`` with an infinity left out), v bit for bit, or both within an fp8 ulp of the
    exact value over their scales (k 0.5, v 2.0). Returns the k rows."""
    valid = slots >= 0
    heads, dim = v.shape[-2:]
    got_k = host_values(backend, k_cache).reshape(-1, heads, dim)[slots[valid]]
    got_v = host_values(backend, v_cache).reshape(-1, heads, dim)[slots[valid]]
    if fp8_format is not None:
        got_k = got_k.view(fp8_format) if got_k.dtype == np.uint8 else got_k
        got_v = got_v.view(fp8_format) if got_v.dtype == np.uint8 else got_v
        for got, exact in ((got_k, expected_k[valid] / 0.5), (got_v, v[valid] / 2.0)):
            err = np.abs(got.astype(np.float64) - exact)
            assert np.all(err <= np.abs(exact) * 2.0 ** -3 + 2.0 ** -9), err.max()
        return got_k
    rows = (np.all(np.isfinite(rows_of[valid]), axis=-1) if rows_of is not None
            else np.ones(got_k.shape[:-1], bool))
    _assert_close(got_k[rows], expected_k[valid][rows], dtype, f"{what} k cache")
    np.testing.assert_array_equal(got_v, v[valid])
    return got_k


def _put_fp8(backend: Backend, host: np.ndarray):
    """An fp8 array on the backend: torch's own fp8 dtype, CuPy's uint8 bits, else as is."""
    if backend.framework == "torch":
        import torch

        bits = backend.put(host.view(np.uint8))
        return bits.view(getattr(torch, host.dtype.name))
    if backend.framework == "cupy":
        return backend.put(host.view(np.uint8))
    return backend.put(host)


def _cache_case(rng, *, T=29, Hq=4, Hk=2, D=64, num_blocks=8, block_size=4, layout="NHD"):
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((T, Hk, D)).astype(np.float32)
    v = rng.standard_normal((T, Hk, D)).astype(np.float32)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[::5] = -1  # padding
    shape = ((num_blocks, block_size, Hk, D) if layout == "NHD" else (num_blocks, Hk, block_size, D))
    return q, k, v, slots, shape


def _cache_rows(cache, layout):
    """[slot, head, D] view of a cache."""
    if layout == "HND":
        cache = np.swapaxes(cache, 1, 2)
    return cache.reshape(-1, *cache.shape[2:])


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rope_and_cache_writes_rotated_k_and_v(backend, rng, layout, block_size, dtype):
    q, k, v, slots, shape = _cache_case(rng, layout=layout, block_size=block_size,
                                        num_blocks=64 // block_size + 2)
    dt = np_dtype(dtype)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    positions = rng.integers(0, 512, len(q))
    cache = cr.cos_sin_cache(512, 64, dtype="float32")
    kc0 = np.full(shape, 7, dt)
    kc, vc = backend.put(kc0), backend.put(kc0)
    qd, kd = backend.put(q), backend.put(k)
    q_out, k_out, kc_out, vc_out = cr.rope_and_cache(
        qd, kd, backend.put(v), backend.put(positions), kc, vc, backend.put(slots),
        cos_sin_cache=backend.put(cache), layout=layout)
    assert q_out is qd and k_out is kd and kc_out is kc and vc_out is vc
    k_rot = reference_rope(k, positions, cos_sin_cache=cache)
    _assert_close(host_values(backend, q_out), reference_rope(q, positions, cos_sin_cache=cache), dtype,
                  "q")
    rows_k, rows_v = _cache_rows(host_values(backend, kc), layout), _cache_rows(host_values(backend, vc), layout)
    valid = slots >= 0
    _assert_close(rows_k[slots[valid]], k_rot[valid], dtype, "k cache")
    np.testing.assert_array_equal(rows_v[slots[valid]], v[valid])
    untouched = np.setdiff1d(np.arange(rows_k.shape[0]), slots[valid])
    assert np.all(rows_k[untouched].astype(np.float32) == 7)
    assert np.all(rows_v[untouched].astype(np.float32) == 7)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
def test_rope_and_cache_fp8_with_norm_in_one_call(backend, rng, fp8):
    """QK-norm + RoPE + fp8 cache write, caches as two views of one [blocks, 2, ...] buffer."""
    q, k, v, slots, _ = _cache_case(rng, num_blocks=8, block_size=4)
    D = q.shape[-1]
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    positions = rng.integers(0, 256, len(q))
    fmt = np.dtype(getattr(ml_dtypes, fp8))
    combined = np.zeros((8, 2, 4, 2, D), fmt)
    buf = _put_fp8(backend, combined)
    extra = {"cache_dtype": fp8} if backend.framework == "cupy" else {}
    q_out, k_out, _, _ = cr.rope_and_cache(
        backend.put(q), backend.put(k), backend.put(v), backend.put(positions), buf[:, 0],
        buf[:, 1], backend.put(slots), theta=1e6, k_scale=0.5, v_scale=2.0, q_weight=backend.put(w),
        k_weight=backend.put(w), eps=1e-6, inplace=False, **extra)
    host = host_values(backend, buf)
    host = host.view(fmt) if host.dtype == np.uint8 else host
    valid = slots >= 0
    k_exact = reference_rope(_rms_norm64(k, w, 1e-6, 0.0), positions, theta=1e6) / 0.5
    v_exact = v.astype(np.float64) / 2.0
    for rows, exact in ((host[:, 0].reshape(-1, 2, D), k_exact), (host[:, 1].reshape(-1, 2, D),
                                                                  v_exact)):
        got = rows[slots[valid]].astype(np.float64)
        lo = np.nextafter(exact[valid].astype(np.float32), -np.inf).astype(fmt).astype(np.float64)
        hi = np.nextafter(exact[valid].astype(np.float32), np.inf).astype(fmt).astype(np.float64)
        assert np.all((got >= np.minimum(lo, hi)) & (got <= np.maximum(lo, hi)))
    _assert_close(host_values(backend, k_out),
                  reference_rope(_rms_norm64(k, w, 1e-6, 0.0), positions, theta=1e6), "float32",
                  "k_out")


def test_slots_past_the_cache_are_skipped_or_refused(rng):
    q, k, v, slots, shape = _cache_case(rng, T=12, num_blocks=4, block_size=4)
    slots[1] = 1000
    kc, vc = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    with pytest.raises(IndexError, match="slot_mapping holds 1 slot"):
        cr.rope_and_cache(q.copy(), k.copy(), v, None, kc, vc, slots, validate=True)
    assert not kc.any() and not vc.any()
    cr.rope_and_cache(q.copy(), k.copy(), v, None, kc, vc, slots)
    assert kc.any()


@pytest.mark.parametrize("case,error,match", [
    ("cache_heads", ValueError, "does not hold 2 heads"),
    ("cache_dtype", TypeError, "caches must have q's dtype"),
    ("v_tokens", ValueError, "v must have k's shape"),
    ("slot_shape", ValueError, "slot_mapping must have shape"),
    ("slot_dtype", TypeError, "slot_mapping must be int32 or int64"),
    ("scale_shape", ValueError, "k_scale must be a number or a 0-d"),
    ("layout", ValueError, "layout must be one of"),
    ("overlap", ValueError, "k_cache shares memory with v_cache"),
    ("uint8", TypeError, "uint8 caches hold fp8 bits"),
    ("blocks", ValueError, "same blocks and block size"),
    ("k_scale_unused", ValueError, "k_scale is only used with an fp8 out_dtype or an fp8 cache"),
    ("v_scale_unused", ValueError, "v_scale is only used with an fp8 cache"),
])
def test_rope_and_cache_refusals_write_nothing(rng, case, error, match):
    q, k, v, slots, shape = _cache_case(rng)
    kc, vc = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    kw = {}
    if case == "cache_heads":
        kc = vc = None
        kc, vc = np.zeros(shape[:2] + (3, 64), np.float32), np.zeros(shape[:2] + (3, 64), np.float32)
    elif case == "cache_dtype":
        kc, vc = kc.astype(np.float16), vc.astype(np.float16)
    elif case == "v_tokens":
        v = v[:-1]
    elif case == "slot_shape":
        slots = slots[:-1]
    elif case == "slot_dtype":
        slots = slots.astype(np.float32)
    elif case == "scale_shape":
        kw["k_scale"] = np.ones(2, np.float32)
        kc, vc = kc.astype(ml_dtypes.float8_e4m3fn), vc.astype(ml_dtypes.float8_e4m3fn)
    elif case == "layout":
        kw["layout"] = "NDH"
    elif case == "overlap":
        vc = kc
    elif case == "uint8":
        kc, vc = kc.astype(np.uint8), vc.astype(np.uint8)
    elif case == "blocks":
        vc = vc[:-1]
    elif case in ("k_scale_unused", "v_scale_unused"):  # a scale the 16/32-bit caches would ignore
        kw[case[:7]] = 2.0
    q0, k0 = q.copy(), k.copy()
    before = kc.copy(), vc.copy()
    with pytest.raises(error, match=match):
        cr.rope_and_cache(q, k, v, None, kc, vc, slots, **kw)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(kc, before[0])


@pytest.mark.parametrize("kwargs,error,match", [
    ({"eps": None}, TypeError, "eps is required"),
    ({"eps": "1e-6"}, TypeError, "eps must be a number"),
    ({"q_weight": np.ones(32, np.float32)}, ValueError, r"q_weight must have shape \(64,\)"),
    ({"q_weight": np.ones(64, np.float64)}, TypeError, "q_weight must be one of"),
    ({"k_weight": np.ones(64, np.float16)}, TypeError, "one dtype"),
    ({"out_dtype": "int8"}, ValueError, "out_dtype must be None or one of"),
    ({"out_dtype": "float8_e4m3fn", "inplace": True}, ValueError, "pass inplace=False"),
    ({"q_scale": 0.5}, ValueError, "q_scale is only used with an fp8 out_dtype"),
])
def test_rms_norm_rope_refusals(rng, kwargs, error, match):
    q = rng.standard_normal((3, 2, 64)).astype(np.float32)
    k = rng.standard_normal((3, 1, 64)).astype(np.float32)
    args = {"q_weight": np.ones(64, np.float32), "k_weight": np.ones(64, np.float32), "eps": 1e-6}
    args.update(kwargs)
    q0 = q.copy()
    with pytest.raises(error, match=match):
        cr.rms_norm_rope(q, k, args.pop("q_weight"), args.pop("k_weight"), np.arange(3), **args)
    np.testing.assert_array_equal(q, q0)


def test_fused_ops_refuse_float64_and_autograd(rng):
    """float64 is refused on every route (the array path, and the operators that tensors
    requiring grad take); gradients exist for rms_norm_rope (tests/test_fused_torch.py) but not
    for fp8 outputs, which refuse with what to do instead, before writing anything."""
    q = rng.standard_normal((3, 2, 64))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32 for the fused ops"):
        cr.rms_norm_rope(q, None, np.ones(64, np.float32), None, eps=1e-6)
    torch = pytest.importorskip("torch")
    t = torch.randn(3, 2, 64, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32 for the fused ops"):
        cr.rms_norm_rope(t, None, torch.ones(64), None, eps=1e-6)
    t = torch.randn(3, 2, 64, requires_grad=True)
    assert cr.rms_norm_rope(t, None, torch.ones(64), None, eps=1e-6).requires_grad
    with pytest.raises(NotImplementedError,
                       match=r"rms_norm_rope: no gradient for fp8 outputs \(out_dtype="
                             r"'float8_e4m3fn'\), but q requires grad; call it under "
                             r"torch.no_grad\(\)"):
        cr.rms_norm_rope(t, None, torch.ones(64), None, eps=1e-6, out_dtype="float8_e4m3fn")
