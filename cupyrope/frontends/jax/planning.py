"""What a traced JAX call is made of: its hashable options (:class:`RotationOptions`,
:class:`FusedCall`), the names of its array operands, and its checked plan from their shapes,
shared by the entry points, the lowerings and the callback. Design: ``docs/jax_internals.md``."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...core.arrays import ArrayInfo, describe, describe_traced
from ...core.fused_plan import PER_HEAD, is_per_row, plan_fused
from ...core.plan import plan_rope
from ...core.scaling import Scaling

# The rotation's array arguments, in the order cupyrope_rope takes them.
ROPE_ARRAYS = ("q", "k", "positions", "cos_sin_cache", "cos", "sin")
TABLES = ("cos_sin_cache", "cos", "sin")
# The fused ops' array arguments besides the rotation's, in the order the callback takes them.
FUSED_ARRAYS = ("q_weight", "k_weight", "v", "k_cache", "v_cache", "slot_mapping",
                "k_cache_scales", "v_cache_scales")
SCALES = ("q_scale", "k_scale", "v_scale")  # numbers (static) or arrays (operands)
CACHES = ("k_cache", "v_cache")
BLOCK_SCALES = ("k_cache_scales", "v_cache_scales")  # an NVFP4 cache's e4m3 block scales
# The scale arrays a call may write, in the order their new arrays follow the new caches.
WRITTEN_SCALES = SCALES + BLOCK_SCALES
SCALED = {"q_scale": "q", "k_scale": "k"}  # the outputs' per-row scales: whose rows they scale
_VALIDATED = ("positions", "cos", "sin", "slot_mapping")  # what validate=True reads


class RotationOptions(NamedTuple):
    """The hashable, non-array options of one rotation (custom_vjp's non-differentiable argument,
    the ``rotation`` param of ``cupyrope_rope``)."""

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


class FusedCall(NamedTuple):
    """The hashable description of one fused call (the ``fused`` param of ``cupyrope_fused``):
    the rotation's options, the fused options that are not arrays (canonical: fp8 dtypes by name),
    and the names of the array arguments given, in the order the primitive receives them."""

    op_name: str
    rotation: RotationOptions
    options: tuple[tuple[str, object], ...]
    names: tuple[str, ...]
    # One element of a jax.vmap run per element (the primitives' batching rule): a cache write
    # there keeps the callback on GPUs (see primitives._gpu_lowering).
    per_element: bool = False
    # The scale arrays the call writes (per-row fp8 scales, NVFP4 block scales), in the order of
    # WRITTEN_SCALES: those in ``names`` (a cache's) come back as new arrays aliased to them; the
    # others (the rows of fp8 outputs, every one written) are new arrays of the call alone.
    written_scales: tuple[str, ...] = ()

    @property
    def writes_cache(self) -> bool:
        return any(name in self.names for name in CACHES)

    @property
    def new_row_scales(self) -> tuple[str, ...]:
        """The written scales that are no operand: per-row scales of q_out / k_out."""
        return tuple(name for name in self.written_scales if name not in self.names)


def rope_operand_names(present: tuple[bool, ...]) -> tuple[str, ...]:
    """The names of a ``cupyrope_rope``'s operands: q, then the present ones of k, positions,
    cos_sin_cache, cos, sin."""
    return ("q",) + tuple(name for name, here in zip(ROPE_ARRAYS[1:], present) if here)


def rope_operands_by_name(present: tuple[bool, ...], operands) -> dict:
    """The rotation's operands by name (absent ones None)."""
    return dict(dict.fromkeys(ROPE_ARRAYS), **dict(zip(rope_operand_names(present), operands)))


def plan_rotation(infos: dict, rotation: RotationOptions, *, inplace: bool = False):
    """The checked plan of a rotation from its arrays' infos by name (absent ones left out)."""
    return plan_rope(infos["q"], infos.get("k"), infos.get("positions"),
                     **{name: infos.get(name) for name in TABLES}, inplace=inplace,
                     **rotation.call_options())


def plan_fused_call(op_name: str, rotation: RotationOptions, options: dict, named: dict, *,
                    inplace=False, validate: bool, new_row_scales: tuple[str, ...] = ()):
    """The checked plan of a fused call from its arrays by name (ArrayInfos while tracing, NumPy
    or CuPy views of XLA's buffers in the callback). ``new_row_scales``: per-row scales of the
    outputs that the call returns as new arrays, planned as float32 ``q.shape[:-1]`` /
    ``k.shape[:-1]`` arrays where ``named`` holds none (while tracing and lowering)."""
    named = dict(named)
    for name in new_row_scales:
        if name not in named:
            named[name] = new_row_scales_info(named[SCALED[name]], name)
    return plan_fused(
        op_name, named["q"], named.get("k"), named.get("positions"),
        rope=dict(rotation.call_options(), inplace=inplace,
                  **{name: named.get(name) for name in TABLES}),
        fusion=dict(options, **{name: x for name, x in named.items()
                                if name in FUSED_ARRAYS or name in SCALES}),
        validate=validate)


def new_row_scales_info(x, name: str):
    """The ArrayInfo of the new per-row scales of ``x`` (q or k, an ArrayInfo or an array):
    float32 ``x.shape[:-1]``, C order, on x's device, written by the call."""
    x = describe(x, name) if isinstance(x, ArrayInfo) else describe_traced(x, name)
    shapes_only = np.broadcast_to(np.zeros((), np.float32), tuple(x.shape[:-1]))
    info = describe_traced(shapes_only, name)
    info.kind, info.device, info.writable = x.kind, x.device, True
    return info


def wants_new_row_scales(op_name: str, value, x) -> bool:
    """Whether ``"per_head"`` here makes new scale arrays (as eager calls on mutable arrays do:
    apply_rope and rms_norm_rope, for q / k with a token dim); otherwise the checks refuse it."""
    return (isinstance(value, str) and value == PER_HEAD and op_name != "rope_and_cache"
            and x is not None and len(x.shape) >= 3)


def planning_info(x, name: str, *, read: bool):
    """What a fused call is checked with before it runs: the shape and dtype of a JAX array
    (``describe_traced``), a NumPy cache as it is (the checks refuse it)."""
    if isinstance(x, np.ndarray):
        return describe(x, name)
    info = describe_traced(x, name)
    if name in CACHES or name in BLOCK_SCALES or (name in SCALES and is_per_row(x)):
        info.writable = True  # the call writes new arrays (XLA's buffers), never this one
    elif name in SCALES and info.size == 1:
        info.view = np.ones(info.shape, np.float32)  # the checks read a value; the call reads x
    elif read and name in _VALIDATED:
        info.view = np.asarray(x)  # validate=True on concrete arrays: checked now, on the host
    return info
