"""M-RoPE (multimodal RoPE, Qwen2-VL / Qwen3-VL): positions carry three components (temporal,
height, width) and each frequency takes its angle from one of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .abi import MRopeMode

MROPE_NONE, MROPE_SECTIONED, MROPE_INTERLEAVED = MRopeMode.NONE, MRopeMode.SECTIONED, MRopeMode.INTERLEAVED


def mrope_layout(scaling: Mapping[str, Any] | None, rotary_dim: int, op_name: str):
    """``(mode, sections)`` of a dict's M-RoPE, or ``(MROPE_NONE, None)`` without ``mrope_section``.

    Sectioned (Qwen2-VL, Qwen2.5-VL): frequencies ``[0, s0)`` take the temporal position,
    ``[s0, s0 + s1)`` the height, the rest the width. Interleaved (Qwen3-VL, ``mrope_interleaved``
    true): frequency ``j`` takes the height when ``j % 3 == 1 and j < 3 * s1``, the width when
    ``j % 3 == 2 and j < 3 * s2``, else the temporal position. As in Hugging Face, the sections
    count frequencies (pairs) and add up to ``rotary_dim // 2``.
    """
    if not scaling or scaling.get("mrope_section") is None:
        if scaling and scaling.get("mrope_interleaved"):
            raise ValueError(f"{op_name}: scaling['mrope_interleaved'] needs an 'mrope_section'")
        return MROPE_NONE, None
    sections = scaling["mrope_section"]
    if (isinstance(sections, (str, bytes)) or not hasattr(sections, "__len__") or len(sections) != 3
            or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0
                   for v in sections)):
        raise ValueError(
            f"{op_name}: scaling['mrope_section'] must be 3 non-negative ints (temporal, height, width "
            f"frequencies), got {sections!r}"
        )
    sections = tuple(int(v) for v in sections)
    if sum(sections) != rotary_dim // 2:
        raise ValueError(
            f"{op_name}: scaling['mrope_section'] {list(sections)} must add up to rotary_dim // 2 = "
            f"{rotary_dim // 2} frequencies, got {sum(sections)}"
        )
    interleaved = scaling.get("mrope_interleaved", False)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"{op_name}: scaling['mrope_interleaved'] must be a bool, got {interleaved!r}")
    return (MROPE_INTERLEAVED if interleaved else MROPE_SECTIONED), sections


def mrope_components(mode: int, sections, half: int) -> np.ndarray:
    """The position component (0 temporal, 1 height, 2 width) of each of ``half`` frequencies."""
    j = np.arange(half)
    if mode == MROPE_SECTIONED:
        return np.searchsorted(np.cumsum(sections), j, side="right")
    component = np.zeros(half, dtype=np.int64)
    component[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    component[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return component
