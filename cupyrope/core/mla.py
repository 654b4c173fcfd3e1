"""DeepSeek MLA (Multi-head Latent Attention: DeepSeek-V2 / V3 / R1, Kimi K2): the checks and the
NumPy path of the MLA ops (:func:`cupyrope.mla_rope_quantize`, :func:`cupyrope.mla_rope_and_cache`).

An MLA q head is ``[nope | rope]``: its LAST ``rope_dim`` dims are rotated, the ``nope`` dims
pass through; one rotary k head ``k_pe`` is shared by every q head. Each head may be one array
``[T, H, nope + rope]`` or two (FlashInfer's ``q_nope [T, H, nope]`` and ``q_pe [T, H, rope]``).
The whole head (nope dims and rotated rope dims) is stored once, in the input dtype or as fp8
``value / scale``. The latent cache is vLLM's ``concat_and_cache_mla`` layout: one row per slot,
``[kv_c (kv_lora_rank) | k_pe rotated (rope_dim)]``, in ``[num_blocks, block_size, kv_lora_rank +
rope_dim]``; or FlashInfer's two caches, ``kv_cache [num_blocks, block_size, kv_lora_rank]`` and
``kpe_cache [num_blocks, block_size, rope_dim]``.

The rotation's arguments (angle source, schedule, pairing, positions) are checked by
:func:`cupyrope.core.plan.plan_rope` on the rope parts, so the MLA ops take every angle source
the fused ops take; everything else is checked here, before anything is allocated or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import ArrayInfo, describe, host_view
from .dtypes import FP8_DTYPES
from .fused_plan import (FusionPlan, Scale, _scale, check_slot_mapping, check_slot_values,
                         fp8_name)
from .numpy_path import _put, cos_sin_per_token, store_as
from .overlap import shares_memory
from .plan import RopePlan, check_values, plan_rope

# The dtypes of MLA activations (q, k_pe, kv_c): the serving dtypes and float32.
MLA_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class MlaPlan:
    """What an MLA call reads and writes. ``rope`` holds the rope parts (q_pe as its q, k_pe as
    its k, as ``[T, heads, rope_dim]``) and the angles; the nope parts are ``[T, heads, nope]``
    (None: no nope dims)."""

    op_name: str
    rope: RopePlan
    q_nope: ArrayInfo | None
    k_nope: ArrayInfo | None
    out_dtype: str | None  # fp8 format of the q / k outputs; None: the input dtype
    q_scale: Scale
    k_scale: Scale
    rotate: bool = True  # False: the cache write alone, unrotated (vLLM's concat_and_cache_mla)
    kv_c: ArrayInfo | None = None  # [T, kv_lora_rank]
    kv_cache: ArrayInfo | None = None  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    # [num_blocks, block_size, rope_dim] (kv_cache then holds kv_lora_rank); None: joint rows
    kpe_cache: ArrayInfo | None = None
    slot_mapping: ArrayInfo | None = None
    cache_dtype: str | None = None  # fp8 format of the cache; None: the input dtype
    kv_scale: Scale | None = None
    num_blocks: int = 0
    block_size: int = 0

    @property
    def writes_cache(self) -> bool:
        return self.kv_cache is not None


def _tokens_heads_dims(info: ArrayInfo, name: str, what: str, op_name: str) -> None:
    if info.ndim != 3:
        raise ValueError(f"{op_name}: {name} must be {what}, got shape {info.shape}")


def check_activation(info: ArrayInfo, name: str, like: ArrayInfo, op_name: str) -> None:
    """``info`` is an activation of ``like``'s array type, device and dtype, with a unit last
    stride (rows are read with 16-byte accesses on the GPU)."""
    if info.kind != like.kind or info.device != like.device:
        raise TypeError(f"{op_name}: {name} must be the array type and device of q ({like.kind}, "
                        f"{like.where()}), got ({info.kind}, {info.where()})")
    if info.dtype != like.dtype:
        raise TypeError(f"{op_name}: {name} must have q's dtype {like.dtype}, got {info.dtype}")
    if info.ndim and info.shape[-1] > 1 and info.strides[-1] != 1:
        raise ValueError(f"{op_name}: {name}'s last dim must have stride 1, got strides "
                         f"{info.strides}")


def plan_mla(op_name: str, q_nope, q_pe, k_nope, k_pe, positions, *, rope: dict,
             out_dtype=None, q_scale=None, k_scale=None, kv_c=None, kv_cache=None,
             slot_mapping=None, cache_dtype=None, kv_scale=None, rotate: bool = True,
             validate: bool = False, kpe_cache=None) -> MlaPlan:
    """Check every argument of an MLA call (the parts as ``[T, heads, dim]`` arrays; ``q_nope``
    and ``k_nope`` may be None) and return its plan, or raise naming the argument, what it must
    be and what it is."""
    out_dtype = fp8_name(out_dtype, "out_dtype", op_name)
    if out_dtype is not None and rope.get("inplace"):
        raise ValueError(f"{op_name}: an fp8 out_dtype needs new outputs: pass inplace=False")
    qi = describe(q_pe, "q_pe")
    _tokens_heads_dims(qi, "the rope part of q", "[num_tokens, num_heads, rope_dim]", op_name)
    if qi.dtype not in MLA_DTYPES:
        raise TypeError(f"{op_name}: q must be one of {MLA_DTYPES}, got {qi.dtype}")
    ki = describe(k_pe, "k_pe")
    _tokens_heads_dims(ki, "k_pe", "[num_tokens, rope_dim] or [num_tokens, num_kv_heads, "
                       "rope_dim]", op_name)
    check_activation(ki, "k_pe", qi, op_name)
    if ki.shape[0] != qi.shape[0] or ki.shape[2] != qi.shape[2]:
        raise ValueError(f"{op_name}: k_pe must have q's tokens ({qi.shape[0]}) and rope_dim "
                         f"({qi.shape[2]}), got shape {ki.shape}")
    check_activation(qi, "q", qi, op_name)
    plan = plan_rope(q_pe, k_pe, positions, op_name=op_name, **rope)
    if plan.rotary_dim != qi.shape[2]:
        raise ValueError(f"{op_name}: the whole rope part of a head is rotated: its rope_dim "
                         f"{qi.shape[2]} must equal the angle source's rotary dims "
                         f"{plan.rotary_dim}")
    nopes = []
    for x, name, part in ((q_nope, "q_nope", qi), (k_nope, "k_nope", ki)):
        if x is None:
            nopes.append(None)
            continue
        info = describe(x, name)
        _tokens_heads_dims(info, name, "[num_tokens, heads, nope_dim]", op_name)
        check_activation(info, name, qi, op_name)
        if info.shape[:2] != part.shape[:2]:
            raise ValueError(f"{op_name}: {name} must have the tokens and heads of its rope part "
                             f"{part.shape[:2]}, got shape {info.shape}")
        if plan.inplace:
            raise ValueError(f"{op_name}: inplace=True rotates the rope parts alone; {name} is "
                             "not written in place (pass inplace=False for new outputs)")
        nopes.append(info)
    mla = MlaPlan(op_name=op_name, rope=plan, q_nope=nopes[0], k_nope=nopes[1],
                  out_dtype=out_dtype, q_scale=_scale(q_scale, "q_scale", op_name, qi),
                  k_scale=_scale(k_scale, "k_scale", op_name, qi), rotate=rotate)
    if out_dtype is None:
        for value, name in ((q_scale, "q_scale"), (k_scale, "k_scale")):
            if value is not None:
                raise ValueError(f"{op_name}: {name} is only used with an fp8 out_dtype")
    if any(x is not None for x in (kv_cache, kv_c, slot_mapping, kpe_cache)):
        _plan_latent_cache(mla, kv_c, kv_cache, slot_mapping, cache_dtype, kv_scale, kpe_cache)
    elif cache_dtype is not None or kv_scale is not None:
        raise ValueError(f"{op_name}: cache_dtype and kv_scale describe kv_cache, which is None")
    if validate:
        check_values(plan)
        if mla.writes_cache:
            check_slot_values(FusionPlan(op_name=op_name, slot_mapping=mla.slot_mapping,
                                         num_blocks=mla.num_blocks, block_size=mla.block_size))
    return mla


def _check_cache(info: ArrayInfo, name: str, q: ArrayInfo, op_name: str) -> None:
    if info.kind != q.kind or info.device != q.device:
        raise TypeError(f"{op_name}: {name} must be the array type and device of q ({q.kind}, "
                        f"{q.where()}), got ({info.kind}, {info.where()})")


def _check_cache_rows(info: ArrayInfo, name: str, op_name: str) -> None:
    if info.strides[-1] != 1 and info.shape[-1] > 1:
        raise ValueError(f"{op_name}: {name}'s last dim must have stride 1, got strides "
                         f"{info.strides}")
    if not info.writable:
        raise ValueError(f"{op_name}: {name} is read-only")


def _plan_latent_cache(mla: MlaPlan, kv_c, kv_cache, slot_mapping, cache_dtype, kv_scale,
                       kpe_cache=None) -> None:
    op_name, q, k_pe = mla.op_name, mla.rope.q, mla.rope.k
    if any(x is None for x in (kv_c, kv_cache, slot_mapping)):
        raise TypeError(f"{op_name}: kv_c, kv_cache and slot_mapping are all required")
    num_tokens, rope_dim = k_pe.shape[0], k_pe.shape[2]
    if k_pe.shape[1] != 1:
        raise ValueError(f"{op_name}: MLA caches one rotary k head a token: k_pe must be "
                         f"[num_tokens, rope_dim] or [num_tokens, 1, rope_dim], got shape "
                         f"{k_pe.shape}")
    latent = describe(kv_c, "kv_c")
    if latent.ndim == 3 and latent.shape[1] == 1:
        latent = describe(kv_c[:, 0], "kv_c")
    if latent.ndim != 2 or latent.shape[0] != num_tokens:
        raise ValueError(f"{op_name}: kv_c must be [num_tokens={num_tokens}, kv_lora_rank] (or "
                         f"[num_tokens, 1, kv_lora_rank]), got shape "
                         f"{describe(kv_c, 'kv_c').shape}")
    check_activation(latent, "kv_c", q, op_name)
    rank = latent.shape[1]
    cache = describe(kv_cache, "kv_cache")
    _check_cache(cache, "kv_cache", q, op_name)
    pe_cache = None
    if kpe_cache is None:
        if cache.ndim != 3 or cache.shape[2] != rank + rope_dim:
            raise ValueError(f"{op_name}: kv_cache must be [num_blocks, block_size, kv_lora_rank "
                             f"+ rope_dim = {rank} + {rope_dim}], got shape {cache.shape}")
    else:  # two caches: kv_c rows in kv_cache, k_pe rows in kpe_cache
        if cache.ndim != 3 or cache.shape[2] != rank:
            raise ValueError(f"{op_name}: with a kpe_cache, kv_cache must be [num_blocks, "
                             f"block_size, kv_lora_rank = {rank}], got shape {cache.shape}")
        pe_cache = describe(kpe_cache, "kpe_cache")
        _check_cache(pe_cache, "kpe_cache", q, op_name)
        if pe_cache.shape != (*cache.shape[:2], rope_dim):
            raise ValueError(f"{op_name}: kpe_cache must be [num_blocks, block_size, rope_dim] = "
                             f"{(*cache.shape[:2], rope_dim)} (kv_cache's blocks), got shape "
                             f"{pe_cache.shape}")
        if pe_cache.dtype != cache.dtype:
            raise TypeError(f"{op_name}: kpe_cache must have kv_cache's dtype {cache.dtype}, got "
                            f"{pe_cache.dtype}")
        _check_cache_rows(pe_cache, "kpe_cache", op_name)
    _check_cache_rows(cache, "kv_cache", op_name)
    named = fp8_name(cache_dtype, "cache_dtype", op_name)
    if cache.dtype in FP8_DTYPES:
        if named is not None and named != cache.dtype:
            raise ValueError(f"{op_name}: cache_dtype {named} but kv_cache is {cache.dtype}")
        mla.cache_dtype = cache.dtype
    elif cache.dtype == "uint8":  # fp8 bits (CuPy has no fp8 dtype; vLLM keeps such caches)
        if named is None:
            raise TypeError(f"{op_name}: a uint8 kv_cache holds fp8 bits: say which format with "
                            "cache_dtype='float8_e4m3fn' or 'float8_e5m2'")
        mla.cache_dtype = named
    elif cache.dtype == q.dtype:
        if named is not None:
            raise ValueError(f"{op_name}: cache_dtype {named} but kv_cache is {cache.dtype}")
    else:
        raise TypeError(f"{op_name}: kv_cache must have q's dtype {q.dtype}, an fp8 dtype, or "
                        f"uint8 with cache_dtype, got {cache.dtype}")
    if mla.cache_dtype is None and kv_scale is not None:
        raise ValueError(f"{op_name}: kv_scale is only used with an fp8 kv_cache")
    mla.kv_scale = _scale(kv_scale, "kv_scale", op_name, q)
    slots = check_slot_mapping(slot_mapping, num_tokens, q, op_name)
    operands = [("q", q), ("k_pe", k_pe), ("kv_c", latent), ("slot_mapping", slots)]
    for cache_name, written in (("kv_cache", cache), ("kpe_cache", pe_cache)):
        for name, info in operands if written is not None else ():
            if shares_memory(written, info):
                raise ValueError(f"{op_name}: {cache_name} shares memory with {name}; pass "
                                 "arrays that do not overlap")
        operands.append((cache_name, written))
    mla.kv_c, mla.kv_cache, mla.slot_mapping, mla.kpe_cache = latent, cache, slots, pe_cache
    mla.num_blocks, mla.block_size = cache.shape[0], cache.shape[1]


def _pairs(rope_dim: int, interleaved: bool) -> tuple[slice, slice]:
    """The first and second dims of every pair of a rope part: GPT-J ``(2j, 2j + 1)``, NeoX
    ``(j, j + rope_dim // 2)``."""
    half = rope_dim // 2
    if interleaved:
        return slice(0, rope_dim, 2), slice(1, rope_dim, 2)
    return slice(0, half), slice(half, rope_dim)


def rotated_rope_parts(mla: MlaPlan) -> list[np.ndarray]:
    """float32 q_pe and k_pe rotated as the kernels rotate them (float32 cos / sin, each pair
    ``x1 cos - x2 sin``, ``x2 cos + x1 sin``); unrotated when the call does not rotate."""
    plan = mla.rope
    parts = [np.asarray(host_view(plan.q)).astype(np.float32),
             np.asarray(host_view(plan.k)).astype(np.float32)]
    if not mla.rotate:
        return parts
    cos, sin = cos_sin_per_token(plan)
    cos, sin = cos[..., None, :].astype(np.float32), sin[..., None, :].astype(np.float32)
    first, second = _pairs(plan.rotary_dim, plan.interleaved)
    rotated = []
    for x in parts:
        y = x.copy()
        x1, x2 = x[..., first], x[..., second]
        y[..., first] = x1 * cos - x2 * sin
        y[..., second] = x2 * cos + x1 * sin
        rotated.append(y)
    return rotated


def mla_on_host(mla: MlaPlan, outputs: list) -> None:
    """An MLA call on the CPU. ``outputs``: NumPy views ``[q_nope_out, q_pe_out, k_nope_out,
    k_pe_out]`` (None where nothing is written; the inputs themselves in place), each stored once
    from float32 in the output format (fp8 ``value / scale``, saturated)."""
    q_pe, k_pe = rotated_rope_parts(mla)
    dtype = mla.out_dtype or mla.rope.q.dtype
    values = [None if mla.q_nope is None else np.asarray(host_view(mla.q_nope)), q_pe,
              None if mla.k_nope is None else np.asarray(host_view(mla.k_nope)), k_pe]
    scales = [mla.q_scale, mla.q_scale, mla.k_scale, mla.k_scale]
    for out, value, scale in zip(outputs, values, scales):
        if out is not None and value is not None:
            _put(out, Ellipsis, store_as(value.astype(np.float32), dtype, scale.value))
    if mla.writes_cache:
        write_latent_cache(mla, k_pe[:, 0])


def write_latent_cache(mla: MlaPlan, k_pe: np.ndarray) -> None:
    """``[kv_c | k_pe]`` (float32 k_pe, rotated or not) into the row of each token's slot (or
    kv_c and k_pe into the rows of their two caches), stored once in the cache's format;
    negative slots and slots past the cache write nothing."""
    slots = np.asarray(host_view(mla.slot_mapping)).astype(np.int64)
    valid = (slots >= 0) & (slots < mla.num_blocks * mla.block_size)
    blocks, rows = slots[valid] // mla.block_size, slots[valid] % mla.block_size
    latent = np.asarray(host_view(mla.kv_c))[valid].astype(np.float32)
    dtype = mla.cache_dtype or mla.rope.q.dtype
    if mla.kpe_cache is None:
        parts = [(mla.kv_cache, np.concatenate([latent, k_pe[valid]], axis=-1))]
    else:
        parts = [(mla.kv_cache, latent), (mla.kpe_cache, k_pe[valid])]
    for cache, entries in parts:
        _put(np.asarray(host_view(cache)), (blocks, rows),
             store_as(entries, dtype, mla.kv_scale.value))
