"""``warmup``: everything a call needs on the device, prepared ahead of time.

Compiling a kernel and uploading a schedule's inverse frequencies both synchronise, so neither can
happen while a stream is captured into a CUDA graph; a call under capture that would need one
raises an error naming this function. Calling it first with the dtypes, angle sources and (for
computed angles) the schedules the graph will use makes the capture work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .cuda import compiler
from .core.abi import AngleSource
from .core.arrays import require_gpu
from .cuda.launch import device_constants
from .core.schedules import DEFAULT_THETA, compute_frequencies


def warmup(dtypes: Iterable[Any] = ("bfloat16", "float16", "float32"), *,
           table_dtypes: Iterable[Any] = ("float32",),
           sources: Iterable[AngleSource | str] = tuple(AngleSource),
           interleaved: Iterable[bool] = (False, True), vector: Iterable[bool] = (True, False),
           wide_index: Iterable[bool] = (False,), device: int | None = None,
           theta: float | None = None, scaling: Mapping[str, Any] | None = None,
           rotary_dim: int | None = None, seq_len: int | None = None) -> int:
    """Compile chosen specialisations and upload a frequency schedule; returns how many
    specialisations are ready.

    Parameters
    ----------
    dtypes, table_dtypes, sources, interleaved, vector, wide_index, device
        Which specialisations to compile, as for every call on the device (the lean and the
        general kernel of each 16-byte one); dtypes as names or NumPy / torch / JAX dtypes,
        sources as :class:`AngleSource` or ``"cache"``, ``"tables"``, ``"computed"``.
    theta, scaling, rotary_dim, seq_len
        A schedule whose float64 inverse frequencies to upload now, for calls that compute angles
        in the kernel (as ``apply_rope`` takes them; ``rotary_dim`` is required with them: the
        rotated width of those calls). Call once per schedule a CUDA graph will use.

    Examples
    --------
    >>> import cupyrope as cr
    >>> cr.warmup(dtypes=("bfloat16",), sources=("computed",), interleaved=(False,),
    ...           theta=500000.0, rotary_dim=128)                                # doctest: +SKIP
    4
    """
    schedule = theta is not None or scaling is not None or seq_len is not None
    if schedule and rotary_dim is None:
        raise ValueError("warmup: rotary_dim is needed with theta / scaling / seq_len (the rotated "
                         "width of the calls whose inverse frequencies to upload)")
    inv_freq = None
    if schedule or rotary_dim is not None:  # checked before anything is compiled
        inv_freq, _ = compute_frequencies(rotary_dim, theta=DEFAULT_THETA if theta is None else theta,
                                          scaling=scaling, seq_len=seq_len, op_name="warmup")
    require_gpu("warmup")
    count = compiler.compile_specialisations(dtypes, table_dtypes=table_dtypes, sources=sources,
                                             interleaved=interleaved, vector=vector,
                                             wide_index=wide_index, device=device)
    if inv_freq is not None:
        device_id = compiler.current_device() if device is None else int(device)
        device_constants.inv_freq(device_id, inv_freq)
    return count
