"""One test body, every array backend: the harness behind tests/test_backends.py.

A test takes the ``backend`` fixture (tests/conftest.py), builds its inputs on the host, puts them
on the backend (``backend.put``: NumPy, torch CPU, JAX CPU; CuPy, torch CUDA, JAX GPU where a GPU
is present), calls :func:`rope_and_check` and gets every check at once: the result's type, device,
dtype and shape; the values against the float64 reference (tests/reference.py) within the
dtype-keyed tolerance table (tests/tolerances.py); the in-place contract (the inputs are returned,
written) or the out-of-place one (inputs untouched, new arrays); tables and positions untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from cupyrope.core.arrays import describe
from reference import default_positions, reference_angles, reference_inv_freq, reference_rope
from tolerances import assert_bits_equal, assert_rope_close, max_abs_angle, np_dtype

THETA = 10000.0
MAX_POSITION = 4096
SOURCES = ["cache", "tables_half", "tables_full", "computed"]


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # a broken driver counts as no GPU
        return False


class Backend:
    """Host arrays in, this backend's arrays out (and back)."""

    def __init__(self, name: str):
        self.name = name
        self.framework = name.split("-")[0]  # numpy, torch, jax, cupy
        self.on_gpu = name in ("cupy", "torch-cuda", "jax-gpu")
        self.mutable = self.framework != "jax"

    def __repr__(self) -> str:
        return self.name

    def put(self, host: np.ndarray):
        """A copy of ``host`` on this backend (bfloat16 included), C-contiguous."""
        host = np.ascontiguousarray(host)
        if self.framework == "numpy":
            return host.copy()
        if self.framework == "cupy":
            import cupy

            if host.dtype == np_dtype("bfloat16"):
                return cupy.asarray(host.view(np.uint16)).view(host.dtype)
            return cupy.asarray(host)
        if self.framework == "torch":
            import torch

            if host.dtype == np_dtype("bfloat16"):
                tensor = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
            else:
                tensor = torch.from_numpy(host.copy())
            return tensor.cuda() if self.on_gpu else tensor
        import jax
        import jax.numpy as jnp

        if host.dtype == np.float64 and not jax.config.jax_enable_x64:
            pytest.skip("JAX without jax_enable_x64 makes float64 arrays float32")
        device = jax.devices("gpu" if self.on_gpu else "cpu")[0]
        return jax.device_put(jnp.asarray(host), device)

    def get(self, x) -> np.ndarray:
        """The values of a backend array as NumPy (same dtype, bfloat16 included)."""
        if self.framework == "torch":
            import torch

            x = x.detach().cpu()
            if x.dtype == torch.bfloat16:
                return x.view(torch.int16).numpy().view(np_dtype("bfloat16"))
            return x.numpy()
        if self.framework == "cupy":
            return x.get()
        return np.asarray(x)

    def check_type(self, out, like) -> None:
        """``out`` is an array of this backend, on ``like``'s device, with its dtype and shape."""
        got, want = describe(out, "out"), describe(like, "like")
        assert got.kind == want.kind == ("numpy" if self.framework == "numpy" else self.framework)
        assert got.device == want.device and got.dtype == want.dtype and got.shape == want.shape


BACKEND_NAMES = ["numpy", "torch", "jax", "cupy", "torch-cuda", "jax-gpu"]


def backend_params(names=BACKEND_NAMES):
    """pytest params of the backends, the GPU ones marked ``gpu`` (skipped without one)."""
    return [pytest.param(n, marks=pytest.mark.gpu) if Backend(n).on_gpu else n for n in names]


def host_values(backend: Backend, x) -> np.ndarray:
    """A backend array's values as NumPy (torch fp8 as its ml_dtypes type; CuPy returns fp8 bits
    as uint8)."""
    if backend.framework == "torch":
        import torch

        x = x.detach().cpu()
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            import ml_dtypes

            return x.view(torch.uint8).numpy().view(getattr(ml_dtypes, str(x.dtype)[6:]))
    return backend.get(x)


def require(backend: Backend) -> None:
    """Skip when the backend's framework is not installed (JAX on GPU also needs its GPU)."""
    if backend.framework in ("torch", "jax"):
        pytest.importorskip(backend.framework)
    if backend.name == "jax-gpu":
        import jax

        try:
            jax.devices("gpu")
        except RuntimeError:
            pytest.skip("JAX has no GPU backend here")


def reference_tables(positions, rotary_dim, *, theta=THETA, width="half", interleaved=False,
                     dtype="float32", linear_factor=1.0):
    """cos, sin per-token tables built from reference angles (float64), rounded to ``dtype``.

    width "half": [..., r/2]; "full": Hugging Face layout [..., r] (halves repeated for NeoX, each value
    repeated twice for interleaved).
    """
    angles = reference_angles(positions, reference_inv_freq(rotary_dim, theta, linear_factor))
    c, s = np.cos(angles), np.sin(angles)
    if width == "full":
        if interleaved:
            c, s = np.repeat(c, 2, axis=-1), np.repeat(s, 2, axis=-1)
        else:
            c, s = np.concatenate([c, c], axis=-1), np.concatenate([s, s], axis=-1)
    dt = np_dtype(dtype)
    return c.astype(dt), s.astype(dt)


def angle_source(source, token_shape, positions, rotary_dim, *, interleaved, theta=THETA,
                 table_dtype="float32", max_position=MAX_POSITION, pass_rotary_dim=True):
    """(library kwargs, reference kwargs, check kwargs) for one angle source, on the host.

    The reference sees the very tables handed to the library (so the check needs no table term).
    """
    if source == "cache":
        cache = cr.cos_sin_cache(max_position, rotary_dim, theta=theta, dtype=table_dtype)
        lib = {"positions": positions, "cos_sin_cache": cache}
        ref = {"positions": positions, "cos_sin_cache": cache}
        return lib, ref, {}
    if source in ("tables_half", "tables_full"):
        pos = default_positions(token_shape) if positions is None else positions
        pos = np.broadcast_to(pos, token_shape)
        width = "half" if source == "tables_half" else "full"
        c, s = reference_tables(pos, rotary_dim, theta=theta, width=width, interleaved=interleaved,
                                dtype=table_dtype)
        lib = {"cos": c, "sin": s}
        if width == "half" or pass_rotary_dim:
            lib["rotary_dim"] = rotary_dim
        ref = {"cos": c, "sin": s, "rotary_dim": rotary_dim}
        return lib, ref, {}
    assert source == "computed"
    pos = default_positions(token_shape) if positions is None else positions
    lib = {"positions": positions, "theta": theta}
    if pass_rotary_dim:
        lib["rotary_dim"] = rotary_dim
    ref = {"positions": positions, "theta": theta, "rotary_dim": rotary_dim}
    return lib, ref, {"max_angle": max_abs_angle(pos, reference_inv_freq(rotary_dim, theta))}


def rope_and_check(backend: Backend, q, k, source, rotary_dim, *, interleaved, positions=None,
                   inplace=False, inverse=False, table_dtype="float32"):
    """``apply_rope`` on the backend's q and k (views allowed) with host-built angles, every check
    of the module docstring; returns the outputs."""
    token_shape = tuple(q.shape[:-2])
    lib, ref_kw, check = angle_source(source, token_shape, positions, rotary_dim,
                                      interleaved=interleaved, table_dtype=table_dtype)
    host_inputs = {name: np.array(value, copy=True) for name, value in lib.items()
                   if isinstance(value, np.ndarray)}
    lib = {name: backend.put(value) if isinstance(value, np.ndarray) else value
           for name, value in lib.items()}
    q0, k0 = backend.get(q).copy(), None if k is None else backend.get(k).copy()
    result = cr.apply_rope(q, k, interleaved=interleaved, inverse=inverse, inplace=inplace, **lib)
    outs = [result] if k is None else list(result)
    assert len(outs) == (1 if k is None else 2)
    for out, x, x0 in zip(outs, [q, k], [q0, k0]):
        backend.check_type(out, x)
        if inplace:
            assert out is x, "inplace=True must return the input objects"
        else:
            assert_bits_equal(backend.get(x), x0, what="input after an out-of-place call")
            if backend.mutable:
                assert describe(out, "out").ptr != describe(x, "x").ptr, "a new output array"
        ref = reference_rope(x0, interleaved=interleaved, inverse=inverse, **ref_kw)
        assert_rope_close(backend.get(out), ref, x0, interleaved=interleaved, rotary_dim=rotary_dim,
                          **check)
    for name, before in host_inputs.items() if backend.mutable else ():  # JAX arrays never change
        assert_bits_equal(backend.get(lib[name]), before, what=f"{name} after the call")
    return outs
