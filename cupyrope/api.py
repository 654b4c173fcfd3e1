"""The public functions (:func:`apply_rope`, :func:`rms_norm_rope`, :func:`rope_and_cache`) and the
one place where a call is routed: ``torch.compile`` tracing, autograd and DTensors to
``cupyrope.frontends.torch.ops``, JAX tracers to ``cupyrope.frontends.jax.ops``, everything else
straight to :func:`cupyrope.execute.run`, where every route ends.

Design notes: docs/architecture.md#apipy
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
               validate: bool = False, seq_len: int | None = None, out_dtype: Any = None,
               q_scale: Any = None, k_scale: Any = None,
               out: Array | tuple[Array, Array] | None = None) -> Array | tuple[Array, Array]:
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
        ``(B, S, H, D)``, ``(S, 1)`` for ``(S, B, H, D)``. None means ``arange`` along axis -3 of q
        (a q of shape ``(H, D)``, with no token dim, then raises: pass positions).
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
        positions). See docs/schedules.md.
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
    out_dtype : {None, "float8_e4m3fn", "float8_e5m2"} or an fp8 dtype object, optional
        Quantise the rotated q and k (and their pass-through dims) in the same pass:
        ``fp8(value / scale)``, saturated to the format's largest finite value. Out of place only;
        CuPy, which has no fp8 dtype, gets the bits as uint8. Needs compute capability 8.9+.
    q_scale, k_scale : float or one-element float32 array, optional
        The fp8 scales (vLLM convention: stored = value / scale); default 1.
    out : array, or (array, array) when k is given, optional
        Preallocated outputs (CUDA graphs, buffers reused across steps): q_out (and k_out) of
        q's (k's) array type, shape, dtype and device, any strides with a unit last dim, sharing
        no element with any argument. The results are written there and returned. Not with
        ``inplace=True``, fp8 outputs, JAX arrays or tensors that require grad.

    Returns
    -------
    q_out, or (q_out, k_out) when k is given
        Arrays of q's type on q's device: for pair ``(x1, x2)`` at angle ``a``,
        ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``.

    Notes
    -----
    Differentiable in q and k: torch tensors that require grad go through the ``torch.library``
    operators of :mod:`cupyrope.frontends.torch.ops` (also what ``torch.compile`` traces), JAX tracers
    (``jax.grad`` / ``jax.jit`` / ``jax.vmap``) through :mod:`cupyrope.frontends.jax.ops`.

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
    if out_dtype is not None or q_scale is not None or k_scale is not None:
        if out is not None:
            raise ValueError("apply_rope: out= is not supported with fp8 outputs (out_dtype, "
                             "q_scale, k_scale): use the returned arrays")
        return execute.run_fused(
            "apply_rope", q, k, positions,
            rope=_rope_options(cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim,
                           inverse, inplace, seq_len),
            fusion=dict(out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale),
            validate=validate, router=_fused_route)
    if _compiling():  # torch.compile / export tracing: the traceable custom op
        return _torch_ops().apply_rope(
            q, k, positions, cos_sin_cache=cos_sin_cache, cos=cos, sin=sin, theta=theta,
            scaling=scaling, interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse,
            inplace=inplace, validate=validate, seq_len=seq_len,
            **({} if out is None else {"out": out}))
    return execute.run(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, interleaved,
                       rotary_dim, inverse, inplace, validate, seq_len, _framework_route, out)


def _compiling_before_torch() -> bool:
    """False until torch is imported; then ``torch.compiler.is_compiling`` takes this function's
    place (one cheap call ahead of the repeat-call path;
    measured: docs/perf_log.md#cupyropeapipy)."""
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
    from .frontends.torch import ops as torch_ops

    return torch_ops


def _framework_route(q, k, positions, cos_sin_cache, cos, sin):
    """The module that must run this call, or None for the array path: torch tensors that require
    grad (grad mode on) and DTensors go through the custom ops of ``cupyrope.frontends.torch.ops``, JAX
    tracers (``jax.grad``, ``jax.jit``, ``jax.vmap``) through ``cupyrope.frontends.jax.ops``. Neither
    framework is imported here: only one the caller has already imported is asked."""
    if "torch" in sys.modules:
        torch_ops = _torch_ops()
        if torch_ops.needs_autograd(q, k) or torch_ops.is_distributed(q, k, positions,
                                                                      cos_sin_cache, cos, sin):
            return torch_ops
    if "jax" in sys.modules:
        from .frontends.jax import ops as jax_ops

        if jax_ops.is_traced(q, k, positions, cos_sin_cache, cos, sin):
            return jax_ops
    return None


def _rope_options(cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim, inverse,
                  inplace, seq_len) -> dict:
    """The rotation's arguments of a fused call, as ``plan_rope`` takes them."""
    return dict(cos_sin_cache=cos_sin_cache, cos=cos, sin=sin, theta=theta, scaling=scaling,
                interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse, inplace=inplace,
                seq_len=seq_len)


def _fused_route(op_name, q, k, positions, rope, fusion):
    """The module whose ``run_fused`` must take a fused call, or None for the array path: calls
    traced by torch.compile, torch tensors that require grad and DTensors go to
    ``cupyrope.frontends.torch.ops``, JAX
    tracers to ``cupyrope.frontends.jax.ops``. As for :func:`_framework_route`, only a framework the caller
    has already imported is asked."""
    if _compiling():
        return _torch_ops()
    if "torch" in sys.modules:
        torch_ops = _torch_ops()
        arrays = (q, k, positions, *rope.values(), *fusion.values())  # weights, v, caches, scales
        if torch_ops.needs_autograd(q, k, *fusion.values()) or torch_ops.is_distributed(*arrays):
            return torch_ops
    if "jax" in sys.modules:
        from .frontends.jax import ops as jax_ops

        if (jax_ops.is_traced(q, k, positions, *rope.values(), *fusion.values())
                or jax_ops.updates_jax_cache(q, fusion)):
            return jax_ops
    return None


def rms_norm_rope(q: Array, k: Array | None, q_weight: Array, k_weight: Array | None,
                  positions: Array | None = None, *, eps: float, weight_offset: float = 0.0,
                  cos_sin_cache: Array | None = None, cos: Array | None = None,
                  sin: Array | None = None, theta: float = 10000.0,
                  scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
                  rotary_dim: int | None = None, inverse: bool = False, inplace: bool = False,
                  validate: bool = False, seq_len: int | None = None, out_dtype: Any = None,
                  q_scale: Any = None, k_scale: Any = None) -> Array | tuple[Array, Array]:
    """RMSNorm of every head of q (and k), then the rotation, in one pass (QK-norm models:
    Qwen3, Gemma 3, OLMo 2).

    Per head, over ``head_dim``, in float32: ``x * rsqrt(mean(x**2) + eps) * (weight_offset +
    weight)``, then the rotation of :func:`apply_rope`, rounded once to the output dtype.

    Parameters
    ----------
    q, k : arrays, shapes ``(..., num_q_heads, head_dim)`` / ``(..., num_k_heads, head_dim)``
        float16, bfloat16 or float32; views of one fused QKV buffer work (v is never touched).
    q_weight, k_weight : arrays, shape ``(head_dim,)``
        The norm weights (float32, float16 or bfloat16); ``k_weight`` is None when k is.
    eps : float
        Added to the mean square (the model's ``rms_norm_eps``).
    weight_offset : float
        0 for ``weight * x`` (Qwen3, OLMo 2), 1 for Gemma's ``(1 + weight) * x``.
    positions, cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim, inverse, inplace,
    validate, seq_len, out_dtype, q_scale, k_scale
        As in :func:`apply_rope`. Dims past ``rotary_dim`` are normalised too.

    Returns
    -------
    q_out, or (q_out, k_out) when k is given

    Examples
    --------
    >>> import numpy as np, cupyrope as cr
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    >>> k = rng.standard_normal((4, 2, 64)).astype(np.float32)
    >>> w = np.ones(64, np.float32)
    >>> q2, k2 = cr.rms_norm_rope(q, k, w, w, np.arange(4), eps=1e-6)
    >>> bool(np.allclose(np.sqrt((q2 ** 2).mean(-1)), 1, atol=1e-4))
    True
    """
    return execute.run_fused(
        "rms_norm_rope", q, k, positions,
        rope=_rope_options(cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim,
                           inverse, inplace, seq_len),
        fusion=dict(norm=True, q_weight=q_weight, k_weight=k_weight, eps=eps,
                    weight_offset=weight_offset, out_dtype=out_dtype, q_scale=q_scale,
                    k_scale=k_scale),
        validate=validate, router=_fused_route)


def rope_and_cache(q: Array, k: Array, v: Array, positions: Array | None, k_cache: Array,
                   v_cache: Array, slot_mapping: Array, *, cos_sin_cache: Array | None = None,
                   cos: Array | None = None, sin: Array | None = None, theta: float = 10000.0,
                   scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
                   rotary_dim: int | None = None, layout: str = "NHD", k_scale: Any = None,
                   v_scale: Any = None, cache_dtype: Any = None, q_weight: Array | None = None,
                   k_weight: Array | None = None, eps: float | None = None,
                   weight_offset: float = 0.0, out_dtype: Any = None, q_scale: Any = None,
                   inplace: bool = True, validate: bool = False, seq_len: int | None = None):
    """Rotate q and k and write the rotated k and v into a paged KV cache, in one launch
    (optionally after QK-RMSNorm and with fp8 outputs).

    Parameters
    ----------
    q, k, v : arrays, shapes ``(T, Hq, D)``, ``(T, Hk, D)``, ``(T, Hk, D)``
        One token dim (vLLM / SGLang batches); views of a fused QKV buffer work.
    positions, cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim, seq_len
        As in :func:`apply_rope`.
    k_cache, v_cache : arrays
        ``layout="NHD"``: ``(num_blocks, block_size, Hk, D)`` (vLLM's flash layout; block_size 1
        is SGLang's token-slot cache); ``"HND"``: ``(num_blocks, Hk, block_size, D)``. Any
        strides with a unit last dim: two views of one ``(num_blocks, 2, ...)`` buffer work. The
        dtype of q, or fp8 (``float8_e4m3fn`` / ``float8_e5m2``; uint8 bits with
        ``cache_dtype``).
    slot_mapping : int64 or int32 array, shape ``(T,)``
        Token t goes to block ``slot // block_size``, row ``slot % block_size``. Negative slots
        (padding) write nothing; slots past the cache are skipped too (``validate=True`` raises
        IndexError for them instead). Slots must be distinct: ``validate=True`` raises
        ValueError for a slot given to two tokens; without it nothing is checked, the NumPy
        path keeps the last token's row and on the GPU which token's row lands is unspecified.
    k_scale, v_scale : float or one-element float32 array
        fp8 scales of the caches (stored = value / scale); ``k_scale`` also scales an fp8 k_out.
    q_weight, k_weight, eps, weight_offset
        QK-RMSNorm before the rotation, as :func:`rms_norm_rope` (when weights are given).
    out_dtype, q_scale
        fp8 q/k outputs, as :func:`apply_rope` (then ``inplace=False``).
    inplace : bool
        True (vLLM's convention): q and k are rotated in place.

    Returns
    -------
    (q_out, k_out, k_cache, v_cache)
        The caches are the arrays given, written in place.
    """
    norm = q_weight is not None or k_weight is not None
    return execute.run_fused(
        "rope_and_cache", q, k, positions,
        rope=_rope_options(cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim,
                           False, inplace, seq_len),
        fusion=dict(norm=norm, q_weight=q_weight, k_weight=k_weight, eps=eps,
                    weight_offset=weight_offset, out_dtype=out_dtype, q_scale=q_scale,
                    k_scale=k_scale, v=v, k_cache=k_cache, v_cache=v_cache,
                    slot_mapping=slot_mapping, layout=layout, v_scale=v_scale,
                    cache_dtype=cache_dtype),
        validate=validate, router=_fused_route)
