"""The public functions (:func:`apply_rope`, :func:`rms_norm_rope`, :func:`rope_and_cache`,
:func:`write_cache`, :func:`rerotate_cache`) and the
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
from .core.arrays import describe, mark_written, new_output
from .core.fused_plan import PER_HEAD
from .cuda.recipes import fast_fused_key, rerotate_key

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
        producer. Any strides: q may be a view into a fused QKV buffer, have padded heads, or be a
        ``[B, S, H, D]`` transpose of ``[B, H, S, D]`` storage; heads whose last dim has a stride
        other than 1 take the general (scalar) kernel.
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
    q_scale, k_scale : float, one-element float32 array, "per_head" or float32 array, optional
        The fp8 scales (vLLM convention: stored = value / scale); default 1. One per tensor (a
        number or a 0-d / one-element array), or one per (token, head) row computed by the call
        from the row's amax (``scale = amax / the format's largest value``, at least 2^-126):
        ``"per_head"`` returns new float32 arrays of shape ``q.shape[:-1]`` / ``k.shape[:-1]``
        after the outputs, a float32 C-contiguous array of that shape is filled instead. Every
        scale of a call is per tensor, or every one per row.
    out : array, or (array, array) when k is given, optional
        Preallocated outputs (CUDA graphs, buffers reused across steps): q_out (and k_out) of
        q's (k's) array type, shape, dtype and device, any strides with a unit last dim, sharing
        no element with any argument. The results are written there and returned. Not with
        ``inplace=True``, fp8 outputs, JAX arrays or tensors that require grad.

    Returns
    -------
    q_out, or (q_out, k_out) when k is given
        Arrays of q's type on q's device: for pair ``(x1, x2)`` at angle ``a``,
        ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``. Then, for ``q_scale`` / ``k_scale``
        ``"per_head"``, the new per-row scale arrays (q's, then k's).

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
        fusion = dict(out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale)
        made = _new_row_scales(fusion, q, k)
        return _with_row_scales(execute.run_fused(
            "apply_rope", q, k, positions,
            rope=_rope_options(cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim,
                           inverse, inplace, seq_len),
            fusion=fusion, validate=validate, router=_fused_route), made)
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
    """cupyrope.frontends.torch.ops, imported on first use (an import statement on every call
    cost a repeat call ~0.5 µs)."""
    global _TORCH_OPS
    if _TORCH_OPS is None:
        from .frontends.torch import ops as torch_ops

        _TORCH_OPS = torch_ops
    return _TORCH_OPS


_TORCH_OPS = None


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


def _new_row_scales(fusion: dict, q, k) -> list:
    """Replace ``q_scale`` / ``k_scale`` = ``"per_head"`` by new float32 arrays of shape
    ``q.shape[:-1]`` / ``k.shape[:-1]`` (the call fills them); returns them, to be returned after
    the outputs. A "per_head" that cannot be made here (JAX, no token dim) is left for the checks
    to refuse with what to pass instead."""
    made = []
    for name, x in (("q_scale", q), ("k_scale", k)):
        value = fusion.get(name)
        if isinstance(value, str) and value == PER_HEAD:
            scales = _new_row_scales_like(x)
            if scales is not None:
                fusion[name] = scales
                made.append(scales)
    return made


def _new_row_scales_like(x):
    """A new float32 array of shape ``x.shape[:-1]``, of x's type and on its device (torch, CuPy
    or NumPy, with a token dim); None otherwise."""
    if x is None or len(getattr(x, "shape", ())) < 3:
        return None
    shape = tuple(x.shape[:-1])
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.new_empty(shape, dtype=torch.float32)
    if type(x).__module__.split(".", 1)[0] not in ("numpy", "cupy"):
        return None  # JAX (immutable, traced) or another producer
    info = describe(x, "q")
    return new_output(x, info.kind, info.device, shape, "float32")


def _with_row_scales(result, made: list):
    """A fused call's result, then the per-row scale arrays that ``"per_head"`` made."""
    if not made:
        return result
    return (*result, *made) if isinstance(result, tuple) else (result, *made)


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
                  q_scale: Any = None, k_scale: Any = None,
                  out: Array | tuple[Array, Array] | None = None,
                  norm_over: str = "head") -> Array | tuple[Array, Array]:
    """RMSNorm of every head of q (and k), then the rotation, in one pass (per-head QK-norm
    models: Qwen3, Qwen3-MoE, Gemma 3; with ``norm_over="all_heads"`` the norm of the whole
    projection, all heads of a token together: OLMo 2, FlashInfer's ``fused_qk_rmsnorm_rope``).

    Per head, over ``head_dim``, in float32: ``x * rsqrt(mean(x**2) + eps) * (weight_offset +
    weight)``, then the rotation of :func:`apply_rope`, rounded once to the output dtype.

    Parameters
    ----------
    q, k : arrays, shapes ``(..., num_q_heads, head_dim)`` / ``(..., num_k_heads, head_dim)``
        float16, bfloat16 or float32; views of one fused QKV buffer work (v is never touched).
    q_weight, k_weight : arrays, shape ``(head_dim,)``
        The norm weights (float32, float16 or bfloat16); ``k_weight`` is None when k is. With
        ``norm_over="all_heads"``: ``(num_heads * head_dim,)`` or ``(num_heads, head_dim)``, one
        weight per element of the projection (``q_norm.weight`` of OLMo 2).
    eps : float
        Added to the mean square (the model's ``rms_norm_eps``).
    weight_offset : float
        0 for ``weight * x`` (Qwen3), 1 for Gemma's ``(1 + weight) * x``.
    positions, cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim, inverse, inplace,
    validate, seq_len, out_dtype, q_scale, k_scale
        As in :func:`apply_rope`. Dims past ``rotary_dim`` are normalised too; per-row fp8
        scales take the amax of the normalised, rotated row.
    out : array, or (array, array) when k is given, optional
        Preallocated outputs written by the launch itself (no copy): q_out (and k_out) of q's
        (k's) array type, shape and device, of the output dtype (q's, or the fp8 ``out_dtype``;
        uint8 bits for CuPy), any token and head strides with a unit last stride, sharing no
        element with any argument. Returned in place of new arrays. Not with ``inplace=True``
        or JAX arrays; under ``torch.compile`` and autograd the results are copied into them.
    norm_over : ``"head"`` or ``"all_heads"``
        ``"head"``: the mean over each head's ``head_dim``. ``"all_heads"``: over all heads of a
        token together, q's heads and k's apart (``mean(x**2)`` over the last two dims), still
        one launch: a block holds a token and reduces its sums before rotating.

    Returns
    -------
    q_out, or (q_out, k_out) when k is given; then the per-row scale arrays that
    ``"per_head"`` made (q's, then k's)

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
    fast = None
    if out is None and not validate and not _compiling():
        # The repeat-call path first, keyed by the arguments as given (no dicts).
        fast = fast_fused_key("rms_norm_rope", (q, k, positions, cos_sin_cache, cos, sin,
                                                q_weight, k_weight, q_scale, k_scale),
                              (eps, weight_offset, theta, scaling, interleaved, rotary_dim,
                               inverse, inplace, seq_len, out_dtype, norm_over))
        if fast is not None:
            result = execute.replay_fast(fast, q, k, None, inplace)
            if result is not None:
                return result
    fusion = dict(norm=True, q_weight=q_weight, k_weight=k_weight, eps=eps,
                  weight_offset=weight_offset, out_dtype=out_dtype, q_scale=q_scale,
                  k_scale=k_scale, norm_over=norm_over)
    made = _new_row_scales(fusion, q, k)
    rope = _rope_options(cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim,
                         inverse, inplace, seq_len)
    if out is not None:
        return _with_row_scales(_run_fused_into("rms_norm_rope", q, k, positions, rope, fusion,
                                                validate, out), made)
    return _with_row_scales(execute.run_fused(
        "rms_norm_rope", q, k, positions, rope=rope, fusion=fusion, validate=validate,
        router=_fused_route, fast_key=None if fast is None else fast[0]), made)


def rms_norm_rope_repeat(q, k, q_weight, k_weight, eps, weight_offset, cos, sin, norm_over,
                         inplace):
    """The repeat call of ``rms_norm_rope(q, k, q_weight, k_weight, eps=eps,
    weight_offset=weight_offset, cos=cos, sin=sin, norm_over=norm_over, inplace=inplace)`` (every
    other argument its default): its outputs, or None when no recipe is kept for that call or the
    full path must decide (then make that call). The key is the one the public function forms
    for the same call, so it replays exactly what that call would; for callers that make the
    call on every step with the same arguments (a patched Hugging Face layer), where the public
    function's keyword arguments are a measurable part of the host time."""
    if _compiling():
        return None
    fast = fast_fused_key("rms_norm_rope", (q, k, None, None, cos, sin, q_weight, k_weight,
                                            None, None),
                          (eps, weight_offset, 10000.0, None, False, None, False, inplace, None,
                           None, norm_over))
    return None if fast is None else execute.replay_fast(fast, q, k, None, inplace)


def rope_and_cache(q: Array, k: Array, v: Array, positions: Array | None, k_cache: Array,
                   v_cache: Array, slot_mapping: Array, *, cos_sin_cache: Array | None = None,
                   cos: Array | None = None, sin: Array | None = None, theta: float = 10000.0,
                   scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
                   rotary_dim: int | None = None, layout: str = "NHD", k_scale: Any = None,
                   v_scale: Any = None, cache_dtype: Any = None, q_weight: Array | None = None,
                   k_weight: Array | None = None, eps: float | None = None,
                   weight_offset: float = 0.0, out_dtype: Any = None, q_scale: Any = None,
                   inplace: bool | None = None, validate: bool = False,
                   seq_len: int | None = None, k_cache_scales: Array | None = None,
                   v_cache_scales: Array | None = None,
                   out: tuple[Array, Array] | None = None, norm_over: str = "head"):
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
        ``cache_dtype``), or NVFP4 (``cache_dtype="nvfp4"``: uint8 of last dim ``D // 2``, two
        e2m1 values a byte, the even one in the low nibble; TensorRT-LLM's and FlashInfer's
        layout).
    slot_mapping : int64 or int32 array, shape ``(T,)``
        Token t goes to block ``slot // block_size``, row ``slot % block_size``. Negative slots
        (padding) write nothing; slots past the cache are skipped too (``validate=True`` raises
        IndexError for them instead). Slots must be distinct: ``validate=True`` raises
        ValueError for a slot given to two tokens; without it nothing is checked, the NumPy
        path keeps the last token's row and on the GPU which token's row lands is unspecified.
    k_scale, v_scale : float, one-element float32 array or float32 array
        fp8 scales of the caches (stored = value / scale); ``k_scale`` also scales an fp8 k_out.
        Per (slot, head) row instead: float32 arrays of shape ``(num_blocks, block_size, Hk)``
        (NHD) or ``(num_blocks, Hk, block_size)`` (HND) beside the caches, which the call fills
        with each written row's ``amax / the format's largest value`` (at least 2^-126); with
        fp8 outputs and a cache of q's dtype, ``q_scale`` / ``k_scale`` of shape ``(T, H)`` take
        the outputs' rows instead. NVFP4 caches: the global scales (one per tensor; a reader
        dequantises ``e2m1 * block_scale * global``).
    q_weight, k_weight, eps, weight_offset, norm_over
        QK-RMSNorm before the rotation, as :func:`rms_norm_rope` (when weights are given).
    out_dtype, q_scale
        fp8 q/k outputs, as :func:`apply_rope` (then ``inplace=False``).
    inplace : bool, optional
        True (vLLM's convention, the default without ``out``): q and k are rotated in place.
    out : (array, array), optional
        Preallocated ``(q_out, k_out)`` written by the launch itself, as in
        :func:`rms_norm_rope` (then q and k are only read; the default ``inplace`` is False).
    k_cache_scales, v_cache_scales : arrays, optional
        NVFP4 caches only: their e4m3 block scales, one per 16 values of a row, uint8 or
        float8_e4m3fn of shape ``(num_blocks, block_size, Hk, D // 16)`` (NHD) or
        ``(num_blocks, Hk, block_size, D // 16)`` (HND), written in place with the caches.

    Returns
    -------
    (q_out, k_out, k_cache, v_cache)
        The caches are the arrays given, written in place.
    """
    if inplace is None:
        inplace = out is None
    fast = None
    if (out is None and not validate and k_cache_scales is None and v_cache_scales is None
            and not _compiling()):
        # The repeat-call path first, keyed by the arguments as given (no dicts).
        fast = fast_fused_key("rope_and_cache", (q, k, positions, cos_sin_cache, cos, sin,
                                                 q_weight, k_weight, q_scale, k_scale, v_scale,
                                                 v, k_cache, v_cache, slot_mapping),
                              (theta, scaling, interleaved, rotary_dim, layout, cache_dtype,
                               eps, weight_offset, out_dtype, inplace, seq_len, norm_over))
        if fast is not None:
            result = execute.replay_fast(fast, q, k, (k_cache, v_cache), inplace)
            if result is not None:
                return result
    norm = q_weight is not None or k_weight is not None
    fusion = dict(norm=norm, q_weight=q_weight, k_weight=k_weight, eps=eps,
                  weight_offset=weight_offset, out_dtype=out_dtype, q_scale=q_scale,
                  k_scale=k_scale, v=v, k_cache=k_cache, v_cache=v_cache,
                  slot_mapping=slot_mapping, layout=layout, v_scale=v_scale,
                  cache_dtype=cache_dtype, norm_over=norm_over)
    if k_cache_scales is not None or v_cache_scales is not None:  # NVFP4 caches only
        fusion.update(k_cache_scales=k_cache_scales, v_cache_scales=v_cache_scales)
    rope = _rope_options(cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim, False,
                         inplace, seq_len)
    if out is not None:
        return _run_fused_into("rope_and_cache", q, k, positions, rope, fusion, validate, out)
    return execute.run_fused("rope_and_cache", q, k, positions, rope=rope, fusion=fusion,
                             validate=validate, router=_fused_route,
                             fast_key=None if fast is None else fast[0])


def _run_fused_into(op_name: str, q, k, positions, rope: dict, fusion: dict, validate: bool,
                    out):
    """A fused call that writes its outputs into ``out`` (q_out, or (q_out, k_out)): checked in
    full (:func:`cupyrope.core.fused_plan.plan_fused_outputs`), then one launch into those
    arrays. Calls that a frontend must take (torch.compile, autograd, DTensors) run there and
    their results are copied into ``out``; JAX arrays are immutable and refused."""
    from .core.fused_plan import plan_fused, plan_fused_outputs

    route = _fused_route(op_name, q, k, positions, rope, fusion)
    if route is not None:
        if route is not _torch_ops():
            raise TypeError(f"{op_name}: out= writes into its arrays and JAX arrays are "
                            "immutable; use the returned arrays instead")
        if rope["inplace"] is True:
            raise ValueError(f"{op_name}: pass inplace=True (write into q and k) or out= (write "
                             "into other arrays), not both")
        result = route.run_fused(op_name, q, k, positions, rope=rope, fusion=fusion,
                                 validate=validate)
        results = result if isinstance(result, tuple) else (result,)
        targets = out if isinstance(out, (tuple, list)) else (out,)
        if len(targets) != (1 if k is None else 2):
            raise TypeError(f"{op_name}: out must be {'q_out' if k is None else '(q_out, k_out)'}")
        for target, value in zip(targets, results):
            target.copy_(value)
        return (*targets, *results[2:]) if k is not None else targets[0]
    plan = plan_fused(op_name, q, k, positions, rope=rope, fusion=fusion, validate=validate)
    outputs = plan_fused_outputs(plan, out)
    execute.rotate(plan, outputs)
    f = plan.fusion
    natives = [info.obj for info in outputs]
    mark_written(*natives, *((f.k_cache.obj, f.v_cache.obj) if f.writes_cache else ()))
    if f.writes_cache:
        return natives[0], natives[1], f.k_cache.obj, f.v_cache.obj
    return natives[0] if plan.k is None else (natives[0], natives[1])


def write_cache(k: Array, v: Array, k_cache: Array, v_cache: Array, slot_mapping: Array, *,
                layout: str = "NHD", k_scale: Any = None, v_scale: Any = None,
                cache_dtype: Any = None, validate: bool = False,
                k_cache_scales: Array | None = None, v_cache_scales: Array | None = None):
    """Write k and v, unrotated, into a paged KV cache, in one launch (vLLM's
    ``reshape_and_cache_flash``; the cache half of :func:`rope_and_cache`).

    No rotation at all: every value is stored as it is (a cache of k's dtype gets its bits, inf
    and NaN included; an fp8 or NVFP4 cache ``fp8(value / scale)`` as :func:`rope_and_cache`
    stores it). k and v are only read.

    Parameters
    ----------
    k, v : arrays, shape ``(T, Hk, D)``
        float16, bfloat16 or float32; any token and head strides with a unit last stride (views
        of a fused QKV buffer work).
    k_cache, v_cache, slot_mapping, layout, k_scale, v_scale, cache_dtype, k_cache_scales,
    v_cache_scales
        As in :func:`rope_and_cache` (``k_scale`` scales the k cache only).
    validate : bool
        Read slot_mapping on the host and raise for slots past the cache (IndexError) or given
        to two tokens (ValueError); this synchronises.

    Returns
    -------
    (k_cache, v_cache)
        The caches given, written in place (CuPy, torch, NumPy). JAX arrays and tracers: new
        caches (XLA writes the slots in place where the caller donates the caches), then the
        new arrays of the scales the call writes (NVFP4 block scales, per-row cache scales), as
        :func:`rope_and_cache` returns them on JAX; under ``jax.jit`` one native kernel call.

    Notes
    -----
    The launch is the fused kernel of :func:`rope_and_cache` with nothing to rotate: it reads
    no positions and no angles, so it needs no frequency table; before a CUDA graph capture,
    ``cupyrope.warmup(sources=("tables",))`` compiles its kernels.

    Examples
    --------
    >>> import numpy as np, cupyrope as cr
    >>> k = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    >>> v = k + 1
    >>> k_cache = np.zeros((2, 4, 2, 8), np.float32); v_cache = np.zeros_like(k_cache)
    >>> _ = cr.write_cache(k, v, k_cache, v_cache, np.array([5, -1, 0]))
    >>> bool((k_cache[1, 1] == k[0]).all() and (v_cache[0, 0] == v[2]).all())
    True
    """
    shape = tuple(getattr(k, "shape", ()))
    if len(shape) != 3:
        # Also checked by the plan; here because the q of the call is a zero-head view of k.
        raise ValueError(f"write_cache: k must be [num_tokens, num_heads, head_dim], got "
                         f"{'shape ' + str(shape) if hasattr(k, 'shape') else type(k).__name__}")
    fusion = dict(rotate=False, norm=False, out_dtype=None, q_scale=None, k_scale=k_scale, v=v,
                  k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, layout=layout,
                  v_scale=v_scale, cache_dtype=cache_dtype)
    if k_cache_scales is not None or v_cache_scales is not None:  # NVFP4 caches only
        fusion.update(k_cache_scales=k_cache_scales, v_cache_scales=v_cache_scales)
    # The fused path's q is a view of k with no heads: nothing is read or written through it.
    result = execute.run_fused(
        "write_cache", k[:, :0], k, None,
        rope=_rope_options(None, None, None, 10000.0, None, False, None, False, False, None),
        fusion=fusion, validate=validate, router=_fused_route)
    # (q_out, k_out, k_cache, v_cache), then on JAX the new arrays of the scales the call writes.
    return tuple(result[2:])


def rerotate_cache(k_cache: Array, slots: Array, delta: Array | int, *,
                   cos_sin_cache: Array | None = None, theta: float = 10000.0,
                   scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
                   rotary_dim: int | None = None, layout: str = "NHD", k_scale: Any = None,
                   cache_dtype: Any = None, validate: bool = False,
                   seq_len: int | None = None) -> Array:
    """Re-rotate cached keys in place: each named slot's row is rotated by the angle of its
    position delta (sliding-window eviction, attention sinks: a key cached at position ``p``
    becomes the key at ``p + delta``, since rotations compose exactly: R(d) R(p) = R(p + d)).

    One kernel launch on the GPU (the NumPy path on the CPU); dims past ``rotary_dim`` are not
    touched; each re-rotated element is rounded once to the cache's format.

    Parameters
    ----------
    k_cache : array
        The paged key cache that :func:`rope_and_cache` writes: ``layout="NHD"``: ``(num_blocks,
        block_size, num_kv_heads, head_dim)``; ``"HND"``: ``(num_blocks, num_kv_heads, block_size,
        head_dim)``. float16, bfloat16, float32 or fp8 (``float8_e4m3fn`` / ``float8_e5m2``; uint8
        bits with ``cache_dtype``); any strides with a unit last dim. Written in place (JAX
        arrays: a new cache is returned).
    slots : int32 or int64 array, shape ``(N,)``
        The slots to re-rotate, ``block * block_size + row`` as ``rope_and_cache``'s
        ``slot_mapping``. Negative slots are skipped; slots past the cache are skipped too
        (``validate=True`` raises IndexError). Slots must be distinct: ``validate=True`` raises
        ValueError for a slot named twice; without it one rotation of that row lands (which one
        is unspecified on the GPU).
    delta : int, or int32 / int64 array of shape ``(N,)`` (or one element)
        The position shift of each slot; an int shifts every slot (it is passed by value: a
        CUDA graph replays it, where an array is read at every replay). Any int64 with computed
        angles, negative ones included (exact backward rotations). With a ``cos_sin_cache`` the
        delta is its row, so it must lie in ``[0, max_position)``: an int outside raises
        IndexError; array values are checked with ``validate=True``, else a row outside the
        table is never read and its slot's rotated dims become NaN.
    cos_sin_cache : array, shape ``(max_position, rotary_dim)``, optional
        The vLLM / FlashInfer table (cos half, then sin half), row ``delta``; None computes the
        angles ``delta * inv_freq`` in the kernel (float64 or float-float, as ``apply_rope``).
        The keys already carry a schedule's attention factor (mscale): the re-rotation is by
        the angle alone (computed angles leave the factor out, a table's entries are divided
        by the factor its row 0, position 0, holds).
    theta, scaling, seq_len
        The schedule of computed angles, as :func:`apply_rope` (not with a table; no M-RoPE).
    interleaved, rotary_dim
        As :func:`apply_rope`: the cache's pairing and rotated dims.
    layout : {"NHD", "HND"}
        The cache layout, as :func:`rope_and_cache`.
    k_scale : float or one-element float32 array, optional
        fp8 caches: the scale (stored = value / k_scale); rows are decoded, rotated and stored
        again with it. Default 1.
    cache_dtype : {None, "float8_e4m3fn", "float8_e5m2"}
        The fp8 format of a uint8 cache.
    validate : bool
        Read slots (and deltas with a table) on the host and raise for values out of range or
        repeated slots (this synchronises).

    Returns
    -------
    k_cache
        The cache given, re-rotated in place (JAX: the new cache).

    Examples
    --------
    >>> import numpy as np, cupyrope as cr
    >>> k = np.random.default_rng(0).standard_normal((6, 1, 2, 64)).astype(np.float32)
    >>> positions = np.arange(6)
    >>> k_cache = cr.apply_rope(k.reshape(6, 2, 64), positions=positions).reshape(6, 1, 2, 64)
    >>> _ = cr.rerotate_cache(k_cache, np.arange(6), -2)        # every key two positions back
    >>> expected = cr.apply_rope(k.reshape(6, 2, 64), positions=positions - 2)
    >>> bool(np.allclose(k_cache.reshape(6, 2, 64), expected, atol=1e-5))
    True
    """
    arrays = (k_cache, slots, delta, cos_sin_cache, k_scale)
    key = None
    if validate is False and not _compiling():
        # The repeat-call path first, keyed by the arguments as given: tensors that require grad
        # while grad mode is on, DTensors and JAX arrays form no key (the routes below take them).
        key = rerotate_key(arrays, (theta, scaling, interleaved, rotary_dim, layout, cache_dtype,
                                    seq_len))
        if key is not None:
            result = execute.replay_rerotate_fast(key, k_cache)
            if result is not None:
                return result
    options = dict(cos_sin_cache=cos_sin_cache, theta=theta, scaling=scaling,
                   interleaved=interleaved, rotary_dim=rotary_dim, layout=layout, k_scale=k_scale,
                   cache_dtype=cache_dtype, validate=validate, seq_len=seq_len)
    if _compiling() or ("torch" in sys.modules
                        and (_torch_ops().needs_autograd(k_cache)
                             or _torch_ops().is_distributed(*arrays))):
        return _torch_ops().rerotate_cache(k_cache, slots, delta, **options)
    if "jax" in sys.modules:
        from .frontends.jax import ops as jax_ops

        if jax_ops.is_rerotate_on_jax(*arrays):
            return jax_ops.rerotate_cache(k_cache, slots, delta, **options)
    from .cuda.launch import run_rerotate

    return run_rerotate(k_cache, slots, delta, key=key, **options)
