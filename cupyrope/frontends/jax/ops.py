"""JAX transformations of cupyrope's ops: ``jax.grad``, ``jax.jit`` and ``jax.vmap`` of
:func:`cupyrope.apply_rope` and of the fused ops (:func:`cupyrope.rms_norm_rope`, fp8 outputs,
:func:`cupyrope.rope_and_cache`), and the functional KV-cache update on JAX arrays.

``apply_rope`` and the fused ops send a call here when one of its array arguments is a JAX tracer:
inside ``jax.grad`` / ``jax.vjp`` (a ``custom_vjp``), ``jax.jit`` and ``jax.vmap``. Calls on
concrete JAX arrays outside any transformation keep the DLPack path of ``cupyrope.core.arrays``, except
``rope_and_cache``, which always comes here (see "The KV cache on JAX").

How a traced call runs
----------------------
Each op binds one JAX primitive: ``cupyrope_rope`` (apply_rope) or ``cupyrope_fused``
(rms_norm_rope, fp8 outputs, rope_and_cache). Their params are the hashable static options
(:class:`_Static` / :class:`_Fused`) and which optional arrays are present, so a lowering can plan
the whole call from the params and the operands' shapes. Each platform lowers them its own way:

- XLA's CPU (and any platform without a rule of its own): the jax.numpy formulation of
  :mod:`cupyrope.frontends.jax.lowering`, with the NumPy path's semantics (every angle source, M-RoPE, fused
  RMSNorm, fp8 stores, the paged-cache write). XLA compiles and fuses it like any jnp code, no
  Python runs per execution, and ``jax.export`` serialises it. Computed angles are float64 with
  ``jax_enable_x64`` and an exact fixed-point reduction in 32-bit integers without it (see that
  module). XLA may contract products into fused multiply-adds, so results can differ from the
  eager NumPy path's by an ulp (both within the accuracy contract).
- "cuda": :func:`_gpu_lowering`: one native XLA kernel call of the CUDA kernel the eager planner
  picks (:mod:`cupyrope.frontends.jax.native`, jaxlib's GPU kernel call with NVRTC's PTX): no Python runs
  per execution, XLA puts it in its command buffers, ``jax.export`` serialises it.
- The callback route, a ``jax.experimental.buffer_callback`` (JAX >= 0.7): XLA hands a Python
  callback its own device buffers and compute stream, and the callback runs the CUDA kernel there
  (nothing is copied or synchronised; Python runs at every execution). It takes ``validate=True``
  on every platform (values are read when the call runs; on the CPU the NumPy path writes XLA's
  output buffers), ROCm, a jaxlib without the kernel call (warned once), and the cache write
  inside a per-element ``jax.vmap``.
- ``jax.vmap`` of ``apply_rope``, ``rms_norm_rope`` and fp8 outputs is one primitive call for the
  whole batch: a ``custom_vmap`` rule makes the batch a leading token dim (``_batched_rope``,
  ``_batched_fused``); a batched cos/sin cache, weights or scales, or M-RoPE positions, run once
  per element, and so does ``rope_and_cache`` (the primitives' batching rule, ``jax.lax.map``).

Sharding
--------
Every call but ``rope_and_cache`` and ``validate=True`` is wrapped in a
``jax.experimental.custom_partitioning`` (:func:`_partition`, with a Shardy rule): under
``jax.jit`` with q / k sharded over token dims or heads on a ``Mesh``, each device runs the
primitive on its own shard, with positions and per-token tables sharded like q's tokens and the
cos/sin cache, weights and scales replicated (no collective). What cannot be shard-local is
replicated (gathered) instead: head_dim, dims a mesh axis does not divide, k's heads where the
axis does not divide Hk, and the last token dim when positions are the implicit arange along it.
``rope_and_cache`` and validating calls are not partitioned: XLA runs them on replicated operands.

fp8 arrays cross the callback as their bits (uint8 buffers, bitcast by XLA on either side, which
costs nothing): XLA's buffers offer no CUDA array interface for fp8, and the kernels are told the
format, as for CuPy's uint8 fp8 arrays. The native call takes them as they are.

Argument errors are raised while tracing (the checks run on the traced shapes and dtypes), with
the same exception types and messages as eager calls. ``validate=True`` reads positions (and slots)
inside the callback: an out-of-range value then surfaces as a ``JaxRuntimeError`` carrying the
IndexError's message, when the computation runs. Options that are not arrays (``theta``, ``eps``,
``weight_offset``, ``rotary_dim`` ...) must be concrete Python values; fp8 scales may be traced
(0-d or one-element float32 arrays, read when the call runs).

Gradients (``custom_vjp``)
--------------------------
- ``apply_rope``: the gradient of a rotation is the inverse rotation of the cotangent, so the
  backward pass is the same primitive with ``inverse`` flipped, for q and k in one launch.
- ``rms_norm_rope`` (q, k, q_weight, k_weight): per head, in float32, ``r = rsqrt(mean(x**2) +
  eps)``, ``n = x * r``, ``w' = weight_offset + w``, ``y = rotate(n * w')``. Backward from ``g_y``:
  ``g = rotate⁻¹(g_y)`` (the inverse-rotation primitive, q and k in one launch), ``g_w = sum(g * n)``
  over the token and head dims, ``g_n = g * w'``, ``g_x = r * (g_n - n * mean(g_n * n))`` (jnp).
- Positions, tables, scales, v, the caches and slots get no cotangent (zero), as in the torch path.
- fp8 outputs have no gradient and ``rope_and_cache`` has none here: differentiating either raises
  while tracing (TypeError, NotImplementedError), naming the op.

The KV cache on JAX
-------------------
JAX arrays are immutable, so ``rope_and_cache`` on JAX arrays (concrete or traced) is functional:
it returns ``(q_out, k_out, k_cache_new, v_cache_new)`` and leaves its arguments unchanged. The new
caches are a scatter into the input caches (CPU) or the callback's outputs aliased to them: XLA
updates a cache in place when the caller donates it (``jax.jit(..., donate_argnums=...)``) and
copies it first otherwise, so the rows no slot names always equal the input cache's. q and k are
not rotated in place: the call needs ``inplace=False`` (the default ``inplace=True`` raises
TypeError), and q_out, k_out are new arrays. Caches that are not JAX arrays are refused.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.interpreters import mlir

from ... import execute
from . import lowering as jax_lowering, native as jax_native
from ...core.arrays import cupy_module, cupy_view_of_buffer, describe, describe_traced, on_gpu_buffer
from ...core.dtypes import FP8_DTYPES, dtype_name, numpy_dtype
from ...core.fused_plan import plan_fused
from ...cuda.compiler import current_device
from ...core.plan import check_values, plan_rope
from ...core.scaling import Scaling
from ...core.validators import check_real

_ARGUMENTS = ("q", "k", "positions", "cos_sin_cache", "cos", "sin")
_TABLES = ("cos_sin_cache", "cos", "sin")
# The fused ops' array arguments besides the rotation's, in the order the callback takes them.
_FUSED_ARRAYS = ("q_weight", "k_weight", "v", "k_cache", "v_cache", "slot_mapping")
_SCALES = ("q_scale", "k_scale", "v_scale")  # numbers (static) or arrays (operands)
_CACHES = ("k_cache", "v_cache")
_VALIDATED = ("positions", "cos", "sin", "slot_mapping")  # what validate=True reads


def is_traced(*arrays) -> bool:
    """True when any argument is a JAX tracer (inside jax.grad / jax.jit / jax.vmap ...)."""
    tracer = jax.core.Tracer
    return any(isinstance(x, tracer) for x in arrays)


def updates_jax_cache(q, fusion: dict) -> bool:
    """True for a KV-cache write on JAX arrays, concrete ones included: its new caches come from
    XLA (the module docstring's "The KV cache on JAX"), so such a call always runs here."""
    return fusion.get("k_cache") is not None and isinstance(q, jax.Array)


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


class _Fused(NamedTuple):
    """The hashable description of one fused call: the rotation's options, the fused options that
    are not arrays (canonical: fp8 dtypes by name), and the names of the array arguments given, in
    the order the callback receives them."""

    op_name: str
    rope: _Static
    options: tuple[tuple[str, object], ...]
    names: tuple[str, ...]
    # One element of a jax.vmap run per element (_per_element): a cache write there keeps the
    # callback on GPUs (see _gpu_lowering).
    per_element: bool = False


def apply_rope(q, k=None, positions=None, *, cos_sin_cache=None, cos=None, sin=None,
               theta=10000.0, scaling=None, interleaved=False, rotary_dim=None, inverse=False,
               inplace=False, validate=False, seq_len=None, out=None):
    """:func:`cupyrope.apply_rope` for JAX under transformations (grad, jit, vmap).

    Same arguments, results and errors as :func:`cupyrope.apply_rope`; array arguments are JAX
    arrays, tracers or NumPy arrays. ``inplace=True`` raises TypeError (JAX arrays are immutable).
    Options other than arrays (``theta``, ``scaling``, ``rotary_dim`` ...) must be concrete Python
    values.
    """
    if out is not None:
        raise TypeError("apply_rope: out= writes into its arrays and JAX arrays are immutable; "
                        "use the returned arrays instead")
    arrays = [_as_jax(x, name) for x, name in zip((q, k, positions, cos_sin_cache, cos, sin),
                                                   _ARGUMENTS)]
    static = _Static(_number(theta, "theta"), _hashable_scaling(scaling), interleaved,
                     rotary_dim, inverse, validate, seq_len)
    # Argument errors are raised now, while tracing, from the traced shapes and dtypes.
    _plan_rotation({name: describe_traced(x, name) for x, name in zip(arrays, _ARGUMENTS)
                    if x is not None}, static, inplace=inplace)
    q, k, *tables = arrays
    q_out, k_out = _rope(static, q, k, tuple(tables))
    return q_out if k is None else (q_out, k_out)


def run_fused(op_name, q, k, positions, *, rope: dict, fusion: dict, validate: bool):
    """A fused op (``rms_norm_rope``, ``rope_and_cache``, ``apply_rope(out_dtype=...)``) with a
    JAX tracer among its arguments, or a ``rope_and_cache`` on JAX arrays: checked now, run by one
    primitive (see the module docstring). Returns what :func:`cupyrope.execute.run_fused`
    returns, with new caches in place of the written ones."""
    inplace = rope["inplace"]
    if op_name == "rope_and_cache" and isinstance(inplace, (bool, np.bool_)) and inplace:
        raise TypeError(
            "rope_and_cache: JAX arrays are immutable, so q and k cannot be rotated in place: pass "
            "inplace=False (q_out and k_out are new arrays, and the call returns new caches, "
            "updated in place by XLA where the caller donates them)")
    given = {"q": q, "k": k, "positions": positions, **{name: rope[name] for name in _TABLES},
             **{name: fusion.get(name) for name in _FUSED_ARRAYS + _SCALES}}
    arrays = {name: _fused_array(x, name, op_name) for name, x in given.items()
              if x is not None and not (name in _SCALES and _is_number(x))}
    options = {name: value for name, value in fusion.items()
               if name not in _FUSED_ARRAYS and name not in arrays}
    for name, value in options.items():
        _refuse_tracer(value, name, op_name)
    traced = is_traced(*arrays.values())
    static = _Static(_number(rope["theta"], "theta", op_name),
                     _hashable_scaling(rope["scaling"], op_name), rope["interleaved"],
                     rope["rotary_dim"], rope["inverse"], validate and traced, rope["seq_len"])
    # Argument errors are raised now, while tracing, from the shapes and dtypes; values
    # (validate=True) now for concrete arrays, else where the call runs.
    infos = {name: _planning_info(x, name, read=validate and not traced)
             for name, x in arrays.items()}
    f = _plan(op_name, static, options, infos, inplace=inplace,
              validate=validate and not traced).fusion
    # Canonical, hashable options for the callback (eps is ignored without the norm).
    options.update(out_dtype=f.out_dtype, eps=f.eps if f.norm else None,
                   weight_offset=f.weight_offset)
    if f.writes_cache:
        options.update(cache_dtype=f.cache_dtype)
    fused = _Fused(op_name, static, tuple(sorted(options.items())), tuple(arrays))
    outs = _fused(fused, tuple(arrays.values()))
    if f.writes_cache:
        return outs
    return outs[0] if k is None else (outs[0], outs[1])


def _as_jax(x, name: str, op_name: str = "apply_rope"):
    if x is None or isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    raise TypeError(
        f"{op_name}: {name} must be a JAX or NumPy array when another argument is a JAX array or "
        f"tracer, got {type(x).__module__}.{type(x).__qualname__}"
    )


def _fused_array(x, name: str, op_name: str):
    """An array argument of a fused call as a JAX array; a NumPy cache stays as it is, to be
    refused by the checks (it would not be written: the call returns new caches)."""
    if name in _CACHES and isinstance(x, np.ndarray):
        return x
    return _as_jax(x, name, op_name)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _refuse_tracer(value, name: str, op_name: str) -> None:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{op_name}: {name} must be a concrete number (not a traced value), got "
            f"{type(value).__name__}"
        )


def _number(value, name: str, op_name: str = "apply_rope") -> float:
    _refuse_tracer(value, name, op_name)
    return check_real(value, name, op_name)


def _hashable_scaling(scaling, op_name: str = "apply_rope") -> Scaling | None:
    frozen = Scaling.from_dict(scaling)
    try:
        hash(frozen)
    except TypeError:
        raise TypeError(f"{op_name}: scaling holds a value JAX cannot take as a static "
                        f"argument (unhashable): {scaling!r}") from None
    return frozen


def _planning_info(x, name: str, *, read: bool):
    """What a fused call is checked with before it runs: the shape and dtype of a JAX array
    (``describe_traced``), a NumPy cache as it is (the checks refuse it)."""
    if isinstance(x, np.ndarray):
        return describe(x, name)
    info = describe_traced(x, name)
    if name in _CACHES:
        info.writable = True  # the call writes new caches (XLA's buffers), never this array
    elif name in _SCALES and info.size == 1:
        info.view = np.ones(info.shape, np.float32)  # the checks read a value; the call reads x
    elif read and name in _VALIDATED:
        info.view = np.asarray(x)  # validate=True on concrete arrays: checked now, on the host
    return info


def _plan(op_name: str, static: _Static, options: dict, named: dict, *, inplace=False,
          validate: bool):
    """The checked plan of a fused call from its arrays by name (ArrayInfos while tracing, NumPy
    or CuPy views of XLA's buffers in the callback)."""
    return plan_fused(
        op_name, named["q"], named.get("k"), named.get("positions"),
        rope=dict(static.call_options(), inplace=inplace,
                  **{name: named.get(name) for name in _TABLES}),
        fusion=dict(options, **{name: x for name, x in named.items()
                                if name in _FUSED_ARRAYS or name in _SCALES}),
        validate=validate)


# ----------------------------------------------------------------------------------------------
# custom_vjp: apply_rope


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope(static: _Static, q, k, tables):
    return _call(static, q, k, tables)


def _rope_fwd(static: _Static, q, k, tables):
    return _call(static, q, k, tables), tables


def _rope_bwd(static: _Static, tables, cotangents):
    grad_q_out, grad_k_out = cotangents
    grad_q, grad_k = _inverse_rotation(static, grad_q_out, grad_k_out, tables)
    # Positions, tables: not differentiated (None: a zero cotangent, float0 for integers).
    return grad_q, grad_k, tuple(None for _ in tables)


_rope.defvjp(_rope_fwd, _rope_bwd)


def _inverse_rotation(static: _Static, grad_q, grad_k, tables):
    """The gradient of a rotation: the cotangents rotated back, q and k in one launch."""
    back = static._replace(inverse=not static.inverse, validate=False)
    return _call(back, grad_q, grad_k, tables)


def _call(static: _Static, q, k, tables):
    """(q_out, k_out or None) through one buffer_callback; under ``jax.vmap``, one call for the
    whole batch where it folds into the token dims (:func:`_batched_rope`)."""
    return _batched_rope(static)(q, k, tables)


@functools.lru_cache(maxsize=1024)
def _batched_rope(static: _Static):
    """The rotation with a vmap rule: the batch becomes one more (leading) token dim of q and k,
    so a vmapped call is one launch, not one per element. Positions and per-token tables that are
    batched get that dim too (aligned with q's token dims: broadcasting aligns from the right, so
    ones are inserted after the batch dim); unbatched ones broadcast over it as they broadcast
    over any token dim, and the cos/sin cache is shared. A batched cache, or M-RoPE positions
    (their component dim leads), cannot fold: those run per element (``jax.lax.map``)."""
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def rope(q, k, tables):
        return _rope_call(static, q, k, tables)

    @rope.def_vmap
    def rule(axis_size, in_batched, q, k, tables):
        q_batched, k_batched, tables_batched = in_batched
        positions, cache, cos, sin = tables
        token_ndim = q.ndim - 2 - (1 if q_batched else 0)  # the per-element token dims
        positions_batched, cache_batched, cos_batched, sin_batched = tables_batched
        mrope = positions is not None and positions.ndim - positions_batched > token_ndim
        if cache_batched or mrope:
            return _rotation_per_element(rope, axis_size, in_batched, q, k, tables)

        q_all = _leading(q, q_batched, axis_size)
        k_all = None if k is None else _leading(k, k_batched, axis_size)
        folded = (_aligned(positions, positions_batched, 0, token_ndim), cache,
                  _aligned(cos, cos_batched, 1, token_ndim),
                  _aligned(sin, sin_batched, 1, token_ndim))
        q_out, k_out = _rope_call(static, q_all, k_all, folded)
        return (q_out, k_out), (True, None if k is None else True)

    return rope


def _leading(x, batched, axis_size):
    """x with the vmapped batch as its first dim (broadcast where x is not batched)."""
    return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))


def _aligned(x, batched, trailing: int, token_ndim: int):
    """A batched per-token array (positions: ``trailing`` 0; cos / sin tables: 1) with ones after
    its batch dim, so that the batch lines up with q's new leading token dim; unbatched arrays
    broadcast over that dim as they are."""
    if x is None or not batched:
        return x
    missing = token_ndim - (x.ndim - 1 - trailing)
    return x.reshape(x.shape[:1] + (1,) * missing + x.shape[1:])


def _rotation_per_element(rope, axis_size, in_batched, q, k, tables):
    """A vmapped rotation one element at a time (what cannot fold into the token dims)."""
    args = (q, k, tuple(tables))
    in_batched = (in_batched[0], in_batched[1], tuple(in_batched[2]))
    batched = jax.tree_util.tree_map(lambda x, b: x if x is None else _leading(x, b, axis_size),
                                     args, in_batched, is_leaf=lambda x: x is None)
    q_out, k_out = jax.lax.map(lambda element: rope(*element), batched)
    return (q_out, k_out), (True, None if k is None else True)


def _callback_call(static: _Static, q, k, tables):
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

    def rotate(inputs, outputs):
        it = iter(inputs)
        q = next(it)
        k, positions, cache, cos, sin = (next(it) if here else None for here in present)
        plan = plan_rope(q, k, positions, cos_sin_cache=cache, cos=cos, sin=sin, **options)
        if static.validate:
            check_values(plan)
        execute.rotate_into(plan, outputs)

    def run(ctx, outs, *buffers):
        _on_buffers(ctx, buffers, outs, rotate)

    return run


def _on_buffers(ctx, buffers, outs, body) -> None:
    """``body(inputs, outputs)`` on XLA's buffers: NumPy views on the CPU; on a GPU, CuPy views,
    with XLA's device and stream current, so the kernel runs on XLA's stream, on XLA's buffers
    (nothing is copied or synchronised)."""
    if not on_gpu_buffer(outs[0]):
        body([np.asarray(b) for b in buffers], [np.asarray(b) for b in outs])
        return
    inputs = [cupy_view_of_buffer(b) for b in buffers]
    outputs = [cupy_view_of_buffer(b) for b in outs]
    cupy = cupy_module()
    device = outputs[0].device.id
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(ctx.stream, device):
        body(inputs, outputs)


# ----------------------------------------------------------------------------------------------
# custom_vjp: the fused ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(fused: _Fused, arrays: tuple):
    return _fused_call(fused, arrays)


def _fused_fwd(fused: _Fused, arrays: tuple):
    options = dict(fused.options)
    if "k_cache" in fused.names:
        raise NotImplementedError(
            "rope_and_cache: jax.grad through the KV-cache write is not available; differentiate "
            "rms_norm_rope or apply_rope, or pass inputs wrapped in jax.lax.stop_gradient")
    if options["out_dtype"] is not None:
        raise TypeError(
            f"{fused.op_name}: fp8 outputs (out_dtype={options['out_dtype']!r}) have no gradient; "
            "differentiate the call without out_dtype (and quantise its result), or pass inputs "
            "wrapped in jax.lax.stop_gradient")
    return _fused_call(fused, arrays), arrays


def _fused_bwd(fused: _Fused, arrays: tuple, cotangents):
    """rms_norm_rope's gradient (the only fused call _fused_fwd lets through): the inverse
    rotation of the float32 cotangents, then RMSNorm's backward per head, in float32."""
    named = dict(zip(fused.names, arrays))
    options = dict(fused.options)
    grads = [g.astype(jnp.float32) for g in cotangents]
    rotated = _inverse_rotation(fused.rope, grads[0], grads[1] if len(grads) > 1 else None,
                                tuple(named.get(name) for name in ("positions", *_TABLES)))
    result = {name: None for name in fused.names}
    for x_name, w_name, grad in zip(("q", "k"), ("q_weight", "k_weight"), rotated):
        if x_name in named:
            result[x_name], result[w_name] = _rms_norm_vjp(
                named[x_name], named[w_name], grad, options["eps"], options["weight_offset"])
    return (tuple(result[name] for name in fused.names),)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _rms_norm_vjp(x, weight, grad, eps: float, weight_offset: float):
    """(grad of x, grad of weight) of ``y = x * rsqrt(mean(x**2) + eps) * (weight_offset +
    weight)`` per head (last dim), given the grad of y; in float32, returned in the dtypes of x
    and weight."""
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    n = x32 * r
    grad_weight = jnp.sum(grad * n, axis=tuple(range(grad.ndim - 1)))
    grad_n = grad * (weight_offset + weight.astype(jnp.float32))
    grad_x = r * (grad_n - n * jnp.mean(grad_n * n, axis=-1, keepdims=True))
    return grad_x.astype(x.dtype), grad_weight.astype(weight.dtype)


def _fused_call(fused: _Fused, arrays: tuple) -> tuple:
    """The outputs of a fused call: under ``jax.vmap``, one call for the whole batch where it
    folds into the token dims (:func:`_batched_fused`); the cache write runs per element (its
    caches and slots have no token dims to fold into)."""
    if any(name in fused.names for name in _CACHES):
        return _fused_primitive_call(fused, arrays)
    return _batched_fused(fused)(arrays)


# Arrays of a fused call that are per token (folded under vmap) rather than shared by all tokens.
_PER_TOKEN = {"q": None, "k": None, "positions": 0, "cos": 1, "sin": 1}  # name -> trailing dims


@functools.lru_cache(maxsize=1024)
def _batched_fused(fused: _Fused):
    """A fused call without a cache write (rms_norm_rope, fp8 outputs) with the vmap rule of
    :func:`_batched_rope`: the batch a leading token dim of q and k, batched positions and
    per-token tables aligned with it; the cos/sin cache, RMSNorm weights and fp8 scales must be
    shared by the batch (a batched one, or M-RoPE positions, runs per element)."""
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def call(arrays):
        return _fused_primitive_call(fused, arrays)

    @call.def_vmap
    def rule(axis_size, in_batched, arrays):
        (flags,) = in_batched
        batched = dict(zip(fused.names, flags))
        named = dict(zip(fused.names, arrays))
        token_ndim = named["q"].ndim - 2 - (1 if batched["q"] else 0)
        positions = named.get("positions")
        mrope = positions is not None and positions.ndim - batched["positions"] > token_ndim
        if mrope or any(batched[name] for name in fused.names if name not in _PER_TOKEN):
            whole = tuple(_leading(x, b, axis_size) for x, b in zip(arrays, flags))
            outs = jax.lax.map(call, whole)
        else:
            def folded(name, x):
                if name not in _PER_TOKEN:
                    return x  # shared by the batch
                if _PER_TOKEN[name] is None:  # q, k
                    return _leading(x, batched[name], axis_size)
                return _aligned(x, batched[name], _PER_TOKEN[name], token_ndim)

            outs = _fused_primitive_call(fused, tuple(folded(n, x) for n, x in named.items()))
        return outs, tuple(True for _ in outs)

    return call


def _fused_callback_call(fused: _Fused, arrays: tuple) -> tuple:
    """The outputs of a fused call through one buffer_callback: q_out (k_out), then the new caches
    (outputs aliased to the input caches). fp8 arrays cross as their bits (uint8)."""
    from jax.experimental.buffer_callback import buffer_callback

    named = dict(zip(fused.names, arrays))
    out_dtype = dict(fused.options)["out_dtype"]
    rotated = [named[name] for name in ("q", "k") if name in named]
    stored = jnp.uint8 if out_dtype is not None else rotated[0].dtype
    results = [jax.ShapeDtypeStruct(x.shape, stored) for x in rotated]
    inputs, aliases = [_bits(x) for x in arrays], {}
    for name in _CACHES:
        if name in named:
            index = fused.names.index(name)
            aliases[index] = len(results)
            results.append(jax.ShapeDtypeStruct(inputs[index].shape, inputs[index].dtype))
    run = buffer_callback(_fused_callback(fused), tuple(results), vmap_method="sequential",
                          input_output_aliases=aliases or None)
    outs = list(run(*inputs))
    if out_dtype is not None:
        outs[:len(rotated)] = [jax.lax.bitcast_convert_type(o, out_dtype)
                               for o in outs[:len(rotated)]]
    for position, name in enumerate((name for name in _CACHES if name in named), len(rotated)):
        if outs[position].dtype != named[name].dtype:  # an fp8 cache, back from its bits
            outs[position] = jax.lax.bitcast_convert_type(outs[position], named[name].dtype)
    return tuple(outs)


def _bits(x):
    """An fp8 array as its bits (uint8); any other array as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if dtype_name(x.dtype) in FP8_DTYPES else x


@functools.lru_cache(maxsize=1024)
def _fused_callback(fused: _Fused):
    """The callback of one fused call description (memoised: its identity keys JAX's compile
    caches). It checks the call again on XLA's buffers (cheap; validate=True reads values here)
    and runs the fused kernel or the NumPy path."""
    options = dict(fused.options)
    rotated = 2 if "k" in fused.names else 1

    def rotate(inputs, outputs):
        named = dict(zip(fused.names, inputs))
        if "k_cache" in named:
            # Written where XLA wants the new caches: outputs aliased to the input caches, which
            # hold the input caches' rows when the callback starts. Where XLA did not alias them
            # (jax.vmap over batched caches on a GPU hands each element a fresh output slice),
            # the input rows are copied first, so that rows no slot names keep their values.
            for name, out in zip(("k_cache", "v_cache"), outputs[rotated:]):
                if describe(out, name).ptr != describe(named[name], name).ptr:
                    out[...] = named[name]
            named["k_cache"], named["v_cache"] = outputs[rotated:]
        plan = _plan(fused.op_name, fused.rope, options, named, validate=fused.rope.validate)
        execute.rotate(plan, [_output_info(out, options["out_dtype"])
                              for out in outputs[:rotated]])

    def run(ctx, outs, *buffers):
        _on_buffers(ctx, buffers, outs, rotate)

    return run


def _output_info(out, out_dtype: str | None):
    """The ArrayInfo of an output buffer; fp8 outputs are uint8 buffers holding that format."""
    info = describe(out, "output")
    if out_dtype is not None:
        info.dtype = out_dtype
    return info


# ----------------------------------------------------------------------------------------------
# The primitives: what a traced call binds, and how each platform lowers it


def _primitive(name: str, abstract_eval):
    from jax._src import dispatch
    from jax.extend.core import Primitive

    primitive = Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(abstract_eval)
    return primitive


def _rope_abstract_eval(*avals, static: _Static, present: tuple[bool, ...]):
    """q_out (and k_out): the shapes and dtypes of q (and k)."""
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in avals[:1 + present[0]]]


def _fused_abstract_eval(*avals, fused: _Fused):
    """q_out (k_out) in the fp8 out_dtype or their own, then the new caches (the input caches')."""
    named = dict(zip(fused.names, avals))
    out_dtype = dict(fused.options)["out_dtype"]
    outs = [jax.core.ShapedArray(named[name].shape,
                                 named[name].dtype if out_dtype is None else numpy_dtype(out_dtype))
            for name in ("q", "k") if name in named]
    return outs + [jax.core.ShapedArray(named[name].shape, named[name].dtype)
                   for name in _CACHES if name in named]


# cupyrope_rope: operands q, then those of k, positions, cos_sin_cache, cos, sin that ``present``
# marks; params ``static`` (_Static), ``present`` (5 bools). Results q_out (, k_out).
_rope_p = _primitive("cupyrope_rope", _rope_abstract_eval)
# cupyrope_fused: operands the arrays of ``fused.names`` in that order (fp8 arrays as they are);
# param ``fused`` (_Fused). Results q_out (, k_out) (, k_cache_new, v_cache_new).
_fused_p = _primitive("cupyrope_fused", _fused_abstract_eval)


def _rope_operands(static: _Static, q, k, tables):
    present = tuple(x is not None for x in (k, *tables))
    return [x for x in (q, k, *tables) if x is not None], dict(static=static, present=present)


def _rope_call(static: _Static, q, k, tables):
    """(q_out, k_out or None) through one ``cupyrope_rope``, partitionable (see "Sharding")."""
    operands, params = _rope_operands(static, q, k, tables)
    outs = _bind("rope", params, operands, partitioned=not static.validate)
    return outs[0], (outs[1] if k is not None else None)


def _fused_primitive_call(fused: _Fused, arrays: tuple) -> tuple:
    """The outputs of a fused call through one ``cupyrope_fused``; partitionable unless it writes
    a cache (see "Sharding")."""
    partitioned = not fused.rope.validate and not any(name in fused.names for name in _CACHES)
    return tuple(_bind("fused", dict(fused=fused), list(arrays), partitioned=partitioned))


def _rope_names(present: tuple[bool, ...]) -> tuple[str, ...]:
    """The names of a ``cupyrope_rope``'s operands: q, then the present ones of k, positions,
    cos_sin_cache, cos, sin."""
    return ("q",) + tuple(name for name, here in zip(_ARGUMENTS[1:], present) if here)


def _named_operands(present: tuple[bool, ...], operands) -> dict:
    """The rotation's operands by name (absent ones None)."""
    return dict(dict.fromkeys(_ARGUMENTS), **dict(zip(_rope_names(present), operands)))


def _plan_rotation(infos: dict, static: _Static, *, inplace: bool = False):
    """The checked plan of a rotation from its arrays' infos by name (absent ones left out)."""
    return plan_rope(infos["q"], infos.get("k"), infos.get("positions"),
                     **{name: infos.get(name) for name in _TABLES}, inplace=inplace,
                     **static.call_options())


def _rope_jnp(*operands, static: _Static, present: tuple[bool, ...]):
    """cupyrope_rope as jax.numpy (:mod:`cupyrope.frontends.jax.lowering`), planned from the shapes."""
    named = _named_operands(present, operands)
    plan = _plan_rotation({name: describe_traced(x, name) for name, x in named.items()
                           if x is not None}, static)
    outs = jax_lowering.rotate(plan, *(named[name] for name in _ARGUMENTS))
    return [x for x in outs if x is not None]


def _rope_callback_outputs(*operands, static: _Static, present: tuple[bool, ...]):
    """cupyrope_rope through the buffer_callback (GPU, and validate=True on any platform)."""
    named = _named_operands(present, operands)
    q_out, k_out = _callback_call(static, named["q"], named["k"],
                                  tuple(named[name] for name in _ARGUMENTS[2:]))
    return [q_out] + ([k_out] if k_out is not None else [])


def _fused_jnp(*arrays, fused: _Fused):
    """cupyrope_fused as jax.numpy (:mod:`cupyrope.frontends.jax.lowering`), planned from the shapes."""
    named = dict(zip(fused.names, arrays))
    options = dict(fused.options)
    infos = {name: _planning_info(x, name, read=False) for name, x in named.items()}
    plan = _plan(fused.op_name, fused.rope, options, infos, validate=False)
    scales = {name: named.get(name, options.get(name)) for name in _SCALES}
    return list(jax_lowering.fused(
        plan, *(named.get(name) for name in _ARGUMENTS),
        **{name: named.get(name) for name in _FUSED_ARRAYS}, scales=scales))


def _fused_callback_outputs(*arrays, fused: _Fused):
    return list(_fused_callback_call(fused, arrays))


def _lower_rope(ctx, *operands, static: _Static, present: tuple[bool, ...]):
    """cupyrope_rope on XLA's CPU (and any platform without a lowering of its own): jax.numpy;
    validate=True reads positions when the call runs, so it keeps the callback."""
    body = _rope_callback_outputs if static.validate else _rope_jnp
    return mlir.lower_fun(functools.partial(body, static=static, present=present),
                          multiple_results=True)(ctx, *operands)


def _lower_fused(ctx, *arrays, fused: _Fused):
    """cupyrope_fused on XLA's CPU: as :func:`_lower_rope`."""
    body = _fused_callback_outputs if fused.rope.validate else _fused_jnp
    return mlir.lower_fun(functools.partial(body, fused=fused),
                          multiple_results=True)(ctx, *arrays)


def _gpu_lowering(kind: str, platform: str, ctx, *operands, **params):
    """The lowering of a cupyrope primitive on a GPU ("cuda", "rocm").

    ``kind`` "rope": ``operands`` q, then k, positions, cos_sin_cache, cos, sin where
    ``params["present"]`` (5 bools, in that order) marks them; ``params["static"]`` is the
    :class:`_Static` options. ``kind`` "fused": ``operands`` the arrays of
    ``params["fused"].names`` (a :class:`_Fused`: the op, its rotation's _Static, its canonical
    options, fp8 arrays as fp8); results q_out (k_out) then the new caches, which a lowering
    aliases to the input caches. Returns the results' IR values.

    The rotation on NVIDIA GPUs is a native XLA kernel call (:mod:`cupyrope.frontends.jax.native`) where
    this jaxlib offers one, and so are the fused ops; validate=True, ROCm, a jaxlib without the
    kernel call (warned once) and the cache write inside a per-element jax.vmap take the
    buffer_callback route, on XLA's buffers and stream. (The cache write's new caches are aliased
    to the input caches; as a native call inside jax.lax.map, XLA on jaxlib 0.11.2 did not keep
    that aliasing, and rows no slot names came out zero: the callback checks and copies where XLA
    does not alias.)"""
    validate = (params["static"] if kind == "rope" else params["fused"].rope).validate
    if platform == "cuda" and not validate:
        reason = jax_native.unavailable_reason()
        if reason is None:
            if kind == "rope":
                names = _rope_names(params["present"])
                infos = jax_native.planning_infos(ctx.avals_in, names, current_device())
                return jax_native.lower_planned(ctx, operands, names,
                                                _plan_rotation(infos, params["static"]))
            fused = params["fused"]
            if not (fused.per_element and any(name in fused.names for name in _CACHES)):
                return jax_native.lower_planned(ctx, operands, fused.names, _native_fused_plan(
                    ctx, fused))
        else:
            _warn_callback_route(reason)
    body = _rope_callback_outputs if kind == "rope" else _fused_callback_outputs
    return mlir.lower_fun(functools.partial(body, **params), multiple_results=True)(ctx, *operands)


def _native_fused_plan(ctx, fused: _Fused):
    """The checked plan of a fused call for the native kernel call, from XLA's shapes (as
    :func:`_planning_info` prepares them for the checks: the caches are written, one-element
    scales are read by the kernel)."""
    infos = jax_native.planning_infos(ctx.avals_in, fused.names, current_device())
    for name, info in infos.items():
        if name in _CACHES:
            info.writable = True
        elif name in _SCALES and info.size == 1:
            info.view = np.ones(info.shape, np.float32)
    return _plan(fused.op_name, fused.rope, dict(fused.options), infos, validate=False)


@functools.lru_cache(maxsize=None)
def _warn_callback_route(reason: str) -> None:
    """Say once (per reason) that traced calls on this GPU run through the callback."""
    warnings.warn(f"cupyrope: calls under jax.jit run through a Python callback on this GPU "
                  f"(no native XLA call: {reason}); it works, with a Python call per execution",
                  RuntimeWarning, stacklevel=2)


def _per_element(primitive, args, dims, **params):
    """The batching rule of both primitives: one call per element (``jax.lax.map``). The
    custom_vmap rules fold what can be folded before a primitive sees a batch; what reaches here
    (rope_and_cache, whose caches and slots have no token dims) runs per element."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    leading = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
               for a, d in zip(args, dims)]
    if "fused" in params:
        params = dict(params, fused=params["fused"]._replace(per_element=True))
    outs = jax.lax.map(lambda element: primitive.bind(*element, **params), leading)
    return outs, [0] * len(outs)


def _lower_on_gpu(kind: str, platform: str, ctx, *operands, **params):
    # _gpu_lowering is looked up when a call is lowered, so that replacing it takes effect.
    return _gpu_lowering(kind, platform, ctx, *operands, **params)


def _register_lowerings() -> None:
    from jax.interpreters import batching

    for primitive in (_rope_p, _fused_p):
        batching.primitive_batchers[primitive] = functools.partial(_per_element, primitive)
    mlir.register_lowering(_rope_p, _lower_rope)
    mlir.register_lowering(_fused_p, _lower_fused)
    for platform in ("cuda", "rocm"):
        # Looked up when a call is lowered, so that replacing _gpu_lowering takes effect.
        mlir.register_lowering(_rope_p, functools.partial(_lower_on_gpu, "rope", platform),
                               platform=platform)
        mlir.register_lowering(_fused_p, functools.partial(_lower_on_gpu, "fused", platform),
                               platform=platform)


_register_lowerings()


# ----------------------------------------------------------------------------------------------
# Sharding: a custom_partitioning around each primitive call


class _Bound(NamedTuple):
    """One primitive call, hashable (custom_partitioning's static argument): which primitive,
    its params as sorted items, and the names of its operands in order."""

    kind: str  # "rope" or "fused"
    params: tuple[tuple[str, object], ...]
    names: tuple[str, ...]

    def bind(self, operands) -> tuple:
        primitive = _rope_p if self.kind == "rope" else _fused_p
        return tuple(primitive.bind(*operands, **dict(self.params)))

    @property
    def implicit_positions(self) -> bool:
        """Positions are an arange along the last token dim (computed or cache angles without
        positions): a shard of that dim would restart it."""
        return "positions" not in self.names and "cos" not in self.names


def _bind(kind: str, params: dict, operands: list, *, partitioned: bool) -> tuple:
    names = _rope_names(params["present"]) if kind == "rope" else params["fused"].names
    bound = _Bound(kind, tuple(sorted(params.items())), names)
    if not partitioned:
        return bound.bind(operands)
    return _partitioned_call()(bound, *operands)


def _bound_call(bound: _Bound, *operands):
    return bound.bind(operands)


@functools.lru_cache(maxsize=1)
def _partitioned_call():
    """The custom_partitioning of every partitionable call: each shard runs the primitive on its
    tokens and heads (see :func:`_partition`)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    call = custom_partitioning(_bound_call, static_argnums=(0,))
    call.def_partition(partition=_partition, sharding_rule=_sharding_rule,
                       infer_sharding_from_operands=_infer_sharding,
                       propagate_user_sharding=None)
    return call


# Arrays indexed per token, and how many trailing dims each has past the token dims; M-RoPE
# positions also have a leading component dim.
_TOKEN_ALIGNED = {"positions": 0, "cos": 1, "sin": 1}


def _dims(bound: _Bound, shapes: dict) -> dict:
    """For each operand, per dim, what it indexes: ("token", i), ("head", name) / ("head_dim",)
    for q and k, or None (its own: replicated)."""
    n = len(shapes["q"]) - 2
    token_shape = shapes["q"][:n]
    dims = {}
    for name, shape in shapes.items():
        if name in ("q", "k"):
            dims[name] = tuple(("token", i) for i in range(n)) + (("head", name), ("head_dim",))
        elif name in _TOKEN_ALIGNED:
            trailing = _TOKEN_ALIGNED[name]
            leading = 1 if name == "positions" and len(shape) > n and shape[0] == 3 and (
                _is_mrope(bound)) else 0
            core = shape[leading:len(shape) - trailing]
            offset = n - len(core)
            dims[name] = ((None,) * leading + tuple(
                ("token", offset + i) if offset + i >= 0 and size == token_shape[offset + i]
                and size != 1 else None for i, size in enumerate(core)) + (None,) * trailing)
        else:
            dims[name] = (None,) * len(shape)
    return dims


def _is_mrope(bound: _Bound) -> bool:
    params = dict(bound.params)
    static = params["static"] if bound.kind == "rope" else params["fused"].rope
    scaling = static.scaling.as_dict() if static.scaling is not None else None
    return bool(scaling and scaling.get("mrope_section") is not None)


def _sharding_rule(bound: _Bound, mesh, operand_types, result_types):
    """Shardy's rule: one factor per token dim (shared by q, k, positions and per-token tables),
    heads of q and of k (two factors: their counts may differ), head_dim; everything else its
    own factors. The implicit arange's token dim needs replication."""
    from jax.experimental.custom_partitioning import SdyShardingRule
    from jax._src.lib.mlir import ir

    shapes = {name: tuple(ir.ShapedType(t).shape) for name, t in zip(bound.names, operand_types)}
    dims = _dims(bound, shapes)

    def factor(name, index, dim):
        if dim is None:
            return f"{name}_{index}"
        return {"token": lambda: f"t{dim[1]}", "head": lambda: f"h_{dim[1]}",
                "head_dim": lambda: "d"}[dim[0]]()

    mappings = {name: tuple(factor(name, i, d) for i, d in enumerate(dims[name])) for name in dims}
    outputs = tuple(mappings[name] for name in ("q", "k") if name in mappings)
    replicated = [f"t{len(shapes['q']) - 3}"] if bound.implicit_positions and len(
        shapes["q"]) > 2 else []
    return SdyShardingRule(tuple(mappings[name] for name in bound.names), outputs,
                           need_replication_factors=tuple(replicated + ["d"]))


def _infer_sharding(bound: _Bound, mesh, arg_shapes, result_shape):
    """GSPMD's propagation (when Shardy is off): the shardings :func:`_partition` would give."""
    return _shardings(bound, mesh, arg_shapes)[1]


def _partition(bound: _Bound, mesh, arg_shapes, result_shape):
    """Each shard runs the primitive on its own tokens and heads: q's token and head shardings are
    kept, k's heads shard alike where the mesh axes divide Hk, positions and per-token tables are
    sharded along q's token dims, the cos/sin cache, weights and scales are replicated. Replicated
    instead: head_dim, dims that a mesh axis does not divide, and the last token dim when
    positions are the implicit arange along it (a shard would restart the arange)."""
    arg_shardings, result_shardings = _shardings(bound, mesh, arg_shapes)

    def shard(*operands):
        return bound.bind(operands)

    return mesh, shard, result_shardings, arg_shardings


def _shardings(bound: _Bound, mesh, arg_shapes):
    from jax.sharding import NamedSharding, PartitionSpec

    shapes = {name: tuple(a.shape) for name, a in zip(bound.names, arg_shapes)}
    q = arg_shapes[0]
    if not isinstance(q.sharding, NamedSharding):
        raise ValueError(f"{bound.kind}: sharded JAX calls need a NamedSharding over a Mesh, got "
                         f"{type(q.sharding).__name__}")
    q_spec = tuple(q.sharding.spec) + (None,) * (len(q.shape) - len(q.sharding.spec))

    def axes_size(axes):
        names = axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([mesh.shape[a] for a in names]))

    def kept(axes, size):
        return axes if axes is not None and size % axes_size(axes) == 0 else None

    n = len(q.shape) - 2
    tokens = [kept(q_spec[i], q.shape[i]) for i in range(n)]
    if bound.implicit_positions and n:
        tokens[-1] = None
    heads = q_spec[n]
    dims = _dims(bound, shapes)

    def spec(name):
        out = []
        for size, dim in zip(shapes[name], dims[name]):
            if dim is None or dim[0] == "head_dim":
                out.append(None)
            elif dim[0] == "token":
                out.append(tokens[dim[1]])
            else:
                out.append(kept(heads, size))
        return NamedSharding(mesh, PartitionSpec(*out))

    arg_shardings = tuple(spec(name) for name in bound.names)
    result_shardings = tuple(spec(name) for name in ("q", "k") if name in shapes)
    return arg_shardings, result_shardings
