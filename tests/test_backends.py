"""One test body over every array backend (tests/backends.py): NumPy, torch and JAX on the CPU,
and CuPy, torch and JAX on a GPU where one is present, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from backends import (BACKEND_NAMES, MAX_POSITION, SOURCES, Backend, _gpu_available, angle_source,
                      backend_params, require, rope_and_check)
from cupyrope.core.arrays import describe
from tolerances import (C_COMPUTE, assert_bits_equal, assert_rope_close, compute_eps, np_dtype,
                        unit_roundoff)


@pytest.fixture(params=backend_params())
def backend(request) -> Backend:
    backend = Backend(request.param)
    require(backend)
    return backend


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype, T, D", [("bfloat16", 53, 128), ("float16", 9, 64)])
def test_fused_qkv_views(backend, dtype, T, D, interleaved, source, inplace, randn, rng):
    """q and k as views of one packed QKV projection output ``[T, (Hq + 2 Hk) * D]``: rotated in
    one call, v untouched; in place the buffer holds the result, out of place it is unchanged."""
    Hq, Hk = 8, 2
    before = randn((T, (Hq + 2 * Hk) * D), dtype)
    buf = backend.put(before)
    view = buf.reshape(T, Hq + 2 * Hk, D)
    q, k = view[:, :Hq], view[:, Hq:Hq + Hk]
    positions = rng.integers(0, MAX_POSITION, size=T).astype(np.int32)
    if inplace and not backend.mutable:
        with pytest.raises(TypeError, match="immutable JAX array"):
            cr.apply_rope(q, k, backend.put(positions), theta=10000.0, inplace=True)
        return
    if backend.mutable:  # the slices must be views into buf, not copies
        item = np.dtype(np_dtype(dtype)).itemsize
        qi, ki, bi = describe(q, "q"), describe(k, "k"), describe(buf, "buf")
        assert qi.ptr == bi.ptr and ki.ptr == bi.ptr + Hq * D * item
        assert qi.strides == ((Hq + 2 * Hk) * D, D, 1)
    outs = rope_and_check(backend, q, k, source, D, interleaved=interleaved, positions=positions,
                          inplace=inplace)
    after = backend.get(buf)
    assert_bits_equal(after[:, (Hq + Hk) * D:], before[:, (Hq + Hk) * D:], what="v part of qkv")
    if inplace:
        # What apply_rope returned is the content of buf's q and k parts.
        assert_bits_equal(after[:, :Hq * D].reshape(T, Hq, D), backend.get(outs[0]), what="q in buf")
        assert_bits_equal(after[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D), backend.get(outs[1]),
                          what="k in buf")
    else:
        assert_bits_equal(after, before, what="qkv buffer after an out-of-place call")


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("source", ["cache", "computed", "tables_half"])
@pytest.mark.parametrize("S, B, D, interleaved, positions_dtype",
                         [(31, 3, 128, False, "int64"), (8, 3, 64, True, "int32")],
                         ids=["S31-neox", "S8-gptj"])
def test_sbhd_positions_s1(backend, S, B, D, interleaved, positions_dtype, source, inplace, randn, rng):
    """[S, B, H, D] (Megatron / TransformerEngine sbhd) with positions [S, 1]."""
    if inplace and not backend.mutable:
        pytest.skip("JAX arrays are immutable (tested by test_jax_inplace_raises)")
    q = backend.put(randn((S, B, 4, D), "bfloat16"))
    k = backend.put(randn((S, B, 1, D), "bfloat16"))
    positions = rng.integers(0, MAX_POSITION, size=(S, 1)).astype(positions_dtype)
    rope_and_check(backend, q, k, source, D, interleaved=interleaved, positions=positions,
                   inplace=inplace)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_inverse_undoes_forward(backend, dtype, interleaved, source, randn, rng):
    T, D = 12, 64
    host = randn((T, 3, D), dtype)
    q = backend.put(host)
    positions = rng.integers(0, MAX_POSITION, size=T)
    lib, _, check = angle_source(source, (T,), positions, D, interleaved=interleaved)
    lib = {name: backend.put(v) if isinstance(v, np.ndarray) else v for name, v in lib.items()}
    fwd = cr.apply_rope(q, interleaved=interleaved, **lib)
    back = cr.apply_rope(fwd, interleaved=interleaved, inverse=True, **lib)
    if backend.on_gpu:
        # Two roundings to the output dtype (and cos^2 + sin^2 of a rounded table != 1 exactly).
        extra = 4 * unit_roundoff(dtype) + 4 * unit_roundoff("float32")
    else:
        # two rotations: the intermediate rounding to the output dtype (<= u * sqrt(2) * (|x1| + |x2|)
        # per element, carried through the second rotation) plus a second arithmetic error.
        extra = 2.0 * np.sqrt(2.0) * unit_roundoff(dtype) + C_COMPUTE * compute_eps(dtype)
        if source != "computed":  # float32 cos/sin: cos^2 + sin^2 = 1 only to 2 * u(float32)
            extra += 2.0 * unit_roundoff("float32")
        check = {}
    assert_rope_close(backend.get(back), host.astype(np.float64), host, interleaved=interleaved,
                      rotary_dim=D, extra_pair_rel=extra, **check)
    # and the forward really moved something (position 0 excepted)
    moved = positions != 0
    assert not np.array_equal(backend.get(fwd)[moved], host[moved])


@pytest.mark.parametrize("with_k", [False, True])
@pytest.mark.parametrize("name", [n for n in BACKEND_NAMES if n.startswith("jax")])
def test_jax_inplace_raises(name, with_k, randn, rng):
    backend = Backend(name)
    if backend.on_gpu and not _gpu_available():
        pytest.skip("needs a CUDA GPU")
    require(backend)
    host = randn((5, 2, 32), "bfloat16" if backend.on_gpu else "float32")
    q = backend.put(host)
    k = backend.put(randn((5, 1, 32), "float32" if not backend.on_gpu else "bfloat16")) if with_k else None
    with pytest.raises(TypeError, match=r"(?i)in-?place|inplace"):
        cr.apply_rope(q, k, backend.put(rng.integers(0, 10, size=5).astype(np.int32)), inplace=True)
    assert_bits_equal(backend.get(q), host, what="JAX q after a refused in-place call")
