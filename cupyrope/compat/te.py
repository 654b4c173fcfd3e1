"""TransformerEngine: ``apply_rotary_pos_emb(t, freqs, tensor_format, ...)``."""

from __future__ import annotations

import torch

from ..api import apply_rope
from ..positions import TE_FORMATS, load_balanced_positions


def te_apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None,
                            interleaved=False, fused=False, cu_seqlens=None, cp_size=1,
                            cp_rank=0):
    """TransformerEngine's ``apply_rotary_pos_emb``, through one cupyrope launch (out of place).

    Parameters
    ----------
    t : tensor ``[s, b, h, d]`` (``"sbhd"``), ``[b, s, h, d]`` (``"bshd"``) or ``[t, h, d]``
        (``"thd"``, packed sequences); any strides but the last.
    freqs : float tensor ``[s2, 1, 1, d2]``
        Angles, as TransformerEngine's ``RotaryPositionEmbedding`` makes them: each pair's angle
        repeated (``cat(f, f)`` for NeoX, pairwise for interleaved). ``d2 <= d``; dims past ``d2``
        pass through. Row ``p`` rotates the tokens at position ``p``.
    tensor_format : {"sbhd", "bshd", "thd"}
    start_positions : int tensor ``[b]``, optional
        Per-sequence position offsets (inference); not with ``cp_size > 1``.
    interleaved : bool
    fused : bool
        Ignored: this is always one fused kernel.
    cu_seqlens : int tensor ``[b + 1]``, required for ``"thd"``
        With ``cp_size > 1``, the cumulative lengths of the whole (padded) sequences.
    cp_size, cp_rank : int
        Context parallelism (each sequence in ``2 * cp_size`` chunks, rank ``r`` holding chunks
        ``r`` and ``2 * cp_size - 1 - r``).

    Returns a new tensor shaped like ``t`` (contiguous). cos / sin are taken in float32 of the
    float32 angles (TransformerEngine's fused kernel does the same); positions are computed on
    t's device without synchronising, so the call is CUDA-graph capturable. Positions past the
    end of ``freqs`` give NaN (TransformerEngine asserts instead). ``freqs`` gets no gradient.
    """
    del fused
    if tensor_format not in TE_FORMATS:
        raise ValueError(f"apply_rotary_pos_emb: tensor_format must be one of {TE_FORMATS}, "
                         f"got {tensor_format!r}")
    if cp_size > 1 and start_positions is not None:
        raise ValueError("apply_rotary_pos_emb: start_positions != None with cp_size > 1 is not "
                         "supported (as in TransformerEngine)")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("apply_rotary_pos_emb: cu_seqlens must not be None when tensor_format "
                         "is 'thd'")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"apply_rotary_pos_emb: need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, "
                         f"cp_size={cp_size}")
    cache = te_cos_sin_cache(freqs, interleaved=interleaved)
    positions = positions_on_device(t, tensor_format, cu_seqlens, start_positions, cp_size,
                                        cp_rank)
    return apply_rope(t, positions=positions, cos_sin_cache=cache, interleaved=interleaved)


def te_cos_sin_cache(freqs, *, interleaved=False):
    """A ``[s2, d2]`` float32 cos/sin cache (vLLM layout) from TransformerEngine's ``[s2, 1, 1, d2]``
    angles: pair ``j``'s angle is ``freqs[p, j]`` (NeoX) or ``freqs[p, 2j]`` (interleaved)."""
    rows, width = freqs.shape[0], freqs.shape[-1]
    if freqs.numel() != rows * width or width % 2:
        raise ValueError(f"apply_rotary_pos_emb: freqs must have shape [s2, 1, 1, d2] with d2 even, "
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
