"""FlashInfer's public RoPE calls (``flashinfer.rope``): ``rope_quantize_fp8`` (and its MLA alias
``mla_rope_quantize_fp8``): RoPE on the rotary part of q and k and fp8 quantisation of both
parts, one launch when each rope part is followed by its nope part in memory; and the plain
rotations, each one cupyrope launch: ``apply_rope`` / ``apply_llama31_rope`` (ragged batches),
their ``_pos_ids`` forms, the ``_inplace`` twins, and ``apply_rope_with_cos_sin_cache``.

Design notes: docs/architecture.md#compatflashinferpy
"""

from __future__ import annotations

import math

import torch

# Imported under another name: this module defines FlashInfer's own ``apply_rope``.
from ..api import apply_rope as cupyrope_apply_rope
from ..core.validators import check_bool, check_real, check_rotary_dim, check_theta, is_integer
from .te import positions_on_device
from .vllm import count, heads_view, require_tensor

WHERE = "rope_quantize_fp8"
FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # largest finite values
OUT_NAMES = ("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out")


def rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                      quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0,
                      q_rope_out=None, k_rope_out=None, q_nope_out=None, k_nope_out=None,
                      enable_pdl=False):
    """FlashInfer's ``rope_quantize_fp8``.

    Parameters
    ----------
    q_rope : tensor ``(nnz, num_qo_heads, rope_dim)``, float16 or bfloat16 (float32 works too)
    k_rope : tensor ``(nnz, num_kv_heads, rope_dim)``, or ``(nnz, rope_dim)`` for MLA (one
        shared k head)
    q_nope : tensor ``(nnz, num_qo_heads, no_rope_dim)`` or None (``no_rope_dim`` 0)
    k_nope : tensor shaped like k_rope with ``no_rope_dim`` last, or None
    cos_sin_cache : tensor ``(max_seq_len, rope_dim)``
        cos in the first half of a row, sin in the second (FlashInfer requires float32).
    pos_ids : int32 / int64 tensor ``(nnz,)``
    is_neox : bool
        True: NeoX pairing within the rope part; False: GPT-J (interleaved, DeepSeek's).
    quantize_dtype : ``torch.float8_e4m3fn``, ``torch.float8_e5m2`` or None
        None: the dtype of the first ``*_out`` given, else e4m3.
    quant_scale_q, quant_scale_kv : float, or a one-element float32 tensor
        Multiplied in before the cast (stored = fp8(value * scale), saturated at the format's
        largest finite value).
    q_rope_out, k_rope_out, q_nope_out, k_nope_out : tensors, optional
        Shaped like the matching input, of ``quantize_dtype``; written and returned.
    enable_pdl : bool
        Accepted for FlashInfer's signature; Programmatic Dependent Launch is a launch attribute
        that does not change results, and cupyrope's launches do not set it.

    Returns
    -------
    (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
        fp8 tensors shaped like the inputs (size-0 nope outputs where a nope input is None).
        Without ``*_out``, a joined rope/nope pair comes back as two views of one fp8 tensor.
    """
    check_bool(is_neox, "is_neox", WHERE)
    check_bool(enable_pdl, "enable_pdl", WHERE)
    mla = require_tensor(k_rope, "k_rope", WHERE).dim() == 2
    inputs = _inputs(q_rope, k_rope, q_nope, k_nope, mla)
    nnz, _, rope_dim = inputs[0].shape
    if tuple(require_tensor(pos_ids, "pos_ids", WHERE).shape) != (nnz,):
        raise ValueError(f"{WHERE}: pos_ids must have shape ({nnz},) (one per token), got "
                         f"{tuple(pos_ids.shape)}")
    given = (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
    dtype = _quantize_dtype(quantize_dtype, given)
    scale_q = _scale(quant_scale_q, "quant_scale_q")
    scale_kv = _scale(quant_scale_kv, "quant_scale_kv")
    outs = [_out(out, like, name, dtype, mla and which % 2 == 1)
            for which, (out, like, name) in enumerate(zip(given, inputs, OUT_NAMES))]

    q_rope, k_rope, q_nope, k_nope = inputs
    rope = dict(cos_sin_cache=cos_sin_cache, interleaved=not is_neox, rotary_dim=rope_dim,
                out_dtype=dtype, q_scale=_reciprocal(scale_q), k_scale=_reciprocal(scale_kv))
    q_joined, k_joined = _joined(q_rope, q_nope), _joined(k_rope, k_nope)
    if q_joined is not None and k_joined is not None:  # one launch quantises both parts
        q8, k8 = cupyrope_apply_rope(q_joined, k_joined, pos_ids, **rope)
        results = [q8[..., :rope_dim], k8[..., :rope_dim], q8[..., rope_dim:], k8[..., rope_dim:]]
    else:  # separate tensors, or nope first ([nope | rope]: cupyrope rotates the FIRST dims)
        results = [*cupyrope_apply_rope(q_rope, k_rope, pos_ids, **rope),
                   _quantize(q_nope, scale_q, dtype), _quantize(k_nope, scale_kv, dtype)]
    _store(results, outs)
    if mla:  # k_rope came as (nnz, rope_dim): its results go back without the heads dim
        results[1::2] = [x.squeeze(-2) for x in results[1::2]]
    return tuple(out if out is not None else result for out, result in zip(given, results))


def mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                          quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0,
                          q_rope_out=None, k_rope_out=None, q_nope_out=None, k_nope_out=None,
                          enable_pdl=False):
    """FlashInfer's ``mla_rope_quantize_fp8``: the same op as :func:`rope_quantize_fp8` (an alias
    there too), under its MLA name."""
    return rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox,
                             quantize_dtype, quant_scale_q, quant_scale_kv, q_rope_out,
                             k_rope_out, q_nope_out, k_nope_out, enable_pdl)


def _inputs(q_rope, k_rope, q_nope, k_nope, mla: bool) -> list:
    """The four inputs as ``(nnz, heads, dim)`` tensors (views; size-0 nope parts for None)."""
    if require_tensor(q_rope, "q_rope", WHERE).dim() != 3:
        raise ValueError(f"{WHERE}: q_rope must be (nnz, num_qo_heads, rope_dim), got shape "
                         f"{tuple(q_rope.shape)}")
    k_rope = k_rope.unsqueeze(-2) if mla else k_rope
    nnz, _, rope_dim = q_rope.shape
    if k_rope.dim() != 3 or k_rope.shape[0] != nnz or k_rope.shape[2] != rope_dim:
        raise ValueError(f"{WHERE}: k_rope must be (nnz={nnz}, num_kv_heads, rope_dim={rope_dim}) "
                         f"or (nnz, rope_dim) for MLA, got shape {tuple(k_rope.shape)}")
    nopes = []
    for x, rope, name in ((q_nope, q_rope, "q_nope"), (k_nope, k_rope, "k_nope")):
        if x is None:
            nopes.append(rope.new_empty((*rope.shape[:2], 0)))
            continue
        require_tensor(x, name, WHERE)
        x = x.unsqueeze(-2) if mla and name == "k_nope" and x.dim() == 2 else x
        if x.dim() != 3 or x.shape[:2] != rope.shape[:2]:
            raise ValueError(f"{WHERE}: {name} must have the tokens and heads of its rope part "
                             f"{tuple(rope.shape[:2])}, got shape {tuple(x.shape)}")
        if x.dtype != rope.dtype:
            raise TypeError(f"{WHERE}: {name} must have the rope part's dtype {rope.dtype}, got "
                            f"{x.dtype}")
        nopes.append(x)
    if nopes[0].shape[2] != nopes[1].shape[2]:
        raise ValueError(f"{WHERE}: q_nope and k_nope must have one no_rope_dim, got "
                         f"{nopes[0].shape[2]} and {nopes[1].shape[2]}")
    return [q_rope, k_rope, *nopes]


def _quantize_dtype(quantize_dtype, outs):
    """FlashInfer's rule: the dtype named, else the first out's, else float8_e4m3fn."""
    if quantize_dtype is None:
        quantize_dtype = next((out.dtype for out in outs if out is not None),
                              torch.float8_e4m3fn)
    if isinstance(quantize_dtype, str):
        quantize_dtype = getattr(torch, quantize_dtype, quantize_dtype)
    if quantize_dtype not in FP8:
        raise ValueError(f"{WHERE}: quantize_dtype must be torch.float8_e4m3fn or "
                         f"torch.float8_e5m2, got {quantize_dtype!r}")
    return quantize_dtype


def _scale(value, name: str):
    """A quantisation scale: a finite number > 0, or a one-element float32 tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            raise ValueError(f"{WHERE}: {name} must be a number or a one-element float32 tensor, "
                             f"got shape {tuple(value.shape)} {value.dtype}")
        return value.reshape(())
    scale = check_real(value, name, WHERE)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{WHERE}: {name} must be finite and > 0, got {value!r}")
    return scale


def _reciprocal(scale):
    """cupyrope's divisor for FlashInfer's multiplier (a device tensor stays on the device: no
    synchronisation, and a captured CUDA graph reads its current value).

    FlashInfer stores fp8(value * quant_scale), cupyrope fp8(value / scale) (vLLM's convention):
    the two agree up to the float32 rounding of the reciprocal (exactly for powers of two)."""
    return torch.reciprocal(scale) if isinstance(scale, torch.Tensor) else 1.0 / scale


def _out(out, like, name: str, dtype, mla_k: bool):
    """A ``*_out`` buffer checked against its input, as ``(nnz, heads, dim)`` (or None)."""
    if out is None:
        return None
    require_tensor(out, name, WHERE)
    out3 = out.unsqueeze(-2) if mla_k and out.dim() == 2 else out
    if tuple(out3.shape) != tuple(like.shape):
        raise ValueError(f"{WHERE}: {name} must have its input's shape "
                         f"{tuple(like.shape[::2] if mla_k else like.shape)}, got "
                         f"{tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{WHERE}: {name} must have quantize_dtype {dtype}, got {out.dtype}")
    if out.device != like.device:
        raise ValueError(f"{WHERE}: {name} is on {out.device} but the inputs are on "
                         f"{like.device}")
    return out3


def _joined(rope, nope):
    """The ``[..., rope_dim + no_rope_dim]`` view that holds ``rope`` then ``nope`` when the nope
    part starts right after the rope part in memory (same storage, shape and strides), else
    None. Size-0 nope parts join nothing."""
    # The strides of size-1 dims (the head dim of an unsqueezed MLA k) locate nothing.
    leading = zip(rope.shape[:-1], rope.stride()[:-1], nope.stride()[:-1])
    if (nope.shape[-1] == 0 or rope.dtype != nope.dtype or rope.device != nope.device
            or rope.shape[:-1] != nope.shape[:-1] or rope.stride(-1) != 1 or nope.stride(-1) != 1
            or any(size > 1 and a != b for size, a, b in leading)
            or rope.untyped_storage().data_ptr() != nope.untyped_storage().data_ptr()
            or nope.data_ptr() != rope.data_ptr() + rope.shape[-1] * rope.element_size()):
        return None
    return rope.as_strided((*rope.shape[:-1], rope.shape[-1] + nope.shape[-1]), rope.stride(),
                           rope.storage_offset())


def _quantize(x, scale, dtype):
    """fp8(x * scale), saturated, as FlashInfer stores the nope part: float32 product, one
    rounding (NaN stays NaN)."""
    limit = FP8[dtype]
    return x.to(torch.float32, copy=True).mul_(scale).clamp_(-limit, limit).to(dtype)


def _store(results, outs) -> None:
    """Copy the results into the ``*_out`` buffers given: one copy for a rope/nope pair that is
    adjacent in both, else one per buffer."""
    for rope_at, nope_at in ((0, 2), (1, 3)):
        pair_out = [outs[rope_at], outs[nope_at]]
        if None not in pair_out:
            joined_out = _joined(*pair_out)
            joined_result = _joined(results[rope_at], results[nope_at])
            if joined_out is not None and joined_result is not None:
                joined_out.copy_(joined_result)
                continue
        for at in (rope_at, nope_at):
            if outs[at] is not None:
                outs[at].copy_(results[at])


# ----------------------------------------------------------------------------------------------
# The plain rotations: angles computed in the kernel (ragged batches or pos_ids), or a table


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
               rope_theta=1e4):
    """FlashInfer's ``apply_rope``: rotate a ragged batch of queries and keys, out of place.

    Request ``b`` holds tokens ``indptr[b]:indptr[b + 1]``; token ``i`` of it is at position
    ``offsets[b] + (i - indptr[b])`` (:func:`cupyrope.varlen_positions`). Angles are computed in
    the kernel: pair ``j`` of a token at position ``p`` turns by
    ``p * rope_theta ** (-2j / rotary_dim) / rope_scale``.

    Parameters
    ----------
    q : tensor ``(nnz, num_q_heads, head_dim)``
        float16 or bfloat16 (float32 and float64 work too); any strides but the last.
    k : tensor ``(nnz, num_k_heads, head_dim)``
    indptr : int32 / int64 tensor ``(batch_size + 1,)``
        Starts at 0 and ends at ``nnz``, as FlashInfer requires (not checked: that would read it
        back to the host).
    offsets : int32 / int64 tensor ``(batch_size,)``
        The position of each request's first token.
    rotary_dim : int, optional
        The first ``rotary_dim`` dims of each head are rotated (even, <= head_dim), the others
        pass through; None: ``head_dim``.
    interleave : bool
        False: dim ``j`` pairs with ``j + rotary_dim // 2`` (NeoX); True: ``2j`` with ``2j + 1``
        (GPT-J; cupyrope's ``interleaved``).
    rope_scale : float
        Divides every frequency (linear position interpolation: Hugging Face's ``"linear"``
        schedule with ``factor=rope_scale``); finite and > 0.
    rope_theta : float
        The RoPE base; finite and > 0.

    Returns
    -------
    (q_rope, k_rope)
        New contiguous tensors shaped like q and k; q and k are left as they were.

    Examples
    --------
    >>> import torch
    >>> from cupyrope import compat
    >>> q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    >>> indptr, offsets = torch.tensor([0, 3, 5]), torch.tensor([10, 0])
    >>> q_rope, k_rope = compat.apply_rope(q, k, indptr, offsets)
    >>> q_rope.shape
    torch.Size([5, 4, 64])
    """
    return _rotate_ragged("apply_rope", q, k, indptr, offsets, rotary_dim, interleave,
                          rope_theta, _linear_scaling(rope_scale, "apply_rope"), inplace=False)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
                       rope_theta=1e4):
    """FlashInfer's ``apply_rope_inplace``: :func:`apply_rope` written into q and k.

    Returns None (as FlashInfer); q and k hold the result.
    """
    op_name = "apply_rope_inplace"
    _rotate_ragged(op_name, q, k, indptr, offsets, rotary_dim, interleave, rope_theta,
                   _linear_scaling(rope_scale, op_name), inplace=True)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                       rope_theta=1e4):
    """FlashInfer's ``apply_rope_pos_ids``: :func:`apply_rope` with the position of every token
    given, out of place.

    Parameters
    ----------
    q, k : tensors ``(nnz, num_q_heads, head_dim)``, ``(nnz, num_k_heads, head_dim)``
    pos_ids : int32 / int64 tensor ``(nnz,)``
        Negative positions rotate backwards.
    rotary_dim, interleave, rope_scale, rope_theta
        As in :func:`apply_rope`.

    Returns
    -------
    (q_rope, k_rope)
        New contiguous tensors shaped like q and k.
    """
    op_name = "apply_rope_pos_ids"
    return _rotate_at(op_name, q, k, pos_ids, rotary_dim, interleave, rope_theta,
                      _linear_scaling(rope_scale, op_name), inplace=False)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                               rope_theta=1e4):
    """FlashInfer's ``apply_rope_pos_ids_inplace``: :func:`apply_rope_pos_ids` written into q
    and k. Returns None."""
    op_name = "apply_rope_pos_ids_inplace"
    _rotate_at(op_name, q, k, pos_ids, rotary_dim, interleave, rope_theta,
               _linear_scaling(rope_scale, op_name), inplace=True)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
                       old_context_len=8192):
    """FlashInfer's ``apply_llama31_rope``: :func:`apply_rope` with Llama 3.1's frequencies, out
    of place.

    Pair ``j``'s frequency ``f = rope_theta ** (-2j / rotary_dim)`` becomes
    ``(1 - s) * f / rope_scale + s * f`` with
    ``s = clip((old_context_len * f / (2 pi) - low_freq_factor) / (high_freq_factor -
    low_freq_factor), 0, 1)``: Hugging Face's ``"llama3"`` schedule, which cupyrope computes,
    with ``factor=rope_scale`` and ``original_max_position_embeddings=old_context_len``.

    Parameters
    ----------
    q, k, indptr, offsets, rotary_dim, interleave, rope_theta
        As in :func:`apply_rope`.
    rope_scale : float
        Divides the low frequencies (Llama 3.1: 8); finite and > 0.
    low_freq_factor, high_freq_factor : float
        ``0 < low_freq_factor < high_freq_factor``, finite (Llama 3.1: 1 and 4).
    old_context_len : int
        The pretraining context length (Llama 3.1: 8192); a positive integer.

    Returns
    -------
    (q_rope, k_rope)
        New contiguous tensors shaped like q and k.
    """
    op_name = "apply_llama31_rope"
    scaling = _llama31_scaling(rope_scale, low_freq_factor, high_freq_factor, old_context_len,
                               op_name)
    return _rotate_ragged(op_name, q, k, indptr, offsets, rotary_dim, interleave, rope_theta,
                          scaling, inplace=False)


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                               rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                               high_freq_factor=4, old_context_len=8192):
    """FlashInfer's ``apply_llama31_rope_inplace``: :func:`apply_llama31_rope` written into q and
    k. Returns None."""
    op_name = "apply_llama31_rope_inplace"
    scaling = _llama31_scaling(rope_scale, low_freq_factor, high_freq_factor, old_context_len,
                               op_name)
    _rotate_ragged(op_name, q, k, indptr, offsets, rotary_dim, interleave, rope_theta, scaling,
                   inplace=True)


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
                               old_context_len=8192):
    """FlashInfer's ``apply_llama31_rope_pos_ids``: :func:`apply_llama31_rope` with the position
    of every token given (``pos_ids`` as in :func:`apply_rope_pos_ids`), out of place.

    Returns ``(q_rope, k_rope)``, new contiguous tensors shaped like q and k.
    """
    op_name = "apply_llama31_rope_pos_ids"
    scaling = _llama31_scaling(rope_scale, low_freq_factor, high_freq_factor, old_context_len,
                               op_name)
    return _rotate_at(op_name, q, k, pos_ids, rotary_dim, interleave, rope_theta, scaling,
                      inplace=False)


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                       rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                                       high_freq_factor=4, old_context_len=8192):
    """FlashInfer's ``apply_llama31_rope_pos_ids_inplace``: :func:`apply_llama31_rope_pos_ids`
    written into q and k. Returns None."""
    op_name = "apply_llama31_rope_pos_ids_inplace"
    scaling = _llama31_scaling(rope_scale, low_freq_factor, high_freq_factor, old_context_len,
                               op_name)
    _rotate_at(op_name, q, k, pos_ids, rotary_dim, interleave, rope_theta, scaling,
               inplace=True)


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache,
                                  is_neox=True):
    """FlashInfer's ``apply_rope_with_cos_sin_cache``: rotate query and key by the rows of a
    cos/sin table, out of place (the in-place twin is
    :func:`cupyrope.compat.apply_rope_with_cos_sin_cache_inplace`).

    Parameters
    ----------
    positions : int32 / int64 tensor ``(nnz,)``
        The table row of each token.
    query : tensor ``(nnz, num_q_heads * head_size)`` (or ``(nnz, num_q_heads, head_size)``)
    key : tensor ``(nnz, num_k_heads * head_size)`` (or ``(nnz, num_k_heads, head_size)``)
    head_size : int
    cos_sin_cache : tensor ``(max_seq_len, rotary_dim)``, ``rotary_dim <= head_size``
        cos in the first half of a row, sin in the second; the first ``rotary_dim`` dims of
        each head are rotated. FlashInfer requires float32; any float dtype works here.
    is_neox : bool
        True: NeoX pairing; False: GPT-J (interleaved).

    Returns
    -------
    (query_out, key_out)
        New contiguous tensors shaped like query and key.
    """
    op_name = "apply_rope_with_cos_sin_cache"
    head_size = count(head_size, "head_size", op_name, minimum=1)
    check_bool(is_neox, "is_neox", op_name)
    if require_tensor(query, "query", op_name).dim() not in (2, 3):
        raise ValueError(f"{op_name}: query must be (nnz, num_q_heads * head_size) or (nnz, "
                         f"num_q_heads, head_size), got shape {tuple(query.shape)}")
    _check_positions(positions, "positions", query.shape[0], op_name)
    q = heads_view(query, positions, head_size, "query", op_name)
    k = heads_view(require_tensor(key, "key", op_name), positions, head_size, "key", op_name)
    query_out, key_out = cupyrope_apply_rope(q, k, positions, cos_sin_cache=cos_sin_cache,
                                             interleaved=not is_neox)
    return query_out.view(query.shape), key_out.view(key.shape)


def _rotate_ragged(op_name, q, k, indptr, offsets, rotary_dim, interleave, rope_theta, scaling,
                   *, inplace):
    """One launch over a ragged batch (the positions are made on q's device first)."""
    nnz = _check_qk(q, k, rotary_dim, op_name)
    for x, name in ((indptr, "indptr"), (offsets, "offsets")):
        if require_tensor(x, name, op_name).dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op_name}: {name} must be int32 or int64, got {x.dtype}")
        if x.dim() != 1:
            raise ValueError(f"{op_name}: {name} must be 1-d, got shape {tuple(x.shape)}")
    batch_size = offsets.shape[0]
    if indptr.shape[0] != batch_size + 1:
        raise ValueError(f"{op_name}: indptr must have shape (batch_size + 1,) = "
                         f"({batch_size + 1},) for offsets of shape ({batch_size},), got "
                         f"{tuple(indptr.shape)}")
    if batch_size == 0 and nnz:
        raise ValueError(f"{op_name}: indptr and offsets describe no request but q has {nnz} "
                         "tokens")
    # varlen_positions(indptr, offsets) computed with torch ops on q's device: no read back to
    # the host, so the call neither synchronises nor breaks CUDA-graph capture.
    positions = positions_on_device(q, "thd", indptr, offsets, 1, 0)
    return _launch(q, k, positions, rotary_dim, interleave, rope_theta, scaling, inplace,
                   op_name)


def _rotate_at(op_name, q, k, pos_ids, rotary_dim, interleave, rope_theta, scaling, *,
               inplace):
    """One launch at the positions given."""
    nnz = _check_qk(q, k, rotary_dim, op_name)
    _check_positions(pos_ids, "pos_ids", nnz, op_name)
    return _launch(q, k, pos_ids, rotary_dim, interleave, rope_theta, scaling, inplace, op_name)


def _launch(q, k, positions, rotary_dim, interleave, rope_theta, scaling, inplace, op_name):
    """The one cupyrope launch: ``(q_rope, k_rope)``, q and k themselves in place."""
    check_bool(interleave, "interleave", op_name)
    theta = check_theta(rope_theta, op_name, "rope_theta")
    return cupyrope_apply_rope(q, k, positions, theta=theta, scaling=scaling,
                               interleaved=interleave, rotary_dim=rotary_dim, inplace=inplace)


def _check_qk(q, k, rotary_dim, op_name: str) -> int:
    """``nnz`` of FlashInfer's ``(nnz, heads, head_dim)`` q and k, checked with rotary_dim."""
    for x, name, heads in ((q, "q", "num_q_heads"), (k, "k", "num_k_heads")):
        if require_tensor(x, name, op_name).dim() != 3:
            raise ValueError(f"{op_name}: {name} must be (nnz, {heads}, head_dim), got shape "
                             f"{tuple(x.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"{op_name}: k must have q's nnz {q.shape[0]} and head_dim "
                         f"{q.shape[2]}, got shape {tuple(k.shape)}")
    if rotary_dim is not None:
        check_rotary_dim(rotary_dim, op_name, q.shape[2])
    return q.shape[0]


def _check_positions(positions, name: str, nnz: int, op_name: str) -> None:
    """One int32 / int64 position per token (cupyrope would broadcast a shorter one)."""
    if require_tensor(positions, name, op_name).dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op_name}: {name} must be int32 or int64, got {positions.dtype}")
    if tuple(positions.shape) != (nnz,):
        raise ValueError(f"{op_name}: {name} must have shape ({nnz},) (one per token), got "
                         f"{tuple(positions.shape)}")


def _positive(value, name: str, op_name: str) -> float:
    number = check_real(value, name, op_name)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{op_name}: {name} must be finite and > 0, got {value!r}")
    return number


def _linear_scaling(rope_scale, op_name: str):
    """FlashInfer divides every frequency by ``rope_scale``: Hugging Face's linear schedule
    (None for 1, the plain frequencies)."""
    factor = _positive(rope_scale, "rope_scale", op_name)
    return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}


def _llama31_scaling(rope_scale, low_freq_factor, high_freq_factor, old_context_len,
                     op_name: str) -> dict:
    """FlashInfer's Llama 3.1 arguments as the ``"llama3"`` rope_scaling dict (the same
    frequencies: FlashInfer's clamped ``smooth`` is Hugging Face's three bands in one formula)."""
    factor = _positive(rope_scale, "rope_scale", op_name)
    low = _positive(low_freq_factor, "low_freq_factor", op_name)
    high = _positive(high_freq_factor, "high_freq_factor", op_name)
    if not low < high:
        raise ValueError(f"{op_name}: low_freq_factor must be < high_freq_factor, got "
                         f"{low_freq_factor!r} and {high_freq_factor!r}")
    length = old_context_len
    if isinstance(length, float) and length.is_integer():
        length = int(length)
    if not is_integer(length) or length < 1:
        raise ValueError(
            f"{op_name}: old_context_len must be a positive integer (FlashInfer's int "
            f"argument; cupyrope's llama3 schedule takes no fractional context length: for "
            f"one, build a cos_sin_cache and call apply_rope_with_cos_sin_cache), got "
            f"{old_context_len!r}")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(length)}
