"""Inverse frequencies and cos/sin tables, computed in float64 on the host.

Frequency schedules follow Hugging Face's ``rope_scaling`` dicts (``ROPE_INIT_FUNCTIONS``). Tables
are computed in float64 from an exact float64 angle and rounded once to the requested dtype, so they
are accurate at any position (a float32 ``pos * inv_freq`` is already ~2e-3 rad off at 131072).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .dtypes import FLOAT_DTYPES, numpy_dtype, round_once

# rope_types Hugging Face defines that cupyrope does not compute yet.
_PLANNED_ROPE_TYPES = ("dynamic", "yarn", "llama3", "longrope", "proportional")


def _check_rotary_dim(rotary_dim, where: str) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"{where}: rotary_dim must be an int, got {type(rotary_dim).__name__}")
    rotary_dim = int(rotary_dim)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"{where}: rotary_dim must be even and >= 2, got {rotary_dim}")
    return rotary_dim


def check_theta(theta, where: str) -> float:
    try:
        value = float(theta)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: theta must be a number, got {type(theta).__name__}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: theta must be finite and > 0, got {theta!r}")
    return value


def scaling_type(scaling: dict[str, Any] | None, where: str) -> str:
    """The rope_type of a Hugging Face rope_scaling dict, checked."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        raise TypeError(
            f"{where}: scaling must be None or a Hugging Face rope_scaling dict, "
            f"got {type(scaling).__name__}"
        )
    if "mrope_section" in scaling:
        raise NotImplementedError(f"{where}: scaling with 'mrope_section' (M-RoPE) is not supported yet")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", "linear"):
        return rope_type
    if rope_type in _PLANNED_ROPE_TYPES:
        raise NotImplementedError(
            f"{where}: scaling rope_type {rope_type!r} is not supported yet "
            "(supported: 'default', 'linear')"
        )
    raise ValueError(
        f"{where}: unknown scaling rope_type {rope_type!r}; expected one of "
        f"{('default', 'linear') + _PLANNED_ROPE_TYPES}"
    )


def rope_frequencies(rotary_dim, *, theta=10000.0, scaling=None, seq_len=None):
    """Inverse frequencies of a RoPE schedule, in float64.

    Parameters
    ----------
    rotary_dim : int
        Number of rotated dims (even); there are ``rotary_dim // 2`` frequencies.
    theta : float
        The RoPE base (``rope_theta``).
    scaling : dict, optional
        A Hugging Face ``rope_scaling`` dict: ``{"rope_type": "default"}`` or
        ``{"rope_type": "linear", "factor": f}``.
    seq_len : int, optional
        Sequence length for length-dependent schedules (none of the supported ones uses it).

    Returns
    -------
    inv_freq : numpy.ndarray, float64, shape ``(rotary_dim // 2,)``
        ``theta ** (-2 j / rotary_dim)``, divided by ``factor`` for linear scaling.
    attention_factor : float
        The factor that multiplies cos and sin (1.0 for default and linear).

    Examples
    --------
    >>> inv_freq, attention_factor = rope_frequencies(8, theta=10000.0)
    >>> inv_freq.round(6).tolist(), attention_factor
    ([1.0, 0.1, 0.01, 0.001], 1.0)
    """
    where = "rope_frequencies"
    rotary_dim = _check_rotary_dim(rotary_dim, where)
    theta = check_theta(theta, where)
    kind = scaling_type(scaling, where)
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / theta**exponents
    if kind == "linear":
        factor = scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"{where}: linear scaling needs a 'factor' > 0, got {factor!r}")
        inv_freq = inv_freq / float(factor)
    return inv_freq, 1.0


def cos_sin_table(positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float):
    """float64 cos and sin of ``positions[..., None] * inv_freq`` times the attention factor."""
    angles = positions.astype(np.float64)[..., None] * inv_freq
    return np.cos(angles) * attention_factor, np.sin(angles) * attention_factor


def cos_sin_cache(max_position, rotary_dim, *, theta=10000.0, scaling=None, dtype="float32",
                  like=None):
    """A vLLM/FlashInfer-layout cos/sin cache, computed in float64 and rounded once.

    Parameters
    ----------
    max_position : int
        Number of rows (positions 0 .. max_position - 1).
    rotary_dim : int
        Rotated dims; the cache is ``rotary_dim`` wide.
    theta, scaling :
        As for :func:`rope_frequencies` (``seq_len`` of length-dependent schedules is
        ``max_position``).
    dtype : str
        ``"float32"`` (recommended), ``"float64"``, ``"float16"`` or ``"bfloat16"``.
    like : array, optional
        The cache is returned as this array's type on its device (NumPy when None).

    Returns
    -------
    cache : array, shape ``(max_position, rotary_dim)``
        ``cache[p, :rotary_dim // 2]`` is cos, ``cache[p, rotary_dim // 2:]`` is sin of
        ``p * inv_freq``.

    Examples
    --------
    >>> cache = cos_sin_cache(4, 8)
    >>> cache.shape, cache.dtype.name
    ((4, 8), 'float32')
    """
    where = "cos_sin_cache"
    if isinstance(max_position, bool) or not isinstance(max_position, (int, np.integer)):
        raise TypeError(f"{where}: max_position must be an int, got {type(max_position).__name__}")
    if max_position < 0:
        raise ValueError(f"{where}: max_position must be >= 0, got {max_position}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    inv_freq, attention_factor = rope_frequencies(
        rotary_dim, theta=theta, scaling=scaling, seq_len=int(max_position)
    )
    cos, sin = cos_sin_table(np.arange(int(max_position)), inv_freq, attention_factor)
    cache = round_once(np.concatenate([cos, sin], axis=-1), dtype)
    return _place_like(cache, like)


def _place_like(host: np.ndarray, like):
    """Copy a host array to the type and device of ``like`` (or return it for None / NumPy)."""
    if like is None:
        return host
    from .arrays import describe, empty_like_caller, finish

    info = describe(like, "like")
    if info.kind == "jax":
        import jax

        device = next(iter(like.devices()))
        return jax.device_put(host, device)
    if info.kind == "torch":
        import torch

        if host.dtype == numpy_dtype("bfloat16"):
            tensor = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(host)
        device = "cpu" if info.device is None else f"cuda:{info.device}"
        return tensor.to(device)
    if info.on_gpu:
        out, _ = empty_like_caller(info, host.shape, host.dtype.name)
        out.set(host)
        return finish(info, out)
    return host
