"""TransformerEngine: ``apply_rotary_pos_emb(t, freqs, tensor_format, ...)`` and
``apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list, ...)``."""

from __future__ import annotations

import torch

from ..api import apply_rope
from ..core.validators import is_integer
from ..positions import TE_FORMATS, load_balanced_positions


def te_apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None,
                            interleaved=False, fused=False, cu_seqlens=None, cp_size=1,
                            cp_rank=0):
    """TransformerEngine's ``apply_rotary_pos_emb``, through one cupyrope launch (out of place).

    Parameters
    ----------
    t : tensor ``[s, b, h, d]`` (``"sbhd"``), ``[b, s, h, d]`` (``"bshd"``) or ``[t, h, d]``
        (``"thd"``, packed sequences); any strides, the last dim's included (a non-unit one
        takes the general scalar path).
    freqs : float tensor ``[s2, 1, 1, d2]``
        Angles, as TransformerEngine's ``RotaryPositionEmbedding`` makes them: each pair's angle
        repeated (``cat(f, f)`` for NeoX, pairwise for interleaved). ``d2 <= d``; dims past ``d2``
        pass through. Row ``p`` rotates the tokens at position ``p``.
    tensor_format : {"sbhd", "bshd", "thd"}
    start_positions : int tensor ``[b]``, optional
        Per-sequence position offsets: token ``i`` of sequence ``b`` takes row
        ``start_positions[b] + p(i)``, ``p(i)`` its position in the whole sequence (with
        ``cp_size > 1``, the load-balanced position below), as TransformerEngine's kernel does.
    interleaved : bool
    fused : bool
        Ignored: this is always one fused kernel.
    cu_seqlens : int tensor ``[b + 1]``, required for ``"thd"``
        With ``cp_size > 1``, the cumulative lengths of the whole (padded) sequences.
    cp_size, cp_rank : int
        Context parallelism (each sequence in ``2 * cp_size`` chunks, rank ``r`` holding chunks
        ``r`` and ``2 * cp_size - 1 - r``): every local sequence length must be even.

    Returns a new tensor shaped like ``t`` (contiguous). cos / sin are taken in float32 of the
    float32 angles (TransformerEngine's fused kernel does the same); positions are computed on
    t's device without synchronising, so the call is CUDA-graph capturable. Positions past the
    end of ``freqs`` give NaN (TransformerEngine asserts instead). ``freqs`` gets no gradient.
    """
    del fused
    op_name = "apply_rotary_pos_emb"
    if tensor_format not in TE_FORMATS:
        raise ValueError(f"{op_name}: tensor_format must be one of {TE_FORMATS}, "
                         f"got {tensor_format!r}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError(f"{op_name}: cu_seqlens must not be None when tensor_format is 'thd'")
    _check_context_parallel(t, tensor_format, cp_size, cp_rank, op_name)
    cache = te_cos_sin_cache(freqs, interleaved=interleaved)
    positions = positions_on_device(t, tensor_format, cu_seqlens, start_positions, cp_size,
                                        cp_rank)
    return apply_rope(t, positions=positions, cos_sin_cache=cache, interleaved=interleaved)


def te_apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list,
                                      tensor_format="sbhd", start_positions=None,
                                      interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """TransformerEngine's ``apply_fused_qkv_rotary_pos_emb``: q and k of a fused QKV tensor
    rotated in one cupyrope launch (two where q and k take different angle tables), v copied.

    Parameters
    ----------
    qkv : tensor ``[s, b, h, q + k + v]`` (``"sbhd"``) or ``[b, s, h, q + k + v]`` (``"bshd"``)
        ``h`` groups, each its q heads, then its k heads, then one v head, along the last dim
        (widths ``qkv_split_arg_list``); any strides (the q and k heads are rotated where they lie,
        without a copy).
    q_freqs, k_freqs : float tensors ``[s2, 1, 1, d2]``
        TransformerEngine's angles (``RotaryPositionEmbedding``) for q and for k; ``d2 <= d``. The
        same tensor for both rotates q and k in one launch.
    qkv_split_arg_list : three ints ``[q, k, v]``
        Widths of q, k and v in each group; ``v`` is the head dim ``d``, ``q`` and ``k`` multiples
        of it and ``q`` a multiple of ``k``; they add up to qkv's last dim.
    tensor_format : {"sbhd", "bshd"}
    start_positions : int tensor ``[b]``, optional
        Per-sequence position offsets (inference); not with ``cp_size > 1`` (as in
        TransformerEngine).
    interleaved : bool
    cu_seqlens : ignored (as in TransformerEngine: ``"thd"`` is not supported here)
    cp_size, cp_rank : int
        Context parallelism, as in :func:`te_apply_rotary_pos_emb`.

    Returns
    -------
    (q, k, v) : new contiguous tensors of qkv's dtype and device, shaped as TransformerEngine's:
        q ``[s, b, h * q / k, k]``, k ``[s, b, h, k]``, v ``[s, b, h, v]`` (``b`` first for
        ``"bshd"``). Differentiable with respect to qkv; the angles get no gradient.
    """
    op_name = "apply_fused_qkv_rotary_pos_emb"
    del cu_seqlens
    if tensor_format == "thd":
        raise ValueError(
            f"{op_name}: tensor_format 'thd' is not supported (as in TransformerEngine); rotate "
            "q and k views of the packed qkv with te_apply_rotary_pos_emb(..., tensor_format="
            "'thd', cu_seqlens=...) instead")
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"{op_name}: tensor_format must be 'sbhd' or 'bshd', got {tensor_format!r}")
    if cp_size > 1 and start_positions is not None:
        raise ValueError(
            f"{op_name}: start_positions with cp_size > 1 is not supported (as in "
            "TransformerEngine); rotate q and k views of qkv with te_apply_rotary_pos_emb, "
            "which takes both")
    if qkv.dim() != 4:
        raise ValueError(f"{op_name}: qkv must be 4-d ({tensor_format}), got shape "
                         f"{tuple(qkv.shape)}")
    _check_context_parallel(qkv, tensor_format, cp_size, cp_rank, op_name)
    q_width, k_width, head_dim = _qkv_split(qkv_split_arg_list, qkv.shape[-1], op_name)
    q = qkv[..., :q_width].unflatten(-1, (q_width // head_dim, head_dim))
    k = qkv[..., q_width:q_width + k_width].unflatten(-1, (k_width // head_dim, head_dim))
    v = qkv[..., q_width + k_width:]
    # One position per (s, b) token, broadcast over the groups: the token dims of q and k are
    # [s, b, h] (each group's heads are the heads of the rotation).
    positions = positions_on_device(qkv, tensor_format, None, start_positions, cp_size,
                                    cp_rank)[..., None]
    q_cache = te_cos_sin_cache(q_freqs, interleaved=interleaved, op_name=op_name)
    if k_freqs is q_freqs:
        q_out, k_out = apply_rope(q, k, positions, cos_sin_cache=q_cache, interleaved=interleaved)
    else:
        # Two tables: two launches (telling equal tables apart would read them on the host).
        k_cache = te_cos_sin_cache(k_freqs, interleaved=interleaved, op_name=op_name)
        q_out = apply_rope(q, positions=positions, cos_sin_cache=q_cache, interleaved=interleaved)
        k_out = apply_rope(k, positions=positions, cos_sin_cache=k_cache, interleaved=interleaved)
    lead = tuple(qkv.shape[:2])
    groups = qkv.shape[2]
    return (q_out.reshape(*lead, groups * q_width // k_width, k_width),
            k_out.reshape(*lead, groups, k_width),
            v.clone(memory_format=torch.contiguous_format))


def _qkv_split(split, width: int, op_name: str) -> tuple[int, int, int]:
    """(q, k, v) widths of a fused QKV group, checked as TransformerEngine lays them out."""
    if len(split) != 3 or any(not is_integer(n) or n <= 0 for n in split):
        raise ValueError(f"{op_name}: qkv_split_arg_list must be three positive ints [q, k, v], "
                         f"got {list(split)}")
    q_width, k_width, head_dim = (int(n) for n in split)
    if q_width + k_width + head_dim != width:
        raise ValueError(f"{op_name}: qkv_split_arg_list {list(split)} adds up to "
                         f"{q_width + k_width + head_dim}, but qkv's last dim is {width}")
    if q_width % head_dim or k_width % head_dim or q_width % k_width:
        raise ValueError(
            f"{op_name}: qkv_split_arg_list {list(split)} must give whole heads of d = {head_dim} "
            "(its v width) for q and k, and a q width that is a multiple of the k width (the "
            "shape TransformerEngine gives q)")
    return q_width, k_width, head_dim


def _check_context_parallel(t, tensor_format: str, cp_size, cp_rank, op_name: str) -> None:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"{op_name}: need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, "
                         f"cp_size={cp_size}")
    if cp_size > 1 and tensor_format != "thd":
        seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
        if seq % 2:
            raise ValueError(f"{op_name}: with cp_size > 1 the local sequence length must be even "
                             f"(two chunks per rank), got {seq}")


def te_cos_sin_cache(freqs, *, interleaved=False, op_name="apply_rotary_pos_emb"):
    """A ``[s2, d2]`` float32 cos/sin cache (vLLM layout) from TransformerEngine's ``[s2, 1, 1, d2]``
    angles: pair ``j``'s angle is ``freqs[p, j]`` (NeoX) or ``freqs[p, 2j]`` (interleaved).
    ``op_name`` prefixes the error message."""
    rows, width = freqs.shape[0], freqs.shape[-1]
    if freqs.numel() != rows * width or width % 2:
        raise ValueError(f"{op_name}: freqs must have shape [s2, 1, 1, d2] with d2 even, "
                         f"got {tuple(freqs.shape)}")
    angles = freqs.detach().reshape(rows, width).float()
    half = angles[:, ::2] if interleaved else angles[:, : width // 2]
    return torch.cat((half.cos(), half.sin()), dim=-1)


def positions_on_device(t, tensor_format, cu_seqlens, start_positions, cp_size, cp_rank):
    """:func:`cupyrope.positions.te_positions`, with torch ops on t's device (no host reads)."""
    device = t.device
    if tensor_format == "thd":
        bounds = cu_seqlens.to(device=device, dtype=torch.int64) // cp_size  # this rank's rows
        rows = torch.arange(t.shape[0], device=device)
        sequence = torch.searchsorted(bounds[1:], rows, right=True).clamp_(max=bounds.numel() - 2)
        first = bounds[sequence]
        local = rows - first
        if cp_size > 1:
            chunk = (bounds[sequence + 1] - first) // 2
            positions = load_balanced_positions(local, chunk, cp_size, cp_rank, torch.where)
        else:
            positions = local
        if start_positions is not None:
            positions = positions + start_positions.to(device=device, dtype=torch.int64)[sequence]
        return positions
    seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    rows = torch.arange(seq, device=device)
    if cp_size > 1:
        positions = load_balanced_positions(rows, seq // 2, cp_size, cp_rank, torch.where)
    else:
        positions = rows
    if start_positions is not None:
        starts = start_positions.to(device=device, dtype=torch.int64)
        positions = starts[:, None] + positions[None, :]  # [b, s]
        return positions.t() if tensor_format == "sbhd" else positions
    return positions[:, None] if tensor_format == "sbhd" else positions
