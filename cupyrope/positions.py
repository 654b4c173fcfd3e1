"""Position helpers for packed (variable-length) batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from .core.arrays import describe, place_like, to_host
from .core.validators import check_int


def varlen_positions(cu_seqlens: Any, offsets: Any = None) -> Any:
    """Positions of a packed ``[T, H, D]`` batch.

    Parameters
    ----------
    cu_seqlens : int32 or int64 array, shape ``(B + 1,)``
        Cumulative sequence lengths: sequence ``i`` occupies rows
        ``cu_seqlens[i]:cu_seqlens[i + 1]``, starting at 0 and non-decreasing.
    offsets : int array, shape ``(B,)``, optional
        First position of each sequence (e.g. the cached length when decoding, or a context-parallel
        shard's start). Zero by default.

    Returns
    -------
    positions : array, shape ``(cu_seqlens[-1],)``
        ``offsets[i] + arange(len_i)`` for each sequence, with the type and device of
        ``cu_seqlens`` and its dtype (int64 where an int32 would not hold a position: never
        wraps).

    Examples
    --------
    >>> import numpy as np
    >>> varlen_positions(np.array([0, 3, 5])).tolist()
    [0, 1, 2, 0, 1]
    >>> varlen_positions(np.array([0, 3, 5]), offsets=np.array([10, 7])).tolist()
    [10, 11, 12, 7, 8]
    """
    info = describe(cu_seqlens, "cu_seqlens")
    if info.dtype not in ("int32", "int64"):
        raise TypeError(f"varlen_positions: cu_seqlens must be int32 or int64, got {info.dtype}")
    if info.ndim != 1 or info.shape[0] < 1:
        raise ValueError(f"varlen_positions: cu_seqlens must have shape (B + 1,), got {info.shape}")
    bounds = to_host(info).astype(np.int64)
    lengths = np.diff(bounds)
    if bounds[0] != 0 or (lengths < 0).any():
        raise ValueError(
            f"varlen_positions: cu_seqlens must start at 0 and never decrease, got {bounds.tolist()}"
        )
    starts = np.zeros(len(lengths), dtype=np.int64)
    if offsets is not None:
        offsets_info = describe(offsets, "offsets")
        if offsets_info.dtype not in ("int32", "int64"):
            raise TypeError(f"varlen_positions: offsets must be int32 or int64, got {offsets_info.dtype}")
        if offsets_info.shape != (len(lengths),):
            raise ValueError(
                f"varlen_positions: offsets must have shape ({len(lengths)},) to match cu_seqlens, "
                f"got {offsets_info.shape}"
            )
        starts = to_host(offsets_info).astype(np.int64)
    # Position of row t in sequence i: starts[i] + (t - bounds[i]).
    sequence = np.repeat(np.arange(len(lengths)), lengths)
    positions = (np.arange(bounds[-1], dtype=np.int64) - bounds[sequence] + starts[sequence])
    return place_like(_widened_if_needed(positions, info.dtype),
                      cu_seqlens if info.kind != "numpy" else None)


# ----------------------------------------------------------------------------------------------
# Training layouts: context parallelism and TransformerEngine's formats

TE_FORMATS = ("sbhd", "bshd", "thd")


def _check_cp(cp_size, cp_rank, op_name: str) -> tuple[int, int]:
    cp_size = check_int(cp_size, "cp_size", op_name, minimum=1)
    cp_rank = check_int(cp_rank, "cp_rank", op_name, minimum=0)
    if cp_rank >= cp_size:
        raise ValueError(f"{op_name}: cp_rank must be < cp_size ({cp_size}), got {cp_rank}")
    return cp_size, cp_rank


def _widened_if_needed(positions: np.ndarray, dtype: str) -> np.ndarray:
    """int64 positions in ``dtype`` (cu_seqlens' dtype), or int64 when a value does not fit
    int32: a position never wraps."""
    if dtype == "int32" and positions.size and (positions.max() > np.iinfo(np.int32).max
                                                or positions.min() < np.iinfo(np.int32).min):
        dtype = "int64"
    return positions.astype(dtype)


def _host_ints(x, name: str, op_name: str):
    info = describe(x, name)
    if info.dtype not in ("int32", "int64"):
        raise TypeError(f"{op_name}: {name} must be int32 or int64, got {info.dtype}")
    return info, to_host(info).astype(np.int64)


def _cp_rank_positions(lengths: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """Positions of one rank's rows, sequence after sequence, for full sequence ``lengths``.

    Each sequence is cut into ``2 * cp_size`` chunks of ``c = length / (2 * cp_size)`` rows; rank
    ``r`` holds chunk ``r`` then chunk ``2 * cp_size - 1 - r`` (the load-balanced split of
    TransformerEngine and Megatron-LM, so every rank gets the same share of causal attention).
    """
    local = lengths // cp_size  # rows of each sequence on this rank
    sequence = np.repeat(np.arange(len(lengths)), local)
    row = np.arange(int(local.sum()), dtype=np.int64) - np.repeat(np.cumsum(local) - local, local)
    if cp_size == 1:
        return row
    return load_balanced_positions(row, (lengths // (2 * cp_size))[sequence], cp_size, cp_rank,
                                   np.where)


def load_balanced_positions(row, chunk, cp_size: int, cp_rank: int, where):
    """True positions of the rows ``row`` (0-based within a sequence's share on this rank) whose
    sequences are cut into chunks of ``chunk`` rows: rank ``r`` holds chunk ``r``, then chunk
    ``2 * cp_size - 1 - r``. Element-wise on NumPy arrays or torch tensors (``where`` is
    ``np.where`` or ``torch.where``), so that the torch adapters compute it on the device."""
    return where(row < chunk, cp_rank * chunk + row, (2 * cp_size - 1 - cp_rank) * chunk + row - chunk)


def context_parallel_positions(cu_seqlens: Any, cp_size: int, cp_rank: int, *,
                               offsets: Any = None) -> Any:
    """Positions of the packed tokens one context-parallel rank holds.

    Context parallelism (TransformerEngine, Megatron-LM) cuts every sequence into ``2 * cp_size``
    equal chunks and gives rank ``r`` chunks ``r`` and ``2 * cp_size - 1 - r``, packed in that
    order; this returns the true position of each of those rows, to pass to ``apply_rope``.

    Parameters
    ----------
    cu_seqlens : int32 or int64 array, shape ``(B + 1,)``
        Cumulative lengths of the *whole* sequences (before the split; TransformerEngine's
        ``cu_seqlens_padded``), each a multiple of ``2 * cp_size`` when ``cp_size > 1``.
        With ``cp_size == 1`` this is :func:`varlen_positions`.
    cp_size, cp_rank : int
        Context-parallel world size and this rank.
    offsets : int array, shape ``(B,)``, optional
        Added to every position of sequence ``i`` (e.g. a cached length).

    Returns
    -------
    positions : array, shape ``(cu_seqlens[-1] // cp_size,)``
        Type and device of ``cu_seqlens``, and its dtype (int64 where int32 would wrap). Computed on the host: GPU inputs are read back
        (a synchronisation), so compute them once per batch, e.g. in the data loader.

    Examples
    --------
    >>> import numpy as np
    >>> context_parallel_positions(np.array([0, 8]), 2, 0).tolist()
    [0, 1, 6, 7]
    >>> context_parallel_positions(np.array([0, 8]), 2, 1).tolist()
    [2, 3, 4, 5]
    """
    op_name = "context_parallel_positions"
    cp_size, cp_rank = _check_cp(cp_size, cp_rank, op_name)
    info, bounds = _host_ints(cu_seqlens, "cu_seqlens", op_name)
    if info.ndim != 1 or info.shape[0] < 1:
        raise ValueError(f"{op_name}: cu_seqlens must have shape (B + 1,), got {info.shape}")
    lengths = np.diff(bounds)
    if bounds[0] != 0 or (lengths < 0).any():
        raise ValueError(f"{op_name}: cu_seqlens must start at 0 and never decrease, got {bounds.tolist()}")
    if cp_size > 1 and (lengths % (2 * cp_size)).any():
        raise ValueError(
            f"{op_name}: every sequence length must be a multiple of 2 * cp_size = {2 * cp_size} "
            f"(pad them: TransformerEngine's cu_seqlens_padded), got lengths {lengths.tolist()}"
        )
    positions = _cp_rank_positions(lengths, cp_size, cp_rank)
    if offsets is not None:
        offsets_info, starts = _host_ints(offsets, "offsets", op_name)
        if offsets_info.shape != (len(lengths),):
            raise ValueError(
                f"{op_name}: offsets must have shape ({len(lengths)},) to match cu_seqlens, "
                f"got {offsets_info.shape}"
            )
        positions = positions + np.repeat(starts, lengths // cp_size)
    return place_like(_widened_if_needed(positions, info.dtype),
                      cu_seqlens if info.kind != "numpy" else None)


def te_positions(t: Any, tensor_format: str = "sbhd", *, cu_seqlens: Any = None,
                 start_positions: Any = None, cp_size: int = 1, cp_rank: int = 0) -> Any:
    """Positions for ``apply_rope`` on a tensor in one of TransformerEngine's layouts.

    TransformerEngine's ``apply_rotary_pos_emb(t, freqs, tensor_format, start_positions,
    interleaved, cu_seqlens=..., cp_size=..., cp_rank=...)`` rotates row ``p`` of its per-position
    angle table ``freqs`` into token ``t[..]``; this gives that ``p`` for every token, shaped to
    broadcast to the token dims of ``t``, so that

    ``apply_rope(t, positions=te_positions(t, fmt, ...), cos_sin_cache=cache)``

    with ``cache[p] = [cos(freqs[p, :r/2]), sin(freqs[p, :r/2])]`` (``cupyrope.compat`` has the
    drop-in) rotates ``t`` in place of TransformerEngine, with no copy of ``t``.

    Parameters
    ----------
    t : array
        ``[s, b, h, d]`` (``"sbhd"``), ``[b, s, h, d]`` (``"bshd"``) or ``[t, h, d]`` (``"thd"``);
        only its shape, type and device are read. On a context-parallel rank, its local share.
    tensor_format : {"sbhd", "bshd", "thd"}
    cu_seqlens : int array ``(B + 1,)``, required for ``"thd"``
        Cumulative sequence lengths of the packed batch; with ``cp_size > 1`` those of the whole
        (padded) sequences, as TransformerEngine takes them.
    start_positions : int array ``(b,)``, optional
        First position of each sequence (inference with a KV cache); with ``cp_size > 1`` it is
        added to the load-balanced position in the whole sequence, as TransformerEngine's kernel
        does.
    cp_size, cp_rank : int
        Context parallelism: the load-balanced split of :func:`context_parallel_positions`.

    Returns
    -------
    positions : int64 array of ``t``'s type and device
        ``"sbhd"``: ``[s, 1]`` (``[s, b]`` with start_positions); ``"bshd"``: ``[s]`` (``[b, s]``);
        ``"thd"``: ``[t]``. Computed on the host (GPU ``cu_seqlens`` / ``start_positions`` are read
        back): compute once per batch and reuse for every layer.

    Examples
    --------
    >>> import numpy as np
    >>> te_positions(np.zeros((4, 2, 1, 8)), "sbhd").ravel().tolist()
    [0, 1, 2, 3]
    >>> te_positions(np.zeros((4, 1, 8)), "thd", cu_seqlens=np.array([0, 3, 4]),
    ...              start_positions=np.array([5, 0])).tolist()
    [5, 6, 7, 0]
    """
    op_name = "te_positions"
    if tensor_format not in TE_FORMATS:
        raise ValueError(f"{op_name}: tensor_format must be one of {TE_FORMATS}, got {tensor_format!r}")
    cp_size, cp_rank = _check_cp(cp_size, cp_rank, op_name)
    shape = describe(t, "t").shape
    needed = 3 if tensor_format == "thd" else 4
    if len(shape) != needed:
        raise ValueError(f"{op_name}: a {tensor_format!r} tensor has {needed} dims, got shape {shape}")
    starts = None
    if start_positions is not None:
        starts_info, starts = _host_ints(start_positions, "start_positions", op_name)
        if starts_info.ndim != 1:
            raise ValueError(f"{op_name}: start_positions must have shape (b,), got {starts_info.shape}")

    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError(f"{op_name}: tensor_format 'thd' needs cu_seqlens")
        _, bounds = _host_ints(cu_seqlens, "cu_seqlens", op_name)
        positions = np.asarray(context_parallel_positions(bounds, cp_size, cp_rank, offsets=starts))
        if positions.shape[0] != shape[0]:
            raise ValueError(
                f"{op_name}: cu_seqlens cover {positions.shape[0]} rows on this rank "
                f"(cu_seqlens[-1] // cp_size) but t has {shape[0]}"
            )
    else:
        batch, seq = (shape[1], shape[0]) if tensor_format == "sbhd" else (shape[0], shape[1])
        if cp_size > 1 and seq % 2:
            raise ValueError(f"{op_name}: with cp_size > 1 the local sequence length must be even, "
                             f"got {seq}")
        positions = _cp_rank_positions(np.array([seq * cp_size]), cp_size, cp_rank)
        if starts is not None:
            if starts.shape[0] != batch:
                raise ValueError(f"{op_name}: start_positions must have shape ({batch},), got "
                                 f"{starts.shape}")
            positions = starts[:, None] + positions[None, :]  # [b, s]
            if tensor_format == "sbhd":
                positions = positions.T
        elif tensor_format == "sbhd":
            positions = positions[:, None]
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    info = describe(t, "t")
    return place_like(positions, t if info.kind != "numpy" else None)
