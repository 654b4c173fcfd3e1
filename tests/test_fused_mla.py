"""DeepSeek MLA layouts through views, against the float64 reference, on every backend.

DeepSeek-V2/V3 heads put the rotary part LAST: q is ``[T, H, 128 + 64]`` (``[T, H, 512 + 64]`` in
the absorbed decode form), rope dims ``[..., nope:]``, and one rotary k head ``k_pe [T, 1, 64]``
is shared by every q head. cupyrope's ``rotary_dim`` rotates the FIRST ``rotary_dim`` dims of a
head, so:

- the rope part is rotated through the view ``q[..., nope:]`` (in place or out of place, plain
  or fp8 outputs), the nope part is never touched;
- a head laid out rope-FIRST (``[rope | nope]``) is rotated and quantised whole in one call with
  ``rotary_dim=64`` (the nope dims are the pass-through dims, quantised with the same scale);
- ``rotary_dim=64`` on the rope-last head rotates the nope dims instead: the test below pins that
  down, so the rope-last layout always goes through the view;
- ``rope_and_cache`` writes rotated ``k_pe`` into a ``[num_blocks, block_size, 1, 64]`` cache, or
  into the last 64 columns of vLLM's MLA cache ``[num_blocks, block_size, 512 + 64]`` through a
  view; the latent ``kv_c`` columns are not written by it (v must have k's shape).

The NumPy, torch CPU and JAX CPU backends run here; CuPy and torch CUDA are marked gpu.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import Backend, backend_params
from reference import reference_rope
from tolerances import assert_bits_equal, assert_rope_close, np_dtype

BACKENDS = backend_params(["numpy", "torch", "jax", "cupy", "torch-cuda", "jax-gpu"])
MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
# (nope, rope): DeepSeek-V3's q head, and the absorbed q of MLA decode.
HEADS = [(128, 64), (512, 64)]
ROPE = 64
MAX_POSITION = 4096
# DeepSeek-V3's rope_scaling (its cos_sin_cache carries YaRN's frequencies and mscale).
DEEPSEEK_V3 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
FP8 = ["float8_e4m3fn", "float8_e5m2"]
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@pytest.fixture(scope="module")
def deepseek_cache() -> np.ndarray:
    return cr.cos_sin_cache(MAX_POSITION, ROPE, theta=10000.0, scaling=DEEPSEEK_V3,
                            dtype="float32")


def host_values(backend: Backend, x) -> np.ndarray:
    """A backend array's values as NumPy, fp8 as ml_dtypes (torch's fp8 dtypes and the uint8
    bits CuPy holds included)."""
    if backend.framework == "torch":
        import torch

        x = x.detach().cpu()
        name = str(x.dtype)[len("torch."):]
        if name in FP8:
            return x.view(torch.uint8).numpy().view(np.dtype(getattr(ml_dtypes, name)))
    return backend.get(x)


def put_fp8(backend: Backend, host: np.ndarray):
    """An fp8 array on the backend: torch's fp8 dtype, CuPy's uint8 bits, else as it is."""
    if backend.framework == "numpy":
        return backend.put(host)
    bits = backend.put(host.view(np.uint8))
    if backend.framework == "torch":
        import torch

        return bits.view(getattr(torch, host.dtype.name))
    return bits


def as_fp8(values: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 bits (CuPy's fp8) reinterpreted as the fp8 format, other arrays as they are."""
    return values.view(np.dtype(getattr(ml_dtypes, fmt))) if values.dtype == np.uint8 else values


def assert_fp8_close(got: np.ndarray, exact: np.ndarray, what: str) -> None:
    """fp8 ``got`` is the exact value rounded once (saturated), give or take the float32 arithmetic
    before the rounding: it lies between the roundings of the exact value moved by 2^-18 of the
    head's largest magnitude, a band far narrower than an fp8 ulp."""
    fmt = got.dtype
    limit = FP8_MAX[fmt.name]
    exact = np.asarray(exact, dtype=np.float64)
    band = 2.0**-18 * (np.abs(exact) + np.abs(exact).max(axis=-1, keepdims=True))
    lo = np.clip(exact - band, -limit, limit).astype(np.float32).astype(fmt).astype(np.float64)
    hi = np.clip(exact + band, -limit, limit).astype(np.float32).astype(fmt).astype(np.float64)
    value = got.astype(np.float64)
    bad = ~((value >= lo) & (value <= hi))
    assert not bad.any(), (f"{what}: {int(bad.sum())} fp8 value(s) off, first at "
                           f"{np.argwhere(bad)[0]}: got {value[bad][0]}, exact {exact[bad][0]}")


def _mla_inputs(randn, rng, nope, dtype, T=19, H=8):
    """q ``[T, H, nope + 64]``, k_pe ``[T, 1, 64]`` and positions, on the host."""
    q = randn((T, H, nope + ROPE), dtype)
    k_pe = randn((T, 1, ROPE), dtype)
    return q, k_pe, rng.integers(0, MAX_POSITION, T)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_part_of_the_q_head_in_place(backend, rng, randn, deepseek_cache, head, dtype,
                                          interleaved):
    nope, _ = head
    q, k_pe, positions = _mla_inputs(randn, rng, nope, dtype)
    qd, kd = backend.put(q), backend.put(k_pe)
    out = cr.apply_rope(qd[..., nope:], kd, backend.put(positions),
                        cos_sin_cache=backend.put(deepseek_cache), interleaved=interleaved,
                        inplace=True)
    assert out[1] is kd
    got = backend.get(qd)
    assert_bits_equal(got[..., :nope], q[..., :nope], what="nope part")
    for x, result in ((q[..., nope:], got[..., nope:]), (k_pe, backend.get(kd))):
        expected = reference_rope(x, positions, cos_sin_cache=deepseek_cache,
                                  interleaved=interleaved)
        assert_rope_close(result, expected, x, interleaved=interleaved, rotary_dim=ROPE)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("head", HEADS)
def test_rope_part_of_the_q_head_out_of_place(backend, rng, randn, deepseek_cache, head):
    nope, _ = head
    q, k_pe, positions = _mla_inputs(randn, rng, nope, "bfloat16")
    qd, kd = backend.put(q), backend.put(k_pe)
    q_out, k_out = cr.apply_rope(qd[..., nope:], kd, backend.put(positions),
                                 cos_sin_cache=backend.put(deepseek_cache), interleaved=True)
    assert_bits_equal(backend.get(qd), q, what="q after an out-of-place call")
    assert_bits_equal(backend.get(kd), k_pe, what="k_pe after an out-of-place call")
    for x, result in ((q[..., nope:], q_out), (k_pe, k_out)):
        got = backend.get(result)
        assert got.shape == x.shape and got.flags.c_contiguous
        expected = reference_rope(x, positions, cos_sin_cache=deepseek_cache, interleaved=True)
        assert_rope_close(got, expected, x, interleaved=True, rotary_dim=ROPE)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("fmt", FP8)
def test_fp8_rope_part_through_the_view(backend, rng, randn, deepseek_cache, fmt):
    """fp8 q_pe / k_pe for fp8 MLA attention: the rope part of each head, quantised."""
    nope = 128
    q, k_pe, positions = _mla_inputs(randn, rng, nope, "bfloat16")
    q_scale, k_scale = 0.5, 4.0
    q8, k8 = cr.apply_rope(backend.put(q)[..., nope:], backend.put(k_pe), backend.put(positions),
                           cos_sin_cache=backend.put(deepseek_cache), interleaved=True,
                           out_dtype=fmt, q_scale=q_scale, k_scale=k_scale)
    for x, out, scale in ((q[..., nope:], q8, q_scale), (k_pe, k8, k_scale)):
        got = as_fp8(host_values(backend, out), fmt)
        assert got.dtype.name == fmt and got.shape == x.shape
        exact = reference_rope(x, positions, cos_sin_cache=deepseek_cache, interleaved=True)
        assert_fp8_close(got, exact / scale, f"{backend} fp8 rope part")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("fmt", FP8)
def test_fp8_whole_head_laid_out_rope_first_in_one_call(backend, rng, randn, deepseek_cache, fmt):
    """``[rope | nope]`` heads: rotary_dim=64 rotates the rope part and the same launch quantises
    the nope part (the pass-through dims) with the same scale."""
    nope = 128
    q, k, positions = _mla_inputs(randn, rng, nope, "bfloat16")
    k = randn((q.shape[0], 1, nope + ROPE), "bfloat16")
    q[0, 0, ROPE] = 1e4  # saturates (e4m3) in the nope part
    q8, k8 = cr.apply_rope(backend.put(q), backend.put(k), backend.put(positions),
                           cos_sin_cache=backend.put(deepseek_cache), rotary_dim=ROPE,
                           out_dtype=fmt, q_scale=2.0, k_scale=0.25)
    for x, out, scale in ((q, q8, 2.0), (k, k8, 0.25)):
        got = as_fp8(host_values(backend, out), fmt)
        assert got.shape == x.shape
        exact = reference_rope(x, positions, cos_sin_cache=deepseek_cache, rotary_dim=ROPE)
        assert_fp8_close(got, exact / scale, f"{backend} rope-first head")
    if fmt == "float8_e4m3fn":
        assert float(as_fp8(host_values(backend, q8), fmt)[0, 0, ROPE]) == 448.0


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
def test_rotary_dim_rotates_the_leading_dims_so_rope_last_needs_the_view(backend, rng, randn,
                                                                         deepseek_cache):
    """On DeepSeek's ``[nope | rope]`` head, rotary_dim=64 would rotate nope dims 0..63 and pass
    the real rope part through: rope-last heads must be given as the view ``q[..., nope:]``."""
    nope = 128
    q, _, positions = _mla_inputs(randn, rng, nope, "float32")
    out = backend.get(cr.apply_rope(backend.put(q), positions=backend.put(positions),
                                    cos_sin_cache=backend.put(deepseek_cache), rotary_dim=ROPE))
    leading = reference_rope(q, positions, cos_sin_cache=deepseek_cache, rotary_dim=ROPE)
    assert_rope_close(out, leading, q, interleaved=False, rotary_dim=ROPE)
    assert_bits_equal(out[..., nope:], q[..., nope:], what="rope part left as it was")


def _slots(rng, T, num_slots):
    slots = rng.permutation(num_slots)[:T].astype(np.int64)
    slots[::4] = -1  # padding tokens write nothing
    return slots


def _k_pe_case(randn, rng, backend, deepseek_cache, cache_dtype, num_slots):
    """q (rope-last heads), k_pe, v, positions, slots; the backend's q view and arguments."""
    nope = 128
    q, k_pe, positions = _mla_inputs(randn, rng, nope, "bfloat16")
    v = randn(k_pe.shape, "bfloat16")
    slots = _slots(rng, q.shape[0], num_slots)
    qd = backend.put(q)
    args = dict(positions=backend.put(positions), slot_mapping=backend.put(slots),
                cos_sin_cache=backend.put(deepseek_cache), interleaved=True)
    if cache_dtype in FP8 and backend.framework == "cupy":
        args["cache_dtype"] = cache_dtype  # CuPy's fp8 caches are uint8 bits
    return q, k_pe, v, positions, slots, qd, args


def _check_rows(rows, slots, exact, fmt, what):
    """The cache rows of the valid slots hold ``exact`` (rounded once to the cache format)."""
    valid = slots >= 0
    got = rows[slots[valid]]
    if fmt in FP8:
        assert_fp8_close(as_fp8(got, fmt), exact[valid], what)
    else:
        scale = np.abs(exact[valid]).max(axis=-1, keepdims=True)
        assert np.all(np.abs(got.astype(np.float64) - exact[valid]) <= scale * 2.0**-7), what


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_k_pe_into_a_paged_cache(backend, rng, randn, deepseek_cache, block_size, cache_dtype):
    num_blocks = 48 // block_size + 1
    q, k_pe, v, positions, slots, qd, args = _k_pe_case(randn, rng, backend, deepseek_cache,
                                                        cache_dtype, num_blocks * block_size)
    shape = (num_blocks, block_size, 1, ROPE)
    poison = np.full(shape, np.nan, np_dtype("bfloat16")).astype(np_dtype(cache_dtype))
    if cache_dtype in FP8:
        kc, vc = put_fp8(backend, poison), put_fp8(backend, poison)
        scales = dict(k_scale=0.5, v_scale=2.0)
    else:
        kc, vc = backend.put(poison), backend.put(poison)
        scales = {}
    cr.rope_and_cache(qd[..., 128:], backend.put(k_pe), backend.put(v), k_cache=kc, v_cache=vc,
                      **args, **scales)
    k_exact = reference_rope(k_pe, positions, cos_sin_cache=deepseek_cache, interleaved=True)
    k_scale, v_scale = scales.get("k_scale", 1.0), scales.get("v_scale", 1.0)
    rows_k = host_values(backend, kc).reshape(-1, 1, ROPE)
    rows_v = host_values(backend, vc).reshape(-1, 1, ROPE)
    _check_rows(rows_k, slots, k_exact / k_scale, cache_dtype, "k_pe rows")
    _check_rows(rows_v, slots, v.astype(np.float64) / v_scale, cache_dtype, "v rows")
    untouched = np.setdiff1d(np.arange(rows_k.shape[0]), slots[slots >= 0])
    for rows in (rows_k, rows_v):  # still the poison
        assert np.isnan(as_fp8(rows[untouched], cache_dtype).astype(np.float32)).all()
    got_q = backend.get(qd)
    assert_bits_equal(got_q[..., :128], q[..., :128], what="nope part of q")
    expected_q = reference_rope(q[..., 128:], positions, cos_sin_cache=deepseek_cache,
                                interleaved=True)
    assert_rope_close(got_q[..., 128:], expected_q, q[..., 128:], interleaved=True,
                      rotary_dim=ROPE)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
def test_k_pe_into_the_rope_columns_of_an_mla_cache(backend, rng, randn, deepseek_cache):
    """vLLM's MLA cache entry is ``[kv_c (512) | k_pe (64)]``: k_cache is the view of its last 64
    columns as ``[num_blocks, block_size, 1, 64]``; the kv_c columns stay as they were."""
    num_blocks, block_size, latent = 4, 16, 512
    q, k_pe, v, positions, slots, qd, args = _k_pe_case(randn, rng, backend, deepseek_cache,
                                                        "bfloat16", num_blocks * block_size)
    mla = np.full((num_blocks, block_size, latent + ROPE), np.nan, np_dtype("bfloat16"))
    mla_cache = backend.put(mla)
    v_cache = backend.put(np.full((num_blocks, block_size, 1, ROPE), np.nan, mla.dtype))
    k_cache = mla_cache[..., latent:][:, :, None, :]
    cr.rope_and_cache(qd[..., 128:], backend.put(k_pe), backend.put(v), k_cache=k_cache,
                      v_cache=v_cache, **args)
    got = backend.get(mla_cache).reshape(-1, latent + ROPE)
    assert np.isnan(got[:, :latent].astype(np.float32)).all(), "kv_c columns were written"
    k_exact = reference_rope(k_pe, positions, cos_sin_cache=deepseek_cache, interleaved=True)
    _check_rows(got[:, None, latent:], slots, k_exact, "bfloat16", "k_pe columns")
    untouched = np.setdiff1d(np.arange(got.shape[0]), slots[slots >= 0])
    assert np.isnan(got[untouched].astype(np.float32)).all()
