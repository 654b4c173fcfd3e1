"""cupyrope.write_cache: k and v into a paged KV cache without any rotation (vLLM's
reshape_and_cache_flash), in one launch: bit-exact copies into caches of k's dtype (inf, NaN
payloads and -0.0 included), fp8 stores of value / scale, padding slots skipped, bad input refused
before anything is written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import Backend, backend_params, host_values
from tolerances import np_dtype

MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
GPU = backend_params(["cupy", "torch-cuda"])
FP8 = ["float8_e4m3fn", "float8_e5m2"]
# Bit patterns of special values: +inf, -inf, a quiet NaN with a payload, a negative NaN, -0.0.
SPECIAL_BITS = {
    "bfloat16": (np.uint16, [0x7F80, 0xFF80, 0x7FC1, 0xFFC0, 0x8000]),
    "float16": (np.uint16, [0x7C00, 0xFC00, 0x7E01, 0xFE00, 0x8000]),
    "float32": (np.uint32, [0x7F800000, 0xFF800000, 0x7FC00001, 0xFFC00000, 0x80000000]),
}


def _put_fp8(backend: Backend, host: np.ndarray):
    """An fp8 array on the backend: torch's own fp8 dtype, CuPy's uint8 bits, else as is."""
    if backend.framework == "torch":
        import torch

        return backend.put(host.view(np.uint8)).view(getattr(torch, host.dtype.name))
    if backend.framework == "cupy":
        return backend.put(host.view(np.uint8))
    return backend.put(host)


def _rows(cache: np.ndarray, layout: str) -> np.ndarray:
    """[slot, head, D] view of a cache."""
    if layout == "HND":
        cache = np.swapaxes(cache, 1, 2)
    return cache.reshape(-1, *cache.shape[2:])


def _with_specials(x: np.ndarray, dtype: str, rng) -> np.ndarray:
    """``x`` with inf, NaN (payloads included) and -0.0 scattered over it, the first dims of a
    head (the pair a rotation would mix) included."""
    bits_type, bits = SPECIAL_BITS[dtype]
    # Written through a view of x's own memory: x is a strided view of the projection, where
    # reshape(-1) would make a copy and leave x as it was.
    raw = x.view(bits_type)
    at = np.unravel_index(rng.choice(x.size, size=4 * len(bits), replace=False), x.shape)
    raw[at] = np.tile(np.array(bits, bits_type), 4)
    raw[0, 0, : len(bits)] = np.array(bits, bits_type)  # token 0, head 0: dims 0 and 1 among them
    assert np.isnan(x.astype(np.float32)).any() and np.isinf(x.astype(np.float32)).any()
    return x


def _kv(rng, dtype, T=37, Hk=3, D=64):
    """k and v as strided views of one fused [T, Hq + 2 Hk, D] projection."""
    dt = np_dtype(dtype)
    qkv = rng.standard_normal((T, 4 + 2 * Hk, D)).astype(dt)
    k, v = qkv[:, 4:4 + Hk], qkv[:, 4 + Hk:]
    _with_specials(k, dtype, rng)
    _with_specials(v, dtype, rng)
    return qkv, Hk


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_values_are_copied_bit_for_bit(backend, rng, dtype, layout, block_size):
    qkv, Hk = _kv(rng, dtype)
    T, D = qkv.shape[0], qkv.shape[-1]
    num_blocks = 2 * T // block_size + 1
    shape = ((num_blocks, block_size, Hk, D) if layout == "NHD"
             else (num_blocks, Hk, block_size, D))
    poison = np.full(shape, 7, np_dtype(dtype))
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[::4] = -1  # padding: nothing written
    device_qkv = backend.put(qkv)
    k, v = device_qkv[:, 4:4 + Hk], device_qkv[:, 4 + Hk:]
    kc, vc = backend.put(poison), backend.put(poison)
    result = cr.write_cache(k, v, kc, vc, backend.put(slots), layout=layout)
    assert result[0] is kc and result[1] is vc
    written = slots >= 0
    bits_type = SPECIAL_BITS[dtype][0]
    for cache, x in ((kc, qkv[:, 4:4 + Hk]), (vc, qkv[:, 4 + Hk:])):
        rows = _rows(host_values(backend, cache), layout)
        np.testing.assert_array_equal(rows[slots[written]].view(bits_type),
                                      np.ascontiguousarray(x[written]).view(bits_type))
        untouched = np.setdiff1d(np.arange(rows.shape[0]), slots[written])
        assert np.all(rows[untouched].astype(np.float32) == 7), "stray write"
    np.testing.assert_array_equal(host_values(backend, device_qkv).view(bits_type),
                                  qkv.view(bits_type))  # k and v only read


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_caches_store_value_over_scale(backend, rng, fp8, dtype):
    """fp8(value / scale), rounded once and saturated, as rope_and_cache stores it; the scales as
    numbers or one-element float32 arrays; NaN stays NaN."""
    T, Hk, D = 29, 2, 32
    dt = np_dtype(dtype)
    k = (4 * rng.standard_normal((T, Hk, D))).astype(dt)
    v = (4 * rng.standard_normal((T, Hk, D))).astype(dt)
    k[3, 1, 5] = np.nan
    v[2, 0, 0] = 1e30  # saturates
    fmt = np.dtype(getattr(ml_dtypes, fp8))
    slots = rng.permutation(64)[:T].astype(np.int32)
    slots[::5] = -1
    kc, vc = (_put_fp8(backend, np.zeros((16, 4, Hk, D), fmt)) for _ in range(2))
    extra = {"cache_dtype": fp8} if backend.framework == "cupy" else {}
    v_scale = backend.put(np.array([2.0], np.float32))
    cr.write_cache(backend.put(k), backend.put(v), kc, vc, backend.put(slots), k_scale=0.5,
                   v_scale=v_scale, **extra)
    valid = slots >= 0
    limit = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fp8]
    for cache, x, scale in ((kc, k, 0.5), (vc, v, 2.0)):
        host = host_values(backend, cache)
        host = host.view(fmt) if host.dtype == np.uint8 else host
        got = host.reshape(-1, Hk, D)[slots[valid]].astype(np.float64)
        exact = x[valid].astype(np.float32) * np.float32(1 / scale)  # the kernels' reciprocal
        expected = np.clip(exact, -limit, limit).astype(fmt).astype(np.float64)
        np.testing.assert_array_equal(got, expected)
        assert np.isnan(got).sum() == np.isnan(x[valid].astype(np.float32)).sum()


@pytest.mark.parametrize("backend", GPU, indirect=True)
def test_one_launch_of_the_general_fused_kernel_without_angles(backend, rng, monkeypatch):
    from cupyrope import execute
    from cupyrope.cuda import launch

    execute.clear()
    ran = []
    plan_launch = launch.plan_launch

    def recording(plan, *args, **kwargs):
        spec = plan_launch(plan, *args, **kwargs)
        ran.append((plan.rotary_dim, spec.kernel, spec.pointers))
        return spec

    monkeypatch.setattr(launch, "plan_launch", recording)
    k = backend.put(rng.standard_normal((300, 8, 128)).astype(np_dtype("bfloat16")))
    kc = backend.put(np.zeros((40, 16, 8, 128), np_dtype("bfloat16")))
    vc = backend.put(np.zeros((40, 16, 8, 128), np_dtype("bfloat16")))
    cr.write_cache(k, k, kc, vc, backend.put(np.arange(300)))
    (rotary_dim, kernel, pointers), = ran
    assert rotary_dim == 0 and kernel.fused and not kernel.lean and kernel.vector
    assert pointers[4:] == (0, 0, 0)  # no positions, no cos / sin read
    np.testing.assert_array_equal(host_values(backend, kc).reshape(-1, 8, 128)[:300], host_values(backend, k))


def test_validate_refuses_slots_past_the_cache_and_repeated_slots(rng):
    k = rng.standard_normal((4, 1, 8)).astype(np.float32)
    kc = np.zeros((2, 2, 1, 8), np.float32)
    vc = kc.copy()
    with pytest.raises(IndexError, match="slot_mapping holds 1 slot"):
        cr.write_cache(k, k, kc, vc, np.array([0, 4, 1, -1]), validate=True)
    with pytest.raises(ValueError, match="gives slot 1 to tokens"):
        cr.write_cache(k, k, kc, vc, np.array([1, -1, 1, -1]), validate=True)
    assert not kc.any() and not vc.any()
    cr.write_cache(k, k, kc, vc, np.array([0, 4, 1, -1]))  # without validate: skipped
    np.testing.assert_array_equal(kc.reshape(4, 1, 8)[[0, 1]], k[[0, 2]])
    assert not kc.reshape(4, 1, 8)[2:].any()


@pytest.mark.parametrize("case,error,match", [
    ("flat_k", ValueError, r"write_cache: k must be \[num_tokens, num_heads, head_dim\]"),
    ("v_shape", ValueError, "write_cache: v must have k's shape"),
    ("v_dtype", TypeError, "write_cache: v must be the array type, device and dtype of k"),
    ("k_dtype", TypeError, "write_cache: k must be float16, bfloat16 or float32"),
    ("cache_heads", ValueError, "write_cache: k_cache of shape"),
    ("cache_dtype", TypeError, "write_cache: the caches must have k's dtype"),
    ("uint8_without_format", TypeError, "uint8 caches hold fp8 bits"),
    ("slot_dtype", TypeError, "write_cache: slot_mapping must be int32 or int64"),
    ("slot_shape", ValueError, r"write_cache: slot_mapping must have shape \(6,\)"),
    ("layout", ValueError, "write_cache: layout must be one of"),
    ("v_scale_auto", ValueError, "write_cache: v_scale is only used with an fp8 cache"),
    ("k_scale_auto", ValueError, "write_cache: k_scale is only used with an fp8"),
    ("bad_scale", ValueError, "write_cache: k_scale must be finite and > 0"),
    ("overlap", ValueError, "write_cache: k_cache shares memory with k"),
    ("read_only", ValueError, "write_cache: v_cache is read-only"),
    ("odd_layout_hint", ValueError, "pass layout=\"HND\""),
    ("one_dim", ValueError, "write_cache: k must be \\[num_tokens, num_heads, head_dim\\] with "
                            "head_dim >= 2"),
])
def test_bad_input_is_refused_before_anything_is_written(rng, case, error, match):
    T, H, D = 6, 2, 8
    k = rng.standard_normal((T, H, D)).astype(np.float32)
    v = rng.standard_normal((T, H, D)).astype(np.float32)
    kc = np.full((4, 4, H, D), 7, np.float32)
    vc = kc.copy()
    args = dict(k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=np.arange(T))
    options = {}
    if case == "flat_k":
        args["k"] = k.reshape(T, H * D)
    elif case == "v_shape":
        args["v"] = v[:, :1]
    elif case == "v_dtype":
        args["v"] = v.astype(np.float16)
    elif case == "k_dtype":
        args["k"], args["v"] = k.astype(np.float64), v.astype(np.float64)
    elif case == "cache_heads":
        args["k_cache"] = np.zeros((4, 4, H + 1, D), np.float32)
    elif case == "cache_dtype":
        args["k_cache"], args["v_cache"] = kc.astype(np.float16), vc.astype(np.float16)
    elif case == "uint8_without_format":
        args["k_cache"], args["v_cache"] = kc.astype(np.uint8), vc.astype(np.uint8)
    elif case == "slot_dtype":
        args["slot_mapping"] = np.arange(T, dtype=np.float32)
    elif case == "slot_shape":
        args["slot_mapping"] = np.arange(T + 1)
    elif case == "layout":
        options["layout"] = "NDH"
    elif case == "v_scale_auto":
        options["v_scale"] = 2.0
    elif case == "k_scale_auto":
        options["k_scale"] = 2.0
    elif case == "bad_scale":
        args["k_cache"], args["v_cache"] = kc.astype(np.uint8), vc.astype(np.uint8)
        options.update(cache_dtype="float8_e4m3fn", k_scale=0.0)
    elif case == "overlap":
        buf = np.zeros((4 * 4 * H * D + T * H * D,), np.float32)
        args["k_cache"] = buf[:4 * 4 * H * D].reshape(4, 4, H, D)
        args["k"] = buf[4 * 4 * H * D - 8:-8].reshape(T, H, D)
    elif case == "read_only":
        vc.setflags(write=False)
    elif case == "odd_layout_hint":
        args["k_cache"] = np.zeros((4, H, 4, D), np.float32)
        args["v_cache"] = np.zeros((4, H, 4, D), np.float32)
    elif case == "one_dim":
        args["k"], args["v"] = k[..., :1], v[..., :1]
        args["k_cache"], args["v_cache"] = kc[..., :1], vc[..., :1]
    before = [np.array(x, copy=True) for x in (args["k_cache"], args["v_cache"], args["k"])]
    with pytest.raises(error, match=match):
        cr.write_cache(**args, **options)
    for x, was in zip((args["k_cache"], args["v_cache"], args["k"]), before):
        np.testing.assert_array_equal(x, was)


def test_torch_compile_traces_the_cache_write(rng):
    torch = pytest.importorskip("torch")
    k = torch.from_numpy(rng.standard_normal((5, 2, 16)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((5, 2, 16)).astype(np.float32))
    kc, vc = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    slots = torch.tensor([6, -1, 0, 3, 1])

    @torch.compile(fullgraph=True)
    def step(k, v, kc, vc, slots):
        cr.write_cache(k, v, kc, vc, slots)
        return kc.sum()

    step(k, v, kc, vc, slots)
    rows = kc.view(8, 2, 16)
    assert torch.equal(rows[[6, 0, 3, 1]], k[[0, 2, 3, 4]]) and not rows[[2, 4, 5, 7]].any()
    assert torch.equal(vc.view(8, 2, 16)[[6, 0, 3, 1]], v[[0, 2, 3, 4]])
