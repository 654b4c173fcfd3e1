"""Position helpers for packed (variable-length) batches."""

from __future__ import annotations

import numpy as np

from .arrays import describe, host_view
from .frequencies import _place_like


def varlen_positions(cu_seqlens, offsets=None):
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
        ``offsets[i] + arange(len_i)`` for each sequence, with the dtype, type and device of
        ``cu_seqlens``.

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
    bounds = _to_host(info).astype(np.int64)
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
        starts = _to_host(offsets_info).astype(np.int64)
    # Position of row t in sequence i: starts[i] + (t - bounds[i]).
    sequence = np.repeat(np.arange(len(lengths)), lengths)
    positions = (np.arange(bounds[-1], dtype=np.int64) - bounds[sequence] + starts[sequence])
    return _place_like(positions.astype(info.dtype), cu_seqlens if info.kind != "numpy" else None)


def _to_host(info) -> np.ndarray:
    if info.on_gpu:
        return info.view.get() if info.view is not None else info.obj.cpu().numpy()
    return np.asarray(host_view(info))
