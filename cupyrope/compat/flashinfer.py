"""FlashInfer's public RoPE calls (``flashinfer.rope``): ``rope_quantize_fp8`` (and its MLA alias
``mla_rope_quantize_fp8``): RoPE on the rotary part of q and k and fp8 quantisation of both
parts, one launch when each rope part is followed by its nope part in memory; and the plain
rotations, each one cupyrope launch: ``apply_rope`` / ``apply_llama31_rope`` (ragged batches),
their ``_pos_ids`` forms, the ``_inplace`` twins, and ``apply_rope_with_cos_sin_cache``.
Then ``rope_quantize_fp8_append_paged_kv_cache`` (the same with k and v appended to FlashInfer's
paged cache, or MLA's k_nope / k_rope to its ckv / kpe caches, one launch each, with ``flashinfer.page``'s ``get_seq_lens`` / ``get_batch_indices_positions``) and
``fused_qk_rmsnorm_rope`` (``flashinfer.norm``: QK-RMSNorm over all heads and 3D RoPE).

Design notes: docs/architecture.md#compatflashinferpy
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Imported under another name: this module defines FlashInfer's own ``apply_rope``.
from ..api import apply_rope as cupyrope_apply_rope
from ..api import rms_norm_rope, rope_and_cache
from ..mla import mla_rope_and_cache
from ..mla import mla_rope_quantize as cupyrope_mla_rope_quantize
from ..core.validators import check_bool, check_real, check_rotary_dim, check_theta, is_integer
from .te import positions_on_device
from .vllm import count, heads_view, identity_rotation, require_tensor

WHERE = "rope_quantize_fp8"
FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # largest finite values
OUT_NAMES = ("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out")
BACKENDS = ("cuda", "cutile")  # rope_quantize_fp8's backend values


def rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                      quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0,
                      q_rope_out=None, k_rope_out=None, q_nope_out=None, k_nope_out=None,
                      enable_pdl=False, backend="cuda"):
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
    backend : {"cuda", "cutile"}
        FlashInfer's choice between its CUDA kernel and its cuTile one; both compute the same
        values, and here both run cupyrope's kernel (the cuTile kernel's limits, interleaved
        pairing and MLA only, do not apply). Any other value is refused, as in FlashInfer.

    Returns
    -------
    (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
        fp8 tensors shaped like the inputs (size-0 nope outputs where a nope input is None).
        Without ``*_out``, a joined rope/nope pair comes back as two views of one fp8 tensor.
    """
    check_bool(is_neox, "is_neox", WHERE)
    check_bool(enable_pdl, "enable_pdl", WHERE)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{WHERE}: backend must be 'cuda' or 'cutile' (FlashInfer's two "
                         f"implementations; both run cupyrope's kernel here), got {backend!r}")
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
    else:  # separate tensors, or nope first: the MLA op stores rope and nope parts in one launch
        del rope["rotary_dim"]
        nopes = [None if x.shape[-1] == 0 else x for x in (q_nope, k_nope)]
        results = list(cupyrope_mla_rope_quantize(q_rope, k_rope, *nopes, pos_ids, **rope))
        for i, like in ((2, q_nope), (3, k_nope)):
            if results[i] is None:  # no nope part: FlashInfer returns a size-0 fp8 tensor
                results[i] = torch.empty(like.shape, dtype=dtype, device=like.device)
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


def _inputs(q_rope, k_rope, q_nope, k_nope, mla: bool, op_name: str = WHERE) -> list:
    """The four inputs as ``(nnz, heads, dim)`` tensors (views; size-0 nope parts for None)."""
    if require_tensor(q_rope, "q_rope", op_name).dim() != 3:
        raise ValueError(f"{op_name}: q_rope must be (nnz, num_qo_heads, rope_dim), got shape "
                         f"{tuple(q_rope.shape)}")
    k_rope = k_rope.unsqueeze(-2) if mla else k_rope
    nnz, _, rope_dim = q_rope.shape
    if k_rope.dim() != 3 or k_rope.shape[0] != nnz or k_rope.shape[2] != rope_dim:
        raise ValueError(f"{op_name}: k_rope must be (nnz={nnz}, num_kv_heads, "
                         f"rope_dim={rope_dim}) or (nnz, rope_dim) for MLA, got shape "
                         f"{tuple(k_rope.shape)}")
    nopes = []
    for x, rope, name in ((q_nope, q_rope, "q_nope"), (k_nope, k_rope, "k_nope")):
        if x is None:
            nopes.append(rope.new_empty((*rope.shape[:2], 0)))
            continue
        require_tensor(x, name, op_name)
        x = x.unsqueeze(-2) if mla and name == "k_nope" and x.dim() == 2 else x
        if x.dim() != 3 or x.shape[:2] != rope.shape[:2]:
            raise ValueError(f"{op_name}: {name} must have the tokens and heads of its rope part "
                             f"{tuple(rope.shape[:2])}, got shape {tuple(x.shape)}")
        if x.dtype != rope.dtype:
            raise TypeError(f"{op_name}: {name} must have the rope part's dtype {rope.dtype}, got "
                            f"{x.dtype}")
        nopes.append(x)
    if nopes[0].shape[2] != nopes[1].shape[2]:
        raise ValueError(f"{op_name}: q_nope and k_nope must have one no_rope_dim, got "
                         f"{nopes[0].shape[2]} and {nopes[1].shape[2]}")
    return [q_rope, k_rope, *nopes]


def _quantize_dtype(quantize_dtype, outs, op_name: str = WHERE):
    """FlashInfer's rule: the dtype named, else the first out's, else float8_e4m3fn."""
    if quantize_dtype is None:
        quantize_dtype = next((out.dtype for out in outs if out is not None),
                              torch.float8_e4m3fn)
    if isinstance(quantize_dtype, str):
        quantize_dtype = getattr(torch, quantize_dtype, quantize_dtype)
    if quantize_dtype not in FP8:
        raise ValueError(f"{op_name}: quantize_dtype must be torch.float8_e4m3fn or "
                         f"torch.float8_e5m2, got {quantize_dtype!r}")
    return quantize_dtype


def _scale(value, name: str, op_name: str = WHERE):
    """A quantisation scale: a finite number > 0, or a one-element float32 tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            raise ValueError(f"{op_name}: {name} must be a number or a one-element float32 tensor, "
                             f"got shape {tuple(value.shape)} {value.dtype}")
        return value.reshape(())
    scale = check_real(value, name, op_name)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op_name}: {name} must be finite and > 0, got {value!r}")
    return scale


def _reciprocal(scale):
    """cupyrope's divisor for FlashInfer's multiplier (a device tensor stays on the device: no
    synchronisation, and a captured CUDA graph reads its current value).

    FlashInfer stores fp8(value * quant_scale), cupyrope fp8(value / scale) (vLLM's convention):
    the two agree up to the float32 rounding of the reciprocal (exactly for powers of two)."""
    return torch.reciprocal(scale) if isinstance(scale, torch.Tensor) else 1.0 / scale


def _out(out, like, name: str, dtype, mla_k: bool, op_name: str = WHERE):
    """A ``*_out`` buffer checked against its input, as ``(nnz, heads, dim)`` (or None)."""
    if out is None:
        return None
    require_tensor(out, name, op_name)
    out3 = out.unsqueeze(-2) if mla_k and out.dim() == 2 else out
    if tuple(out3.shape) != tuple(like.shape):
        raise ValueError(f"{op_name}: {name} must have its input's shape "
                         f"{tuple(like.shape[::2] if mla_k else like.shape)}, got "
                         f"{tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{op_name}: {name} must have quantize_dtype {dtype}, got {out.dtype}")
    if out.device != like.device:
        raise ValueError(f"{op_name}: {name} is on {out.device} but the inputs are on "
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
# rope_quantize_fp8 with the paged KV-cache append, and FlashInfer's page-table helpers

PAGED = "rope_quantize_fp8_append_paged_kv_cache"
KV_LAYOUTS = ("NHD", "HND")


def rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache,
                                            pos_ids, paged_kv_cache, kv_indices, kv_indptr,
                                            batch_indices, positions, is_neox=True,
                                            quantize_dtype=None, quant_scale_q=1.0,
                                            quant_scale_kv=1.0, page_size=16, kv_layout="NHD",
                                            q_rope_out=None, q_nope_out=None, enable_pdl=False):
    """FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache``: RoPE on the rope part of q and
    k, fp8 of q (returned) and of k and v (appended to FlashInfer's paged cache). GQA / MHA take
    3-d k parts; MLA a 2-d k_rope (see below).

    Parameters
    ----------
    q_rope : tensor ``(nnz, num_qo_heads, rope_dim)``, float16 or bfloat16 (float32 works too)
    k_rope : tensor ``(nnz, num_kv_heads, rope_dim)``
    q_nope, k_nope : tensors ``(nnz, heads, no_rope_dim)``, or None (``no_rope_dim`` 0)
    v : tensor ``(nnz, num_kv_heads, rope_dim + no_rope_dim)``
    cos_sin_cache : tensor ``(max_seq_len, rope_dim)``, cos then sin per row
    pos_ids : int32 / int64 tensor ``(nnz,)``, the rotation's positions
    paged_kv_cache : tuple ``(k_cache, v_cache)``
        ``(max_pages, page_size, num_kv_heads, head_dim)`` (``kv_layout="NHD"``) or
        ``(max_pages, num_kv_heads, page_size, head_dim)`` (``"HND"``), ``head_dim = rope_dim +
        no_rope_dim``, of ``quantize_dtype``; any strides with a unit last dim. A k head is
        stored rope part first.
    kv_indices : int tensor ``(total_pages,)``, the page of each entry of the page table
    kv_indptr : int tensor ``(batch_size + 1,)``, request ``b``'s pages are
        ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``
    batch_indices, positions : int tensors ``(nnz,)``
        Token ``t`` belongs to request ``batch_indices[t]`` (negative: padding, not written) at
        position ``positions[t]`` in its sequence (:func:`get_batch_indices_positions`).
    is_neox, quantize_dtype, quant_scale_q, quant_scale_kv, q_rope_out, q_nope_out, enable_pdl
        As in :func:`rope_quantize_fp8`; ``quant_scale_kv`` scales k and v
        (stored = fp8(value * scale), saturated).
    page_size : int
        The cache's page size (FlashInfer's default 16); must match the caches' shape.
    kv_layout : {"NHD", "HND"}

    Returns
    -------
    (q_rope_out, q_nope_out)
        fp8 tensors shaped like q_rope and q_nope (size 0 for a None q_nope). k and v go to the
        caches only.

    Notes
    -----
    Token ``t`` goes to entry ``e = kv_indptr[b] * page_size + positions[t]`` of request
    ``b = batch_indices[t]``'s pages: page ``kv_indices[e // page_size]``, row
    ``e % page_size``, FlashInfer's rule. That page table is turned into cupyrope's slot
    mapping (slot = page * page_size + row) on the device: about twenty small integer kernels
    on ``nnz`` elements, no host read, so the call stays CUDA-graph capturable. A token whose
    entry falls outside ``kv_indices`` (FlashInfer would read past it) or whose slot falls
    outside the caches is not written.

    Then one launch of :func:`cupyrope.rope_and_cache` rotates, quantises and writes
    everything when each rope part is followed by its nope part in memory (the slices
    ``x[..., :rope_dim]`` and ``x[..., rope_dim:]`` of one tensor) or there is no nope part;
    separate rope and nope tensors take a second launch for the nope parts, through the exact
    identity rotation (``x * 1 - y * 0``: equal for finite values; an inf in dim 0 or 1 of a
    nope head makes the other NaN). Each launch also writes an fp8 k output that is dropped.
    Given ``*_out`` buffers are filled by an fp8 copy of the result.

    MLA: ``k_rope (nnz, rope_dim)``, ``k_nope (nnz, kv_lora_rank)`` (or None), ``v`` None and
    ``paged_kv_cache = (ckv_cache (max_pages, page_size, kv_lora_rank), kpe_cache (max_pages,
    page_size, rope_dim))`` of ``quantize_dtype``; ``kv_layout`` is ignored. k_nope goes to
    ckv_cache and the rotated k_rope to kpe_cache, both as fp8(value * quant_scale_kv), in the
    slot of the same page-table rule: one launch of :func:`cupyrope.mla_rope_and_cache` (two
    caches), which also writes an fp8 k_rope output that is dropped.
    """
    op_name = PAGED
    check_bool(is_neox, "is_neox", op_name)
    check_bool(enable_pdl, "enable_pdl", op_name)
    if require_tensor(k_rope, "k_rope", op_name).dim() == 2:
        return _append_paged_mla(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids,
                                 paged_kv_cache, kv_indices, kv_indptr, batch_indices, positions,
                                 is_neox, quantize_dtype, quant_scale_q, quant_scale_kv,
                                 page_size, kv_layout, q_rope_out, q_nope_out)
    q_rope, k_rope, q_nope, k_nope = _inputs(q_rope, k_rope, q_nope, k_nope, False, op_name)
    nnz, _, rope_dim = q_rope.shape
    head_dim = rope_dim + q_nope.shape[2]
    if tuple(require_tensor(pos_ids, "pos_ids", op_name).shape) != (nnz,):
        raise ValueError(f"{op_name}: pos_ids must have shape ({nnz},) (one per token), got "
                         f"{tuple(pos_ids.shape)}")
    if require_tensor(v, "v", op_name).shape != (nnz, k_rope.shape[1], head_dim):
        raise ValueError(f"{op_name}: v must be (nnz, num_kv_heads, rope_dim + no_rope_dim) = "
                         f"{(nnz, k_rope.shape[1], head_dim)}, got {tuple(v.shape)}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"{op_name}: kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    page_size = count(page_size, "page_size", op_name, minimum=1)
    dtype = _quantize_dtype(quantize_dtype, (q_rope_out, q_nope_out), op_name)
    k_cache, v_cache = _paged_caches(paged_kv_cache, dtype, page_size, kv_layout, op_name)
    scale_q = _scale(quant_scale_q, "quant_scale_q", op_name)
    scale_kv = _scale(quant_scale_kv, "quant_scale_kv", op_name)
    outs = [_out(out, like, name, dtype, False, op_name)
            for out, like, name in ((q_rope_out, q_rope, "q_rope_out"),
                                    (q_nope_out, q_nope, "q_nope_out"))]
    no_rope_dim = q_nope.shape[2]
    q_joined, k_joined = _joined(q_rope, q_nope), _joined(k_rope, k_nope)
    one_launch = no_rope_dim == 0 or (q_joined is not None and k_joined is not None)
    if not one_launch and no_rope_dim < 2:
        raise ValueError(
            f"{op_name}: a no_rope_dim of {no_rope_dim} in tensors apart from the rope part is "
            "not supported: pass each rope part and its nope part as the slices "
            "x[..., :rope_dim] and x[..., rope_dim:] of one tensor")
    slots = _paged_slots(kv_indices, kv_indptr, batch_indices, positions, page_size, nnz,
                        q_rope.device, op_name)

    fused = dict(layout=kv_layout, out_dtype=dtype, q_scale=_reciprocal(scale_q),
                 k_scale=_reciprocal(scale_kv), v_scale=_reciprocal(scale_kv), inplace=False)
    rope = dict(cos_sin_cache=cos_sin_cache, interleaved=not is_neox, rotary_dim=rope_dim)
    if one_launch:
        q, k = (q_rope, k_rope) if no_rope_dim == 0 else (q_joined, k_joined)
        q8 = rope_and_cache(q, k, v, pos_ids, k_cache, v_cache, slots, **rope, **fused)[0]
        results = [q8[..., :rope_dim], q8[..., rope_dim:]]
    else:  # separate rope and nope tensors: the nope parts take a launch of their own
        q8_rope = rope_and_cache(q_rope, k_rope, v[..., :rope_dim], pos_ids,
                                 k_cache[..., :rope_dim], v_cache[..., :rope_dim], slots,
                                 **rope, **fused)[0]
        table, position = identity_rotation(q_rope)
        q8_nope = rope_and_cache(q_nope, k_nope, v[..., rope_dim:], position,
                                 k_cache[..., rope_dim:], v_cache[..., rope_dim:], slots,
                                 cos_sin_cache=table, rotary_dim=2, **fused)[0]
        results = [q8_rope, q8_nope]
    _store([results[0], None, results[1], None], [outs[0], None, outs[1], None])
    return tuple(out if out is not None else result
                 for out, result in zip((q_rope_out, q_nope_out), results))


def _append_paged_mla(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids,
                      paged_kv_cache, kv_indices, kv_indptr, batch_indices, positions, is_neox,
                      quantize_dtype, quant_scale_q, quant_scale_kv, page_size, kv_layout,
                      q_rope_out, q_nope_out):
    """The MLA form of :func:`rope_quantize_fp8_append_paged_kv_cache` (2-d k_rope), checked
    here, then one cupyrope launch."""
    op_name = PAGED
    if v is not None:
        raise ValueError(f"{op_name}: MLA (2-d k_rope) takes no v: k_nope is the latent kept "
                         "in ckv_cache; pass v=None")
    q_rope, k_rope, q_nope, k_nope = _inputs(q_rope, k_rope, q_nope, k_nope, True, op_name)
    nnz, _, rope_dim = q_rope.shape
    rank = k_nope.shape[2]
    if tuple(require_tensor(pos_ids, "pos_ids", op_name).shape) != (nnz,):
        raise ValueError(f"{op_name}: pos_ids must have shape ({nnz},) (one per token), got "
                         f"{tuple(pos_ids.shape)}")
    if kv_layout not in KV_LAYOUTS:  # ignored for MLA, but still one of FlashInfer's names
        raise ValueError(f"{op_name}: kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    page_size = count(page_size, "page_size", op_name, minimum=1)
    dtype = _quantize_dtype(quantize_dtype, (q_rope_out, q_nope_out), op_name)
    if (not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2
            or not all(isinstance(c, torch.Tensor) for c in paged_kv_cache)):
        raise TypeError(f"{op_name}: paged_kv_cache must be a tuple (ckv_cache, kpe_cache) of "
                        f"two tensors for MLA, got {type(paged_kv_cache).__name__}")
    ckv_cache, kpe_cache = paged_kv_cache
    for cache, name, dim, what in ((ckv_cache, "ckv_cache", rank, "kv_lora_rank"),
                                   (kpe_cache, "kpe_cache", rope_dim, "rope_dim")):
        if cache.dtype != dtype:
            raise TypeError(f"{op_name}: {name} must have quantize_dtype {dtype}, got "
                            f"{cache.dtype}")
        if cache.dim() != 3 or cache.shape[1:] != (page_size, dim):
            raise ValueError(f"{op_name}: {name} must be (max_pages, page_size={page_size}, "
                             f"{what}={dim}), got shape {tuple(cache.shape)}")
    if ckv_cache.shape[0] != kpe_cache.shape[0]:
        raise ValueError(f"{op_name}: ckv_cache and kpe_cache must have the same pages, got "
                         f"{ckv_cache.shape[0]} and {kpe_cache.shape[0]}")
    scale_q = _scale(quant_scale_q, "quant_scale_q", op_name)
    scale_kv = _scale(quant_scale_kv, "quant_scale_kv", op_name)
    outs = [_out(out, like, name, dtype, False, op_name)
            for out, like, name in ((q_rope_out, q_rope, "q_rope_out"),
                                    (q_nope_out, q_nope, "q_nope_out"))]
    slots = _paged_slots(kv_indices, kv_indptr, batch_indices, positions, page_size, nnz,
                         q_rope.device, op_name)
    (q8_nope, q8_rope), _, _ = mla_rope_and_cache(
        (q_nope, q_rope), k_rope, k_nope[:, 0], pos_ids, ckv_cache, slots,
        cos_sin_cache=cos_sin_cache, interleaved=not is_neox, out_dtype=dtype,
        q_scale=_reciprocal(scale_q), k_scale=_reciprocal(scale_kv),
        kv_scale=_reciprocal(scale_kv), kpe_cache=kpe_cache)
    results = [q8_rope, q8_nope]
    _store([results[0], None, results[1], None], [outs[0], None, outs[1], None])
    return tuple(out if out is not None else result
                 for out, result in zip((q_rope_out, q_nope_out), results))


def _paged_caches(paged_kv_cache, dtype, page_size: int, layout: str, op_name: str):
    """``(k_cache, v_cache)`` checked: two 4-d tensors of ``dtype`` whose page dim (by
    ``layout``) is ``page_size``; the rest (heads, head_dim, strides) cupyrope checks."""
    if (not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2
            or not all(isinstance(c, torch.Tensor) for c in paged_kv_cache)):
        raise TypeError(f"{op_name}: paged_kv_cache must be a tuple (k_cache, v_cache) of two "
                        f"tensors, got {type(paged_kv_cache).__name__}")
    for cache, name in zip(paged_kv_cache, ("k_cache", "v_cache")):
        if cache.dtype != dtype:
            raise TypeError(f"{op_name}: {name} must have quantize_dtype {dtype}, got "
                            f"{cache.dtype}")
        if cache.dim() != 4:
            raise ValueError(f"{op_name}: {name} must be 4-d (max_pages, page_size, num_kv_heads, "
                             f"head_dim) for NHD or (max_pages, num_kv_heads, page_size, "
                             f"head_dim) for HND, got shape {tuple(cache.shape)}")
        pages = cache.shape[1] if layout == "NHD" else cache.shape[2]
        if pages != page_size:
            raise ValueError(f"{op_name}: {name} of shape {tuple(cache.shape)} has pages of "
                             f"{pages} entries in layout {layout}, but page_size={page_size}")
    return paged_kv_cache


def _paged_slots(kv_indices, kv_indptr, batch_indices, positions, page_size: int, nnz: int,
                device, op_name: str):
    """cupyrope's slot of each token (``page * page_size + row``, -1 where nothing is written)
    from FlashInfer's page table, computed with torch integer ops on ``device`` (no host
    read)."""
    for x, name, size in ((kv_indices, "kv_indices", None), (kv_indptr, "kv_indptr", None),
                          (batch_indices, "batch_indices", nnz), (positions, "positions", nnz)):
        if require_tensor(x, name, op_name).dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op_name}: {name} must be int32 or int64, got {x.dtype}")
        if x.dim() != 1 or (size is not None and x.shape[0] != size):
            expected = f"({size},) (one per token)" if size is not None else "1-d"
            raise ValueError(f"{op_name}: {name} must have shape {expected}, got "
                             f"{tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{op_name}: {name} is on {x.device} but q_rope is on {device}")
    num_requests, num_pages = kv_indptr.shape[0] - 1, kv_indices.shape[0]
    if num_requests < 1 or num_pages < 1:  # no page to write: every token is skipped
        return torch.full((nnz,), -1, dtype=torch.int64, device=device)
    request = batch_indices.long()
    position = positions.long()
    page_iter = (kv_indptr.long()[request.clamp(0, num_requests - 1)]
                 + position.div(page_size, rounding_mode="floor"))
    written = ((request >= 0) & (request < num_requests) & (position >= 0)
               & (page_iter >= 0) & (page_iter < num_pages))
    page = kv_indices.long()[page_iter.clamp(0, num_pages - 1)]
    slot = page * page_size + position.remainder(page_size)
    return torch.where(written, slot, -1)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size):
    """FlashInfer's ``get_seq_lens``: the KV length of each request from its page count and the
    entries of its last page, ``max(pages - 1, 0) * page_size + kv_last_page_len``.

    Parameters
    ----------
    kv_indptr : int tensor ``(batch_size + 1,)``
    kv_last_page_len : int tensor ``(batch_size,)``
    page_size : int

    Returns an int tensor ``(batch_size,)`` on kv_indptr's device (torch ops, no host read).
    """
    op_name = "get_seq_lens"
    page_size = count(page_size, "page_size", op_name, minimum=1)
    if require_tensor(kv_indptr, "kv_indptr", op_name).dim() != 1 or kv_indptr.shape[0] < 1:
        raise ValueError(f"{op_name}: kv_indptr must be 1-d (batch_size + 1,), got shape "
                         f"{tuple(kv_indptr.shape)}")
    if tuple(require_tensor(kv_last_page_len, "kv_last_page_len", op_name).shape) != (
            kv_indptr.shape[0] - 1,):
        raise ValueError(f"{op_name}: kv_last_page_len must have shape "
                         f"({kv_indptr.shape[0] - 1},) (batch_size), got "
                         f"{tuple(kv_last_page_len.shape)}")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    return torch.clamp(pages - 1, min=0) * page_size + kv_last_page_len


def get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices=None,
                                positions=None):
    """FlashInfer's ``get_batch_indices_positions``: the request and the sequence position of
    each appended token. Request ``b`` appends tokens ``append_indptr[b]:append_indptr[b + 1]``,
    the last ``append_indptr[b + 1] - append_indptr[b]`` positions of its ``seq_lens[b]``.

    Parameters
    ----------
    append_indptr : int tensor ``(batch_size + 1,)``
    seq_lens : int tensor ``(batch_size,)`` (:func:`get_seq_lens`)
    nnz : int
        Tokens in the ragged batch; those past ``append_indptr[-1]`` get batch index -1 and
        position 0 (padding).
    batch_indices, positions : int32 tensors ``(nnz,)``, optional
        Written and returned when given.

    Returns
    -------
    (batch_indices, positions)
        int32 tensors ``(nnz,)`` on append_indptr's device, computed with torch ops (no host
        read).
    """
    op_name = "get_batch_indices_positions"
    nnz = count(nnz, "nnz", op_name, minimum=0)
    if require_tensor(append_indptr, "append_indptr", op_name).dim() != 1 or (
            append_indptr.shape[0] < 1):
        raise ValueError(f"{op_name}: append_indptr must be 1-d (batch_size + 1,), got shape "
                         f"{tuple(append_indptr.shape)}")
    batch_size = append_indptr.shape[0] - 1
    if tuple(require_tensor(seq_lens, "seq_lens", op_name).shape) != (batch_size,):
        raise ValueError(f"{op_name}: seq_lens must have shape ({batch_size},) (batch_size), got "
                         f"{tuple(seq_lens.shape)}")
    device = append_indptr.device
    for out, name in ((batch_indices, "batch_indices"), (positions, "positions")):
        if out is not None and (require_tensor(out, name, op_name).shape != (nnz,)
                                or out.dtype != torch.int32 or out.device != device):
            raise ValueError(f"{op_name}: {name} must be an int32 tensor of shape ({nnz},) on "
                             f"{device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    ends = append_indptr[1:].long()
    token = torch.arange(nnz, device=device)
    request = torch.searchsorted(ends, token, right=True)  # the first request ending past it
    inside = request < batch_size
    at = request.clamp(max=max(batch_size - 1, 0))
    if batch_size:
        position = token + seq_lens.to(device).long()[at] - ends[at]
    else:
        position = torch.zeros_like(token)
    found = (torch.where(inside, request, -1).int(), torch.where(inside, position, 0).int())
    results = []
    for out, value in zip((batch_indices, positions), found):
        if out is None:
            results.append(value)
        else:
            out.copy_(value)
            results.append(out)
    return tuple(results)


# ----------------------------------------------------------------------------------------------
# fused_qk_rmsnorm_rope: QK-RMSNorm over all heads and 3D (frame, height, width) RoPE

NORM_ROPE = "fused_qk_rmsnorm_rope"
# What FlashInfer's kernel takes (its Python checks raise ValueError for anything else).
VIDEO_HEAD_DIMS = (64, 128, 256)
VIDEO_MAX_HEADS = 32
VIDEO_ELSEWHERE = ("normalise q and k each as one head of H * head_dim with "
                   "cupyrope.rms_norm_rope, then rotate them with cupyrope.apply_rope (M-RoPE "
                   "scaling), which take any device, dtype, head_dim, head count and strides")


@torch.no_grad()
def fused_qk_rmsnorm_rope(qkv, q_weight, k_weight, *, ppf, pph, ppw, num_frame_channels,
                          num_height_channels, num_width_channels, num_heads_q, num_heads_k,
                          num_heads_v, head_dim, eps=1e-6, base=10000.0, interleave=True,
                          factor=1.0, low=0.0, high=0.0, attention_factor=1.0, is_qk_norm=True,
                          output_fp8=False, output_quant_scale=1.0, v_quant_scale=1.0,
                          q_out=None, k_out=None, v_out=None):
    """FlashInfer's ``fused_qk_rmsnorm_rope`` (video DiT self-attention): RMSNorm of q and of k
    over all their heads, then 3D RoPE, and v copied out; optionally all three in fp8.

    Parameters
    ----------
    qkv : tensor ``[batch, seq_len, (Hq + Hk + Hv) * head_dim]`` or ``[num_tokens, ...]``
        bfloat16, contiguous, on a CUDA device (FlashInfer's limits), q heads then k heads then
        v heads. A 2-d qkv holds ``num_tokens // seq_len`` sequences one after the other. Never
        written.
    q_weight, k_weight : bfloat16 contiguous tensors of ``num_heads_q * head_dim`` /
        ``num_heads_k * head_dim`` elements: the norm weights over the whole q / k projection
        (one per element).
    ppf, pph, ppw : int
        Patches in frame, height and width: ``seq_len = ppf * pph * ppw``, token ``s`` of a
        sequence at frame ``s // (pph * ppw)``, row ``s // ppw % pph``, column ``s % ppw``.
    num_frame_channels, num_height_channels, num_width_channels : int
        Even, adding up to head_dim: rotary pair ``j`` (dims ``2j, 2j + 1`` interleaved, ``j,
        j + head_dim / 2`` NeoX) turns by the frame position when ``2j < num_frame_channels``,
        by the height position when below ``num_frame_channels + num_height_channels``, else by
        the width position, at frequency ``base ** (-2i / C)``, ``i`` its index within its group
        of ``C`` channels.
    num_heads_q, num_heads_k, num_heads_v, head_dim : int
        head_dim 64, 128 or 256 and at most 32 heads in each part (FlashInfer's limits).
    eps : float
        ``x * rsqrt(mean(x**2) + eps) * weight``, the mean over all heads of q (of k).
    base : float
    interleave : bool
        True (FlashInfer's default): GPT-J pairing; False: NeoX.
    factor, low, high, attention_factor : float
        YaRN: with ``factor != 1`` frequency ``f`` of index ``i`` becomes
        ``f / factor * r + f * (1 - r)``, ``r = clip((i - low) / (high - low), 0, 1)`` (``high``
        moved by 0.001 when equal to ``low``), and the rotated values are multiplied by
        ``attention_factor`` (which must be 1 when ``factor`` is 1, as FlashInfer requires).
    is_qk_norm : bool
        False: RoPE only.
    output_fp8 : bool
        q, k and v outputs as float8_e4m3fn: ``fp8(value * output_quant_scale)`` for q and k,
        ``fp8(v * v_quant_scale)``, saturated.
    q_out, k_out, v_out : tensors, optional
        Contiguous ``[batch, seq_len, H, head_dim]`` (3-d qkv) or ``[num_tokens, H, head_dim]``,
        bfloat16 (float8_e4m3fn with ``output_fp8``); written and returned.

    Returns
    -------
    (q_out, k_out, v_out)
        Never requiring grad: as FlashInfer's kernel, the call is not differentiable and runs
        under ``torch.no_grad()`` (weights that require grad, e.g. ``nn.RMSNorm``'s, are read).

    Raises
    ------
    ValueError
        Where FlashInfer's checks raise, before anything is launched: bad sizes, and inputs
        its kernel does not take (CPU tensors, another dtype, another head_dim, more than 32
        heads, non-contiguous tensors); the message says what to call instead.

    Notes
    -----
    One cupyrope launch for q and k where FlashInfer's kernel takes one for q, k and v:
    :func:`cupyrope.rms_norm_rope` with ``norm_over="all_heads"`` normalises all heads of q
    (of k) together in float32 and turns them by the 3D RoPE as M-RoPE (``mrope_section`` of
    the three groups' pairs) from a ``[max(ppf, pph, ppw), head_dim]`` float32 table made in
    float64, at ``[3, seq_len]`` positions, rounded once into q_out and k_out (bfloat16, or fp8
    with the reciprocal of ``output_quant_scale`` as cupyrope's scale); v is copied
    (``Tensor.copy_``, or an fp8 quantisation of its own). Without the norm, one
    :func:`cupyrope.apply_rope`. The table and positions are made once per device and
    arguments and kept; a first call inside a CUDA graph capture raises (call once before
    capturing). Angles come from float64 (FlashInfer: float32 frequencies and fast-math
    sincos).
    """
    op_name = NORM_ROPE
    sizes = {name: count(value, name, op_name, minimum=minimum)
             for name, value, minimum in (
                 ("ppf", ppf, 1), ("pph", pph, 1), ("ppw", ppw, 1),
                 ("num_frame_channels", num_frame_channels, 0),
                 ("num_height_channels", num_height_channels, 0),
                 ("num_width_channels", num_width_channels, 0),
                 ("num_heads_q", num_heads_q, 1), ("num_heads_k", num_heads_k, 1),
                 ("num_heads_v", num_heads_v, 0), ("head_dim", head_dim, 2))}
    channels = [sizes[f"num_{part}_channels"] for part in ("frame", "height", "width")]
    head_dim, seq_len = sizes["head_dim"], sizes["ppf"] * sizes["pph"] * sizes["ppw"]
    if any(c % 2 for c in channels) or sum(channels) != head_dim:
        raise ValueError(f"{op_name}: num_frame_channels, num_height_channels and "
                         f"num_width_channels must be even and add up to head_dim ({head_dim}), "
                         f"got {channels}")
    for flag, name in ((interleave, "interleave"), (is_qk_norm, "is_qk_norm"),
                       (output_fp8, "output_fp8")):
        check_bool(flag, name, op_name)
    yarn = [check_real(value, name, op_name) for value, name in (
        (factor, "factor"), (low, "low"), (high, "high"), (attention_factor, "attention_factor"))]
    base = check_theta(base, op_name, "base")
    if yarn[0] == 1.0 and yarn[3] != 1.0:
        raise ValueError(f"{op_name}: attention_factor must be 1 when factor is 1 (YaRN off), got "
                         f"{attention_factor!r}")
    if not (math.isfinite(yarn[0]) and yarn[0] > 0):
        raise ValueError(f"{op_name}: factor must be finite and > 0, got {factor!r}")
    heads = [sizes["num_heads_q"], sizes["num_heads_k"], sizes["num_heads_v"]]
    q, k, v = _video_qkv(qkv, heads, head_dim, seq_len, op_name)
    weights = []
    for weight, name, h in ((q_weight, "q_weight", heads[0]), (k_weight, "k_weight", heads[1])):
        if require_tensor(weight, name, op_name).numel() != h * head_dim:
            raise ValueError(f"{op_name}: {name} must have num_heads * head_dim = {h * head_dim} "
                             f"elements, got shape {tuple(weight.shape)}")
        weights.append(weight.reshape(h * head_dim))
    out_dtype = torch.float8_e4m3fn if output_fp8 else qkv.dtype
    outs = []
    for out, like, name in ((q_out, q, "q_out"), (k_out, k, "k_out"), (v_out, v, "v_out")):
        shape = tuple(like.shape) if qkv.dim() == 3 else (like.shape[0] * like.shape[1],
                                                          *like.shape[2:])
        if out is not None and (require_tensor(out, name, op_name).shape != shape
                                or out.dtype != out_dtype or out.device != qkv.device):
            raise ValueError(f"{op_name}: {name} must be a {out_dtype} tensor of shape {shape} "
                             f"on {qkv.device}, got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}")
        outs.append(None if out is None else out.view(like.shape))
    scales = [_scale(value, name, op_name) for value, name in (
        (output_quant_scale, "output_quant_scale"), (v_quant_scale, "v_quant_scale"))]
    _refuse_beyond_flashinfer(qkv, (q_weight, k_weight), (q_out, k_out, v_out), head_dim, heads,
                              op_name)
    table, positions = _video_rope_table(qkv, head_dim, channels, base, yarn,
                                         (sizes["ppf"], sizes["pph"], sizes["ppw"]), op_name)
    rope = dict(cos_sin_cache=table, scaling={"mrope_section": [c // 2 for c in channels]},
                interleaved=interleave)

    fp8 = {}
    if output_fp8:
        scale = _reciprocal(scales[0])
        fp8 = dict(out_dtype=out_dtype, q_scale=scale, k_scale=scale)
    if is_qk_norm:  # the norm over all heads and the rotation: one launch, into q_out / k_out
        targets = None
        if outs[0] is not None or outs[1] is not None:
            targets = tuple(out if out is not None else torch.empty(like.shape, dtype=out_dtype,
                                                                    device=qkv.device)
                            for out, like in zip(outs[:2], (q, k)))
        results = list(rms_norm_rope(q, k, *weights, positions, eps=eps, norm_over="all_heads",
                                     out=targets, **fp8, **rope))
    elif output_fp8:
        results = list(cupyrope_apply_rope(q, k, positions, **fp8, **rope))
        for out, result in zip(outs[:2], results):
            if out is not None:  # the rotation cannot write fp8 into given tensors
                out.copy_(result)
    else:
        results = [out if out is not None else torch.empty(like.shape, dtype=out_dtype,
                                                           device=qkv.device)
                   for out, like in zip(outs[:2], (q, k))]
        cupyrope_apply_rope(q, k, positions, out=(results[0], results[1]), **rope)
    if output_fp8:
        results.append(_fp8_copy(v, _reciprocal(scales[1]), out_dtype))
        if outs[2] is not None:
            outs[2].copy_(results[2])
    else:
        results.append(outs[2] if outs[2] is not None else torch.empty(
            v.shape, dtype=out_dtype, device=qkv.device))
        results[2].copy_(v)
    given = (q_out, k_out, v_out)
    return tuple(out if out is not None else result.view(_video_out_shape(result, qkv))
                 for out, result in zip(given, results))


def _refuse_beyond_flashinfer(qkv, weights, outs, head_dim: int, heads, op_name: str) -> None:
    """ValueError, as FlashInfer's checks raise it, for what its kernel does not take (the
    sizes and shapes are checked already): a device other than CUDA, a dtype other than
    bfloat16, head_dim outside 64 / 128 / 256, more than 32 heads in a part, non-contiguous
    tensors. Each message names the cupyrope calls that take it."""
    if head_dim not in VIDEO_HEAD_DIMS:
        raise ValueError(f"{op_name}: head_dim must be 64, 128, or 256, got {head_dim}; for "
                         f"another head_dim, {VIDEO_ELSEWHERE}")
    if max(heads) > VIDEO_MAX_HEADS:
        raise ValueError(f"{op_name}: max(num_heads_q, num_heads_k, num_heads_v) must be <= "
                         f"{VIDEO_MAX_HEADS}, got {max(heads)}; for more heads, "
                         f"{VIDEO_ELSEWHERE}")
    if qkv.dtype != torch.bfloat16:
        raise ValueError(f"{op_name}: qkv must be bfloat16, got {qkv.dtype}; for another dtype, "
                         f"{VIDEO_ELSEWHERE}")
    if any(w.dtype != torch.bfloat16 for w in weights):
        raise ValueError(f"{op_name}: q_weight and k_weight must be bfloat16, got "
                         f"{weights[0].dtype} and {weights[1].dtype}; for other dtypes, "
                         f"{VIDEO_ELSEWHERE}")
    named = [("qkv", qkv), ("q_weight", weights[0]), ("k_weight", weights[1]),
             *((name, out) for name, out in zip(("q_out", "k_out", "v_out"), outs)
               if out is not None)]
    for name, x in named:
        if not x.is_contiguous():
            raise ValueError(f"{op_name}: {name} must be contiguous, got strides "
                             f"{tuple(x.stride())}; for strided views, {VIDEO_ELSEWHERE}")
    if qkv.device.type != "cuda":
        raise ValueError(f"{op_name}: qkv must be a CUDA tensor, got one on {qkv.device}; on "
                         f"that device, {VIDEO_ELSEWHERE}")


def _video_out_shape(result, qkv) -> tuple:
    """The shape FlashInfer returns: ``[batch, seq_len, H, D]`` for 3-d qkv, else
    ``[num_tokens, H, D]``."""
    return tuple(result.shape) if qkv.dim() == 3 else (-1, *result.shape[2:])


def _video_qkv(qkv, heads, head_dim: int, seq_len: int, op_name: str):
    """q, k and v of a ``[batch, seq_len, hidden]`` (or ``[num_tokens, hidden]``) qkv as
    ``[batch, seq_len, H, head_dim]`` views."""
    if require_tensor(qkv, "qkv", op_name).dim() not in (2, 3):
        raise ValueError(f"{op_name}: qkv must be 2-d [num_tokens, hidden] or 3-d [batch, "
                         f"seq_len, hidden], got shape {tuple(qkv.shape)}")
    width = sum(heads) * head_dim
    if qkv.shape[-1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"{op_name}: qkv's last dim must be (num_heads_q + num_heads_k + "
                         f"num_heads_v) * head_dim = {width} with stride 1, got shape "
                         f"{tuple(qkv.shape)} and strides {tuple(qkv.stride())}")
    if qkv.dim() == 3 and qkv.shape[1] != seq_len:
        raise ValueError(f"{op_name}: qkv's seq_len {qkv.shape[1]} != ppf * pph * ppw = {seq_len}")
    if qkv.dim() == 2:
        if qkv.shape[0] % seq_len:
            raise ValueError(f"{op_name}: qkv's num_tokens {qkv.shape[0]} must be a multiple of "
                             f"ppf * pph * ppw = {seq_len}")
        qkv = qkv.unflatten(0, (qkv.shape[0] // seq_len, seq_len))
    ends = [0, heads[0] * head_dim, (heads[0] + heads[1]) * head_dim, width]
    return [qkv[..., lo:hi].unflatten(-1, (h, head_dim))
            for lo, hi, h in zip(ends[:-1], ends[1:], heads)]


def _video_frequencies(head_dim: int, channels, base: float, yarn) -> np.ndarray:
    """FlashInfer's frequency of each of the ``head_dim // 2`` pairs, in float64: each group of
    channels counts its own indices; YaRN blends in ``f / factor`` by index."""
    factor, low, high, _ = yarn
    if abs(low - high) <= 1e-6:
        high += 0.001
    groups = []
    for size in channels:
        index = np.arange(size // 2, dtype=np.float64)
        freq = base ** (-2.0 * index / size) if size else index
        if factor != 1.0:
            ramp = np.clip((index - low) / (high - low), 0.0, 1.0)
            freq = freq / factor * ramp + freq * (1.0 - ramp)
        groups.append(freq)
    return np.concatenate(groups)


def _video_rope_table(like, head_dim: int, channels, base: float, yarn, patches, op_name: str):
    """The ``[max(patches), head_dim]`` float32 cos/sin table (times attention_factor) and the
    ``[3, seq_len]`` int32 (frame, row, column) positions on ``like``'s device, made once per
    device and arguments."""
    key = (like.device, head_dim, tuple(channels), base, tuple(yarn), tuple(patches))
    found = _VIDEO_TABLES.get(key)
    if found is not None:
        return found
    if like.device.type == "cuda":
        with torch.cuda.device(like.device):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{op_name}: the first call with these sizes uploads a frequency table, which "
                    "a CUDA graph capture cannot do: call it once before capturing")
    ppf, pph, ppw = patches
    angles = np.outer(np.arange(max(patches), dtype=np.float64),
                      _video_frequencies(head_dim, channels, base, yarn))
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1) * yarn[3]
    token = np.arange(ppf * pph * ppw)
    positions = np.stack([token // (pph * ppw), token // ppw % pph, token % ppw])
    found = (torch.from_numpy(table.astype(np.float32)).to(like.device),
             torch.from_numpy(positions.astype(np.int32)).to(like.device))
    if len(_VIDEO_TABLES) >= 64:
        _VIDEO_TABLES.clear()
    _VIDEO_TABLES[key] = found
    return found


_VIDEO_TABLES: dict = {}


def _fp8_copy(x, divisor, dtype):
    """``fp8(x / divisor)``, saturated, through one cupyrope launch of the identity rotation."""
    identity, zero = identity_rotation(x)
    return cupyrope_apply_rope(x, positions=zero, cos_sin_cache=identity, rotary_dim=2,
                               out_dtype=dtype, q_scale=divisor)


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
