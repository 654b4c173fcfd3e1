"""``transformer_engine.pytorch.attention.rope``.

``RotaryPositionEmbedding`` makes TE's angle table ``[s, 1, 1, d]`` (float32, each pair's angle
repeated: ``cat(f, f)``, or pairwise when interleaved). ``apply_rotary_pos_emb(fused=True)`` and
``apply_fused_qkv_rotary_pos_emb`` run cupyrope.compat's adapters; ``fused=False`` is the torch
reference the test compares them with, written from TE's documented semantics: token ``i`` of
sequence ``b`` takes angle row ``start_positions[b] + p(i)``, ``p`` its position in the whole
sequence under context parallelism (rank ``r`` of ``cp`` holds chunks ``r`` and
``2 cp - 1 - r`` of ``2 cp``), ``out = x * cos + rotate_half(x) * sin`` with cos / sin in x's
dtype, dims past the table's width passed through."""

from __future__ import annotations

import torch

from cupyrope.compat import te_apply_fused_qkv_rotary_pos_emb, te_apply_rotary_pos_emb
from peer_shim_support import NoAdapter, module_getattr

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "apply_fused_qkv_rotary_pos_emb"]


class RotaryPositionEmbedding(torch.nn.Module):
    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor=None,
                 pretrained_max_position_embeddings=None, rotary_base: float = 10000.0,
                 interleaved: bool = False):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents))
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved

    def forward(self, max_seq_len: int, offset: int = 0):
        device_type = self.inv_freq.device.type
        with torch.autocast(enabled=False, device_type=device_type):
            seq = torch.arange(max_seq_len, device=self.inv_freq.device,
                               dtype=self.inv_freq.dtype) + offset
            factor = self.seq_len_interpolation_factor
            pretrained = self.pretrained_max_position_embeddings
            if factor is not None and pretrained is not None:
                if max_seq_len > pretrained * factor:
                    seq = seq * (pretrained / max_seq_len)
                else:
                    seq = seq / factor
            freqs = torch.outer(seq, self.inv_freq)
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])


def _cp_positions(length: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """Positions in the whole sequence of this rank's ``length`` tokens."""
    local = torch.arange(length, device=device)
    if cp_size == 1:
        return local
    chunk = length // 2
    full = length * cp_size
    first = cp_rank * chunk + local
    second = full - (cp_rank + 1) * chunk + (local - chunk)
    return torch.where(local < chunk, first, second)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        even, odd = x[..., ::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``t [..., d]`` rotated by ``angles [..., d2]`` (broadcast over heads)."""
    width = angles.shape[-1]
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    rot, passed = t[..., :width], t[..., width:]
    return torch.cat((rot * cos + _rotate_half(rot, interleaved) * sin, passed), dim=-1)


def _unfused(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
             cp_rank):
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    if tensor_format == "thd":
        bounds = (cu_seqlens // cp_size).tolist()
        pieces = []
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            rows = _cp_positions(hi - lo, cp_size, cp_rank, t.device)
            if start_positions is not None:
                rows = rows + int(start_positions[b])
            pieces.append(_rotate(t[lo:hi], table[rows][:, None, :], interleaved))
        return torch.cat(pieces)
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"Unsupported tensor_format: {tensor_format}.")
    seq_dim = 0 if tensor_format == "sbhd" else 1
    rows = _cp_positions(t.shape[seq_dim], cp_size, cp_rank, t.device)  # [s]
    if start_positions is not None:
        rows = start_positions.to(t.device, torch.long)[:, None] + rows[None, :]  # [b, s]
        if tensor_format == "sbhd":
            rows = rows.t()
    else:
        rows = rows[:, None] if tensor_format == "sbhd" else rows[None, :]
    return _rotate(t, table[rows][:, :, None, :], interleaved)


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    if tensor_format == "thd" and cu_seqlens is None:
        raise AssertionError("cu_seqlens must not be None when tensor_format is 'thd'.")
    if fused:
        return te_apply_rotary_pos_emb(t, freqs, tensor_format=tensor_format,
                                       start_positions=start_positions, interleaved=interleaved,
                                       fused=True, cu_seqlens=cu_seqlens, cp_size=cp_size,
                                       cp_rank=cp_rank)
    return _unfused(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                    cp_rank)


def apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list,
                                   tensor_format="sbhd", start_positions=None, interleaved=False,
                                   cu_seqlens=None, cp_size=1, cp_rank=0):
    return te_apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list,
                                             tensor_format=tensor_format,
                                             start_positions=start_positions,
                                             interleaved=interleaved, cu_seqlens=cu_seqlens,
                                             cp_size=cp_size, cp_rank=cp_rank)


__getattr__ = module_getattr("transformer_engine.pytorch.attention.rope")
