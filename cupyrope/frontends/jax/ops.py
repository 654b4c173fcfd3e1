"""JAX entry points of cupyrope's ops under transformations (``jax.grad``, ``jax.jit``,
``jax.vmap``), and the functional KV-cache update on JAX arrays: argument checks while tracing,
the custom gradients (``custom_vjp``) and the batching rules (``custom_vmap``) around the
primitives of :mod:`cupyrope.frontends.jax.primitives`. Design: ``docs/jax_internals.md``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import primitives, sharding
from ...core.arrays import describe_traced
from ...core.fused_plan import is_per_row
from ...core.scaling import Scaling
from ...core.validators import check_real
from .planning import (BLOCK_SCALES, CACHES, FUSED_ARRAYS, ROPE_ARRAYS, SCALED, SCALES, TABLES,
                       WRITTEN_SCALES, FusedCall, RotationOptions, plan_fused_call,
                       plan_rotation, planning_info, wants_new_row_scales)


def is_traced(*arrays) -> bool:
    """True when any argument is a JAX tracer (inside jax.grad / jax.jit / jax.vmap ...)."""
    tracer = jax.core.Tracer
    return any(isinstance(x, tracer) for x in arrays)


def updates_jax_cache(q, fusion: dict) -> bool:
    """True for a call on JAX arrays, concrete ones included, that writes arrays besides its
    outputs: a KV-cache write, per-row fp8 scales. Their new arrays come from XLA ("The KV cache
    on JAX" in docs/jax_internals.md), so such a call always runs here."""
    if not isinstance(q, jax.Array):
        return False
    return fusion.get("k_cache") is not None or any(
        fusion.get(name) is not None and is_per_row(fusion[name]) for name in SCALES)


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
                                                   ROPE_ARRAYS)]
    rotation = RotationOptions(_number(theta, "theta"), _hashable_scaling(scaling), interleaved,
                               rotary_dim, inverse, validate, seq_len)
    # Argument errors are raised now, while tracing, from the traced shapes and dtypes.
    plan_rotation({name: describe_traced(x, name) for x, name in zip(arrays, ROPE_ARRAYS)
                   if x is not None}, rotation, inplace=inplace)
    q, k, *tables = arrays
    q_out, k_out = _rope(rotation, q, k, tuple(tables))
    return q_out if k is None else (q_out, k_out)


def run_fused(op_name, q, k, positions, *, rope: dict, fusion: dict, validate: bool):
    """A fused op (``rms_norm_rope``, ``rope_and_cache``, ``apply_rope(out_dtype=...)``) with a
    JAX tracer among its arguments, or one on JAX arrays that writes arrays besides its outputs
    (a cache, per-row scales): checked now, run by one primitive. Returns what
    :func:`cupyrope.execute.run_fused` returns, with new caches in place of the written ones,
    then the new arrays of every scale array the call writes (per-row scales, NVFP4 block
    scales)."""
    inplace = rope["inplace"]
    if op_name == "rope_and_cache" and isinstance(inplace, (bool, np.bool_)) and inplace:
        raise TypeError(
            "rope_and_cache: JAX arrays are immutable, so q and k cannot be rotated in place: pass "
            "inplace=False (q_out and k_out are new arrays, and the call returns new caches, "
            "updated in place by XLA where the caller donates them)")
    given = {"q": q, "k": k, "positions": positions, **{name: rope[name] for name in TABLES},
             **{name: fusion.get(name) for name in FUSED_ARRAYS + SCALES}}
    # "per_head": new scale arrays, which the call returns (planned from q's / k's shape).
    made = tuple(name for name, x in SCALED.items()
                 if wants_new_row_scales(op_name, fusion.get(name), given[x]))
    arrays = {name: _fused_array(x, name, op_name) for name, x in given.items()
              if x is not None and name not in made
              and not (name in SCALES and (_is_number(x) or isinstance(x, str)))}
    options = {name: value for name, value in fusion.items()
               if name not in FUSED_ARRAYS and name not in arrays and name not in made}
    for name, value in options.items():
        _refuse_tracer(value, name, op_name)
    traced = is_traced(*arrays.values())
    rotation = RotationOptions(_number(rope["theta"], "theta", op_name),
                               _hashable_scaling(rope["scaling"], op_name), rope["interleaved"],
                               rope["rotary_dim"], rope["inverse"], validate and traced,
                               rope["seq_len"])
    # Argument errors are raised now, while tracing, from the shapes and dtypes; values
    # (validate=True) now for concrete arrays, else where the call runs.
    infos = {name: planning_info(x, name, read=validate and not traced)
             for name, x in arrays.items()}
    f = plan_fused_call(op_name, rotation, options, infos, inplace=inplace,
                        validate=validate and not traced, new_row_scales=made).fusion
    # Canonical, hashable options for the callback (eps is ignored without the norm).
    options.update(out_dtype=f.out_dtype, eps=f.eps if f.norm else None,
                   weight_offset=f.weight_offset)
    if f.writes_cache:
        options.update(cache_dtype=f.cache_dtype)
    written = tuple(name for name, _ in f.written_scales())
    if f.out_dtype is not None:
        # Per-row q_scale / k_scale then scale the outputs' rows, every one written: the arrays
        # given are only checked (no operands), the call returns new ones.
        for name in set(SCALED) & set(written):
            arrays.pop(name, None)
    fused = FusedCall(op_name, rotation, tuple(sorted(options.items())), tuple(arrays),
                      written_scales=tuple(name for name in WRITTEN_SCALES if name in written))
    outs = _fused(fused, tuple(arrays.values()))
    if not fused.writes_cache and not fused.written_scales:
        return outs[0] if k is None else (outs[0], outs[1])
    # q_out (k_out) (, k_cache_new, v_cache_new), then the new arrays of the scale arrays the
    # call writes, in WRITTEN_SCALES order: "per_head"'s as eager calls return them, the others'
    # because JAX arrays are immutable.
    return outs


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
    """An array argument of a fused call as a JAX array; a NumPy array the call writes (a cache,
    block or per-row scales) stays as it is, to be refused by the checks (it would not be
    written: the call returns new arrays)."""
    if isinstance(x, np.ndarray) and (name in CACHES or name in BLOCK_SCALES
                                      or (name in SCALES and is_per_row(x))):
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


# ----------------------------------------------------------------------------------------------
# custom_vjp: apply_rope


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope(rotation: RotationOptions, q, k, tables):
    return _call(rotation, q, k, tables)


def _rope_fwd(rotation: RotationOptions, q, k, tables):
    return _call(rotation, q, k, tables), tables


def _rope_bwd(rotation: RotationOptions, tables, cotangents):
    grad_q_out, grad_k_out = cotangents
    grad_q, grad_k = _inverse_rotation(rotation, grad_q_out, grad_k_out, tables)
    # Positions, tables: not differentiated (None: a zero cotangent, float0 for integers).
    return grad_q, grad_k, tuple(None for _ in tables)


_rope.defvjp(_rope_fwd, _rope_bwd)


def _inverse_rotation(rotation: RotationOptions, grad_q, grad_k, tables):
    """The gradient of a rotation: the cotangents rotated back, q and k in one launch."""
    back = rotation._replace(inverse=not rotation.inverse, validate=False)
    return _call(back, grad_q, grad_k, tables)


def _call(rotation: RotationOptions, q, k, tables):
    """(q_out, k_out or None) through one primitive call; under ``jax.vmap``, one call for the
    whole batch where it folds into the token dims (:func:`_batched_rope`)."""
    return _batched_rope(rotation)(q, k, tables)


# ----------------------------------------------------------------------------------------------
# custom_vmap: apply_rope


@functools.lru_cache(maxsize=1024)
def _batched_rope(rotation: RotationOptions):
    """The rotation with a vmap rule: the batch becomes one more (leading) token dim of q and k,
    so a vmapped call is one launch, not one per element. Positions and per-token tables that are
    batched get that dim too (aligned with q's token dims: broadcasting aligns from the right, so
    ones are inserted after the batch dim); unbatched ones broadcast over it as they broadcast
    over any token dim, and the cos/sin cache is shared. A batched cache, or M-RoPE positions
    (their component dim leads), cannot fold: those run per element (``jax.lax.map``)."""
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def rope(q, k, tables):
        return _rope_call(rotation, q, k, tables)

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
        q_out, k_out = _rope_call(rotation, q_all, k_all, folded)
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


def _rope_call(rotation: RotationOptions, q, k, tables):
    """(q_out, k_out or None) through one ``cupyrope_rope``, partitionable unless it validates
    (values are read when the call runs)."""
    present = tuple(x is not None for x in (k, *tables))
    operands = [x for x in (q, k, *tables) if x is not None]
    params = dict(rotation=rotation, present=present)
    bind = primitives.bind if rotation.validate else sharding.bind_partitioned
    outs = bind("rope", params, operands)
    return outs[0], (outs[1] if k is not None else None)


# ----------------------------------------------------------------------------------------------
# custom_vjp: the fused ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(fused: FusedCall, arrays: tuple):
    return _fused_call(fused, arrays)


def _fused_fwd(fused: FusedCall, arrays: tuple):
    options = dict(fused.options)
    if "k_cache" in fused.names:
        raise NotImplementedError(
            f"{fused.op_name}: jax.grad through the KV-cache write is not available; "
            "differentiate rms_norm_rope or apply_rope, or pass inputs wrapped in "
            "jax.lax.stop_gradient")
    if options["out_dtype"] is not None:
        raise TypeError(
            f"{fused.op_name}: fp8 outputs (out_dtype={options['out_dtype']!r}) have no gradient; "
            "differentiate the call without out_dtype (and quantise its result), or pass inputs "
            "wrapped in jax.lax.stop_gradient")
    return _fused_call(fused, arrays), arrays


def _fused_bwd(fused: FusedCall, arrays: tuple, cotangents):
    """rms_norm_rope's gradient (the only fused call _fused_fwd lets through): the inverse
    rotation of the float32 cotangents, then RMSNorm's backward per head, in float32."""
    named = dict(zip(fused.names, arrays))
    options = dict(fused.options)
    grads = [g.astype(jnp.float32) for g in cotangents]
    rotated = _inverse_rotation(fused.rotation, grads[0], grads[1] if len(grads) > 1 else None,
                                tuple(named.get(name) for name in ("positions", *TABLES)))
    result = {name: None for name in fused.names}
    for x_name, w_name, grad in zip(("q", "k"), ("q_weight", "k_weight"), rotated):
        if x_name in named:
            result[x_name], result[w_name] = _rms_norm_vjp(
                named[x_name], named[w_name], grad, options["eps"], options["weight_offset"],
                options.get("norm_over") == "all_heads")
    return (tuple(result[name] for name in fused.names),)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _rms_norm_vjp(x, weight, grad, eps: float, weight_offset: float, all_heads: bool = False):
    """(grad of x, grad of weight) of ``y = x * rsqrt(mean(x**2) + eps) * (weight_offset +
    weight)`` per head (last dim; ``all_heads``: the last two dims), given the grad of y; in
    float32, returned in the dtypes (and the weight's shape) of x and weight."""
    axes = (-2, -1) if all_heads else (-1,)
    x32 = x.astype(jnp.float32)
    w32 = weight.astype(jnp.float32)
    w32 = w32.reshape(x.shape[-2:]) if all_heads else w32
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    n = x32 * r
    grad_weight = jnp.sum(grad * n, axis=tuple(range(grad.ndim - w32.ndim)))
    grad_n = grad * (weight_offset + w32)
    grad_x = r * (grad_n - n * jnp.mean(grad_n * n, axis=axes, keepdims=True))
    return grad_x.astype(x.dtype), grad_weight.reshape(weight.shape).astype(weight.dtype)


def _fused_call(fused: FusedCall, arrays: tuple) -> tuple:
    """The outputs of a fused call: under ``jax.vmap``, one call for the whole batch where it
    folds into the token dims (:func:`_batched_fused`); the cache write runs per element (its
    caches and slots have no token dims to fold into)."""
    if fused.writes_cache:
        return _fused_primitive_call(fused, arrays)
    return _batched_fused(fused)(arrays)


# ----------------------------------------------------------------------------------------------
# custom_vmap: the fused ops


# Arrays of a fused call that are per token (folded under vmap) rather than shared by all tokens.
_PER_TOKEN = {"q": None, "k": None, "positions": 0, "cos": 1, "sin": 1}  # name -> trailing dims


@functools.lru_cache(maxsize=1024)
def _batched_fused(fused: FusedCall):
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


def _fused_primitive_call(fused: FusedCall, arrays: tuple) -> tuple:
    """The outputs of a fused call through one ``cupyrope_fused``; partitionable unless it
    validates or writes a cache or scale arrays (XLA runs those on replicated operands)."""
    partitioned = (not fused.rotation.validate and not fused.writes_cache
                   and not fused.written_scales)
    bind = sharding.bind_partitioned if partitioned else primitives.bind
    return bind("fused", dict(fused=fused), list(arrays))


# ----------------------------------------------------------------------------------------------
# rerotate_cache: the functional form on JAX arrays (cupyrope.frontends.jax.rerotate)


def is_rerotate_on_jax(k_cache, slots, delta, cos_sin_cache, k_scale) -> bool:
    """Whether a ``rerotate_cache`` call runs here: a JAX cache, or a JAX tracer among its
    arguments."""
    from . import rerotate

    return rerotate.is_rerotate_on_jax(k_cache, slots, delta, cos_sin_cache, k_scale)


def rerotate_cache(k_cache, slots, delta, **options):
    """:func:`cupyrope.rerotate_cache` on JAX arrays and tracers: returns the new cache."""
    from . import rerotate

    return rerotate.rerotate_cache(k_cache, slots, delta, **options)
