"""vLLM / SGLang / FlashInfer: the in-place ``rotary_embedding`` op."""

from __future__ import annotations

from ..api import apply_rope


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
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size < 1:
        raise TypeError(f"rotary_embedding: head_size must be a positive int, got {head_size!r}")
    q = _heads_view(query, positions, head_size, "query")
    k = None if key is None else _heads_view(key, positions, head_size, "key")
    apply_rope(q, k, positions, cos_sin_cache=cos_sin_cache, interleaved=not is_neox, inplace=True)


def _heads_view(x, positions, head_size: int, name: str):
    """``[..., H * head_size]`` as ``[..., H, head_size]`` (a view: the last dim has stride 1)."""
    token_dims = positions.dim()
    if x.dim() == token_dims + 2:
        if x.shape[-1] != head_size:
            raise ValueError(f"rotary_embedding: {name} has head size {x.shape[-1]}, expected "
                             f"head_size={head_size}")
        return x
    if x.dim() != token_dims + 1:
        raise ValueError(
            f"rotary_embedding: {name} of shape {tuple(x.shape)} must be positions.shape "
            f"{tuple(positions.shape)} + [heads * head_size] or + [heads, head_size]"
        )
    if x.shape[-1] % head_size:
        raise ValueError(f"rotary_embedding: {name}'s last dim {x.shape[-1]} is not a multiple of "
                         f"head_size={head_size}")
    return x.view(*x.shape[:-1], x.shape[-1] // head_size, head_size)
