"""CPU interop: torch CPU tensors, JAX CPU arrays, NumPy and a bare DLPack producer.

The result has the caller's type, device, dtype and shape; values are compared with the float64
reference through the shared tolerance table. CI sets CUPYROPE_REQUIRE_INTEROP=torch,jax so the
importorskip below cannot silently skip there (conftest fails the session instead).
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from reference import reference_angles, reference_inv_freq, reference_rope
from tolerances import as_numpy, assert_bits_equal, assert_rope_close, max_abs_angle, np_dtype

THETA = 10000.0
MAX_POSITION = 2048
DTYPES = ["float32", "float64", "float16", "bfloat16"]
SOURCES = ["cache", "tables", "computed"]


def tables_np(positions, rotary_dim, interleaved, dtype="float32"):
    """Hugging Face full-width cos/sin from reference angles."""
    angles = reference_angles(positions, reference_inv_freq(rotary_dim, THETA))
    if interleaved:
        angles = np.repeat(angles, 2, axis=-1)
    else:
        angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np_dtype(dtype)), np.sin(angles).astype(np_dtype(dtype))


def check_against_reference(out, x0, positions, source, *, interleaved, D, cache=None, tables=None,
                            inverse=False):
    """Compare ``out`` with the reference for q0 = ``x0`` (NumPy), tables / cache as NumPy."""
    if source == "cache":
        ref = reference_rope(x0, positions, cos_sin_cache=as_numpy(cache), interleaved=interleaved,
                             inverse=inverse)
        check = {}
    elif source == "tables":
        c, s = (as_numpy(t) for t in tables)
        ref = reference_rope(x0, cos=c, sin=s, interleaved=interleaved, inverse=inverse)
        check = {}
    else:
        ref = reference_rope(x0, positions, theta=THETA, interleaved=interleaved, inverse=inverse)
        check = {"max_angle": max_abs_angle(positions, reference_inv_freq(D, THETA))}
    assert_rope_close(as_numpy(out), ref, x0, interleaved=interleaved, rotary_dim=D, **check)


# ----------------------------------------------------------------------------------------------------
# torch (CPU)

@pytest.fixture
def tch():
    return pytest.importorskip("torch")


def to_torch(tch, a):
    a = np.ascontiguousarray(a)
    if a.dtype == np_dtype("bfloat16"):
        return tch.from_numpy(a.view(np.int16)).view(tch.bfloat16)
    return tch.from_numpy(a)


def torch_layout(tch, randn, layout, dtype, B=2, S=7, Hq=4, Hk=2, D=64):
    """q, k torch tensors of shape [B, S, H, D] in one of several memory layouts (views included)."""
    if layout == "contiguous":
        return to_torch(tch, randn((B, S, Hq, D), dtype)), to_torch(tch, randn((B, S, Hk, D), dtype)), None
    if layout == "transposed":  # [B, H, S, D] storage
        sq = to_torch(tch, randn((B, Hq, S, D), dtype))
        sk = to_torch(tch, randn((B, Hk, S, D), dtype))
        return sq.transpose(1, 2), sk.transpose(1, 2), (sq, sk)
    assert layout == "fused_qkv"
    qkv = to_torch(tch, randn((B, S, Hq + 2 * Hk, D), dtype))
    return qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk], (qkv,)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused_qkv"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_out_of_place(dtype, source, layout, tch, randn, rng):
    B, S, D = 2, 7, 64
    interleaved = source == "tables"
    q, k, _ = torch_layout(tch, randn, layout, dtype, B=B, S=S, D=D)
    q0, k0 = as_numpy(q).copy(), as_numpy(k).copy()
    pos_np = rng.integers(0, MAX_POSITION, size=(B, S))
    positions = tch.from_numpy(pos_np)
    kwargs, cache, tables = {}, None, None
    if source == "cache":
        cache = cr.cos_sin_cache(MAX_POSITION, D, theta=THETA, like=q)
        # like=q: a float64 q gets a float64 table, every other dtype float32
        expected = tch.float64 if dtype == "float64" else tch.float32
        assert isinstance(cache, tch.Tensor) and cache.device.type == "cpu" and cache.dtype == expected
        kwargs = {"positions": positions, "cos_sin_cache": cache}
    elif source == "tables":
        tables = tuple(to_torch(tch, t) for t in tables_np(pos_np, D, interleaved))
        kwargs = {"cos": tables[0], "sin": tables[1]}
    else:
        kwargs = {"positions": positions, "theta": THETA}

    out_q, out_k = cr.apply_rope(q, k, interleaved=interleaved, **kwargs)
    for out, x, x0 in ((out_q, q, q0), (out_k, k, k0)):
        assert isinstance(out, tch.Tensor)
        assert out.device.type == "cpu" and out.dtype == x.dtype and tuple(out.shape) == tuple(x.shape)
        assert out.is_contiguous() and out.data_ptr() != x.data_ptr()
        assert_bits_equal(as_numpy(x), x0, what="torch input after an out-of-place call")
        check_against_reference(out, x0, pos_np, source, interleaved=interleaved, D=D, cache=cache,
                                tables=tables)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused_qkv"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_inplace(dtype, source, layout, tch, randn, rng):
    B, S, D = 2, 7, 64
    q, k, storage = torch_layout(tch, randn, layout, dtype, B=B, S=S, D=D)
    storage_before = [as_numpy(t).copy() for t in storage] if storage else []
    q0, k0 = as_numpy(q).copy(), as_numpy(k).copy()
    pos_np = rng.integers(0, MAX_POSITION, size=(S,)).astype(np.int32)
    positions = tch.from_numpy(pos_np)
    cache = tables = None
    if source == "cache":
        cache = cr.cos_sin_cache(MAX_POSITION, D, theta=THETA, like=q)
        kwargs = {"positions": positions, "cos_sin_cache": cache}
    elif source == "tables":
        tables = tuple(to_torch(tch, t) for t in tables_np(pos_np, D, False, dtype="bfloat16"))
        kwargs = {"cos": tables[0], "sin": tables[1]}
    else:
        kwargs = {"positions": positions}
    ptr_q, ptr_k = q.data_ptr(), k.data_ptr()
    out_q, out_k = cr.apply_rope(q, k, inplace=True, **kwargs)
    assert out_q is q and out_k is k
    assert q.data_ptr() == ptr_q and k.data_ptr() == ptr_k
    for out, x0 in ((q, q0), (k, k0)):
        check_against_reference(out, x0, np.broadcast_to(pos_np, (B, S)), source, interleaved=False, D=D,
                                cache=cache, tables=tables)
    if layout == "fused_qkv":  # v untouched
        Hq, Hk = q.shape[2], k.shape[2]
        assert_bits_equal(as_numpy(storage[0][:, :, Hq + Hk:]), storage_before[0][:, :, Hq + Hk:], what="v")
    if layout == "transposed":  # the writes went to the [B, H, S, D] storage
        assert_bits_equal(as_numpy(storage[0].transpose(1, 2)), as_numpy(q), what="q storage")


@pytest.mark.parametrize("which", ["q", "k", "both"])
def test_torch_requires_grad(which, tch, randn, rng):
    """Tensors that require grad go through the differentiable custom op (tests/test_autograd_cpu.py
    checks its gradients); under no_grad they take the plain path and the result has no history."""
    T, D = 5, 32
    q = to_torch(tch, randn((T, 2, D)))
    k = to_torch(tch, randn((T, 1, D)))
    if which in ("q", "both"):
        q.requires_grad_(True)
    if which in ("k", "both"):
        k.requires_grad_(True)
    positions = tch.from_numpy(rng.integers(0, 100, size=T))
    out_q, out_k = cr.apply_rope(q, k, positions)
    assert "cupyrope" in type(out_q.grad_fn).__name__  # one node: both outputs carry it
    assert out_k.grad_fn is out_q.grad_fn
    for out, x in ((out_q, q), (out_k, k)):
        check_against_reference(out.detach(), x.detach().numpy().copy(), positions.numpy(),
                                "computed", interleaved=False, D=D)
    with tch.no_grad():
        out_q, out_k = cr.apply_rope(q, k, positions)
    assert isinstance(out_q, tch.Tensor) and not out_q.requires_grad
    check_against_reference(out_q, q.detach().numpy().copy(), positions.numpy(), "computed",
                            interleaved=False, D=D)
    check_against_reference(out_k, k.detach().numpy().copy(), positions.numpy(), "computed",
                            interleaved=False, D=D)


def test_torch_k_none_and_expand(tch, randn, rng):
    """k=None returns one tensor; an expanded (zero-stride) tensor works out of place, not in place."""
    T, D = 6, 64
    row = to_torch(tch, randn((1, 3, D)))
    q = row.expand(T, 3, D)
    positions = tch.from_numpy(rng.integers(0, 100, size=T))
    out = cr.apply_rope(q, positions=positions)
    assert isinstance(out, tch.Tensor) and tuple(out.shape) == (T, 3, D)
    check_against_reference(out, as_numpy(q).copy(), positions.numpy(), "computed", interleaved=False, D=D)
    before = as_numpy(row).copy()
    with pytest.raises(ValueError, match=r"\bq\b"):
        cr.apply_rope(q, positions=positions, inplace=True)
    assert_bits_equal(as_numpy(row), before, what="expanded storage")


def test_torch_last_dim_stride(tch, randn):
    q = to_torch(tch, randn((4, 64, 3))).transpose(1, 2)  # [4, 3, 64] with last stride 3
    assert tch.equal(cr.apply_rope(q), cr.apply_rope(q.contiguous()))


# ----------------------------------------------------------------------------------------------------
# JAX (CPU)


@pytest.fixture
def jx():
    jax = pytest.importorskip("jax")
    # On a machine with a GPU, JAX puts new arrays there by default: these tests are about CPU arrays.
    with jax.default_device(jax.devices("cpu")[0]):
        yield jax


def jax_dtype_context(jax, dtype):
    """float64 needs jax_enable_x64 (scoped, so other tests keep JAX's default)."""
    import contextlib

    if dtype == "float64":
        return jax.enable_x64(True)
    return contextlib.nullcontext()


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_jax(dtype, source, jx, randn, rng):
    jnp = jx.numpy
    T, D = 9, 64
    interleaved = source == "computed"
    with jax_dtype_context(jx, dtype):
        q_np, k_np = randn((T, 4, D), dtype), randn((T, 1, D), dtype)
        q, k = jnp.asarray(q_np), jnp.asarray(k_np)
        assert str(q.dtype) == dtype
        pos_np = rng.integers(0, MAX_POSITION, size=T).astype(np.int64 if dtype == "float64" else np.int32)
        positions = jnp.asarray(pos_np)
        cache = tables = None
        if source == "cache":
            cache = cr.cos_sin_cache(MAX_POSITION, D, theta=THETA, like=q)
            expected = "float64" if dtype == "float64" else "float32"  # like=q's float64 stays float64
            assert isinstance(cache, jx.Array) and str(cache.dtype) == expected
            kwargs = {"positions": positions, "cos_sin_cache": cache}
        elif source == "tables":
            tables = tuple(jnp.asarray(t) for t in tables_np(pos_np, D, interleaved))
            kwargs = {"cos": tables[0], "sin": tables[1]}
        else:
            kwargs = {"positions": positions, "theta": THETA}
        out_q, out_k = cr.apply_rope(q, k, interleaved=interleaved, **kwargs)
        for out, x, x0 in ((out_q, q, q_np), (out_k, k, k_np)):
            assert isinstance(out, jx.Array), type(out)
            assert out.dtype == x.dtype and out.shape == x.shape
            assert list(out.devices())[0].platform == "cpu"
            assert_bits_equal(np.asarray(x), x0, what="jax input")
            check_against_reference(np.asarray(out), x0, pos_np, source, interleaved=interleaved, D=D,
                                    cache=cache, tables=tables)
        # q only, inverse
        out = cr.apply_rope(q, interleaved=interleaved, inverse=True, **kwargs)
        assert isinstance(out, jx.Array)
        check_against_reference(np.asarray(out), q_np, pos_np, source, interleaved=interleaved, D=D,
                                cache=cache, tables=tables, inverse=True)


# ----------------------------------------------------------------------------------------------------
# NumPy and other DLPack producers


class DLPackOnly:
    """A CPU array seen only through the DLPack protocol (not an ndarray, no __array__)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_numpy_and_bare_dlpack_producer(dtype, randn, rng):
    T, D = 8, 64
    q_np = randn((T, 4, D), dtype)
    k_np = randn((T, 2, D), dtype)
    positions = rng.integers(0, MAX_POSITION, size=T)
    out_q, out_k = cr.apply_rope(q_np, k_np, positions)
    assert type(out_q) is np.ndarray and type(out_k) is np.ndarray
    check_against_reference(out_q, q_np, positions, "computed", interleaved=False, D=D)

    out = cr.apply_rope(DLPackOnly(q_np), DLPackOnly(k_np))  # positions None: arange(T)
    assert isinstance(out, tuple) and all(type(o) is np.ndarray for o in out)
    for o, x in zip(out, (q_np, k_np)):
        assert o.dtype == x.dtype and o.shape == x.shape
        check_against_reference(o, x, np.arange(T), "computed", interleaved=False, D=D)


def test_wrapper_tensors_are_left_to_the_full_path():
    """A torch tensor subclass that intercepts dispatch (FakeTensor here, DTensor in
    tests/test_dtensor.py) has no storage of its own: the repeat-call key, which reads data
    pointers, never takes it, even on a CUDA device (faked: no GPU needed)."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cupyrope.core import arrays
    from cupyrope.cuda import recipes

    with FakeTensorMode():
        q = torch.empty(2, 4, 8, device="cuda")
    assert q.device.type == "cuda"
    assert arrays.gpu_array_key(q) is None
    options = (10000.0, None, False, None, False, False, None)
    assert recipes.call_key(q, None, None, None, None, None, options) is None
