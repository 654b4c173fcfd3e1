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

Argument errors are raised while tracing (the checks run on stand-ins of the traced shapes and
dtypes), with the same exception types and messages as eager calls. ``validate=True`` reads the
positions inside the callback: an out-of-range position then surfaces as a ``JaxRuntimeError``
carrying the IndexError's message, when the computation runs.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .arrays import describe
from .cpu import rotate_on_host
from .plan import check_positions_in_cache, plan_rope

_ARGUMENTS = ("q", "k", "positions", "cos_sin_cache", "cos", "sin")


def is_traced(*arrays) -> bool:
    """True when any argument is a JAX tracer (inside jax.grad / jax.jit / jax.vmap ...)."""
    tracer = jax.core.Tracer
    return any(isinstance(x, tracer) for x in arrays)


class _Static(NamedTuple):
    """The hashable, non-array options of one call (custom_vjp's non-differentiable argument)."""

    theta: float
    scaling: str | None  # the rope_scaling dict as JSON text
    interleaved: bool
    rotary_dim: int | None
    inverse: bool
    validate: bool
    seq_len: int | None

    def call_options(self) -> dict:
        return dict(theta=self.theta,
                    scaling=None if self.scaling is None else json.loads(self.scaling),
                    interleaved=self.interleaved, rotary_dim=self.rotary_dim,
                    inverse=self.inverse, seq_len=self.seq_len)


def apply_rope(q, k=None, positions=None, *, cos_sin_cache=None, cos=None, sin=None,
               theta=10000.0, scaling=None, interleaved=False, rotary_dim=None, inverse=False,
               inplace=False, validate=False, seq_len=None):
    """:func:`cupyrope.apply_rope` for JAX under transformations (grad, jit, vmap).

    Same arguments, results and errors as :func:`cupyrope.apply_rope`; array arguments are JAX
    arrays, tracers or NumPy arrays. ``inplace=True`` raises TypeError (JAX arrays are immutable).
    Options other than arrays (``theta``, ``scaling``, ``rotary_dim`` ...) must be concrete Python
    values.
    """
    if isinstance(inplace, (bool, np.bool_)) and inplace:
        raise TypeError("apply_rope: inplace=True needs a mutable array; q is an immutable JAX array")
    arrays = [_as_jax(x, name) for x, name in zip((q, k, positions, cos_sin_cache, cos, sin),
                                                   _ARGUMENTS)]
    static = _Static(_number(theta, "theta"), _scaling_json(scaling), interleaved, rotary_dim,
                     inverse, validate, seq_len)
    _check_on_stand_ins(static, arrays, inplace)
    q, k, *tables = arrays
    q_out, k_out = _rope(static, q, k, tuple(tables))
    return q_out if k is None else (q_out, k_out)


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
    if isinstance(value, bool):
        raise TypeError(f"apply_rope: {name} must be a number, got bool")
    try:
        return float(value)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            f"apply_rope: {name} must be a concrete number (not a traced value), got "
            f"{type(value).__name__}"
        ) from None


def _scaling_json(scaling) -> str | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(
            "apply_rope: scaling must be None or a Hugging Face rope_scaling dict, "
            f"got {type(scaling).__name__}"
        )

    def plain(value):
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
        raise TypeError(f"apply_rope: scaling holds a value JSON cannot carry: {value!r}")

    return json.dumps(scaling, sort_keys=True, default=plain)


def _stand_in(x):
    """A NumPy array with x's shape, dtype and C-order strides over one element of memory: the
    argument checks read only metadata, so traced shapes are checked without allocating them."""
    if x is None:
        return None
    dtype = np.dtype(x.dtype)
    strides, step = [], dtype.itemsize
    for size in reversed(x.shape):
        strides.append(step)
        step *= max(size, 1)
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=x.shape,
                                           strides=tuple(reversed(strides)), writeable=False)


def _check_on_stand_ins(static: _Static, arrays, inplace) -> None:
    q, k, positions, cache, cos, sin = (_stand_in(x) for x in arrays)
    plan_rope(q, k, positions, cos_sin_cache=cache, cos=cos, sin=sin, inplace=inplace,
              **static.call_options())


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
        on_gpu = _on_gpu(q)
        view = _cupy_view if on_gpu else np.asarray
        arrays = [None if b is None else view(b) for b in (q, k, positions, cache, cos, sin)]
        out_arrays = [view(b) for b in outs]
        if on_gpu:
            _rotate_on_xla_stream(ctx, static, options, arrays, out_arrays)
        else:
            plan = _plan(static, options, arrays)
            if plan.num_tokens and plan.num_q_heads + plan.num_k_heads:
                rotate_on_host(plan, out_arrays)

    return run


def _plan(static: _Static, options: dict, arrays):
    q, k, positions, cache, cos, sin = arrays
    plan = plan_rope(q, k, positions, cos_sin_cache=cache, cos=cos, sin=sin, **options)
    if static.validate:
        check_positions_in_cache(plan)
    return plan


def _on_gpu(buffer) -> bool:
    try:
        buffer.__cuda_array_interface__
    except Exception:  # CPU buffers have no such interface
        return False
    return True


def _cupy_view(buffer):
    """A CuPy array over an XLA device buffer (no copy)."""
    from .kernels import _import_cupy

    cupy = _import_cupy()
    shape, dtype = tuple(buffer.shape), np.dtype(buffer.dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    pointer = buffer.__cuda_array_interface__["data"][0]
    if nbytes == 0 or pointer == 0:
        return cupy.ndarray(shape, dtype=dtype)
    device = cupy.cuda.runtime.pointerGetAttributes(pointer).device
    memory = cupy.cuda.UnownedMemory(pointer, nbytes, owner=buffer, device_id=device)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def _rotate_on_xla_stream(ctx, static: _Static, options: dict, arrays, out_arrays) -> None:
    from .kernels import _import_cupy
    from .launch import rotate_on_gpu

    cupy = _import_cupy()
    device = arrays[0].device.id
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(ctx.stream, device):
        plan = _plan(static, options, arrays)
        if plan.num_tokens and plan.num_q_heads + plan.num_k_heads:
            rotate_on_gpu(plan, [describe(out, "output") for out in out_arrays])
