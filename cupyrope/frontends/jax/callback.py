"""The callback route of cupyrope's primitives: a ``jax.experimental.buffer_callback`` that runs
the checked plan on XLA's own buffers and stream (the CUDA kernel on a GPU, the NumPy path on the
CPU), for what the native call and the jax.numpy lowering do not cover. Design:
``docs/jax_internals.md``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ... import execute
from ...core.arrays import cupy_module, cupy_view_of_buffer, describe, on_gpu_buffer
from ...core.dtypes import FP8_DTYPES, dtype_name
from ...core.plan import check_values, plan_rope
from .planning import (CACHES, ROPE_ARRAYS, SCALED, FusedCall, RotationOptions,
                       plan_fused_call, rope_operands_by_name)


def rope_outputs(*operands, rotation: RotationOptions, present: tuple[bool, ...]):
    """cupyrope_rope's results through the buffer_callback (``mlir.lower_fun``'s body)."""
    named = rope_operands_by_name(present, operands)
    q_out, k_out = _rope_callback_call(rotation, named["q"], named["k"],
                                       tuple(named[name] for name in ROPE_ARRAYS[2:]))
    return [q_out] + ([k_out] if k_out is not None else [])


def fused_outputs(*arrays, fused: FusedCall):
    """cupyrope_fused's results through the buffer_callback (``mlir.lower_fun``'s body)."""
    return list(_fused_callback_call(fused, arrays))


def _rope_callback_call(rotation: RotationOptions, q, k, tables):
    """(q_out, k_out or None) through one buffer_callback."""
    from jax.experimental.buffer_callback import buffer_callback

    present = tuple(x is not None for x in (k, *tables))
    inputs = [x for x in (q, k, *tables) if x is not None]
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if k is not None:
        results.append(jax.ShapeDtypeStruct(k.shape, k.dtype))
    run = buffer_callback(_rope_callback(rotation, present), tuple(results),
                          vmap_method="sequential")
    outs = run(*inputs)
    return outs[0], (outs[1] if k is not None else None)


@functools.lru_cache(maxsize=1024)
def _rope_callback(rotation: RotationOptions, present: tuple[bool, ...]):
    """The callback for one set of options (memoised: its identity keys JAX's compile caches)."""
    options = rotation.call_options()

    def rotate(inputs, outputs):
        it = iter(inputs)
        q = next(it)
        k, positions, cache, cos, sin = (next(it) if here else None for here in present)
        plan = plan_rope(q, k, positions, cos_sin_cache=cache, cos=cos, sin=sin, **options)
        if rotation.validate:
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
    with cupy.cuda.Device(device), _xla_stream(cupy, ctx.stream, device):
        body(inputs, outputs)


class _StreamHandle:
    """XLA's stream handle through the CUDA stream protocol, as CuPy 14 takes external streams."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def _xla_stream(cupy, handle: int, device: int):
    """A CuPy stream on XLA's stream ``handle`` (``Stream.from_external``; CuPy 13 has only
    ``ExternalStream``, which CuPy 14 deprecates with a warning on every call)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(handle, device)
    return from_external(_StreamHandle(handle))


def _fused_callback_call(fused: FusedCall, arrays: tuple) -> tuple:
    """The outputs of a fused call through one buffer_callback: q_out (k_out), then the new caches
    and the new written scale arrays (outputs aliased to the input arrays; the outputs' per-row
    scales are new outputs). fp8 arrays cross as their bits (uint8)."""
    from jax.experimental.buffer_callback import buffer_callback

    named = dict(zip(fused.names, arrays))
    out_dtype = dict(fused.options)["out_dtype"]
    rotated = [named[name] for name in ("q", "k") if name in named]
    stored = jnp.uint8 if out_dtype is not None else rotated[0].dtype
    results = [jax.ShapeDtypeStruct(x.shape, stored) for x in rotated]
    inputs, aliases = [_bits(x) for x in arrays], {}
    written = [name for name in CACHES if name in named] + list(fused.written_scales)
    for name in written:
        if name in named:
            index = fused.names.index(name)
            aliases[index] = len(results)
            results.append(jax.ShapeDtypeStruct(inputs[index].shape, inputs[index].dtype))
        else:  # the per-row scales of q_out / k_out
            results.append(jax.ShapeDtypeStruct(named[SCALED[name]].shape[:-1], jnp.float32))
    run = buffer_callback(_fused_callback(fused), tuple(results), vmap_method="sequential",
                          input_output_aliases=aliases or None)
    outs = list(run(*inputs))
    if out_dtype is not None:
        outs[:len(rotated)] = [jax.lax.bitcast_convert_type(o, out_dtype)
                               for o in outs[:len(rotated)]]
    for position, name in enumerate(written, len(rotated)):
        if name in named and outs[position].dtype != named[name].dtype:  # fp8, from its bits
            outs[position] = jax.lax.bitcast_convert_type(outs[position], named[name].dtype)
    return tuple(outs)


def _bits(x):
    """An fp8 array as its bits (uint8); any other array as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if dtype_name(x.dtype) in FP8_DTYPES else x


@functools.lru_cache(maxsize=1024)
def _fused_callback(fused: FusedCall):
    """The callback of one fused call description (memoised: its identity keys JAX's compile
    caches). It checks the call again on XLA's buffers (cheap; validate=True reads values here)
    and runs the fused kernel or the NumPy path."""
    options = dict(fused.options)
    rotated = 2 if "k" in fused.names else 1

    written = [name for name in CACHES if name in fused.names] + list(fused.written_scales)

    def rotate(inputs, outputs):
        named = dict(zip(fused.names, inputs))
        # Written where XLA wants the new arrays: outputs aliased to the input caches (and
        # their scales), which hold the inputs' rows when the callback starts. Where XLA did not
        # alias them (jax.vmap over batched caches on a GPU hands each element a fresh output
        # slice), the input rows are copied first, so that rows no slot names keep their values.
        for name, out in zip(written, outputs[rotated:]):
            if name in named and describe(out, name).ptr != describe(named[name], name).ptr:
                out[...] = named[name]
            named[name] = out
        plan = plan_fused_call(fused.op_name, fused.rotation, options, named,
                               validate=fused.rotation.validate)
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
