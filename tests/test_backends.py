"""One test body over every array backend (tests/backends.py): NumPy, torch and JAX on the CPU,
and CuPy, torch and JAX on a GPU where one is present, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from backends import MAX_POSITION, SOURCES, Backend, backend_params, require, rope_and_check
from cupyrope.arrays import describe
from tolerances import assert_bits_equal, np_dtype


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
