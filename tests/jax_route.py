"""Test helpers of the traced JAX route (cupyrope/frontends/jax/ops.py).

- :func:`launches`: how many cupyrope primitives a JAX function runs, and on which shapes, read
  from its jaxpr. Every traced call binds ``cupyrope_rope`` or ``cupyrope_fused`` once per launch;
  a call inside a ``scan`` (``jax.lax.map``: a vmap that runs per element) runs once per
  iteration.
- :func:`assert_within_ulps`: the traced route (XLA) against the eager NumPy path. XLA's CPU
  contracts ``x1 * cos - x2 * sin`` into fused multiply-adds, so the two may round differently.
"""

from __future__ import annotations

import jax
import numpy as np

from tolerances import as_numpy, ulp

PRIMITIVES = ("cupyrope_rope", "cupyrope_fused")


def launches(f, *args) -> list[tuple[int, ...]]:
    """The shape of q of every launch ``f(*args)`` makes, a call in a scan counted per
    iteration."""
    shapes: list[tuple[int, ...]] = []
    _walk(jax.make_jaxpr(f)(*args).jaxpr, 1, shapes)
    return shapes


def _walk(jaxpr, repeats: int, shapes: list) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in PRIMITIVES:
            shapes.extend([tuple(eqn.invars[0].aval.shape)] * repeats)
        inner = repeats * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _walk(sub.jaxpr, inner, shapes)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _walk(sub, inner, shapes)


def assert_within_ulps(actual, expected, x, what: str, ulps: float = 1.0) -> None:
    """Same shape, dtype and NaN pattern, every element within ``ulps`` units in the last place
    of ``expected``'s dtype (at the larger magnitude of the two), plus the float32 arithmetic's
    rounding of the head's inputs ``x`` (2^-23 of the largest |x| of the head: a fused multiply-add
    rounds ``x1 * cos - x2 * sin`` once where NumPy rounds three times)."""
    a, e = as_numpy(actual), as_numpy(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (what, a.shape, e.shape, a.dtype, e.dtype)
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    assert np.array_equal(np.isnan(a64), np.isnan(e64)), f"{what}: NaN patterns differ"
    head = np.max(np.abs(as_numpy(x).astype(np.float64)), axis=-1, keepdims=True)
    bound = ulps * ulp(np.fmax(np.abs(a64), np.abs(e64)), e.dtype.name) + 2.0 ** -23 * head
    error = np.where(np.isnan(e64), 0.0, np.abs(a64 - e64))
    assert np.all(error <= bound), (f"{what}: {int(np.sum(error > bound))} element(s) apart by "
                                    f"more than the bound, worst {np.max(error / bound):.3g}x")


def require_native_gpu():
    """Skip unless CuPy, JAX's GPU backend and the native kernel call of this jaxlib are all
    here; returns the CuPy module (the eager calls the native ones are checked against)."""
    import pytest

    from backends import Backend, require

    cupy = pytest.importorskip("cupy")
    require(Backend("jax-gpu"))
    from cupyrope.frontends.jax import native

    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    return cupy
