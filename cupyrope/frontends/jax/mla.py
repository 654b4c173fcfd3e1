"""The DeepSeek MLA ops on JAX arrays and tracers (:func:`cupyrope.mla_rope_quantize`,
:func:`cupyrope.mla_rope_and_cache`): the functional form, checked while tracing, run by one
primitive, ``cupyrope_mla``. It lowers to one native XLA kernel call of ``mla_rope_kernel`` on
NVIDIA GPUs and to jax.numpy (the NumPy path's arithmetic) elsewhere. Design:
``docs/jax_internals.md`` ("The MLA ops on JAX").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from ...core.abi import AngleSource
from ...core.arrays import describe_traced
from ...core.dtypes import CUDA_TYPE_NAMES, ITEMSIZE, numpy_dtype
from ...core.mla import MlaPlan, plan_mla
from ...core.mrope import MROPE_NONE
from .lowering import _rotated, _stored, cos_sin_per_token
from .planning import RotationOptions

# The operands of ``cupyrope_mla``, in the order it takes those present: q whole ([T, H, nope +
# rope]) or its parts, the k parts ([T, Hk, dim]), the latent [T, rank], positions, the latent
# cache (and k_pe's own cache, FlashInfer's layout) and slots, the cos/sin cache, one-element fp8
# scales.
OPERANDS = ("q", "q_nope", "q_pe", "k_nope", "k_pe", "kv_c", "positions", "kv_cache",
            "kpe_cache", "slot_mapping", "cos_sin_cache", "q_scale", "k_scale", "kv_scale")
_CACHES = ("kv_cache", "kpe_cache")  # written: the call returns new ones, aliased to these
_SCALES = ("q_scale", "k_scale", "kv_scale")
_VALIDATED = ("positions", "slot_mapping")  # what validate=True reads


class MlaCall(NamedTuple):
    """The hashable description of one MLA call (the ``call`` param of ``cupyrope_mla``)."""

    op_name: str
    rotation: RotationOptions
    names: tuple[str, ...]  # the operands given, in OPERANDS order
    out_dtype: str | None  # fp8 format of the q / k outputs; None: the input dtype
    cache_dtype: str | None  # the format a uint8 cache holds
    scale_values: tuple[tuple[str, float | None], ...]  # scales given as numbers

    def results(self) -> tuple[str, ...]:
        """The results, in order: q_out (q whole) or q_nope_out, q_pe_out; k_nope_out,
        k_pe_out; the new caches."""
        names = ["q_out"] if "q" in self.names else [
            f"{name}_out" for name in ("q_nope", "q_pe") if name in self.names]
        names += [f"{name}_out" for name in ("k_nope", "k_pe") if name in self.names]
        return tuple(names + [name for name in _CACHES if name in self.names])


def is_mla_on_jax(*arrays) -> bool:
    """Whether an MLA call belongs here: a JAX array or tracer among its arguments."""
    return any(isinstance(x, (jax.Array, jax.core.Tracer)) for x in arrays)


def mla_rope_quantize(q_rope, k_rope, q_nope=None, k_nope=None, positions=None, *,
                      cos_sin_cache=None, theta=10000.0, scaling=None, interleaved=True,
                      out_dtype=None, q_scale=None, k_scale=None, inplace=False, validate=False,
                      seq_len=None):
    """:func:`cupyrope.mla_rope_quantize` on JAX: same arguments, errors and results (new
    arrays); ``inplace=True`` raises TypeError (JAX arrays are immutable)."""
    op_name = "mla_rope_quantize"
    _refuse_inplace(op_name, inplace)
    k_shape = tuple(k_rope.shape)
    arrays = dict(q_pe=q_rope, k_pe=_with_head_dim(k_rope, "k_rope", op_name),
                  q_nope=q_nope,
                  k_nope=None if k_nope is None else _with_head_dim(k_nope, "k_nope", op_name),
                  positions=positions, cos_sin_cache=cos_sin_cache)
    outs = _run(op_name, arrays, dict(theta=theta, scaling=scaling, interleaved=interleaved,
                                      seq_len=seq_len),
                dict(out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale), validate)
    k_rope_out = outs["k_pe_out"].reshape(k_shape)
    k_nope_out = outs.get("k_nope_out")
    if k_nope_out is not None:
        k_nope_out = k_nope_out.reshape(tuple(k_nope.shape))
    return outs["q_pe_out"], k_rope_out, outs.get("q_nope_out"), k_nope_out


def mla_rope_and_cache(q, k_pe, kv_c, positions, kv_cache, slot_mapping, *, cos_sin_cache=None,
                       theta=10000.0, scaling=None, interleaved=True, out_dtype=None,
                       q_scale=None, k_scale=None, kv_scale=None, cache_dtype=None,
                       inplace=False, validate=False, seq_len=None, kpe_cache=None):
    """:func:`cupyrope.mla_rope_and_cache` on JAX, functional: returns ``(q_out, k_pe_out,
    kv_cache_new)`` (q_out in q's layout: one array or the pair), with ``kpe_cache`` ``(q_out,
    k_pe_out, kv_cache_new, kpe_cache_new)``, and changes none of its arguments; rows no slot
    names keep the input caches' values (XLA writes the slots in place where the caller donates
    the caches). ``inplace=True`` raises TypeError."""
    op_name = "mla_rope_and_cache"
    _refuse_inplace(op_name, inplace)
    k_shape = tuple(k_pe.shape)
    k_heads = _with_head_dim(k_pe, "k_pe", op_name)
    arrays = dict(k_pe=k_heads, positions=positions, kv_cache=kv_cache, kpe_cache=kpe_cache,
                  slot_mapping=slot_mapping, cos_sin_cache=cos_sin_cache,
                  kv_c=kv_c.reshape(kv_c.shape[0], kv_c.shape[2])
                  if len(getattr(kv_c, "shape", ())) == 3 and kv_c.shape[1] == 1 else kv_c)
    joint = not isinstance(q, (tuple, list))
    if joint:
        if len(getattr(q, "shape", ())) != 3:
            raise ValueError(f"{op_name}: q must be [num_tokens, num_heads, nope_dim + rope_dim] "
                             f"or a pair (q_nope, q_pe), got shape "
                             f"{tuple(getattr(q, 'shape', ()))}")
        if q.shape[-1] < k_heads.shape[-1]:
            raise ValueError(f"{op_name}: q's head ({q.shape[-1]} dims) is shorter than k_pe's "
                             f"rope_dim {k_heads.shape[-1]}")
        arrays["q"] = q
    elif len(q) != 2:
        raise ValueError(f"{op_name}: q must be one array or a pair (q_nope, q_pe), got "
                         f"{len(q)} arrays")
    else:
        arrays["q_nope"], arrays["q_pe"] = q
    outs = _run(op_name, arrays, dict(theta=theta, scaling=scaling, interleaved=interleaved,
                                      seq_len=seq_len),
                dict(out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale, kv_scale=kv_scale,
                     cache_dtype=cache_dtype), validate)
    q_out = outs["q_out"] if joint else (outs["q_nope_out"], outs["q_pe_out"])
    caches = (outs["kv_cache"],) + ((outs["kpe_cache"],) if kpe_cache is not None else ())
    return (q_out, outs["k_pe_out"].reshape(k_shape), *caches)


def _refuse_inplace(op_name: str, inplace) -> None:
    if inplace is True:
        raise TypeError(f"{op_name}: JAX arrays are immutable, so the rope parts cannot be "
                        "rotated in place: pass inplace=False (the call returns new arrays)")


def _with_head_dim(x, name: str, op_name: str):
    """``x`` as ``[T, heads, dim]``: a 2-d ``[T, dim]`` array gains a unit head dim."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) == 2:
        return x.reshape(shape[0], 1, shape[1])
    if len(shape) != 3:
        raise ValueError(f"{op_name}: {name} must be [num_tokens, rope_dim] or [num_tokens, heads, "
                         f"dim], got shape {shape}")
    return x


def _as_jax(x, name: str, op_name: str):
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    if isinstance(x, np.ndarray) and name not in _CACHES:
        return jnp.asarray(x)
    raise TypeError(f"{op_name}: {name} must be a JAX array when another argument is a JAX "
                    f"array or tracer (the call returns new arrays), got "
                    f"{type(x).__module__}.{type(x).__qualname__}")


def _run(op_name: str, given: dict, rotation: dict, options: dict, validate: bool) -> dict:
    """Check the call now (while tracing) and run it through one ``cupyrope_mla``; returns the
    results by name (MlaCall.results)."""
    from .ops import _hashable_scaling, _number, _refuse_tracer

    scale_values = []
    for name in _SCALES:
        value = options.get(name)
        if value is not None and not hasattr(value, "shape"):
            scale_values.append((name, value))  # a number: static (checked by plan_mla)
            given[name] = None
        else:
            given[name] = value
    arrays = {name: _as_jax(given[name], name, op_name) for name in OPERANDS
              if given.get(name) is not None}
    for name in ("out_dtype", "cache_dtype"):
        _refuse_tracer(options.get(name), name, op_name)
    traced = [name for name in _VALIDATED
              if isinstance(arrays.get(name), jax.core.Tracer)]
    if validate and traced:
        raise TypeError(f"{op_name}: validate=True reads {' and '.join(traced)} on the host, but "
                        "under a JAX transformation they are traced; validate outside jax.jit, "
                        "or leave validate off")
    call_rotation = RotationOptions(_number(rotation["theta"], "theta", op_name),
                                    _hashable_scaling(rotation["scaling"], op_name),
                                    rotation["interleaved"], None, False, False,
                                    rotation["seq_len"])
    infos = {name: _info(x, name, read=validate) for name, x in arrays.items()}
    mla = _plan(op_name, call_rotation, infos, dict(scale_values), options.get("out_dtype"),
                options.get("cache_dtype"), validate=validate)
    call = MlaCall(op_name, call_rotation, tuple(arrays), mla.out_dtype,
                   mla.cache_dtype if "kv_cache" in arrays else None,
                   tuple(sorted(scale_values)))
    outs = mla_p.bind(*arrays.values(), call=call)
    return dict(zip(call.results(), outs))


def _info(x, name: str, *, read: bool):
    """What the checks see of an operand: its shape and dtype (the cache as written: the call
    returns a new one); a one-element scale reads as 1 (the call reads the array); with
    ``read``, positions and slots on the host."""
    info = describe_traced(x, name)
    if name in _CACHES:
        info.writable = True
    elif name in _SCALES and info.size == 1:
        info.view = np.ones(info.shape, np.float32)
    elif read and name in _VALIDATED:
        info.view = np.asarray(x)
    return info


def _plan(op_name: str, rotation: RotationOptions, infos: dict, scale_values: dict, out_dtype,
          cache_dtype, *, validate: bool = False, out_itemsize: int | None = None) -> MlaPlan:
    """The checked plan of an MLA call from its operands' infos (q whole is split into its
    nope and rope parts, views of it)."""
    infos = dict(infos)
    if "q" in infos:
        q, rope_dim = infos.pop("q"), infos["k_pe"].shape[-1]
        nope = q.shape[-1] - rope_dim
        itemsize = ITEMSIZE[q.dtype]
        infos["q_pe"] = dataclasses.replace(q, shape=q.shape[:2] + (rope_dim,),
                                            ptr=q.ptr + nope * itemsize if q.ptr else 0)
        if nope:
            infos["q_nope"] = dataclasses.replace(q, shape=q.shape[:2] + (nope,))
    scales = {name: infos.get(name, scale_values.get(name)) for name in _SCALES}
    return plan_mla(op_name, infos.get("q_nope"), infos["q_pe"], infos.get("k_nope"),
                    infos["k_pe"], infos.get("positions"),
                    rope=dict(rotation.call_options(), cos_sin_cache=infos.get("cos_sin_cache"),
                              inplace=False),
                    out_dtype=out_dtype, q_scale=scales["q_scale"], k_scale=scales["k_scale"],
                    kv_c=infos.get("kv_c"), kv_cache=infos.get("kv_cache"),
                    slot_mapping=infos.get("slot_mapping"), cache_dtype=cache_dtype,
                    kv_scale=scales["kv_scale"], validate=validate,
                    kpe_cache=infos.get("kpe_cache"))


def _call_plan(call: MlaCall, infos: dict) -> MlaPlan:
    return _plan(call.op_name, call.rotation, infos, dict(call.scale_values), call.out_dtype,
                 call.cache_dtype)


# ----------------------------------------------------------------------------------------------
# The primitive


def _abstract_eval(*avals, call: MlaCall):
    named = dict(zip(call.names, avals))
    out = named["k_pe"].dtype if call.out_dtype is None else numpy_dtype(call.out_dtype)
    results = []
    for name in call.results():
        if name in _CACHES:
            results.append(jax.core.ShapedArray(named[name].shape, named[name].dtype))
        else:
            source = named[name.removesuffix("_out")]
            results.append(jax.core.ShapedArray(source.shape, out))
    return results


def _make_primitive():
    from jax._src import dispatch
    from jax.extend.core import Primitive

    primitive = Primitive("cupyrope_mla")
    primitive.multiple_results = True
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(_abstract_eval)
    return primitive


# cupyrope_mla: operands the arrays of ``call.names``; param ``call`` (MlaCall); results
# ``call.results()``.
mla_p = _make_primitive()


def mla_jnp(*operands, call: MlaCall):
    """cupyrope_mla as jax.numpy, as ``core.mla.mla_on_host`` computes it: the rope parts rotated
    in float32, every part stored once in the output format, ``[kv_c | k_pe rotated]`` stored in
    the rows of the valid slots."""
    named = dict(zip(call.names, operands))
    mla = _call_plan(call, {name: _info(x, name, read=False) for name, x in named.items()})
    rope = mla.rope
    cos, sin = cos_sin_per_token(rope, named.get("positions"), named.get("cos_sin_cache"),
                                 None, None)
    cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
    out_dtype = numpy_dtype(mla.out_dtype or rope.q.dtype)
    rope_dim = rope.rotary_dim
    q = named.get("q")
    q_nope = q[..., :q.shape[-1] - rope_dim] if q is not None else named.get("q_nope")
    q_pe = q[..., q.shape[-1] - rope_dim:] if q is not None else named["q_pe"]
    rotated = {name: _rotated(rope, x.astype(jnp.float32), cos, sin)
               for name, x in (("q_pe", q_pe), ("k_pe", named["k_pe"]))}

    def store(x, scale_name):
        return _stored(x.astype(jnp.float32), out_dtype, _scale(named, call, scale_name))

    parts = {"q_pe_out": store(rotated["q_pe"], "q_scale"),
             "k_pe_out": store(rotated["k_pe"], "k_scale")}
    if q_nope is not None and q_nope.shape[-1]:
        parts["q_nope_out"] = store(q_nope, "q_scale")
    if "k_nope" in named:
        parts["k_nope_out"] = store(named["k_nope"], "k_scale")
    if q is not None:
        parts["q_out"] = (jnp.concatenate([parts["q_nope_out"], parts["q_pe_out"]], axis=-1)
                          if "q_nope_out" in parts else parts["q_pe_out"])
    if mla.writes_cache:
        parts.update(_latent_cache_write(mla, named, rotated["k_pe"][:, 0],
                                         _scale(named, call, "kv_scale")))
    return [parts[name] for name in call.results()]


def _scale(named: dict, call: MlaCall, name: str):
    """A scale operand, or the number given (None: 1)."""
    return named.get(name, dict(call.scale_values).get(name))


def _latent_cache_write(mla: MlaPlan, named: dict, k_pe, kv_scale) -> dict:
    """The new caches by name: ``[kv_c | k_pe]`` stored once in the cache's format in the rows
    of the valid slots (negative slots and slots past the cache are dropped from the scatter),
    or kv_c and k_pe in the rows of their own caches (``kpe_cache``)."""
    slots = named["slot_mapping"].astype(jnp.int32)
    valid = (slots >= 0) & (slots < mla.num_blocks * mla.block_size)
    blocks = jnp.where(valid, slots // mla.block_size, mla.num_blocks)
    rows = jnp.where(valid, slots % mla.block_size, 0)
    dtype = numpy_dtype(mla.cache_dtype or mla.rope.q.dtype)
    kv_c = named["kv_c"].astype(jnp.float32)
    if "kpe_cache" in named:  # each part stored on its own (the store is element by element)
        parts = {"kv_cache": _stored(kv_c, dtype, kv_scale),
                 "kpe_cache": _stored(k_pe, dtype, kv_scale)}
    else:
        parts = {"kv_cache": _stored(jnp.concatenate([kv_c, k_pe], axis=-1), dtype, kv_scale)}
    new = {}
    for name, values in parts.items():
        cache = named[name]
        if cache.dtype == jnp.uint8 and values.dtype != jnp.uint8:
            values = jax.lax.bitcast_convert_type(values, jnp.uint8)
        new[name] = cache.at[blocks, rows].set(values, mode="drop")
    return new


def _lower_jnp(ctx, *operands, call: MlaCall):
    return mlir.lower_fun(functools.partial(mla_jnp, call=call), multiple_results=True)(
        ctx, *operands)


def _lower_cuda(ctx, *operands, call: MlaCall):
    """One native kernel call of ``mla_rope_kernel`` where this jaxlib offers the kernel call
    (:mod:`cupyrope.frontends.jax.native`); else the jax.numpy lowering (warned once)."""
    from . import native

    reason = native.unavailable_reason()
    if reason is not None:
        _warn_jnp_route(reason)
        return _lower_jnp(ctx, *operands, call=call)
    return _lower_native(ctx, operands, call)


@functools.lru_cache(maxsize=None)
def _warn_jnp_route(reason: str) -> None:
    warnings.warn(f"cupyrope: the MLA ops under jax.jit run as jax.numpy on this GPU (no native "
                  f"XLA call: {reason}); results are the same, in several XLA kernels",
                  RuntimeWarning, stacklevel=2)


def _per_element(args, dims, *, call: MlaCall):
    """jax.vmap: one call per element (``jax.lax.map``); a call that writes a cache is
    :func:`mla_jnp` vmapped instead (XLA's batched scatter into the batched caches). As a native
    call inside jax.lax.map, XLA (jaxlib 0.11.2, H200) did not keep the new cache aliased to the
    input cache: the kernel wrote through the input slice, and the batched caches came out as
    the loop's zero-filled results (the fused cache write met the same and takes the
    buffer_callback there, :mod:`cupyrope.frontends.jax.primitives`)."""
    if any(name in _CACHES for name in call.names):
        outs = jax.vmap(functools.partial(mla_jnp, call=call), in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    leading = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
               for a, d in zip(args, dims)]
    outs = jax.lax.map(lambda element: mla_p.bind(*element, call=call), leading)
    return outs, [0] * len(outs)


def _register_rules() -> None:
    from jax.interpreters import batching

    batching.primitive_batchers[mla_p] = _per_element
    mlir.register_lowering(mla_p, _lower_jnp)
    for platform in ("cuda", "rocm"):
        mlir.register_lowering(mla_p, _lower_cuda if platform == "cuda" else _lower_jnp,
                               platform=platform)


_register_rules()


# ----------------------------------------------------------------------------------------------
# The native call: mla_rope_kernel through a flat-argument entry


THREADS = 128  # mla_rope_kernel's largest block (its launch bound; mla_launch.THREADS)
# q whole and its output: the pointer fields of their nope and rope parts (the rope part's at
# the byte offset of the nope dims).
_WHOLE = {"q": ("q_nope", "q_pe"), "q_out": ("q_nope_out", "q_pe_out")}


class NativeMla(NamedTuple):
    """A planned kernel call: the specialisation, the MlaParams words, the block's threads and
    the grid, what each of XLA's buffers sets (``(field, byte offset)`` pairs, in XLA's order:
    operands, the frequencies, results) and the float64 frequencies of computed angles."""

    spec: object
    params: np.ndarray
    block: int
    grid: tuple[int, int]
    buffers: tuple[tuple[tuple[str, int], ...], ...]
    inv_freq: np.ndarray | None


def plan_native_mla(call: MlaCall, avals_in, avals_out, device: int, *,
                    multiprocessors: int, num_regs: Callable[[object], int]) -> NativeMla:
    """The kernel call of ``call`` on XLA's buffers (C order) on ``device`` of
    ``multiprocessors`` SMs: the plan from the shapes, ``mla_launch.plan_mla_launch`` on planning
    addresses, then which struct fields each buffer sets; ``num_regs`` gives a specialisation's
    registers (the geometry's resident blocks: ``mla_launch.mla_geometry``). Needs no GPU."""
    from . import native
    from ...cuda.mla_launch import mla_geometry, plan_mla_launch

    infos = native.planning_infos(avals_in, call.names, device)
    for name in _CACHES:
        if name in infos:
            infos[name].writable = True
    for name in _SCALES:
        if name in infos:
            infos[name].view = np.ones(infos[name].shape, np.float32)
    mla = _call_plan(call, infos)
    if mla.rope.mrope_mode != MROPE_NONE:
        raise ValueError(f"{call.op_name}: M-RoPE positions are not supported by the MLA ops")
    results = call.results()
    out_infos = {}
    for index, (name, aval) in enumerate(zip(results, avals_out)):
        info = describe_traced(aval, name)
        info.device, info.ptr = device, native.fake_pointer(len(call.names) + 1 + index)
        if call.out_dtype is not None and name not in _CACHES:
            info.dtype = call.out_dtype
        out_infos[name] = info
    rope_dim = mla.rope.rotary_dim
    if "q_out" in out_infos:  # the parts of q whole's output, views of it
        whole = out_infos["q_out"]
        nope = whole.shape[-1] - rope_dim
        out_infos["q_pe_out"] = dataclasses.replace(
            whole, shape=whole.shape[:2] + (rope_dim,),
            ptr=whole.ptr + nope * ITEMSIZE[whole.dtype])
        if nope:
            out_infos["q_nope_out"] = dataclasses.replace(whole, shape=whole.shape[:2] + (nope,))
    inv_freq = None
    if mla.rope.source == AngleSource.COMPUTED:
        inv_freq = np.ascontiguousarray(mla.rope.inv_freq, dtype=np.float64)
    spec, params = plan_mla_launch(
        mla, [out_infos.get(name) for name in ("q_nope_out", "q_pe_out", "k_nope_out",
                                               "k_pe_out")],
        inv_freq_ptr=0 if inv_freq is None else native.fake_pointer(len(call.names)))
    nope_dims = mla.q_nope.shape[-1] if mla.q_nope is not None else 0

    def fields(name: str) -> tuple[tuple[str, int], ...]:
        if name not in _WHOLE:
            return ((_FIELDS.get(name, name), 0),)
        itemsize = 1 if name == "q_out" and call.out_dtype else ITEMSIZE[mla.rope.q.dtype]
        nope_field, pe_field = _WHOLE[name]
        return ((nope_field, 0), (pe_field, nope_dims * itemsize))

    # XLA's buffers: the operands, the frequencies, then the results; the new caches are aliased
    # to the input caches and written through them (they set nothing).
    buffers = [fields(name) for name in call.names]
    buffers += [fields("inv_freq")] if inv_freq is not None else []
    buffers += [() if name in _CACHES else fields(name) for name in results]
    block, grid = mla_geometry(spec, params, multiprocessors, num_regs(spec))
    return NativeMla(spec, params, block, grid, tuple(buffers), inv_freq)


# MlaParams fields of the operands whose names differ.
_FIELDS = {"cos_sin_cache": "table"}


def mla_entry_source(native_mla: NativeMla, name: str) -> str:
    """The flat-argument entry of a planned call: XLA's buffers, then every MlaParams word; the
    buffers replace the pointer words they set."""
    from ...cuda.mla_launch import MLA_PARAMS_DTYPE

    words = MLA_PARAMS_DTYPE.itemsize // 8
    arguments = [f"unsigned long long buffer{i}" for i in range(len(native_mla.buffers))]
    arguments += [f"unsigned long long word{i}" for i in range(words)]
    lines = [f"union {{ cupyrope::MlaParams p; unsigned long long w[{words}]; }} mla;"]
    lines += [f"mla.w[{i}] = word{i};" for i in range(words)]
    for i, fields in enumerate(native_mla.buffers):
        for field, offset in fields:
            word = MLA_PARAMS_DTYPE.fields[field][1] // 8
            lines.append(f"mla.w[{word}] = buffer{i} + {offset}ull;")
    expression = native_mla.spec.name_expression
    body = expression.replace("mla_rope_kernel", "mla_rope_tokens", 1)
    spec = native_mla.spec
    bound = (f"cupyrope::MlaMinBlocksPerSM<{CUDA_TYPE_NAMES[spec.dtype]}, "
             f"{CUDA_TYPE_NAMES[spec.table_dtype]}, {str(spec.interleaved).lower()}, "
             f"{int(spec.source)}, {str(spec.wide_index).lower()}>::value")
    lines.append(f"{body}(mla.p);")
    separator = ",\n    "
    statements = "\n  ".join(lines)
    return f"""#include "rope.cu"

// XLA's entry (cupyrope/frontends/jax/mla.py): XLA's buffers, then the MlaParams words.
extern "C" __global__ void __launch_bounds__({THREADS}, ({bound})) {name}(
    {separator.join(arguments)}) {{
  {statements}
}}
"""


def mla_kernel_name(native_mla: NativeMla) -> str:
    digest = hashlib.sha256(f"{native_mla.spec.name_expression}{native_mla.buffers}".encode())
    return f"cupyrope_xla_mla_{digest.hexdigest()[:16]}"


_ptx_cache: dict = {}
_ptx_lock = threading.Lock()


def mla_entry_ptx(native_mla: NativeMla, capability: str, arithmetic: str | None) -> str:
    """PTX of the entry for compute capability ``capability`` ("90"), memoised; needs NVRTC."""
    from . import native
    from ...cuda import compiler

    name = mla_kernel_name(native_mla)
    key = (name, capability, arithmetic, compiler.source_fingerprint())
    with _ptx_lock:
        ptx = _ptx_cache.get(key)
        if ptx is None:
            ptx = native.nvrtc_ptx(mla_entry_source(native_mla, name),
                                   compiler.compile_options(arithmetic)
                                   + (f"--gpu-architecture=compute_{capability}",))
            _ptx_cache[key] = ptx
    return ptx


def _lower_native(ctx, operands, call: MlaCall):
    from . import native
    from ...core.arrays import cupy_module
    from ...cuda import compiler
    from ...cuda.launch import FP8_MIN_COMPUTE_CAPABILITY, _compute_capability, _multiprocessors

    device = compiler.current_device()
    # The registers of the library's own build of the specialisation (the entry compiles the
    # same kernel body under the same bound) size the geometry.
    planned = plan_native_mla(call, ctx.avals_in, ctx.avals_out, device,
                              multiprocessors=_multiprocessors(device),
                              num_regs=lambda spec: compiler.get_kernel(spec, device).num_regs)
    results = call.results()
    if planned.grid[0] == 0:  # no token: empty outputs, the input caches, no launch
        outs = [mlir.full_like_aval(ctx, 0, aval) for aval in ctx.avals_out]
        for name in _CACHES:
            if name in results:
                outs[results.index(name)] = operands[call.names.index(name)]
        return outs
    if ((call.out_dtype is not None or call.cache_dtype is not None)
            and _compute_capability(device) < FP8_MIN_COMPUTE_CAPABILITY):
        raise RuntimeError(f"{call.op_name}: fp8 outputs need a GPU of compute capability 8.9 "
                           f"or newer; device {device} has "
                           f"{_compute_capability(device) / 10:.1f}")
    capability = cupy_module().cuda.Device(device).compute_capability
    ptx = mla_entry_ptx(planned, capability, compiler.kernel_arithmetic(planned.spec, device))
    name = mla_kernel_name(planned)
    gpu_triton = native.gpu_triton()
    kernel = gpu_triton.TritonKernel(name, planned.block // 32, 1, 0, ptx, "", int(capability))
    parameters = [gpu_triton.create_array_parameter(0, native.POINTER_DIVISIBILITY)
                  for _ in planned.buffers]
    parameters += [gpu_triton.create_scalar_parameter(int(w), "u64")
                   for w in np.frombuffer(planned.params.tobytes(), dtype=np.uint64)]
    nodes = list(operands)
    if planned.inv_freq is not None:
        nodes.append(mlir.ir_constant(planned.inv_freq.view(np.uint32)))
    aliases = {call.names.index(name): results.index(name) for name in _CACHES
               if name in results}
    return native.kernel_call(ctx, nodes, name,
                              gpu_triton.TritonKernelCall(kernel, *planned.grid, 1, parameters),
                              aliases)
