"""The public entry point, :func:`apply_rope`."""

from __future__ import annotations

import sys
import threading

from .arrays import empty_like_caller, finish, gpu_array_key, host_view, new_gpu_outputs
from .cpu import rotate_on_host
from .plan import check_positions_in_cache, plan_rope

# Launch recipes of earlier GPU calls, keyed on everything they depend on except data pointers.
# A repeated call (same shapes, strides, dtypes, devices, alignment and options) skips argument
# checking and planning: the checks passed for exactly this metadata before.
_recipes: dict = {}
_recipes_lock = threading.Lock()
_MAX_RECIPES = 4096


def apply_rope(q, k=None, positions=None, *, cos_sin_cache=None, cos=None, sin=None,
               theta=10000.0, scaling=None, interleaved=False, rotary_dim=None, inverse=False,
               inplace=False, validate=False, seq_len=None):
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
    return _rotate(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, interleaved,
                   rotary_dim, inverse, inplace, validate, seq_len)


def _rotate(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim,
            inverse, inplace, validate, seq_len):
    """apply_rope outside torch.compile tracing: the repeat-call path first, then the full one
    (the custom ops of cupyrope.torch_ops call this on detached tensors)."""
    options = (theta, scaling, interleaved, rotary_dim, inverse, inplace, seq_len)
    key = None if validate else _recipe_key(q, k, positions, cos_sin_cache, cos, sin, options)
    if key is not None:
        try:
            recipe = _recipes.get(key[0])
        except TypeError:  # an unhashable option (e.g. theta given as an array): full path
            recipe = key = None
        if recipe is not None:
            result = _replay(recipe, q, k, key[1], inplace)
            if result is not None:
                return result

    route = _framework_route(q, k, positions, cos_sin_cache, cos, sin)
    if route is not None:  # differentiation or tracing needs the framework's own machinery
        return route.apply_rope(
            q, k, positions, cos_sin_cache=cos_sin_cache, cos=cos, sin=sin, theta=theta,
            scaling=scaling, interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse,
            inplace=inplace, validate=validate, seq_len=seq_len)

    plan = plan_rope(q, k, positions, cos_sin_cache=cos_sin_cache, cos=cos, sin=sin, theta=theta,
                     scaling=scaling, interleaved=interleaved, rotary_dim=rotary_dim,
                     inverse=inverse, inplace=inplace, seq_len=seq_len)
    if validate:
        check_positions_in_cache(plan)

    inputs = [plan.q] + ([plan.k] if plan.k is not None else [])
    if plan.inplace:
        natives, outputs = [info.obj for info in inputs], inputs
    else:
        made = [empty_like_caller(info, info.shape, info.dtype) for info in inputs]
        natives, outputs = [m[0] for m in made], [m[1] for m in made]

    empty = plan.num_tokens == 0 or plan.num_q_heads + plan.num_k_heads == 0
    if not empty:
        if plan.q.on_gpu:
            from .launch import rotate_on_gpu

            recipe = rotate_on_gpu(plan, outputs)
            if key is not None:
                with _recipes_lock:
                    if len(_recipes) >= _MAX_RECIPES:
                        _recipes.clear()
                    _recipes[key[0]] = recipe
        else:
            rotate_on_host(plan, [host_view(info) for info in outputs])

    results = natives if plan.inplace else [finish(info, out) for info, out in zip(inputs, natives)]
    return results[0] if plan.k is None else (results[0], results[1])


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


def _recipe_key(q, k, positions, cos_sin_cache, cos, sin, options):
    """(hashable key, data pointers) for a call on CUDA torch tensors / CuPy arrays, else None."""
    metas, pointers = [], []
    for x in (q, k, positions, cos_sin_cache, cos, sin):
        if x is None:
            metas.append(None)
            pointers.append(0)
            continue
        found = gpu_array_key(x)
        if found is None:
            return None
        metas.append(found[0])
        pointers.append(found[1])
    theta, scaling, interleaved, rotary_dim, inverse, inplace, seq_len = options
    # Only exact bools: interleaved=1 must still reach the check that rejects it.
    if not (type(interleaved) is bool and type(inverse) is bool and type(inplace) is bool):
        return None
    if scaling is not None:
        try:  # lists (LongRoPE factors, mrope_section) as tuples, so the key hashes
            scaling = tuple(sorted((key, tuple(value) if isinstance(value, list) else value)
                                   for key, value in scaling.items()))
            hash(scaling)
        except (AttributeError, TypeError):
            return None
    same_qk = k is not None and pointers[1] == pointers[0]  # refused in place; must not be cached
    key = (tuple(metas), type(theta), theta, scaling, interleaved, rotary_dim, inverse, inplace,
           seq_len, same_qk)
    return key, pointers


def _replay(recipe, q, k, pointers, inplace):
    """Run a cached recipe on new arrays; None when the full path must decide instead."""
    q_ptr, k_ptr, positions_ptr, cache_ptr, cos_ptr, sin_ptr = pointers
    if inplace:
        q_out, k_out, q_out_ptr, k_out_ptr = q, k, q_ptr, k_ptr
    else:
        q_out, q_out_ptr, k_out, k_out_ptr = new_gpu_outputs(q, k)
        if recipe.vector and (q_out_ptr | k_out_ptr) & 15:
            return None  # allocators align to 256 bytes; never expected, but never assumed
    recipe.launch(q, q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cache_ptr or cos_ptr,
                  sin_ptr)
    return q_out if k is None else (q_out, k_out)
