"""SGLang: ``apply_rope_with_cos_sin_cache_inplace`` (sgl-kernel), with the fused KV-buffer write
of its ``fused_set_kv_buffer_arg``.

SGLang's KV pool is a flat token-slot cache: ``k_buffer[cache_loc[t]] = k[t]``, one
``[num_slots, Hk, head_size]`` (or ``[num_slots, Hk * head_size]``) buffer per layer. That is
cupyrope's NHD paged cache with ``block_size`` 1, so the buffers are passed as
``[num_slots, 1, Hk, head_size]`` views (no copy) to one :func:`cupyrope.rope_and_cache` launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.dtypes import FP8_DTYPES, dtype_name_of
from ..core.validators import check_bool
from .vllm import (cache_kind, count, require_tensor, rotate_in_place, token_heads_view,
                   write_cache)

WHERE = "apply_rope_with_cos_sin_cache_inplace"


@dataclass
class FusedSetKVBufferArg:
    """What SGLang's ``FusedSetKVBufferArg`` holds (sgl-kernel's field order): any object with
    these attributes is accepted, SGLang's own dataclass included.

    Attributes
    ----------
    value : tensor ``[nnz, Hk * head_size]`` or ``[nnz, Hk, head_size]``
    k_buffer, v_buffer : tensors ``[num_slots, Hk * head_size]`` or ``[num_slots, Hk, head_size]``
        Of query's dtype, an fp8 dtype, or uint8 holding fp8 bits (SGLang's ``store_dtype`` for
        fp8 pools; then ``cache_dtype`` names the format).
    k_scale, v_scale : float, one-element float32 tensor, or None (1)
        fp8 buffers store ``fp8(value / scale)``, saturated: the division SGLang's
        ``set_kv_buffer`` applies before its fp8 cast. Unused with 16-bit buffers, as there.
    cache_loc : int64 (or int32) tensor ``[nnz]``
        The slot of each token; negative slots write nothing.
    cache_dtype : "float8_e4m3fn", "float8_e5m2" or None
        Not in SGLang: the fp8 format of uint8 buffers (SGLang's pool keeps it as ``dtype``).
    """

    value: Any
    k_buffer: Any
    v_buffer: Any
    k_scale: Any
    v_scale: Any
    cache_loc: Any
    cache_dtype: str | None = None


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True, fused_set_kv_buffer_arg=None,
                                          enable_pdl=None):
    """sgl-kernel's ``apply_rope_with_cos_sin_cache_inplace``: rotate query and key in place and,
    with ``fused_set_kv_buffer_arg``, store rotated key and value in the KV buffers in the same
    launch.

    Parameters
    ----------
    positions : int32 / int64 tensor ``[nnz]``
    query : tensor ``[nnz, Hq * head_size]`` or ``[nnz, Hq, head_size]``
    key : tensor ``[nnz, Hk * head_size]`` or ``[nnz, Hk, head_size]``
    head_size : int
    cos_sin_cache : tensor ``[max_position, rotary_dim]``, ``rotary_dim <= head_size``
        cos then sin per row (SGLang requires float32; any float dtype works here).
    is_neox : bool
    fused_set_kv_buffer_arg : :class:`FusedSetKVBufferArg` or an object with its attributes
    enable_pdl : bool or None
        Accepted for SGLang's signature; Programmatic Dependent Launch is a launch attribute
        that does not change results, and cupyrope's launches do not set it.

    Returns None.
    """
    if enable_pdl is not None:
        check_bool(enable_pdl, "enable_pdl", WHERE)
    arg = fused_set_kv_buffer_arg
    if arg is None:
        rotate_in_place(WHERE, positions, query, key, head_size, cos_sin_cache, is_neox)
        return
    head_size = count(head_size, "head_size", WHERE, minimum=1)
    check_bool(is_neox, "is_neox", WHERE)
    fields = _fields(arg)
    q, k, v = (token_heads_view(x, positions, head_size, name, WHERE)
               for x, name in ((query, "query"), (key, "key"), (fields["value"], "value")))
    k_buffer, v_buffer = (_slot_view(fields[name], head_size, name)
                          for name in ("k_buffer", "v_buffer"))
    kind = cache_kind(k_buffer, v_buffer, _buffer_format(k_buffer, fields["cache_dtype"]),
                      q.dtype, WHERE, "fused_set_kv_buffer_arg")
    write_cache(WHERE, positions, q, k, v, k_buffer, v_buffer, fields["cache_loc"], kind,
                fields["k_scale"], fields["v_scale"], cos_sin_cache, is_neox)


def _fields(arg) -> dict:
    """The attributes of a FusedSetKVBufferArg-like object (k_scale, v_scale and cache_dtype may
    be missing: they default to None)."""
    required = ("value", "k_buffer", "v_buffer", "cache_loc")
    missing = [name for name in required if getattr(arg, name, None) is None]
    if missing:
        raise TypeError(f"{WHERE}: fused_set_kv_buffer_arg must have {', '.join(required)}; "
                        f"{type(arg).__name__} has no {', '.join(missing)}")
    optional = ("k_scale", "v_scale", "cache_dtype")
    return {name: getattr(arg, name, None) for name in required + optional}


def _slot_view(buffer, head_size: int, name: str):
    """A token-slot buffer ``[S, H * head_size]`` / ``[S, H, head_size]`` as the NHD paged cache
    ``[S, 1, H, head_size]`` (block_size 1): views, since only the last dim is split."""
    if require_tensor(buffer, f"fused_set_kv_buffer_arg.{name}", WHERE).dim() == 2:
        if buffer.shape[1] % head_size:
            raise ValueError(f"{WHERE}: fused_set_kv_buffer_arg.{name}'s last dim "
                             f"{buffer.shape[1]} is not a multiple of head_size={head_size}")
        buffer = buffer.view(buffer.shape[0], buffer.shape[1] // head_size, head_size)
    elif buffer.dim() != 3 or buffer.shape[2] != head_size:
        raise ValueError(f"{WHERE}: fused_set_kv_buffer_arg.{name} must be [num_slots, heads * "
                         f"head_size] or [num_slots, heads, head_size={head_size}], got shape "
                         f"{tuple(buffer.shape)}")
    return buffer.unsqueeze(1)


def _buffer_format(k_buffer, cache_dtype) -> str | None:
    """The format the buffers must hold: the fp8 format of fp8 or uint8 buffers (uint8 needs
    ``cache_dtype``), None (query's dtype) otherwise."""
    stored = dtype_name_of(k_buffer.dtype)
    named = None if cache_dtype is None else dtype_name_of(cache_dtype)
    if named is not None and named not in FP8_DTYPES:
        raise ValueError(f"{WHERE}: fused_set_kv_buffer_arg.cache_dtype must be None or one of "
                         f"{FP8_DTYPES}, got {cache_dtype!r}")
    if stored == "uint8":
        if named is None:
            raise TypeError(f"{WHERE}: uint8 KV buffers hold fp8 bits: name the format with "
                            "fused_set_kv_buffer_arg.cache_dtype='float8_e4m3fn' or 'float8_e5m2'")
        return named
    if stored in FP8_DTYPES:
        if named is not None and named != stored:
            raise ValueError(f"{WHERE}: fused_set_kv_buffer_arg.cache_dtype is {named} but the "
                             f"buffers are {stored}")
        return stored
    if named is not None:
        raise ValueError(f"{WHERE}: fused_set_kv_buffer_arg.cache_dtype {named} names an fp8 "
                         f"format but the buffers are {stored}")
    return None
