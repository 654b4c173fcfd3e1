"""Inverse frequencies and cos/sin tables, computed in float64 on the host.

Frequency schedules follow Hugging Face's ``rope_scaling`` / ``rope_parameters`` dicts
(``ROPE_INIT_FUNCTIONS``; the formulas live in ``schedules.py``). Tables are computed in float64 from
an exact float64 angle and rounded once to the requested dtype, so they are accurate at any position
(a float32 ``pos * inv_freq`` is already ~2e-3 rad off at 131072).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .arrays import describe, place_like
from .dtypes import FLOAT_DTYPES, dtype_name_of, refused_dtype_error, round_once
from .schedules import ROPE_TYPES, compute_frequencies, scaling_type
from .validators import check_int

__all__ = ["ROPE_TYPES", "cos_sin_cache", "cos_sin_table", "rope_frequencies", "scaling_type"]


def rope_frequencies(rotary_dim: int, *, theta: float = 10000.0,
                     scaling: Mapping[str, Any] | None = None,
                     seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies and attention factor of a RoPE schedule, in float64.

    The same numbers as Hugging Face's ``ROPE_INIT_FUNCTIONS`` (and the models' default schedule),
    computed in float64 instead of float32; the attention factor is bit for bit Hugging Face's.

    Parameters
    ----------
    rotary_dim : int
        Number of rotated dims (even); there are ``rotary_dim // 2`` frequencies. This is Hugging
        Face's ``dim = int(head_dim * partial_rotary_factor)``, except for ``proportional``, where it
        is head_dim (that schedule spans the whole head).
    theta : float
        The RoPE base, used when ``scaling`` has no ``rope_theta``; when it has one, theta must be
        left at its default (10000.0) or equal it.
    scaling : dict, optional
        A Hugging Face ``rope_scaling`` (legacy, ``"type"`` or ``"rope_type"``) or transformers 5
        ``rope_parameters`` dict. ``rope_type`` (default ``"default"``) and its keys:

        - ``default``: none.
        - ``linear``: ``factor``.
        - ``dynamic`` (NTK): ``factor``, ``max_position_embeddings`` (the config's); uses seq_len.
        - ``yarn``: ``factor`` (absent or None: ``max_position_embeddings /
          original_max_position_embeddings``), ``original_max_position_embeddings``; optional
          ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``, ``mscale_all_dim``,
          ``attention_factor``, ``truncate`` (True).
        - ``llama3``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
          ``original_max_position_embeddings``.
        - ``longrope`` (also ``"su"``): ``short_factor``, ``long_factor`` (``rotary_dim // 2``
          numbers each), ``original_max_position_embeddings``; optional ``factor`` (absent:
          ``max_position_embeddings / original_max_position_embeddings``), ``attention_factor``;
          uses seq_len.
        - ``proportional``: optional ``factor`` (1), ``partial_rotary_factor`` (1).

        Every type also takes ``rope_theta``, ``partial_rotary_factor`` (in (0, 1]; only
        ``proportional`` and ``apply_rope``'s default rotary_dim use it) and, standing in for an
        absent ``original_max_position_embeddings``, ``max_position_embeddings``. Keys a type does
        not read give a UserWarning. ``mrope_section`` (M-RoPE) raises NotImplementedError.
    seq_len : int, optional
        The sequence length (Hugging Face: ``max(position_ids) + 1``) for the length-dependent
        schedules: ``dynamic`` scales by ``max(seq_len, max_position_embeddings)`` (None: no
        change); ``longrope`` takes ``long_factor`` when ``seq_len >
        original_max_position_embeddings``, else (None included) ``short_factor``.

    Returns
    -------
    inv_freq : numpy.ndarray, float64, shape ``(rotary_dim // 2,)``
        Pair ``j`` turns by ``position * inv_freq[j]``.
    attention_factor : float
        Multiplies cos and sin (1.0 except for ``yarn`` and ``longrope``).

    Raises
    ------
    ValueError
        Unknown rope_type (the message lists the known ones), a missing key (named), or
        inconsistent values (factor <= 0, beta_fast < beta_slow, low_freq_factor >=
        high_freq_factor, factor lists of the wrong length, theta and rope_theta disagreeing ...).

    Examples
    --------
    >>> inv_freq, attention_factor = rope_frequencies(8, theta=10000.0)
    >>> inv_freq.round(6).tolist(), attention_factor
    ([1.0, 0.1, 0.01, 0.001], 1.0)
    >>> llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ...            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    ...            "rope_theta": 500000.0}
    >>> inv_freq, attention_factor = rope_frequencies(128, scaling=llama31)
    >>> inv_freq.shape, attention_factor
    ((64,), 1.0)
    >>> yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    >>> round(rope_frequencies(128, theta=1e6, scaling=yarn)[1], 6)
    1.138629
    """
    return compute_frequencies(rotary_dim, theta=theta, scaling=scaling, seq_len=seq_len,
                               op_name="rope_frequencies")


def cos_sin_table(positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float):
    """float64 cos and sin of ``positions[..., None] * inv_freq`` times the attention factor."""
    angles = positions.astype(np.float64)[..., None] * inv_freq
    return np.cos(angles) * attention_factor, np.sin(angles) * attention_factor


def cos_sin_cache(max_position: int, rotary_dim: int, *, theta: float = 10000.0,
                  scaling: Mapping[str, Any] | None = None, dtype: Any = None,
                  like: Any = None) -> Any:
    """A vLLM/FlashInfer-layout cos/sin cache, computed in float64 and rounded once.

    Parameters
    ----------
    max_position : int
        Number of rows (positions 0 .. max_position - 1), at least 1.
    rotary_dim : int
        Rotated dims; the cache is ``rotary_dim`` wide.
    theta, scaling :
        As for :func:`rope_frequencies`. Length-dependent schedules take ``max_position`` as their
        ``seq_len`` (``dynamic`` scales to it; ``longrope`` uses its long factors for the whole
        cache when ``max_position > original_max_position_embeddings``).
    dtype : str or dtype object, optional
        ``"float32"`` (recommended), ``"float64"``, ``"float16"`` or ``"bfloat16"``, as a string or
        a NumPy / CuPy / JAX / torch dtype. Default: float32, or float64 when ``like`` is float64
        (a float64 rotation keeps float64 angles).
    like : array, optional
        The cache is returned as this array's type on its device (NumPy when None).

    Returns
    -------
    cache : array, shape ``(max_position, rotary_dim)``
        ``cache[p, :rotary_dim // 2]`` is cos, ``cache[p, rotary_dim // 2:]`` is sin of
        ``p * inv_freq``, both times the schedule's attention factor.

    Examples
    --------
    >>> cache = cos_sin_cache(4, 8)
    >>> cache.shape, cache.dtype.name
    ((4, 8), 'float32')
    """
    op_name = "cos_sin_cache"
    # A cache of no rows could serve no position.
    max_position = check_int(max_position, "max_position", op_name, minimum=1)
    if dtype is None:
        dtype = "float64" if like is not None and describe(like, "like").dtype == "float64" else "float32"
    elif dtype_name_of(dtype) in FLOAT_DTYPES:
        dtype = dtype_name_of(dtype)
    else:
        raise refused_dtype_error(dtype)(
            f"{op_name}: dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    # Length-dependent schedules (dynamic, longrope) see the cache's length as the sequence length.
    inv_freq, attention_factor = compute_frequencies(
        rotary_dim, theta=theta, scaling=scaling, seq_len=int(max_position), op_name=op_name
    )
    cos, sin = cos_sin_table(np.arange(int(max_position)), inv_freq, attention_factor)
    cache = round_once(np.concatenate([cos, sin], axis=-1), dtype)
    return place_like(cache, like)
