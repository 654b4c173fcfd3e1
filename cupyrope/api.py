"""The public entry point, :func:`apply_rope`, and the one place where a call is routed.

A call goes to one of three places, decided here once:

- inside ``torch.compile`` / ``torch.export`` tracing: the traceable torch custom op
  (``cupyrope.torch_ops``);
- torch tensors that require grad (grad mode on): the differentiable custom ops, and JAX tracers
  (``jax.grad``, ``jax.jit``, ``jax.vmap``): ``cupyrope.jax_ops``;
- everything else: :func:`cupyrope.execute.run` directly.

Both framework routes end in :func:`cupyrope.execute.run` too, so every call is checked, planned
and launched by the same code.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from . import execute

# Any array cupyrope takes: CuPy, torch, JAX, NumPy or another DLPack producer.
Array = Any


def apply_rope(q: Array, k: Array | None = None, positions: Array | None = None, *,
               cos_sin_cache: Array | None = None, cos: Array | None = None,
               sin: Array | None = None, theta: float = 10000.0,
               scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
               rotary_dim: int | None = None, inverse: bool = False, inplace: bool = False,
               validate: bool = False, seq_len: int | None = None) -> Array | tuple[Array, Array]:
    """Rotate q (and k) by Rotary Position Embedding angles, in one kernel launch.

    Parameters
    ----------
    q : array, shape ``(..., num_q_heads, head_dim)``
        float16, bfloat16, float32 or float64; CuPy, torch (CUDA or CPU), JAX, NumPy or any DLPack
        producer. Only the last dim needs stride 1: q may be a view into a fused QKV buffer, have
        padded heads, or be a ``[B, S, H, D]`` transpose of ``[B, H, S, D]`` storage.
    k : array, shape ``(..., num_k_heads, head_dim)``, optional
        Same leading (token) dims and dtype as q; any number of heads (GQA, MQA).
    positions : int32 or int64 array, optional
        Broadcastable to ``q.shape[:-2]``: ``(T,)`` for ``(T, H, D)``, ``(S,)`` or ``(B, S)`` for
        ``(B, S, H, D)``, ``(S, 1)`` for ``(S, B, H, D)``. None means ``arange`` along axis -3 of q.
        Negative positions rotate backwards when angles are computed in the kernel.
    cos_sin_cache : array, shape ``(max_position, rotary_dim)``, optional
        vLLM/FlashInfer layout: ``[:, :rotary_dim // 2]`` cos, ``[:, rotary_dim // 2:]`` sin,
        row ``positions[t]``. Rows outside the cache come out as NaN (never read out of bounds).
    cos, sin : arrays, shape broadcastable to ``q.shape[:-2] + (w,)``, optional
        Per-token tables (Hugging Face, TransformerEngine, Liger). ``w`` is ``rotary_dim`` (full
        width: halves repeated for NeoX, pairs repeated for interleaved) or ``rotary_dim // 2``.
        ``positions`` must then be None.
    theta : float
        RoPE base for angles computed in the kernel (neither table given).
    scaling : dict, optional
        A Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (default, linear, dynamic,
        yarn, llama3, longrope, proportional; ``mrope_section`` for M-RoPE with ``[3, ...]``
        positions). See the README's "Frequency schedules".
    interleaved : bool
        False: NeoX pairing, dim ``j`` with ``j + rotary_dim // 2`` (``rotate_half``).
        True: GPT-J pairing, dim ``2j`` with ``2j + 1``.
    rotary_dim : int, optional
        Even number of rotated dims; dims past it pass through unchanged. Defaults to head_dim for
        computed angles, to the cache width, or to the per-token table width.
    inverse : bool
        Rotate by ``-angle`` (the gradient of the rotation; also un-rotates).
    inplace : bool
        Write into q and k and return them; otherwise return new contiguous arrays.
    validate : bool
        With a cache, read positions on the host and raise IndexError for rows outside it
        (this synchronises; off by default).
    seq_len : int, optional
        Sequence length for the length-dependent schedules (dynamic, longrope); Hugging Face uses
        ``max(position_ids) + 1``.

    Returns
    -------
    q_out, or (q_out, k_out) when k is given
        Arrays of q's type on q's device: for pair ``(x1, x2)`` at angle ``a``,
        ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``.

    Notes
    -----
    Differentiable in q and k: torch tensors that require grad go through the ``torch.library``
    operators of :mod:`cupyrope.torch_ops` (also what ``torch.compile`` traces), JAX tracers
    (``jax.grad`` / ``jax.jit`` / ``jax.vmap``) through :mod:`cupyrope.jax_ops`.

    Examples
    --------
    >>> import numpy as np, cupyrope as cr
    >>> q = np.random.default_rng(0).standard_normal((5, 4, 64)).astype(np.float32)
    >>> k = np.random.default_rng(1).standard_normal((5, 1, 64)).astype(np.float32)
    >>> q_rot, k_rot = cr.apply_rope(q, k, np.arange(5), theta=10000.0)
    >>> q_back = cr.apply_rope(q_rot, positions=np.arange(5), inverse=True)
    >>> bool(np.allclose(q_back, q, atol=1e-5))
    True
    """
    if _compiling():  # torch.compile / export tracing: the traceable custom op
        return _torch_ops().apply_rope(
            q, k, positions, cos_sin_cache=cos_sin_cache, cos=cos, sin=sin, theta=theta,
            scaling=scaling, interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse,
            inplace=inplace, validate=validate, seq_len=seq_len)
    return execute.run(q, k, positions, cos_sin_cache, cos, sin, theta=theta, scaling=scaling,
                       interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse,
                       inplace=inplace, validate=validate, seq_len=seq_len,
                       router=_framework_route)


def _compiling_before_torch() -> bool:
    """False until torch is imported; then ``torch.compiler.is_compiling`` takes this function's
    place (one call, ~0.07 us, ahead of the repeat-call path)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    global _compiling
    _compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or _never
    return _compiling()


def _never() -> bool:
    return False


_compiling = _compiling_before_torch


def _torch_ops():
    from . import torch_ops

    return torch_ops


def _framework_route(q, k, positions, cos_sin_cache, cos, sin):
    """The module that must run this call, or None for the array path: torch tensors that require
    grad (grad mode on) go through the differentiable custom ops of ``cupyrope.torch_ops``, JAX
    tracers (``jax.grad``, ``jax.jit``, ``jax.vmap``) through ``cupyrope.jax_ops``. Neither
    framework is imported here: only one the caller has already imported is asked."""
    if "torch" in sys.modules:
        torch_ops = _torch_ops()
        if torch_ops.needs_autograd(q, k):
            return torch_ops
    if "jax" in sys.modules:
        from . import jax_ops

        if jax_ops.is_traced(q, k, positions, cos_sin_cache, cos, sin):
            return jax_ops
    return None
