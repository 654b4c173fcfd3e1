"""JAX transformations of :func:`cupyrope.apply_rope`: ``jax.grad``, ``jax.jit`` and ``jax.vmap``.

``apply_rope`` sends a call here when one of its array arguments is a JAX tracer: inside
``jax.grad`` / ``jax.vjp`` (a ``custom_vjp``), ``jax.jit`` and ``jax.vmap``. Calls on concrete JAX
arrays outside any transformation keep the DLPack path of ``cupyrope.arrays``.

How a traced call runs
----------------------
The rotation is one ``jax.experimental.buffer_callback`` (JAX >= 0.7): XLA hands a Python callback
its own device buffers and, on GPU, its compute stream. The callback runs the same code as every
other call (argument checks, then the CUDA kernel or the NumPy path) reading the input buffers and
writing the output buffers where XLA placed them. So under ``jax.jit``:

- on GPU the kernel is launched on XLA's stream, on XLA's buffers: nothing is copied through the
  host and nothing synchronises (the first call of a frequency schedule uploads its float64
  ``inv_freq`` once, synchronising that once);
- on CPU the NumPy path writes into XLA's output buffers;
- Python runs at every execution (like ``jax.pure_callback``, without its copies): each call costs
  the host time of an eager call, XLA does not fuse across it, and it is not captured into XLA's
  CUDA graphs (command buffers); ``jax.export`` cannot serialise it;
- ``jax.vmap`` runs the callback once per batch element (``vmap_method="sequential"``): correct
  for every argument combination, not fast. Give apply_rope the batch as a token dim instead.

Gradients (``custom_vjp``): the gradient of a rotation is the inverse rotation of the cotangent,
so the backward pass is the same callback with ``inverse`` flipped, for q and k in one launch.
Positions, tables and ``theta`` get no cotangent (zero), as in the torch path.

Argument errors are raised while tracing (the checks run on the traced shapes and
dtypes), with the same exception types and messages as eager calls. ``validate=True`` reads the
positions inside the callback: an out-of-range position then surfaces as a ``JaxRuntimeError``
carrying the IndexError's message, when the computation runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import execute
from .arrays import cupy_module, cupy_view_of_buffer, describe_traced, on_gpu_buffer
from .plan import check_values, plan_rope
from .scaling import Scaling
from .validators import check_real

_ARGUMENTS = ("q", "k", "positions", "cos_sin_cache", "cos", "sin")


def is_traced(*arrays) -> bool:
    """True when any argument is a JAX tracer (inside jax.grad / jax.jit / jax.vmap ...)."""
    tracer = jax.core.Tracer
    return any(isinstance(x, tracer) for x in arrays)


class _Static(NamedTuple):
    """The hashable, non-array options of one call (custom_vjp's non-differentiable argument)."""

    theta: float
    scaling: Scaling | None
    interleaved: bool
    rotary_dim: int | None
    inverse: bool
    validate: bool
    seq_len: int | None

    def call_options(self) -> dict:
        return dict(theta=self.theta, scaling=self.scaling, interleaved=self.interleaved,
                    rotary_dim=self.rotary_dim, inverse=self.inverse, seq_len=self.seq_len)


def apply_rope(q, k=None, positions=None, *, cos_sin_cache=None, cos=None, sin=None,
               theta=10000.0, scaling=None, interleaved=False, rotary_dim=None, inverse=False,
               inplace=False, validate=False, seq_len=None):
    """:func:`cupyrope.apply_rope` for JAX under transformations (grad, jit, vmap).

    Same arguments, results and errors as :func:`cupyrope.apply_rope`; array arguments are JAX
    arrays, tracers or NumPy arrays. ``inplace=True`` raises TypeError (JAX arrays are immutable).
    Options other than arrays (``theta``, ``scaling``, ``rotary_dim`` ...) must be concrete Python
    values.
    """
    arrays = [_as_jax(x, name) for x, name in zip((q, k, positions, cos_sin_cache, cos, sin),
                                                   _ARGUMENTS)]
    static = _Static(_number(theta, "theta"), _hashable_scaling(scaling), interleaved,
                     rotary_dim, inverse, validate, seq_len)
    # Argument errors are raised now, while tracing, from the traced shapes and dtypes.
    plan_rope(*(None if x is None else describe_traced(x, name)
                for x, name in zip(arrays[:3], _ARGUMENTS)),
              **{name: None if x is None else describe_traced(x, name)
                 for x, name in zip(arrays[3:], ("cos_sin_cache", "cos", "sin"))},
              inplace=inplace, **static.call_options())
    q, k, *tables = arrays
    q_out, k_out = _rope(static, q, k, tuple(tables))
    return q_out if k is None else (q_out, k_out)


def run_fused(where, q, k, positions, *, rope: dict, fusion: dict, validate: bool):
    """A fused op (``rms_norm_rope``, ``rope_and_cache``, ``apply_rope(out_dtype=...)``) with a
    JAX tracer among its arguments."""
    raise NotImplementedError(
        f"{where}: the fused ops take concrete JAX arrays, not tracers (jax.jit / "
        "jax.grad / jax.vmap); call it outside the traced function")


def _as_jax(x, name: str):
    if x is None or isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    raise TypeError(
        f"apply_rope: {name} must be a JAX or NumPy array when another argument is a JAX tracer, "
        f"got {type(x).__module__}.{type(x).__qualname__}"
    )


def _number(value, name: str) -> float:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"apply_rope: {name} must be a concrete number (not a traced value), got "
            f"{type(value).__name__}"
        )
    return check_real(value, name, "apply_rope")


def _hashable_scaling(scaling) -> Scaling | None:
    frozen = Scaling.from_dict(scaling)
    try:
        hash(frozen)
    except TypeError:
        raise TypeError(f"apply_rope: scaling holds a value JAX cannot take as a static "
                        f"argument (unhashable): {scaling!r}") from None
    return frozen


# ----------------------------------------------------------------------------------------------
# custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope(static: _Static, q, k, tables):
    return _call(static, q, k, tables)


def _rope_fwd(static: _Static, q, k, tables):
    return _call(static, q, k, tables), tables


def _rope_bwd(static: _Static, tables, cotangents):
    grad_q_out, grad_k_out = cotangents
    back = static._replace(inverse=not static.inverse, validate=False)
    grad_q, grad_k = _call(back, grad_q_out, grad_k_out, tables)
    # Positions, tables: not differentiated (None: a zero cotangent, float0 for integers).
    return grad_q, grad_k, tuple(None for _ in tables)


_rope.defvjp(_rope_fwd, _rope_bwd)


def _call(static: _Static, q, k, tables):
    """(q_out, k_out or None) through one buffer_callback."""
    from jax.experimental.buffer_callback import buffer_callback

    present = tuple(x is not None for x in (k, *tables))
    inputs = [x for x in (q, k, *tables) if x is not None]
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if k is not None:
        results.append(jax.ShapeDtypeStruct(k.shape, k.dtype))
    run = buffer_callback(_callback(static, present), tuple(results), vmap_method="sequential")
    outs = run(*inputs)
    return outs[0], (outs[1] if k is not None else None)


@functools.lru_cache(maxsize=1024)
def _callback(static: _Static, present: tuple[bool, ...]):
    """The callback for one set of options (memoised: its identity keys JAX's compile caches)."""
    options = static.call_options()

    def run(ctx, outs, *buffers):
        it = iter(buffers)
        q = next(it)
        k, positions, cache, cos, sin = (next(it) if here else None for here in present)
        if not on_gpu_buffer(q):
            arrays = [None if b is None else np.asarray(b) for b in (q, k, positions, cache, cos, sin)]
            execute.rotate_into(_plan(static, options, arrays), [np.asarray(b) for b in outs])
            return
        arrays = [None if b is None else cupy_view_of_buffer(b)
                  for b in (q, k, positions, cache, cos, sin)]
        cupy = cupy_module()
        device = arrays[0].device.id
        # The kernel runs on XLA's stream, on XLA's buffers: nothing is copied or synchronised.
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(ctx.stream, device):
            execute.rotate_into(_plan(static, options, arrays),
                                [cupy_view_of_buffer(b) for b in outs])

    return run


def _plan(static: _Static, options: dict, arrays):
    q, k, positions, cache, cos, sin = arrays
    plan = plan_rope(q, k, positions, cos_sin_cache=cache, cos=cos, sin=sin, **options)
    if static.validate:
        check_values(plan)
    return plan
