"""The public entry point, :func:`apply_rope`."""

from __future__ import annotations

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
        Hugging Face ``rope_scaling`` dict: ``{"rope_type": "default"}`` or
        ``{"rope_type": "linear", "factor": f}``.
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
        Sequence length for length-dependent frequency schedules.

    Returns
    -------
    q_out, or (q_out, k_out) when k is given
        Arrays of q's type on q's device: for pair ``(x1, x2)`` at angle ``a``,
        ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``.

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
        try:
            scaling = tuple(sorted(scaling.items()))
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
