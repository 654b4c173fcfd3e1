"""Whether two arrays share an element: the exact answer, from pointers, shapes and strides alone.

A rotation in place reads and writes the same elements, so an array it writes must not share an
element with any other operand. Views of one buffer often interleave without sharing anything (q
and k of a fused QKV projection: every token's q heads, then its k heads), so comparing address
ranges is not enough. NumPy's ``shares_memory`` decides the question exactly for any pointer, shape
and strides (a bounded integer program) without touching memory: each array is handed to it as a
byte view made from its ``__array_interface__``, whatever device the pointer belongs to.
"""

from __future__ import annotations

import numpy as np

from .arrays import ArrayInfo
from .dtypes import ITEMSIZE

# NumPy >= 1.25 keeps it in np.exceptions, older ones at the top level.
_TooHardError = getattr(getattr(np, "exceptions", np), "TooHardError")


class _ByteView:
    """An ``__array_interface__`` of an array's bytes: its shape plus a last dim of itemsize bytes."""

    def __init__(self, info: ArrayInfo):
        itemsize = ITEMSIZE[info.dtype]
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(info.shape) + (itemsize,),
            "strides": tuple(s * itemsize for s in info.strides) + (1,),
            "typestr": "|u1",
            "data": (info.ptr, True),
        }


def byte_span(info: ArrayInfo) -> tuple[int, int]:
    """(lowest, one past the highest) byte offset from the pointer that the array covers.

    Kept on the ArrayInfo (made afresh for every call): a fused call with a KV cache compares
    each written array with every operand, and recomputing the spans was most of its host time."""
    span = info.__dict__.get("_byte_span")
    if span is None:
        itemsize = ITEMSIZE[info.dtype]
        if info.size == 0:
            span = (0, 0)
        else:
            low = sum((n - 1) * s for n, s in zip(info.shape, info.strides) if s < 0)
            high = sum((n - 1) * s for n, s in zip(info.shape, info.strides) if s > 0)
            span = (low * itemsize, (high + 1) * itemsize)
        info.__dict__["_byte_span"] = span
    return span


def overlaps_itself(info: ArrayInfo) -> bool:
    """True when two different indices of ``info`` reach the same element (exact; never reads it).

    Dims of one element and empty arrays reach nothing twice. When the dims, by |stride|, each
    step past everything the smaller ones span (every dense or sliced layout), no index repeats.
    Otherwise: indices i != j meet iff, at the first dim k where they differ, the block with
    ``i_k`` in [1, n_k) and the later dims free shares an element with the block at ``i_k = 0``
    (every dim before k fixed), which :func:`shares_memory` decides exactly for each k.
    """
    if info.size == 0:
        return False
    span = 0  # the largest offset the smaller dims reach together
    for stride, size in sorted(zip(map(abs, info.strides), info.shape)):
        if size > 1:
            if stride <= span:
                break
            span += (size - 1) * stride
    else:
        return False
    itemsize = ITEMSIZE[info.dtype]
    ptr = info.ptr or itemsize * (1 << 40)  # traced arrays have no memory: any far address
    for k, (size, stride) in enumerate(zip(info.shape, info.strides)):
        if size < 2:
            continue
        later_shape, later_strides = info.shape[k + 1:], info.strides[k + 1:]
        moved = ArrayInfo(None, info.kind, info.device, ptr + stride * itemsize,
                          (size - 1,) + later_shape, (stride,) + later_strides, info.dtype)
        fixed = ArrayInfo(None, info.kind, info.device, ptr, later_shape, later_strides, info.dtype)
        if shares_memory(moved, fixed):
            return True
    return False


def shares_memory(a: ArrayInfo, b: ArrayInfo) -> bool:
    """True when ``a`` and ``b`` have an element in common (exact; never reads them)."""
    if a.size == 0 or b.size == 0 or a.device != b.device or not a.ptr or not b.ptr:
        return False
    (a_low, a_high), (b_low, b_high) = byte_span(a), byte_span(b)
    if a.ptr + a_high <= b.ptr + b_low or b.ptr + b_high <= a.ptr + a_low:
        return False  # disjoint address ranges: the common case, decided without NumPy
    try:
        return bool(np.shares_memory(np.asarray(_ByteView(a)), np.asarray(_ByteView(b))))
    except _TooHardError:  # pragma: no cover - needs pathological strides
        return True  # cannot be proven disjoint: treated as overlapping, so the call is refused
