"""vLLM: the in-place ``rotary_embedding`` op (SGLang's and FlashInfer's too) and
``batched_rotary_embedding``, the fused ``fused_qk_norm_rope`` and ``fused_qk_norm_rope_kvcache``
ops, ``reshape_and_cache_flash``, and RoPE fused with ``reshape_and_cache_flash``.

Each function takes the arguments of the call it replaces (torch tensors, CUDA or CPU) and maps
them onto one cupyrope op through views: no copy of q, k, v or the caches. The helpers at the end
(head views, cache formats and scales, the cache write) are shared with the SGLang adapter.
"""

from __future__ import annotations

import torch

from ..api import apply_rope, rms_norm_rope, rope_and_cache
from ..api import write_cache as write_unrotated  # write_cache below is the adapters' helper
from ..core.dtypes import FP8_DTYPES, dtype_name_of
from .. import execute
from ..cuda.recipes import FUSED_OPERANDS, call_key, fast_fused_key, recipes, replay
from ..mla import latent_cache_write
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

    Notes
    -----
    Each output is the float32 rotation rounded once to query's dtype. vLLM's tests compare its
    kernel with a torch reference that rounds to bfloat16 after every multiply and add
    (``x1 * cos - x2 * sin`` in bf16 tensors, with a bf16 table), within ``atol=1e-3,
    rtol=1.6e-2``; that reference is the less accurate of the two, so a few elements fall
    outside that tolerance. Measured on CPU (bf16 q ``[2048, 8, 128]`` of N(0, 1) values, vLLM's
    bf16 table of 8192 rows, random positions, both pairings), against float64 on the same bf16
    values: largest error 0.0156 here (half a bf16 ulp at |x| < 4) against 0.025 to 0.027 for
    the per-op reference; on the 0.6 % of elements outside vLLM's tolerance, cupyrope's error
    is 5.2x to 63x smaller element by element (median 61x; largest 0.00098 against 0.010 to
    0.013). tests/test_compat_vllm.py checks that ordering on fresh data.
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
    # A repeat call of a layout replays on qkv as given: no views, nothing checked again.
    found = _qkv_norm_key(op_name, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
                          q_weight, k_weight, cos_sin_cache, is_neox, position_ids)
    if found is not None and execute.replay_fast(found, qkv, qkv, None, True) is not None:
        return
    q, k, _ = split_qkv(op_name, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, is_neox,
                        position_ids)
    execute.watch_kept()
    rms_norm_rope(q, k, q_weight, k_weight, position_ids, eps=eps, cos_sin_cache=cos_sin_cache,
                  interleaved=not is_neox, inplace=True)
    if found is not None:  # q and k are views of qkv: its pointer, k's offset
        execute.keep_kept_under(found[0])


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
    # A serving step repeats one layout: keyed on the tensors as given (flat or not), its launch
    # replays the recipe of the first such call, no head views made, nothing checked again.
    found = _flat_cache_key(op_name, positions, query, key, value, key_cache, value_cache,
                            slot_mapping, kv_cache_dtype, k_scale, v_scale, head_size,
                            cos_sin_cache, is_neox)
    if found is not None and execute.replay_fast(found, query, key, (key_cache, value_cache),
                                                 True) is not None:
        return
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
    slots = padded_slots(slot_mapping, num_tokens)
    execute.watch_kept()
    write_cache(op_name, positions, q, k, v, key_cache, value_cache, slots, kind,
                k_scale, v_scale, cos_sin_cache, is_neox)
    if found is not None and slots is slot_mapping:
        # The views and the scales' 0-d views have the given tensors' pointers (a padded slot
        # mapping would not: it is new each call), so the launch replays on these.
        execute.keep_kept_under(found[0])


def _qkv_norm_key(op_name, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight,
                  k_weight, cos_sin_cache, is_neox, position_ids):
    """(key, pointers) of a ``fused_qk_norm_rope`` call on qkv as given, the pointers those of
    the rms_norm_rope call it makes on qkv's q and k views (k's heads start ``num_heads_q *
    head_dim`` elements in), or None."""
    if type(num_heads_q) is not int or type(head_dim) is not int:
        return None  # the full path checks them
    found = fast_fused_key(op_name, (qkv, qkv, position_ids, cos_sin_cache, None, None, q_weight,
                                     k_weight), (num_heads_q, num_heads_k, num_heads_v, head_dim,
                                                 eps, is_neox))
    if found is not None:
        found[1][1] += num_heads_q * head_dim * qkv.element_size()
    return found


_SCALE_POINTERS = (FUSED_OPERANDS.index("k_scale"), FUSED_OPERANDS.index("v_scale"))


def _flat_cache_key(op_name, positions, query, key, value, key_cache, value_cache, slot_mapping,
                    kv_cache_dtype, k_scale, v_scale, head_size, cos_sin_cache, is_neox):
    """(key, pointers) of a vLLM cache-writing call on its tensors as given, the pointers in the
    order of the rope_and_cache call it makes (its views share the given tensors' pointers), or
    None. The scales are keyed in every format, as the full path checks them in every format,
    but only fp8 caches read them: with key's own dtype ("auto") their pointers are 0, as in the
    launch the full path makes."""
    found = fast_fused_key(op_name, (query, key, positions, cos_sin_cache, None, None, None, None,
                                     None, k_scale, v_scale, value, key_cache, value_cache,
                                     slot_mapping), (head_size, kv_cache_dtype, is_neox))
    if found is not None and kv_cache_dtype == "auto":
        for at in _SCALE_POINTERS:
            found[1][at] = 0
    return found


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale):
    """vLLM's ``reshape_and_cache_flash``: write key and value, unrotated, into the flash-layout
    paged caches, in one launch of :func:`cupyrope.write_cache`.

    Parameters
    ----------
    key, value : tensors ``[T, Hk, head_size]``
        Any token and head strides (slices of a fused QKV projection work); never written.
    key_cache, value_cache : tensors ``[num_blocks, block_size, Hk, head_size]``
        vLLM's flash layout by shape, with any strides (unit last stride): an HND cache is the
        ``[num_blocks, Hk, block_size, head_size]`` storage seen through ``.permute(0, 2, 1, 3)``.
        key's dtype, or fp8: a torch fp8 dtype or uint8 holding fp8 bits.
    slot_mapping : int64 (or int32) tensor ``[n]``, ``n <= T``
        Token ``t < n`` goes to block ``slot // block_size``, row ``slot % block_size``; negative
        slots are padding and write nothing. Tokens past ``n`` (vLLM V1 pads the batch for CUDA
        graphs, not the slots) are not cached.
    kv_cache_dtype : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
        "auto": the caches hold key's dtype and the scales are not used (as in vLLM).
    k_scale, v_scale : float, or a one-element float32 tensor on key's device
        fp8 caches store ``fp8(value / scale)``, saturated (vLLM's convention). Per-head scales
        are not supported.

    Returns None (as vLLM's op). Every value is stored as it is: a cache of key's dtype gets the
    bits of key and value (inf and NaN included), an fp8 cache ``fp8(x / scale)``. key and value
    are never written.
    """
    op_name = "reshape_and_cache_flash"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{op_name}: kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    for x, name in ((key, "key"), (value, "value")):
        if require_tensor(x, name, op_name).dim() != 3:
            raise ValueError(f"{op_name}: {name} must be [num_tokens, num_heads, head_size], got "
                             f"shape {tuple(x.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"{op_name}: value must have key's shape {tuple(key.shape)}, got "
                         f"{tuple(value.shape)}")
    if key.shape[2] < 2:
        raise ValueError(f"{op_name}: head_size must be >= 2, got {key.shape[2]}")
    require_tensor(slot_mapping, "slot_mapping", op_name)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(f"{op_name}: slot_mapping must be 1-d with at most {key.shape[0]} entries "
                         f"(one per token), got shape {tuple(slot_mapping.shape)}")
    kind = cache_kind(key_cache, value_cache, KV_CACHE_DTYPES[kv_cache_dtype], key.dtype, op_name,
                      f"kv_cache_dtype={kv_cache_dtype!r}")
    scales = {"k_scale": cache_scale(k_scale, "k_scale", op_name),
              "v_scale": cache_scale(v_scale, "v_scale", op_name)}
    if kind is None:  # "auto": checked all the same, then not used
        scales = {}
    n = slot_mapping.shape[0]
    write_unrotated(key[:n], value[:n], key_cache, value_cache, slot_mapping, layout="NHD",
                    cache_dtype=kind if kind in FP8_DTYPES else None, **scales)


def fused_qk_norm_rope_kvcache(qkv, q_out, k_out, num_heads_q, num_heads_k, num_heads_v,
                               head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                               position_ids, key_cache, value_cache, slot_mapping,
                               forced_token_heads_per_warp=-1):
    """vLLM's ``fused_qk_norm_rope_kvcache``: :func:`fused_qk_norm_rope` with the
    ``reshape_and_cache_flash`` write folded in; ``qkv`` is read only.

    Parameters
    ----------
    qkv : tensor ``[T, (num_heads_q + num_heads_k + num_heads_v) * head_dim]``
        float16 or bfloat16 (float32 works too), q heads then k heads then v heads per token;
        any row stride, unit last stride. Never written.
    q_out, k_out : tensors ``[T, num_heads_q, head_dim]``, ``[T, num_heads_k, head_dim]``
        Of qkv's dtype and device, any strides with a unit last dim: they receive
        ``rope(x * rsqrt(mean(x**2) + eps) * weight)`` of the q and k heads (float32, rounded
        once), every token included.
    num_heads_q, num_heads_k, num_heads_v : int
        ``num_heads_v`` must equal ``num_heads_k`` (the caches hold both with the KV heads).
    head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox, position_ids
        As in :func:`fused_qk_norm_rope`.
    key_cache, value_cache : tensors ``[num_blocks, block_size, num_heads_k, head_dim]``
        Of qkv's dtype (vLLM supports ``kv_cache_dtype="auto"`` only), any strides with a unit
        last dim (vLLM's ``[num_blocks, H, block_size, 2 * head_dim]`` buffer split into
        transposed key / value views works).
    slot_mapping : int64 (or int32) tensor ``[n]``, ``n <= T``
        As in :func:`reshape_and_cache_flash`: normalised, rotated k and the v heads of token
        ``t < n`` go to slot ``slot_mapping[t]``; negative slots and tokens past ``n`` are not
        cached (they still get their q_out / k_out rows).
    forced_token_heads_per_warp : int
        vLLM's launch-geometry knob; accepted and not used (it does not change results).

    Returns None (as vLLM's op).

    Notes
    -----
    One launch of :func:`cupyrope.rope_and_cache` reads qkv and writes the caches, q_out and
    k_out (``out=``: no copy). A slot_mapping shorter than T is padded with -1 on the device
    (two small kernels). Every check runs before anything is written.
    """
    op_name = "fused_qk_norm_rope_kvcache"
    q, k, v = split_qkv(op_name, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, is_neox,
                        position_ids)
    count(forced_token_heads_per_warp, "forced_token_heads_per_warp", op_name, minimum=-1)
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"{op_name}: num_heads_v must equal num_heads_k ({k.shape[1]}): the "
                         f"caches hold k and v with the same heads, got num_heads_v={v.shape[1]}")
    for out, like, name in ((q_out, q, "q_out"), (k_out, k, "k_out")):
        require_tensor(out, name, op_name)
        if out.shape != like.shape or out.dtype != qkv.dtype or out.device != qkv.device:
            raise ValueError(f"{op_name}: {name} must be a {qkv.dtype} tensor of shape "
                             f"{tuple(like.shape)} on {qkv.device}, got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
    num_tokens = qkv.shape[0]
    require_tensor(slot_mapping, "slot_mapping", op_name)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > num_tokens:
        raise ValueError(f"{op_name}: slot_mapping must be 1-d with at most {num_tokens} entries "
                         f"(one per token), got shape {tuple(slot_mapping.shape)}")
    cache_kind(key_cache, value_cache, None, qkv.dtype, op_name,
               "kv_cache_dtype='auto' (the one cache format of this vLLM op)")
    rope_and_cache(
        q, k, v, position_ids, key_cache, value_cache, padded_slots(slot_mapping, num_tokens),
        cos_sin_cache=cos_sin_cache, interleaved=not is_neox, q_weight=q_weight,
        k_weight=k_weight, eps=eps, layout="NHD", inplace=False, out=(q_out, k_out))


def batched_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rot_dim,
                             cos_sin_cache_offsets):
    """vLLM's ``batched_rotary_embedding``: :func:`rotary_embedding` with a per-token offset into
    a cache that concatenates several tables (one per scaling factor, e.g. multi-LoRA long
    context), in place.

    Parameters
    ----------
    positions : int32 / int64 tensor ``[T]`` (or ``[B, S]``)
    query, key : tensors as in :func:`rotary_embedding` (key may be None)
    head_size : int
    cos_sin_cache : tensor ``[num_rows, rot_dim]``
        The concatenated tables, cos then sin per row.
    is_neox : bool
    rot_dim : int
        The cache's row width, ``cos_sin_cache.shape[1]`` (vLLM reads rows ``rot_dim`` apart).
    cos_sin_cache_offsets : int32 / int64 tensor with one entry per token (``positions.numel()``)
        Token ``t`` reads row ``positions[t] + cos_sin_cache_offsets[t]``.

    Returns None; query and key hold the result.

    Notes
    -----
    Since ``positions + offsets`` indexes the concatenated cache exactly as vLLM's kernel does,
    the rows are computed on the device (one small integer add: no host read, CUDA-graph
    capturable) and the rotation is one in-place launch of :func:`cupyrope.apply_rope` at those
    rows. Rows outside the cache give NaN (never read out of bounds). Accuracy against vLLM's
    bf16 references: see :func:`rotary_embedding`.
    """
    op_name = "batched_rotary_embedding"
    head_size = count(head_size, "head_size", op_name, minimum=1)
    rot_dim = count(rot_dim, "rot_dim", op_name, minimum=2)
    check_bool(is_neox, "is_neox", op_name)
    if require_tensor(cos_sin_cache, "cos_sin_cache", op_name).dim() != 2:
        raise ValueError(f"{op_name}: cos_sin_cache must be 2-d [num_rows, rot_dim], got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.shape[1] != rot_dim:
        raise ValueError(f"{op_name}: rot_dim={rot_dim} must be the cache's row width "
                         f"cos_sin_cache.shape[1] = {cos_sin_cache.shape[1]}")
    for x, name in ((positions, "positions"), (cos_sin_cache_offsets, "cos_sin_cache_offsets")):
        if require_tensor(x, name, op_name).dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op_name}: {name} must be int32 or int64, got {x.dtype}")
    if cos_sin_cache_offsets.numel() != positions.numel():
        raise ValueError(f"{op_name}: cos_sin_cache_offsets must have one entry per token "
                         f"({positions.numel()}), got shape {tuple(cos_sin_cache_offsets.shape)}")
    if cos_sin_cache_offsets.device != positions.device:
        raise ValueError(f"{op_name}: cos_sin_cache_offsets is on {cos_sin_cache_offsets.device} "
                         f"but positions is on {positions.device}")
    q = heads_view(query, positions, head_size, "query", op_name)
    k = None if key is None else heads_view(key, positions, head_size, "key", op_name)
    rows = torch.add(positions, cos_sin_cache_offsets.reshape(positions.shape))
    apply_rope(q, k, rows, cos_sin_cache=cos_sin_cache, interleaved=not is_neox, inplace=True)


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


def split_qkv(op_name: str, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, is_neox,
              position_ids):
    """The q, k and v heads of vLLM's fused ``[T, (Hq + Hk + Hv) * head_dim]`` projection, as
    ``[T, H, head_dim]`` views, after checking the arguments that describe them."""
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
    v = qkv[:, k_end:].view(num_tokens, heads["num_heads_v"], head_dim)
    return q, k, v


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


def padded_slots(slot_mapping, num_tokens: int):
    """``slot_mapping`` with -1 appended up to ``num_tokens`` entries (vLLM V1 pads the batch for
    CUDA graphs, not the slots: the padded tokens are not cached); itself when it is long
    enough."""
    if slot_mapping.shape[0] == num_tokens:
        return slot_mapping
    padded = slot_mapping.new_full((num_tokens,), -1)
    padded[:slot_mapping.shape[0]].copy_(slot_mapping)
    return padded


def identity_rotation(like):
    """``(cos_sin_cache, positions)`` of the identity rotation on ``like``'s device: a one-row
    table ``[cos, sin] = [1, 0]`` (``rotary_dim=2``) and position 0 for every token (a ``(1,)``
    tensor that broadcasts). Made once per device and kept; inside a CUDA graph capture a missing
    pair is made for that graph and not kept (its fill kernels only run when the graph does)."""
    device = like.device
    found = _IDENTITY.get(device)
    if found is not None:
        return found
    pair = (torch.eye(1, 2, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))
    if device.type == "cuda":
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                return pair
    _IDENTITY[device] = pair
    return pair


_IDENTITY: dict = {}


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



def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """vLLM's ``concat_and_cache_mla``: write ``[kv_c | k_pe]``, unrotated, into the MLA latent
    cache, through :func:`cupyrope.mla.latent_cache_write` (the cache half of
    :func:`cupyrope.mla_rope_and_cache`, without the rotation).

    Parameters
    ----------
    kv_c : tensor ``[T, kv_lora_rank]``
    k_pe : tensor ``[T, pe_dim]`` (or ``[T, 1, pe_dim]``)
    kv_cache : tensor ``[num_blocks, block_size, kv_lora_rank + pe_dim]``
        kv_c's dtype ("auto"), or fp8: a torch fp8 dtype or uint8 holding fp8 bits.
    slot_mapping : int64 (or int32) tensor ``[n]``, ``n <= T``
        Token ``t < n`` goes to block ``slot // block_size``, row ``slot % block_size``;
        negative slots write nothing; tokens past ``n`` (vLLM V1's CUDA-graph padding) are not
        read.
    kv_cache_dtype : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
    scale : float or one-element float32 tensor
        fp8 caches store ``fp8(value / scale)``, saturated (vLLM's convention); unused with
        "auto".

    Returns None (as vLLM's op).
    """
    op_name = "concat_and_cache_mla"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{op_name}: kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    for x, name in ((kv_c, "kv_c"), (k_pe, "k_pe"), (kv_cache, "kv_cache"),
                    (slot_mapping, "slot_mapping")):
        require_tensor(x, name, op_name)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > kv_c.shape[0]:
        raise ValueError(f"{op_name}: slot_mapping must be 1-d with at most {kv_c.shape[0]} "
                         f"entries (one per token), got shape {tuple(slot_mapping.shape)}")
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    stored = dtype_name_of(kv_cache.dtype)
    options = {}
    if fmt is not None:
        if stored not in ("uint8", fmt):
            raise TypeError(f"{op_name}: kv_cache_dtype={kv_cache_dtype!r} needs a cache of {fmt} "
                            f"(or uint8 holding its bits), got {kv_cache.dtype}")
        options = dict(cache_dtype=fmt, kv_scale=cache_scale(scale, "scale", op_name))
    n = slot_mapping.shape[0]
    latent_cache_write(kv_c[:n], k_pe[:n], kv_cache, slot_mapping, op_name=op_name, **options)
