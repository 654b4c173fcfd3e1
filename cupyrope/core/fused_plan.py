"""Checks of what the fused ops add to a rotation: RMSNorm weights, fp8 outputs and their scales
(one per tensor, or one per (token, head) row computed by the call), and the KV-cache write (v,
the paged caches in the input dtype, fp8 or NVFP4, the slot mapping), the cache write without a
rotation (``write_cache``) and the ``out=`` arrays of the fused ops. :func:`plan_fusion` turns
those arguments into a :class:`FusionPlan` or raises, before anything is allocated, launched or
written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .abi import AngleSource, StoreFormat
from .arrays import ArrayInfo, describe, in_place_refusal, to_host
from .dtypes import FP8_DTYPES, ITEMSIZE, POSITION_DTYPES, dtype_name_of, refused_dtype_error
from .overlap import shares_memory
from .plan import RopePlan, check_values, operands_of, plan_rope
from .plan import _check_written_layout as check_written_layout
from .validators import check_real

# Largest finite value of each fp8 format: stores saturate there.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
STORE_FORMATS = {"float8_e4m3fn": StoreFormat.E4M3, "float8_e5m2": StoreFormat.E5M2,
                 "nvfp4": StoreFormat.NVFP4}
# Scales computed per (token, head) row by the call: ``q_scale="per_head"`` (new arrays, returned
# after the results) or a float32 array to fill.
PER_HEAD = "per_head"
# NVFP4 caches (TensorRT-LLM's and FlashInfer's layout): e2m1 values two per byte (uint8
# [..., head_dim // 2]), one e4m3 block scale per NVFP4_BLOCK values ([..., head_dim // 16]).
NVFP4 = "nvfp4"
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
CACHE_FORMATS = FP8_DTYPES + (NVFP4,)
BLOCK_SCALE_DTYPES = ("uint8", "float8_e4m3fn")
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("NHD", "HND")


@dataclass
class Scale:
    """An fp8 scale: a Python number, or a one-element float32 array (read by the kernel on the
    GPU, so that a CUDA graph sees updated values)."""

    value: float = 1.0
    array: ArrayInfo | None = None
    # Per-row scales instead: the float32 array the call writes one scale per (token, head) row
    # into (amax / the fp8 format's largest value); ``value`` and ``array`` are then unused.
    rows: ArrayInfo | None = None


@dataclass
class FusionPlan:
    """What a fused call does besides rotating q and k. Strides are in elements."""

    op_name: str
    norm: bool = False
    # False: no rotation at all (``write_cache``): k and v go to the caches as they are (the plan's
    # rotary_dim is 0, no angle is read) and nothing is written to q_out / k_out.
    rotate: bool = True
    q_weight: ArrayInfo | None = None
    k_weight: ArrayInfo | None = None
    eps: float = 0.0
    weight_offset: float = 0.0
    # RMSNorm over all heads of a token together (q's, and k's apart; OLMo 2), with weights of
    # num_heads * head_dim elements; else over each head (Qwen3, Gemma 3).
    all_heads: bool = False
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
    k_cache_scales: ArrayInfo | None = None  # NVFP4 caches: their e4m3 block scales
    v_cache_scales: ArrayInfo | None = None

    @property
    def writes_cache(self) -> bool:
        return self.k_cache is not None

    @property
    def row_scaled(self) -> bool:
        """Whether some store is quantised per row (per-(token, head) fp8 scales or an NVFP4
        cache): such launches gather each row before storing it (kernels_cu/quantize.cuh)."""
        return self.cache_dtype == NVFP4 or any(
            s is not None and s.rows is not None for s in (self.q_scale, self.k_scale, self.v_scale))

    def written_scales(self) -> list[tuple[str, ArrayInfo]]:
        """The scale arrays the call writes: per-row scales and NVFP4 block scales."""
        named = [(name, s.rows) for name, s in (("q_scale", self.q_scale), ("k_scale", self.k_scale),
                                                ("v_scale", self.v_scale))
                 if s is not None and s.rows is not None]
        named += [(name, info) for name, info in (("k_cache_scales", self.k_cache_scales),
                                                  ("v_cache_scales", self.v_cache_scales))
                  if info is not None]
        return named

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
                   if s is not None),
                 *self.written_scales())
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


def cache_format_name(value, op_name: str) -> str | None:
    """The cache format named by ``cache_dtype``: an fp8 dtype (a string or a dtype object) or
    ``"nvfp4"``; None for None."""
    if value is None:
        return None
    text = dtype_name_of(value)
    if text not in CACHE_FORMATS:
        raise refused_dtype_error(value)(
            f"{op_name}: cache_dtype must be None or one of {CACHE_FORMATS}, got {value!r}")
    return text


def is_per_row(value) -> bool:
    """Whether an fp8 scale argument asks for scales per (token, head) row: ``"per_head"``, or an
    array of two or more dims (a per-tensor scale is a number or a 0-d / one-element array)."""
    if isinstance(value, str):
        return value == PER_HEAD
    if isinstance(value, (int, float, np.integer, np.floating)):
        return False
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) >= 2


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


def _row_scales(value, name: str, op_name: str, q: ArrayInfo, shape: tuple[int, ...], what: str,
                *, contiguous: bool) -> Scale:
    """A float32 array the call writes one scale per row into: an output's (``contiguous``: C
    order, as the kernel indexes them by token and head) or a cache's (any strides)."""
    if isinstance(value, str):
        if not contiguous:  # a cache's rows
            raise ValueError(f"{op_name}: {name}='per_head' for {what}: their scales must stay "
                             f"beside the cache; pass the float32 array of shape {shape} that "
                             "keeps them")
        raise ValueError(f"{op_name}: {name}='per_head' makes new scale arrays only in apply_rope "
                         "and rms_norm_rope, for CuPy, torch, JAX and NumPy arrays with a token "
                         f"dim; pass a float32 array of shape {shape} ({what}) to fill")
    info = describe(value, name)
    if info.shape != tuple(shape):
        raise ValueError(f"{op_name}: {name} holds the scales of {what}, one per row: it must have "
                         f"shape {tuple(shape)}, got {info.shape}")
    if info.dtype != "float32":
        raise TypeError(f"{op_name}: {name} (per-row scales) must be float32, got {info.dtype}")
    if info.kind != q.kind or info.device != q.device:
        raise TypeError(f"{op_name}: {name} must be the array type and device of q ({q.kind}, "
                        f"{q.where()}), got ({info.kind}, {info.where()})")
    if not info.writable:
        raise ValueError(f"{op_name}: {name} is read-only (the call writes its per-row scales)")
    if contiguous and not _c_order(info):
        raise ValueError(f"{op_name}: {name} (per-row scales) must be C-contiguous, got strides "
                         f"{info.strides}")
    return Scale(rows=info)


def _c_order(info: ArrayInfo) -> bool:
    step = 1
    for size, stride in zip(reversed(info.shape), reversed(info.strides)):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def _block_scales(value, name: str, plan: "FusionPlan", q: ArrayInfo, heads: int,
                  head_dim: int) -> ArrayInfo:
    """The e4m3 block scales beside an NVFP4 cache: the cache's blocks, slots and heads, then
    head_dim // 16 bytes (uint8 or float8_e4m3fn)."""
    op_name = plan.op_name
    if value is None:
        raise TypeError(f"{op_name}: an NVFP4 cache needs its block scales: pass k_cache_scales "
                        "and v_cache_scales")
    info = describe(value, name)
    blocks = head_dim // NVFP4_BLOCK
    shape = ((plan.num_blocks, plan.block_size, heads, blocks) if plan.layout == "NHD"
             else (plan.num_blocks, heads, plan.block_size, blocks))
    if info.shape != shape:
        raise ValueError(f"{op_name}: {name} must have shape {shape} (the cache's blocks, slots "
                         f"and heads, then head_dim // {NVFP4_BLOCK} e4m3 scales), got {info.shape}")
    if info.dtype not in BLOCK_SCALE_DTYPES:
        raise TypeError(f"{op_name}: {name} holds e4m3 block scales: uint8 or float8_e4m3fn, got "
                        f"{info.dtype}")
    if info.kind != q.kind or info.device != q.device:
        raise TypeError(f"{op_name}: {name} must be the array type and device of q ({q.kind}, "
                        f"{q.where()}), got ({info.kind}, {info.where()})")
    if info.strides[-1] != 1:
        raise ValueError(f"{op_name}: {name}'s last dim must have stride 1, got strides "
                         f"{info.strides}")
    if not info.writable:
        raise ValueError(f"{op_name}: {name} is read-only")
    return info


def _scales_per_row(op_name: str, scales: dict) -> set[str]:
    """The names of the fp8 scales given per row; other strings than ``"per_head"`` refused."""
    for name, value in scales.items():
        if isinstance(value, str) and value != PER_HEAD:
            raise ValueError(f"{op_name}: {name} must be a number, a 0-d / one-element float32 "
                             f"array, '{PER_HEAD}' or a float32 array of per-row scales, got "
                             f"{value!r}")
    return {name for name, value in scales.items() if value is not None and is_per_row(value)}


def _plan_row_scales(plan: "FusionPlan", q: ArrayInfo, k: ArrayInfo | None, per_row: set[str],
                     scales: dict, k_cache_scales, v_cache_scales) -> None:
    """NVFP4 block scales, and the per-row scales: every fp8 store of a call is scaled per tensor,
    or every one per row (mixing is refused)."""
    op_name = plan.op_name
    if plan.cache_dtype == NVFP4:
        if per_row & {"k_scale", "v_scale"}:
            raise ValueError(f"{op_name}: an NVFP4 cache takes one global scale per tensor in "
                             "k_scale and v_scale (a number or a one-element float32 array); its "
                             "block scales go in k_cache_scales and v_cache_scales")
        heads, head_dim = plan.v.shape[1], plan.v.shape[2]
        plan.k_cache_scales = _block_scales(k_cache_scales, "k_cache_scales", plan, q, heads,
                                            head_dim)
        plan.v_cache_scales = _block_scales(v_cache_scales, "v_cache_scales", plan, q, heads,
                                            head_dim)
    elif k_cache_scales is not None or v_cache_scales is not None:
        raise ValueError(f"{op_name}: k_cache_scales and v_cache_scales hold the block scales of "
                         "an NVFP4 cache (cache_dtype='nvfp4')")
    if not per_row:
        return
    fp8_cache = plan.cache_dtype in FP8_DTYPES
    if plan.out_dtype is not None and fp8_cache:
        raise ValueError(f"{op_name}: per-row scales for fp8 outputs and an fp8 cache in one call "
                         "are not supported (k_scale would name both k_out's scales and the "
                         "cache's): write the cache with per-row scales here and quantise q with "
                         "apply_rope(out_dtype=...), or scale per tensor")
    needed = []  # (scale, expected shape, the rows it scales, C order)
    if plan.out_dtype is not None:
        needed.append(("q_scale", q.shape[:-1], "q_out's rows", True))
        if k is not None:
            needed.append(("k_scale", k.shape[:-1], "k_out's rows", True))
    if fp8_cache:
        heads = plan.v.shape[1]
        shape = ((plan.num_blocks, plan.block_size, heads) if plan.layout == "NHD"
                 else (plan.num_blocks, heads, plan.block_size))
        needed += [("k_scale", shape, "the k cache's rows", False),
                   ("v_scale", shape, "the v cache's rows", False)]
    for name, shape, what, contiguous in needed:
        if name not in per_row:
            kind = "one per tensor" if scales[name] is not None else "not given"
            made = f"'{PER_HEAD}' or " if contiguous and op_name != "rope_and_cache" else ""
            raise ValueError(f"{op_name}: {' and '.join(sorted(per_row))} per (token, head) row "
                             f"but {name} {kind}: scale every fp8 store of a call per tensor, or "
                             f"every one per row ({name}: {made}a float32 array of shape "
                             f"{tuple(shape)})")
        if len(shape) < 2:
            raise ValueError(f"{op_name}: per-row scales need q and k with a token dim "
                             f"([..., heads, head_dim]), got q of shape {q.shape}")
        setattr(plan, name, _row_scales(scales[name], name, op_name, q, tuple(shape), what,
                                        contiguous=contiguous))
    unused = sorted(per_row - {name for name, *_ in needed})
    if unused:
        raise ValueError(f"{op_name}: {unused[0]} is per row but this call stores nothing it "
                         "scales (no k, or no fp8 store)")


# What the norm of the fused ops normalises over (``norm_over``): each head, or all heads of a
# token together (q's, and k's apart).
NORM_OVER = ("head", "all_heads")


def check_norm_over(value, op_name: str) -> str:
    """``value`` when it is one of :data:`NORM_OVER`, else ValueError naming them."""
    if not isinstance(value, str) or value not in NORM_OVER:
        raise ValueError(f"{op_name}: norm_over must be one of {NORM_OVER}, got {value!r}")
    return value


def _weight(value, name: str, op_name: str, q: ArrayInfo, head_dim: int,
            num_heads: int | None = None) -> ArrayInfo:
    """A norm weight: ``(head_dim,)``, or with ``num_heads`` (the norm over all heads) ``(num_heads
    * head_dim,)`` or ``(num_heads, head_dim)`` laid out as one run of equal steps."""
    info = describe(value, name)
    if num_heads is None:
        if info.shape != (head_dim,):
            raise ValueError(f"{op_name}: {name} must have shape ({head_dim},) (head_dim), got "
                             f"{info.shape}")
    else:
        size = num_heads * head_dim
        if info.shape not in ((size,), (num_heads, head_dim)):
            raise ValueError(f"{op_name}: with norm_over='all_heads' {name} must have shape "
                             f"({size},) or ({num_heads}, {head_dim}) (num_heads * head_dim), "
                             f"got {info.shape}")
        if info.ndim == 2 and num_heads > 1 and info.strides[0] != head_dim * info.strides[1]:
            raise ValueError(f"{op_name}: {name} of shape {info.shape} must be one run of equal "
                             f"steps (strides ({head_dim * info.strides[1]}, "
                             f"{info.strides[1]})), got strides {info.strides}: pass "
                             f"{name}.reshape(-1) of a contiguous copy")
    if info.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op_name}: {name} must be one of {WEIGHT_DTYPES}, got {info.dtype}")
    if info.device != q.device:
        raise ValueError(f"{op_name}: {name} is on {info.where()} but q is on {q.where()}")
    return info


def plan_fusion(op_name: str, q: ArrayInfo, k: ArrayInfo | None, *, q_weight=None, k_weight=None,
                eps=None, weight_offset=0.0, norm=False, out_dtype=None, q_scale=None,
                k_scale=None, v=None, k_cache=None, v_cache=None, slot_mapping=None,
                layout="NHD", v_scale=None, cache_dtype=None, k_cache_scales=None,
                v_cache_scales=None, rotate=True, norm_over="head") -> FusionPlan:
    """Check the fused part of a call (see :func:`cupyrope.rms_norm_rope`,
    :func:`cupyrope.rope_and_cache` and :func:`cupyrope.write_cache` for the arguments)."""
    if q.dtype not in WEIGHT_DTYPES:
        what = "k" if not rotate else "q"
        raise TypeError(f"{op_name}: {what} must be float16, bfloat16 or float32 for the fused ops, "
                        f"got {q.dtype}" + (" (apply_rope rotates float64)" if rotate else ""))
    head_dim = q.shape[-1]
    plan = FusionPlan(op_name=op_name, rotate=rotate is not False)
    if not plan.rotate and (norm or out_dtype is not None or k_cache is None):
        raise ValueError(f"{op_name}: a call without rotation only writes k and v into a KV cache "
                         "(no norm, no fp8 outputs)")
    if check_norm_over(norm_over, op_name) != "head" and not norm:
        raise ValueError(f"{op_name}: norm_over={norm_over!r} is only used with the norm (pass "
                         "q_weight and k_weight)")
    if norm:
        plan.norm = True
        plan.all_heads = norm_over == "all_heads"
        if eps is None:
            raise TypeError(f"{op_name}: eps is required (e.g. eps=1e-6, the model's rms_norm_eps)")
        plan.eps = check_real(eps, "eps", op_name)
        if not (math.isfinite(plan.eps) and plan.eps >= 0):
            raise ValueError(f"{op_name}: eps must be finite and >= 0, got {eps!r}")
        plan.weight_offset = check_real(weight_offset, "weight_offset", op_name)
        if q_weight is None:
            raise TypeError(f"{op_name}: q_weight is required")
        plan.q_weight = _weight(q_weight, "q_weight", op_name, q, head_dim,
                                q.shape[-2] if plan.all_heads else None)
        if k is not None:
            if k_weight is None:
                raise TypeError(f"{op_name}: k_weight is required when k is given")
            plan.k_weight = _weight(k_weight, "k_weight", op_name, q, head_dim,
                                    k.shape[-2] if plan.all_heads else None)
            if plan.k_weight.dtype != plan.q_weight.dtype:
                raise TypeError(f"{op_name}: q_weight and k_weight must have one dtype, got "
                                f"{plan.q_weight.dtype} and {plan.k_weight.dtype}")
        elif k_weight is not None:
            raise ValueError(f"{op_name}: k_weight given without k")

    plan.out_dtype = fp8_name(out_dtype, "out_dtype", op_name)
    if plan.out_dtype is None and q_scale is not None:
        raise ValueError(f"{op_name}: q_scale is only used with an fp8 out_dtype")
    scales = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    per_row = _scales_per_row(op_name, scales)  # checked once the stores are known
    plan.q_scale = Scale() if "q_scale" in per_row else _scale(q_scale, "q_scale", op_name, q)
    plan.k_scale = Scale() if "k_scale" in per_row else _scale(k_scale, "k_scale", op_name, q)

    if k_cache is None and v_cache is None and v is None and slot_mapping is None:
        if v_scale is not None or cache_dtype is not None:
            raise ValueError(f"{op_name}: v_scale / cache_dtype are only used with a KV cache")
        if plan.out_dtype is None and k_scale is not None:
            raise ValueError(f"{op_name}: k_scale is only used with an fp8 out_dtype or cache")
        _plan_row_scales(plan, q, k, per_row, scales, k_cache_scales, v_cache_scales)
        return plan
    _plan_cache_write(plan, q, k, v, k_cache, v_cache, slot_mapping, layout,
                      None if "v_scale" in per_row else v_scale, cache_dtype,
                      v_scale_given=v_scale is not None)
    if plan.out_dtype is None and plan.cache_dtype is None and k_scale is not None:
        raise ValueError(f"{op_name}: k_scale is only used with an fp8 out_dtype or an fp8 cache")
    _plan_row_scales(plan, q, k, per_row, scales, k_cache_scales, v_cache_scales)
    return plan


def _plan_cache_write(plan, q, k, v, k_cache, v_cache, slot_mapping, layout, v_scale,
                      cache_dtype, *, v_scale_given: bool = False) -> None:
    op_name = plan.op_name
    src = "q" if plan.rotate else "k"  # write_cache's q is a zero-head view of k: name k
    # An NVFP4 cache holds two e2m1 values a byte: head_dim // 2 bytes a row.
    nvfp4 = isinstance(cache_dtype, str) and cache_dtype == NVFP4
    if any(x is None for x in (k, v, k_cache, v_cache, slot_mapping)):
        raise TypeError(f"{op_name}: k, v, k_cache, v_cache and slot_mapping are all required")
    if len(q.shape) != 3:
        raise ValueError(f"{op_name}: q must be [num_tokens, num_heads, head_dim] (one token dim, "
                         f"as vLLM and SGLang lay out a batch), got shape {q.shape}")
    plan.v = describe(v, "v")
    if plan.v.kind != q.kind or plan.v.device != q.device or plan.v.dtype != q.dtype:
        raise TypeError(f"{op_name}: v must be the array type, device and dtype of {src} "
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
    if nvfp4 and head_dim % NVFP4_BLOCK:
        raise ValueError(f"{op_name}: an NVFP4 cache needs head_dim a multiple of {NVFP4_BLOCK} "
                         f"(one e4m3 scale per {NVFP4_BLOCK} values), got {head_dim}")
    width = head_dim // 2 if nvfp4 else head_dim  # elements of a cache row
    caches = []
    for name, value in (("k_cache", k_cache), ("v_cache", v_cache)):
        info = describe(value, name)
        if info.kind != q.kind or info.device != q.device:
            raise TypeError(f"{op_name}: {name} must be the array type and device of {src} "
                            f"({q.kind}, {q.where()}), got ({info.kind}, {info.where()})")
        if info.ndim != 4:
            raise ValueError(f"{op_name}: {name} must be 4-d ({_layout_text(layout)}), got shape "
                             f"{info.shape}")
        blocks, size, heads = ((info.shape[0], info.shape[1], info.shape[2]) if layout == "NHD"
                               else (info.shape[0], info.shape[2], info.shape[1]))
        if heads != num_heads or info.shape[3] != width:
            other = LAYOUTS[1 - LAYOUTS.index(layout)]
            other_heads = info.shape[1] if other == "HND" else info.shape[2]
            fits_other = other_heads == num_heads and info.shape[3] == width
            held = (f"{head_dim} NVFP4 values ({width} bytes)" if nvfp4 else f"{head_dim}")
            raise ValueError(f"{op_name}: {name} of shape {info.shape} does not hold {num_heads} "
                             f"heads of {held} in layout {_layout_text(layout)}"
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
    named = cache_format_name(cache_dtype, op_name)
    if named == NVFP4:
        if kc.dtype != "uint8":
            raise TypeError(f"{op_name}: NVFP4 caches are uint8 (two e2m1 values a byte), got "
                            f"{kc.dtype}")
        plan.cache_dtype = NVFP4
    elif kc.dtype in FP8_DTYPES:
        if named is not None and named != kc.dtype:
            raise ValueError(f"{op_name}: cache_dtype {named} but the caches are {kc.dtype}")
        plan.cache_dtype = kc.dtype
    elif kc.dtype == "uint8":  # fp8 bits (CuPy has no fp8 dtype; vLLM keeps such caches too)
        if named is None:
            raise TypeError(f"{op_name}: uint8 caches hold fp8 bits: say which format with "
                            f"cache_dtype='float8_e4m3fn' or 'float8_e5m2' (or 'nvfp4' for "
                            "NVFP4 caches)")
        plan.cache_dtype = named
    elif kc.dtype == q.dtype:
        if named is not None:
            raise ValueError(f"{op_name}: cache_dtype {named} but the caches are {kc.dtype}")
        plan.cache_dtype = None
    else:
        raise TypeError(f"{op_name}: the caches must have {src}'s dtype {q.dtype}, an fp8 dtype, "
                        f"or uint8 with cache_dtype, got {kc.dtype}")
    if plan.cache_dtype is None and (v_scale is not None or v_scale_given):
        raise ValueError(f"{op_name}: v_scale is only used with an fp8 cache")
    plan.v_scale = _scale(v_scale, "v_scale", op_name, q)

    plan.slot_mapping = check_slot_mapping(slot_mapping, num_tokens, q, op_name, src)


def check_slot_mapping(slot_mapping, num_tokens: int, q: ArrayInfo, op_name: str,
                       name_of_q: str = "q") -> ArrayInfo:
    """A cache write's ``slot_mapping``: int32 or int64, one slot per token, on the device of q
    (the array called ``name_of_q`` in messages)."""
    slots = describe(slot_mapping, "slot_mapping")
    if slots.dtype not in POSITION_DTYPES:
        raise TypeError(f"{op_name}: slot_mapping must be int32 or int64, got {slots.dtype}")
    if slots.shape != (num_tokens,):
        raise ValueError(f"{op_name}: slot_mapping must have shape ({num_tokens},) (one slot per "
                         f"token), got {slots.shape}")
    if slots.device != q.device:
        raise ValueError(f"{op_name}: slot_mapping is on {slots.where()} but {name_of_q} is on "
                         f"{q.where()}")
    return slots


def _layout_text(layout: str) -> str:
    return ("[num_blocks, block_size, num_heads, head_dim]" if layout == "NHD"
            else "[num_blocks, num_heads, block_size, head_dim]")


def check_written_alone(plan: FusionPlan, rope_operands) -> None:
    """The caches (and the scale arrays the call writes) are written by the launch: none may
    share an element with any operand."""
    operands = list(rope_operands) + plan.operands()
    for written in ("k_cache", "v_cache"):
        info = dict(operands).get(written)
        if info is None:
            continue
        for other, other_info in operands:
            if other != written and shares_memory(info, other_info):
                raise ValueError(f"{plan.op_name}: {written} shares memory with {other}: pass a "
                                 "cache that no other argument overlaps")
    for written, info in plan.written_scales():
        for other, other_info in operands:
            if other_info is not info and shares_memory(info, other_info):
                raise ValueError(f"{plan.op_name}: {written} shares memory with {other}: pass "
                                 "scale arrays that no other argument overlaps")


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
    if fusion.get("rotate", True) is False:
        plan = _plan_unrotated(op_name, q, k, rope)
    else:
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
        if fused.rotate:
            check_values(plan)
        check_slot_values(fused)
    return plan


def _plan_unrotated(op_name: str, q, k, rope: dict) -> RopePlan:
    """The plan of a call that rotates nothing (``write_cache``: q a zero-head view of k): k and q
    checked as a rotation's operands, then rotary_dim 0 and no angle source, so that the fused
    kernel reads no angle and passes every dim through (a table-less TOKEN_TABLES launch: no
    frequency table to upload, so a CUDA graph can capture it without a warmup)."""
    if any(rope.get(name) is not None for name in ("cos_sin_cache", "cos", "sin", "rotary_dim",
                                                    "scaling", "seq_len")):
        raise ValueError(f"{op_name}: a call without rotation takes no angle source or rotary_dim")
    head_dim = describe(k, "k").shape[-1] if k is not None else 0
    if head_dim < 2:
        raise ValueError(f"{op_name}: k must be [num_tokens, num_heads, head_dim] with head_dim "
                         f">= 2, got shape {describe(k, 'k').shape if k is not None else None}")
    plan = plan_rope(q, k, None, op_name=op_name, rotary_dim=2, inplace=False,
                     interleaved=False, inverse=False)  # the operands' checks only
    plan.rotary_dim = 0
    plan.source = AngleSource.TOKEN_TABLES
    plan.positions, plan.positions_strides, plan.inv_freq = None, (), None
    return plan


def plan_fused_outputs(plan: RopePlan, out) -> list[ArrayInfo]:
    """The ``q_out`` / ``k_out`` arrays a fused call writes into (``out=``): each of its input's
    array type, shape and device, of the output dtype (fp8 when asked), writable, with no two
    indices on one element, a unit last stride (the fused kernels address whole, dense heads),
    sharing no element with an operand or with each other."""
    f = plan.fusion
    op_name = plan.op_name
    names = ("q_out", "k_out")[:1 if plan.k is None else 2]
    expected = "q_out" if plan.k is None else "(q_out, k_out)"
    if plan.k is None and not isinstance(out, (tuple, list)):
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise TypeError(f"{op_name}: out must be {expected} for a call "
                        f"{'without' if plan.k is None else 'with'} k, got {got}")
    if plan.inplace:
        raise ValueError(f"{op_name}: pass inplace=True (write into q and k) or out= (write into "
                         "other arrays), not both")
    dtype = f.out_dtype or plan.q.dtype
    infos = []
    for name, x, like in zip(names, out, (plan.q, plan.k)):
        info = describe(x, name)
        if info.kind != like.kind or info.device != like.device:
            raise TypeError(f"{op_name}: {name} must be a {like.kind} array on {like.where()} like "
                            f"{name[0]}, got a {info.kind} array on {info.where()}")
        if info.kind == "jax" or not info.writable:
            raise TypeError(f"{op_name}: out= writes into its arrays and {name} is "
                            f"{'an immutable JAX array' if info.kind == 'jax' else 'read-only'}; "
                            "use the returned arrays instead")
        if info.shape != like.shape or info.dtype != _stored_dtype(dtype, info):
            raise ValueError(f"{op_name}: {name} must have shape {like.shape} and dtype {dtype}, "
                             f"got shape {info.shape} and dtype {info.dtype}")
        refusal = in_place_refusal(info)
        if refusal is not None:
            raise RuntimeError(f"{op_name}: {name} {refusal}")
        if info.size and info.strides[-1] != 1 and info.shape[-1] > 1:
            raise ValueError(f"{op_name}: {name} must have stride 1 in its last dim (head_dim) for "
                             f"the fused ops, got strides {info.strides}")
        check_written_layout(info, name, op_name, "")
        if info.on_gpu and info.ptr % ITEMSIZE[info.dtype]:
            raise ValueError(f"{op_name}: {name}'s data pointer {info.ptr:#x} is not a multiple of "
                             f"its element size ({ITEMSIZE[info.dtype]} bytes)")
        infos.append(info)
    operands = operands_of(plan) + f.operands() + list(zip(names, infos))
    for written, info in zip(names, infos):
        for other, other_info in operands:
            if other != written and shares_memory(info, other_info):
                raise ValueError(f"{op_name}: {written} shares memory with {other}; out= arrays "
                                 "must not overlap any argument (use inplace=True to write into q "
                                 "and k)")
    return infos


def _stored_dtype(dtype: str, info: ArrayInfo) -> str:
    """The dtype an output of ``dtype`` has in ``info``'s array type: CuPy, which has no fp8
    dtype, holds fp8 bits as uint8."""
    return "uint8" if dtype in FP8_DTYPES and info.dtype == "uint8" else dtype
