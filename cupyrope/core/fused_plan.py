"""Checks of what the fused ops add to a rotation: RMSNorm weights, fp8 outputs and their scales,
and the KV-cache write (v, the paged caches, the slot mapping). :func:`plan_fusion` turns those
arguments into a :class:`FusionPlan` or raises, before anything is allocated, launched or written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .abi import StoreFormat
from .arrays import ArrayInfo, describe, to_host
from .dtypes import FP8_DTYPES, ITEMSIZE, POSITION_DTYPES, dtype_name_of, refused_dtype_error
from .overlap import shares_memory
from .plan import RopePlan, check_values, operands_of, plan_rope
from .validators import check_real

# Largest finite value of each fp8 format: stores saturate there.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
STORE_FORMATS = {"float8_e4m3fn": StoreFormat.E4M3, "float8_e5m2": StoreFormat.E5M2}
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("NHD", "HND")


@dataclass
class Scale:
    """An fp8 scale: a Python number, or a one-element float32 array (read by the kernel on the
    GPU, so that a CUDA graph sees updated values)."""

    value: float = 1.0
    array: ArrayInfo | None = None


@dataclass
class FusionPlan:
    """What a fused call does besides rotating q and k. Strides are in elements."""

    op_name: str
    norm: bool = False
    q_weight: ArrayInfo | None = None
    k_weight: ArrayInfo | None = None
    eps: float = 0.0
    weight_offset: float = 0.0
    out_dtype: str | None = None  # fp8 dtype of q_out / k_out; None: the input dtype
    q_scale: Scale | None = None
    k_scale: Scale | None = None
    v_scale: Scale | None = None
    v: ArrayInfo | None = None
    k_cache: ArrayInfo | None = None
    v_cache: ArrayInfo | None = None
    slot_mapping: ArrayInfo | None = None
    cache_dtype: str | None = None  # the caches' element format (fp8 or the input dtype)
    layout: str = "NHD"
    block_size: int = 0
    num_blocks: int = 0

    @property
    def writes_cache(self) -> bool:
        return self.k_cache is not None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def cache_strides(self, cache: ArrayInfo) -> tuple[int, int, int]:
        """(block, slot-in-block, head) element strides of a cache in this layout."""
        s = cache.strides
        return (s[0], s[1], s[2]) if self.layout == "NHD" else (s[0], s[2], s[1])

    def operands(self) -> list[tuple[str, ArrayInfo]]:
        named = (("q_weight", self.q_weight), ("k_weight", self.k_weight), ("v", self.v),
                 ("k_cache", self.k_cache), ("v_cache", self.v_cache),
                 ("slot_mapping", self.slot_mapping),
                 *((name, s.array) for name, s in (("q_scale", self.q_scale),
                                                   ("k_scale", self.k_scale),
                                                   ("v_scale", self.v_scale))
                   if s is not None))
        return [(name, info) for name, info in named if info is not None]


def fp8_name(value, name: str, op_name: str) -> str | None:
    """The fp8 dtype named by ``value`` (a string or a NumPy / torch / JAX dtype), or None."""
    if value is None:
        return None
    text = dtype_name_of(value)
    if text not in FP8_DTYPES:
        raise refused_dtype_error(value)(
            f"{op_name}: {name} must be None or one of {FP8_DTYPES}, got {value!r}")
    return text


def _scale(value, name: str, op_name: str, q: ArrayInfo) -> Scale:
    if value is None:
        return Scale()
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        scale = check_real(value, name, op_name)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{op_name}: {name} must be finite and > 0, got {value!r}")
        return Scale(value=scale)
    info = describe(value, name)
    if info.size != 1 or info.ndim > 1:
        raise ValueError(f"{op_name}: {name} must be a number or a 0-d / one-element array, got "
                         f"shape {info.shape}")
    if info.dtype != "float32":
        raise TypeError(f"{op_name}: {name} must be float32, got {info.dtype}")
    if info.device != q.device:
        raise ValueError(f"{op_name}: {name} is on {info.where()} but q is on {q.where()}")
    if not info.on_gpu:  # the NumPy path reads it now
        return Scale(value=float(to_host(info).reshape(())))
    return Scale(array=info)


def _weight(value, name: str, op_name: str, q: ArrayInfo, head_dim: int) -> ArrayInfo:
    info = describe(value, name)
    if info.shape != (head_dim,):
        raise ValueError(f"{op_name}: {name} must have shape ({head_dim},) (head_dim), got "
                         f"{info.shape}")
    if info.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op_name}: {name} must be one of {WEIGHT_DTYPES}, got {info.dtype}")
    if info.device != q.device:
        raise ValueError(f"{op_name}: {name} is on {info.where()} but q is on {q.where()}")
    return info


def plan_fusion(op_name: str, q: ArrayInfo, k: ArrayInfo | None, *, q_weight=None, k_weight=None,
                eps=None, weight_offset=0.0, norm=False, out_dtype=None, q_scale=None,
                k_scale=None, v=None, k_cache=None, v_cache=None, slot_mapping=None,
                layout="NHD", v_scale=None, cache_dtype=None) -> FusionPlan:
    """Check the fused part of a call (see :func:`cupyrope.rms_norm_rope` and
    :func:`cupyrope.rope_and_cache` for the arguments)."""
    if q.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op_name}: q must be float16, bfloat16 or float32 for the fused ops, got "
                        f"{q.dtype} (apply_rope rotates float64)")
    head_dim = q.shape[-1]
    plan = FusionPlan(op_name=op_name)
    if norm:
        plan.norm = True
        if eps is None:
            raise TypeError(f"{op_name}: eps is required (e.g. eps=1e-6, the model's rms_norm_eps)")
        plan.eps = check_real(eps, "eps", op_name)
        if not (math.isfinite(plan.eps) and plan.eps >= 0):
            raise ValueError(f"{op_name}: eps must be finite and >= 0, got {eps!r}")
        plan.weight_offset = check_real(weight_offset, "weight_offset", op_name)
        if q_weight is None:
            raise TypeError(f"{op_name}: q_weight is required")
        plan.q_weight = _weight(q_weight, "q_weight", op_name, q, head_dim)
        if k is not None:
            if k_weight is None:
                raise TypeError(f"{op_name}: k_weight is required when k is given")
            plan.k_weight = _weight(k_weight, "k_weight", op_name, q, head_dim)
            if plan.k_weight.dtype != plan.q_weight.dtype:
                raise TypeError(f"{op_name}: q_weight and k_weight must have one dtype, got "
                                f"{plan.q_weight.dtype} and {plan.k_weight.dtype}")
        elif k_weight is not None:
            raise ValueError(f"{op_name}: k_weight given without k")

    plan.out_dtype = fp8_name(out_dtype, "out_dtype", op_name)
    if plan.out_dtype is None and q_scale is not None:
        raise ValueError(f"{op_name}: q_scale is only used with an fp8 out_dtype")
    plan.q_scale = _scale(q_scale, "q_scale", op_name, q)
    plan.k_scale = _scale(k_scale, "k_scale", op_name, q)

    if k_cache is None and v_cache is None and v is None and slot_mapping is None:
        if v_scale is not None or cache_dtype is not None:
            raise ValueError(f"{op_name}: v_scale / cache_dtype are only used with a KV cache")
        if plan.out_dtype is None and k_scale is not None:
            raise ValueError(f"{op_name}: k_scale is only used with an fp8 out_dtype or cache")
        return plan
    _plan_cache_write(plan, q, k, v, k_cache, v_cache, slot_mapping, layout, v_scale, cache_dtype)
    if plan.out_dtype is None and plan.cache_dtype is None and k_scale is not None:
        raise ValueError(f"{op_name}: k_scale is only used with an fp8 out_dtype or an fp8 cache")
    return plan


def _plan_cache_write(plan, q, k, v, k_cache, v_cache, slot_mapping, layout, v_scale,
                      cache_dtype) -> None:
    op_name = plan.op_name
    if any(x is None for x in (k, v, k_cache, v_cache, slot_mapping)):
        raise TypeError(f"{op_name}: k, v, k_cache, v_cache and slot_mapping are all required")
    if len(q.shape) != 3:
        raise ValueError(f"{op_name}: q must be [num_tokens, num_heads, head_dim] (one token dim, "
                         f"as vLLM and SGLang lay out a batch), got shape {q.shape}")
    plan.v = describe(v, "v")
    if plan.v.kind != q.kind or plan.v.device != q.device or plan.v.dtype != q.dtype:
        raise TypeError(f"{op_name}: v must be the array type, device and dtype of q "
                        f"({q.kind}, {q.where()}, {q.dtype}), got ({plan.v.kind}, "
                        f"{plan.v.where()}, {plan.v.dtype})")
    if plan.v.shape != k.shape:
        raise ValueError(f"{op_name}: v must have k's shape {k.shape} (the same tokens and KV "
                         f"heads), got {plan.v.shape}")
    if plan.v.strides[-1] != 1:
        raise ValueError(f"{op_name}: v's last dim must have stride 1, got strides {plan.v.strides}")
    if layout not in LAYOUTS:
        raise ValueError(f"{op_name}: layout must be one of {LAYOUTS}, got {layout!r}")
    plan.layout = layout
    num_tokens, num_heads, head_dim = k.shape
    caches = []
    for name, value in (("k_cache", k_cache), ("v_cache", v_cache)):
        info = describe(value, name)
        if info.kind != q.kind or info.device != q.device:
            raise TypeError(f"{op_name}: {name} must be the array type and device of q ({q.kind}, "
                            f"{q.where()}), got ({info.kind}, {info.where()})")
        if info.ndim != 4:
            raise ValueError(f"{op_name}: {name} must be 4-d ({_layout_text(layout)}), got shape "
                             f"{info.shape}")
        blocks, size, heads = ((info.shape[0], info.shape[1], info.shape[2]) if layout == "NHD"
                               else (info.shape[0], info.shape[2], info.shape[1]))
        if heads != num_heads or info.shape[3] != head_dim:
            other = LAYOUTS[1 - LAYOUTS.index(layout)]
            other_heads = info.shape[1] if other == "HND" else info.shape[2]
            fits_other = other_heads == num_heads and info.shape[3] == head_dim
            raise ValueError(f"{op_name}: {name} of shape {info.shape} does not hold {num_heads} "
                             f"heads of {head_dim} in layout {_layout_text(layout)}"
                             + (f"; it fits {_layout_text(other)}: pass layout=\"{other}\""
                                if fits_other else ""))
        if info.strides[-1] != 1:
            raise ValueError(f"{op_name}: {name}'s last dim must have stride 1, got strides "
                             f"{info.strides}")
        if not info.writable:
            raise ValueError(f"{op_name}: {name} is read-only")
        caches.append((info, blocks, size))
    (kc, blocks, size), (vc, v_blocks, v_size) = caches
    if (blocks, size) != (v_blocks, v_size):
        raise ValueError(f"{op_name}: k_cache and v_cache must have the same blocks and block size, "
                         f"got {kc.shape} and {vc.shape}")
    if kc.dtype != vc.dtype:
        raise TypeError(f"{op_name}: k_cache and v_cache must have one dtype, got {kc.dtype} and "
                        f"{vc.dtype}")
    plan.k_cache, plan.v_cache, plan.num_blocks, plan.block_size = kc, vc, blocks, size
    named = fp8_name(cache_dtype, "cache_dtype", op_name)
    if kc.dtype in FP8_DTYPES:
        if named is not None and named != kc.dtype:
            raise ValueError(f"{op_name}: cache_dtype {named} but the caches are {kc.dtype}")
        plan.cache_dtype = kc.dtype
    elif kc.dtype == "uint8":  # fp8 bits (CuPy has no fp8 dtype; vLLM keeps such caches too)
        if named is None:
            raise TypeError(f"{op_name}: uint8 caches hold fp8 bits: say which format with "
                            f"cache_dtype='float8_e4m3fn' or 'float8_e5m2'")
        plan.cache_dtype = named
    elif kc.dtype == q.dtype:
        if named is not None:
            raise ValueError(f"{op_name}: cache_dtype {named} but the caches are {kc.dtype}")
        plan.cache_dtype = None
    else:
        raise TypeError(f"{op_name}: the caches must have q's dtype {q.dtype}, an fp8 dtype, or "
                        f"uint8 with cache_dtype, got {kc.dtype}")
    if plan.cache_dtype is None and v_scale is not None:
        raise ValueError(f"{op_name}: v_scale is only used with an fp8 cache")
    plan.v_scale = _scale(v_scale, "v_scale", op_name, q)

    slots = describe(slot_mapping, "slot_mapping")
    if slots.dtype not in POSITION_DTYPES:
        raise TypeError(f"{op_name}: slot_mapping must be int32 or int64, got {slots.dtype}")
    if slots.shape != (num_tokens,):
        raise ValueError(f"{op_name}: slot_mapping must have shape ({num_tokens},) (one slot per "
                         f"token), got {slots.shape}")
    if slots.device != q.device:
        raise ValueError(f"{op_name}: slot_mapping is on {slots.where()} but q is on {q.where()}")
    plan.slot_mapping = slots


def _layout_text(layout: str) -> str:
    return ("[num_blocks, block_size, num_heads, head_dim]" if layout == "NHD"
            else "[num_blocks, num_heads, block_size, head_dim]")


def check_written_alone(plan: FusionPlan, rope_operands) -> None:
    """The caches are written by the launch: neither may share an element with any operand."""
    operands = list(rope_operands) + plan.operands()
    for written in ("k_cache", "v_cache"):
        info = dict(operands).get(written)
        if info is None:
            continue
        for other, other_info in operands:
            if other != written and shares_memory(info, other_info):
                raise ValueError(f"{plan.op_name}: {written} shares memory with {other}: pass a "
                                 "cache that no other argument overlaps")


def check_slot_values(plan: FusionPlan) -> None:
    """validate=True: every slot is padding (negative) or inside the cache, and no two tokens
    share a slot (padding may repeat)."""
    if plan.slot_mapping is None:
        return
    slots = to_host(plan.slot_mapping).astype(np.int64)
    bad = slots >= plan.num_slots
    if bad.any():
        raise IndexError(f"{plan.op_name}: slot_mapping holds {int(bad.sum())} slot(s) >= "
                         f"{plan.num_slots} (num_blocks * block_size), first "
                         f"{int(slots[bad][0])}; negative slots mean padding")
    written = slots[slots >= 0]
    values, first_token, counts = np.unique(written, return_index=True, return_counts=True)
    shared = counts > 1
    if shared.any():
        # The shared slot whose first token comes first, with every token that writes it.
        slot = int(values[shared][np.argmin(first_token[shared])])
        tokens = np.flatnonzero(slots == slot).tolist()
        raise ValueError(f"{plan.op_name}: slot_mapping gives slot {slot} to tokens {tokens} "
                         f"({int(shared.sum())} slot(s) shared in all); slots must be distinct, "
                         "one token per cache row (negative slots are padding and may repeat)")



def plan_fused(op_name: str, q, k, positions, *, rope: dict, fusion: dict, validate: bool) -> RopePlan:
    """The plan of a fused call: the rotation's checks (:func:`cupyrope.core.plan.plan_rope`), then the
    fused part's, then the memory each written array may not share."""
    if fusion.get("out_dtype") is not None and rope.get("inplace"):
        raise ValueError(f"{op_name}: an fp8 out_dtype needs new outputs: pass inplace=False")
    plan = plan_rope(q, k, positions, op_name=op_name, **rope)
    fused = plan_fusion(op_name, plan.q, plan.k, **fusion)
    for name, info in fused.operands():
        if info.on_gpu and info.ptr % ITEMSIZE[info.dtype]:
            raise ValueError(f"{op_name}: {name}'s data pointer {info.ptr:#x} is not a multiple of "
                             f"its element size ({ITEMSIZE[info.dtype]} bytes); pass an array "
                             "that starts on an element boundary")
    operands = operands_of(plan)
    if plan.inplace:
        for written, info in operands[:2]:
            for other, other_info in fused.operands():
                if written in ("q", "k") and shares_memory(info, other_info):
                    raise ValueError(f"{op_name}: inplace=True but {written} shares memory with "
                                     f"{other}; pass arrays that do not overlap")
    check_written_alone(fused, operands)
    plan.fusion = fused
    if validate:
        check_values(plan)
        check_slot_values(fused)
    return plan
