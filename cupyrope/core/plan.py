"""Argument checking: turn the arguments of ``apply_rope`` into a :class:`RopePlan` or raise.

Everything that can be wrong with a call is found here, before any allocation, kernel launch or
write: the messages name the argument, what was expected and what was given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .abi import AngleSource
from .arrays import ArrayInfo, describe, in_place_refusal, to_host
from .dtypes import FLOAT_DTYPES, ITEMSIZE, POSITION_DTYPES
from .mrope import MROPE_NONE, mrope_layout
from .scaling import as_dict
from .overlap import overlaps_itself, shares_memory
from .schedules import (DEFAULT_THETA, SEQ_LEN_SCHEDULES, compute_frequencies, rotary_dim_for,
                        scaling_type)
from .validators import check_bool, check_rotary_dim, check_theta, is_integer


@dataclass
class RopePlan:
    """A checked ``apply_rope`` call. Strides are in elements; token strides are aligned to
    ``token_shape`` (0 where an operand broadcasts)."""

    q: ArrayInfo
    k: ArrayInfo | None
    token_shape: tuple[int, ...]
    num_q_heads: int
    num_k_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    inverse: bool
    inplace: bool
    source: AngleSource
    positions: ArrayInfo | None = None  # None: arange along the last token dim
    positions_strides: tuple[int, ...] = ()
    cache: ArrayInfo | None = None  # cos_sin_cache, [max_position, rotary_dim]
    cos: ArrayInfo | None = None  # per-token tables
    sin: ArrayInfo | None = None
    cos_strides: tuple[int, ...] = ()
    sin_strides: tuple[int, ...] = ()
    cos_col_stride: int = 1  # elements between the table entries of pairs j and j + 1
    sin_col_stride: int = 1
    inv_freq: np.ndarray | None = None  # computed angles: float64 [rotary_dim // 2]
    attention_factor: float = 1.0
    # M-RoPE (schedules.mrope_layout): positions are [3, ...] (temporal, height, width) and each
    # pair takes its angle from one component.
    mrope_mode: int = MROPE_NONE
    mrope_sections: tuple[int, int, int] | None = None
    positions_component_stride: int = 0
    # The fused ops (cupyrope.core.fused_plan): RMSNorm, fp8 outputs, the KV-cache write; None for a rotation.
    fusion: object | None = None
    op_name: str = "apply_rope"  # the public function called: the prefix of every message

    @property
    def device(self) -> int | None:
        return self.q.device

    @property
    def num_tokens(self) -> int:
        return int(np.prod(self.token_shape, dtype=np.int64))

    @property
    def table(self) -> ArrayInfo | None:
        return self.cache if self.cache is not None else self.cos

    @property
    def is_empty(self) -> bool:
        """Nothing to rotate: no tokens or no heads (the call returns without a launch)."""
        return self.num_tokens == 0 or self.num_q_heads + self.num_k_heads == 0


def _describe(x, name: str) -> ArrayInfo:
    """An argument's ArrayInfo (routes that describe arrays themselves pass ArrayInfos)."""
    return x if isinstance(x, ArrayInfo) else describe(x, name)


def _broadcast_strides(info: ArrayInfo, shape: tuple[int, ...], target: tuple[int, ...],
                       strides: tuple[int, ...], name: str, op_name: str) -> tuple[int, ...]:
    """Strides that index ``info`` (leading ``shape``) at every index of ``target``."""
    extra = len(shape) - len(target)
    if extra > 0:
        if any(s != 1 for s in shape[:extra]):
            raise ValueError(
                f"{op_name}: {name} of shape {info.shape} does not broadcast to the token dims "
                f"{target}"
            )
        shape, strides = shape[extra:], strides[extra:]
    out = [0] * (len(target) - len(shape))
    for size, stride, want in zip(shape, strides, target[len(target) - len(shape):]):
        if size == want:
            out.append(stride if size > 1 else 0)
        elif size == 1:
            out.append(0)
        else:
            raise ValueError(
                f"{op_name}: {name} of shape {info.shape} does not broadcast to the token dims "
                f"{target}"
            )
    return tuple(out)


def _check_same_device(info: ArrayInfo, q: ArrayInfo, name: str, op_name: str) -> None:
    if info.device != q.device:
        raise ValueError(
            f"{op_name}: {name} is on {info.where()} but q is on {q.where()}; all arrays of one "
            "call must be on the same device"
        )


def _check_rotated(info: ArrayInfo, name: str, op_name: str) -> None:
    # Any strides, the last dim's included: a head whose elements are not adjacent takes the
    # kernels' scalar path (refused by the fused ops: check_dense_heads).
    if info.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op_name}: {name} must be one of {FLOAT_DTYPES}, got {info.dtype}")
    if info.ndim < 2:
        raise ValueError(f"{op_name}: {name} must have shape [..., heads, head_dim], got {info.shape}")


def has_dense_heads(info: ArrayInfo) -> bool:
    """Stride 1 in the last dim (head_dim), or nothing to index (NumPy and torch may report any
    strides for an empty array or a dim of one element)."""
    return info.strides[-1] == 1 or info.shape[-1] <= 1 or info.size == 0


def check_dense_heads(plan: RopePlan) -> None:
    """The fused kernels (RMSNorm, fp8 outputs, the KV-cache write) address a head's elements
    as adjacent: q and k must have stride 1 in their last dim. Raises ValueError saying what to
    pass instead."""
    for name, info in (("q", plan.q), ("k", plan.k)):
        if info is not None and not has_dense_heads(info):
            raise ValueError(
                f"{plan.op_name}: {name} must have stride 1 in its last dim (head_dim) for the fused "
                f"ops (RMSNorm, fp8 outputs, the KV-cache write), got strides {info.strides}; pass "
                f"a dense copy ({name}.contiguous() in torch, ascontiguousarray in NumPy / CuPy), "
                "or rotate with apply_rope, which takes any stride"
            )


def _check_written_layout(info: ArrayInfo, name: str, op_name: str, prefix: str) -> None:
    """An array the launch writes must not give two indices the same element: a zero stride, or
    strides that make rows or heads interleave onto each other (possible once the last dim is
    strided), would write one element twice with different values."""
    if info.size > 0 and any(stride == 0 and size > 1
                             for size, stride in zip(info.shape, info.strides)):
        raise ValueError(
            f"{op_name}: {prefix}{name} has a zero stride (shape {info.shape}, strides "
            f"{info.strides}), so its elements alias each other"
        )
    if overlaps_itself(info):
        raise ValueError(
            f"{op_name}: {prefix}{name} of shape {info.shape} has strides {info.strides} under "
            "which two of its indices reach the same element, so a write would clobber one of "
            "them; pass an array whose indices reach distinct elements"
        )


def _check_inplace_target(info: ArrayInfo, name: str, op_name: str) -> None:
    if info.kind == "jax":
        raise TypeError(f"{op_name}: inplace=True needs a mutable array; {name} is an immutable JAX array")
    if not info.writable:
        raise ValueError(f"{op_name}: inplace=True but {name} is read-only")
    refusal = in_place_refusal(info)
    if refusal is not None:
        raise RuntimeError(f"{op_name}: inplace=True but {name} {refusal}")
    _check_written_layout(info, name, op_name, "inplace=True but ")


def plan_rope(q, k=None, positions=None, *, cos_sin_cache=None, cos=None, sin=None,
              theta=10000.0, scaling=None, interleaved=False, rotary_dim=None, inverse=False,
              inplace=False, seq_len=None, op_name="apply_rope") -> RopePlan:
    """Check every argument of :func:`cupyrope.apply_rope`; see it for their meaning.
    ``op_name``: the public function called (a fused op's name), which prefixes every message."""
    interleaved = check_bool(interleaved, "interleaved", op_name)
    inverse = check_bool(inverse, "inverse", op_name)
    inplace = check_bool(inplace, "inplace", op_name)
    scaling = as_dict(scaling)

    qi = _describe(q, "q")
    _check_rotated(qi, "q", op_name)
    token_shape = qi.shape[:-2]
    head_dim = qi.shape[-1]

    ki = None
    if k is not None:
        ki = _describe(k, "k")
        _check_rotated(ki, "k", op_name)
        if ki.kind != qi.kind:
            raise TypeError(
                f"{op_name}: k is a {ki.kind} array but q is a {qi.kind} array; pass q and k as "
                "one array type (results come back as that type)"
            )
        _check_same_device(ki, qi, "k", op_name)
        if ki.dtype != qi.dtype:
            raise TypeError(f"{op_name}: k must have q's dtype {qi.dtype}, got {ki.dtype}")
        if ki.shape[:-2] != token_shape:
            raise ValueError(
                f"{op_name}: k's leading (token) dims {ki.shape[:-2]} must equal q's {token_shape}"
            )
        if ki.shape[-1] != head_dim:
            raise ValueError(f"{op_name}: k's head_dim {ki.shape[-1]} must equal q's {head_dim}")

    if inplace:
        _check_inplace_target(qi, "q", op_name)
        if ki is not None:
            _check_inplace_target(ki, "k", op_name)
            if ki.obj is qi.obj or (ki.on_gpu and ki.ptr == qi.ptr and qi.size > 0):
                raise ValueError(f"{op_name}: inplace=True but q and k are the same array")

    if cos_sin_cache is not None and (cos is not None or sin is not None):
        raise ValueError(f"{op_name}: pass either cos_sin_cache or cos/sin, not both")
    if (cos is None) != (sin is None):
        raise ValueError(f"{op_name}: cos and sin must be given together")

    if rotary_dim is not None:
        if not is_integer(rotary_dim):
            raise TypeError(f"{op_name}: rotary_dim must be an int, got {type(rotary_dim).__name__}")
        rotary_dim = int(rotary_dim)

    plan_args = dict(q=qi, k=ki, token_shape=token_shape, num_q_heads=qi.shape[-2],
                     num_k_heads=0 if ki is None else ki.shape[-2], head_dim=head_dim,
                     interleaved=interleaved, inverse=inverse, inplace=inplace, op_name=op_name)

    if cos_sin_cache is not None or cos is not None:
        _refuse_schedule_with_table(theta, scaling, seq_len,
                                    "cos_sin_cache" if cos is None else "cos/sin", op_name)
    if cos is not None:
        if positions is not None:
            raise ValueError(f"{op_name}: positions must be None when cos/sin tables are given")
        if isinstance(scaling, dict) and scaling.get("mrope_section") is not None:
            raise ValueError(
                f"{op_name}: M-RoPE (scaling['mrope_section']) needs [3, ...] positions: it applies "
                "to angles computed from theta and to a cos_sin_cache, not to cos/sin tables"
            )
        plan = _plan_token_tables(plan_args, _describe(cos, "cos"), _describe(sin, "sin"), rotary_dim)
    else:
        rotary_dim, source_args = (
            _plan_cache(_describe(cos_sin_cache, "cos_sin_cache"), qi, rotary_dim, op_name)
            if cos_sin_cache is not None
            else _plan_computed(theta, scaling, seq_len, rotary_dim, head_dim, op_name)
        )
        plan = RopePlan(rotary_dim=rotary_dim, **plan_args, **source_args)
        if isinstance(scaling, dict):
            # With a cache only the M-RoPE keys of scaling matter: the cache holds the schedule.
            plan.mrope_mode, plan.mrope_sections = mrope_layout(scaling, rotary_dim, op_name)
        _plan_positions(plan, positions)

    check_rotary_dim(plan.rotary_dim, op_name, head_dim)
    operands = operands_of(plan)
    for name, info in operands:
        if info.on_gpu and info.ptr % ITEMSIZE[info.dtype]:
            raise ValueError(
                f"{op_name}: {name}'s data pointer {info.ptr:#x} is not a multiple of its element "
                f"size ({ITEMSIZE[info.dtype]} bytes for {info.dtype}); no kernel can read it: pass "
                "an array that starts on an element boundary (e.g. a copy)"
            )
    if inplace:
        _check_no_shared_elements(operands, op_name)
    return plan


def plan_outputs(plan: RopePlan, out) -> list[ArrayInfo]:
    """The ``out=`` arrays of a call, checked: q_out (and k_out when k is given), each of its
    input's array type, shape, dtype and device (any strides), writable, with no aliased
    elements, sharing no element with an operand or with each other. Returns their
    descriptions (what the launch writes)."""
    names = ("q_out", "k_out")[:1 if plan.k is None else 2]
    if plan.k is None and not isinstance(out, (tuple, list)):
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise TypeError(f"apply_rope: out must be {'q_out' if plan.k is None else '(q_out, k_out)'}"
                        f" for a call {'without' if plan.k is None else 'with'} k, got "
                        f"{type(out).__name__}{'' if not isinstance(out, (tuple, list)) else f' of {len(out)}'}")
    infos = []
    for name, x, like in zip(names, out, (plan.q, plan.k)):
        info = describe(x, name)
        if info.kind != like.kind:
            raise TypeError(f"apply_rope: {name} must be a {like.kind} array like "
                            f"{name[0]}, got a {info.kind} array")
        if info.kind == "jax" or not info.writable:
            raise TypeError(f"apply_rope: out= writes into its arrays and {name} is "
                            f"{'an immutable JAX array' if info.kind == 'jax' else 'read-only'}; "
                            "use the returned arrays instead")
        if (info.shape, info.dtype, info.device) != (like.shape, like.dtype, like.device):
            raise ValueError(
                f"apply_rope: {name} must have {name[0]}'s shape, dtype and device ("
                f"{like.shape}, {like.dtype}, {like.where()}), got ({info.shape}, {info.dtype}, "
                f"{info.where()})")
        refusal = in_place_refusal(info)
        if refusal is not None:
            raise RuntimeError(f"apply_rope: {name} {refusal}")
        _check_written_layout(info, name, "apply_rope", "")
        if info.on_gpu and info.ptr % ITEMSIZE[info.dtype]:
            raise ValueError(f"apply_rope: {name}'s data pointer {info.ptr:#x} is not a multiple of "
                             f"its element size ({ITEMSIZE[info.dtype]} bytes)")
        infos.append(info)
    operands = operands_of(plan) + list(zip(names, infos))
    for written, info in zip(names, infos):
        for other, other_info in operands:
            if other != written and shares_memory(info, other_info):
                raise ValueError(f"apply_rope: {written} shares memory with {other}; out= arrays "
                                 "must not overlap any argument (use inplace=True to write into q "
                                 "and k)")
    return infos


def operands_of(plan: RopePlan) -> list[tuple[str, ArrayInfo]]:
    named = (("q", plan.q), ("k", plan.k), ("positions", plan.positions),
             ("cos_sin_cache", plan.cache), ("cos", plan.cos), ("sin", plan.sin))
    return [(name, info) for name, info in named if info is not None]


def _check_no_shared_elements(operands, op_name: str) -> None:
    """In place, q and k are read and written by the same launch: neither may share an element
    with another operand (exact; fused-QKV views that interleave without sharing are fine)."""
    for written, info in operands[:2]:
        if written not in ("q", "k"):
            break
        for other, other_info in operands:
            if other == written or (written == "k" and other == "q"):
                continue
            if shares_memory(info, other_info):
                raise ValueError(
                    f"{op_name}: inplace=True but {written} shares memory with {other}: the "
                    f"rotation would read elements it has already written. Pass arrays that do not "
                    f"overlap, or rotate out of place"
                )


# Keys of a scaling dict that still mean something with a table: the M-RoPE layout.
_TABLE_SCALING_KEYS = frozenset({"mrope_section", "mrope_interleaved"})


def _refuse_schedule_with_table(theta, scaling, seq_len, table: str, op_name: str) -> None:
    """A table holds its angles: a schedule given beside it would be ignored, so it is refused."""
    if isinstance(theta, (bool, np.bool_)) or not isinstance(theta, (int, float, np.number)):
        check_theta(theta, op_name)  # the type error a wrong theta always gets
    if theta != DEFAULT_THETA:
        raise ValueError(
            f"{op_name}: theta={theta!r} is given with {table}, which already holds the angles; "
            "leave theta at its default or drop the table to compute angles from theta"
        )
    if seq_len is not None:
        raise ValueError(f"{op_name}: seq_len is given with {table}, which does not use it "
                         "(only the dynamic and longrope schedules read it)")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        scaling_type(scaling, op_name)  # the TypeError for a scaling that is not a dict
    ignored = sorted(key for key, value in scaling.items()
                     if key not in _TABLE_SCALING_KEYS
                     and not (key in ("rope_type", "type") and value in (None, "default")))
    if ignored:
        raise ValueError(
            f"{op_name}: scaling keys {ignored} are given with {table}, which already holds the "
            "schedule's angles; with a table, scaling may only carry M-RoPE keys "
            f"({sorted(_TABLE_SCALING_KEYS)}). Build the table with that schedule instead "
            "(cupyrope.cos_sin_cache(..., scaling=...))"
        )


def _plan_cache(cache: ArrayInfo, q: ArrayInfo, rotary_dim, op_name: str):
    _check_same_device(cache, q, "cos_sin_cache", op_name)
    if cache.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op_name}: cos_sin_cache must be one of {FLOAT_DTYPES}, got {cache.dtype}")
    if cache.ndim != 2:
        raise ValueError(
            f"{op_name}: cos_sin_cache must have shape [max_position, rotary_dim], got {cache.shape}"
        )
    width = cache.shape[1]
    if rotary_dim is None:
        rotary_dim = width
    if width != rotary_dim:
        raise ValueError(
            f"{op_name}: cos_sin_cache is {width} wide but rotary_dim is {rotary_dim}; the cache "
            "holds rotary_dim // 2 cos then rotary_dim // 2 sin per row"
        )
    if width % 2:
        raise ValueError(f"{op_name}: cos_sin_cache width must be even, got {width}")
    if width > q.shape[-1]:
        raise ValueError(
            f"{op_name}: cos_sin_cache is {width} wide, more than q's head_dim {q.shape[-1]}; "
            "its width is rotary_dim, which must not exceed head_dim"
        )
    return rotary_dim, dict(source=AngleSource.CACHE_TABLE, cache=cache,
                            cos_col_stride=cache.strides[1], sin_col_stride=cache.strides[1])


def _plan_computed(theta, scaling, seq_len, rotary_dim, head_dim, op_name: str):
    check_theta(theta, op_name)
    if seq_len is not None and scaling_type(scaling, op_name) not in SEQ_LEN_SCHEDULES:
        raise ValueError(
            f"{op_name}: seq_len is given but the {scaling_type(scaling, op_name)!r} schedule "
            f"does not use it (only {' and '.join(SEQ_LEN_SCHEDULES)} read it); leave it out"
        )
    # head_dim, or int(head_dim * partial_rotary_factor) when scaling has one (Hugging Face's dim)
    given = rotary_dim
    rotary_dim = rotary_dim_for(head_dim, scaling, rotary_dim, op_name)
    if given is None and rotary_dim == head_dim and (head_dim < 2 or head_dim % 2):
        # The user gave no rotary_dim: name what they did give (q's last dim).
        raise ValueError(
            f"{op_name}: head_dim must be even and >= 2 to rotate whole heads (rotary_dim "
            f"defaults to head_dim), got head_dim {head_dim}"
            + (f"; pass an even rotary_dim below it (e.g. rotary_dim={head_dim - 1}) to rotate "
               "part of each head" if head_dim > 2 else "")
        )
    check_rotary_dim(rotary_dim, op_name, head_dim)
    inv_freq, attention_factor = compute_frequencies(rotary_dim, theta=theta, scaling=scaling,
                                                     seq_len=seq_len, op_name=op_name)
    return rotary_dim, dict(source=AngleSource.COMPUTED, inv_freq=inv_freq,
                            attention_factor=attention_factor)


def _plan_positions(plan: RopePlan, positions) -> None:
    token_shape, op_name = plan.token_shape, plan.op_name
    if positions is None:
        if plan.mrope_mode != MROPE_NONE:
            raise ValueError(f"{op_name}: M-RoPE needs positions of shape [3, ...]; got None")
        if not token_shape:
            # Position 0 for every head would return q unchanged: most likely a forgotten token
            # dim or forgotten positions, so neither is guessed.
            raise ValueError(
                f"{op_name}: q of shape {plan.q.shape} is [heads, head_dim], with no token dim, "
                "and positions is None, so no token has a position. Pass q as [tokens, heads, "
                "head_dim] (positions=None numbers the tokens 0, 1, ...; q[None] is one token) "
                "or pass positions (a 0-d int array for one token at that position)"
            )
        # arange along the last token dim (axis -3 of q)
        plan.positions_strides = tuple(1 if i == len(token_shape) - 1 else 0
                                       for i in range(len(token_shape)))
        return
    info = _describe(positions, "positions")
    if info.dtype not in POSITION_DTYPES:
        raise TypeError(f"{op_name}: positions must be int32 or int64, got {info.dtype}")
    _check_same_device(info, plan.q, "positions", op_name)
    plan.positions = info
    shape, strides = info.shape, info.strides
    if plan.mrope_mode != MROPE_NONE:
        if info.ndim < 1 or shape[0] != 3:
            raise ValueError(
                f"{op_name}: M-RoPE needs positions of shape [3, ...] (temporal, height, width), "
                f"the rest broadcastable to the token dims {token_shape}; got {shape}"
            )
        plan.positions_component_stride = strides[0]
        shape, strides = shape[1:], strides[1:]
    plan.positions_strides = _broadcast_strides(info, shape, token_shape, strides, "positions",
                                                op_name)


def _plan_token_tables(plan_args: dict, cos: ArrayInfo, sin: ArrayInfo, rotary_dim) -> RopePlan:
    q, op_name = plan_args["q"], plan_args["op_name"]
    for info, name in ((cos, "cos"), (sin, "sin")):
        _check_same_device(info, q, name, op_name)
        if info.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op_name}: {name} must be one of {FLOAT_DTYPES}, got {info.dtype}")
        if info.ndim < 1:
            raise ValueError(f"{op_name}: {name} must have a last dim of table entries, got a scalar")
    if cos.dtype != sin.dtype:
        raise TypeError(f"{op_name}: cos and sin must share one dtype, got {cos.dtype} and {sin.dtype}")
    width = cos.shape[-1]
    if sin.shape[-1] != width:
        raise ValueError(f"{op_name}: cos and sin must be equally wide, got {width} and {sin.shape[-1]}")
    if rotary_dim is None:
        rotary_dim = width  # Hugging Face convention: tables are rotary_dim wide
        if width % 2 or width > q.shape[-1]:
            raise ValueError(
                f"{op_name}: cos/sin are {width} wide; without rotary_dim that width is the "
                f"rotary_dim, which must be even and at most head_dim ({q.shape[-1]})"
            )
    if width not in (rotary_dim, rotary_dim // 2) or width < 1:
        raise ValueError(
            f"{op_name}: cos/sin tables must be rotary_dim ({rotary_dim}) or rotary_dim // 2 "
            f"({rotary_dim // 2}) wide, got {width}"
        )
    full_width = width == rotary_dim
    plan = RopePlan(rotary_dim=rotary_dim, source=AngleSource.TOKEN_TABLES, cos=cos, sin=sin,
                    **plan_args)
    token_shape = plan.token_shape
    # Full-width interleaved tables repeat each entry twice (cos[2j] == cos[2j + 1]): read every
    # second one. Full-width NeoX tables repeat the halves: read the first half.
    step = 2 if (full_width and plan.interleaved) else 1
    plan.cos_strides = _broadcast_strides(cos, cos.shape[:-1], token_shape, cos.strides[:-1], "cos",
                                          op_name)
    plan.sin_strides = _broadcast_strides(sin, sin.shape[:-1], token_shape, sin.strides[:-1], "sin",
                                          op_name)
    plan.cos_col_stride = cos.strides[-1] * step
    plan.sin_col_stride = sin.strides[-1] * step
    return plan


def check_values(plan: RopePlan) -> None:
    """``validate=True``: the checks that read values on the host (they synchronise).

    - Cache source: positions outside the cache raise IndexError.
    - Full-width per-token tables: the kernels read one entry per pair (NeoX: the first half,
      interleaved: the even entries), so tables whose halves (pairs) differ raise ValueError
      instead of rotating silently by the first half only.
    """
    op_name = plan.op_name
    if plan.source == AngleSource.TOKEN_TABLES:
        _check_full_width_repeats(plan)
        return
    if plan.source != AngleSource.CACHE_TABLE:
        return
    max_position = plan.cache.shape[0]
    if plan.positions is None:
        last = plan.token_shape[-1] if plan.token_shape else 1
        lo, hi = 0, last - 1
        if plan.num_tokens == 0:
            return
    else:
        values = to_host(plan.positions)
        if values.size == 0:
            return
        lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= max_position:
        raise IndexError(
            f"{op_name}: positions must lie in [0, {max_position}) for a cos_sin_cache of "
            f"{max_position} rows, got values in [{lo}, {hi}]"
        )


def _check_full_width_repeats(plan: RopePlan) -> None:
    width, op_name = plan.cos.shape[-1], plan.op_name
    if width != plan.rotary_dim:  # half-width tables: one entry per pair, nothing repeated
        return
    for info, name in ((plan.cos, "cos"), (plan.sin, "sin")):
        values = to_host(info)
        if plan.interleaved:
            first, second, how = values[..., 0::2], values[..., 1::2], "entries 2j and 2j + 1"
        else:
            half = width // 2
            first, second, how = values[..., :half], values[..., half:], "its two halves"
        if not np.array_equal(first, second, equal_nan=True):
            raise ValueError(
                f"{op_name}: {name} is rotary_dim ({width}) wide, so {how} must be equal (the "
                "Hugging Face layout repeats each angle); they differ. Pass rotary_dim // 2-wide "
                "tables with one entry per pair"
            )
