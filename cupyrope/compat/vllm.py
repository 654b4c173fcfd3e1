"""vLLM: the in-place ``rotary_embedding`` op (SGLang's and FlashInfer's too), the fused
``fused_qk_norm_rope`` op, and RoPE fused with ``reshape_and_cache_flash``.

Each function takes the arguments of the call it replaces (torch tensors, CUDA or CPU) and maps
them onto one cupyrope op through views: no copy of q, k, v or the caches. The helpers at the end
(head views, cache formats and scales, the cache write) are shared with the SGLang adapter.
"""

from __future__ import annotations

import torch

from ..api import apply_rope, rms_norm_rope, rope_and_cache
from ..core.dtypes import FP8_DTYPES, dtype_name_of
from ..cuda.recipes import call_key, recipes, replay
from ..core.validators import check_bool, check_real, is_integer

# vLLM's kv_cache_dtype strings that a CUDA build accepts for reshape_and_cache_flash, and the
# cache format each names (None: the cache holds key's own dtype, "auto"). vLLM reads "fp8" as
# e4m3 on NVIDIA GPUs.
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """vLLM's ``rotary_embedding`` op (also SGLang's and FlashInfer's ``..._inplace``): in place.

    Parameters
    ----------
    positions : int32 / int64 tensor, ``[T]`` (or ``[B, S]``)
    query : tensor ``[T, Hq * head_size]`` or ``[T, Hq, head_size]`` (``[B, S, ...]`` with
        ``[B, S]`` positions); any token stride, e.g. a slice of a fused QKV projection.
    key : tensor ``[T, Hk * head_size]`` / ``[T, Hk, head_size]``, or None
    head_size : int
    cos_sin_cache : tensor ``[max_position, rotary_dim]``, ``rotary_dim <= head_size``:
        cos in the first half of a row, sin in the second; any float dtype.
    is_neox : bool
        True: NeoX pairing (``rotate_half``); False: GPT-J (interleaved).

    Returns None; query and key hold the result (as vLLM's op).
    """
    rotate_in_place("rotary_embedding", positions, query, key, head_size, cos_sin_cache, is_neox)


def fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight,
                       k_weight, cos_sin_cache, is_neox, position_ids):
    """vLLM's ``fused_qk_norm_rope`` (``torch.ops._C.fused_qk_norm_rope``, Qwen3-style QK-norm
    models): RMSNorm of every q and k head, then RoPE, in place on the fused QKV projection, in
    one launch of :func:`cupyrope.rms_norm_rope`.

    Parameters
    ----------
    qkv : tensor ``[T, (num_heads_q + num_heads_k + num_heads_v) * head_dim]``
        float16 or bfloat16 (vLLM's dtypes; float32 works too): per token the q heads, then the k
        heads, then the v heads. Any row stride (a slice of a wider buffer works); the last dim
        must have stride 1. The v heads are never read or written.
    num_heads_q, num_heads_k, num_heads_v : int
        Heads of each part on this rank (GQA: ``num_heads_k < num_heads_q``).
    head_dim : int
        Any even size (vLLM's kernel is compiled for 64, 128 and 256 only).
    eps : float
        The norm's epsilon (``rms_norm_eps``).
    q_weight, k_weight : tensors ``[head_dim]``
        The q_norm / k_norm weights. vLLM requires qkv's dtype; float32 is accepted too.
    cos_sin_cache : tensor ``[max_position, rotary_dim]``
        vLLM's layout (cos then sin per row). ``rotary_dim < head_dim`` rotates the first
        ``rotary_dim`` dims of each head (partial rotary); every dim is normalised.
    is_neox : bool
        True: NeoX pairing; False: GPT-J (interleaved).
    position_ids : int64 (or int32) tensor ``[T]``

    Returns None (as vLLM's op): the q and k heads of ``qkv`` hold
    ``rope(x * rsqrt(mean(x**2) + eps) * weight)``, computed in float32 and rounded once.
    """
    op_name = "fused_qk_norm_rope"
    heads = {name: count(value, name, op_name, minimum=1 if name != "num_heads_v" else 0)
             for name, value in (("num_heads_q", num_heads_q), ("num_heads_k", num_heads_k),
                                 ("num_heads_v", num_heads_v))}
    head_dim = count(head_dim, "head_dim", op_name, minimum=1)
    check_bool(is_neox, "is_neox", op_name)
    if require_tensor(qkv, "qkv", op_name).dim() != 2:
        raise ValueError(f"{op_name}: qkv must be 2-d [num_tokens, (num_heads_q + num_heads_k + "
                         f"num_heads_v) * head_dim], got shape {tuple(qkv.shape)}")
    width = sum(heads.values()) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"{op_name}: qkv has {qkv.shape[1]} columns, expected (num_heads_q + "
                         f"num_heads_k + num_heads_v) * head_dim = {width}")
    if qkv.stride(1) != 1:
        raise ValueError(f"{op_name}: qkv's last dim must have stride 1, got strides "
                         f"{tuple(qkv.stride())}")
    num_tokens = qkv.shape[0]
    if tuple(require_tensor(position_ids, "position_ids", op_name).shape) != (num_tokens,):
        raise ValueError(f"{op_name}: position_ids must have shape ({num_tokens},) (one per row of "
                         f"qkv), got {tuple(position_ids.shape)}")
    q_end = heads["num_heads_q"] * head_dim
    k_end = q_end + heads["num_heads_k"] * head_dim
    q = qkv[:, :q_end].view(num_tokens, heads["num_heads_q"], head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, heads["num_heads_k"], head_dim)
    rms_norm_rope(q, k, q_weight, k_weight, position_ids, eps=eps, cos_sin_cache=cos_sin_cache,
                  interleaved=not is_neox, inplace=True)


def rope_and_reshape_and_cache_flash(positions, query, key, value, key_cache, value_cache,
                                     slot_mapping, kv_cache_dtype, k_scale, v_scale, head_size,
                                     cos_sin_cache, is_neox=True):
    """vLLM's ``rotary_embedding`` followed by ``reshape_and_cache_flash``, in one launch of
    :func:`cupyrope.rope_and_cache`.

    The arguments are those of the two calls it replaces, in their order: ``rotary_embedding
    (positions, query, key, ...)`` then ``reshape_and_cache_flash(key, value, key_cache,
    value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)``, then the rest of
    ``rotary_embedding``'s (``head_size, cos_sin_cache, is_neox``).

    Parameters
    ----------
    positions : int32 / int64 tensor ``[T]``
    query : tensor ``[T, Hq * head_size]`` or ``[T, Hq, head_size]``; rotated in place.
    key : tensor ``[T, Hk * head_size]`` or ``[T, Hk, head_size]``; rotated in place, then cached.
    value : tensor shaped like key; cached unchanged.
    key_cache, value_cache : tensors ``[num_blocks, block_size, Hk, head_size]``
        vLLM's flash layout by shape, with any strides (unit last stride): an HND cache is the
        ``[num_blocks, Hk, block_size, head_size]`` storage seen through ``.permute(0, 2, 1, 3)``,
        as vLLM allocates it. key's dtype, or fp8: a torch fp8 dtype or uint8 holding fp8 bits.
    slot_mapping : int64 (or int32) tensor ``[n]``, ``n <= T``
        Token ``t < n`` goes to block ``slot // block_size``, row ``slot % block_size``; negative
        slots are padding and write nothing. Tokens past ``n`` (vLLM V1 pads the batch for CUDA
        graphs, not the slots) are rotated but not cached.
    kv_cache_dtype : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
        "auto": the caches hold key's dtype and the scales are not used (as in vLLM).
    k_scale, v_scale : float, or a one-element float32 tensor on key's device
        fp8 caches store ``fp8(value / scale)``, saturated (vLLM's convention). Per-head scales
        (``[Hk]``) are not supported.
    head_size : int
    cos_sin_cache : tensor ``[max_position, rotary_dim]``, ``rotary_dim <= head_size``
    is_neox : bool

    Returns None (as both vLLM ops). Rotated k is cached from float32, rounded once: vLLM rounds
    it to key's dtype first, so fp8 entries may differ from vLLM's by one fp8 ulp.
    """
    op_name = "rope_and_reshape_and_cache_flash"
    head_size = count(head_size, "head_size", op_name, minimum=1)
    check_bool(is_neox, "is_neox", op_name)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{op_name}: kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    q, k, v = (token_heads_view(x, positions, head_size, name, op_name)
               for x, name in ((query, "query"), (key, "key"), (value, "value")))
    num_tokens = q.shape[0]
    require_tensor(slot_mapping, "slot_mapping", op_name)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > num_tokens:
        raise ValueError(f"{op_name}: slot_mapping must be 1-d with at most {num_tokens} entries "
                         f"(one per token), got shape {tuple(slot_mapping.shape)}")
    kind = cache_kind(key_cache, value_cache, fmt, q.dtype, op_name,
                       f"kv_cache_dtype={kv_cache_dtype!r}")
    if slot_mapping.shape[0] < num_tokens:  # CUDA-graph padding: no slot for the last tokens
        padded = slot_mapping.new_full((num_tokens,), -1)
        padded[:slot_mapping.shape[0]].copy_(slot_mapping)
        slot_mapping = padded
    write_cache(op_name, positions, q, k, v, key_cache, value_cache, slot_mapping, kind,
                k_scale, v_scale, cos_sin_cache, is_neox)


# ----------------------------------------------------------------------------------------------
# Shared by the vLLM and SGLang adapters


def require_tensor(x, name: str, op_name: str):
    """``x`` itself, if it is a torch tensor (the adapters read shapes and make views of it)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op_name}: {name} must be a torch tensor, got {type(x).__name__}")
    return x


def count(value, name: str, op_name: str, *, minimum: int) -> int:
    """A Python / NumPy int (not a bool) >= minimum."""
    if not is_integer(value):
        raise TypeError(f"{op_name}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{op_name}: {name} must be >= {minimum}, got {value}")
    return int(value)


def rotate_in_place(op_name: str, positions, query, key, head_size, cos_sin_cache,
                    is_neox) -> None:
    """:func:`rotary_embedding` under the name of the op it stands for (``op_name``).

    A serving step calls this with the same layout every time, so a repeat call is keyed on the
    tensors as given (flat ``[T, H * head_size]`` or not), ``head_size`` and ``is_neox`` and
    replays the launch recipe of the first such call: no head views are made and nothing is
    checked again (the full path checked exactly this metadata). Anything else takes the full
    path below."""
    found = call_key(query, key, positions, cos_sin_cache, None, None,
                     (10000.0, None, is_neox, None, False, True, None))
    if found is not None:
        adapter_key = (op_name, type(head_size), head_size, found[0])
        recipe = recipes.get(adapter_key)
        if recipe is not None and replay(recipe, query, key, found[1], True) is not None:
            return
    head_size = count(head_size, "head_size", op_name, minimum=1)
    check_bool(is_neox, "is_neox", op_name)
    q = heads_view(query, positions, head_size, "query", op_name)
    k = None if key is None else heads_view(key, positions, head_size, "key", op_name)
    apply_rope(q, k, positions, cos_sin_cache=cos_sin_cache, interleaved=not is_neox, inplace=True)
    if found is not None:
        # The views have the given tensors' pointers, so the views' recipe (with its overlap
        # guards) replays on the tensors as given.
        inner = call_key(q, k, positions, cos_sin_cache, None, None,
                         (10000.0, None, not is_neox, None, False, True, None))
        recipe = None if inner is None else recipes.get(inner[0])
        if recipe is not None:
            recipes.put(adapter_key, recipe)


def heads_view(x, positions, head_size: int, name: str, op_name: str):
    """``[..., H * head_size]`` as ``[..., H, head_size]`` (a view: the last dim has stride 1)."""
    require_tensor(x, name, op_name)
    token_dims = require_tensor(positions, "positions", op_name).dim()
    if x.dim() == token_dims + 2:
        if x.shape[-1] != head_size:
            raise ValueError(f"{op_name}: {name} has head size {x.shape[-1]}, expected "
                             f"head_size={head_size}")
        return x
    if x.dim() != token_dims + 1:
        raise ValueError(
            f"{op_name}: {name} of shape {tuple(x.shape)} must be positions.shape "
            f"{tuple(positions.shape)} + [heads * head_size] or + [heads, head_size]"
        )
    if x.shape[-1] % head_size:
        raise ValueError(f"{op_name}: {name}'s last dim {x.shape[-1]} is not a multiple of "
                         f"head_size={head_size}")
    return x.view(*x.shape[:-1], x.shape[-1] // head_size, head_size)


def token_heads_view(x, positions, head_size: int, name: str, op_name: str):
    """``[T, H * head_size]`` or ``[T, H, head_size]`` as ``[T, H, head_size]``: the one token dim
    of a serving batch (positions ``[T]``)."""
    if require_tensor(positions, "positions", op_name).dim() != 1:
        raise ValueError(f"{op_name}: positions must be 1-d [num_tokens] with a KV cache, got shape "
                         f"{tuple(positions.shape)}")
    return heads_view(x, positions, head_size, name, op_name)


def cache_kind(k_cache, v_cache, fmt: str | None, dtype, op_name: str, said: str) -> str | None:
    """Check the caches against the format the caller named (None: key's own dtype) and return
    what :func:`cupyrope.rope_and_cache` needs to know: ``cache_dtype`` for uint8 caches (fp8
    bits), ``"fp8"`` for caches of an fp8 dtype, None for caches of key's dtype."""
    kinds = {dtype_name_of(require_tensor(c, name, op_name).dtype)
             for c, name in ((k_cache, "key cache"), (v_cache, "value cache"))}
    if len(kinds) != 1:
        raise TypeError(f"{op_name}: key and value caches must have one dtype, got "
                        f"{k_cache.dtype} and {v_cache.dtype}")
    stored = kinds.pop()
    if fmt is None:
        if stored != dtype_name_of(dtype):
            raise TypeError(f"{op_name}: with {said} the caches must hold key's dtype {dtype}, got "
                            f"{k_cache.dtype}")
        return None
    if stored == "uint8":  # fp8 bits
        return fmt
    if stored != fmt:
        raise TypeError(f"{op_name}: {said} needs caches of {fmt} (or uint8 holding its bits), got "
                        f"{k_cache.dtype}")
    return "fp8"


def cache_scale(value, name: str, op_name: str):
    """An fp8 scale as cupyrope takes it: None (1), a number, or a one-element tensor (kept on
    the device, so a captured CUDA graph reads its current value)."""
    if value is None:
        return None
    if hasattr(value, "numel"):
        if value.numel() != 1:
            raise ValueError(f"{op_name}: {name} must be a number or a one-element tensor (per-head "
                             f"scales are not supported), got shape {tuple(value.shape)}")
        return value.reshape(())
    return check_real(value, name, op_name)


def write_cache(op_name: str, positions, q, k, v, k_cache, v_cache, slot_mapping, kind, k_scale,
                v_scale, cos_sin_cache, is_neox: bool) -> None:
    """Rotate q and k in place and write rotated k and v into ``[num_blocks, block_size, Hk, D]``
    caches (any strides), one launch. ``kind`` is :func:`cache_kind`'s answer: the scales are
    only passed for fp8 caches (serving stacks pass unit scales with 16-bit caches too)."""
    scales = {"k_scale": cache_scale(k_scale, "k_scale", op_name),
              "v_scale": cache_scale(v_scale, "v_scale", op_name)}
    if kind is None:  # checked all the same, so that a bad scale fails before an fp8 run does
        scales = {}
    rope_and_cache(q, k, v, positions, k_cache, v_cache, slot_mapping,
                   cos_sin_cache=cos_sin_cache, interleaved=not is_neox, layout="NHD",
                   cache_dtype=kind if kind in FP8_DTYPES else None, inplace=True, **scales)

