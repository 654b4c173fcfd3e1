"""The JAX primitives ``cupyrope_rope`` and ``cupyrope_fused``: their definition, abstract
evaluation, per-element batching rule, and the lowering each platform gets (XLA's CPU: jax.numpy;
NVIDIA GPUs: the native kernel call; otherwise: the callback). Design: ``docs/jax_internals.md``."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax.interpreters import mlir

from . import callback, lowering as jax_lowering, native as jax_native
from ...core.arrays import describe_traced
from ...core.dtypes import numpy_dtype
from ...cuda.compiler import current_device
from .planning import (CACHES, FUSED_ARRAYS, ROPE_ARRAYS, SCALED, SCALES, FusedCall,
                       RotationOptions, plan_fused_call, plan_rotation, planning_info,
                       rope_operand_names, rope_operands_by_name)


def _primitive(name: str, abstract_eval):
    from jax._src import dispatch
    from jax.extend.core import Primitive

    primitive = Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(abstract_eval)
    return primitive


def _rope_abstract_eval(*avals, rotation: RotationOptions, present: tuple[bool, ...]):
    """q_out (and k_out): the shapes and dtypes of q (and k)."""
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in avals[:1 + present[0]]]


def _fused_abstract_eval(*avals, fused: FusedCall):
    """q_out (k_out) in the fp8 out_dtype or their own, then the new caches (the input caches'),
    then the written scale arrays: a cache's (the input arrays'), the outputs' per-row scales
    (float32, q's / k's shape but head_dim)."""
    named = dict(zip(fused.names, avals))
    out_dtype = dict(fused.options)["out_dtype"]
    outs = [jax.core.ShapedArray(named[name].shape,
                                 named[name].dtype if out_dtype is None else numpy_dtype(out_dtype))
            for name in ("q", "k") if name in named]
    outs += [jax.core.ShapedArray(named[name].shape, named[name].dtype)
             for name in CACHES if name in named]
    for name in fused.written_scales:
        if name in named:
            outs.append(jax.core.ShapedArray(named[name].shape, named[name].dtype))
        else:
            outs.append(jax.core.ShapedArray(named[SCALED[name]].shape[:-1], np.float32))
    return outs


# cupyrope_rope: operands q, then those of k, positions, cos_sin_cache, cos, sin that ``present``
# marks; params ``rotation`` (RotationOptions), ``present`` (5 bools). Results q_out (, k_out).
rope_p = _primitive("cupyrope_rope", _rope_abstract_eval)
# cupyrope_fused: operands the arrays of ``fused.names`` in that order (fp8 arrays as they are);
# param ``fused`` (FusedCall). Results q_out (, k_out) (, k_cache_new, v_cache_new), then one
# new array per ``fused.written_scales``.
fused_p = _primitive("cupyrope_fused", _fused_abstract_eval)


def bind(kind: str, params: dict, operands) -> tuple:
    """The results of one ``cupyrope_rope`` (``kind`` "rope") or ``cupyrope_fused`` ("fused")."""
    primitive = rope_p if kind == "rope" else fused_p
    return tuple(primitive.bind(*operands, **params))


def operand_names(kind: str, params: dict) -> tuple[str, ...]:
    """The names of a primitive call's operands, in order."""
    return rope_operand_names(params["present"]) if kind == "rope" else params["fused"].names


def _rope_jnp(*operands, rotation: RotationOptions, present: tuple[bool, ...]):
    """cupyrope_rope as jax.numpy (:mod:`cupyrope.frontends.jax.lowering`), planned from the shapes."""
    named = rope_operands_by_name(present, operands)
    plan = plan_rotation({name: describe_traced(x, name) for name, x in named.items()
                          if x is not None}, rotation)
    outs = jax_lowering.rotate(plan, *(named[name] for name in ROPE_ARRAYS))
    return [x for x in outs if x is not None]


def _fused_jnp(*arrays, fused: FusedCall):
    """cupyrope_fused as jax.numpy (:mod:`cupyrope.frontends.jax.lowering`), planned from the shapes."""
    named = dict(zip(fused.names, arrays))
    options = dict(fused.options)
    infos = {name: planning_info(x, name, read=False) for name, x in named.items()}
    plan = plan_fused_call(fused.op_name, fused.rotation, options, infos, validate=False,
                           new_row_scales=fused.new_row_scales)
    scales = {name: named.get(name, options.get(name)) for name in SCALES}
    return list(jax_lowering.fused(
        plan, *(named.get(name) for name in ROPE_ARRAYS),
        **{name: named.get(name) for name in FUSED_ARRAYS}, scales=scales))


def _lower_rope(ctx, *operands, rotation: RotationOptions, present: tuple[bool, ...]):
    """cupyrope_rope on XLA's CPU (and any platform without a lowering of its own): jax.numpy;
    validate=True reads positions when the call runs, so it keeps the callback."""
    body = callback.rope_outputs if rotation.validate else _rope_jnp
    return mlir.lower_fun(functools.partial(body, rotation=rotation, present=present),
                          multiple_results=True)(ctx, *operands)


def _lower_fused(ctx, *arrays, fused: FusedCall):
    """cupyrope_fused on XLA's CPU: as :func:`_lower_rope`."""
    body = callback.fused_outputs if fused.rotation.validate else _fused_jnp
    return mlir.lower_fun(functools.partial(body, fused=fused),
                          multiple_results=True)(ctx, *arrays)


def _gpu_lowering(kind: str, platform: str, ctx, *operands, **params):
    """The lowering of a cupyrope primitive on a GPU ("cuda", "rocm").

    ``kind`` "rope": ``operands`` q, then k, positions, cos_sin_cache, cos, sin where
    ``params["present"]`` (5 bools, in that order) marks them; ``params["rotation"]`` is the
    :class:`RotationOptions`. ``kind`` "fused": ``operands`` the arrays of
    ``params["fused"].names`` (a :class:`FusedCall`: the op, its rotation's options, its canonical
    options, fp8 arrays as fp8); results q_out (k_out) then the new caches, which a lowering
    aliases to the input caches. Returns the results' IR values.

    A native XLA kernel call (:mod:`cupyrope.frontends.jax.native`) where this jaxlib offers one;
    validate=True, ROCm, a jaxlib without the kernel call (warned once) and the cache write inside
    a per-element jax.vmap take the buffer_callback route (``docs/jax_internals.md`` says why)."""
    validate = (params["rotation"] if kind == "rope" else params["fused"].rotation).validate
    if platform == "cuda" and not validate:
        reason = jax_native.unavailable_reason()
        if reason is None:
            if kind == "rope":
                names = rope_operand_names(params["present"])
                infos = jax_native.planning_infos(ctx.avals_in, names, current_device())
                return jax_native.lower_planned(ctx, operands, names,
                                                plan_rotation(infos, params["rotation"]))
            fused = params["fused"]
            # As a native call inside jax.lax.map, XLA (jaxlib 0.11.2) did not keep the new
            # caches aliased to the input caches, and rows no slot names came out zero: the
            # callback checks and copies where XLA does not alias.
            if not (fused.per_element and fused.writes_cache):
                return jax_native.lower_planned(ctx, operands, fused.names, _native_fused_plan(
                    ctx, fused))
        else:
            _warn_callback_route(reason)
    body = callback.rope_outputs if kind == "rope" else callback.fused_outputs
    return mlir.lower_fun(functools.partial(body, **params), multiple_results=True)(ctx, *operands)


def _native_fused_plan(ctx, fused: FusedCall):
    """The checked plan of a fused call for the native kernel call, from XLA's shapes (as
    :func:`~cupyrope.frontends.jax.planning.planning_info` prepares them for the checks: the
    caches are written, one-element scales are read by the kernel)."""
    infos = jax_native.planning_infos(ctx.avals_in, fused.names, current_device())
    for name, info in infos.items():
        if name in CACHES or name in fused.written_scales:
            info.writable = True
        elif name in SCALES and info.size == 1:
            info.view = np.ones(info.shape, np.float32)
    return plan_fused_call(fused.op_name, fused.rotation, dict(fused.options), infos,
                           validate=False, new_row_scales=fused.new_row_scales)


@functools.lru_cache(maxsize=None)
def _warn_callback_route(reason: str) -> None:
    """Say once (per reason) that traced calls on this GPU run through the callback."""
    warnings.warn(f"cupyrope: calls under jax.jit run through a Python callback on this GPU "
                  f"(no native XLA call: {reason}); it works, with a Python call per execution",
                  RuntimeWarning, stacklevel=2)


def _per_element(primitive, args, dims, **params):
    """The batching rule of both primitives: one call per element (``jax.lax.map``). The
    custom_vmap rules of :mod:`cupyrope.frontends.jax.ops` fold what can be folded before a
    primitive sees a batch; what reaches here (rope_and_cache, whose caches and slots have no
    token dims) runs per element."""
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


def _register_rules() -> None:
    from jax.interpreters import batching

    for primitive in (rope_p, fused_p):
        batching.primitive_batchers[primitive] = functools.partial(_per_element, primitive)
    mlir.register_lowering(rope_p, _lower_rope)
    mlir.register_lowering(fused_p, _lower_fused)
    for platform in ("cuda", "rocm"):
        mlir.register_lowering(rope_p, functools.partial(_lower_on_gpu, "rope", platform),
                               platform=platform)
        mlir.register_lowering(fused_p, functools.partial(_lower_on_gpu, "fused", platform),
                               platform=platform)


_register_rules()
