"""The staged fused kernel (kernels_cu/fused_staged.cuh: rows moved by bulk copies through
shared-memory stages) against the float64 reference, on a Hopper GPU.

The library takes it for the norm past the fused decode kernel's tokens on Hopper GPUs of fast
memory (the H200: ``launch.fused_staged_applies``). Here any Hopper GPU runs it: the device is
made to report the H200's memory bandwidth and the decode kernel's limit is set to no token, so
that few tokens (one a block, blocks past the tokens) and many (each block's stages reused many
times) both take it. Every case checks which kernel ran, the outputs against the reference (NaN
where a position is outside the cache), the cache rows written at the slots given and nothing
else. The CPU suite covers the choice itself (tests/test_launch_geometry.py) and compiles the
kernels (tests/test_kernel_compile.py)."""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from backends import backend_params, host_values
from reference import reference_rope
from tolerances import np_dtype
from test_fused import _assert_close, _rms_norm64

GPU_BACKENDS = backend_params(["cupy", "torch-cuda"])


@pytest.fixture
def staged(monkeypatch, backend, hopper_fast_memory):
    """The staged kernel for every norm launch of this test, or skip off Hopper GPUs."""
    from cupyrope.cuda import launch

    hopper_fast_memory(launch, "fused kernel")
    monkeypatch.setattr(launch, "FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS", 0)


def _paged(rng, T, Hk, D, dtype, layout, block_size=16):
    """Zeroed k and v caches (NHD or HND) with a shuffled slot mapping, every 7th token padding
    and one slot past the cache (both skipped)."""
    num_blocks = T // block_size + 3
    slots = (rng.permutation(num_blocks)[:, None] * block_size
             + np.arange(block_size)).reshape(-1)[:T].copy()
    slots[::7] = -1
    if T > 3:
        slots[3] = num_blocks * block_size + 5
    shape = ((num_blocks, block_size, Hk, D) if layout == "NHD"
             else (num_blocks, Hk, block_size, D))
    return slots, np.zeros(shape, np_dtype(dtype)), np.zeros(shape, np_dtype(dtype))


def _slot_rows(cache, layout):
    """[num_slots, Hk, D] view of a cache's rows in slot order."""
    c = cache if layout == "NHD" else np.swapaxes(cache, 1, 2)
    return c.reshape(-1, *c.shape[2:])


def _assert_with_nan_rows(got, expected, dtype, what):
    """Close where the reference is finite, NaN (in every rotated dim) where it is not."""
    bad = np.isnan(expected).any(axis=-1)
    assert np.isnan(np.asarray(got, np.float64)[bad]).all(), f"{what}: rows outside the cache"
    _assert_close(np.asarray(got)[~bad], expected[~bad], dtype, what)


@pytest.mark.parametrize("backend", GPU_BACKENDS, indirect=True)
@pytest.mark.parametrize("T", [1, 37, 4001])
@pytest.mark.parametrize("dtype,interleaved,table_dtype", [
    ("bfloat16", False, "float32"), ("float16", False, "float16"),
    ("bfloat16", True, "bfloat16"), ("float16", True, "float32")])
@pytest.mark.parametrize("cache,inplace", [(None, False), ("NHD", True), ("HND", False),
                                           ("NHD", False)])
def test_staged_kernel_matches_the_reference(backend, rng, staged, planned_launches, T, dtype,
                                             interleaved, table_dtype, cache, inplace):
    Hq, Hk, D, max_position = 6, 2, 128, 4096
    positions = rng.integers(0, max_position, T)
    if T > 5:
        positions[5] = max_position + 3  # outside the cache: NaN rows, as every kernel gives
    table = cr.cos_sin_cache(max_position, D, dtype=table_dtype)
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    wq = rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype))
    wk = rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype))
    weight_offset = 1.0 if interleaved else 0.0
    qb, kb = backend.put(q), backend.put(k)
    common = dict(cos_sin_cache=backend.put(table), interleaved=interleaved, eps=1e-6,
                  weight_offset=weight_offset, inplace=inplace)
    if cache is None:
        q_out, k_out = cr.rms_norm_rope(qb, kb, backend.put(wq), backend.put(wk),
                                        backend.put(positions), **common)
    else:
        v = rng.standard_normal((T, Hk, D)).astype(np_dtype(dtype))
        slots, k_host, v_host = _paged(rng, T, Hk, D, dtype, cache)
        k_cache, v_cache = backend.put(k_host), backend.put(v_host)
        q_out, k_out, _, _ = cr.rope_and_cache(
            qb, kb, backend.put(v), backend.put(positions), k_cache, v_cache,
            backend.put(slots), layout=cache, q_weight=backend.put(wq), k_weight=backend.put(wk),
            **common)
    expected = {}
    for x, w, out, name in ((q, wq, q_out, "q"), (k, wk, k_out, "k")):
        expected[name] = reference_rope(_rms_norm64(x, w, 1e-6, weight_offset), positions,
                                        cos_sin_cache=table, interleaved=interleaved)
        got = host_values(backend, out)
        assert got.shape == x.shape
        _assert_with_nan_rows(got, expected[name], dtype, f"{backend} {name}")
    if inplace:
        _assert_with_nan_rows(host_values(backend, qb), expected["q"], dtype, "q in place")
    if cache is not None:
        got_k = _slot_rows(host_values(backend, k_cache), cache)
        got_v = _slot_rows(host_values(backend, v_cache), cache)
        written = (slots >= 0) & (slots < got_k.shape[0])
        _assert_with_nan_rows(got_k[slots[written]], expected["k"][written], dtype, "k cache")
        np.testing.assert_array_equal(got_v[slots[written]], v[written])
        untouched = np.ones(got_k.shape[0], bool)
        untouched[slots[written]] = False
        assert not got_k[untouched].any() and not got_v[untouched].any(), "stray cache write"
    (spec,) = planned_launches
    assert spec.kernel.staged and spec.kernel.cache == (cache is not None), spec.kernel
    assert spec.grid[0] <= T and spec.shared_bytes > 0


@pytest.mark.parametrize("backend", GPU_BACKENDS, indirect=True)
def test_staged_kernel_on_fused_qkv_views_and_other_heads(backend, rng, staged, planned_launches):
    """vLLM's layout (q, k, v views of one [T, (Hq + 2 Hk) D] buffer: token rows apart by the
    whole QKV width), heads of 64 (4 lanes a head, 8 thread rows a warp) and 40 + 8 heads (more
    than a block's thread rows: each row loops over heads)."""
    T, max_position = 3001, 8192
    for Hq, Hk, D in ((40, 8, 64), (12, 4, 256)):
        planned_launches.clear()
        table = cr.cos_sin_cache(max_position, D, dtype="float32")
        positions = rng.integers(0, max_position, T)
        qkv = (rng.standard_normal((T, (Hq + 2 * Hk) * D)) * 2).astype(np_dtype("bfloat16"))
        wq = rng.uniform(0.5, 1.5, D).astype(np_dtype("bfloat16"))
        wk = rng.uniform(0.5, 1.5, D).astype(np_dtype("bfloat16"))
        buf = backend.put(qkv)
        q = buf[:, :Hq * D].reshape(T, Hq, D)
        k = buf[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D)
        v = buf[:, (Hq + Hk) * D:].reshape(T, Hk, D)
        slots, k_host, v_host = _paged(rng, T, Hk, D, "bfloat16", "NHD")
        k_cache, v_cache = backend.put(k_host), backend.put(v_host)
        cr.rope_and_cache(q, k, v, backend.put(positions), k_cache, v_cache, backend.put(slots),
                          cos_sin_cache=backend.put(table), q_weight=backend.put(wq),
                          k_weight=backend.put(wk), eps=1e-6)
        host = host_values(backend, buf)
        parts = qkv.reshape(T, Hq + 2 * Hk, D)
        got = host.reshape(T, Hq + 2 * Hk, D)
        for lo, hi, w, name in ((0, Hq, wq, "q"), (Hq, Hq + Hk, wk, "k")):
            expected = reference_rope(_rms_norm64(parts[:, lo:hi], w, 1e-6, 0.0), positions,
                                      cos_sin_cache=table)
            _assert_close(got[:, lo:hi], expected, "bfloat16", f"{Hq}/{Hk}/{D} {name}")
        np.testing.assert_array_equal(got[:, Hq + Hk:], parts[:, Hq + Hk:])  # v untouched
        got_v = _slot_rows(host_values(backend, v_cache), "NHD")
        written = (slots >= 0) & (slots < got_v.shape[0])
        np.testing.assert_array_equal(got_v[slots[written]], parts[:, Hq + Hk:][written])
        (spec,) = planned_launches
        assert spec.kernel.staged, spec.kernel


def _mrope_component(pair, sections, interleaved):
    """The position component (0 temporal, 1 height, 2 width) of frequency ``pair``, as Hugging
    Face's Qwen2-VL (sectioned) and Qwen3-VL (interleaved) lay them out."""
    s0, s1, s2 = sections
    if not interleaved:
        return 0 if pair < s0 else (1 if pair < s0 + s1 else 2)
    if pair % 3 == 1 and pair < 3 * s1:
        return 1
    if pair % 3 == 2 and pair < 3 * s2:
        return 2
    return 0


def _mrope_tables(table, positions, sections, interleaved):
    """float64 cos / sin [T, half] of each token's pairs, each pair from the cache row of its
    own component's position (NaN where that position is outside the cache)."""
    cache = np.asarray(table, np.float64)
    half = cache.shape[1] // 2
    T = positions.shape[1]
    cos, sin = np.full((T, half), np.nan), np.full((T, half), np.nan)
    for j in range(half):
        pos = positions[_mrope_component(j, sections, interleaved)]
        inside = (pos >= 0) & (pos < cache.shape[0])
        cos[inside, j] = cache[pos[inside], j]
        sin[inside, j] = cache[pos[inside], half + j]
    return cos, sin


def _assert_close_with_nans(got, expected, dtype, what):
    """NaN exactly where the reference is (pairs whose angle row is missing), close elsewhere."""
    got = np.asarray(got, np.float64)
    nan = np.isnan(expected)
    assert np.isnan(got[nan]).all() and not np.isnan(got[~nan]).any(), f"{what}: NaN pattern"
    _assert_close(np.where(nan, 0.0, got), np.where(nan, 0.0, expected), dtype, what)


def _staged_fused_call(backend, rng, op, dtype_name, q, k, positions, table, *,
                       interleaved=False, scaling=None, inplace=False):
    """``op`` ("norm", "cache", "norm+cache") on the GPU of q / k of ``dtype_name``: the outputs,
    the k / v caches with the slots and v (cache ops) and the float64 inputs the rotation sees
    (normalised for norm ops)."""
    T, Hk, D = k.shape
    dtype = np_dtype(dtype_name)
    common = dict(cos_sin_cache=backend.put(table), interleaved=interleaved, inplace=inplace)
    if scaling is not None:
        common["scaling"] = scaling
    weights = {}
    if "norm" in op:
        weights = {"q": rng.uniform(0.5, 1.5, D).astype(dtype),
                   "k": rng.uniform(0.5, 1.5, D).astype(dtype)}
    qb, kb, pb = backend.put(q), backend.put(k), backend.put(positions)
    if op == "norm":
        outs = cr.rms_norm_rope(qb, kb, backend.put(weights["q"]), backend.put(weights["k"]), pb,
                                eps=1e-6, **common)
        caches = None
    else:
        v = rng.standard_normal((T, Hk, D)).astype(dtype)
        slots, k_host, v_host = _paged(rng, T, Hk, D, dtype_name, "NHD")
        k_cache, v_cache = backend.put(k_host), backend.put(v_host)
        norm = ({"q_weight": backend.put(weights["q"]), "k_weight": backend.put(weights["k"]),
                 "eps": 1e-6} if weights else {})
        q_out, k_out, _, _ = cr.rope_and_cache(qb, kb, backend.put(v), pb, k_cache, v_cache,
                                               backend.put(slots), **norm, **common)
        outs = (q_out, k_out)
        caches = (k_cache, v_cache, slots, v)
    inputs = {name: (_rms_norm64(x, weights[name], 1e-6, 0.0) if weights
                     else np.asarray(x, np.float64)) for name, x in (("q", q), ("k", k))}
    return outs, caches, inputs


def _check_caches(backend, caches, expected_k, dtype):
    k_cache, v_cache, slots, v = caches
    got_k = _slot_rows(host_values(backend, k_cache), "NHD")
    got_v = _slot_rows(host_values(backend, v_cache), "NHD")
    written = (slots >= 0) & (slots < got_k.shape[0])
    _assert_close_with_nans(got_k[slots[written]], expected_k[written], dtype, "k cache")
    np.testing.assert_array_equal(got_v[slots[written]], v[written])
    untouched = np.ones(got_k.shape[0], bool)
    untouched[slots[written]] = False
    assert not got_k[untouched].any() and not got_v[untouched].any(), "stray cache write"


def _check_caches_and_kernel(backend, caches, expected_k, dtype, planned_launches, op, kind):
    """The cache rows of a cache op (``caches``: _staged_fused_call's), and that the one launch
    was the staged kernel's ``kind`` ("mrope", "partial") specialisation with ``op``'s fusions."""
    if caches is not None:
        _check_caches(backend, caches, expected_k, dtype)
    (spec,) = planned_launches
    assert spec.kernel.staged and getattr(spec.kernel, kind), spec.kernel
    assert (spec.kernel.norm, spec.kernel.cache) == ("norm" in op, "cache" in op)


@pytest.mark.parametrize("backend", GPU_BACKENDS, indirect=True)
@pytest.mark.parametrize("T", [37, 3001])
@pytest.mark.parametrize("interleaved_mrope", [False, True], ids=["sectioned", "interleaved"])
@pytest.mark.parametrize("dtype,table_dtype", [("bfloat16", "float32"), ("float16", "float16")])
@pytest.mark.parametrize("op", ["norm", "cache", "norm+cache"])
def test_staged_kernel_mrope_matches_the_reference(backend, rng, staged, planned_launches,
                                                   monkeypatch, T, interleaved_mrope, dtype,
                                                   table_dtype, op):
    """Qwen2-VL's sectioned and Qwen3-VL's interleaved M-RoPE through the staged kernel: each
    pair rotated by its own position component's angle (a component outside the cache: NaN in
    its pairs only), with the norm, the cache write or both."""
    from cupyrope.cuda import launch

    monkeypatch.setattr(launch, "STAGED_LAYOUT_MIN_TOKENS", 1)
    Hq, Hk, D, max_position = 6, 2, 128, 4096
    sections = (24, 20, 20) if interleaved_mrope else (16, 24, 24)
    positions = rng.integers(0, max_position, (3, T))
    if T > 5:
        positions[1, 5] = max_position + 3  # the height component outside the cache
    table = cr.cos_sin_cache(max_position, D, dtype=table_dtype)
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    scaling = {"rope_type": "default", "mrope_section": list(sections),
               "mrope_interleaved": interleaved_mrope}
    outs, caches, inputs = _staged_fused_call(backend, rng, op, dtype, q, k, positions, table,
                                              scaling=scaling)
    cos, sin = _mrope_tables(table, positions, sections, interleaved_mrope)
    expected = {}
    for name, out in zip(("q", "k"), outs):
        expected[name] = reference_rope(inputs[name], cos=cos, sin=sin, rotary_dim=D)
        _assert_close_with_nans(host_values(backend, out), expected[name], dtype,
                                f"{backend} {name}")
    _check_caches_and_kernel(backend, caches, expected["k"], dtype, planned_launches, op, "mrope")


@pytest.mark.parametrize("backend", GPU_BACKENDS, indirect=True)
@pytest.mark.parametrize("T", [37, 3001])
@pytest.mark.parametrize("D,rotary_dim,interleaved", [(256, 64, False), (128, 64, False),
                                                      (128, 64, True)])
@pytest.mark.parametrize("op,inplace", [("norm", False), ("norm", True), ("cache", True),
                                        ("cache", False), ("norm+cache", False)])
def test_staged_kernel_partial_rotation_matches_the_reference(backend, rng, staged,
                                                              planned_launches, monkeypatch, T,
                                                              D, rotary_dim, interleaved, op,
                                                              inplace):
    """Partial rotations (Qwen3-Next: 64 of 256 dims, GLM: 64 of 128) through the staged kernel:
    the norm over the whole head, the first rotary_dim dims rotated, the others normalised (or,
    without the norm, kept bit for bit), in place or not, with the cache write."""
    from cupyrope.cuda import launch

    monkeypatch.setattr(launch, "STAGED_LAYOUT_MIN_TOKENS", 1)
    Hq, Hk, max_position, dtype = 6, 2, 4096, "bfloat16"
    positions = rng.integers(0, max_position, T)
    if T > 5:
        positions[5] = max_position + 3  # outside the cache: NaN in the rotated dims only
    table = cr.cos_sin_cache(max_position, rotary_dim, dtype="float32")
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    outs, caches, inputs = _staged_fused_call(backend, rng, op, dtype, q, k, positions, table,
                                              interleaved=interleaved, inplace=inplace)
    expected = {}
    for name, x, out in zip(("q", "k"), (q, k), outs):
        expected[name] = reference_rope(inputs[name], positions, cos_sin_cache=table,
                                        interleaved=interleaved, rotary_dim=rotary_dim)
        got = host_values(backend, out)
        _assert_close_with_nans(got, expected[name], dtype, f"{backend} {name}")
        if "norm" not in op:  # dims past rotary_dim: the input's bits
            np.testing.assert_array_equal(got[..., rotary_dim:].view(np.uint16),
                                          x[..., rotary_dim:].view(np.uint16))
    _check_caches_and_kernel(backend, caches, expected["k"], dtype, planned_launches, op,
                             "partial")


@pytest.mark.parametrize("backend", GPU_BACKENDS, indirect=True)
@pytest.mark.parametrize("T", [1, 37, 3001])
@pytest.mark.parametrize("D,Hq,Hk", [(80, 32, 4), (96, 8, 1), (128, 6, 2)])
@pytest.mark.parametrize("dtype,interleaved,table_dtype", [
    ("bfloat16", False, "float32"), ("float16", True, "float16")])
@pytest.mark.parametrize("inplace", [True, False])
def test_staged_kernel_runs_apply_rope(backend, rng, staged, planned_launches, monkeypatch, T,
                                       D, Hq, Hk, dtype, interleaved, table_dtype, inplace):
    """apply_rope on the staged kernel with neither norm nor cache write (the library takes it
    for in place heads of 5 and 6 lanes, many a token, from PLAIN_STAGED_MIN_TOKENS; here every
    lane and head count, in place or not, from one token): rows in, rotated in shared memory,
    rows out."""
    from cupyrope.cuda import launch

    monkeypatch.setattr(launch, "PLAIN_STAGED_MIN_TOKENS", 1)
    monkeypatch.setattr(launch, "PLAIN_STAGED_LANES", frozenset(range(1, 33)))
    monkeypatch.setattr(launch, "PLAIN_STAGED_MIN_HEADS", 1)
    monkeypatch.setattr(launch, "PLAIN_STAGED_IN_PLACE_ONLY", False)
    monkeypatch.setattr(launch, "DECODE_MAX_TOKENS", 0)  # few tokens: not the decode kernel
    max_position = 4096
    positions = rng.integers(0, max_position, T)
    if T > 5:
        positions[5] = -1  # outside the cache: NaN rows
    table = cr.cos_sin_cache(max_position, D, dtype=table_dtype)
    q = (rng.standard_normal((T, Hq, D)) * 3).astype(np_dtype(dtype))
    k = (rng.standard_normal((T, Hk, D)) * 3).astype(np_dtype(dtype))
    qb, kb = backend.put(q), backend.put(k)
    q_out, k_out = cr.apply_rope(qb, kb, backend.put(positions), cos_sin_cache=backend.put(table),
                                 interleaved=interleaved, inplace=inplace)
    for x, out, name in ((q, q_out, "q"), (k, k_out, "k")):
        expected = reference_rope(x, positions, cos_sin_cache=table, interleaved=interleaved)
        _assert_with_nan_rows(host_values(backend, out), expected, dtype, f"{backend} {name}")
    if inplace:
        expected = reference_rope(q, positions, cos_sin_cache=table, interleaved=interleaved)
        _assert_with_nan_rows(host_values(backend, qb), expected, dtype, "q in place")
    else:
        np.testing.assert_array_equal(host_values(backend, qb), q)  # the input untouched
    (spec,) = planned_launches
    assert spec.kernel.staged and not (spec.kernel.norm or spec.kernel.cache), spec.kernel
