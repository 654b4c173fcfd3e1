"""FlashInfer: ``rope_quantize_fp8`` (and its MLA alias ``mla_rope_quantize_fp8``): RoPE on the
rotary part of q and k and fp8 quantisation of both parts, for fp8 attention (DeepSeek MLA, GQA,
MHA); one launch when each rope part is followed by its nope part in memory.

Design notes: docs/architecture.md#compatflashinferpy
"""

from __future__ import annotations

import math

import torch

from ..api import apply_rope
from ..core.validators import check_bool, check_real
from .vllm import require_tensor

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
        q8, k8 = apply_rope(q_joined, k_joined, pos_ids, **rope)
        results = [q8[..., :rope_dim], k8[..., :rope_dim], q8[..., rope_dim:], k8[..., rope_dim:]]
    else:  # separate tensors, or nope first ([nope | rope]: cupyrope rotates the FIRST dims)
        results = [*apply_rope(q_rope, k_rope, pos_ids, **rope),
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
