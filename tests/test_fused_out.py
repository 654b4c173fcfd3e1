"""``out=`` on the fused ops (rms_norm_rope, rope_and_cache): the launch writes the arrays given
(any token and head strides with a unit last stride, fp8 outputs included) with the same values as
new outputs get, and a bad ``out`` is refused, naming the argument, before anything is written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import Backend, backend_params, host_values
from tolerances import np_dtype

MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
GPU = backend_params(["cupy", "torch-cuda"])


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")


def _case(rng, dtype, T=40, Hq=8, Hk=2, D=128):
    dt = np_dtype(dtype)
    q = rng.standard_normal((T, Hq, D)).astype(dt)
    k = rng.standard_normal((T, Hk, D)).astype(dt)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    return q, k, w, rng.integers(0, 4096, T)


def _padded_outputs(backend: Backend, q, k, dtype):
    """q_out and k_out as views of one poisoned [T, Hq + Hk + 3, D] buffer (heads padded, a
    token stride that is neither's), and the buffer."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    buf = backend.put(np.full((T, Hq + Hk + 3, D), np.nan, np_dtype(dtype)))
    return buf[:, 1:1 + Hq], buf[:, 2 + Hq:2 + Hq + Hk], buf


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("source", ["cache", "computed"])
@pytest.mark.parametrize("interleaved,rotary_dim", [(False, None), (True, None), (False, 64)])
def test_rms_norm_rope_writes_the_given_outputs(backend, rng, dtype, source, interleaved,
                                                rotary_dim):
    q, k, w, positions = _case(rng, dtype)
    angles = ({"cos_sin_cache": backend.put(cr.cos_sin_cache(4096, rotary_dim or 128))}
              if source == "cache" else {"theta": 5e5, "rotary_dim": rotary_dim})
    args = (backend.put(q), backend.put(k), backend.put(w), backend.put(w), backend.put(positions))
    options = dict(eps=1e-6, interleaved=interleaved, **angles)
    expected = [host_values(backend, x) for x in cr.rms_norm_rope(*args, **options)]
    q_out, k_out, buf = _padded_outputs(backend, q, k, dtype)
    result = cr.rms_norm_rope(*args, **options, out=(q_out, k_out))
    assert result[0] is q_out and result[1] is k_out
    for got, want in zip(result, expected):
        np.testing.assert_array_equal(_bits(host_values(backend, got)), _bits(want))
    host = host_values(backend, buf).astype(np.float32)
    Hq, Hk = q.shape[1], k.shape[1]
    assert np.isnan(host[:, [0, 1 + Hq, *range(2 + Hq + Hk, host.shape[1])]]).all(), "stray write"
    np.testing.assert_array_equal(host_values(backend, args[0]), q)  # inputs only read


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
def test_rms_norm_rope_q_only_takes_one_output(backend, rng):
    q, _, w, positions = _case(rng, "float32")
    args = (backend.put(q), None, backend.put(w), None, backend.put(positions))
    expected = host_values(backend, cr.rms_norm_rope(*args, eps=1e-5))
    out = backend.put(np.full(q.shape, np.nan, np.float32))
    assert cr.rms_norm_rope(*args, eps=1e-5, out=out) is out
    np.testing.assert_array_equal(host_values(backend, out), expected)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_outputs_into_the_given_arrays(backend, rng, fp8):
    q, k, w, positions = _case(rng, "bfloat16", T=16)
    args = (backend.put(q), backend.put(k), backend.put(w), backend.put(w), backend.put(positions))
    options = dict(eps=1e-6, out_dtype=fp8, q_scale=0.25, k_scale=0.5)
    expected = [host_values(backend, x) for x in cr.rms_norm_rope(*args, **options)]
    fmt = np.dtype(getattr(ml_dtypes, fp8))
    if backend.framework == "torch":
        import torch

        outs = [backend.put(np.zeros(x.shape, np.uint8)).view(getattr(torch, fp8)) for x in (q, k)]
    elif backend.framework == "cupy":
        outs = [backend.put(np.zeros(x.shape, np.uint8)) for x in (q, k)]
    else:
        outs = [np.zeros(x.shape, fmt) for x in (q, k)]
    cr.rms_norm_rope(*args, **options, out=tuple(outs))
    for got, want in zip(outs, expected):
        np.testing.assert_array_equal(_bits(host_values(backend, got)), _bits(want))


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("norm", [False, True])
def test_rope_and_cache_writes_the_given_outputs_and_reads_q_and_k(backend, rng, norm):
    q, k, w, positions = _case(rng, "bfloat16", T=24)
    v = rng.standard_normal(k.shape).astype(k.dtype)
    slots = rng.permutation(64)[:24]
    slots[::3] = -1
    table = backend.put(cr.cos_sin_cache(4096, 128))
    extra = dict(q_weight=backend.put(w), k_weight=backend.put(w), eps=1e-6) if norm else {}

    def run(**out):
        qd, kd = backend.put(q), backend.put(k)
        caches = [backend.put(np.zeros((16, 4, 2, 128), k.dtype)) for _ in range(2)]
        result = cr.rope_and_cache(qd, kd, backend.put(v), backend.put(positions), *caches,
                                   backend.put(slots), cos_sin_cache=table, **extra, **out)
        return qd, kd, caches, result

    qd, kd, caches, _ = run()  # in place: the reference values
    q_out, k_out, buf = _padded_outputs(backend, q, k, "bfloat16")
    qd2, kd2, caches2, result = run(out=(q_out, k_out))
    assert result[0] is q_out and result[1] is k_out and result[2] is caches2[0]
    for got, want in ((q_out, qd), (k_out, kd), (caches2[0], caches[0]), (caches2[1], caches[1])):
        np.testing.assert_array_equal(_bits(host_values(backend, got)), _bits(host_values(backend, want)))
    np.testing.assert_array_equal(host_values(backend, qd2), q)  # out= makes q and k read only
    np.testing.assert_array_equal(host_values(backend, kd2), k)


@pytest.mark.parametrize("backend", GPU, indirect=True)
def test_out_takes_one_launch_of_the_lean_kernel_when_aligned(backend, rng, launched_kernels):
    ran = launched_kernels
    q, k, w, positions = _case(rng, "bfloat16", T=64)
    q_out, k_out, _ = _padded_outputs(backend, q, k, "bfloat16")
    cr.rms_norm_rope(backend.put(q), backend.put(k), backend.put(w), backend.put(w),
                     backend.put(positions), eps=1e-6, out=(q_out, k_out))
    kernel, = ran
    assert kernel.fused and kernel.lean and kernel.norm


@pytest.mark.parametrize("case,error,match", [
    ("not_a_pair", TypeError, r"rms_norm_rope: out must be \(q_out, k_out\) for a call with k"),
    ("shape", ValueError, r"rms_norm_rope: k_out must have shape \(6, 2, 16\) and dtype float32, "
                          r"got shape \(6, 1, 16\)"),
    ("dtype", ValueError, "rms_norm_rope: q_out must have shape .* and dtype float32, got shape "
                          r"\(6, 4, 16\) and dtype float16"),
    ("last_stride", ValueError, r"rms_norm_rope: q_out must have stride 1 in its last dim "
                                r"\(head_dim\) for the fused ops, got strides \(128, 32, 2\)"),
    ("zero_stride", ValueError, "rms_norm_rope: k_out has a zero stride"),
    ("overlaps_q", ValueError, "rms_norm_rope: q_out shares memory with q"),
    ("outputs_overlap", ValueError, "rms_norm_rope: q_out shares memory with k_out"),
    ("read_only", TypeError, "rms_norm_rope: out= writes into its arrays and k_out is read-only"),
    ("with_inplace", ValueError, "rms_norm_rope: pass inplace=True .* or out= .*, not both"),
    ("other_type", TypeError, "rms_norm_rope: q_out must be a numpy array"),
])
def test_bad_out_is_refused_before_anything_is_written(rng, case, error, match):
    torch = pytest.importorskip("torch") if case == "other_type" else None
    q = rng.standard_normal((6, 4, 16)).astype(np.float32)
    k = rng.standard_normal((6, 2, 16)).astype(np.float32)
    w = np.ones(16, np.float32)
    q_out, k_out = np.full(q.shape, 7, np.float32), np.full(k.shape, 7, np.float32)
    options = {}
    if case == "not_a_pair":
        out = q_out
    elif case == "shape":
        out = (q_out, k_out[:, :1])
    elif case == "dtype":
        out = (q_out.astype(np.float16), k_out)
    elif case == "last_stride":
        out = (np.full((6, 4, 32), 7, np.float32)[..., ::2], k_out)
    elif case == "zero_stride":
        base = np.full((6, 1, 16), 7, np.float32)
        out = (q_out, np.lib.stride_tricks.as_strided(base, k.shape, (64, 0, 4)))
    elif case == "overlaps_q":
        out = (q, k_out)
    elif case == "outputs_overlap":
        out = (q_out, q_out[:, :2])
    elif case == "read_only":
        k_out.setflags(write=False)
        out = (q_out, k_out)
    elif case == "with_inplace":
        out, options = (q_out, k_out), {"inplace": True}
    else:
        out = (torch.zeros(q.shape), k_out)
    before = [np.array(x, copy=True) for x in (q, k, q_out, k_out)]
    with pytest.raises(error, match=match):
        cr.rms_norm_rope(q, k, w, w, np.arange(6), eps=1e-6, out=out, **options)
    for x, was in zip((q, k, q_out, k_out), before):
        np.testing.assert_array_equal(x, was)


def test_jax_outputs_are_refused():
    jnp = pytest.importorskip("jax.numpy")
    q = jnp.ones((2, 1, 8), jnp.float32)
    w = jnp.ones(8, jnp.float32)
    with pytest.raises(TypeError, match="rms_norm_rope: .*immutable"):
        cr.rms_norm_rope(q, None, w, None, jnp.arange(2), eps=1e-6, out=jnp.zeros_like(q))


def test_torch_compile_and_autograd_fill_the_outputs(rng):
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(rng.standard_normal((5, 4, 16)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((5, 2, 16)).astype(np.float32))
    w = torch.ones(16)
    positions = torch.arange(5)
    expected = cr.rms_norm_rope(q, k, w, w, positions, eps=1e-6)

    @torch.compile(fullgraph=True)
    def step(q, k, q_out, k_out):
        cr.rms_norm_rope(q, k, w, w, positions, eps=1e-6, out=(q_out, k_out))
        return q_out.sum() + k_out.sum()

    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    step(q, k, q_out, k_out)
    assert torch.equal(q_out, expected[0]) and torch.equal(k_out, expected[1])
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    graded = q.clone().requires_grad_()
    result = cr.rms_norm_rope(graded, k, w, w, positions, eps=1e-6, out=(q_out, k_out))
    assert result[0] is q_out and torch.equal(q_out, expected[0])
